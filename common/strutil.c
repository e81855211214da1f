/*
 * strutil.c - strict parsing, bounded copies, clocks (see strutil.h).
 * Pure functions; thread-safe.
 */
#include "common/strutil.h"
#include "common/status.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

int ds_parse_i64(const char *s, int64_t min, int64_t max, int64_t *out)
{
	if (!s || !*s || isspace((unsigned char)*s))
		return DS_EINVAL;
	char *end = NULL;
	errno = 0;
	long long v = strtoll(s, &end, 10);
	if (errno == ERANGE)
		return DS_ERANGE;
	if (end == s || *end != '\0')
		return DS_EINVAL;
	if (v < min || v > max)
		return DS_ERANGE;
	*out = (int64_t)v;
	return DS_OK;
}

int ds_parse_int(const char *s, int min, int max, int *out)
{
	int64_t v;
	int rc = ds_parse_i64(s, min, max, &v);
	if (rc == DS_OK)
		*out = (int)v;
	return rc;
}

int ds_parse_double(const char *s, double min, double max, double *out)
{
	if (!s || !*s || isspace((unsigned char)*s))
		return DS_EINVAL;
	char *end = NULL;
	errno = 0;
	double v = strtod(s, &end);
	if (end == s || *end != '\0' || isnan(v))
		return DS_EINVAL;
	if (errno == ERANGE || v < min || v > max)
		return DS_ERANGE;
	*out = v;
	return DS_OK;
}

int ds_parse_bool(const char *s, int *out)
{
	static const char *yes[] = {"1", "true", "yes", "on"};
	static const char *no[] = {"0", "false", "no", "off"};
	if (!s)
		return DS_EINVAL;
	for (size_t i = 0; i < 4; i++) {
		if (strcasecmp(s, yes[i]) == 0) {
			*out = 1;
			return DS_OK;
		}
		if (strcasecmp(s, no[i]) == 0) {
			*out = 0;
			return DS_OK;
		}
	}
	return DS_EINVAL;
}

int ds_parse_i64_list(const char *s, int64_t min, int64_t max, int64_t *out, size_t cap, size_t *n)
{
	size_t count = 0;
	const char *p = s;
	char item[32];
	if (!s || !*s)
		return DS_EINVAL;
	for (;;) {
		const char *comma = strchr(p, ',');
		size_t len = comma ? (size_t)(comma - p) : strlen(p);
		if (len == 0 || len >= sizeof item)
			return DS_EINVAL;
		memcpy(item, p, len);
		item[len] = '\0';
		if (count == cap)
			return DS_ERANGE;
		int rc = ds_parse_i64(item, min, max, &out[count]);
		if (rc)
			return rc;
		count++;
		if (!comma)
			break;
		p = comma + 1;
	}
	*n = count;
	return DS_OK;
}

size_t ds_strlcpy(char *dst, const char *src, size_t size)
{
	size_t n = strlen(src);
	if (size) {
		size_t c = n < size - 1 ? n : size - 1;
		memcpy(dst, src, c);
		dst[c] = '\0';
	}
	return n;
}

void ds_sleep_ms(long ms)
{
	struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
	while (nanosleep(&ts, &ts) != 0)
		;
}

double ds_now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

uint64_t ds_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
