/*
 * unit.h - the tiny C unit-test runner.
 *
 *     TEST(buf_caps_at_max) {
 *         buf b; buf_init(&b, 4);
 *         CHECK_EQ(buf_puts(&b, "hello"), DS_ERANGE);
 *         buf_free(&b);
 *     }
 *
 * TEST registers itself at load time (constructor); the runner (unit_main.c)
 * runs every test, or those whose name contains argv[1], and closes with one
 * line "unit: N passed, N failed, N skipped".  A CHECK failure marks the test
 * failed, prints file:line and the expression, and the test goes on.  A test
 * that cannot run here (a missing data file) calls UT_SKIP("reason") and is
 * counted as skipped, never as passed.  Each test's random numbers are seeded
 * from a hash of its name, so adding a test changes no other test's inputs.
 */
#ifndef DS_TESTS_UNIT_H
#define DS_TESTS_UNIT_H

#include <math.h>
#include <stdint.h>

typedef void (*ut_fn)(void);
void ut_register(const char *name, ut_fn fn);
void ut_fail(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Marks the running test skipped (reason printed); the caller returns. */
void ut_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#define UT_SKIP(...)                                                             \
	do {                                                                     \
		ut_skip(__VA_ARGS__);                                            \
		return;                                                          \
	} while (0)

/* A new empty directory under $TMPDIR (or /tmp), named ds-TAG-XXXXXX; NULL
 * after reporting a failure of the test.  ut_tmpdir_free removes it with all
 * it holds and frees the string (NULL is a no-op). */
char *ut_tmpdir_new(const char *tag);
void ut_tmpdir_free(char *dir);

/* Deterministic random numbers for tests: xorshift64*, seeded per test. */
uint64_t ut_rand_u64(void);
float ut_rand_float(float lo, float hi);

#define TEST(name)                                                               \
	static void name(void);                                                  \
	__attribute__((constructor)) static void ut_reg_##name(void)             \
	{                                                                        \
		ut_register(#name, name);                                        \
	}                                                                        \
	static void name(void)

#define CHECK(cond)                                                              \
	do {                                                                     \
		if (!(cond))                                                     \
			ut_fail(__FILE__, __LINE__, "CHECK(%s)", #cond);         \
	} while (0)

#define CHECK_EQ(a, b)                                                           \
	do {                                                                     \
		long long ut_a = (long long)(a), ut_b = (long long)(b);          \
		if (ut_a != ut_b)                                                \
			ut_fail(__FILE__, __LINE__, "%s == %s: %lld != %lld", #a, #b, \
				ut_a, ut_b);                                     \
	} while (0)

#define CHECK_STR(a, b)                                                          \
	do {                                                                     \
		const char *ut_a = (a), *ut_b = (b);                             \
		if (!ut_a || !ut_b || strcmp(ut_a, ut_b) != 0)                   \
			ut_fail(__FILE__, __LINE__, "%s == %s: \"%s\" != \"%s\"", #a, \
				#b, ut_a ? ut_a : "(null)", ut_b ? ut_b : "(null)"); \
	} while (0)

#define CHECK_NEAR(a, b, tol)                                                    \
	do {                                                                     \
		double ut_a = (double)(a), ut_b = (double)(b);                   \
		if (!(fabs(ut_a - ut_b) <= (tol)))                               \
			ut_fail(__FILE__, __LINE__, "%s ~= %s: %.9g vs %.9g (tol %g)", \
				#a, #b, ut_a, ut_b, (double)(tol));              \
	} while (0)

#endif
