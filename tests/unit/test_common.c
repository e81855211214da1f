/*
 * test_common.c - unit tests of common/: status, buf, strutil, jsonx,
 * config, log level parsing, fileutil, hex.
 */
#include "common/buf.h"
#include "common/config.h"
#include "common/fileutil.h"
#include "common/hex.h"
#include "common/jsonx.h"
#include "common/log.h"
#include "common/status.h"
#include "common/strutil.h"
#include "tests/unit/unit.h"

#include <dirent.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

TEST(status_set_and_wrap)
{
	ds_err e = {0};
	CHECK_EQ(ds_err_set(&e, DS_ENOTFOUND, "tensor %s", "w1"), DS_ENOTFOUND);
	CHECK_EQ(ds_err_wrap(&e, "loading %s", "model"), DS_ENOTFOUND);
	CHECK_STR(e.msg, "loading model: tensor w1");
	CHECK_STR(ds_status_name(DS_EFORMAT), "EFORMAT");
	CHECK_EQ(ds_err_set(NULL, DS_EINVAL, "x"), DS_EINVAL);
	ds_err_clear(&e);
	CHECK_EQ(e.code, DS_OK);
	CHECK_STR(e.msg, "");
}

TEST(buf_caps_at_max_and_keeps_content)
{
	buf b;
	buf_init(&b, 8);
	CHECK_EQ(buf_puts(&b, "abcd"), DS_OK);
	CHECK_EQ(buf_printf(&b, "%d", 1234), DS_OK);
	CHECK_EQ(b.len, 8);
	CHECK_EQ(buf_puts(&b, "x"), DS_ERANGE);
	CHECK_EQ(buf_printf(&b, "%s", "yz"), DS_ERANGE);
	CHECK_STR(b.data, "abcd1234");
	char *s = buf_take(&b);
	CHECK_STR(s, "abcd1234");
	CHECK(b.data == NULL && b.len == 0);
	free(s);
	buf_free(&b);
}

TEST(buf_grows_past_first_allocation)
{
	buf b;
	buf_init(&b, 0);
	for (int i = 0; i < 1000; i++)
		CHECK_EQ(buf_printf(&b, "%04d", i), DS_OK);
	CHECK_EQ(b.len, 4000);
	CHECK(memcmp(b.data + 3996, "0999", 4) == 0);
	CHECK_EQ(b.data[b.len], '\0');
	buf_free(&b);
}

TEST(strutil_parse_is_strict)
{
	int v = 7;
	CHECK_EQ(ds_parse_int("42", 0, 100, &v), DS_OK);
	CHECK_EQ(v, 42);
	CHECK_EQ(ds_parse_int("42x", 0, 100, &v), DS_EINVAL);
	CHECK_EQ(ds_parse_int(" 4", 0, 100, &v), DS_EINVAL);
	CHECK_EQ(ds_parse_int("", 0, 100, &v), DS_EINVAL);
	CHECK_EQ(ds_parse_int("101", 0, 100, &v), DS_ERANGE);
	CHECK_EQ(ds_parse_int("99999999999999999999", 0, 100, &v), DS_ERANGE);
	CHECK_EQ(v, 42);
	double d = 0;
	CHECK_EQ(ds_parse_double("0.25", 0, 1, &d), DS_OK);
	CHECK_NEAR(d, 0.25, 0);
	CHECK_EQ(ds_parse_double("nan", -1, 1, &d), DS_EINVAL);
	CHECK_EQ(ds_parse_double("2", 0, 1, &d), DS_ERANGE);
	int b = -1;
	CHECK_EQ(ds_parse_bool("Yes", &b), DS_OK);
	CHECK_EQ(b, 1);
	CHECK_EQ(ds_parse_bool("off", &b), DS_OK);
	CHECK_EQ(b, 0);
	CHECK_EQ(ds_parse_bool("maybe", &b), DS_EINVAL);
	int64_t ids[4];
	size_t n = 0;
	CHECK_EQ(ds_parse_i64_list("1,2,30", 0, 100, ids, 4, &n), DS_OK);
	CHECK_EQ(n, 3);
	CHECK_EQ(ids[2], 30);
	CHECK_EQ(ds_parse_i64_list("1,,2", 0, 100, ids, 4, &n), DS_EINVAL);
	CHECK_EQ(ds_parse_i64_list("1,2,3,4,5", 0, 100, ids, 4, &n), DS_ERANGE);
	char small[4];
	CHECK_EQ(ds_strlcpy(small, "abcdef", sizeof small), 6);
	CHECK_STR(small, "abc");
}

TEST(jsonx_depth_limit_and_getters)
{
	ds_err e = {0};
	const char *nested = "{\"a\":[1,{\"b\":\"[[[\"}]}";
	CHECK_EQ(jsonx_depth(nested, strlen(nested)), 3);
	CHECK_EQ(jsonx_depth("[[", 2), -1);
	char deep[2101];
	for (int i = 0; i < 1050; i++) {
		deep[i] = '[';
		deep[2099 - i] = ']';
	}
	deep[2100] = '\0';
	CHECK(jsonx_parse(deep, 2100, 64, &e) == NULL);
	CHECK_EQ(e.code, DS_ERANGE);
	CHECK(strstr(e.msg, "1050") != NULL);
	CHECK(jsonx_parse("{\"a\":", 5, 64, &e) == NULL);
	CHECK_EQ(e.code, DS_EFORMAT);
	CHECK(strstr(e.msg, "column") != NULL);

	const char *txt = "{\"n\":5,\"f\":0.5,\"s\":\"x\",\"b\":true,\"r\":2.0,\"z\":null}";
	json_t *v = jsonx_parse(txt, strlen(txt), 8, &e);
	CHECK(v != NULL);
	int64_t n = -1;
	CHECK_EQ(jsonx_get_i64(v, "n", 1, 0, 10, &n, &e), DS_OK);
	CHECK_EQ(n, 5);
	CHECK_EQ(jsonx_get_i64(v, "r", 1, 0, 10, &n, &e), DS_OK); /* 2.0 is an integer */
	CHECK_EQ(n, 2);
	CHECK_EQ(jsonx_get_i64(v, "f", 1, 0, 10, &n, &e), DS_EINVAL);
	CHECK(strstr(e.msg, "'f'") != NULL);
	CHECK_EQ(jsonx_get_i64(v, "n", 1, 6, 10, &n, &e), DS_EINVAL);
	CHECK(strstr(e.msg, "[6, 10]") != NULL);
	n = 77;
	CHECK_EQ(jsonx_get_i64(v, "missing", 0, 0, 10, &n, &e), DS_OK);
	CHECK_EQ(jsonx_get_i64(v, "z", 0, 0, 10, &n, &e), DS_OK); /* null = absent */
	CHECK_EQ(n, 77);
	CHECK_EQ(jsonx_get_i64(v, "missing", 1, 0, 10, &n, &e), DS_EINVAL);
	CHECK(strstr(e.msg, "required") != NULL);
	const char *s = NULL;
	CHECK_EQ(jsonx_get_str(v, "s", 1, &s, &e), DS_OK);
	CHECK_STR(s, "x");
	CHECK_EQ(jsonx_get_str(v, "n", 1, &s, &e), DS_EINVAL);
	double d = 0;
	CHECK_EQ(jsonx_get_double(v, "f", 1, 0, 1, &d, &e), DS_OK);
	CHECK_NEAR(d, 0.5, 0);
	int b = 0;
	CHECK_EQ(jsonx_get_bool(v, "b", 1, &b, &e), DS_OK);
	CHECK_EQ(b, 1);
	char *out = jsonx_dumps(v);
	CHECK(out && !strchr(out, ' ') && !strchr(out, '\n'));
	free(out);
	json_decref(v);
}

struct tcfg {
	char *name;
	int port;
	int64_t big;
	double ratio;
	int flag;
};

static const cfg_opt topts[] = {
	{"name", CFG_STR, offsetof(struct tcfg, name), "def", 1, 0, "a name"},
	{"port", CFG_INT, offsetof(struct tcfg, port), "8000", 1, 65535, "a port"},
	{"big", CFG_I64, offsetof(struct tcfg, big), "5000000000", 1, 0, "unbounded"},
	{"ratio", CFG_DOUBLE, offsetof(struct tcfg, ratio), "0.5", 0, 1, "a ratio"},
	{"flag", CFG_BOOL, offsetof(struct tcfg, flag), "false", 1, 0, "a flag"},
	{0},
};

TEST(config_precedence_file_env_flags)
{
	char path[] = "/tmp/ds-unit-cfg-XXXXXX";
	int fd = mkstemp(path);
	CHECK(fd >= 0);
	FILE *f = fdopen(fd, "w");
	fprintf(f, "# comment\nname = \"from file\"\nport = 9000\nratio=0.25 # trailing\n");
	fclose(f);
	setenv("DSUT_PORT", "9100", 1);
	char cfgflag[64];
	snprintf(cfgflag, sizeof cfgflag, "--config=%s", path);
	char *argv[] = {"prog", cfgflag, "--flag", "--big", "7", "rest", NULL};
	struct tcfg c;
	ds_err e = {0};
	int next = 0;
	CHECK_EQ(cfg_load(topts, &c, "DSUT", 6, argv, 1, &next, &e), DS_OK);
	CHECK_STR(c.name, "from file");   /* file over default */
	CHECK_EQ(c.port, 9100);            /* env over file */
	CHECK_NEAR(c.ratio, 0.25, 0);
	CHECK_EQ(c.flag, 1);               /* flag */
	CHECK_EQ(c.big, 7);
	CHECK_EQ(next, 5);                 /* stopped at the positional */
	char v[64];
	CHECK_EQ(cfg_get(topts, &c, "port", v, sizeof v), DS_OK);
	CHECK_STR(v, "9100");
	CHECK_EQ(cfg_get(topts, &c, "nope", v, sizeof v), DS_ENOTFOUND);
	cfg_free(topts, &c);
	unsetenv("DSUT_PORT");
	unlink(path);
}

TEST(config_no_flag_sets_a_boolean_false)
{
	struct tcfg c;
	ds_err e = {0};
	char *a1[] = {"prog", "--flag", "--no-flag", NULL}; /* the later one wins */
	CHECK_EQ(cfg_load(topts, &c, "DSUT", 3, a1, 1, NULL, &e), DS_OK);
	CHECK_EQ(c.flag, 0);
	cfg_free(topts, &c);
	char *a2[] = {"prog", "--no-flag", "--flag", NULL};
	CHECK_EQ(cfg_load(topts, &c, "DSUT", 3, a2, 1, NULL, &e), DS_OK);
	CHECK_EQ(c.flag, 1);
	cfg_free(topts, &c);
	/* only booleans have a --no- form, and it takes no value */
	char *a3[] = {"prog", "--no-port", NULL};
	CHECK_EQ(cfg_load(topts, &c, "DSUT", 2, a3, 1, NULL, &e), DS_EINVAL);
	CHECK(strstr(e.msg, "--no-port") != NULL);
	cfg_free(topts, &c);
	char *a4[] = {"prog", "--no-flag=true", NULL};
	CHECK_EQ(cfg_load(topts, &c, "DSUT", 2, a4, 1, NULL, &e), DS_EINVAL);
	CHECK(strstr(e.msg, "--no-flag") != NULL);
	cfg_free(topts, &c);
}

TEST(config_rejects_bad_values_with_names)
{
	struct tcfg c;
	ds_err e = {0};
	char *a1[] = {"prog", "--port", "70000", NULL};
	CHECK_EQ(cfg_load(topts, &c, "DSUT", 3, a1, 1, NULL, &e), DS_EINVAL);
	CHECK(strstr(e.msg, "--port=70000") && strstr(e.msg, "range"));
	cfg_free(topts, &c);
	char *a2[] = {"prog", "--colour", "red", NULL};
	CHECK_EQ(cfg_load(topts, &c, "DSUT", 3, a2, 1, NULL, &e), DS_EINVAL);
	CHECK(strstr(e.msg, "--colour") != NULL);
	cfg_free(topts, &c);
	char *a3[] = {"prog", "--port", NULL};
	CHECK_EQ(cfg_load(topts, &c, "DSUT", 2, a3, 1, NULL, &e), DS_EINVAL);
	CHECK(strstr(e.msg, "needs a value") != NULL);
	cfg_free(topts, &c);
	char *a4[] = {"prog", "--flag=perhaps", NULL};
	CHECK_EQ(cfg_load(topts, &c, "DSUT", 2, a4, 1, NULL, &e), DS_EINVAL);
	CHECK(strstr(e.msg, "boolean") != NULL);
	cfg_free(topts, &c);
	setenv("DSUT_RATIO", "abc", 1);
	char *a5[] = {"prog", NULL};
	CHECK_EQ(cfg_load(topts, &c, "DSUT", 1, a5, 1, NULL, &e), DS_EINVAL);
	CHECK(strstr(e.msg, "DSUT_RATIO") != NULL);
	unsetenv("DSUT_RATIO");
	cfg_free(topts, &c);
	char path[] = "/tmp/ds-unit-cfg-XXXXXX";
	int fd = mkstemp(path);
	FILE *f = fdopen(fd, "w");
	fprintf(f, "port = 1\nbogus = 3\n");
	fclose(f);
	CHECK_EQ(cfg_defaults(topts, &c, &e), DS_OK);
	CHECK_EQ(cfg_load_file(topts, &c, path, &e), DS_EINVAL);
	CHECK(strstr(e.msg, ":2") && strstr(e.msg, "bogus"));
	cfg_free(topts, &c);
	unlink(path);
	CHECK_EQ(cfg_load_file(topts, &c, "/nonexistent/x.conf", &e), DS_ENOTFOUND);
	CHECK(strstr(e.msg, "/nonexistent/x.conf") != NULL);
}

TEST(log_level_parse_names)
{
	enum log_level lv = LOG_INFO;
	CHECK_EQ(log_level_parse("warn", &lv), DS_OK);
	CHECK_EQ(lv, LOG_WARN);
	CHECK_EQ(log_level_parse("DEBUG", &lv), DS_OK);
	CHECK_EQ(lv, LOG_DEBUG);
	CHECK_EQ(log_level_parse("loud", &lv), DS_EINVAL);
	enum log_level old = log_get_level();
	log_set_level(LOG_ERROR);
	CHECK_EQ(log_get_level(), LOG_ERROR);
	log_set_level(old);
}

/* ---- fileutil: whole reads under a cap, atomic private writes; hex ---- */

TEST(file_read_all_caps_and_never_truncates)
{
	char *dir = ut_tmpdir_new("file");
	if (!dir)
		return;
	char path[600], *data = NULL;
	size_t len = 0;
	ds_err err = {0};
	snprintf(path, sizeof path, "%s/f.json", dir);
	CHECK_EQ(ds_file_read_all(path, 64, &data, &len, &err), DS_ENOTFOUND);
	CHECK(strstr(err.msg, "f.json") != NULL);
	char text[200];
	for (size_t i = 0; i < sizeof text; i++)
		text[i] = (char)('a' + ut_rand_u64() % 26);
	CHECK_EQ(ds_file_write_private(path, text, sizeof text, 0, &err), DS_OK);
	CHECK_EQ(ds_file_read_all(path, sizeof text, &data, &len, &err), DS_OK);
	CHECK_EQ(len, sizeof text);
	CHECK(data && memcmp(data, text, sizeof text) == 0 && data[len] == '\0');
	free(data);
	data = NULL;
	/* one byte over the cap: an error naming the size, not the first 199 bytes */
	CHECK_EQ(ds_file_read_all(path, sizeof text - 1, &data, &len, &err), DS_ERANGE);
	CHECK(data == NULL);
	CHECK(strstr(err.msg, "200 bytes") != NULL);
	CHECK_EQ(ds_file_read_all(dir, 1 << 20, &data, &len, &err), DS_EPERM); /* a directory */
	ut_tmpdir_free(dir);
}

TEST(file_write_private_is_0600_atomic_and_exclusive)
{
	char *dir = ut_tmpdir_new("file");
	if (!dir)
		return;
	char path[600], text[64];
	size_t len = 0;
	ds_err err = {0};
	snprintf(path, sizeof path, "%s/secret", dir);
	mode_t old = umask(0); /* the mode must not depend on the umask */
	CHECK_EQ(ds_file_write_private(path, "one\n", 4, DS_WRITE_EXCL, &err), DS_OK);
	umask(old);
	struct stat st;
	CHECK(stat(path, &st) == 0 && (st.st_mode & 0777) == 0600);
	/* exclusive: a second create is DS_EBUSY and leaves the first file */
	CHECK_EQ(ds_file_write_private(path, "two\n", 4, DS_WRITE_EXCL, &err), DS_EBUSY);
	CHECK_EQ(ds_file_read_small(path, DS_FILE_PRIVATE, text, sizeof text, &len, &err), DS_OK);
	CHECK(len == 4 && memcmp(text, "one\n", 4) == 0);
	/* replace */
	CHECK_EQ(ds_file_write_private(path, "three\n", 6, 0, &err), DS_OK);
	CHECK_EQ(ds_file_read_small(path, DS_FILE_PRIVATE, text, sizeof text, &len, &err), DS_OK);
	CHECK(len == 6 && memcmp(text, "three\n", 6) == 0);
	/* no temporary file is left beside it */
	DIR *d = opendir(dir);
	int entries = 0;
	for (struct dirent *e; d && (e = readdir(d));)
		entries += e->d_name[0] != '.';
	if (d)
		closedir(d);
	CHECK_EQ(entries, 1);
	/* a directory that does not exist: an error naming the step, nothing created */
	snprintf(path, sizeof path, "%s/no/such/secret", dir);
	CHECK_EQ(ds_file_write_private(path, "x", 1, 0, &err), DS_EIO);
	CHECK(strstr(err.msg, "cannot create") != NULL);
	ut_tmpdir_free(dir);
}

/* The VmFlags of the /proc/self/smaps region holding p into flags ("" if none). */
static void smaps_flags(const void *p, char *flags, size_t cap)
{
	FILE *f = fopen("/proc/self/smaps", "r");
	char line[512];
	int inside = 0;
	flags[0] = '\0';
	while (f && fgets(line, sizeof line, f)) {
		unsigned long lo, hi;
		if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' '))
			inside = (uintptr_t)p >= lo && (uintptr_t)p < hi;
		else if (inside && strncmp(line, "VmFlags:", 8) == 0) {
			snprintf(flags, cap, "%s", line + 8);
			break;
		}
	}
	if (f)
		fclose(f);
}

TEST(huge_alloc_advice_follows_thp_and_ds_thp_never)
{
	const char *old = getenv("DS_THP");
	char *saved = old ? strdup(old) : NULL;
	char flags[256];
	size_t len = 0;
	unsetenv("DS_THP");
	int sys = ds_thp_usable();
	char *p = ds_huge_alloc((size_t)3 << 20, &len);
	CHECK(p != NULL && len == ((size_t)4 << 20) && ((uintptr_t)p & (((size_t)2 << 20) - 1)) == 0);
	if (p) {
		smaps_flags(p, flags, sizeof flags);
		CHECK(strstr(flags, " hg") != NULL); /* MADV_HUGEPAGE */
	}
	ds_huge_free(p, len);
	/* DS_THP=never: as if the kernel had none, and the copy advised against them */
	setenv("DS_THP", "never", 1);
	CHECK_EQ(ds_thp_usable(), 0);
	p = ds_huge_alloc((size_t)1 << 20, &len);
	CHECK(p != NULL && len == ((size_t)2 << 20));
	if (p) {
		smaps_flags(p, flags, sizeof flags);
		CHECK(strstr(flags, " nh") != NULL && strstr(flags, " hg") == NULL); /* MADV_NOHUGEPAGE */
	}
	ds_huge_free(p, len);
	/* anything else reads the kernel's setting (and logs that it was ignored) */
	setenv("DS_THP", "off", 1);
	CHECK_EQ(ds_thp_usable(), sys);
	if (saved)
		setenv("DS_THP", saved, 1);
	else
		unsetenv("DS_THP");
	free(saved);
}

/* VmRSS of /proc/self/status in bytes. */
static size_t rss_now(void)
{
	FILE *f = fopen("/proc/self/status", "r");
	char line[256];
	unsigned long long kb = 0;
	while (f && fgets(line, sizeof line, f))
		if (sscanf(line, "VmRSS: %llu kB", &kb) == 1)
			break;
	if (f)
		fclose(f);
	return (size_t)kb * 1024;
}

TEST(peak_rss_is_this_process_high_water_mark)
{
	const size_t n = (size_t)32 << 20;
	char *p = malloc(n);
	CHECK(p != NULL);
	if (!p)
		return;
	memset(p, 1, n); /* resident now (the barrier keeps the stores) */
	__asm__ volatile("" : : "r"(p) : "memory");
	size_t rss = rss_now(), peak = ds_peak_rss_bytes();
	CHECK(rss >= n);
	CHECK(peak >= rss);
	free(p);
	/* a high-water mark stays (the kernel's per-CPU counts may move it by
	 * a few hundred KiB when the mapping goes) */
	CHECK(ds_peak_rss_bytes() + ((size_t)2 << 20) >= peak);
}

TEST(hex_round_trip_random_bytes)
{
	uint8_t in[37], back[37];
	char text[2 * sizeof in + 1];
	for (size_t i = 0; i < sizeof in; i++)
		in[i] = (uint8_t)ut_rand_u64();
	ds_hex_encode(in, sizeof in, text);
	CHECK_EQ(strlen(text), 2 * sizeof in);
	for (size_t i = 0; i < 2 * sizeof in; i++)
		CHECK((text[i] >= '0' && text[i] <= '9') || (text[i] >= 'a' && text[i] <= 'f'));
	CHECK_EQ(ds_hex_decode(text, sizeof in, back), 0);
	CHECK(memcmp(in, back, sizeof in) == 0);
	text[5] = 'g';
	CHECK_EQ(ds_hex_decode(text, sizeof in, back), -1);
	CHECK_EQ(ds_hex_decode("A0fF", 2, back), 0);
	CHECK(back[0] == 0xA0 && back[1] == 0xFF);
}
