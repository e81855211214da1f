/*
 * gossip.h - cluster membership: SWIM over UDP with TCP push-pull, Lifeguard
 * suspicion, sealed packets (docs/cluster.md, "Gossip").
 *
 * One gossip instance per agent.  It binds one UDP and one TCP socket on the
 * same port, joins the seeds (retrying with backoff), probes one member per
 * protocol period (ping, then ping-req through k members, then suspect),
 * piggybacks membership updates on every packet, syncs full state over TCP
 * on join and periodically, and tells its owner about changes through an
 * event callback.  Every packet and TCP frame is sealed with the cluster key
 * (XChaCha20-Poly1305, key id byte, sender id + epoch + send time in the
 * associated data, per-sender replay window); whatever fails is dropped and
 * counted (gossip_stats), never trusted.
 *
 * Members are identified by their 16-byte node id (DATA_DIR/node.id), not by
 * name or address: a node that restarts with the same data directory is the
 * same member, back with a higher incarnation and a new boot time.
 *
 * Threading: gossip_new starts one background thread that owns the sockets
 * and timers.  Every function here may be called from any thread.  The event
 * callback runs on the gossip thread with no gossip lock held (it may call
 * gossip_members, gossip_set_meta ...), and must not block for long.
 */
#ifndef DS_AGENT_GOSSIP_H
#define DS_AGENT_GOSSIP_H

#include "common/clusterkey.h"
#include "common/status.h"

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#define GOSSIP_ID_LEN 16      /* node id bytes */
#define GOSSIP_ID_HEX 33      /* buffer for its hex text and NUL */
#define GOSSIP_NAME_MAX 64    /* node names: 1..64 printable ASCII bytes, no spaces */
#define GOSSIP_META_MAX 512   /* metadata bytes per member */
#define GOSSIP_DEFAULT_PORT 7946

/* ---- node id and cluster key files ---- */

/* Reads DATA_DIR/node.id (32 hex digits and a newline), or creates it with 16
 * random bytes (ds_file_write_private: mode 0600, exclusive, atomic) when
 * missing; *created says which (may be NULL).  DS_EFORMAT when the file is
 * not a node id, DS_EIO. */
int gossip_node_id_load(const char *data_dir, uint8_t id[GOSSIP_ID_LEN], int *created,
			ds_err *err);
/* 32 lowercase hex digits + NUL. */
void gossip_id_hex(const uint8_t id[GOSSIP_ID_LEN], char out[GOSSIP_ID_HEX]);

/* The keys: a clusterkey_ring (common/clusterkey.h), loaded by
 * agent/auth/clusterkey_file.h. */

/* ---- timing ---- */

/* memberlist's names and meanings (docs/cluster.md lists both profiles). */
typedef struct gossip_timing {
	const char *name;          /* "lan" or "test" */
	int probe_interval_ms;     /* one probe per period (scaled by local health) */
	int probe_timeout_ms;      /* wait for a direct ack before asking k peers */
	int indirect_checks;       /* k: members asked to ping-req a silent target */
	int suspicion_mult;        /* suspicion min = mult * max(1, log10 n) * probe */
	int suspicion_max_mult;    /* suspicion max = max_mult * min */
	int retransmit_mult;       /* each update is sent mult * ceil(log10(n+1)) times */
	int gossip_interval_ms;    /* pending updates go to gossip_nodes members this often */
	int gossip_nodes;
	int push_pull_ms;          /* full state sync with one member over TCP */
	int gossip_to_dead_ms;     /* dead members still get gossip this long */
	int reconnect_ms;          /* push-pull with one dead member this often (heals partitions) */
	int reap_ms;               /* dead/left members are forgotten after this */
	int tcp_timeout_ms;        /* a push-pull exchange must finish within this */
	int tcp_first_ms;          /* an incoming exchange's first frame must arrive whole
				    * (and open) within this of the accept (dsagent) */
	int awareness_max;         /* Lifeguard: local health multiplier saturates here */
	int join_backoff_min_ms;   /* seed retries: min, doubling up to max */
	int join_backoff_max_ms;
	int max_skew_ms;           /* packets whose send time is further off are stale */
	int join_full_per_s;       /* joins answered with the full state per second; more
				    * are referred to a member already synced (dsagent) */
} gossip_timing;

/* Fills *out with profile "lan" (memberlist DefaultLANConfig) or "test"
 * (fast timers for 5-node tests on one machine).  DS_EINVAL for other names. */
int gossip_timing_profile(const char *name, gossip_timing *out, ds_err *err);

/* ---- metadata ---- */

/* Metadata is opaque to the gossip layer: at most GOSSIP_META_MAX bytes that
 * travel in every alive message and push-pull entry; changing it bumps the
 * incarnation, so meta changes are ordered like liveness.  dsagent lays it out
 * as TLV records [type u8][len u8][value] (unknown types are skipped, types
 * are append-only) with these helpers; see docs/cluster.md for the types. */
enum gossip_role {
	GOSSIP_ROLE_NONE = 0,      /* no election yet */
	GOSSIP_ROLE_FOLLOWER = 1,
	GOSSIP_ROLE_CANDIDATE = 2,
	GOSSIP_ROLE_HEAD = 3,
};
enum {
	GOSSIP_HEALTH_OK = 1u << 0,        /* agent up and serving its role */
	GOSSIP_HEALTH_PREFLIGHT = 1u << 1, /* preflight checks passed */
	GOSSIP_HEALTH_DRAINING = 1u << 2,  /* leaving / draining its engine */
};

typedef struct gossip_meta {
	char version[32];        /* agent version */
	uint8_t role;            /* GOSSIP_ROLE_* */
	uint8_t health;          /* GOSSIP_HEALTH_* bits */
	uint8_t eligible;        /* may become head */
	int32_t priority;        /* operator priority (higher wins) */
	uint64_t epoch;          /* highest election epoch this node knows */
	uint8_t head_id[GOSSIP_ID_LEN]; /* the head it follows (all zero: none) */
	uint64_t head_epoch;     /* epoch of that head */
	uint8_t inventory[32];   /* digest of its inventory (all zero: none yet) */
	uint16_t control_port, api_port;
} gossip_meta;

/* Encodes m into out (at most cap bytes); *len gets the size.  DS_ERANGE when
 * it does not fit. */
int gossip_meta_encode(const gossip_meta *m, uint8_t *out, size_t cap, size_t *len,
		       ds_err *err);
/* Decodes meta bytes into *m (zeroed first; absent records stay zero).
 * DS_EFORMAT for truncated records or bad lengths of known types. */
int gossip_meta_decode(const uint8_t *in, size_t len, gossip_meta *m, ds_err *err);

/* ---- members and events ---- */

enum gossip_state {
	GOSSIP_ALIVE = 0,
	GOSSIP_SUSPECT = 1,
	GOSSIP_DEAD = 2,
	GOSSIP_LEFT = 3, /* left on purpose (gossip_leave) */
};
const char *gossip_state_name(int state); /* "alive", "suspect", "dead", "left" */

typedef struct gossip_member {
	uint8_t id[GOSSIP_ID_LEN];
	char name[GOSSIP_NAME_MAX + 1];
	char addr[16];           /* dotted IPv4 of its gossip port */
	uint16_t port;
	int state;               /* enum gossip_state */
	uint32_t incarnation;
	uint64_t boot;           /* its process start (Unix microseconds): changes on restart */
	uint64_t epoch;          /* highest epoch seen in its packet headers (0: none yet) */
	double changed_s;        /* Unix time of the last state change here */
	int is_self;
	size_t meta_len;
	uint8_t meta[GOSSIP_META_MAX];
} gossip_member;

enum gossip_event_kind {
	GOSSIP_EV_JOIN = 1,  /* a new member, first seen alive */
	GOSSIP_EV_ALIVE,     /* back to alive: refuted a suspicion, or rejoined after dead/left */
	GOSSIP_EV_SUSPECT,
	GOSSIP_EV_DEAD,      /* failed: suspicion timed out somewhere */
	GOSSIP_EV_LEFT,      /* left on purpose */
	GOSSIP_EV_META,      /* metadata or address changed */
	GOSSIP_EV_RESTART,   /* same node id, new process (boot changed) */
	GOSSIP_EV_REAP,      /* forgotten after reap_ms dead/left */
};
/* "member_join", "member_alive", ... (the kinds of the store's events). */
const char *gossip_event_name(int kind);

typedef struct gossip_event {
	int kind;                /* enum gossip_event_kind */
	int prev_state;          /* state before the change (-1 for a new member) */
	uint32_t prev_incarnation;
	gossip_member member;    /* the member after the change */
} gossip_event;

/* Called on the gossip thread, no lock held; ev is valid during the call. */
typedef void (*gossip_event_fn)(void *ud, const gossip_event *ev);

/* One JSON object per event, for logs and the store: {"name","id","addr",
 * "state","prev_state","incarnation","boot"}.  *out is written as text
 * (truncated to n). */
void gossip_event_json(const gossip_event *ev, char *out, size_t n);

/* ---- counters ---- */

typedef struct gossip_stats {
	uint64_t packets_in, bytes_in, packets_out, bytes_out; /* UDP datagrams + TCP frames */
	uint64_t tcp_accepted, tcp_connected, tcp_failed;
	uint64_t tcp_evicted;       /* incoming, unauthenticated: closed for a newer one */
	uint64_t tcp_first_timeouts; /* incoming: no whole first frame within tcp_first_ms */
	uint64_t tcp_bytes_in, tcp_bytes_out; /* the TCP share of bytes_in / bytes_out */
	uint64_t pings_out, acks_in, ping_reqs_out, nacks_in, probes_failed;
	uint64_t push_pulls, joins_ok, join_attempts;
	uint64_t joins_referred;    /* joins we answered by naming another member */
	/* drops, one counter per reason (docs/cluster.md "Counters") */
	uint64_t drop_too_large;    /* datagram over 1400 B or frame over the cap */
	uint64_t drop_malformed;    /* shorter than a header, unknown version, bad messages */
	uint64_t drop_bad_key;      /* key id not in the keyring */
	uint64_t drop_auth_fail;    /* did not open with the key (wrong key, altered, truncated) */
	uint64_t drop_replay;       /* (sender, send time) seen before or below the window */
	uint64_t drop_stale;        /* send time outside max_skew of our clock */
	uint64_t drop_wrong_target; /* a ping meant for another node id */
	uint64_t drop_own_id;       /* another process sends with our node id */
	uint64_t drop_unknown_sender; /* a ping-req from a node that is not a live member */
	uint64_t drop_test;         /* dropped by the test-only fault switch */
	uint64_t send_errors, events_lost, table_full;
	int awareness;              /* current Lifeguard local health score */
	int members, alive;
} gossip_stats;

/* The counters by name, for JSON and docs: {name, offset in gossip_stats}
 * (uint64_t fields only; ends with {NULL}). */
typedef struct gossip_stat_field {
	const char *name;
	size_t offset;
} gossip_stat_field;
extern const gossip_stat_field gossip_stat_fields[];

/* ---- the instance ---- */

typedef struct gossip gossip;

typedef struct gossip_params {
	const char *bind_addr;      /* IPv4 literal; "0.0.0.0" = every interface */
	int port;                   /* UDP and TCP port; 0 = any free one (gossip_port) */
	const char *advertise_addr; /* what members dial; NULL = bind_addr, or when that
				       is 0.0.0.0 the first up non-loopback IPv4 address */
	int advertise_port;         /* 0 = the bound port */
	uint8_t node_id[GOSSIP_ID_LEN];
	const char *node_name;      /* 1..GOSSIP_NAME_MAX printable, no spaces */
	const clusterkey_ring *keys; /* copied; n >= 1 */
	const char *seeds;          /* "HOST:PORT[,HOST:PORT...]" or NULL: start alone */
	gossip_timing timing;       /* from gossip_timing_profile */
	uint64_t epoch;             /* sent in every packet header (gossip_set_epoch) */
	const uint8_t *meta;        /* copied; at most GOSSIP_META_MAX bytes */
	size_t meta_len;
	gossip_event_fn on_event;   /* may be NULL */
	void *ud;
} gossip_params;

/* bind 0.0.0.0, port 7946, the lan profile, everything else empty. */
gossip_params gossip_default_params(void);

/* Binds the sockets, parses the seeds and starts the gossip thread (which
 * joins the seeds).  NULL with err: DS_EINVAL (bad params or seed syntax),
 * DS_EIO (bind failed: the message names the address and port). */
gossip *gossip_new(const gossip_params *p, ds_err *err);
/* Stops the thread and frees everything (call gossip_leave first to tell the
 * others).  NULL is a no-op. */
void gossip_free(gossip *g);

/* The bound port and the advertised address; borrowed until gossip_free. */
int gossip_port(const gossip *g);
const char *gossip_advertise_addr(const gossip *g);

/* Replaces this node's metadata (bumps its incarnation and gossips it).
 * DS_ERANGE beyond GOSSIP_META_MAX. */
int gossip_set_meta(gossip *g, const uint8_t *meta, size_t len, ds_err *err);
/* The epoch written into packet headers from now on. */
void gossip_set_epoch(gossip *g, uint64_t epoch);

/* Copies up to max members (this node included, is_self = 1, first) into
 * out and returns how many there are in all (may exceed max). */
size_t gossip_members(gossip *g, gossip_member *out, size_t max);
void gossip_stats_get(gossip *g, gossip_stats *out);
/* 1 once a push-pull with a seed succeeded (or there were no seeds). */
int gossip_joined(gossip *g);

/* Tells the others this node leaves on purpose (they mark it left, not dead)
 * and stops probing and refuting; sends the news to up to 16 live members at
 * once and keeps gossiping it for wait_ms (0 = do not wait). */
void gossip_leave(gossip *g, int wait_ms);

/* {"self": member, "members": [member...], "stats": {...}, "profile": NAME,
 *  "joined": bool}; a member is {"name","id","addr","state","incarnation",
 *  "boot","epoch","changed","self","meta":{decoded fields}|null,"meta_hex"}.
 * New reference or NULL (out of memory). */
json_t *gossip_status_json(gossip *g);

/* TEST ONLY (dsagent --test-fault-injection): drop every packet and TCP
 * exchange to or from the members named in names_csv ("a,b"; NULL or "" =
 * drop nothing).  Counted in drop_test.  DS_EINVAL for a bad name list. */
int gossip_test_drop(gossip *g, const char *names_csv, ds_err *err);

#endif
