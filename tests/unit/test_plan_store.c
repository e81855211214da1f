/*
 * test_plan_store.c - shard plans in the agent's SQLite store
 * (agent/store/store.c, schema/0004_plans.sql).
 *
 * What is checked, each in a fresh database under a mkdtemp directory:
 *   - a plan of random shape (tp, pp, ep in 1..3, random node ids, devices,
 *     layer and expert ranges, environments and groups) reads back field
 *     for field, as the newest plan and by its version;
 *   - a second plan gets a higher version and supersedes the first;
 *   - fencing: a plan, or a status change, from an older epoch is DS_EPERM
 *     and writes nothing;
 *   - bad plans (a missing or misplaced rank, a bad node id, an env that is
 *     not a JSON object, a group naming a rank outside the world, tp x pp x
 *     ep that is not the world size, an unknown status) are DS_EINVAL naming
 *     the problem, and write nothing.
 */
#include "agent/store/store.h"
#include "common/strutil.h"
#include "tests/unit/unit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RANKS_MAX 27
#define GROUPS_MAX 64

typedef struct plan_fix {
	char *dir;
	store *st;
	store_plan p;
	store_plan_rank ranks[RANKS_MAX];
	store_comm_group groups[GROUPS_MAX];
	char env[RANKS_MAX][128];
	char granks[GROUPS_MAX][256];
	char model[64], doc[128];
} plan_fix;

static void rand_id(char out[STORE_ID_HEX])
{
	for (int i = 0; i < STORE_ID_HEX - 1; i++)
		out[i] = "0123456789abcdef"[ut_rand_u64() % 16];
	out[STORE_ID_HEX - 1] = '\0';
}

/* A random plan of epoch in f->p (arrays inside f). */
static void plan_make(plan_fix *f, int64_t epoch)
{
	store_plan *p = &f->p;
	memset(p, 0, sizeof *p);
	p->epoch = epoch;
	p->created = 1700000000 + (int64_t)(ut_rand_u64() % 100000);
	rand_id(p->head_id);
	snprintf(f->model, sizeof f->model, "/models/m%llu", (unsigned long long)(ut_rand_u64() % 1000));
	p->model = f->model;
	p->tp = 1 + (int)(ut_rand_u64() % 3);
	p->pp = 1 + (int)(ut_rand_u64() % 3);
	p->ep = 1 + (int)(ut_rand_u64() % 3);
	p->world_size = p->tp * p->pp * p->ep;
	p->max_ctx = (int)(ut_rand_u64() % 100000);
	p->max_seqs = (ut_rand_u64() & 1) ? -1 : 1 + (int)(ut_rand_u64() % 64);
	ds_strlcpy(p->status, "planned", sizeof p->status);
	snprintf(f->doc, sizeof f->doc, "{\"tp\": %d, \"note\": \"r%llu\"}", p->tp,
		 (unsigned long long)(ut_rand_u64() % 1000));
	p->document = f->doc;
	int S = p->tp * p->ep;
	char node[4][STORE_ID_HEX];
	for (int i = 0; i < 4; i++)
		rand_id(node[i]);
	for (int r = 0; r < p->world_size; r++) {
		store_plan_rank *k = &f->ranks[r];
		memset(k, 0, sizeof *k);
		k->rank = r;
		ds_strlcpy(k->node_id, node[ut_rand_u64() % 4], sizeof k->node_id);
		snprintf(k->node_name, sizeof k->node_name, "n%d", r / 2);
		k->device = (int)(ut_rand_u64() % 9) - 1;
		k->stage = r / S;
		k->ep_rank = (r % S) / p->tp;
		k->tp_rank = r % p->tp;
		k->layer_first = k->stage * 7;
		k->layer_count = 7;
		k->expert_first = k->ep_rank * 5;
		k->expert_count = 5;
		k->weight_bytes = (ut_rand_u64() & 1) ? -1 : (int64_t)(ut_rand_u64() >> 20);
		k->kv_bytes = (int64_t)(ut_rand_u64() >> 30);
		snprintf(f->env[r], sizeof f->env[r], "{\"NCCL_IB_HCA\": \"=mlx5_%d:1\", \"R\": \"%d\"}",
			 (int)(ut_rand_u64() % 8), r);
		k->env = f->env[r];
	}
	p->ranks = f->ranks;
	/* world, each stage, each tp group */
	size_t g = 0;
	ds_strlcpy(f->groups[g].name, "world", sizeof f->groups[g].name);
	int n = snprintf(f->granks[g], sizeof f->granks[g], "[");
	for (int r = 0; r < p->world_size; r++)
		n += snprintf(f->granks[g] + n, sizeof f->granks[g] - (size_t)n, "%s%d", r ? "," : "", r);
	snprintf(f->granks[g] + n, sizeof f->granks[g] - (size_t)n, "]");
	g++;
	for (int s = 0; s < p->pp; s++, g++) {
		snprintf(f->groups[g].name, sizeof f->groups[g].name, "stage%d", s);
		n = snprintf(f->granks[g], sizeof f->granks[g], "[");
		for (int i = 0; i < S; i++)
			n += snprintf(f->granks[g] + n, sizeof f->granks[g] - (size_t)n, "%s%d", i ? "," : "",
				      s * S + i);
		snprintf(f->granks[g] + n, sizeof f->granks[g] - (size_t)n, "]");
	}
	for (size_t i = 0; i < g; i++)
		f->groups[i].ranks = f->granks[i];
	p->groups = f->groups;
	p->n_groups = g;
}

static int fix_open(plan_fix *f)
{
	ds_err e = {0};
	memset(f, 0, sizeof *f);
	f->dir = ut_tmpdir_new("plans");
	if (!f->dir)
		return -1;
	f->st = store_open(f->dir, &e);
	if (!f->st) {
		ut_fail(__FILE__, __LINE__, "store_open: %s", e.msg);
		ut_tmpdir_free(f->dir);
		return -1;
	}
	return 0;
}

static void fix_close(plan_fix *f)
{
	store_close(f->st);
	ut_tmpdir_free(f->dir);
}

/* Checks that what store_plan_get returned equals what was inserted. */
static void plan_same(const store_plan *want, const store_plan *got)
{
	CHECK_EQ(got->id, want->id);
	CHECK_EQ(got->epoch, want->epoch);
	CHECK_EQ(got->created, want->created);
	CHECK_STR(got->head_id, want->head_id);
	CHECK_STR(got->model, want->model);
	CHECK_EQ(got->tp, want->tp);
	CHECK_EQ(got->pp, want->pp);
	CHECK_EQ(got->ep, want->ep);
	CHECK_EQ(got->world_size, want->world_size);
	CHECK_EQ(got->max_ctx, want->max_ctx);
	CHECK_EQ(got->max_seqs, want->max_seqs);
	CHECK_STR(got->document, want->document);
	for (int r = 0; r < want->world_size && got->ranks; r++) {
		const store_plan_rank *a = &want->ranks[r], *b = &got->ranks[r];
		CHECK_EQ(b->rank, a->rank);
		CHECK_STR(b->node_id, a->node_id);
		CHECK_STR(b->node_name, a->node_name);
		CHECK_EQ(b->device, a->device);
		CHECK_EQ(b->stage, a->stage);
		CHECK_EQ(b->tp_rank, a->tp_rank);
		CHECK_EQ(b->ep_rank, a->ep_rank);
		CHECK_EQ(b->layer_first, a->layer_first);
		CHECK_EQ(b->layer_count, a->layer_count);
		CHECK_EQ(b->expert_first, a->expert_first);
		CHECK_EQ(b->expert_count, a->expert_count);
		CHECK_EQ(b->weight_bytes, a->weight_bytes);
		CHECK_EQ(b->kv_bytes, a->kv_bytes);
		CHECK_STR(b->env, a->env);
	}
	CHECK_EQ((long long)got->n_groups, (long long)want->n_groups);
	for (size_t i = 0; i < want->n_groups && i < got->n_groups; i++) {
		CHECK_STR(got->groups[i].name, want->groups[i].name);
		CHECK_STR(got->groups[i].ranks, want->groups[i].ranks);
	}
}

TEST(store_plan_round_trips_and_supersedes)
{
	for (int trial = 0; trial < 8; trial++) {
		plan_fix f;
		ds_err e = {0};
		store_plan got;
		if (fix_open(&f))
			return;
		CHECK_EQ(store_plan_get(f.st, 0, &got, &e), DS_ENOTFOUND);
		plan_make(&f, 3);
		CHECK_EQ(store_plan_insert(f.st, &f.p, &e), DS_OK);
		int64_t first = f.p.id;
		CHECK(first > 0);
		CHECK_EQ(store_plan_get(f.st, 0, &got, &e), DS_OK);
		plan_same(&f.p, &got);
		CHECK_STR(got.status, "planned");
		store_plan_free(&got);
		CHECK_EQ(store_plan_set_status(f.st, first, 3, "serving", NULL, f.p.created + 5, &e),
			 DS_OK);
		/* a second plan of a newer epoch: a higher version; the first is superseded */
		plan_make(&f, 4);
		CHECK_EQ(store_plan_insert(f.st, &f.p, &e), DS_OK);
		CHECK(f.p.id > first);
		CHECK_EQ(store_plan_get(f.st, 0, &got, &e), DS_OK);
		plan_same(&f.p, &got);
		store_plan_free(&got);
		CHECK_EQ(store_plan_get(f.st, first, &got, &e), DS_OK);
		CHECK_STR(got.status, "superseded");
		CHECK_EQ(got.epoch, 3);
		store_plan_free(&got);
		CHECK_EQ(store_plan_get(f.st, f.p.id + 1, &got, &e), DS_ENOTFOUND);
		fix_close(&f);
	}
}

TEST(store_plan_fencing_refuses_older_epochs)
{
	plan_fix f;
	ds_err e = {0};
	store_plan got;
	if (fix_open(&f))
		return;
	plan_make(&f, 7);
	CHECK_EQ(store_plan_insert(f.st, &f.p, &e), DS_OK);
	int64_t id = f.p.id;
	/* a deposed head (epoch 6) cannot write a plan nor change this one */
	plan_make(&f, 6);
	CHECK_EQ(store_plan_insert(f.st, &f.p, &e), DS_EPERM);
	CHECK(strstr(e.msg, "epoch 7") != NULL);
	CHECK_EQ(store_plan_set_status(f.st, id, 6, "stopped", "old head", 1, &e), DS_EPERM);
	CHECK_EQ(store_plan_get(f.st, 0, &got, &e), DS_OK);
	CHECK_EQ(got.id, id);
	CHECK_STR(got.status, "planned");
	CHECK_STR(got.reason, "");
	store_plan_free(&got);
	/* the same or a newer epoch may */
	CHECK_EQ(store_plan_set_status(f.st, id, 8, "failed", "rank 3 died", 99, &e), DS_OK);
	CHECK_EQ(store_plan_get(f.st, id, &got, &e), DS_OK);
	CHECK_STR(got.status, "failed");
	CHECK_STR(got.reason, "rank 3 died");
	CHECK_EQ(got.status_at, 99);
	store_plan_free(&got);
	CHECK_EQ(store_plan_set_status(f.st, id + 5, 8, "failed", NULL, 1, &e), DS_ENOTFOUND);
	CHECK_EQ(store_plan_set_status(f.st, id, 8, "exploded", NULL, 1, &e), DS_EINVAL);
	fix_close(&f);
}

/* Each bad plan is DS_EINVAL with want in the message, and the database
 * still holds only the good plan written first. */
TEST(store_plan_bad_plans_are_refused_whole)
{
	plan_fix f;
	ds_err e = {0};
	store_plan got;
	if (fix_open(&f))
		return;
	plan_make(&f, 2);
	CHECK_EQ(store_plan_insert(f.st, &f.p, &e), DS_OK);
	int64_t id = f.p.id;
	static const char *const wants[] = {
		"rank row 1 says rank 0", "node id", "env is not a JSON object",
		"env is not a JSON object", "comm group 'world'", "is not its world size",
		"status 'done'", "document is not a JSON object", "stage 9",
	};
	for (size_t c = 0; c < sizeof wants / sizeof wants[0]; c++) {
		do
			plan_make(&f, 2);
		while (f.p.world_size < 2 || f.p.pp > 1);
		switch (c) {
		case 0: f.ranks[1].rank = 0; break;
		case 1: f.ranks[f.p.world_size - 1].node_id[5] = 'x'; break;
		case 2: f.ranks[0].env = "[1, 2]"; break;
		case 3: f.ranks[1].env = "{\"a\": "; break;
		case 4: ds_strlcpy(f.granks[0], "[0, 99]", sizeof f.granks[0]); break;
		case 5: f.p.world_size = f.p.world_size - 1; break;
		case 6: ds_strlcpy(f.p.status, "done", sizeof f.p.status); break;
		case 7: f.p.document = "not json"; break;
		case 8: f.ranks[0].stage = 9; break;
		}
		e = (ds_err){0};
		if (store_plan_insert(f.st, &f.p, &e) != DS_EINVAL || !strstr(e.msg, wants[c]))
			ut_fail(__FILE__, __LINE__, "case %zu: wanted DS_EINVAL naming '%s', got %d: %s", c,
				wants[c], e.code, e.msg);
	}
	CHECK_EQ(store_plan_get(f.st, 0, &got, &e), DS_OK);
	CHECK_EQ(got.id, id);
	CHECK_STR(got.status, "planned");
	store_plan_free(&got);
	fix_close(&f);
}
