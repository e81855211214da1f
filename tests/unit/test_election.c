/*
 * test_election.c - agent/cluster/election: rank order, quorum sizes, one vote per
 * epoch on disk, leases, fencing, no preemption, minorities never elect, and
 * a randomized run of crashes and partitions that checks at every step that
 * no two nodes hold a head lease at once.
 *
 * Several election instances run in one process, each with its own SQLite
 * store in a mkdtemp directory, wired by a fake transport (a message is a
 * direct election_handle call on the receiver, unless the link is cut or the
 * receiver is down) and driven by a fake clock in 10 ms steps.  Each node's
 * view is what gossip would tell it: a member is alive when it runs and the
 * link is not cut, with the role and epochs its status shows.
 */
#include "agent/cluster/election.h"
#include "agent/store/store.h"
#include "tests/unit/unit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define SIM_MAX 7
#define STEP_MS 10
#define LEASE 1000
#define SETTLE 300

typedef struct sim sim;

typedef struct sim_node {
	sim *s;
	int i;
	char *dir; /* ut_tmpdir_new */
	store *st;
	election *el;
	uint8_t id[ELECTION_ID_LEN];
	int up;
	int eligible;
	int priority;
} sim_node;

struct sim {
	int n, expect;
	sim_node node[SIM_MAX];
	int cut[SIM_MAX][SIM_MAX]; /* symmetric: no messages, no gossip */
	int64_t now;
	int sent, delivered;
};

static int sim_index(const sim *s, const uint8_t id[ELECTION_ID_LEN])
{
	for (int j = 0; j < s->n; j++)
		if (memcmp(s->node[j].id, id, ELECTION_ID_LEN) == 0)
			return j;
	return -1;
}

static void sim_send(void *ud, const election_msg *m, const uint8_t (*to)[ELECTION_ID_LEN],
		     size_t n, int timeout_ms, election_reply *rep, int *ans)
{
	sim_node *from = ud;
	sim *s = from->s;
	(void)timeout_ms;
	for (size_t k = 0; k < n; k++) {
		int j = sim_index(s, to[k]);
		s->sent++;
		ans[k] = 0;
		if (j < 0 || !s->node[j].up || s->cut[from->i][j])
			continue;
		CHECK_EQ(election_handle(s->node[j].el, m, s->now, &rep[k]), DS_OK);
		ans[k] = 1;
		s->delivered++;
	}
}

static int node_start(sim *s, int i)
{
	sim_node *nd = &s->node[i];
	ds_err err = {0};
	if (!nd->st && !(nd->st = store_open(nd->dir, &err))) {
		ut_fail(__FILE__, __LINE__, "store_open: %s", err.msg);
		return -1;
	}
	election_params p = election_default_params();
	memcpy(p.self_id, nd->id, ELECTION_ID_LEN);
	p.expect = s->expect;
	p.settle_ms = SETTLE;
	p.lease_ms = LEASE;
	p.eligible = nd->eligible;
	p.priority = nd->priority;
	p.store = nd->st;
	p.send = sim_send;
	p.ud = nd;
	p.seed = ut_rand_u64();
	nd->el = election_new(&p, s->now, &err);
	if (!nd->el) {
		ut_fail(__FILE__, __LINE__, "election_new: %s", err.msg);
		return -1;
	}
	nd->up = 1;
	return 0;
}

/* A crash: the process stops; with reopen, its store is closed too (a
 * restart then reads it back from the file). */
static void node_crash(sim *s, int i, int reopen)
{
	sim_node *nd = &s->node[i];
	election_free(nd->el);
	nd->el = NULL;
	nd->up = 0;
	if (reopen) {
		store_close(nd->st);
		nd->st = NULL;
	}
}

/* n nodes with random ids sorted ascending (node 0 ranks first). */
static int sim_init(sim *s, int n, int expect)
{
	memset(s, 0, sizeof *s);
	s->n = n;
	s->expect = expect;
	s->now = 1000000 + (int64_t)(ut_rand_u64() % 100000);
	for (int i = 0; i < n; i++)
		for (int k = 0; k < ELECTION_ID_LEN; k++)
			s->node[i].id[k] = (uint8_t)ut_rand_u64();
	for (int i = 0; i < n; i++) /* sort ids so that rank = index */
		for (int j = i + 1; j < n; j++)
			if (memcmp(s->node[j].id, s->node[i].id, ELECTION_ID_LEN) < 0) {
				uint8_t t[ELECTION_ID_LEN];
				memcpy(t, s->node[i].id, sizeof t);
				memcpy(s->node[i].id, s->node[j].id, sizeof t);
				memcpy(s->node[j].id, t, sizeof t);
			}
	for (int i = 0; i < n; i++) {
		sim_node *nd = &s->node[i];
		nd->s = s;
		nd->i = i;
		nd->eligible = 1;
		nd->dir = ut_tmpdir_new("election");
		if (!nd->dir)
			return -1;
	}
	return 0;
}

static void sim_free(sim *s)
{
	for (int i = 0; i < s->n; i++) {
		election_free(s->node[i].el);
		store_close(s->node[i].st);
		ut_tmpdir_free(s->node[i].dir);
		s->node[i].dir = NULL;
	}
}

static void sim_cut(sim *s, int i, int j, int v)
{
	s->cut[i][j] = s->cut[j][i] = v;
}

/* Pushes each running node's view (as gossip would show it). */
static void sim_views(sim *s)
{
	for (int i = 0; i < s->n; i++) {
		if (!s->node[i].up)
			continue;
		election_member m[SIM_MAX];
		memset(m, 0, sizeof m);
		for (int j = 0; j < s->n; j++) {
			sim_node *o = &s->node[j];
			memcpy(m[j].id, o->id, ELECTION_ID_LEN);
			snprintf(m[j].name, sizeof m[j].name, "n%d", j);
			m[j].is_self = i == j;
			m[j].state = o->up && !s->cut[i][j] ? GOSSIP_ALIVE : GOSSIP_DEAD;
			m[j].eligible = o->eligible;
			m[j].priority = o->priority;
			if (o->up) {
				election_status st;
				election_status_get(o->el, s->now, &st);
				m[j].role = st.role;
				m[j].epoch = st.epoch;
				m[j].head_epoch = st.has_head ? st.head_epoch : 0;
			}
		}
		election_set_view(s->node[i].el, m, (size_t)s->n, s->now);
	}
}

/* Index of the one node holding a valid head lease, -1 when none; fails the
 * test when two do. */
static int sim_head(sim *s)
{
	int head = -1;
	for (int i = 0; i < s->n; i++) {
		if (!s->node[i].up)
			continue;
		election_status st;
		election_status_get(s->node[i].el, s->now, &st);
		if (st.role == GOSSIP_ROLE_HEAD && st.has_head) {
			if (head >= 0)
				ut_fail(__FILE__, __LINE__, "two heads at t=%lld: n%d and n%d",
					(long long)s->now, head, i);
			head = i;
		}
	}
	return head;
}

static void sim_step(sim *s)
{
	s->now += STEP_MS;
	sim_views(s);
	int order[SIM_MAX];
	for (int i = 0; i < s->n; i++)
		order[i] = i;
	for (int i = s->n - 1; i > 0; i--) { /* ticks in a random order */
		int j = (int)(ut_rand_u64() % (uint64_t)(i + 1));
		int t = order[i];
		order[i] = order[j];
		order[j] = t;
	}
	for (int k = 0; k < s->n; k++)
		if (s->node[order[k]].up)
			election_tick(s->node[order[k]].el, s->now);
	sim_head(s);
}

/* Runs until pred holds (returns the time it took) or ms pass (-1). */
static int64_t sim_run_until(sim *s, int (*pred)(sim *), int64_t ms)
{
	int64_t t0 = s->now;
	while (s->now - t0 <= ms) {
		if (pred(s))
			return s->now - t0;
		sim_step(s);
	}
	return -1;
}

static void sim_run(sim *s, int64_t ms)
{
	int64_t t0 = s->now;
	while (s->now - t0 < ms)
		sim_step(s);
}

/* Every running node follows (or is) the same valid head. */
static int all_agree(sim *s)
{
	int head = sim_head(s);
	if (head < 0)
		return 0;
	election_status hs;
	election_status_get(s->node[head].el, s->now, &hs);
	for (int i = 0; i < s->n; i++) {
		if (!s->node[i].up)
			continue;
		election_status st;
		election_status_get(s->node[i].el, s->now, &st);
		if (!st.has_head || memcmp(st.head, s->node[head].id, ELECTION_ID_LEN) != 0 ||
		    st.head_epoch != hs.head_epoch)
			return 0;
	}
	return 1;
}

static uint64_t head_epoch_of(sim *s, int i)
{
	election_status st;
	election_status_get(s->node[i].el, s->now, &st);
	return st.head_epoch;
}

/* ---- pure functions ---------------------------------------------------------- */

TEST(election_quorum_sizes_1_to_7)
{
	static const int want[8] = {1, 1, 2, 2, 3, 3, 4, 4};
	for (int n = 0; n <= 7; n++) {
		int q = election_quorum(n);
		CHECK_EQ(q, want[n]);
		if (n >= 1) {
			CHECK(2 * q > n);          /* two quorums always share a member */
			CHECK(q <= n);             /* a full cluster can elect */
			CHECK(2 * (q - 1) <= n);   /* the smallest such number */
		}
	}
}

/* An independent reference: the rank as one tuple compared field by field. */
static int rank_key_less(const election_member *a, const election_member *b)
{
	int ea = a->eligible ? 0 : 1, eb = b->eligible ? 0 : 1;
	if (ea != eb)
		return ea < eb;
	if (a->priority != b->priority)
		return -(int64_t)a->priority < -(int64_t)b->priority;
	for (int k = 0; k < ELECTION_ID_LEN; k++)
		if (a->id[k] != b->id[k])
			return a->id[k] < b->id[k];
	return 0;
}

TEST(election_rank_order_matches_reference)
{
	election_member m[40];
	for (int round = 0; round < 50; round++) {
		memset(m, 0, sizeof m);
		for (int i = 0; i < 40; i++) {
			m[i].eligible = (int)(ut_rand_u64() % 4 != 0);
			m[i].priority = (int32_t)(ut_rand_u64() % 5) - 2;
			for (int k = 0; k < ELECTION_ID_LEN; k++)
				m[i].id[k] = (uint8_t)(ut_rand_u64() % 3); /* many shared prefixes */
		}
		for (int i = 0; i < 40; i++)
			for (int j = 0; j < 40; j++) {
				int c = election_rank_cmp(&m[i], &m[j]);
				CHECK_EQ(c < 0, rank_key_less(&m[i], &m[j]));
				CHECK_EQ(c > 0, rank_key_less(&m[j], &m[i]));
			}
	}
	/* the three rules, spelled out */
	election_member a, b;
	memset(&a, 0, sizeof a);
	memset(&b, 0, sizeof b);
	a.id[0] = 9;
	b.id[0] = 1;
	a.eligible = 1;
	CHECK(election_rank_cmp(&a, &b) < 0); /* eligible beats a lower id */
	b.eligible = 1;
	a.priority = 5;
	CHECK(election_rank_cmp(&a, &b) < 0); /* priority beats a lower id */
	a.priority = 0;
	CHECK(election_rank_cmp(&b, &a) < 0); /* then the lower id */
}

TEST(election_messages_json_round_trip)
{
	election_msg m, back;
	memset(&m, 0, sizeof m);
	m.kind = ELECTION_MSG_HEARTBEAT;
	m.epoch = 1 + ut_rand_u64() % 100000;
	for (int k = 0; k < ELECTION_ID_LEN; k++)
		m.from[k] = (uint8_t)ut_rand_u64();
	m.n_history = 1 + ut_rand_u64() % ELECTION_HISTORY_MAX;
	for (size_t i = 0; i < m.n_history; i++) {
		m.history[i].epoch = 1 + i;
		for (int k = 0; k < ELECTION_ID_LEN; k++)
			m.history[i].head[k] = (uint8_t)ut_rand_u64();
	}
	json_t *j = election_msg_json(&m);
	CHECK(j != NULL);
	CHECK_EQ(election_msg_parse(j, &back, NULL), DS_OK);
	CHECK(memcmp(&m, &back, sizeof m) == 0);
	json_decref(j);
	election_reply r, rb;
	memset(&r, 0, sizeof r);
	r.granted = 1;
	r.epoch = 77;
	r.has_head = 1;
	r.head[3] = 0xab;
	r.head_epoch = 76;
	snprintf(r.reason, sizeof r.reason, "why not");
	j = election_reply_json(&r);
	CHECK_EQ(election_reply_parse(j, &rb, NULL), DS_OK);
	CHECK(memcmp(&r, &rb, sizeof r) == 0);
	json_decref(j);
	/* malformed messages are refused, naming the field */
	static const char *bad[] = {
		"[]",
		"{\"kind\":\"elect\",\"epoch\":1,\"from\":\"00000000000000000000000000000000\"}",
		"{\"kind\":\"vote\",\"epoch\":0,\"from\":\"00000000000000000000000000000000\"}",
		"{\"kind\":\"vote\",\"epoch\":-3,\"from\":\"00000000000000000000000000000000\"}",
		"{\"kind\":\"vote\",\"epoch\":9007199254740992,\"from\":\"00000000000000000000000000000000\"}",
		"{\"kind\":\"vote\",\"epoch\":1,\"from\":\"0000000000000000000000000000000\"}",
		"{\"kind\":\"vote\",\"epoch\":1,\"from\":\"0000000000000000000000000000000G\"}",
		"{\"kind\":\"vote\",\"epoch\":1,\"from\":\"00000000000000000000000000000000\",\"history\":7}",
		"{\"kind\":\"vote\",\"epoch\":1,\"from\":\"00000000000000000000000000000000\","
		"\"history\":[{\"epoch\":1}]}",
	};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		ds_err e = {0};
		json_t *b = json_loads(bad[i], 0, NULL);
		CHECK(b != NULL);
		CHECK_EQ(election_msg_parse(b, &back, &e), DS_EFORMAT);
		CHECK(e.msg[0] != '\0');
		json_decref(b);
	}
}

/* ---- votes ------------------------------------------------------------------- */

static election_msg vote_msg(const sim *s, int from, int kind, uint64_t epoch)
{
	election_msg m;
	memset(&m, 0, sizeof m);
	m.kind = kind;
	m.epoch = epoch;
	memcpy(m.from, s->node[from].id, ELECTION_ID_LEN);
	return m;
}

TEST(election_one_vote_per_epoch_survives_restart)
{
	sim s;
	if (sim_init(&s, 3, 3) != 0)
		return;
	for (int i = 0; i < 3; i++)
		node_start(&s, i);
	sim_views(&s);
	election *v = s.node[2].el;
	election_reply r;
	uint64_t e = 5 + ut_rand_u64() % 50;
	/* a pre-vote changes nothing */
	election_msg m = vote_msg(&s, 1, ELECTION_MSG_PREVOTE, e);
	CHECK_EQ(election_handle(v, &m, s.now, &r), DS_OK);
	CHECK(r.granted);
	int64_t ve;
	char vc[STORE_ID_HEX];
	CHECK_EQ(store_vote_last(s.node[2].st, &ve, vc, NULL), DS_OK);
	CHECK_EQ(ve, 0);
	/* the vote for n0 is on disk when the reply is out */
	m = vote_msg(&s, 0, ELECTION_MSG_VOTE, e);
	CHECK_EQ(election_handle(v, &m, s.now, &r), DS_OK);
	CHECK(r.granted);
	CHECK_EQ(r.epoch, e);
	char h0[33];
	election_id_hex(s.node[0].id, h0);
	CHECK_EQ(store_vote_last(s.node[2].st, &ve, vc, NULL), DS_OK);
	CHECK_EQ(ve, (int64_t)e);
	CHECK_STR(vc, h0);
	/* the same epoch, another candidate: refused, even after the promise ends */
	s.now += 2 * LEASE;
	sim_views(&s);
	m = vote_msg(&s, 1, ELECTION_MSG_VOTE, e);
	CHECK_EQ(election_handle(v, &m, s.now, &r), DS_OK);
	CHECK(!r.granted);
	CHECK(strstr(r.reason, "already voted") != NULL);
	/* restart with the store reopened from its file: still refused; the same
	 * candidate gets the same vote again (the reply may have been lost) */
	node_crash(&s, 2, 1);
	CHECK_EQ(node_start(&s, 2), 0);
	sim_views(&s);
	v = s.node[2].el;
	election_status st;
	election_status_get(v, s.now, &st);
	CHECK_EQ(st.epoch, e);
	CHECK_EQ(st.voted_epoch, e);
	m = vote_msg(&s, 1, ELECTION_MSG_VOTE, e);
	CHECK_EQ(election_handle(v, &m, s.now, &r), DS_OK);
	CHECK(!r.granted);
	m = vote_msg(&s, 1, ELECTION_MSG_PREVOTE, e);
	CHECK_EQ(election_handle(v, &m, s.now, &r), DS_OK);
	CHECK(!r.granted);
	m = vote_msg(&s, 0, ELECTION_MSG_VOTE, e);
	CHECK_EQ(election_handle(v, &m, s.now, &r), DS_OK);
	CHECK(r.granted);
	/* an older epoch is refused; a newer one is a new vote */
	s.now += 2 * LEASE;
	m = vote_msg(&s, 1, ELECTION_MSG_VOTE, e - 1);
	CHECK_EQ(election_handle(v, &m, s.now, &r), DS_OK);
	CHECK(!r.granted);
	m = vote_msg(&s, 1, ELECTION_MSG_VOTE, e + 1);
	CHECK_EQ(election_handle(v, &m, s.now, &r), DS_OK);
	CHECK(r.granted);
	/* the store keeps one vote per epoch: a second one is refused there too */
	char had[STORE_ID_HEX];
	CHECK_EQ(store_vote_put(s.node[2].st, (int64_t)e, h0, 1, had, NULL), DS_OK);
	char h1[33];
	election_id_hex(s.node[1].id, h1);
	CHECK_EQ(store_vote_put(s.node[2].st, (int64_t)e, h1, 1, had, NULL), DS_EBUSY);
	CHECK_STR(had, h0);
	/* and one head per epoch */
	store_election row;
	memset(&row, 0, sizeof row);
	row.epoch = 999;
	memcpy(row.head, h0, 33);
	snprintf(row.outcome, sizeof row.outcome, "followed");
	row.votes = row.quorum = -1;
	CHECK_EQ(store_election_put(s.node[2].st, &row, NULL, NULL), DS_OK);
	memcpy(row.head, h1, 33);
	CHECK_EQ(store_election_put(s.node[2].st, &row, NULL, NULL), DS_EINTERNAL);
	sim_free(&s);
}

TEST(election_no_vote_for_unknown_or_ineligible_candidates)
{
	sim s;
	if (sim_init(&s, 3, 3) != 0)
		return;
	s.node[1].eligible = 0;
	for (int i = 0; i < 3; i++)
		node_start(&s, i);
	sim_views(&s);
	election_reply r;
	election_msg m = vote_msg(&s, 1, ELECTION_MSG_VOTE, 3);
	CHECK_EQ(election_handle(s.node[2].el, &m, s.now, &r), DS_OK);
	CHECK(!r.granted && strstr(r.reason, "not eligible"));
	sim_cut(&s, 0, 2, 1);
	sim_views(&s);
	m = vote_msg(&s, 0, ELECTION_MSG_VOTE, 3);
	CHECK_EQ(election_handle(s.node[2].el, &m, s.now, &r), DS_OK);
	CHECK(!r.granted && strstr(r.reason, "not alive"));
	sim_free(&s);
}

/* ---- elections over the fake network ---------------------------------------- */

TEST(election_majority_elects_one_head_sizes_1_to_7)
{
	for (int n = 1; n <= SIM_MAX; n++) {
		sim s;
		if (sim_init(&s, n, n) != 0)
			return;
		for (int i = 0; i < n; i++)
			node_start(&s, i);
		int64_t took = sim_run_until(&s, all_agree, 10000);
		CHECK(took >= 0);
		int head = sim_head(&s);
		/* the best ranked node stood first and won */
		CHECK_EQ(head, 0);
		CHECK_EQ(head_epoch_of(&s, 0), 1);
		/* formation: not before the settle time and one lease of listening */
		CHECK(took >= LEASE);
		CHECK(took <= LEASE + LEASE / 4 + 200);
		/* it stays head: leases renew */
		sim_run(&s, 5 * LEASE);
		CHECK_EQ(sim_head(&s), 0);
		CHECK(all_agree(&s));
		CHECK_EQ(head_epoch_of(&s, n - 1), 1);
		sim_free(&s);
	}
}

TEST(election_formation_waits_for_expected_members)
{
	sim s;
	if (sim_init(&s, 5, 5) != 0)
		return;
	for (int i = 0; i < 4; i++) /* one expected member missing */
		node_start(&s, i);
	sim_run(&s, 10 * LEASE);
	CHECK_EQ(sim_head(&s), -1);
	election_status st;
	election_status_get(s.node[0].el, s.now, &st);
	CHECK(strstr(st.why, "formation: 4 of 5") != NULL);
	CHECK_EQ(st.epoch, 0);
	node_start(&s, 4);
	CHECK(sim_run_until(&s, all_agree, 5000) >= 0);
	sim_free(&s);
}

TEST(election_minority_never_elects)
{
	for (int n = 3; n <= SIM_MAX; n++) {
		sim s;
		if (sim_init(&s, n, n) != 0)
			return;
		for (int i = 0; i < n; i++)
			node_start(&s, i);
		CHECK(sim_run_until(&s, all_agree, 10000) >= 0);
		/* cut the head and as many others as still leaves them a minority */
		int minority = (n - 1) / 2;
		for (int i = 0; i < minority; i++)
			for (int j = minority; j < n; j++)
				sim_cut(&s, i, j, 1);
		uint64_t minority_epoch[SIM_MAX];
		for (int i = 0; i < minority; i++)
			minority_epoch[i] = head_epoch_of(&s, i);
		uint64_t old_epoch = head_epoch_of(&s, 0);
		int64_t t0 = s.now, majority_head_at = -1;
		while (s.now - t0 < 10 * LEASE) {
			sim_step(&s);
			int h = sim_head(&s);
			/* in the minority only the old head, in its old epoch, until its
			 * lease runs out (at most lease_ms): nobody there is elected */
			if (h >= 0 && h < minority) {
				CHECK_EQ(h, 0);
				CHECK_EQ(head_epoch_of(&s, h), old_epoch);
				CHECK(s.now - t0 <= LEASE);
			}
			if (h >= minority && majority_head_at < 0)
				majority_head_at = s.now - t0;
		}
		/* the old head (n0) held its lease at most lease_ms after the cut */
		CHECK(majority_head_at >= 0);
		CHECK(majority_head_at >= LEASE - STEP_MS || minority == 0);
		CHECK(majority_head_at <= 4 * LEASE);
		for (int i = 0; i < minority; i++) {
			election_status st;
			election_status_get(s.node[i].el, s.now, &st);
			CHECK(!st.has_head);
			CHECK_EQ(st.epoch, minority_epoch[i]); /* pre-vote: no epoch churn */
		}
		/* healed: the majority's head stays, everyone follows it */
		int h = sim_head(&s);
		uint64_t he = head_epoch_of(&s, h);
		for (int i = 0; i < n; i++)
			for (int j = 0; j < n; j++)
				s.cut[i][j] = 0;
		CHECK(sim_run_until(&s, all_agree, 5000) >= 0);
		CHECK_EQ(sim_head(&s), h);
		CHECK_EQ(head_epoch_of(&s, 0), he);
		sim_free(&s);
	}
}

TEST(election_lease_expiry_and_promises)
{
	sim s;
	if (sim_init(&s, 3, 3) != 0)
		return;
	for (int i = 0; i < 3; i++)
		node_start(&s, i);
	CHECK(sim_run_until(&s, all_agree, 10000) >= 0);
	CHECK_EQ(sim_head(&s), 0);
	/* the head is cut off: it keeps its lease less than lease_ms, then steps down */
	sim_cut(&s, 0, 1, 1);
	sim_cut(&s, 0, 2, 1);
	int64_t t0 = s.now, lost = -1;
	while (s.now - t0 <= 2 * LEASE) {
		sim_step(&s);
		election_status st;
		election_status_get(s.node[0].el, s.now, &st);
		if (lost < 0 && !(st.role == GOSSIP_ROLE_HEAD && st.has_head))
			lost = s.now - t0;
	}
	CHECK(lost > 0 && lost <= LEASE);
	CHECK(lost >= LEASE - LEASE / 3 - 2 * STEP_MS); /* its last ack was at most lease/3 old */
	/* a follower's promise: while it lasts, no vote for anybody else */
	sim s2;
	if (sim_init(&s2, 3, 3) != 0) {
		sim_free(&s);
		return;
	}
	for (int i = 0; i < 3; i++)
		node_start(&s2, i);
	CHECK(sim_run_until(&s2, all_agree, 10000) >= 0);
	election_reply r;
	election_msg m = vote_msg(&s2, 1, ELECTION_MSG_VOTE, 2);
	CHECK_EQ(election_handle(s2.node[2].el, &m, s2.now, &r), DS_OK);
	CHECK(!r.granted && strstr(r.reason, "promised"));
	m.kind = ELECTION_MSG_PREVOTE;
	CHECK_EQ(election_handle(s2.node[2].el, &m, s2.now, &r), DS_OK);
	CHECK(!r.granted);
	/* the head stops (crash): after lease_ms without heartbeat n2 votes */
	node_crash(&s2, 0, 0);
	s2.now += LEASE + STEP_MS;
	sim_views(&s2);
	m.kind = ELECTION_MSG_VOTE;
	CHECK_EQ(election_handle(s2.node[2].el, &m, s2.now, &r), DS_OK);
	CHECK(r.granted);
	sim_free(&s2);
	sim_free(&s);
}

TEST(election_fencing_refuses_stale_epochs)
{
	sim s;
	if (sim_init(&s, 3, 3) != 0)
		return;
	for (int i = 0; i < 3; i++)
		node_start(&s, i);
	CHECK(sim_run_until(&s, all_agree, 10000) >= 0);
	uint64_t e = head_epoch_of(&s, 0);
	ds_err err = {0};
	for (int i = 0; i < 3; i++) {
		CHECK_EQ(election_fence(s.node[i].el, e, s.now, &err), DS_OK);
		CHECK_EQ(election_fence(s.node[i].el, e + 1, s.now, &err), DS_EBUSY);
		if (e > 1)
			CHECK_EQ(election_fence(s.node[i].el, e - 1, s.now, &err), DS_EPERM);
	}
	/* the head crashes; a new head takes over at a higher epoch */
	node_crash(&s, 0, 0);
	CHECK(sim_run_until(&s, all_agree, 10 * LEASE) >= 0);
	int h = sim_head(&s);
	CHECK(h == 1 || h == 2);
	uint64_t e2 = head_epoch_of(&s, h);
	CHECK(e2 > e);
	for (int i = 1; i < 3; i++) {
		memset(&err, 0, sizeof err);
		CHECK_EQ(election_fence(s.node[i].el, e, s.now, &err), DS_EPERM);
		CHECK(strstr(err.msg, "stale epoch") != NULL);
		CHECK_EQ(election_fence(s.node[i].el, e2, s.now, &err), DS_OK);
	}
	/* a follower cut off from the head refuses even the current epoch once
	 * its promise runs out: it cannot know the head still holds it */
	int f = h == 1 ? 2 : 1;
	sim_cut(&s, 1, 2, 1);
	s.now += LEASE + STEP_MS;
	CHECK_EQ(election_fence(s.node[f].el, e2, s.now, &err), DS_EBUSY);
	sim_free(&s);
}

TEST(election_rejoining_better_node_does_not_preempt)
{
	sim s;
	if (sim_init(&s, 3, 3) != 0)
		return;
	for (int i = 0; i < 3; i++)
		node_start(&s, i);
	CHECK(sim_run_until(&s, all_agree, 10000) >= 0);
	CHECK_EQ(sim_head(&s), 0); /* n0 ranks first */
	node_crash(&s, 0, 1);      /* kill -9, store closed */
	CHECK(sim_run_until(&s, all_agree, 10 * LEASE) >= 0);
	int h = sim_head(&s);
	CHECK(h == 1);             /* the next in rank */
	uint64_t e = head_epoch_of(&s, h);
	CHECK_EQ(e, 2);
	CHECK_EQ(node_start(&s, 0), 0); /* back, with its store read from the file */
	sim_run(&s, 20 * LEASE);
	CHECK_EQ(sim_head(&s), 1);
	CHECK(all_agree(&s));
	election_status st;
	election_status_get(s.node[0].el, s.now, &st);
	CHECK_EQ(st.role, GOSSIP_ROLE_FOLLOWER);
	CHECK_EQ(st.head_epoch, e);
	/* every store has the same epoch history */
	store_election *rows[3];
	size_t nrows[3];
	for (int i = 0; i < 3; i++) {
		CHECK_EQ(store_election_list(s.node[i].st, 100, &rows[i], &nrows[i], NULL), DS_OK);
		CHECK_EQ(nrows[i], 2);
	}
	for (int i = 1; i < 3; i++)
		for (size_t k = 0; k < nrows[0] && k < nrows[i]; k++) {
			CHECK_EQ(rows[i][k].epoch, rows[0][k].epoch);
			CHECK_STR(rows[i][k].head, rows[0][k].head);
		}
	for (int i = 0; i < 3; i++)
		free(rows[i]);
	sim_free(&s);
}

TEST(election_ineligible_nodes_vote_but_never_lead)
{
	sim s;
	if (sim_init(&s, 3, 3) != 0)
		return;
	s.node[0].eligible = 0; /* best id, but not eligible */
	s.node[2].priority = 10; /* worst id, best priority */
	for (int i = 0; i < 3; i++)
		node_start(&s, i);
	CHECK(sim_run_until(&s, all_agree, 10000) >= 0);
	CHECK_EQ(sim_head(&s), 2);
	sim_free(&s);
}

TEST(election_single_node_is_head_at_once)
{
	char *dir = ut_tmpdir_new("election");
	if (!dir)
		return;
	ds_err err = {0};
	store *st = store_open(dir, &err);
	CHECK(st != NULL);
	if (!st) {
		ut_tmpdir_free(dir);
		return;
	}
	election_params p = election_default_params();
	p.single = 1;
	p.store = st;
	p.self_id[0] = 7;
	for (int round = 0; round < 2; round++) { /* a restart keeps epoch 1 */
		election *el = election_new(&p, 1000, &err);
		CHECK(el != NULL);
		election_status s;
		election_status_get(el, 5000, &s);
		CHECK_EQ(s.role, GOSSIP_ROLE_HEAD);
		CHECK(s.has_head);
		CHECK_EQ(s.head_epoch, 1);
		CHECK_EQ(s.quorum, 1);
		CHECK_EQ(election_fence(el, 1, 1000000000, &err), DS_OK);
		CHECK_EQ(election_fence(el, 0, 5000, &err), DS_EPERM);
		election_free(el);
	}
	store_close(st);
	ut_tmpdir_free(dir);
}

/* Random crashes, restarts, cuts and heals on 5 nodes: at no step do two
 * nodes hold a head lease (sim_head checks that), head epochs only grow, no
 * epoch has two heads in any store, and once the network is whole again one
 * head is agreed on. */
TEST(election_random_faults_keep_one_head)
{
	sim s;
	if (sim_init(&s, 5, 5) != 0)
		return;
	for (int i = 0; i < 5; i++)
		node_start(&s, i);
	CHECK(sim_run_until(&s, all_agree, 10000) >= 0);
	uint64_t last_epoch = 0;
	for (int ev = 0; ev < 40; ev++) {
		int a = (int)(ut_rand_u64() % 5), b = (int)(ut_rand_u64() % 5);
		switch (ut_rand_u64() % 4) {
		case 0:
			if (s.node[a].up)
				node_crash(&s, a, (int)(ut_rand_u64() % 2));
			else
				node_start(&s, a);
			break;
		case 1:
			if (a != b)
				sim_cut(&s, a, b, 1);
			break;
		default:
			if (a != b)
				sim_cut(&s, a, b, 0);
			break;
		}
		int64_t t0 = s.now, span = 100 + (int64_t)(ut_rand_u64() % (3 * LEASE));
		while (s.now - t0 < span) {
			sim_step(&s);
			int h = sim_head(&s);
			if (h >= 0) {
				uint64_t e = head_epoch_of(&s, h);
				CHECK(e >= last_epoch);
				last_epoch = e;
			}
		}
	}
	for (int i = 0; i < 5; i++) {
		if (!s.node[i].up)
			node_start(&s, i);
		for (int j = 0; j < 5; j++)
			s.cut[i][j] = 0;
	}
	CHECK(sim_run_until(&s, all_agree, 20 * LEASE) >= 0);
	CHECK(s.delivered > 0 && s.sent >= s.delivered);
	sim_free(&s);
}
