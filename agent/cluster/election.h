/*
 * election.h - head election: lowest-rank candidate, majority-acked epoch,
 * leased head (docs/cluster.md "Election"; the research notes' section 2.3,
 * with a pre-vote round added).
 *
 * One election instance per agent.  Its owner (agent/cluster/cluster.c) feeds it the
 * gossip view (election_set_view), calls election_tick on a timer, and hands
 * it the messages of other agents (election_handle); the instance sends its
 * own messages through the send callback (HTTP to the peers' control APIs in
 * the agent, direct calls in tests).  Time is passed in (now_ms, a monotonic
 * clock in milliseconds), so tests drive it with a fake clock.
 *
 * Roles (GOSSIP_ROLE_* values, published in the gossip metadata):
 *
 *          tick: gate open, best ranked, pre-vote majority
 *   NONE --------------------------------------------------> CANDIDATE
 *    ^  ^                                                     |   |
 *    |  | promise expired (no heartbeat for lease_ms)         |   | votes >= quorum
 *    |  +--------- FOLLOWER <--- heartbeat, epoch >= mine ----+   v
 *    |                ^        (from any role but a newer head)  HEAD
 *    |                +--------------------------------------------+
 *    |  votes < quorum (retry after lease_ms + jitter)              |
 *    +-------------------------------------------------------------+
 *       lease lost: fewer than quorum-1 acks within lease_ms, or a reply
 *       with a newer epoch (step down)
 *
 * Rules (the proof sketch is in docs/cluster.md):
 *  1. One vote per epoch, committed to SQLite (synchronous=FULL) before the
 *     reply that grants it; a candidate votes for itself the same way.
 *  2. A head needs votes from quorum = floor(N/2)+1 nodes, N = max(--expect,
 *     members known that have not left): a minority never elects.
 *  3. Granting a vote or acking a heartbeat promises the sender lease_ms
 *     without voting for anybody else (measured from the receipt); the head
 *     holds its lease until lease_ms after the send time of its (quorum-1)-th
 *     most recent ack, so its lease ends before any promise it counts on.
 *  4. No candidacy while this node follows a head with a valid promise or
 *     sees a live member advertising the head role: a better-ranked node that
 *     (re)joins does not preempt a healthy head.
 *  5. Pre-vote: a candidate first asks whether it would get the votes,
 *     changing nothing; only with a majority does it bump the epoch.  So a
 *     node cut off from the majority never raises epochs that would depose
 *     the head when the partition heals.
 *
 * Threading: every function may be called from any thread; one mutex guards
 * the state and is not held while send runs.
 */
#ifndef DS_AGENT_ELECTION_H
#define DS_AGENT_ELECTION_H

#include "agent/cluster/gossip.h"
#include "agent/store/store.h"
#include "common/status.h"

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#define ELECTION_ID_LEN 16
#define ELECTION_HISTORY_MAX 16
#define ELECTION_EPOCH_MAX ((uint64_t)1 << 53) /* epochs travel as JSON integers */

/* One member of the gossip view, as the election needs it. */
typedef struct election_member {
	uint8_t id[ELECTION_ID_LEN];
	char name[GOSSIP_NAME_MAX + 1];
	int state;               /* GOSSIP_ALIVE, GOSSIP_SUSPECT, GOSSIP_DEAD, GOSSIP_LEFT */
	int is_self;
	int eligible;            /* from its metadata */
	int32_t priority;
	int role;                /* GOSSIP_ROLE_* it advertises */
	uint64_t epoch;          /* highest epoch it advertises */
	uint64_t head_epoch;
} election_member;

enum election_msg_kind {
	ELECTION_MSG_PREVOTE = 1, /* "would you vote for me in epoch e?" (changes nothing) */
	ELECTION_MSG_VOTE = 2,    /* "vote for me in epoch e" */
	ELECTION_MSG_HEARTBEAT = 3, /* "I am the head of epoch e" (+ the epoch history) */
};

typedef struct election_entry {
	uint64_t epoch;
	uint8_t head[ELECTION_ID_LEN];
} election_entry;

typedef struct election_msg {
	int kind;                /* enum election_msg_kind */
	uint64_t epoch;
	uint8_t from[ELECTION_ID_LEN];
	size_t n_history;        /* heartbeats: the newest known (epoch, head) pairs */
	election_entry history[ELECTION_HISTORY_MAX];
} election_msg;

typedef struct election_reply {
	int granted;             /* vote granted / heartbeat acknowledged */
	uint64_t epoch;          /* the responder's epoch after handling the message */
	int has_head;            /* it follows (or is) a head with a valid lease */
	uint8_t head[ELECTION_ID_LEN];
	uint64_t head_epoch;
	char reason[160];        /* why not granted ("" when granted) */
} election_reply;

/* Sends m to the n members in to[] and waits at most timeout_ms; fills
 * replies[i] and answered[i] (1 = a reply came back).  Called without the
 * election's lock. */
typedef void (*election_send_fn)(void *ud, const election_msg *m,
				 const uint8_t (*to)[ELECTION_ID_LEN], size_t n, int timeout_ms,
				 election_reply *replies, int *answered);

typedef struct election_params {
	uint8_t self_id[ELECTION_ID_LEN];
	int expect;            /* configured cluster size N; 0 = never elect (gossip only) */
	int settle_ms;         /* formation: the alive set unchanged this long */
	int lease_ms;          /* head lease and follower promise */
	int eligible;          /* this node may become head */
	int32_t priority;      /* higher ranks first */
	int single;            /* no gossip: this node is the cluster, head at once */
	store *store;          /* votes and elections (not owned) */
	election_send_fn send; /* NULL only with single */
	void *ud;
	uint64_t seed;         /* of the jitter */
} election_params;

/* expect 0, settle 3000 ms, lease 5000 ms, eligible, priority 0. */
election_params election_default_params(void);

/* Loads the persisted epoch, vote and history from p->store.  With single,
 * this node becomes head at once: of the newest recorded epoch when it was
 * its head, else of the next epoch (1 on a new store).  NULL with err
 * (DS_EINVAL for bad parameters, the store's code). */
typedef struct election election;
election *election_new(const election_params *p, int64_t now_ms, ds_err *err);
/* NULL is a no-op.  No other call may be in progress. */
void election_free(election *el);

/* Replaces the view (self included, is_self set; a missing self counts as
 * alive).  A change of the alive set restarts the formation settle time. */
void election_set_view(election *el, const election_member *m, size_t n, int64_t now_ms);

/* Advances timers: a head renews its lease (a heartbeat round every
 * lease_ms/3) or steps down; a node without a head may stand.  Blocks for the
 * duration of one round of messages at most (lease_ms/2). */
void election_tick(election *el, int64_t now_ms);

/* Handles another agent's message and fills *r (always).  DS_OK, or the
 * store's error when a vote could not be recorded (then r->granted is 0). */
int election_handle(election *el, const election_msg *m, int64_t now_ms, election_reply *r);

typedef struct election_status {
	int role;                /* GOSSIP_ROLE_* */
	uint64_t epoch;          /* highest epoch known here */
	int has_head;            /* a head with a valid lease (this node, or the one it follows) */
	uint8_t head[ELECTION_ID_LEN];
	uint64_t head_epoch;     /* epoch of that head (of the last known one when !has_head) */
	int64_t lease_left_ms;   /* head: its lease; follower: its promise; else 0 */
	int expect, quorum;      /* configured size; votes needed now */
	int alive, known;        /* members alive (self included); members not left */
	int formed;              /* the formation gate was passed (or an epoch is known) */
	int single;
	int eligible;
	int32_t priority;
	uint64_t voted_epoch;    /* this node's newest vote */
	uint8_t voted_for[ELECTION_ID_LEN];
	char why[192];           /* with no head: why ("formation: 3 of 5 alive", ...) */
} election_status;

void election_status_get(election *el, int64_t now_ms, election_status *out);


/* Fencing, for every plan, launch and abort that carries an epoch: DS_OK when
 * epoch is the reign this node currently recognises (it is the head with a
 * valid lease, or it follows that head with a valid promise).  DS_EPERM for
 * a stale epoch (older than one this node knows: the message names both),
 * DS_EBUSY for no current head or an epoch newer than this node has heard of
 * (retry later). */
int election_fence(election *el, uint64_t epoch, int64_t now_ms, ds_err *err);

/* floor(n/2) + 1 (1 for n <= 1). */
int election_quorum(int n);
/* Rank order: eligible first, then higher priority, then lower node id.
 * Negative when a ranks before b. */
int election_rank_cmp(const election_member *a, const election_member *b);

/* "none", "follower", "candidate", "head". */
const char *election_role_name(int role);

/* JSON forms of messages and replies (the control API's election routes):
 * {"kind":"prevote"|"vote"|"heartbeat","epoch":n,"from":hex,
 *  "history":[{"epoch":n,"head":hex}]} and {"granted":b,"epoch":n,
 *  "head":hex|null,"head_epoch":n,"reason":s}.  The parsers validate every
 * field (DS_EFORMAT naming it). */
json_t *election_msg_json(const election_msg *m);
int election_msg_parse(const json_t *j, election_msg *m, ds_err *err);
json_t *election_reply_json(const election_reply *r);
int election_reply_parse(const json_t *j, election_reply *r, ds_err *err);

/* 32 lowercase hex digits of an id; DS_EFORMAT unless text is exactly that. */
void election_id_hex(const uint8_t id[ELECTION_ID_LEN], char out[33]);
int election_id_parse(const char *text, uint8_t id[ELECTION_ID_LEN]);

#endif
