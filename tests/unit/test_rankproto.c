/*
 * test_rankproto.c - the launcher <-> rank 0 frames (engine/rankproto.h):
 * header, READY, STEP and STATS records round-trip byte for byte at the
 * documented offsets, and READY from a rank is checked, never trusted.
 */
#include "engine/rankproto.h"
#include "tests/unit/unit.h"

#include <string.h>

TEST(rankproto_header_round_trips_at_its_offsets)
{
	uint8_t b[RANKPROTO_HEADER_BYTES];
	rankproto_header_put(b, RANKPROTO_STATS, 0xABCDu, 77);
	CHECK(memcmp(b, "DSWK", 4) == 0);
	CHECK(b[4] == RANKPROTO_VERSION && b[5] == 0 && b[6] == RANKPROTO_STATS);
	rankproto_header h;
	rankproto_header_get(b, &h);
	CHECK(h.magic == RANKPROTO_MAGIC && h.version == RANKPROTO_VERSION);
	CHECK(h.kind == RANKPROTO_STATS && h.id == 0xABCDu && h.length == 77);
	CHECK(strcmp(rankproto_kind_name(RANKPROTO_STATS_REPLY), "STATS_REPLY") == 0);
	CHECK(strcmp(rankproto_kind_name(99), "unknown") == 0);
}

TEST(rankproto_ready_round_trips_and_is_checked)
{
	rankproto_ready r = {.rank = 0, .world_size = 4, .vocab_size = 1000, .max_batch_tokens = 64,
			     .max_ctx = 128, .page_size = 16, .n_pages = 8, .max_seqs = 2,
			     .max_blocks = 8, .max_payload = 4096, .n_eos = 2, .eos = {1, 999}};
	memcpy(r.arch, "deepseek_v3", 12);
	memcpy(r.backend, "cpu", 4);
	uint8_t b[RANKPROTO_READY_BYTES], bad[RANKPROTO_READY_BYTES];
	rankproto_ready_put(&r, b);
	rankproto_ready got;
	ds_err err = {0};
	CHECK_EQ(rankproto_ready_get(b, sizeof b, &got, &err), DS_OK);
	CHECK(got.world_size == 4 && got.max_payload == 4096 && got.n_eos == 2 && got.eos[1] == 999);
	CHECK(strcmp(got.arch, "deepseek_v3") == 0 && strcmp(got.backend, "cpu") == 0);
	CHECK_EQ(rankproto_ready_get(b, sizeof b - 1, &got, &err), DS_EFORMAT);
	memcpy(bad, b, sizeof b);
	int32_t v = 1000; /* an eos id outside the vocabulary */
	memcpy(bad + 44 + 4, &v, 4);
	CHECK_EQ(rankproto_ready_get(bad, sizeof bad, &got, &err), DS_EFORMAT);
	CHECK(strstr(err.msg, "eos id 1000") != NULL);
	memcpy(bad, b, sizeof b);
	v = 0; /* no pages */
	memcpy(bad + 24, &v, 4);
	CHECK_EQ(rankproto_ready_get(bad, sizeof bad, &got, &err), DS_EFORMAT);
	CHECK(strstr(err.msg, "n_pages") != NULL);
}

TEST(rankproto_step_is_the_documented_layout)
{
	const int32_t tok[3] = {5, 6, 7}, pos[3] = {0, 1, 2}, seq[3] = {0, 0, 1};
	const uint8_t want[3] = {0, 1, 1};
	const int32_t tables[2][2] = {{4, 9}, {2, 3}};
	eng_batch b = {.n_tok = 3, .tokens = tok, .pos = pos, .seq = seq, .want_logits = want,
		       .n_seq = 2, .block_tables = &tables[0][0], .max_blocks = 2};
	uint8_t out[256];
	size_t len = 0;
	ds_err err = {0};
	CHECK_EQ(rankproto_step_put(&b, out, sizeof out, &len, &err), DS_OK);
	CHECK_EQ(len, (size_t)(16 + 36 + 4 + 16));
	CHECK_EQ(rankproto_step_bytes(3, 2, 2, 1), (uint64_t)len);
	int32_t w[4];
	memcpy(w, out, 16);
	CHECK(w[0] == 3 && w[1] == 2 && w[2] == 2 && w[3] == (int32_t)RANKPROTO_STEP_WANT);
	CHECK(memcmp(out + 16 + 24, seq, 12) == 0);
	CHECK(out[52] == 0 && out[53] == 1 && out[54] == 1 && out[55] == 0);
	CHECK(memcmp(out + 56, tables, 16) == 0);
	b.want_logits = NULL;
	CHECK_EQ(rankproto_step_put(&b, out, sizeof out, &len, &err), DS_OK);
	CHECK_EQ(len, (size_t)(16 + 36 + 16));
	CHECK_EQ(rankproto_step_put(&b, out, 20, &len, &err), DS_ERANGE);
	CHECK_EQ(rankproto_step_bytes(0, 1, 1, 0), (uint64_t)0);
}

TEST(rankproto_stat_round_trips)
{
	rankproto_stat s = {.rank = 3, .weight_bytes = 1ull << 40, .extra_bytes = 12345,
			    .peak_rss_bytes = 1ull << 33, .comm_seconds = 0.25};
	uint8_t b[RANKPROTO_STAT_BYTES];
	rankproto_stat_put(&s, b);
	rankproto_stat g;
	rankproto_stat_get(b, &g);
	CHECK(g.rank == 3 && g.weight_bytes == 1ull << 40 && g.extra_bytes == 12345);
	CHECK(g.peak_rss_bytes == 1ull << 33 && g.comm_seconds == 0.25);
}
