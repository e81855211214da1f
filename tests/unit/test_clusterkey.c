/*
 * test_clusterkey.c - unit tests of common/clusterkey (the cluster key file
 * format that dsctl writes and dsagent parses, docs/cluster.md "Cluster
 * key"): the round trip, the exact messages of rejected texts, and the
 * accepted set of the key's base64 against the libsodium decoder dsagent
 * used before the format moved to common/.  Names start with clusterkey_.
 */
#include "common/clusterkey.h"
#include "tests/unit/unit.h"

#include <sodium.h>
#include <stdio.h>
#include <string.h>

static void rand_key(uint8_t key[CLUSTERKEY_LEN])
{
	for (int i = 0; i < CLUSTERKEY_LEN; i++)
		key[i] = (uint8_t)ut_rand_u64();
}

TEST(clusterkey_format_parse_round_trip)
{
	for (int t = 0; t < 200; t++) {
		uint8_t keys[CLUSTERKEY_MAX][CLUSTERKEY_LEN];
		uint8_t ids[CLUSTERKEY_MAX];
		uint8_t base = (uint8_t)ut_rand_u64();
		int n = 1 + (int)(ut_rand_u64() % CLUSTERKEY_MAX);
		char text[512] = "";
		size_t len = 0;
		for (int i = 0; i < n; i++) {
			rand_key(keys[i]);
			ids[i] = (uint8_t)(base + 61 * i); /* distinct */
			char line[CLUSTERKEY_LINE_MAX];
			CHECK_EQ(clusterkey_format(ids[i], keys[i], line, sizeof line, NULL), DS_OK);
			CHECK_EQ(strlen(line), 54); /* dsck1:xx: + 44 + newline */
			CHECK_EQ(line[53], '\n');
			/* what libsodium writes for the same bytes */
			char b64[64];
			sodium_bin2base64(b64, sizeof b64, keys[i], CLUSTERKEY_LEN,
					  sodium_base64_VARIANT_ORIGINAL);
			CHECK(memcmp(line + 9, b64, 44) == 0);
			if (t % 3 == 0) /* comments and blank lines are skipped */
				len += (size_t)snprintf(text + len, sizeof text - len, "# key %d\n\n", i);
			len += (size_t)snprintf(text + len, sizeof text - len, "%s", line);
		}
		clusterkey_ring r;
		ds_err e = {0};
		CHECK_EQ(clusterkey_parse(text, len, &r, &e), DS_OK);
		CHECK_EQ(r.n, n);
		for (int i = 0; i < n && i < r.n; i++) {
			CHECK_EQ(r.id[i], ids[i]);
			CHECK(memcmp(r.key[i], keys[i], CLUSTERKEY_LEN) == 0);
		}
		clusterkey_wipe(&r);
		CHECK_EQ(r.n, 0);
	}
}

TEST(clusterkey_raw_file_and_spaces)
{
	uint8_t key[CLUSTERKEY_LEN];
	rand_key(key);
	clusterkey_ring r;
	CHECK_EQ(clusterkey_parse((const char *)key, sizeof key, &r, NULL), DS_OK);
	CHECK_EQ(r.n, 1);
	CHECK_EQ(r.id[0], 0);
	CHECK(memcmp(r.key[0], key, sizeof key) == 0);
	char line[CLUSTERKEY_LINE_MAX], text[256];
	CHECK_EQ(clusterkey_format(0xA7, key, line, sizeof line, NULL), DS_OK);
	line[53] = '\0';
	/* spaces, tabs and CRs around a line; an upper-case id */
	int n = snprintf(text, sizeof text, " \tdsck1:A7:%s\r\n", line + 9);
	CHECK_EQ(clusterkey_parse(text, (size_t)n, &r, NULL), DS_OK);
	CHECK_EQ(r.n, 1);
	CHECK_EQ(r.id[0], 0xa7);
	CHECK(memcmp(r.key[0], key, sizeof key) == 0);
	/* a short buffer */
	ds_err e = {0};
	CHECK_EQ(clusterkey_format(1, key, line, 20, &e), DS_EINVAL);
}

TEST(clusterkey_rejected_texts)
{
	uint8_t key[CLUSTERKEY_LEN];
	rand_key(key);
	char good[CLUSTERKEY_LINE_MAX], good2[CLUSTERKEY_LINE_MAX];
	CHECK_EQ(clusterkey_format(0x01, key, good, sizeof good, NULL), DS_OK);
	rand_key(key);
	CHECK_EQ(clusterkey_format(0x02, key, good2, sizeof good2, NULL), DS_OK);
	char b64[48];
	memcpy(b64, good + 9, 44);
	b64[44] = '\0';
	char text[1024], want[512];
	enum { NOT_KEY, NOT_B64 };
	const struct {
		const char *head, *tail; /* the text is head + good's base64 + tail */
		int b64;                 /* 0: the text is head alone */
		int line, msg;
	} cases[] = {
		{.head = "dsck1:a7\n", .line = 1, .msg = NOT_KEY},
		{.head = "dsck2:a7:", .b64 = 1, .tail = "\n", .line = 1, .msg = NOT_KEY},
		{.head = "# c\ndsck1:g7:", .b64 = 1, .tail = "\n", .line = 2, .msg = NOT_KEY},
		{.head = "dsck1:a7-", .b64 = 1, .tail = "\n", .line = 1, .msg = NOT_KEY},
		{.head = "hello world\n", .line = 1, .msg = NOT_KEY},
		{.head = "dsck1:a7:not base64!\n", .line = 1, .msg = NOT_B64},
		{.head = "\n\ndsck1:a7:", .b64 = 1, .tail = "=\n", .line = 3, .msg = NOT_B64},
		{.head = "dsck1:a7:", .b64 = 1, .tail = " x\n", .line = 1, .msg = NOT_B64},
		{.head = "dsck1:a7:AAAAAAAAAAAAAAAAAAAAAA==\n", .line = 1, .msg = NOT_B64}, /* 16 B */
	};
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		clusterkey_ring r;
		ds_err e = {0};
		int n = snprintf(text, sizeof text, "%s%s%s", cases[i].head, cases[i].b64 ? b64 : "",
				 cases[i].b64 ? cases[i].tail : "");
		if (cases[i].msg == NOT_KEY)
			snprintf(want, sizeof want,
				 "line %d is not a cluster key (expected dsck1:<key id, 2 hex "
				 "digits>:<base64 of 32 bytes>; make one with `dsctl cluster init`)",
				 cases[i].line);
		else
			snprintf(want, sizeof want,
				 "line %d: the key is not 32 bytes in standard base64", cases[i].line);
		CHECK_EQ(clusterkey_parse(text, (size_t)n, &r, &e), DS_EFORMAT);
		CHECK_STR(e.msg, want);
		CHECK_EQ(r.n, 0);
		CHECK(strstr(e.msg, b64) == NULL);
	}
	/* no key at all; 31 raw bytes; a duplicate id; five keys */
	ds_err e = {0};
	clusterkey_ring r;
	CHECK_EQ(clusterkey_parse("# only a comment\n\n", 18, &r, &e), DS_EFORMAT);
	CHECK_STR(e.msg, "no key in it (expected 32 raw bytes or lines dsck1:<key id>:<base64 "
			 "key>; make one with `dsctl cluster init`)");
	CHECK_EQ(clusterkey_parse((const char *)key, 31, &r, &e), DS_EFORMAT);
	int n = snprintf(text, sizeof text, "%s%s", good, good);
	CHECK_EQ(clusterkey_parse(text, (size_t)n, &r, &e), DS_EFORMAT);
	CHECK_STR(e.msg, "line 2: key id 01 appears twice");
	CHECK_EQ(r.n, 0);
	n = 0;
	for (int i = 1; i <= 5; i++) {
		char line[CLUSTERKEY_LINE_MAX];
		CHECK_EQ(clusterkey_format((uint8_t)(0x10 + i), key, line, sizeof line, NULL), DS_OK);
		n += snprintf(text + n, sizeof text - (size_t)n, "%s", line);
	}
	CHECK_EQ(clusterkey_parse(text, (size_t)n, &r, &e), DS_EFORMAT);
	CHECK_STR(e.msg, "more than 4 keys");
	CHECK_EQ(r.n, 0);
}

/* The rule dsagent applied before (libsodium, standard variant): accepted
 * when the text decodes to exactly 32 bytes and nothing is left over. */
static int sodium_accepts(const char *s, size_t n)
{
	uint8_t key[CLUSTERKEY_LEN + 1];
	size_t kl = 0;
	const char *end = NULL;
	return sodium_base642bin(key, sizeof key, s, n, NULL, &kl, &end,
				 sodium_base64_VARIANT_ORIGINAL) == 0 &&
	       end == s + n && kl == CLUSTERKEY_LEN;
}

TEST(clusterkey_base64_accepts_what_libsodium_did)
{
	static const char alpha[] =
		"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_ ";
	uint8_t key[CLUSTERKEY_LEN];
	int accepted = 0;
	for (int t = 0; t < 20000; t++) {
		char line[CLUSTERKEY_LINE_MAX + 16];
		rand_key(key);
		CHECK_EQ(clusterkey_format(0x5c, key, line, CLUSTERKEY_LINE_MAX, NULL), DS_OK);
		char *b = line + 9;
		size_t n = 44;
		/* mutate: a character, the length, the padding, the trailing bits */
		switch (ut_rand_u64() % 6) {
		case 0:
			b[ut_rand_u64() % n] = alpha[ut_rand_u64() % (sizeof alpha - 1)];
			break;
		case 1:
			n = 40 + (size_t)(ut_rand_u64() % 9);
			memset(b + 44, 'A', 8);
			break;
		case 2:
			b[43] = alpha[ut_rand_u64() % (sizeof alpha - 1)];
			break;
		case 3:
			b[42] = alpha[ut_rand_u64() % 64];
			break;
		default:
			break;
		}
		b[n] = '\n';
		int want = sodium_accepts(b, n);
		clusterkey_ring r;
		int got = clusterkey_parse(line, 9 + n + 1, &r, NULL) == DS_OK;
		if (want != got)
			ut_fail(__FILE__, __LINE__, "'%.*s': libsodium %d, clusterkey %d", (int)n, b,
				want, got);
		accepted += got;
		if (got)
			clusterkey_wipe(&r);
	}
	CHECK(accepted > 1000);
}
