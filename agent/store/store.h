/*
 * store.h - the agent's SQLite database (DATA_DIR/dsagent.db).
 *
 * The only module that runs SQL.  store_open creates the data directory
 * (0700), takes its lock (one agent per data directory), creates the
 * database when missing, turns on WAL, a busy timeout and
 * foreign keys, and applies the numbered migrations of schema/ (compiled into
 * the binary) that the file lacks, each in its own transaction that also sets
 * PRAGMA user_version.  A database written by a newer dsagent (user_version
 * above what this binary knows) is refused, never modified.
 *
 * Threading: one connection guarded by a mutex; every function may be called
 * from any thread.  Times are Unix seconds (UTC).
 */
#ifndef DS_AGENT_STORE_H
#define DS_AGENT_STORE_H

#include "common/status.h"

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

typedef struct store store;

#define STORE_NAME_MAX 64 /* key names: 1..64 characters */
#define STORE_PREFIX_LEN 8
#define STORE_HASH_LEN 32

/* One row of api_keys, with usage totals summed from key_usage when it comes
 * from store_key_list (zero from store_key_insert).  0 in expires, revoked_at,
 * last_used means NULL (never / not revoked / never used); 0 in rpm, tpm,
 * max_concurrency means unlimited. */
typedef struct store_key {
	int64_t id;
	char name[STORE_NAME_MAX + 1];
	char prefix[STORE_PREFIX_LEN + 1];
	uint8_t hash[STORE_HASH_LEN];
	int64_t created, expires, revoked_at, last_used;
	int64_t rpm, tpm, max_concurrency;
	int64_t requests, prompt_tokens, completion_tokens;
} store_key;

/* Takes the data directory's lock (DATA_DIR/dsagent.lock, flock, our pid
 * written in it; held until store_close), then opens or creates
 * DATA_DIR/dsagent.db; NULL with err filled on failure (DS_EBUSY: another
 * process holds the lock, the message names its pid, and nothing of the
 * directory was touched; DS_EIO: directory or file; DS_EUNSUPPORTED: the
 * database is newer than this binary; DS_EFORMAT: not a database or a
 * migration failed). */
store *store_open(const char *data_dir, ds_err *err);
/* NULL is a no-op. */
void store_close(store *s);

/* user_version of the open database; the newest version this binary knows. */
int store_schema_version(store *s);
int store_schema_latest(void);
/* Path of the database file; borrowed until store_close. */
const char *store_path(const store *s);

/* Inserts k (id ignored) and sets k->id.  DS_EBUSY when a key that is not
 * revoked already has this name or this hash (message says which). */
int store_key_insert(store *s, store_key *k, ds_err *err);

/* All keys (revoked ones too when include_revoked), ordered by id, with usage
 * totals.  *out is malloc'd (caller frees with free(); NULL when *n == 0). */
int store_key_list(store *s, int include_revoked, store_key **out, size_t *n, ds_err *err);

/* One key by id with its totals; DS_ENOTFOUND when there is none. */
int store_key_get(store *s, int64_t id, store_key *out, ds_err *err);

/* Sets revoked_at = now unless already revoked (then *was_revoked = 1 and the
 * row is unchanged).  DS_ENOTFOUND for an unknown id.  was_revoked may be NULL. */
int store_key_revoke(store *s, int64_t id, int64_t now, int *was_revoked, ds_err *err);

/* Adds one request and its tokens to key_usage(id, day of now, UTC) and sets
 * last_used = now, in one transaction. */
int store_key_usage_add(store *s, int64_t id, int64_t now, int64_t prompt_tokens,
			int64_t completion_tokens, ds_err *err);

/* Appends to the event log; detail_json is a JSON object as text, or NULL. */
int store_event_add(store *s, int64_t ts, const char *kind, const char *detail_json,
		    ds_err *err);

typedef struct store_event {
	int64_t id, ts;
	char kind[64];
	char *detail; /* malloc'd JSON text or NULL */
} store_event;

/* Events with id > after_id, oldest first, at most max.  *out is malloc'd;
 * free it with store_events_free. */
int store_event_list(store *s, int64_t after_id, size_t max, store_event **out, size_t *n,
		     ds_err *err);
void store_events_free(store_event *ev, size_t n);

/* ---- the cluster record (schema/0002_cluster.sql, docs/cluster.md) ---- */

#define STORE_ID_HEX 33     /* node id: 32 hex digits + NUL */
#define STORE_DIGEST_HEX 65 /* inventory digest: 64 hex digits + NUL */

/* One row of nodes.  Empty strings and 0 ports mean unknown (NULL). */
typedef struct store_node {
	char id[STORE_ID_HEX];
	char name[STORE_NAME_MAX + 1];
	char addr[48];
	int control_port, api_port;
	char status[16];       /* alive | suspect | dead | left */
	char role[16];         /* none | follower | candidate | head ("" = unknown) */
	int64_t epoch;
	char digest[STORE_DIGEST_HEX];
	int64_t first_seen, last_seen, inventory_at, health_at; /* 0 = NULL */
	char *inventory;       /* from list/get: malloc'd JSON text or NULL */
} store_node;

/* Writes a node with its inventory in one transaction: upserts the nodes row
 * (identity and liveness from n, host facts and the document from inventory,
 * first_seen kept, inventory_at = health_at = now) and replaces the node's
 * rows of gpus, ib_ports, nics, links and gpu_nic.  inventory is an object in
 * the schema of agent/node/discover.h; a field of the wrong type is stored as NULL,
 * a list entry that is not an object or lacks its key fields is skipped.
 * n->inventory is ignored.  DS_EINVAL for a bad id or a non-object. */
int store_node_put(store *s, const store_node *n, const json_t *inventory, const char *digest,
		   int64_t now, ds_err *err);

/* Updates the liveness fields of a node (name, addr, ports, status, role,
 * epoch, last_seen), inserting a row without inventory when it has none. */
int store_node_seen(store *s, const store_node *n, int64_t now, ds_err *err);

/* Every node, ordered by name then id, each with its inventory text.
 * Free with store_nodes_free. */
int store_node_list(store *s, store_node **out, size_t *n, ds_err *err);
void store_nodes_free(store_node *v, size_t n);

/* Appends one membership change (member_events) at ts (Unix seconds, like
 * every stored time).  Strings may be NULL except node_id, name, kind and
 * state. */
int store_member_event_add(store *s, int64_t ts, const char *node_id, const char *name,
			   const char *addr, const char *kind, const char *state,
			   const char *prev_state, int64_t incarnation, ds_err *err);

/* One row of elections.  head/candidate "" = unknown; votes/quorum -1 =
 * unknown; decided 0 = not yet. */
typedef struct store_election {
	int64_t epoch;
	char head[STORE_ID_HEX];
	char candidate[STORE_ID_HEX];
	int votes, quorum;
	char outcome[16]; /* standing | won | lost | followed | learned | single */
	int64_t ts, decided;
} store_election;

/* Inserts or merges the row of e->epoch: a NULL head_id is filled, a known
 * head_id never changes (DS_EINTERNAL, "two heads in one epoch", when e names
 * another: a safety violation the caller must report), candidate, votes and
 * quorum are replaced when given, the outcome only while it is "standing" or
 * "learned".  *out (may be NULL) gets the row as stored. */
int store_election_put(store *s, const store_election *e, store_election *out, ds_err *err);

/* The newest max rows (highest epochs), returned oldest first.  *out is
 * malloc'd (free(); NULL when *n == 0). */
int store_election_list(store *s, size_t max, store_election **out, size_t *n, ds_err *err);

/* Records this node's vote in epoch for candidate (hex id), synced to disk
 * (synchronous=FULL for this transaction) before it returns.  DS_OK when
 * recorded now or already recorded for the same candidate; DS_EBUSY when the
 * epoch already has a vote for another candidate (*existing gets it; may be
 * NULL). */
int store_vote_put(store *s, int64_t epoch, const char *candidate, int64_t ts,
		   char existing[STORE_ID_HEX], ds_err *err);

/* The vote of the highest epoch: *epoch 0 and cand "" when none. */
int store_vote_last(store *s, int64_t *epoch, char cand[STORE_ID_HEX], ds_err *err);

/* The highest epoch in elections or votes (0 when none). */
int store_epoch_max(store *s, int64_t *out, ds_err *err);

/* ---- shard plans (schema/0004_plans.sql, docs/cluster.md) ---- */

#define STORE_PLAN_STATUS_MAX 16
#define STORE_GROUP_NAME_MAX 64

/* One world rank of a plan.  env is a JSON object as text (the rank's
 * process environment); from store_plan_get it is malloc'd. */
typedef struct store_plan_rank {
	int rank;
	char node_id[STORE_ID_HEX];
	char node_name[STORE_NAME_MAX + 1]; /* "" = unknown */
	int device;                         /* GPU index on its node; -1 = a CPU rank */
	int stage, tp_rank, ep_rank;
	int layer_first, layer_count;
	int expert_first, expert_count;
	int64_t weight_bytes, kv_bytes;     /* -1 = unknown */
	char *env;
} store_plan_rank;

/* One communicator: ranks is a JSON array of world ranks as text (malloc'd
 * from store_plan_get). */
typedef struct store_comm_group {
	char name[STORE_GROUP_NAME_MAX + 1];
	char *ranks;
} store_comm_group;

/* One row of plans.  model and document are borrowed on insert and
 * malloc'd from store_plan_get. */
typedef struct store_plan {
	int64_t id;       /* the version: set by store_plan_insert */
	int64_t epoch;    /* election epoch of the head that wrote it (> 0) */
	int64_t created;
	char head_id[STORE_ID_HEX]; /* "" = unknown */
	char *model;
	int tp, pp, ep, world_size;
	int max_ctx, max_seqs;      /* -1 = unknown */
	char status[STORE_PLAN_STATUS_MAX]; /* planned | launching | serving | failed | stopped | superseded */
	int64_t status_at;
	char reason[256];           /* "" = none */
	char *document;             /* the whole plan, a JSON object as text */
	store_plan_rank *ranks;     /* [world_size], by rank */
	store_comm_group *groups;
	size_t n_groups;
} store_plan;

/* Inserts p with its ranks and groups in one transaction and sets p->id (the
 * new version).  Every earlier plan still planned, launching or serving
 * becomes superseded.  Refused with nothing written: DS_EPERM when p->epoch
 * is older than the newest plan's (a deposed head: fencing); DS_EINVAL when
 * tp * pp * ep != world_size, the ranks are not 0..world_size-1 once each, a
 * node id is malformed, env or document is not a JSON object, a group's ranks
 * are not a JSON array of world ranks, or the status is unknown. */
int store_plan_insert(store *s, store_plan *p, ds_err *err);

/* The plan of version id, or the newest when id == 0, with its ranks and
 * groups; DS_ENOTFOUND when there is none.  Free with store_plan_free. */
int store_plan_get(store *s, int64_t id, store_plan *out, ds_err *err);
void store_plan_free(store_plan *p);

/* Sets the status (and reason, NULL = none) of plan id at now.  DS_EPERM
 * when epoch is older than the plan's (fencing), DS_ENOTFOUND for an
 * unknown id, DS_EINVAL for an unknown status. */
int store_plan_set_status(store *s, int64_t id, int64_t epoch, const char *status,
			  const char *reason, int64_t now, ds_err *err);

#endif
