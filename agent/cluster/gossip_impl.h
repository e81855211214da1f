/*
 * gossip_impl.h - private to agent/cluster/gossip*.c and tests/unit/test_gossip.c:
 * the wire codec and sealing (gossip_wire.c), the replay window, and the
 * membership table with its incarnation rules (gossip_state.c).  Nothing here
 * does I/O; gossip.c owns the sockets and the thread.
 */
#ifndef DS_AGENT_GOSSIP_IMPL_H
#define DS_AGENT_GOSSIP_IMPL_H

#include "agent/cluster/gossip.h"

#include <stddef.h>
#include <stdint.h>

/* ---- sealed packet: header (also the associated data), ciphertext, tag ----
 *
 *   off  len  field
 *     0    1  version (GOSSIP_WIRE_VERSION)
 *     1    1  key id
 *     2   24  nonce (random)
 *    26   16  sender node id
 *    42    8  sender epoch (big endian)
 *    50    8  seq: sender's send time in Unix microseconds, strictly
 *             increasing per sender process (big endian)
 *    58    n  ciphertext of the plaintext messages
 *  58+n   16  Poly1305 tag
 */
#define GOSSIP_WIRE_VERSION 1
#define GOSSIP_HDR_LEN 58
#define GOSSIP_TAG_LEN 16
#define GOSSIP_OVERHEAD (GOSSIP_HDR_LEN + GOSSIP_TAG_LEN)
#define GOSSIP_UDP_MAX 1400 /* whole datagram */
#define GOSSIP_UDP_PLAIN_MAX (GOSSIP_UDP_MAX - GOSSIP_OVERHEAD)
#define GOSSIP_FRAME_MAX (1u << 20) /* TCP frame: u32 length + sealed packet */
#define GOSSIP_PREAUTH_SLACK 64     /* see gossip_frame_preauth_max */

typedef struct gossip_hdr {
	uint8_t version, key_id;
	uint8_t nonce[24];
	uint8_t sender[GOSSIP_ID_LEN];
	uint64_t epoch, seq;
} gossip_hdr;

/* Why a packet was dropped (index into the drop counters); 0 = accepted. */
enum gossip_drop {
	GOSSIP_DROP_NONE = 0,
	GOSSIP_DROP_TOO_LARGE,
	GOSSIP_DROP_MALFORMED,
	GOSSIP_DROP_BAD_KEY,
	GOSSIP_DROP_AUTH_FAIL,
	GOSSIP_DROP_REPLAY,
	GOSSIP_DROP_STALE,
	GOSSIP_DROP_WRONG_TARGET,
	GOSSIP_DROP_OWN_ID,
	GOSSIP_DROP_UNKNOWN_SENDER,
};

/* Seals plen plaintext bytes with keys->key[0] into out (cap bytes, needs
 * plen + GOSSIP_OVERHEAD); *outlen gets the packet size.  DS_ERANGE. */
int gossip_seal(const clusterkey_ring *keys, const uint8_t sender[GOSSIP_ID_LEN], uint64_t epoch,
		uint64_t seq, const uint8_t *plain, size_t plen, uint8_t *out, size_t cap,
		size_t *outlen);

/* What the first `have` bytes (0 .. GOSSIP_HDR_LEN; head may be NULL when
 * have is 0) tell of a sealed packet of len bytes, before the rest has
 * arrived and before a buffer of len bytes exists: GOSSIP_DROP_NONE (nothing
 * wrong yet; it is authenticated only by gossip_open), TOO_LARGE (len >
 * max_len), MALFORMED (len < GOSSIP_OVERHEAD, or a version byte other than
 * GOSSIP_WIRE_VERSION), BAD_KEY (a key id not in the ring).  gossip_open
 * makes the same checks first, so a packet is counted the same way whether
 * a frame was refused early or opened whole. */
int gossip_head_check(const clusterkey_ring *keys, size_t len, size_t max_len,
		      const uint8_t *head, size_t have);

/* The largest sealed packet a TCP frame may carry before its sender is
 * authenticated, for a node that knows `members` members (itself included).
 * The first frame of an exchange is a push-pull with the dialer's table,
 * which it shares with us: room for 2 * members + GOSSIP_PREAUTH_SLACK
 * entries of the largest size (about 40 KiB for a lone node), at most
 * GOSSIP_FRAME_MAX. */
size_t gossip_frame_preauth_max(size_t members);

/* Opens a packet of len bytes (max_len: the size limit of its transport) into
 * plain (needs len bytes) and fills *h.  Returns GOSSIP_DROP_NONE or the
 * reason: TOO_LARGE, MALFORMED (short, bad version), BAD_KEY, AUTH_FAIL. */
int gossip_open(const clusterkey_ring *keys, const uint8_t *pkt, size_t len, size_t max_len,
		gossip_hdr *h, uint8_t *plain, size_t *plen);

/* ---- plaintext: a sequence of messages [type u8][body len u16 BE][body] ---- */

enum gossip_msg_type {
	GOSSIP_MSG_PING = 1,      /* seq u32, target id */
	GOSSIP_MSG_PING_REQ = 2,  /* seq u32, target id, target ip4, port u16, want_nack u8 */
	GOSSIP_MSG_ACK = 3,       /* seq u32 */
	GOSSIP_MSG_NACK = 4,      /* seq u32 */
	GOSSIP_MSG_ALIVE = 5,     /* id, inc u32, ip4, port, boot u64, name, meta */
	GOSSIP_MSG_SUSPECT = 6,   /* id, inc u32, from id */
	GOSSIP_MSG_DEAD = 7,      /* id, inc u32, from id (from == id: left) */
	GOSSIP_MSG_PUSH_PULL = 8, /* flags u8 (GOSSIP_PP_*), count u16; TCP only, first */
	GOSSIP_MSG_STATE = 9,     /* id, inc, state u8, ip4, port, boot, name, meta; TCP only */
};
#define GOSSIP_MSG_HDR 3
#define GOSSIP_MSG_MAX (GOSSIP_MSG_HDR + 38 + GOSSIP_NAME_MAX + GOSSIP_META_MAX)
#define GOSSIP_PP_JOIN 1     /* request: a newcomer's join */
#define GOSSIP_PP_REFER 2    /* answer: busy with joins; the first entry is a member to
			      * pull the full state from (the second is the answerer) */
#define GOSSIP_PP_REFERRED 4 /* request: a join sent there by a REFER; answered in full */

typedef struct gossip_msg {
	int type;
	uint32_t seq;
	uint8_t id[GOSSIP_ID_LEN];   /* ping/ping_req: target; others: the node */
	uint8_t from[GOSSIP_ID_LEN]; /* suspect/dead: the accuser */
	uint32_t incarnation;
	uint8_t state;               /* STATE: enum gossip_state */
	uint32_t ip;                 /* network byte order */
	uint16_t port;
	uint8_t want_nack;
	uint8_t flags;
	uint16_t count;
	uint64_t boot;
	char name[GOSSIP_NAME_MAX + 1];
	const uint8_t *meta;         /* borrowed from the decoded buffer */
	size_t meta_len;
} gossip_msg;

/* Appends m to buf (len bytes used of cap); DS_ERANGE when it does not fit
 * (buf unchanged), DS_EINVAL for a message that could not be decoded back
 * (bad name, meta too long, unknown type). */
int gossip_msg_put(uint8_t *buf, size_t cap, size_t *len, const gossip_msg *m);
/* Decodes the message at *off of p[0..len) and advances *off.  Returns 1 (a
 * message), 0 (end) or DS_EFORMAT (truncated, wrong length for the type,
 * unknown type, bad name, state or port). */
int gossip_msg_next(const uint8_t *p, size_t len, size_t *off, gossip_msg *m);
/* Number of messages when the whole plaintext decodes, else DS_EFORMAT
 * (an empty plaintext is malformed too). */
int gossip_msgs_check(const uint8_t *p, size_t len);

/* ---- replay window ----
 * Per sender, the GOSSIP_REPLAY_WIN highest seqs accepted.  A packet is
 * accepted when |now - seq| <= skew (else STALE) and its seq is neither one of
 * them nor, once the window is full, below all of them (else REPLAY).  A
 * sender silent for 2 * skew is forgotten: anything it sent before then is
 * stale by now.  At most cap senders (least recently heard evicted first). */
#define GOSSIP_REPLAY_WIN 64
typedef struct gossip_replay_ent {
	uint8_t id[GOSSIP_ID_LEN];
	uint64_t seqs[GOSSIP_REPLAY_WIN];
	int n;
	uint64_t last_us; /* receiver's clock at the last accept */
} gossip_replay_ent;

typedef struct gossip_replay {
	gossip_replay_ent *e;
	size_t n, cap;
	uint64_t skew_us;
} gossip_replay;

int gossip_replay_init(gossip_replay *r, size_t cap, uint64_t skew_us);
void gossip_replay_free(gossip_replay *r);
/* Returns GOSSIP_DROP_NONE (and records seq), GOSSIP_DROP_REPLAY or
 * GOSSIP_DROP_STALE.  now_us: the receiver's wall clock. */
int gossip_replay_check(gossip_replay *r, const uint8_t id[GOSSIP_ID_LEN], uint64_t seq,
			uint64_t now_us);

/* ---- Lifeguard suspicion timeout (memberlist suspicion.go) ----
 * n: members believed alive (suspects and this node included). */
void gossip_suspicion_bounds(const gossip_timing *t, int n, int64_t *min_ms, int64_t *max_ms,
			     int *k);
/* Timeout after c independent confirmations:
 * max - (max - min) * ln(c + 1) / ln(k + 1), never below min; min when k = 0. */
int64_t gossip_suspicion_timeout(int64_t min_ms, int64_t max_ms, int k, int c);
/* mult * ceil(log10(n + 1)). */
int gossip_retransmit_limit(int mult, int n);

/* ---- the membership table ---- */

#define GOSSIP_MAX_MEMBERS 4096
#define GOSSIP_MAX_CONFIRM 8
#define GOSSIP_BCAST_MAX 1024
#define GOSSIP_EVQ_MAX 256

typedef struct gossip_node {
	gossip_member m;
	int64_t changed_ms;     /* monotonic time of the last state change */
	int64_t synced_ms;      /* last push-pull that gave it our full state (0: none) */
	/* suspicion timer, while m.state == GOSSIP_SUSPECT */
	int64_t susp_start_ms, susp_min_ms, susp_max_ms, susp_deadline_ms;
	int susp_k, n_conf;
	uint8_t susp_from[GOSSIP_ID_LEN];
	uint8_t conf[GOSSIP_MAX_CONFIRM][GOSSIP_ID_LEN];
} gossip_node;

typedef struct gossip_bcast {
	uint8_t about[GOSSIP_ID_LEN]; /* a newer update about the same node replaces it */
	uint16_t len;
	int transmits;
	uint64_t order;               /* newer = larger */
	uint8_t msg[GOSSIP_MSG_MAX];
} gossip_bcast;

typedef struct gossip_tab {
	gossip_timing t;
	gossip_node *nodes;      /* nodes[0] is this node */
	size_t n, cap;
	gossip_bcast *bq;
	size_t nb;
	uint64_t bcast_order;
	gossip_event *evq;
	size_t nev;
	uint64_t events_lost, table_full;
	int awareness;           /* Lifeguard local health score, 0 .. awareness_max - 1 */
	int leaving;             /* gossip_leave called: accept our own death, never refute */
	int quiet;               /* merging the answer to our join: alive news is old news
				  * to the cluster, not broadcast again */
	double wall_offset_s;    /* wall clock - monotonic, for gossip_member.changed_s */
} gossip_tab;

/* Sets up the table with this node alive at incarnation 1. */
int gossip_tab_init(gossip_tab *tab, const gossip_timing *t, const gossip_member *self,
		    double wall_offset_s);
void gossip_tab_free(gossip_tab *tab);

gossip_node *gossip_tab_find(gossip_tab *tab, const uint8_t id[GOSSIP_ID_LEN]);
/* Members in state alive or suspect, this node included. */
int gossip_tab_live_count(const gossip_tab *tab);

/* The rules of hashicorp/memberlist state.go (docs/cluster.md):
 * alive: ignored unless its incarnation is newer (for this node: refuted
 *   unless it is exactly our current state); a newer one clears suspect/dead.
 * suspect: ignored when older or about a dead/left member; about us: refute;
 *   already suspect: a new accuser is a confirmation (shrinks the timer).
 * dead: ignored when older or already dead/left; about us: refute (unless
 *   leaving); from == id means left.
 * Each accepted change queues a broadcast and an event. */
void gossip_tab_alive(gossip_tab *tab, const gossip_msg *a, int64_t now_ms);
void gossip_tab_suspect(gossip_tab *tab, const gossip_msg *s, int64_t now_ms);
void gossip_tab_dead(gossip_tab *tab, const gossip_msg *d, int64_t now_ms);
/* One push-pull entry from member `from`: alive -> alive rule, left -> dead
 * rule with from = id, suspect/dead -> suspect rule (we suspect rather than
 * believe a remote death). */
void gossip_tab_merge(gossip_tab *tab, const gossip_msg *st, const uint8_t from[GOSSIP_ID_LEN],
		      int64_t now_ms);
/* This node accuses id (a failed probe): suspect rule with from = us. */
void gossip_tab_accuse(gossip_tab *tab, const uint8_t id[GOSSIP_ID_LEN], int64_t now_ms);
/* New metadata for this node: incarnation + 1, broadcast alive. */
void gossip_tab_set_meta(gossip_tab *tab, const uint8_t *meta, size_t len, int64_t now_ms);
/* This node's address changed (bind/advertise known): incarnation + 1. */
void gossip_tab_set_addr(gossip_tab *tab, uint32_t ip, uint16_t port, int64_t now_ms);
/* Leaving: broadcast dead(self, from = self), mark self left. */
void gossip_tab_leave(gossip_tab *tab, int64_t now_ms);
/* Suspicion timeouts -> dead; dead/left older than reap_ms -> removed.
 * Returns the next deadline (monotonic ms), or INT64_MAX. */
int64_t gossip_tab_tick(gossip_tab *tab, int64_t now_ms);
/* Lifeguard: add delta to the local health score (clamped). */
void gossip_tab_awareness(gossip_tab *tab, int delta);

/* The alive message of a node, encoded (for broadcasts and push-pull). */
void gossip_tab_msg_alive(const gossip_node *nd, gossip_msg *m);
/* Appends queued broadcasts that fit into buf (fewest transmits first, then
 * newest); each one sent counts a transmit, and is dropped after the
 * retransmit limit.  Returns how many were added. */
int gossip_tab_bcast_fill(gossip_tab *tab, uint8_t *buf, size_t cap, size_t *len);
/* Queues an encoded message about node `about`, replacing an older one. */
void gossip_tab_bcast(gossip_tab *tab, const uint8_t about[GOSSIP_ID_LEN], const gossip_msg *m);

/* Moves the queued events out (caller frees *out with free()). */
size_t gossip_tab_events_take(gossip_tab *tab, gossip_event **out);

#endif
