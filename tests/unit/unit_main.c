/*
 * unit_main.c - runner for the C unit tier (see unit.h).
 * Usage: unit [SUBSTRING]  - runs the tests whose name contains SUBSTRING.
 */
#include "tests/unit/unit.h"
#include "common/log.h"

#include <ftw.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define MAX_TESTS 4096

static struct {
	const char *name;
	ut_fn fn;
} tests[MAX_TESTS];
static int n_tests;
static int cur_failed, cur_skipped;
static uint64_t rng_state;

void ut_register(const char *name, ut_fn fn)
{
	if (n_tests == MAX_TESTS) {
		fprintf(stderr, "unit: more than %d tests; raise MAX_TESTS\n", MAX_TESTS);
		exit(2);
	}
	tests[n_tests].name = name;
	tests[n_tests].fn = fn;
	n_tests++;
}

void ut_fail(const char *file, int line, const char *fmt, ...)
{
	va_list ap;
	cur_failed = 1;
	fprintf(stderr, "    %s:%d: ", file, line);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

void ut_skip(const char *fmt, ...)
{
	va_list ap;
	cur_skipped = 1;
	fprintf(stderr, "    skipped: ");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

char *ut_tmpdir_new(const char *tag)
{
	const char *base = getenv("TMPDIR");
	char tmpl[512];
	snprintf(tmpl, sizeof tmpl, "%s/ds-%s-XXXXXX", base && *base ? base : "/tmp", tag);
	char *d = mkdtemp(tmpl);
	char *r = d ? strdup(d) : NULL;
	if (!r)
		ut_fail(__FILE__, __LINE__, "mkdtemp %s failed", tmpl);
	return r;
}

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
	(void)sb;
	(void)flag;
	(void)ftw;
	return remove(p);
}

void ut_tmpdir_free(char *dir)
{
	if (dir)
		nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
	free(dir);
}

/* FNV-1a of the test's name: the seed does not depend on the test's position. */
static uint64_t name_hash(const char *s)
{
	uint64_t h = 0xcbf29ce484222325ull;
	for (; *s; s++)
		h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
	return h ? h : 1;
}

uint64_t ut_rand_u64(void)
{
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return rng_state * 0x2545F4914F6CDD1Dull;
}

float ut_rand_float(float lo, float hi)
{
	return lo + (hi - lo) * (float)((ut_rand_u64() >> 40) * (1.0 / 16777216.0));
}

static int by_name(const void *a, const void *b)
{
	return strcmp(*(const char *const *)a, *(const char *const *)b);
}

int main(int argc, char **argv)
{
	const char *filter = argc > 1 ? argv[1] : NULL;
	int passed = 0, failed = 0, skipped = 0;
	/* The modules under test log as they would in the agent; the runner's
	 * output is the test lines.  DS_LOG_LEVEL=info shows them. */
	if (!getenv("DS_LOG_LEVEL"))
		log_set_level(LOG_OFF);
	qsort(tests, (size_t)n_tests, sizeof tests[0], by_name);
	for (int i = 0; i < n_tests; i++) {
		if (filter && !strstr(tests[i].name, filter))
			continue;
		cur_failed = cur_skipped = 0;
		rng_state = name_hash(tests[i].name);
		tests[i].fn();
		printf("%s %s\n", cur_failed ? "FAIL" : cur_skipped ? "skip" : "ok  ", tests[i].name);
		fflush(stdout);
		if (cur_failed)
			failed++;
		else if (cur_skipped)
			skipped++;
		else
			passed++;
	}
	printf("unit: %d passed, %d failed, %d skipped\n", passed, failed, skipped);
	return failed ? 1 : 0;
}
