/*
 * strutil.h - strict number parsing and bounded string copies.
 *
 * These replace atoi/atof/strcpy (banned by `make check`): a parse either
 * consumes the whole string and lands inside [min, max], or fails with
 * DS_EINVAL / DS_ERANGE and leaves *out untouched.
 */
#ifndef DS_STRUTIL_H
#define DS_STRUTIL_H

#include <stddef.h>
#include <stdint.h>

int ds_parse_i64(const char *s, int64_t min, int64_t max, int64_t *out);
int ds_parse_int(const char *s, int min, int max, int *out);
int ds_parse_double(const char *s, double min, double max, double *out);
/* true/false, yes/no, on/off, 1/0 (case-insensitive). */
int ds_parse_bool(const char *s, int *out);

/* Parses "1,2,3" into out (at most cap values); *n gets the count. */
int ds_parse_i64_list(const char *s, int64_t min, int64_t max, int64_t *out, size_t cap, size_t *n);

/* Copies at most size-1 bytes and always terminates; returns strlen(src)
 * (so truncation is `ret >= size`). */
size_t ds_strlcpy(char *dst, const char *src, size_t size);

/* Monotonic and wall clocks in seconds / nanoseconds. */
double ds_now_s(void);
/* Sleeps ms milliseconds (resumed after a signal). */
void ds_sleep_ms(long ms);
uint64_t ds_now_ns(void);

#endif
