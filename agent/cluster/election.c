/*
 * election.c - head election over the gossip view (see election.h for the
 * state diagram and the rules; docs/cluster.md "Election" for the argument).
 *
 * Callers: agent/cluster/cluster.c (view, tick, messages from the control API, status
 * for the metadata and /v1/cluster/state) and tests/unit/test_election.c
 * (several instances wired together, a fake clock).  Calls: agent/store
 * (votes, elections) and the send callback.
 *
 * Invariants:
 *  1. el->epoch never decreases; it is at least every persisted vote and
 *     election row, and every epoch seen in a message or a reply.
 *  2. A vote (ours or for ourselves) is in the store before anybody learns of
 *     it; granting it and promising the candidate happen under el->mu in one
 *     step.
 *  3. role == HEAD implies head == self, head_epoch == the epoch it won, and
 *     lease_until computed from acks of that epoch only.
 *  4. el->mu is never held while send runs; a round's results are applied
 *     only if the role and epoch it started from are still current (else
 *     they are dropped: something newer happened meanwhile).
 *  5. At most one round is in flight (el->busy).
 *
 * Threading: any thread; el->mu guards everything below it in struct
 * election.
 */
#include "agent/cluster/election.h"
#include "common/hex.h"
#include "common/log.h"
#include "common/strutil.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NEVER INT64_MAX

struct ack {
	uint8_t id[ELECTION_ID_LEN];
	int64_t at; /* send time of the round it answered */
};

struct election {
	election_params p;
	char self_hex[33];
	pthread_mutex_t mu;
	uint64_t rng;
	int64_t started_ms;
	/* the view */
	election_member *view;
	size_t n_view, cap_view;
	uint64_t alive_hash;       /* of the alive set, to notice changes */
	int64_t view_changed_ms;
	int formed;
	/* epoch and vote (mirrors of the store) */
	uint64_t epoch;
	uint64_t voted_epoch;
	uint8_t voted_for[ELECTION_ID_LEN];
	/* role */
	int role;
	int knows_head;            /* head/head_epoch are set (maybe expired) */
	uint8_t head[ELECTION_ID_LEN];
	uint64_t head_epoch;
	int64_t promise_until;     /* no vote for anyone but promise_to before this */
	uint8_t promise_to[ELECTION_ID_LEN];
	int64_t lease_until;       /* head */
	struct ack *acks;
	size_t n_acks, cap_acks;
	int64_t next_heartbeat;
	/* candidacy */
	int64_t ready_since;       /* 0: the conditions to stand do not hold */
	int64_t ready_delay;
	int64_t retry_at;
	int busy;
	/* history: the newest (epoch, head) pairs, oldest first */
	election_entry hist[ELECTION_HISTORY_MAX];
	size_t n_hist;
	char why[192];
};

election_params election_default_params(void)
{
	election_params p;
	memset(&p, 0, sizeof p);
	p.expect = 0;
	p.settle_ms = 3000;
	p.lease_ms = 5000;
	p.eligible = 1;
	return p;
}

int election_quorum(int n)
{
	return n <= 1 ? 1 : n / 2 + 1;
}

int election_rank_cmp(const election_member *a, const election_member *b)
{
	if (!!a->eligible != !!b->eligible)
		return a->eligible ? -1 : 1;
	if (a->priority != b->priority)
		return a->priority > b->priority ? -1 : 1;
	return memcmp(a->id, b->id, ELECTION_ID_LEN);
}

const char *election_role_name(int role)
{
	switch (role) {
	case GOSSIP_ROLE_FOLLOWER:
		return "follower";
	case GOSSIP_ROLE_CANDIDATE:
		return "candidate";
	case GOSSIP_ROLE_HEAD:
		return "head";
	default:
		return "none";
	}
}

void election_id_hex(const uint8_t id[ELECTION_ID_LEN], char out[33])
{
	ds_hex_encode(id, ELECTION_ID_LEN, out);
}

int election_id_parse(const char *text, uint8_t id[ELECTION_ID_LEN])
{
	if (!text || strlen(text) != 2 * ELECTION_ID_LEN)
		return DS_EFORMAT;
	for (int i = 0; i < 2 * ELECTION_ID_LEN; i++)
		if (text[i] >= 'A' && text[i] <= 'F') /* ids are lower case on the wire */
			return DS_EFORMAT;
	return ds_hex_decode(text, ELECTION_ID_LEN, id) == 0 ? DS_OK : DS_EFORMAT;
}

static uint64_t next_rand(election *el)
{
	/* xorshift64*: jitter only, nothing secret */
	el->rng ^= el->rng >> 12;
	el->rng ^= el->rng << 25;
	el->rng ^= el->rng >> 27;
	return el->rng * 0x2545F4914F6CDD1DULL;
}

static int64_t jitter(election *el, int64_t span)
{
	return span > 0 ? (int64_t)(next_rand(el) % (uint64_t)span) : 0;
}

static int is_self(const election *el, const uint8_t id[ELECTION_ID_LEN])
{
	return memcmp(id, el->p.self_id, ELECTION_ID_LEN) == 0;
}

static const election_member *find(const election *el, const uint8_t id[ELECTION_ID_LEN])
{
	for (size_t i = 0; i < el->n_view; i++)
		if (memcmp(el->view[i].id, id, ELECTION_ID_LEN) == 0)
			return &el->view[i];
	return NULL;
}

static int member_alive(const election_member *m)
{
	return m->is_self || m->state == GOSSIP_ALIVE;
}

/* Members alive (self always) and members that have not left. */
static void counts(const election *el, int *alive, int *known)
{
	int a = 0, k = 0, self_seen = 0;
	for (size_t i = 0; i < el->n_view; i++) {
		const election_member *m = &el->view[i];
		if (m->is_self || is_self(el, m->id)) {
			self_seen = 1;
			a++;
			k++;
			continue;
		}
		a += m->state == GOSSIP_ALIVE;
		k += m->state != GOSSIP_LEFT;
	}
	if (!self_seen) {
		a++;
		k++;
	}
	*alive = a;
	*known = k;
}

static int quorum_now(const election *el)
{
	if (el->p.single)
		return 1;
	int alive, known;
	counts(el, &alive, &known);
	return election_quorum(known > el->p.expect ? known : el->p.expect);
}

/* Remembers (epoch, head) in the history cache (sorted, newest kept). */
static int hist_has(const election *el, uint64_t epoch)
{
	for (size_t i = 0; i < el->n_hist; i++)
		if (el->hist[i].epoch == epoch)
			return 1;
	return 0;
}

static void hist_add(election *el, uint64_t epoch, const uint8_t head[ELECTION_ID_LEN])
{
	if (hist_has(el, epoch))
		return;
	if (el->n_hist == ELECTION_HISTORY_MAX) {
		if (epoch < el->hist[0].epoch)
			return;
		memmove(el->hist, el->hist + 1, (ELECTION_HISTORY_MAX - 1) * sizeof el->hist[0]);
		el->n_hist--;
	}
	size_t i = el->n_hist;
	while (i > 0 && el->hist[i - 1].epoch > epoch) {
		el->hist[i] = el->hist[i - 1];
		i--;
	}
	el->hist[i].epoch = epoch;
	memcpy(el->hist[i].head, head, ELECTION_ID_LEN);
	el->n_hist++;
}

static int64_t unix_now(void)
{
	return (int64_t)time(NULL);
}

/* Writes an elections row; a failure is logged (the row is a record, the
 * decision already stands).  A second head for one epoch is a safety
 * violation: logged as an error. */
static void record(election *el, uint64_t epoch, const uint8_t *head, const uint8_t *cand,
		   int votes, int quorum, const char *outcome)
{
	store_election e;
	ds_err err = {0};
	memset(&e, 0, sizeof e);
	e.epoch = (int64_t)epoch;
	if (head)
		election_id_hex(head, e.head);
	if (cand)
		election_id_hex(cand, e.candidate);
	e.votes = votes;
	e.quorum = quorum;
	ds_strlcpy(e.outcome, outcome, sizeof e.outcome);
	e.ts = unix_now();
	int rc = store_election_put(el->p.store, &e, NULL, &err);
	if (rc == DS_EINTERNAL)
		log_error("election", "safety violation", "error=\"%s\"", err.msg);
	else if (rc)
		log_warn("election", "cannot record an election", "epoch=%llu error=\"%s\"",
			 (unsigned long long)epoch, err.msg);
	if (head)
		hist_add(el, epoch, head);
}


static void set_why(election *el, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_why(election *el, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(el->why, sizeof el->why, fmt, ap);
	va_end(ap);
}

/* ---- construction ---- */

election *election_new(const election_params *p, int64_t now_ms, ds_err *err)
{
	ds_err e = {0};
	if (!p->store || p->expect < 0 || p->expect > 100000 || p->settle_ms < 0 ||
	    p->lease_ms < 30 || (!p->single && p->expect > 0 && !p->send)) {
		ds_err_set(err, DS_EINVAL,
			   "election: bad parameters (store, expect %d, settle %d ms, lease %d ms, "
			   "send)",
			   p->expect, p->settle_ms, p->lease_ms);
		return NULL;
	}
	election *el = calloc(1, sizeof *el);
	if (!el) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	el->p = *p;
	election_id_hex(p->self_id, el->self_hex);
	pthread_mutex_init(&el->mu, NULL);
	el->rng = p->seed ^ 0x9E3779B97F4A7C15ULL;
	for (int i = 0; i < ELECTION_ID_LEN; i++)
		el->rng = el->rng * 1099511628211ULL ^ p->self_id[i];
	if (!el->rng)
		el->rng = 1;
	el->started_ms = now_ms;
	el->view_changed_ms = now_ms;

	int64_t maxe = 0, ve = 0;
	char vc[STORE_ID_HEX];
	store_election *rows = NULL;
	size_t nrows = 0;
	if (store_epoch_max(p->store, &maxe, &e) != DS_OK ||
	    store_vote_last(p->store, &ve, vc, &e) != DS_OK ||
	    store_election_list(p->store, ELECTION_HISTORY_MAX, &rows, &nrows, &e) != DS_OK) {
		ds_err_set(err, e.code ? e.code : DS_EIO, "election state: %s", e.msg);
		election_free(el);
		return NULL;
	}
	el->epoch = (uint64_t)maxe;
	if (ve > 0 && election_id_parse(vc, el->voted_for) == DS_OK)
		el->voted_epoch = (uint64_t)ve;
	for (size_t i = 0; i < nrows; i++) {
		uint8_t h[ELECTION_ID_LEN];
		if (rows[i].head[0] && election_id_parse(rows[i].head, h) == DS_OK) {
			hist_add(el, (uint64_t)rows[i].epoch, h);
			el->knows_head = 1;
			memcpy(el->head, h, ELECTION_ID_LEN);
			el->head_epoch = (uint64_t)rows[i].epoch;
		}
	}
	free(rows);
	el->formed = el->epoch > 0;
	el->role = GOSSIP_ROLE_NONE;
	if (p->single) {
		uint64_t ep = el->epoch + 1;
		if (el->n_hist && el->hist[el->n_hist - 1].epoch == el->epoch &&
		    is_self(el, el->hist[el->n_hist - 1].head))
			ep = el->epoch;
		el->epoch = ep;
		el->role = GOSSIP_ROLE_HEAD;
		el->knows_head = 1;
		memcpy(el->head, p->self_id, ELECTION_ID_LEN);
		el->head_epoch = ep;
		el->lease_until = NEVER;
		el->formed = 1;
		record(el, ep, p->self_id, p->self_id, 1, 1, "single");
		log_info("election", "single node: head", "epoch=%llu", (unsigned long long)ep);
	}
	return el;
}

void election_free(election *el)
{
	if (!el)
		return;
	pthread_mutex_destroy(&el->mu);
	free(el->view);
	free(el->acks);
	free(el);
}

/* ---- the view ---- */

static uint64_t id_hash(const uint8_t id[ELECTION_ID_LEN])
{
	uint64_t h = 1469598103934665603ULL;
	for (int i = 0; i < ELECTION_ID_LEN; i++)
		h = (h ^ id[i]) * 1099511628211ULL;
	h ^= h >> 31;
	return h * 0x94D049BB133111EBULL;
}

void election_set_view(election *el, const election_member *m, size_t n, int64_t now_ms)
{
	pthread_mutex_lock(&el->mu);
	if (n > el->cap_view) {
		election_member *v = realloc(el->view, n * sizeof *v);
		if (!v) { /* keep the old view; the next call retries */
			pthread_mutex_unlock(&el->mu);
			return;
		}
		el->view = v;
		el->cap_view = n;
	}
	if (n)
		memcpy(el->view, m, n * sizeof *m);
	el->n_view = n;
	uint64_t h = 0;
	for (size_t i = 0; i < n; i++) {
		election_member *x = &el->view[i];
		x->is_self = x->is_self || is_self(el, x->id);
		if (member_alive(x))
			h += id_hash(x->id); /* order-independent */
	}
	if (h != el->alive_hash) {
		el->alive_hash = h;
		el->view_changed_ms = now_ms;
	}
	pthread_mutex_unlock(&el->mu);
}

static uint64_t max_seen(const election *el)
{
	uint64_t e = el->epoch;
	for (size_t i = 0; i < el->n_view; i++) {
		const election_member *m = &el->view[i];
		if (m->epoch > e && m->epoch < ELECTION_EPOCH_MAX)
			e = m->epoch;
		if (m->head_epoch > e && m->head_epoch < ELECTION_EPOCH_MAX)
			e = m->head_epoch;
	}
	return e;
}

/* Ids of the other members that are alive (and suspect, with suspects). */
static size_t targets(const election *el, int suspects, uint8_t (**out)[ELECTION_ID_LEN])
{
	size_t n = 0;
	*out = NULL;
	if (!el->n_view)
		return 0;
	uint8_t(*to)[ELECTION_ID_LEN] = malloc(el->n_view * sizeof *to);
	if (!to)
		return 0;
	for (size_t i = 0; i < el->n_view; i++) {
		const election_member *m = &el->view[i];
		if (m->is_self)
			continue;
		if (m->state == GOSSIP_ALIVE || (suspects && m->state == GOSSIP_SUSPECT))
			memcpy(to[n++], m->id, ELECTION_ID_LEN);
	}
	*out = to;
	return n;
}

/* Sends m with the lock released; returns with it held again. */
static void send_round(election *el, const election_msg *m, uint8_t (*to)[ELECTION_ID_LEN],
		       size_t n, int timeout_ms, election_reply *rep, int *ans)
{
	for (size_t i = 0; i < n; i++) {
		ans[i] = 0;
		memset(&rep[i], 0, sizeof rep[i]);
	}
	if (!n)
		return;
	el->busy = 1;
	pthread_mutex_unlock(&el->mu);
	el->p.send(el->p.ud, m, (const uint8_t(*)[ELECTION_ID_LEN])to, n, timeout_ms, rep, ans);
	pthread_mutex_lock(&el->mu);
	el->busy = 0;
}

/* Raises el->epoch to the newest epoch in the replies; 1 when it rose. */
static int absorb_epochs(election *el, const election_reply *rep, const int *ans, size_t n)
{
	int rose = 0;
	for (size_t i = 0; i < n; i++)
		if (ans[i] && rep[i].epoch > el->epoch && rep[i].epoch < ELECTION_EPOCH_MAX) {
			el->epoch = rep[i].epoch;
			rose = 1;
		}
	return rose;
}

/* ---- the head ---- */

static void step_down(election *el, int64_t now, const char *why)
{
	char h[33];
	election_id_hex(el->p.self_id, h);
	log_warn("election", "head steps down", "epoch=%llu reason=\"%s\"",
		 (unsigned long long)el->head_epoch, why);
	el->role = GOSSIP_ROLE_NONE;
	el->lease_until = 0;
	el->n_acks = 0;
	el->promise_until = 0;
	el->ready_since = 0;
	el->retry_at = now + el->p.lease_ms;
	set_why(el, "stepped down as head of epoch %llu: %s", (unsigned long long)el->head_epoch,
		why);
}

static void ack_set(election *el, const uint8_t id[ELECTION_ID_LEN], int64_t at)
{
	for (size_t i = 0; i < el->n_acks; i++)
		if (memcmp(el->acks[i].id, id, ELECTION_ID_LEN) == 0) {
			if (at > el->acks[i].at)
				el->acks[i].at = at;
			return;
		}
	if (el->n_acks == el->cap_acks) {
		size_t nc = el->cap_acks ? el->cap_acks * 2 : 8;
		struct ack *a = realloc(el->acks, nc * sizeof *a);
		if (!a)
			return; /* one ack fewer: the lease may end early, never late */
		el->acks = a;
		el->cap_acks = nc;
	}
	memcpy(el->acks[el->n_acks].id, id, ELECTION_ID_LEN);
	el->acks[el->n_acks++].at = at;
}

static int cmp_desc(const void *a, const void *b)
{
	int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
	return x < y ? 1 : x > y ? -1 : 0;
}

/* lease_until = send time of the (quorum-1)-th newest ack + lease_ms. */
static void recompute_lease(election *el)
{
	int need = quorum_now(el) - 1;
	if (need <= 0) {
		el->lease_until = NEVER;
		return;
	}
	if ((size_t)need > el->n_acks) {
		el->lease_until = 0;
		return;
	}
	int64_t *t = malloc(el->n_acks * sizeof *t);
	if (!t) {
		el->lease_until = 0;
		return;
	}
	for (size_t i = 0; i < el->n_acks; i++)
		t[i] = el->acks[i].at;
	qsort(t, el->n_acks, sizeof *t, cmp_desc);
	el->lease_until = t[need - 1] + el->p.lease_ms;
	free(t);
}

static void heartbeat_round(election *el, int64_t now)
{
	uint64_t e = el->head_epoch;
	uint8_t(*to)[ELECTION_ID_LEN] = NULL;
	size_t n = targets(el, 1, &to);
	election_reply *rep = n ? calloc(n, sizeof *rep) : NULL;
	int *ans = n ? calloc(n, sizeof *ans) : NULL;
	if (n && (!rep || !ans))
		n = 0; /* no round this time: the lease decides */
	election_msg m;
	memset(&m, 0, sizeof m);
	m.kind = ELECTION_MSG_HEARTBEAT;
	m.epoch = e;
	memcpy(m.from, el->p.self_id, ELECTION_ID_LEN);
	m.n_history = el->n_hist;
	memcpy(m.history, el->hist, el->n_hist * sizeof el->hist[0]);
	send_round(el, &m, to, n, el->p.lease_ms / 3 > 10 ? el->p.lease_ms / 3 : 10, rep, ans);
	if (el->role == GOSSIP_ROLE_HEAD && el->head_epoch == e) {
		for (size_t i = 0; i < n; i++)
			if (ans[i] && rep[i].granted)
				ack_set(el, to[i], now);
		if (absorb_epochs(el, rep, ans, n)) {
			char msg[96];
			snprintf(msg, sizeof msg, "a member knows the newer epoch %llu",
				 (unsigned long long)el->epoch);
			step_down(el, now, msg);
		} else {
			el->next_heartbeat = now + el->p.lease_ms / 3;
			recompute_lease(el);
		}
	}
	free(to);
	free(rep);
	free(ans);
}

/* ---- candidacy ---- */

/* 1 when this node may stand now; *pos = its place among the members that
 * may (0 = best ranked).  Otherwise el->why says why not. */
static int can_stand(election *el, int64_t now, int *pos)
{
	int alive, known;
	counts(el, &alive, &known);
	int q = quorum_now(el);
	if (!el->p.eligible) {
		set_why(el, "this node is not eligible (--eligible=false): it only votes");
		return 0;
	}
	if (!el->formed) {
		if (alive < el->p.expect) {
			set_why(el, "formation: %d of %d expected members alive", alive, el->p.expect);
			return 0;
		}
		if (now - el->view_changed_ms < el->p.settle_ms) {
			set_why(el, "formation: membership settling (%lld of %d ms)",
				(long long)(now - el->view_changed_ms), el->p.settle_ms);
			return 0;
		}
		el->formed = 1;
	}
	if (alive < q) {
		set_why(el, "no quorum: %d members alive, %d needed", alive, q);
		return 0;
	}
	if (now - el->started_ms < el->p.lease_ms) {
		set_why(el, "just started: listening for a head for %d ms", el->p.lease_ms);
		return 0;
	}
	election_member me;
	memset(&me, 0, sizeof me);
	memcpy(me.id, el->p.self_id, ELECTION_ID_LEN);
	me.eligible = 1;
	me.priority = el->p.priority;
	int p = 0;
	for (size_t i = 0; i < el->n_view; i++) {
		const election_member *m = &el->view[i];
		if (m->is_self || m->state != GOSSIP_ALIVE)
			continue;
		if (m->role == GOSSIP_ROLE_HEAD) {
			set_why(el, "member %s advertises the head role", m->name);
			return 0;
		}
		if (!m->eligible || (el->knows_head && memcmp(m->id, el->head, ELECTION_ID_LEN) == 0))
			continue; /* the head whose lease ran out is left out of the order */
		if (election_rank_cmp(m, &me) < 0)
			p++;
	}
	*pos = p;
	return 1;
}

static void stand(election *el, int64_t now)
{
	int q = quorum_now(el);
	uint8_t(*to)[ELECTION_ID_LEN] = NULL;
	election_reply *rep = NULL;
	int *ans = NULL;
	size_t n = targets(el, 0, &to);
	if (n) {
		rep = calloc(n, sizeof *rep);
		ans = calloc(n, sizeof *ans);
		if (!rep || !ans)
			goto out;
	}
	election_msg m;
	memset(&m, 0, sizeof m);
	m.kind = ELECTION_MSG_PREVOTE;
	m.epoch = max_seen(el) + 1;
	memcpy(m.from, el->p.self_id, ELECTION_ID_LEN);
	int timeout = el->p.lease_ms / 2;
	send_round(el, &m, to, n, timeout, rep, ans);
	absorb_epochs(el, rep, ans, n);
	if (el->role != GOSSIP_ROLE_NONE || el->promise_until > now)
		goto out; /* a head or another candidate appeared meanwhile */
	int got = 1;
	for (size_t i = 0; i < n; i++)
		got += ans[i] && rep[i].granted;
	if (got < q) {
		set_why(el, "pre-vote for epoch %llu: %d of %d votes", (unsigned long long)m.epoch, got,
			q);
		el->retry_at = now + el->p.lease_ms / 2 + jitter(el, el->p.lease_ms / 2);
		el->ready_since = 0;
		goto out;
	}
	/* The real vote: our own vote first, on disk. */
	uint64_t e = m.epoch > el->epoch ? m.epoch : el->epoch + 1;
	if (e >= ELECTION_EPOCH_MAX)
		goto out;
	ds_err err = {0};
	if (store_vote_put(el->p.store, (int64_t)e, el->self_hex, unix_now(), NULL, &err) != DS_OK) {
		set_why(el, "cannot record this node's own vote: %s", err.msg);
		el->retry_at = now + el->p.lease_ms;
		el->ready_since = 0;
		goto out;
	}
	el->epoch = e;
	el->voted_epoch = e;
	memcpy(el->voted_for, el->p.self_id, ELECTION_ID_LEN);
	memcpy(el->promise_to, el->p.self_id, ELECTION_ID_LEN);
	el->promise_until = now + el->p.lease_ms;
	el->role = GOSSIP_ROLE_CANDIDATE;
	record(el, e, NULL, el->p.self_id, -1, q, "standing");
	log_info("election", "standing", "epoch=%llu quorum=%d members=%zu",
		 (unsigned long long)e, q, n + 1);
	free(to);
	to = NULL;
	n = targets(el, 0, &to);
	free(rep);
	free(ans);
	rep = n ? calloc(n, sizeof *rep) : NULL;
	ans = n ? calloc(n, sizeof *ans) : NULL;
	if (n && (!rep || !ans))
		n = 0;
	m.kind = ELECTION_MSG_VOTE;
	m.epoch = e;
	send_round(el, &m, to, n, timeout, rep, ans);
	if (el->role != GOSSIP_ROLE_CANDIDATE || el->epoch != e)
		goto out; /* something newer happened meanwhile */
	int votes = 1;
	for (size_t i = 0; i < n; i++)
		votes += ans[i] && rep[i].granted;
	absorb_epochs(el, rep, ans, n);
	if (votes >= q && el->epoch == e) {
		el->role = GOSSIP_ROLE_HEAD;
		el->knows_head = 1;
		memcpy(el->head, el->p.self_id, ELECTION_ID_LEN);
		el->head_epoch = e;
		el->n_acks = 0;
		for (size_t i = 0; i < n; i++)
			if (ans[i] && rep[i].granted)
				ack_set(el, to[i], now);
		recompute_lease(el);
		el->next_heartbeat = now;
		el->why[0] = '\0';
		record(el, e, el->p.self_id, el->p.self_id, votes, q, "won");
		log_info("election", "elected head", "epoch=%llu votes=%d quorum=%d",
			 (unsigned long long)e, votes, q);
	} else {
		el->role = GOSSIP_ROLE_NONE;
		el->promise_until = 0;
		record(el, e, NULL, el->p.self_id, votes, q, "lost");
		set_why(el, "lost the election of epoch %llu: %d of %d votes", (unsigned long long)e,
			votes, q);
		log_info("election", "lost", "epoch=%llu votes=%d quorum=%d", (unsigned long long)e,
			 votes, q);
		el->retry_at = now + el->p.lease_ms + jitter(el, el->p.lease_ms / 2);
		el->ready_since = 0;
	}
out:
	free(to);
	free(rep);
	free(ans);
}

void election_tick(election *el, int64_t now_ms)
{
	pthread_mutex_lock(&el->mu);
	if (el->p.single || el->busy)
		goto out;
	if (el->p.expect <= 0) {
		set_why(el, "elections are off: --expect is 0 (set it to the cluster size)");
		goto out;
	}
	if (el->role == GOSSIP_ROLE_HEAD) {
		if (now_ms >= el->lease_until) {
			char msg[96];
			snprintf(msg, sizeof msg, "fewer than %d members acknowledged it within %d ms",
				 quorum_now(el) - 1, el->p.lease_ms);
			step_down(el, now_ms, msg);
		} else if (now_ms >= el->next_heartbeat) {
			heartbeat_round(el, now_ms);
		}
		goto out;
	}
	if (el->promise_until > now_ms) {
		el->ready_since = 0;
		goto out;
	}
	if (el->role == GOSSIP_ROLE_FOLLOWER) {
		char h[33];
		election_id_hex(el->head, h);
		log_warn("election", "head lost", "head=%s epoch=%llu reason=\"no heartbeat for %d ms\"",
			 h, (unsigned long long)el->head_epoch, el->p.lease_ms);
		el->role = GOSSIP_ROLE_NONE;
	}
	int pos = 0;
	if (!can_stand(el, now_ms, &pos)) {
		el->ready_since = 0;
		goto out;
	}
	if (!el->ready_since) {
		el->ready_since = now_ms;
		el->ready_delay = (int64_t)pos * (el->p.lease_ms / 2) + jitter(el, el->p.lease_ms / 4);
	}
	int64_t at = el->ready_since + el->ready_delay;
	if (at < el->retry_at)
		at = el->retry_at;
	if (now_ms < at) {
		set_why(el, "no head yet: this node (rank %d) stands in %lld ms", pos + 1,
			(long long)(at - now_ms));
		goto out;
	}
	stand(el, now_ms);
out:
	pthread_mutex_unlock(&el->mu);
}

/* ---- messages from other agents ---- */

static int deny(election_reply *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int deny(election_reply *r, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(r->reason, sizeof r->reason, fmt, ap);
	va_end(ap);
	r->granted = 0;
	return DS_OK;
}

static int decide(election *el, const election_msg *m, int64_t now, election_reply *r)
{
	char ch[33], other[33];
	election_id_hex(m->from, ch);
	const election_member *c = find(el, m->from);
	if (!c || c->state != GOSSIP_ALIVE)
		return deny(r, "candidate %s is not alive in this node's view", ch);
	if (!c->eligible)
		return deny(r, "candidate %s is not eligible", c->name);
	if (el->knows_head && m->epoch <= el->head_epoch)
		return deny(r, "epoch %llu is not newer than the head's epoch %llu",
			    (unsigned long long)m->epoch, (unsigned long long)el->head_epoch);
	if (m->epoch < el->epoch)
		return deny(r, "epoch %llu is older than this node's epoch %llu",
			    (unsigned long long)m->epoch, (unsigned long long)el->epoch);
	if (el->role == GOSSIP_ROLE_HEAD && now < el->lease_until)
		return deny(r, "this node is the head of epoch %llu and holds its lease",
			    (unsigned long long)el->head_epoch);
	if (el->promise_until > now && memcmp(el->promise_to, m->from, ELECTION_ID_LEN) != 0) {
		election_id_hex(el->promise_to, other);
		return deny(r, "promised to %s for %lld ms more (its lease)", other,
			    (long long)(el->promise_until - now));
	}
	if (el->voted_epoch == m->epoch && memcmp(el->voted_for, m->from, ELECTION_ID_LEN) != 0) {
		election_id_hex(el->voted_for, other);
		return deny(r, "already voted for %s in epoch %llu", other,
			    (unsigned long long)m->epoch);
	}
	if (m->kind == ELECTION_MSG_PREVOTE) {
		r->granted = 1;
		return DS_OK;
	}
	ds_err err = {0};
	char had[STORE_ID_HEX];
	int rc = store_vote_put(el->p.store, (int64_t)m->epoch, ch, unix_now(), had, &err);
	if (rc == DS_EBUSY)
		return deny(r, "already voted for %s in epoch %llu", had,
			    (unsigned long long)m->epoch);
	if (rc) {
		deny(r, "cannot record the vote: %s", err.msg);
		return rc;
	}
	el->voted_epoch = m->epoch;
	memcpy(el->voted_for, m->from, ELECTION_ID_LEN);
	if (m->epoch > el->epoch)
		el->epoch = m->epoch;
	memcpy(el->promise_to, m->from, ELECTION_ID_LEN);
	el->promise_until = now + el->p.lease_ms;
	if (el->role != GOSSIP_ROLE_NONE) { /* a newer epoch begins: no longer head/candidate */
		el->role = GOSSIP_ROLE_NONE;
		el->lease_until = 0;
		el->n_acks = 0;
	}
	el->ready_since = 0;
	r->granted = 1;
	return DS_OK;
}

static void on_heartbeat(election *el, const election_msg *m, int64_t now, election_reply *r)
{
	char hh[33], other[33];
	election_id_hex(m->from, hh);
	if (m->epoch < el->epoch) {
		deny(r, "stale epoch %llu: this node is at epoch %llu", (unsigned long long)m->epoch,
		     (unsigned long long)el->epoch);
		return;
	}
	if (el->knows_head && el->head_epoch == m->epoch &&
	    memcmp(el->head, m->from, ELECTION_ID_LEN) != 0) {
		election_id_hex(el->head, other);
		log_error("election", "two heads claim one epoch", "epoch=%llu known=%s claimant=%s",
			  (unsigned long long)m->epoch, other, hh);
		deny(r, "epoch %llu already has head %s here", (unsigned long long)m->epoch, other);
		return;
	}
	int fresh = !(el->knows_head && el->head_epoch == m->epoch);
	if (el->role == GOSSIP_ROLE_HEAD || el->role == GOSSIP_ROLE_CANDIDATE)
		log_info("election", "yields to a newer head", "head=%s epoch=%llu", hh,
			 (unsigned long long)m->epoch);
	if (m->epoch > el->epoch)
		el->epoch = m->epoch;
	el->role = GOSSIP_ROLE_FOLLOWER;
	el->knows_head = 1;
	memcpy(el->head, m->from, ELECTION_ID_LEN);
	el->head_epoch = m->epoch;
	memcpy(el->promise_to, m->from, ELECTION_ID_LEN);
	el->promise_until = now + el->p.lease_ms;
	el->lease_until = 0;
	el->n_acks = 0;
	el->ready_since = 0;
	el->why[0] = '\0';
	if (fresh) {
		record(el, m->epoch, m->from, NULL, -1, -1, "followed");
		log_info("election", "following head", "head=%s epoch=%llu", hh,
			 (unsigned long long)m->epoch);
	}
	for (size_t i = 0; i < m->n_history && i < ELECTION_HISTORY_MAX; i++) {
		const election_entry *h = &m->history[i];
		if (h->epoch == 0 || h->epoch > m->epoch || hist_has(el, h->epoch))
			continue;
		if (el->n_hist == ELECTION_HISTORY_MAX && h->epoch < el->hist[0].epoch)
			continue;
		record(el, h->epoch, h->head, NULL, -1, -1, "learned");
	}
	r->granted = 1;
}

static int head_valid(const election *el, int64_t now)
{
	if (el->role == GOSSIP_ROLE_HEAD)
		return now < el->lease_until;
	return el->knows_head && el->promise_until > now &&
	       memcmp(el->promise_to, el->head, ELECTION_ID_LEN) == 0;
}

int election_handle(election *el, const election_msg *m, int64_t now_ms, election_reply *r)
{
	int rc = DS_OK;
	memset(r, 0, sizeof *r);
	pthread_mutex_lock(&el->mu);
	if (el->p.single || el->p.expect <= 0)
		deny(r, "elections are off on this node (%s)",
		     el->p.single ? "single node" : "--expect 0");
	else if (m->epoch == 0 || m->epoch >= ELECTION_EPOCH_MAX)
		deny(r, "epoch %llu out of range", (unsigned long long)m->epoch);
	else if (is_self(el, m->from))
		deny(r, "a message from this node's own id");
	else if (m->kind == ELECTION_MSG_PREVOTE || m->kind == ELECTION_MSG_VOTE)
		rc = decide(el, m, now_ms, r);
	else if (m->kind == ELECTION_MSG_HEARTBEAT)
		on_heartbeat(el, m, now_ms, r);
	else
		deny(r, "unknown message kind %d", m->kind);
	r->epoch = el->epoch;
	r->has_head = head_valid(el, now_ms);
	if (el->knows_head) {
		memcpy(r->head, el->head, ELECTION_ID_LEN);
		r->head_epoch = el->head_epoch;
	}
	pthread_mutex_unlock(&el->mu);
	return rc;
}

/* ---- status, history, fencing ---- */

void election_status_get(election *el, int64_t now_ms, election_status *out)
{
	memset(out, 0, sizeof *out);
	pthread_mutex_lock(&el->mu);
	int valid = head_valid(el, now_ms);
	out->role = el->role;
	if ((el->role == GOSSIP_ROLE_HEAD || el->role == GOSSIP_ROLE_FOLLOWER) && !valid)
		out->role = GOSSIP_ROLE_NONE;
	out->epoch = el->epoch;
	out->has_head = valid;
	if (el->knows_head) {
		memcpy(out->head, el->head, ELECTION_ID_LEN);
		out->head_epoch = el->head_epoch;
	}
	if (valid && el->role == GOSSIP_ROLE_HEAD)
		out->lease_left_ms = el->lease_until == NEVER ? -1 : el->lease_until - now_ms;
	else if (valid)
		out->lease_left_ms = el->promise_until - now_ms;
	counts(el, &out->alive, &out->known);
	out->expect = el->p.single ? 1 : el->p.expect;
	out->quorum = quorum_now(el);
	out->formed = el->formed;
	out->single = el->p.single;
	out->eligible = el->p.eligible;
	out->priority = el->p.priority;
	out->voted_epoch = el->voted_epoch;
	memcpy(out->voted_for, el->voted_for, ELECTION_ID_LEN);
	if (!valid)
		ds_strlcpy(out->why, el->why[0] ? el->why : "no head yet", sizeof out->why);
	pthread_mutex_unlock(&el->mu);
}

int election_fence(election *el, uint64_t epoch, int64_t now_ms, ds_err *err)
{
	int rc = DS_OK;
	pthread_mutex_lock(&el->mu);
	uint64_t known = el->epoch > el->head_epoch ? el->epoch : el->head_epoch;
	if (epoch < known) {
		rc = ds_err_set(err, DS_EPERM,
				"stale epoch %llu: this node knows epoch %llu (head epoch %llu)",
				(unsigned long long)epoch, (unsigned long long)known,
				(unsigned long long)el->head_epoch);
	} else if (!head_valid(el, now_ms)) {
		rc = ds_err_set(err, DS_EBUSY, "epoch %llu: this node recognises no head now (%s)",
				(unsigned long long)epoch, el->why[0] ? el->why : "lease expired");
	} else if (epoch != el->head_epoch) {
		rc = ds_err_set(err, DS_EBUSY,
				"epoch %llu is newer than this node's head epoch %llu (retry once its "
				"heartbeat arrives)",
				(unsigned long long)epoch, (unsigned long long)el->head_epoch);
	}
	pthread_mutex_unlock(&el->mu);
	return rc;
}

/* ---- JSON ---- */

static const char *kind_name(int kind)
{
	switch (kind) {
	case ELECTION_MSG_PREVOTE:
		return "prevote";
	case ELECTION_MSG_VOTE:
		return "vote";
	case ELECTION_MSG_HEARTBEAT:
		return "heartbeat";
	default:
		return "?";
	}
}

json_t *election_msg_json(const election_msg *m)
{
	char from[33], h[33];
	election_id_hex(m->from, from);
	json_t *hist = json_array();
	json_t *o = json_pack("{s:s,s:I,s:s}", "kind", kind_name(m->kind), "epoch",
			      (json_int_t)m->epoch, "from", from);
	if (!o || !hist)
		goto fail;
	for (size_t i = 0; i < m->n_history && i < ELECTION_HISTORY_MAX; i++) {
		election_id_hex(m->history[i].head, h);
		if (json_array_append_new(hist, json_pack("{s:I,s:s}", "epoch",
							  (json_int_t)m->history[i].epoch, "head",
							  h)) != 0)
			goto fail;
	}
	if (json_object_set_new(o, "history", hist) != 0) {
		hist = NULL;
		goto fail;
	}
	return o;
fail:
	json_decref(hist);
	json_decref(o);
	return NULL;
}

static int get_epoch(const json_t *j, const char *key, uint64_t min, uint64_t *out, ds_err *err)
{
	const json_t *v = json_object_get(j, key);
	if (!json_is_integer(v) || json_integer_value(v) < (json_int_t)min ||
	    (uint64_t)json_integer_value(v) >= ELECTION_EPOCH_MAX)
		return ds_err_set(err, DS_EFORMAT, "'%s' must be an integer in [%llu, 2^53)", key,
				  (unsigned long long)min);
	*out = (uint64_t)json_integer_value(v);
	return DS_OK;
}

static int get_id(const json_t *j, const char *key, uint8_t id[ELECTION_ID_LEN], ds_err *err)
{
	const json_t *v = json_object_get(j, key);
	if (!json_is_string(v) || election_id_parse(json_string_value(v), id) != DS_OK)
		return ds_err_set(err, DS_EFORMAT, "'%s' must be a node id (32 lowercase hex digits)",
				  key);
	return DS_OK;
}

int election_msg_parse(const json_t *j, election_msg *m, ds_err *err)
{
	memset(m, 0, sizeof *m);
	if (!json_is_object(j))
		return ds_err_set(err, DS_EFORMAT, "an election message must be a JSON object");
	const char *k = json_string_value(json_object_get(j, "kind"));
	if (!k)
		return ds_err_set(err, DS_EFORMAT, "'kind' must be prevote, vote or heartbeat");
	if (strcmp(k, "prevote") == 0)
		m->kind = ELECTION_MSG_PREVOTE;
	else if (strcmp(k, "vote") == 0)
		m->kind = ELECTION_MSG_VOTE;
	else if (strcmp(k, "heartbeat") == 0)
		m->kind = ELECTION_MSG_HEARTBEAT;
	else
		return ds_err_set(err, DS_EFORMAT, "'kind' must be prevote, vote or heartbeat");
	int rc = get_epoch(j, "epoch", 1, &m->epoch, err);
	if (!rc)
		rc = get_id(j, "from", m->from, err);
	if (rc)
		return rc;
	const json_t *hist = json_object_get(j, "history");
	if (!hist)
		return DS_OK;
	if (!json_is_array(hist) || json_array_size(hist) > ELECTION_HISTORY_MAX)
		return ds_err_set(err, DS_EFORMAT, "'history' must be a list of at most %d entries",
				  ELECTION_HISTORY_MAX);
	for (size_t i = 0; i < json_array_size(hist); i++) {
		const json_t *e = json_array_get(hist, i);
		if ((rc = get_epoch(e, "epoch", 1, &m->history[i].epoch, err)) ||
		    (rc = get_id(e, "head", m->history[i].head, err)))
			return ds_err_wrap(err, "history[%zu]", i);
	}
	m->n_history = json_array_size(hist);
	return DS_OK;
}

json_t *election_reply_json(const election_reply *r)
{
	char h[33];
	election_id_hex(r->head, h);
	int zero = 1;
	for (int i = 0; i < ELECTION_ID_LEN; i++)
		zero &= r->head[i] == 0;
	return json_pack("{s:b,s:I,s:b,s:o,s:I,s:s}", "granted", r->granted, "epoch",
			 (json_int_t)r->epoch, "has_head", r->has_head, "head",
			 zero ? json_null() : json_string(h), "head_epoch", (json_int_t)r->head_epoch,
			 "reason", r->reason);
}

int election_reply_parse(const json_t *j, election_reply *r, ds_err *err)
{
	memset(r, 0, sizeof *r);
	if (!json_is_object(j))
		return ds_err_set(err, DS_EFORMAT, "an election reply must be a JSON object");
	const json_t *g = json_object_get(j, "granted");
	if (!json_is_boolean(g))
		return ds_err_set(err, DS_EFORMAT, "'granted' must be true or false");
	r->granted = json_is_true(g);
	r->has_head = json_is_true(json_object_get(j, "has_head"));
	int rc = get_epoch(j, "epoch", 0, &r->epoch, err);
	if (!rc)
		rc = get_epoch(j, "head_epoch", 0, &r->head_epoch, err);
	if (rc)
		return rc;
	const json_t *h = json_object_get(j, "head");
	if (!json_is_null(h) && h && (rc = get_id(j, "head", r->head, err)))
		return rc;
	const char *why = json_string_value(json_object_get(j, "reason"));
	ds_strlcpy(r->reason, why ? why : "", sizeof r->reason);
	return DS_OK;
}
