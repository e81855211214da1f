/*
 * gossip.c - SWIM membership over UDP with TCP push-pull (see gossip.h; the
 * wire format and timings are in docs/cluster.md).
 *
 * Callers: agent/main.c (new, set_meta, leave, free), agent/api/control.c
 * (status_json, test_drop).  Calls: gossip_wire.c (codec, sealing, replay
 * window), gossip_state.c (the membership table and its rules), libsodium
 * (random numbers), the socket API.
 *
 * One background thread runs this loop:
 *
 *   lock; timers (probe, gossip, push-pull, reconnect, join, relays, TCP
 *   deadlines, suspicion and reaping); take events; unlock; deliver events
 *   -> poll(wake pipe, UDP, TCP listener, TCP exchanges; until the next
 *   deadline) -> lock; read every ready socket; take events; unlock; deliver.
 *
 * A probe of one member (one per probe period, round-robin over a shuffled
 * list; the period is stretched by the Lifeguard health score):
 *
 *   ping --ack--> done (health - 1)
 *     |  probe_timeout without ack
 *     v
 *   ping-req to k alive members (they ping it for us; nack if they get nothing)
 *     |  end of the probe period without any ack
 *     v
 *   failed: health + missing nacks (or + 1 without helpers); accuse -> suspect
 *
 * A push-pull is one TCP connection: the dialer sends one frame with its whole
 * table, the other side merges it and answers with its own table, both close.
 * Frames are u32 length + a sealed packet, capped at GOSSIP_FRAME_MAX.
 *
 * An incoming connection is a stranger until its frame opens (the tag is at
 * the end, so nothing earlier can prove the key).  Its slot, one of
 * CONNS_IN (ours use CONNS_OUT others, so a flood never stops our own
 * exchanges):
 *
 *   listen backlog --accept_tcp (a slot free, or evictable)--> READ, stranger
 *   READ: u32 length + sealed header into head[] --gossip_head_check fails
 *     (length past gossip_frame_preauth_max, version, key id)--> closed
 *   head passed --malloc(length)--> rest of the packet --frame_process opens
 *     it--> WRITE, authed (deadline: accept + tcp_timeout) --answer sent--> closed
 *   READ at accept + tcp_first_ms (after one last read) --timers--> closed
 *   READ, the oldest stranger, held evict_grace_ms, and a newer connection
 *     waiting --accept_tcp--> closed (tcp_evicted)
 *
 * With every slot held by a stranger younger than the grace, or by an
 * authenticated exchange, new connections wait in the backlog (the listener
 * leaves the poll set) instead of being accepted and dropped: a dialer's
 * frame waits with it and is often read at the accept.
 *
 * Every datagram and frame is opened (key id, AEAD), checked against the
 * replay window, decoded as a whole, and only then acted on; a failure at any
 * step increments exactly one drop counter.
 *
 * Threading: mu guards everything below it in struct gossip; the API takes it
 * briefly.  The thread releases it to poll, to deliver events and while it
 * resolves seed names (DNS may block).  The sockets are used by the gossip
 * thread only, except that gossip_leave sends on the UDP socket under mu.
 */
#include "agent/cluster/gossip_impl.h"
#include "common/log.h"
#include "common/strutil.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <math.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CONNS_IN 16  /* incoming exchanges: conns[0 .. CONNS_IN) */
#define CONNS_OUT 16 /* ours (joins, push-pulls, reconnects): the rest */
#define CONNS_MAX (CONNS_IN + CONNS_OUT)
#define ACCEPTS_PER_ROUND (4 * CONNS_IN) /* then poll again: timers keep running */
#define RELAYS_MAX 64
#define SEEDS_MAX 32
#define DROP_NAMES_MAX 64
#define REPLAY_SENDERS 1024
#define RECV_BATCH 256 /* datagrams read per poll round, so timers keep running */

enum { PP_JOIN = 1, PP_REFERRED, PP_PERIODIC, PP_RECONNECT, PP_INCOMING };
enum { CONN_FREE = 0, CONN_CONNECTING, CONN_WRITE, CONN_READ };

typedef struct conn {
	int phase;
	int fd;
	int purpose;
	int authed;       /* PP_INCOMING: its frame opened; we are answering */
	struct sockaddr_in peer;
	uint8_t *buf;     /* frame being written, or packet being read (allocated
			   * once head[] passed gossip_head_check) */
	size_t len, off;  /* write: len bytes, off sent; read: len expected, off got */
	uint8_t head[4 + GOSSIP_HDR_LEN]; /* read: u32 length + the packet's header */
	size_t head_got;
	int64_t opened_ms;   /* accepted or dialed */
	int64_t deadline_ms;
	int refer;        /* PP_JOIN: the answer referred us to refer_id / refer_addr */
	uint8_t refer_id[GOSSIP_ID_LEN];
	struct sockaddr_in refer_addr;
} conn;

typedef struct relay {
	uint32_t our_seq, their_seq;
	struct sockaddr_in reply_to;
	int want_nack;
	int64_t deadline_ms;
} relay;

struct gossip {
	pthread_t thread;
	int thread_started;
	int wake_rd, wake_wr;
	int udp, tcp;
	int port;
	char adv_addr[16];
	uint32_t adv_ip;
	uint16_t adv_port;
	uint8_t id[GOSSIP_ID_LEN];
	clusterkey_ring keys;
	gossip_event_fn on_event;
	void *ud;
	char *seeds[SEEDS_MAX];
	size_t n_seeds;

	pthread_mutex_t mu; /* guards everything below */
	int stop;
	gossip_timing t;
	uint64_t epoch;
	uint64_t last_seq;
	gossip_tab tab;
	gossip_replay replay;
	gossip_stats st;
	int joined, join_inflight, join_round_ok;
	int64_t next_join_ms, join_backoff_ms;
	int64_t jw_start_ms; /* the one-second window of full join answers */
	int jw_full;
	struct {
		int active, indirect_sent, expected_nacks, nacks;
		uint32_t seq;
		uint8_t target[GOSSIP_ID_LEN];
		int64_t start_ms, direct_deadline_ms, deadline_ms;
	} probe;
	uint8_t (*order)[GOSSIP_ID_LEN];
	size_t order_n, order_i, order_cap;
	uint32_t seq_no;
	relay relays[RELAYS_MAX];
	int n_relays;
	int64_t next_probe_ms, next_gossip_ms, next_pp_ms, next_reconnect_ms;
	conn conns[CONNS_MAX];
	char drop_names[DROP_NAMES_MAX][GOSSIP_NAME_MAX + 1];
	int n_drop;
	int64_t own_id_warned_ms;
	int64_t evict_warned_ms;
};

/* ---- clocks ---- */

static int64_t mono_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static uint64_t wall_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* The seq of the next packet: the send time, strictly increasing. */
static uint64_t next_seq(gossip *g)
{
	uint64_t us = wall_us();
	if (us <= g->last_seq)
		us = g->last_seq + 1;
	g->last_seq = us;
	return us;
}

static uint32_t rnd(uint32_t n)
{
	return n ? randombytes_uniform(n) : 0;
}

/* ---- test-only fault switch ---- */

static int drop_name(const gossip *g, const char *name)
{
	for (int i = 0; i < g->n_drop; i++)
		if (strcmp(g->drop_names[i], name) == 0)
			return 1;
	return 0;
}

/* 1 when traffic with this peer (by node id or by address) is switched off. */
static int dropped_peer(gossip *g, const uint8_t *id, const struct sockaddr_in *addr)
{
	if (!g->n_drop)
		return 0;
	for (size_t i = 1; i < g->tab.n; i++) {
		const gossip_member *m = &g->tab.nodes[i].m;
		if (!drop_name(g, m->name))
			continue;
		if (id && memcmp(m->id, id, GOSSIP_ID_LEN) == 0)
			return 1;
		if (addr) {
			char a[16];
			inet_ntop(AF_INET, &addr->sin_addr, a, sizeof a);
			if (strcmp(a, m->addr) == 0 && ntohs(addr->sin_port) == m->port)
				return 1;
		}
	}
	return 0;
}

/* ---- sending ---- */

static void addr_of(const gossip_member *m, struct sockaddr_in *sa)
{
	memset(sa, 0, sizeof *sa);
	sa->sin_family = AF_INET;
	inet_pton(AF_INET, m->addr, &sa->sin_addr);
	sa->sin_port = htons(m->port);
}

/* Seals plain and sends it to `to`; id (may be NULL) names the receiver for
 * the fault switch. */
static void send_plain(gossip *g, const struct sockaddr_in *to, const uint8_t *id,
		       const uint8_t *plain, size_t plen)
{
	uint8_t pkt[GOSSIP_UDP_MAX];
	size_t n = 0;
	if (dropped_peer(g, id, to)) {
		g->st.drop_test++;
		return;
	}
	if (gossip_seal(&g->keys, g->id, g->epoch, next_seq(g), plain, plen, pkt, sizeof pkt,
			&n) != DS_OK) {
		g->st.send_errors++;
		return;
	}
	ssize_t w = sendto(g->udp, pkt, n, MSG_DONTWAIT | MSG_NOSIGNAL, (const struct sockaddr *)to,
			   sizeof *to);
	if (w != (ssize_t)n) {
		g->st.send_errors++;
		return;
	}
	g->st.packets_out++;
	g->st.bytes_out += n;
}

/* One message plus as many queued broadcasts as fit. */
static void send_msg(gossip *g, const struct sockaddr_in *to, const uint8_t *id,
		     const gossip_msg *m, const gossip_msg *extra)
{
	uint8_t plain[GOSSIP_UDP_PLAIN_MAX];
	size_t len = 0;
	if (gossip_msg_put(plain, sizeof plain, &len, m) != DS_OK)
		return;
	if (extra)
		gossip_msg_put(plain, sizeof plain, &len, extra);
	gossip_tab_bcast_fill(&g->tab, plain, sizeof plain, &len);
	send_plain(g, to, id, plain, len);
}

/* Up to k random members passing keep() other than us and `not`; ids out. */
typedef int (*keep_fn)(const gossip *g, const gossip_node *nd, int64_t now);

static size_t pick(gossip *g, size_t k, keep_fn keep, const uint8_t *not, int64_t now,
		   uint8_t (*out)[GOSSIP_ID_LEN])
{
	size_t n = 0, seen = 0;
	/* Reservoir sampling: one pass, uniform. */
	for (size_t i = 1; i < g->tab.n; i++) {
		const gossip_node *nd = &g->tab.nodes[i];
		if (!keep(g, nd, now) || (not && memcmp(nd->m.id, not, GOSSIP_ID_LEN) == 0))
			continue;
		seen++;
		if (n < k) {
			memcpy(out[n++], nd->m.id, GOSSIP_ID_LEN);
		} else {
			uint32_t j = rnd((uint32_t)seen);
			if (j < k)
				memcpy(out[j], nd->m.id, GOSSIP_ID_LEN);
		}
	}
	return n;
}

static int keep_alive(const gossip *g, const gossip_node *nd, int64_t now)
{
	return nd->m.state == GOSSIP_ALIVE;
}

static int keep_gossip(const gossip *g, const gossip_node *nd, int64_t now)
{
	if (nd->m.state == GOSSIP_ALIVE || nd->m.state == GOSSIP_SUSPECT)
		return 1;
	return nd->m.state == GOSSIP_DEAD && now - nd->changed_ms <= g->t.gossip_to_dead_ms;
}

static int keep_synced(const gossip *g, const gossip_node *nd, int64_t now)
{
	return nd->m.state == GOSSIP_ALIVE && nd->synced_ms != 0;
}

static int keep_dead(const gossip *g, const gossip_node *nd, int64_t now)
{
	return nd->m.state == GOSSIP_DEAD;
}

/* ---- probing ---- */

static void order_rebuild(gossip *g)
{
	if (g->order_cap < g->tab.n) {
		void *p = realloc(g->order, g->tab.n * sizeof *g->order);
		if (!p)
			return;
		g->order = p;
		g->order_cap = g->tab.n;
	}
	g->order_n = 0;
	for (size_t i = 1; i < g->tab.n; i++) {
		int s = g->tab.nodes[i].m.state;
		if (s == GOSSIP_ALIVE || s == GOSSIP_SUSPECT)
			memcpy(g->order[g->order_n++], g->tab.nodes[i].m.id, GOSSIP_ID_LEN);
	}
	for (size_t i = g->order_n; i > 1; i--) {
		size_t j = rnd((uint32_t)i);
		uint8_t tmp[GOSSIP_ID_LEN];
		memcpy(tmp, g->order[i - 1], GOSSIP_ID_LEN);
		memcpy(g->order[i - 1], g->order[j], GOSSIP_ID_LEN);
		memcpy(g->order[j], tmp, GOSSIP_ID_LEN);
	}
	g->order_i = 0;
}

/* The next member to probe, or NULL. */
static gossip_node *probe_next(gossip *g)
{
	for (int pass = 0; pass < 2; pass++) {
		while (g->order_i < g->order_n) {
			gossip_node *nd = gossip_tab_find(&g->tab, g->order[g->order_i++]);
			if (nd && nd != &g->tab.nodes[0] &&
			    (nd->m.state == GOSSIP_ALIVE || nd->m.state == GOSSIP_SUSPECT))
				return nd;
		}
		order_rebuild(g);
	}
	return NULL;
}

static void probe_start(gossip *g, int64_t now)
{
	gossip_node *nd = probe_next(g);
	int64_t period = (int64_t)g->t.probe_interval_ms * (g->tab.awareness + 1);
	g->next_probe_ms = now + period;
	if (!nd)
		return;
	g->probe.active = 1;
	g->probe.indirect_sent = 0;
	g->probe.expected_nacks = g->probe.nacks = 0;
	g->probe.seq = ++g->seq_no;
	memcpy(g->probe.target, nd->m.id, GOSSIP_ID_LEN);
	g->probe.start_ms = now;
	g->probe.direct_deadline_ms = now + g->t.probe_timeout_ms;
	g->probe.deadline_ms = now + (period > g->t.probe_timeout_ms ? period
								     : 2 * g->t.probe_timeout_ms);
	gossip_msg ping = {.type = GOSSIP_MSG_PING, .seq = g->probe.seq};
	memcpy(ping.id, nd->m.id, GOSSIP_ID_LEN);
	gossip_msg sus = {.type = GOSSIP_MSG_SUSPECT};
	int suspect = nd->m.state == GOSSIP_SUSPECT;
	if (suspect) { /* Lifeguard buddy system: tell it so it can refute at once */
		memcpy(sus.id, nd->m.id, GOSSIP_ID_LEN);
		sus.incarnation = nd->m.incarnation;
		memcpy(sus.from, g->id, GOSSIP_ID_LEN);
	}
	struct sockaddr_in to;
	addr_of(&nd->m, &to);
	uint8_t id[GOSSIP_ID_LEN];
	memcpy(id, nd->m.id, GOSSIP_ID_LEN);
	send_msg(g, &to, id, &ping, suspect ? &sus : NULL);
	g->st.pings_out++;
}

static void probe_tick(gossip *g, int64_t now, int64_t *next)
{
	if (g->probe.active) {
		gossip_node *nd = gossip_tab_find(&g->tab, g->probe.target);
		if (!nd || nd->m.state == GOSSIP_DEAD || nd->m.state == GOSSIP_LEFT) {
			g->probe.active = 0; /* decided elsewhere meanwhile */
		} else if (!g->probe.indirect_sent && now >= g->probe.direct_deadline_ms) {
			uint8_t helpers[8][GOSSIP_ID_LEN];
			size_t k = g->t.indirect_checks < 8 ? (size_t)g->t.indirect_checks : 8;
			size_t n = pick(g, k, keep_alive, g->probe.target, now, helpers);
			gossip_msg req = {.type = GOSSIP_MSG_PING_REQ, .seq = g->probe.seq,
					  .want_nack = 1};
			struct sockaddr_in ta;
			addr_of(&nd->m, &ta);
			memcpy(req.id, nd->m.id, GOSSIP_ID_LEN);
			req.ip = ta.sin_addr.s_addr;
			req.port = nd->m.port;
			for (size_t i = 0; i < n; i++) {
				gossip_node *h = gossip_tab_find(&g->tab, helpers[i]);
				struct sockaddr_in to;
				addr_of(&h->m, &to);
				send_msg(g, &to, helpers[i], &req, NULL);
				g->st.ping_reqs_out++;
			}
			g->probe.indirect_sent = 1;
			g->probe.expected_nacks = (int)n;
		}
		if (g->probe.active && now >= g->probe.deadline_ms) {
			int delta = 1;
			if (g->probe.expected_nacks > 0)
				delta = g->probe.expected_nacks - g->probe.nacks;
			gossip_tab_awareness(&g->tab, delta > 0 ? delta : 0);
			g->st.probes_failed++;
			g->probe.active = 0;
			gossip_tab_accuse(&g->tab, g->probe.target, now);
		}
	}
	if (!g->probe.active && now >= g->next_probe_ms)
		probe_start(g, now);
	if (g->probe.active) {
		int64_t d = g->probe.indirect_sent ? g->probe.deadline_ms
						   : g->probe.direct_deadline_ms;
		*next = d < *next ? d : *next;
	}
	*next = g->next_probe_ms < *next ? g->next_probe_ms : *next;
}

static void relay_tick(gossip *g, int64_t now, int64_t *next)
{
	for (int i = 0; i < g->n_relays;) {
		relay *r = &g->relays[i];
		if (now >= r->deadline_ms) {
			if (r->want_nack) {
				gossip_msg nack = {.type = GOSSIP_MSG_NACK, .seq = r->their_seq};
				send_msg(g, &r->reply_to, NULL, &nack, NULL);
			}
			g->relays[i] = g->relays[--g->n_relays];
			continue;
		}
		*next = r->deadline_ms < *next ? r->deadline_ms : *next;
		i++;
	}
}

/* ---- gossip rounds ---- */

static void gossip_tick(gossip *g, int64_t now, int64_t *next)
{
	if (now >= g->next_gossip_ms) {
		g->next_gossip_ms = now + g->t.gossip_interval_ms;
		if (g->tab.nb) {
			uint8_t ids[16][GOSSIP_ID_LEN];
			size_t k = g->t.gossip_nodes < 16 ? (size_t)g->t.gossip_nodes : 16;
			size_t n = pick(g, k, keep_gossip, NULL, now, ids);
			for (size_t i = 0; i < n; i++) {
				uint8_t plain[GOSSIP_UDP_PLAIN_MAX];
				size_t len = 0;
				if (!gossip_tab_bcast_fill(&g->tab, plain, sizeof plain, &len))
					break;
				gossip_node *nd = gossip_tab_find(&g->tab, ids[i]);
				struct sockaddr_in to;
				addr_of(&nd->m, &to);
				send_plain(g, &to, ids[i], plain, len);
			}
		}
	}
	*next = g->next_gossip_ms < *next ? g->next_gossip_ms : *next;
}

/* ---- TCP push-pull ---- */

static void conn_close(gossip *g, conn *c)
{
	if (c->fd >= 0)
		close(c->fd);
	free(c->buf);
	memset(c, 0, sizeof *c);
	c->fd = -1;
	c->phase = CONN_FREE;
}

/* A free slot for an exchange we start, or NULL (incoming ones never take
 * these). */
static conn *conn_slot_out(gossip *g)
{
	for (int i = CONNS_IN; i < CONNS_MAX; i++)
		if (g->conns[i].phase == CONN_FREE)
			return &g->conns[i];
	return NULL;
}

/* An unauthenticated connection keeps its slot at least this long (a dialer
 * sends its frame right after connecting; a flood must not evict it before
 * it arrived). */
static int64_t evict_grace_ms(const gossip *g)
{
	return g->t.tcp_first_ms / 4;
}

/* The slot for the next incoming connection: a free one; else the
 * unauthenticated holder accepted first, once it has held its slot
 * evict_grace_ms (the caller closes it); else NULL: the connection waits in
 * the listen backlog, and *retry_ms (may be NULL) is when a holder may be
 * evicted (INT64_MAX: every holder is authenticated and answering). */
static conn *conn_slot_in(gossip *g, int64_t now, int64_t *retry_ms)
{
	conn *oldest = NULL;
	for (int i = 0; i < CONNS_IN; i++) {
		conn *c = &g->conns[i];
		if (c->phase == CONN_FREE)
			return c;
		if (!c->authed && (!oldest || c->opened_ms < oldest->opened_ms))
			oldest = c;
	}
	int64_t at = oldest ? oldest->opened_ms + evict_grace_ms(g) : INT64_MAX;
	if (now >= at)
		return oldest;
	if (retry_ms)
		*retry_ms = at;
	return NULL;
}

/* Builds a sealed frame (u32 length + packet) into c->buf: our whole table,
 * or, for a referral (refer != NULL), the member `refer` and ourselves. */
static int frame_build(gossip *g, conn *c, int flags, const uint8_t *refer)
{
	size_t cap = GOSSIP_FRAME_MAX - 4 - GOSSIP_OVERHEAD;
	size_t want = 3 + GOSSIP_MSG_HDR + (refer ? 2 : g->tab.n) * GOSSIP_MSG_MAX;
	if (want < cap)
		cap = want;
	uint8_t *plain = malloc(cap);
	uint8_t *frame = malloc(cap + 4 + GOSSIP_OVERHEAD);
	if (!plain || !frame) {
		free(plain);
		free(frame);
		return DS_ENOMEM;
	}
	size_t len = 0;
	gossip_msg pp = {.type = GOSSIP_MSG_PUSH_PULL, .flags = (uint8_t)flags};
	gossip_msg_put(plain, cap, &len, &pp); /* count patched below */
	uint16_t count = 0;
	const gossip_node *only[2] = {refer ? gossip_tab_find(&g->tab, refer) : NULL,
				      &g->tab.nodes[0]};
	if (refer && !only[0]) {
		free(plain);
		free(frame);
		return DS_ENOTFOUND;
	}
	size_t total = refer ? 2 : g->tab.n;
	for (size_t i = 0; i < total && count < UINT16_MAX; i++) {
		const gossip_node *nd = refer ? only[i] : &g->tab.nodes[i];
		gossip_msg m;
		gossip_tab_msg_alive(nd, &m);
		m.type = GOSSIP_MSG_STATE;
		m.state = (uint8_t)nd->m.state;
		if (gossip_msg_put(plain, cap, &len, &m) != DS_OK)
			break; /* the frame is full: the rest travels by gossip */
		count++;
	}
	plain[GOSSIP_MSG_HDR + 1] = (uint8_t)(count >> 8);
	plain[GOSSIP_MSG_HDR + 2] = (uint8_t)count;
	size_t n = 0;
	gossip_seal(&g->keys, g->id, g->epoch, next_seq(g), plain, len, frame + 4,
		    cap + GOSSIP_OVERHEAD, &n);
	free(plain);
	frame[0] = (uint8_t)(n >> 24);
	frame[1] = (uint8_t)(n >> 16);
	frame[2] = (uint8_t)(n >> 8);
	frame[3] = (uint8_t)n;
	free(c->buf);
	c->buf = frame;
	c->len = n + 4;
	c->off = 0;
	c->phase = CONN_WRITE;
	g->st.packets_out++;
	g->st.bytes_out += n + 4;
	g->st.tcp_bytes_out += n + 4;
	return DS_OK;
}

static int pp_start(gossip *g, const struct sockaddr_in *to, const uint8_t *id, int purpose,
		    int64_t now)
{
	if (dropped_peer(g, id, to)) {
		g->st.drop_test++;
		return DS_EPERM;
	}
	conn *c = conn_slot_out(g);
	if (!c)
		return DS_EBUSY;
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return DS_EIO;
	if (connect(fd, (const struct sockaddr *)to, sizeof *to) != 0 && errno != EINPROGRESS) {
		close(fd);
		g->st.tcp_failed++;
		return DS_EIO;
	}
	c->fd = fd;
	c->purpose = purpose;
	c->peer = *to;
	c->opened_ms = now;
	c->deadline_ms = now + g->t.tcp_timeout_ms;
	int flags = purpose == PP_JOIN	    ? GOSSIP_PP_JOIN
		    : purpose == PP_REFERRED ? GOSSIP_PP_JOIN | GOSSIP_PP_REFERRED
					     : 0;
	if (frame_build(g, c, flags, NULL) != DS_OK) {
		conn_close(g, c);
		return DS_ENOMEM;
	}
	c->phase = CONN_CONNECTING;
	return DS_OK;
}

static void join_done(gossip *g, int ok, int64_t now)
{
	g->join_inflight--;
	if (ok) {
		if (!g->joined) {
			log_info("gossip", "joined the cluster", "members=%zu", g->tab.n);
			/* A first periodic push-pull 1-3 s after joining, not a full
			 * interval: it catches a join of the same burst whose broadcasts
			 * were over before we were known (or that the member a referral
			 * named had not heard of yet). */
			int64_t soon = now + 1000 + (int64_t)rnd(2000);
			if (soon < g->next_pp_ms)
				g->next_pp_ms = soon;
		}
		g->joined = 1;
		g->join_round_ok = 1;
		g->st.joins_ok++;
	}
	if (g->join_inflight > 0)
		return;
	if (g->join_round_ok) {
		g->join_backoff_ms = g->t.join_backoff_min_ms;
		g->next_join_ms = now + g->t.reconnect_ms;
	} else {
		g->next_join_ms = now + g->join_backoff_ms;
		log_info("gossip", "no seed answered; retrying", "in_ms=%lld",
			 (long long)g->join_backoff_ms);
		g->join_backoff_ms *= 2;
		if (g->join_backoff_ms > g->t.join_backoff_max_ms)
			g->join_backoff_ms = g->t.join_backoff_max_ms;
	}
}

static void conn_finish(gossip *g, conn *c, int ok, int64_t now)
{
	if (ok)
		g->st.push_pulls++;
	else if (c->purpose != PP_INCOMING)
		g->st.tcp_failed++;
	if (c->purpose == PP_JOIN && ok && c->refer) {
		/* Known to the seed now; the full state comes from the member it
		 * named (and the early push-pull of join_done). */
		if (pp_start(g, &c->refer_addr, c->refer_id, PP_REFERRED, now) == DS_OK)
			g->join_inflight++;
	}
	if (c->purpose == PP_JOIN || c->purpose == PP_REFERRED)
		join_done(g, ok, now);
	conn_close(g, c);
}

/* Resolves "host:port" to an IPv4 address (blocking DNS; seeds are few). */
static int seed_resolve(const char *seed, struct sockaddr_in *out)
{
	char host[256];
	const char *colon = strrchr(seed, ':');
	if (!colon || (size_t)(colon - seed) >= sizeof host)
		return DS_EINVAL;
	memcpy(host, seed, (size_t)(colon - seed));
	host[colon - seed] = '\0';
	struct addrinfo hints = {0}, *res = NULL;
	hints.ai_family = AF_INET;
	hints.ai_socktype = SOCK_STREAM;
	if (getaddrinfo(host, colon + 1, &hints, &res) != 0 || !res)
		return DS_ENOTFOUND;
	memcpy(out, res->ai_addr, sizeof *out);
	freeaddrinfo(res);
	return DS_OK;
}

static int is_self_addr(const gossip *g, const struct sockaddr_in *a)
{
	if (ntohs(a->sin_port) != g->port && ntohs(a->sin_port) != g->adv_port)
		return 0;
	return a->sin_addr.s_addr == g->adv_ip || (ntohl(a->sin_addr.s_addr) >> 24) == 127;
}

/* Called with mu held; releases it while resolving (DNS may block), which is
 * safe because only this thread touches the seeds, the join state and the
 * TCP exchanges. */
static void join_tick(gossip *g, int64_t now, int64_t *next)
{
	if (!g->n_seeds || g->tab.leaving)
		return;
	int alone = gossip_tab_live_count(&g->tab) <= 1;
	if ((g->joined && !alone) || g->join_inflight > 0)
		return;
	if (now < g->next_join_ms) {
		*next = g->next_join_ms < *next ? g->next_join_ms : *next;
		return;
	}
	g->st.join_attempts++;
	g->join_round_ok = 0;
	struct sockaddr_in sa[SEEDS_MAX];
	int ok[SEEDS_MAX];
	pthread_mutex_unlock(&g->mu);
	for (size_t i = 0; i < g->n_seeds; i++)
		ok[i] = seed_resolve(g->seeds[i], &sa[i]) == DS_OK;
	pthread_mutex_lock(&g->mu);
	int started = 0, only_self = 1; /* the seeds name only us: the first node */
	for (size_t i = 0; i < g->n_seeds; i++) {
		if (!ok[i]) {
			log_warn("gossip", "cannot resolve seed", "seed=%s", g->seeds[i]);
			only_self = 0;
			continue;
		}
		if (is_self_addr(g, &sa[i]))
			continue;
		only_self = 0;
		if (pp_start(g, &sa[i], NULL, PP_JOIN, now) == DS_OK) {
			started++;
			g->join_inflight++;
		}
	}
	if (!started) {
		if (only_self) {
			g->joined = 1;
			g->next_join_ms = now + g->t.reconnect_ms;
		} else {
			g->join_inflight = 1;
			join_done(g, 0, now);
		}
	}
	*next = g->next_join_ms < *next ? g->next_join_ms : *next;
}

static void pp_tick(gossip *g, int64_t now, int64_t *next)
{
	if (now >= g->next_pp_ms) {
		int n = (int)g->tab.n;
		int64_t iv = g->t.push_pull_ms;
		if (n > 32) /* memberlist pushPullScale */
			iv *= (int64_t)ceil(log2((double)n) - log2(32.0)) + 1;
		g->next_pp_ms = now + iv;
		uint8_t id[1][GOSSIP_ID_LEN];
		if (pick(g, 1, keep_alive, NULL, now, id) == 1) {
			gossip_node *nd = gossip_tab_find(&g->tab, id[0]);
			struct sockaddr_in to;
			addr_of(&nd->m, &to);
			pp_start(g, &to, id[0], PP_PERIODIC, now);
		}
	}
	if (now >= g->next_reconnect_ms) {
		g->next_reconnect_ms = now + g->t.reconnect_ms;
		uint8_t id[1][GOSSIP_ID_LEN];
		if (pick(g, 1, keep_dead, NULL, now, id) == 1) {
			gossip_node *nd = gossip_tab_find(&g->tab, id[0]);
			struct sockaddr_in to;
			addr_of(&nd->m, &to);
			pp_start(g, &to, id[0], PP_RECONNECT, now);
		}
	}
	*next = g->next_pp_ms < *next ? g->next_pp_ms : *next;
	*next = g->next_reconnect_ms < *next ? g->next_reconnect_ms : *next;
}

/* ---- receiving ---- */

static void count_drop(gossip *g, int why)
{
	switch (why) {
	case GOSSIP_DROP_TOO_LARGE: g->st.drop_too_large++; break;
	case GOSSIP_DROP_MALFORMED: g->st.drop_malformed++; break;
	case GOSSIP_DROP_BAD_KEY: g->st.drop_bad_key++; break;
	case GOSSIP_DROP_AUTH_FAIL: g->st.drop_auth_fail++; break;
	case GOSSIP_DROP_REPLAY: g->st.drop_replay++; break;
	case GOSSIP_DROP_STALE: g->st.drop_stale++; break;
	case GOSSIP_DROP_WRONG_TARGET: g->st.drop_wrong_target++; break;
	case GOSSIP_DROP_OWN_ID: g->st.drop_own_id++; break;
	case GOSSIP_DROP_UNKNOWN_SENDER: g->st.drop_unknown_sender++; break;
	default: break;
	}
}

/* Opens a packet and runs the checks shared by UDP and TCP: own id, fault
 * switch, replay window.  Returns a drop reason, or -1 for the fault switch
 * (counted here), or 0. */
static int accept_packet(gossip *g, const uint8_t *pkt, size_t len, size_t max_len,
			 const struct sockaddr_in *from, gossip_hdr *h, uint8_t *plain,
			 size_t *plen, int64_t now)
{
	int why = gossip_open(&g->keys, pkt, len, max_len, h, plain, plen);
	if (why)
		return why;
	if (memcmp(h->sender, g->id, GOSSIP_ID_LEN) == 0) {
		if (now - g->own_id_warned_ms > 10000 || !g->own_id_warned_ms) {
			char a[16];
			inet_ntop(AF_INET, &from->sin_addr, a, sizeof a);
			log_warn("gossip", "a packet with our own node id (a copied data directory?)",
				 "from=%s:%d", a, ntohs(from->sin_port));
			g->own_id_warned_ms = now;
		}
		return GOSSIP_DROP_OWN_ID;
	}
	if (dropped_peer(g, h->sender, from)) {
		g->st.drop_test++;
		return -1;
	}
	why = gossip_replay_check(&g->replay, h->sender, h->seq, wall_us());
	if (why)
		return why;
	gossip_node *nd = gossip_tab_find(&g->tab, h->sender);
	if (nd && h->epoch > nd->m.epoch)
		nd->m.epoch = h->epoch;
	return 0;
}

static int is_live_member(gossip *g, const uint8_t *id)
{
	gossip_node *nd = gossip_tab_find(&g->tab, id);
	return nd && nd != &g->tab.nodes[0] &&
	       (nd->m.state == GOSSIP_ALIVE || nd->m.state == GOSSIP_SUSPECT);
}

static void handle_msg(gossip *g, const gossip_hdr *h, const gossip_msg *m,
		       const struct sockaddr_in *from, int64_t now)
{
	switch (m->type) {
	case GOSSIP_MSG_PING: {
		if (memcmp(m->id, g->id, GOSSIP_ID_LEN) != 0) {
			g->st.drop_wrong_target++;
			return;
		}
		gossip_msg ack = {.type = GOSSIP_MSG_ACK, .seq = m->seq};
		send_msg(g, from, h->sender, &ack, NULL);
		return;
	}
	case GOSSIP_MSG_PING_REQ: {
		if (!is_live_member(g, h->sender)) {
			g->st.drop_unknown_sender++;
			return;
		}
		if (g->n_relays == RELAYS_MAX)
			return;
		relay *r = &g->relays[g->n_relays++];
		r->our_seq = ++g->seq_no;
		r->their_seq = m->seq;
		r->reply_to = *from;
		r->want_nack = m->want_nack;
		r->deadline_ms = now + g->t.probe_timeout_ms;
		gossip_msg ping = {.type = GOSSIP_MSG_PING, .seq = r->our_seq};
		memcpy(ping.id, m->id, GOSSIP_ID_LEN);
		struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons(m->port)};
		to.sin_addr.s_addr = m->ip;
		send_msg(g, &to, m->id, &ping, NULL);
		return;
	}
	case GOSSIP_MSG_ACK:
		if (g->probe.active && m->seq == g->probe.seq) {
			g->probe.active = 0;
			g->st.acks_in++;
			gossip_tab_awareness(&g->tab, -1);
			return;
		}
		for (int i = 0; i < g->n_relays; i++)
			if (g->relays[i].our_seq == m->seq) {
				gossip_msg ack = {.type = GOSSIP_MSG_ACK, .seq = g->relays[i].their_seq};
				struct sockaddr_in to = g->relays[i].reply_to;
				g->relays[i] = g->relays[--g->n_relays];
				send_msg(g, &to, NULL, &ack, NULL);
				return;
			}
		return; /* late: the probe is over */
	case GOSSIP_MSG_NACK:
		if (g->probe.active && m->seq == g->probe.seq) {
			g->probe.nacks++;
			g->st.nacks_in++;
		}
		return;
	case GOSSIP_MSG_ALIVE:
		gossip_tab_alive(&g->tab, m, now);
		return;
	case GOSSIP_MSG_SUSPECT:
		gossip_tab_suspect(&g->tab, m, now);
		return;
	case GOSSIP_MSG_DEAD:
		gossip_tab_dead(&g->tab, m, now);
		return;
	default:
		return;
	}
}

static void handle_datagram(gossip *g, const uint8_t *pkt, size_t len,
			    const struct sockaddr_in *from, int64_t now)
{
	uint8_t plain[GOSSIP_UDP_MAX];
	size_t plen = 0;
	gossip_hdr h;
	g->st.packets_in++;
	g->st.bytes_in += len;
	int why = accept_packet(g, pkt, len, GOSSIP_UDP_MAX, from, &h, plain, &plen, now);
	if (why) {
		if (why > 0)
			count_drop(g, why);
		return;
	}
	/* Decode all before acting on any; TCP-only messages are malformed here. */
	size_t off = 0;
	gossip_msg m;
	int rc, n = 0;
	while ((rc = gossip_msg_next(plain, plen, &off, &m)) == 1) {
		if (m.type == GOSSIP_MSG_PUSH_PULL || m.type == GOSSIP_MSG_STATE) {
			rc = DS_EFORMAT;
			break;
		}
		n++;
	}
	if (rc < 0 || n == 0) {
		g->st.drop_malformed++;
		return;
	}
	off = 0;
	while (gossip_msg_next(plain, plen, &off, &m) == 1)
		handle_msg(g, &h, &m, from, now);
}

static void read_udp(gossip *g, int64_t now)
{
	uint8_t buf[65536];
	for (int i = 0; i < RECV_BATCH; i++) {
		struct sockaddr_in from;
		socklen_t fl = sizeof from;
		ssize_t n = recvfrom(g->udp, buf, sizeof buf, MSG_DONTWAIT | MSG_TRUNC,
				     (struct sockaddr *)&from, &fl);
		if (n < 0)
			return; /* EAGAIN, or an ICMP error from an earlier send */
		if (fl != sizeof from || from.sin_family != AF_INET)
			continue;
		size_t len = (size_t)n > sizeof buf ? sizeof buf : (size_t)n;
		if ((size_t)n > GOSSIP_UDP_MAX) {
			g->st.packets_in++;
			g->st.bytes_in += (uint64_t)n;
			g->st.drop_too_large++;
			continue;
		}
		handle_datagram(g, buf, len, &from, now);
	}
}

/* A whole frame arrived on c: open, check, merge; answer when incoming. */
static int frame_process(gossip *g, conn *c, int64_t now)
{
	uint8_t *plain = malloc(c->len ? c->len : 1);
	size_t plen = 0;
	gossip_hdr h;
	int ok = 0;
	if (!plain)
		return 0;
	g->st.packets_in++;
	g->st.bytes_in += c->len + 4;
	g->st.tcp_bytes_in += c->len + 4;
	int why = accept_packet(g, c->buf, c->len, GOSSIP_FRAME_MAX, &c->peer, &h, plain, &plen,
				now);
	if (why) {
		if (why > 0)
			count_drop(g, why);
		goto out;
	}
	if (c->purpose == PP_INCOMING) { /* a key holder: the whole exchange time */
		c->authed = 1;
		c->deadline_ms = c->opened_ms + g->t.tcp_timeout_ms;
	}
	size_t off = 0;
	gossip_msg m;
	int rc = gossip_msg_next(plain, plen, &off, &m);
	if (rc != 1 || m.type != GOSSIP_MSG_PUSH_PULL) {
		g->st.drop_malformed++;
		goto out;
	}
	int flags = m.flags, join = flags & GOSSIP_PP_JOIN, refer = flags & GOSSIP_PP_REFER;
	size_t count = m.count, first = off, got = 0;
	while ((rc = gossip_msg_next(plain, plen, &off, &m)) == 1 && m.type == GOSSIP_MSG_STATE)
		got++;
	if (rc != 0 || got != count) {
		g->st.drop_malformed++;
		goto out;
	}
	off = first;
	/* What is new to us is gossiped on, except what the answer to our own
	 * join tells us: that is old news to the cluster (memberlist broadcasts
	 * it again; in a burst of 50 joins that was about half the UDP traffic). */
	g->tab.quiet = c->purpose == PP_JOIN || c->purpose == PP_REFERRED;
	int first_entry = 1;
	while (gossip_msg_next(plain, plen, &off, &m) == 1) {
		if (refer && first_entry && c->purpose == PP_JOIN &&
		    memcmp(m.id, g->id, GOSSIP_ID_LEN) != 0 &&
		    memcmp(m.id, h.sender, GOSSIP_ID_LEN) != 0) {
			c->refer = 1;
			memcpy(c->refer_id, m.id, GOSSIP_ID_LEN);
			memset(&c->refer_addr, 0, sizeof c->refer_addr);
			c->refer_addr.sin_family = AF_INET;
			memcpy(&c->refer_addr.sin_addr, &m.ip, 4);
			c->refer_addr.sin_port = htons(m.port);
		}
		first_entry = 0;
		gossip_tab_merge(&g->tab, &m, h.sender, now);
	}
	g->tab.quiet = 0;
	ok = 1;
	int busy = 0;
	if (c->purpose == PP_INCOMING) {
		uint8_t to[1][GOSSIP_ID_LEN];
		if (join && !(flags & GOSSIP_PP_REFERRED)) {
			if (now - g->jw_start_ms >= 1000) {
				g->jw_start_ms = now;
				g->jw_full = 0;
			}
			busy = g->jw_full >= g->t.join_full_per_s &&
			       pick(g, 1, keep_synced, h.sender, now, to) == 1;
			if (!busy)
				g->jw_full++;
			char a[16];
			inet_ntop(AF_INET, &c->peer.sin_addr, a, sizeof a);
			log_debug("gossip", busy ? "join request, referred" : "join request",
				  "from=%s members=%zu", a, count);
		}
		if (busy) {
			g->st.joins_referred++;
			ok = frame_build(g, c, GOSSIP_PP_REFER, to[0]) == DS_OK ? 2 : 0;
		} else {
			ok = frame_build(g, c, 0, NULL) == DS_OK ? 2 : 0;
		}
	}
	/* Our full state went to the sender (in its answer, or in our request):
	 * from now on it may answer joins that we refer to it. */
	gossip_node *peer = gossip_tab_find(&g->tab, h.sender);
	if (peer && ok && !busy)
		peer->synced_ms = now;
out:
	free(plain);
	return ok;
}

/* The largest packet c may bring: an answer to our own dial may be a whole
 * frame; an incoming first frame is not authenticated before it is whole,
 * so only as large as a member's table can plausibly be. */
static size_t frame_limit(const gossip *g, const conn *c)
{
	return c->purpose == PP_INCOMING ? gossip_frame_preauth_max(g->tab.n) : GOSSIP_FRAME_MAX;
}

static void conn_io(gossip *g, conn *c, short rev, int64_t now)
{
	if (c->phase == CONN_CONNECTING) {
		int e = 0;
		socklen_t el = sizeof e;
		if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &e, &el) != 0 || e != 0) {
			conn_finish(g, c, 0, now);
			return;
		}
		g->st.tcp_connected++;
		c->phase = CONN_WRITE;
	}
	if (c->phase == CONN_WRITE) {
		while (c->off < c->len) {
			ssize_t w = send(c->fd, c->buf + c->off, c->len - c->off,
					 MSG_DONTWAIT | MSG_NOSIGNAL);
			if (w < 0 && (errno == EAGAIN || errno == EINTR))
				return;
			if (w <= 0) {
				conn_finish(g, c, 0, now);
				return;
			}
			c->off += (size_t)w;
		}
		if (c->purpose == PP_INCOMING) { /* our answer is out: done */
			conn_finish(g, c, 1, now);
			return;
		}
		free(c->buf);
		c->buf = NULL;
		c->len = c->off = c->head_got = 0;
		c->phase = CONN_READ;
		return;
	}
	if (c->phase != CONN_READ)
		return;
	/* The length and the packet's header go to head[]; the packet's buffer
	 * exists only once they passed gossip_head_check against the limit of
	 * this direction (frame_limit), so a peer without the key makes us hold
	 * at most head[] until its header shows it. */
	for (;;) {
		ssize_t r;
		size_t want = c->head_got < 4 ? 4 : sizeof c->head;
		if (!c->buf)
			r = recv(c->fd, c->head + c->head_got, want - c->head_got, MSG_DONTWAIT);
		else
			r = recv(c->fd, c->buf + c->off, c->len - c->off, MSG_DONTWAIT);
		if (r < 0 && (errno == EAGAIN || errno == EINTR))
			return;
		if (r <= 0) {
			conn_finish(g, c, 0, now);
			return;
		}
		if (!c->buf) {
			c->head_got += (size_t)r;
			if (c->head_got < 4)
				continue;
			uint32_t n = ((uint32_t)c->head[0] << 24) | ((uint32_t)c->head[1] << 16) |
				     ((uint32_t)c->head[2] << 8) | c->head[3];
			int why = gossip_head_check(&g->keys, n, frame_limit(g, c), c->head + 4,
						    c->head_got - 4);
			if (why) {
				g->st.packets_in++;
				count_drop(g, why);
				conn_finish(g, c, 0, now);
				return;
			}
			if (c->head_got < sizeof c->head)
				continue;
			c->buf = malloc(n); /* n >= GOSSIP_OVERHEAD > GOSSIP_HDR_LEN */
			if (!c->buf) {
				conn_finish(g, c, 0, now);
				return;
			}
			memcpy(c->buf, c->head + 4, GOSSIP_HDR_LEN);
			c->len = n;
			c->off = GOSSIP_HDR_LEN;
			continue;
		}
		c->off += (size_t)r;
		if (c->off < c->len)
			continue;
		int ok = frame_process(g, c, now);
		if (ok == 2) /* incoming: the answer is in c->buf, phase WRITE */
			conn_io(g, c, POLLOUT, now);
		else
			conn_finish(g, c, ok, now);
		return;
	}
}

/* Accepts while there is an incoming slot to give (conn_slot_in); the rest
 * waits in the listen backlog, where a dialer's frame waits with it. */
static void accept_tcp(gossip *g, int64_t now)
{
	for (int k = 0; k < ACCEPTS_PER_ROUND; k++) {
		conn *c = conn_slot_in(g, now, NULL);
		if (!c)
			return;
		struct sockaddr_in from;
		socklen_t fl = sizeof from;
		int fd = accept4(g->tcp, (struct sockaddr *)&from, &fl, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0)
			return;
		if (c->phase != CONN_FREE) {
			g->st.tcp_evicted++;
			if (now - g->evict_warned_ms > 10000 || !g->evict_warned_ms) {
				char a[16];
				inet_ntop(AF_INET, &c->peer.sin_addr, a, sizeof a);
				log_warn("gossip",
					 "TCP slots full: closing connections that sent no whole frame "
					 "(a flood from a peer without the cluster key?)",
					 "oldest_from=%s:%d evicted=%llu", a, ntohs(c->peer.sin_port),
					 (unsigned long long)g->st.tcp_evicted);
				g->evict_warned_ms = now;
			}
			conn_finish(g, c, 0, now);
		}
		g->st.tcp_accepted++;
		c->fd = fd;
		c->purpose = PP_INCOMING;
		c->peer = from;
		c->phase = CONN_READ;
		c->opened_ms = now;
		c->deadline_ms = now + g->t.tcp_first_ms;
		conn_io(g, c, POLLIN, now); /* its frame is often here already */
	}
}

/* ---- the thread ---- */

static int64_t timers(gossip *g, int64_t now)
{
	int64_t next = now + 1000;
	if (!g->tab.leaving) {
		probe_tick(g, now, &next);
		pp_tick(g, now, &next);
		join_tick(g, now, &next);
	}
	relay_tick(g, now, &next);
	gossip_tick(g, now, &next);
	for (int i = 0; i < CONNS_MAX; i++) {
		conn *c = &g->conns[i];
		if (c->phase == CONN_READ && now >= c->deadline_ms)
			conn_io(g, c, POLLIN, now); /* a last read: we may have been slow, not it */
		if (c->phase == CONN_FREE)
			continue;
		if (now >= c->deadline_ms) {
			if (c->purpose == PP_INCOMING && !c->authed)
				g->st.tcp_first_timeouts++;
			conn_finish(g, c, 0, now);
		} else if (c->deadline_ms < next) {
			next = c->deadline_ms;
		}
	}
	int64_t retry = INT64_MAX; /* no incoming slot to give: until one may be taken */
	if (!conn_slot_in(g, now, &retry) && retry < next)
		next = retry;
	int64_t t = gossip_tab_tick(&g->tab, now);
	return t < next ? t : next;
}

static void log_event(const gossip_event *ev)
{
	static const char *msg[] = {"?",	       "member joined",  "member alive again",
				    "member suspect",  "member failed",  "member left",
				    "member updated",  "member restarted", "member reaped"};
	const gossip_member *m = &ev->member;
	char id[GOSSIP_ID_HEX];
	gossip_id_hex(m->id, id);
	int k = ev->kind >= GOSSIP_EV_JOIN && ev->kind <= GOSSIP_EV_REAP ? ev->kind : 0;
	log_write(k == GOSSIP_EV_DEAD || k == GOSSIP_EV_SUSPECT ? LOG_WARN : LOG_INFO, "gossip",
		  msg[k], "name=%s id=%s addr=%s:%u state=%s incarnation=%u", m->name, id,
		  m->addr, (unsigned)m->port, gossip_state_name(m->state),
		  (unsigned)m->incarnation);
}

/* Takes the queued events under mu; delivers them after unlocking. */
static void unlock_and_deliver(gossip *g)
{
	gossip_event *ev = NULL;
	size_t n = gossip_tab_events_take(&g->tab, &ev);
	pthread_mutex_unlock(&g->mu);
	for (size_t i = 0; i < n; i++) {
		log_event(&ev[i]);
		if (g->on_event)
			g->on_event(g->ud, &ev[i]);
	}
	free(ev);
}

static void *gossip_main(void *arg)
{
	gossip *g = arg;
	struct pollfd fds[3 + CONNS_MAX];
	int map[3 + CONNS_MAX];
	for (;;) {
		pthread_mutex_lock(&g->mu);
		if (g->stop) {
			pthread_mutex_unlock(&g->mu);
			break;
		}
		int64_t now = mono_ms();
		int64_t next = timers(g, now);
		int nf = 0;
		fds[nf++] = (struct pollfd){.fd = g->wake_rd, .events = POLLIN};
		fds[nf++] = (struct pollfd){.fd = g->udp, .events = POLLIN};
		/* no slot to give: leave new connections in the backlog */
		int room = conn_slot_in(g, now, NULL) != NULL;
		fds[nf++] = (struct pollfd){.fd = room ? g->tcp : -1, .events = POLLIN};
		for (int i = 0; i < CONNS_MAX; i++) {
			conn *c = &g->conns[i];
			if (c->phase == CONN_FREE)
				continue;
			short ev = c->phase == CONN_READ ? POLLIN : POLLOUT;
			map[nf] = i;
			fds[nf++] = (struct pollfd){.fd = c->fd, .events = ev};
		}
		unlock_and_deliver(g);
		int64_t wait = next - mono_ms();
		if (wait < 0)
			wait = 0;
		if (wait > 1000)
			wait = 1000;
		int pr = poll(fds, (nfds_t)nf, (int)wait);
		if (pr <= 0)
			continue;
		pthread_mutex_lock(&g->mu);
		now = mono_ms();
		if (fds[0].revents) {
			char drain[64];
			while (read(g->wake_rd, drain, sizeof drain) > 0) {
			}
		}
		if (fds[1].revents)
			read_udp(g, now);
		if (fds[2].revents)
			accept_tcp(g, now);
		for (int i = 3; i < nf; i++)
			if (fds[i].revents && g->conns[map[i]].phase != CONN_FREE)
				conn_io(g, &g->conns[map[i]], fds[i].revents, now);
		unlock_and_deliver(g);
	}
	return NULL;
}

/* ---- setup ---- */

static int first_ipv4(char out[16])
{
	struct ifaddrs *ifa = NULL;
	if (getifaddrs(&ifa) != 0)
		return DS_ENOTFOUND;
	int rc = DS_ENOTFOUND;
	for (struct ifaddrs *i = ifa; i; i = i->ifa_next) {
		if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP) ||
		    (i->ifa_flags & IFF_LOOPBACK))
			continue;
		inet_ntop(AF_INET, &((struct sockaddr_in *)(void *)i->ifa_addr)->sin_addr, out, 16);
		rc = DS_OK;
		break;
	}
	freeifaddrs(ifa);
	return rc;
}

static int bind_both(gossip *g, const char *addr, int port, ds_err *err)
{
	struct sockaddr_in sa = {.sin_family = AF_INET};
	if (inet_pton(AF_INET, addr, &sa.sin_addr) != 1)
		return ds_err_set(err, DS_EINVAL, "gossip bind address '%s' is not an IPv4 address",
				  addr);
	for (int attempt = 0; attempt < 32; attempt++) {
		g->udp = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		g->tcp = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		if (g->udp < 0 || g->tcp < 0)
			return ds_err_set(err, DS_EIO, "socket: %s", strerror(errno));
		int one = 1;
		setsockopt(g->tcp, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
		sa.sin_port = htons((uint16_t)port);
		if (bind(g->udp, (struct sockaddr *)&sa, sizeof sa) != 0)
			return ds_err_set(err, DS_EIO, "cannot bind gossip UDP %s:%d: %s", addr, port,
					  strerror(errno));
		struct sockaddr_in got;
		socklen_t gl = sizeof got;
		getsockname(g->udp, (struct sockaddr *)&got, &gl);
		sa.sin_port = got.sin_port;
		if (bind(g->tcp, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(g->tcp, 64) == 0) {
			g->port = ntohs(got.sin_port);
			return DS_OK;
		}
		int e = errno;
		close(g->udp);
		close(g->tcp);
		g->udp = g->tcp = -1;
		if (port != 0 || e != EADDRINUSE)
			return ds_err_set(err, DS_EIO, "cannot bind gossip TCP %s:%d: %s", addr,
					  ntohs(got.sin_port), strerror(e));
	}
	return ds_err_set(err, DS_EIO, "no free port for gossip UDP and TCP on %s", addr);
}

static int seeds_parse(gossip *g, const char *csv, ds_err *err)
{
	if (!csv || !*csv)
		return DS_OK;
	const char *p = csv;
	while (*p) {
		const char *e = strchr(p, ',');
		size_t n = e ? (size_t)(e - p) : strlen(p);
		char s[300];
		if (n == 0 || n >= sizeof s)
			return ds_err_set(err, DS_EINVAL, "--join: empty or too long entry in '%s'",
					  csv);
		memcpy(s, p, n);
		s[n] = '\0';
		const char *colon = strrchr(s, ':');
		int port = 0;
		if (!colon || colon == s || ds_parse_int(colon + 1, 1, 65535, &port) != DS_OK)
			return ds_err_set(err, DS_EINVAL,
					  "--join: '%s' is not HOST:PORT (port 1..65535)", s);
		if (g->n_seeds == SEEDS_MAX)
			return ds_err_set(err, DS_EINVAL, "--join: more than %d seeds", SEEDS_MAX);
		if (!(g->seeds[g->n_seeds] = strdup(s)))
			return ds_err_set(err, DS_ENOMEM, "out of memory");
		g->n_seeds++;
		p += n;
		if (*p == ',')
			p++;
	}
	return DS_OK;
}

gossip_params gossip_default_params(void)
{
	gossip_params p;
	memset(&p, 0, sizeof p);
	p.bind_addr = "0.0.0.0";
	p.port = GOSSIP_DEFAULT_PORT;
	gossip_timing_profile("lan", &p.timing, NULL);
	return p;
}

gossip *gossip_new(const gossip_params *p, ds_err *err)
{
	gossip *g = NULL;
	int rc = DS_OK;
	size_t nl = p->node_name ? strlen(p->node_name) : 0;
	if (sodium_init() < 0) {
		ds_err_set(err, DS_EINTERNAL, "libsodium could not start");
		return NULL;
	}
	if (nl < 1 || nl > GOSSIP_NAME_MAX) {
		ds_err_set(err, DS_EINVAL, "node name must be 1..%d characters", GOSSIP_NAME_MAX);
		return NULL;
	}
	for (size_t i = 0; i < nl; i++)
		if ((unsigned char)p->node_name[i] <= 0x20 || (unsigned char)p->node_name[i] >= 0x7f) {
			ds_err_set(err, DS_EINVAL,
				   "node name '%s' must be printable ASCII without spaces",
				   p->node_name);
			return NULL;
		}
	if (!p->keys || p->keys->n < 1) {
		ds_err_set(err, DS_EINVAL, "gossip needs a cluster key");
		return NULL;
	}
	if (p->meta_len > GOSSIP_META_MAX) {
		ds_err_set(err, DS_ERANGE, "node metadata is %zu bytes; at most %d", p->meta_len,
			   GOSSIP_META_MAX);
		return NULL;
	}
	if (p->timing.probe_interval_ms <= 0 || p->timing.probe_timeout_ms <= 0 ||
	    p->timing.gossip_interval_ms <= 0 || p->timing.push_pull_ms <= 0 ||
	    p->timing.reconnect_ms <= 0 || p->timing.tcp_timeout_ms <= 0 ||
	    p->timing.tcp_first_ms <= 0 ||
	    p->timing.max_skew_ms <= 0 || p->timing.join_backoff_min_ms <= 0 ||
	    p->timing.join_full_per_s <= 0) {
		ds_err_set(err, DS_EINVAL, "gossip timing has a zero or negative interval");
		return NULL;
	}
	if (p->timing.tcp_first_ms > p->timing.tcp_timeout_ms) {
		ds_err_set(err, DS_EINVAL,
			   "gossip timing: the first-frame deadline (%d ms) is longer than the TCP "
			   "exchange timeout (%d ms)",
			   p->timing.tcp_first_ms, p->timing.tcp_timeout_ms);
		return NULL;
	}
	if (p->port < 0 || p->port > 65535 || p->advertise_port < 0 || p->advertise_port > 65535) {
		ds_err_set(err, DS_EINVAL, "gossip port out of range");
		return NULL;
	}
	if (!(g = calloc(1, sizeof *g))) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	g->udp = g->tcp = g->wake_rd = g->wake_wr = -1;
	for (int i = 0; i < CONNS_MAX; i++)
		g->conns[i].fd = -1;
	pthread_mutex_init(&g->mu, NULL);
	g->t = p->timing;
	g->epoch = p->epoch;
	g->keys = *p->keys;
	memcpy(g->id, p->node_id, GOSSIP_ID_LEN);
	g->on_event = p->on_event;
	g->ud = p->ud;
	g->join_backoff_ms = g->t.join_backoff_min_ms;
	if ((rc = seeds_parse(g, p->seeds, err)))
		goto out;
	const char *bind_addr = p->bind_addr ? p->bind_addr : "0.0.0.0";
	if ((rc = bind_both(g, bind_addr, p->port, err)))
		goto out;
	const char *adv = p->advertise_addr;
	if (!adv || !*adv) {
		if (strcmp(bind_addr, "0.0.0.0") != 0)
			adv = bind_addr;
		else if (first_ipv4(g->adv_addr) == DS_OK)
			adv = g->adv_addr;
		else
			adv = "127.0.0.1";
	}
	struct in_addr ia;
	if (inet_pton(AF_INET, adv, &ia) != 1 || ia.s_addr == 0) {
		rc = ds_err_set(err, DS_EINVAL, "--advertise-addr '%s' is not a usable IPv4 address",
				adv);
		goto out;
	}
	ds_strlcpy(g->adv_addr, adv, sizeof g->adv_addr);
	g->adv_ip = ia.s_addr;
	g->adv_port = (uint16_t)(p->advertise_port ? p->advertise_port : g->port);
	int pfd[2];
	if (pipe2(pfd, O_NONBLOCK | O_CLOEXEC) != 0) {
		rc = ds_err_set(err, DS_EIO, "pipe: %s", strerror(errno));
		goto out;
	}
	g->wake_rd = pfd[0];
	g->wake_wr = pfd[1];
	gossip_member self;
	memset(&self, 0, sizeof self);
	memcpy(self.id, p->node_id, GOSSIP_ID_LEN);
	memcpy(self.name, p->node_name, nl + 1);
	ds_strlcpy(self.addr, g->adv_addr, sizeof self.addr);
	self.port = g->adv_port;
	self.incarnation = 1;
	self.boot = wall_us();
	self.epoch = p->epoch;
	self.meta_len = p->meta_len;
	if (p->meta_len)
		memcpy(self.meta, p->meta, p->meta_len);
	int64_t now = mono_ms();
	double wall_off = (double)wall_us() / 1e6 - (double)now / 1000.0;
	self.changed_s = wall_off + (double)now / 1000.0;
	if ((rc = gossip_tab_init(&g->tab, &g->t, &self, wall_off)) ||
	    (rc = gossip_replay_init(&g->replay, REPLAY_SENDERS, (uint64_t)g->t.max_skew_ms * 1000))) {
		ds_err_set(err, rc, "out of memory");
		goto out;
	}
	gossip_msg a;
	gossip_tab_msg_alive(&g->tab.nodes[0], &a);
	gossip_tab_bcast(&g->tab, g->id, &a);
	g->next_probe_ms = now + rnd((uint32_t)g->t.probe_interval_ms);
	g->next_gossip_ms = now;
	g->next_pp_ms = now + g->t.push_pull_ms;
	g->next_reconnect_ms = now + g->t.reconnect_ms;
	g->next_join_ms = now;
	g->joined = g->n_seeds == 0;
	if (pthread_create(&g->thread, NULL, gossip_main, g) != 0) {
		rc = ds_err_set(err, DS_EINTERNAL, "cannot start the gossip thread");
		goto out;
	}
	g->thread_started = 1;
	char idh[GOSSIP_ID_HEX];
	gossip_id_hex(g->id, idh);
	log_info("gossip", "started", "name=%s id=%s bind=%s:%d advertise=%s:%d profile=%s seeds=%zu",
		 p->node_name, idh, bind_addr, g->port, g->adv_addr, g->adv_port, g->t.name,
		 g->n_seeds);
out:
	if (rc) {
		gossip_free(g);
		return NULL;
	}
	return g;
}

void gossip_free(gossip *g)
{
	if (!g)
		return;
	if (g->thread_started) {
		pthread_mutex_lock(&g->mu);
		g->stop = 1;
		pthread_mutex_unlock(&g->mu);
		ssize_t w = write(g->wake_wr, "x", 1);
		(void)w;
		pthread_join(g->thread, NULL);
	}
	for (int i = 0; i < CONNS_MAX; i++)
		if (g->conns[i].phase != CONN_FREE)
			conn_close(g, &g->conns[i]);
	if (g->udp >= 0)
		close(g->udp);
	if (g->tcp >= 0)
		close(g->tcp);
	if (g->wake_rd >= 0)
		close(g->wake_rd);
	if (g->wake_wr >= 0)
		close(g->wake_wr);
	for (size_t i = 0; i < g->n_seeds; i++)
		free(g->seeds[i]);
	free(g->order);
	gossip_tab_free(&g->tab);
	gossip_replay_free(&g->replay);
	clusterkey_wipe(&g->keys);
	pthread_mutex_destroy(&g->mu);
	free(g);
}

/* ---- API ---- */

int gossip_port(const gossip *g)
{
	return g->port;
}

const char *gossip_advertise_addr(const gossip *g)
{
	return g->adv_addr;
}

int gossip_set_meta(gossip *g, const uint8_t *meta, size_t len, ds_err *err)
{
	if (len > GOSSIP_META_MAX)
		return ds_err_set(err, DS_ERANGE, "node metadata is %zu bytes; at most %d", len,
				  GOSSIP_META_MAX);
	pthread_mutex_lock(&g->mu);
	gossip_tab_set_meta(&g->tab, meta, len, mono_ms());
	pthread_mutex_unlock(&g->mu);
	return DS_OK;
}

void gossip_set_epoch(gossip *g, uint64_t epoch)
{
	pthread_mutex_lock(&g->mu);
	g->epoch = epoch;
	g->tab.nodes[0].m.epoch = epoch;
	pthread_mutex_unlock(&g->mu);
}

size_t gossip_members(gossip *g, gossip_member *out, size_t max)
{
	pthread_mutex_lock(&g->mu);
	size_t n = g->tab.n;
	for (size_t i = 0; i < n && i < max; i++)
		out[i] = g->tab.nodes[i].m;
	pthread_mutex_unlock(&g->mu);
	return n;
}

void gossip_stats_get(gossip *g, gossip_stats *out)
{
	pthread_mutex_lock(&g->mu);
	*out = g->st;
	out->awareness = g->tab.awareness;
	out->events_lost = g->tab.events_lost;
	out->table_full = g->tab.table_full;
	out->members = (int)g->tab.n;
	out->alive = gossip_tab_live_count(&g->tab);
	pthread_mutex_unlock(&g->mu);
}

int gossip_joined(gossip *g)
{
	pthread_mutex_lock(&g->mu);
	int j = g->joined;
	pthread_mutex_unlock(&g->mu);
	return j;
}

void gossip_leave(gossip *g, int wait_ms)
{
	pthread_mutex_lock(&g->mu);
	if (g->tab.leaving) {
		pthread_mutex_unlock(&g->mu);
		return;
	}
	int64_t now = mono_ms();
	gossip_tab_leave(&g->tab, now);
	g->probe.active = 0;
	uint8_t ids[16][GOSSIP_ID_LEN];
	size_t n = pick(g, 16, keep_alive, NULL, now, ids);
	gossip_msg d = {.type = GOSSIP_MSG_DEAD, .incarnation = g->tab.nodes[0].m.incarnation};
	memcpy(d.id, g->id, GOSSIP_ID_LEN);
	memcpy(d.from, g->id, GOSSIP_ID_LEN);
	for (size_t i = 0; i < n; i++) {
		uint8_t plain[GOSSIP_UDP_PLAIN_MAX];
		size_t len = 0;
		gossip_msg_put(plain, sizeof plain, &len, &d);
		gossip_node *nd = gossip_tab_find(&g->tab, ids[i]);
		struct sockaddr_in to;
		addr_of(&nd->m, &to);
		send_plain(g, &to, ids[i], plain, len);
	}
	pthread_mutex_unlock(&g->mu);
	log_info("gossip", "left the cluster", "told=%zu", n);
	if (wait_ms > 0) {
		struct timespec ts = {.tv_sec = wait_ms / 1000,
				      .tv_nsec = (long)(wait_ms % 1000) * 1000000L};
		nanosleep(&ts, NULL);
	}
}

int gossip_test_drop(gossip *g, const char *names_csv, ds_err *err)
{
	char names[DROP_NAMES_MAX][GOSSIP_NAME_MAX + 1] = {{0}};
	int n = 0;
	const char *p = names_csv ? names_csv : "";
	while (*p) {
		const char *e = strchr(p, ',');
		size_t l = e ? (size_t)(e - p) : strlen(p);
		if (l < 1 || l > GOSSIP_NAME_MAX || n == DROP_NAMES_MAX)
			return ds_err_set(err, DS_EINVAL,
					  "peers must be a comma-separated list of at most %d names",
					  DROP_NAMES_MAX);
		memcpy(names[n], p, l);
		names[n][l] = '\0';
		n++;
		p += l;
		if (*p == ',')
			p++;
	}
	pthread_mutex_lock(&g->mu);
	memcpy(g->drop_names, names, sizeof names);
	g->n_drop = n;
	pthread_mutex_unlock(&g->mu);
	log_warn("gossip", "TEST fault switch: dropping traffic with peers", "peers=%s",
		 n ? names_csv : "(none)");
	return DS_OK;
}

/* ---- JSON ---- */

static json_t *member_json(const gossip_member *m)
{
	char id[GOSSIP_ID_HEX], addr[32];
	char hex[2 * GOSSIP_META_MAX + 1];
	gossip_id_hex(m->id, id);
	snprintf(addr, sizeof addr, "%s:%u", m->addr, (unsigned)m->port);
	sodium_bin2hex(hex, sizeof hex, m->meta, m->meta_len);
	json_t *o = json_pack("{s:s,s:s,s:s,s:s,s:I,s:I,s:I,s:f,s:b,s:s}", "name", m->name, "id",
			      id, "addr", addr, "state", gossip_state_name(m->state), "incarnation",
			      (json_int_t)m->incarnation, "boot", (json_int_t)m->boot, "epoch",
			      (json_int_t)m->epoch, "changed", m->changed_s, "self", m->is_self,
			      "meta_hex", hex);
	if (!o)
		return NULL;
	gossip_meta md;
	json_t *meta = json_null();
	if (m->meta_len && gossip_meta_decode(m->meta, m->meta_len, &md, NULL) == DS_OK) {
		char head[GOSSIP_ID_HEX], inv[65];
		gossip_id_hex(md.head_id, head);
		sodium_bin2hex(inv, sizeof inv, md.inventory, sizeof md.inventory);
		json_decref(meta);
		meta = json_pack("{s:s,s:i,s:i,s:b,s:i,s:I,s:s,s:I,s:s,s:i,s:i}", "version",
				 md.version, "role", md.role, "health", md.health, "eligible",
				 md.eligible, "priority", (int)md.priority, "epoch",
				 (json_int_t)md.epoch, "head_id", head, "head_epoch",
				 (json_int_t)md.head_epoch, "inventory", inv, "control_port",
				 md.control_port, "api_port", md.api_port);
	}
	if (!meta || json_object_set_new(o, "meta", meta) != 0) {
		json_decref(o);
		return NULL;
	}
	return o;
}

json_t *gossip_status_json(gossip *g)
{
	size_t cap = 64, n;
	gossip_member *ms = NULL;
	for (;;) {
		free(ms);
		ms = malloc(cap * sizeof *ms);
		if (!ms)
			return NULL;
		n = gossip_members(g, ms, cap);
		if (n <= cap)
			break;
		cap = n + 16;
	}
	gossip_stats st;
	gossip_stats_get(g, &st);
	json_t *root = json_object(), *arr = json_array(), *stats = json_object();
	int bad = !root || !arr || !stats;
	for (size_t i = 0; !bad && i < n; i++) {
		json_t *o = member_json(&ms[i]);
		bad = !o || json_array_append_new(arr, o) != 0;
		if (!bad && i == 0)
			bad = json_object_set(root, "self", o) != 0;
	}
	for (const gossip_stat_field *f = gossip_stat_fields; !bad && f->name; f++) {
		uint64_t v;
		memcpy(&v, (const char *)&st + f->offset, sizeof v);
		bad = json_object_set_new(stats, f->name, json_integer((json_int_t)v)) != 0;
	}
	if (!bad)
		bad = json_object_set_new(stats, "awareness", json_integer(st.awareness)) ||
		      json_object_set_new(stats, "members", json_integer(st.members)) ||
		      json_object_set_new(stats, "alive", json_integer(st.alive));
	free(ms);
	if (bad) {
		json_decref(root);
		json_decref(arr);
		json_decref(stats);
		return NULL;
	}
	json_object_set_new(root, "members", arr);
	json_object_set_new(root, "stats", stats);
	json_object_set_new(root, "profile", json_string(g->t.name));
	json_object_set_new(root, "joined", json_boolean(gossip_joined(g)));
	return root;
}
