/*
 * test_gossip.c - unit tests of agent/cluster/gossip: the message codec, sealing,
 * the replay window, the suspicion-timeout math, the incarnation rules of
 * the membership table, metadata TLVs, the key and node id files, three
 * in-process instances on loopback (join, bad packets counted, leave), and
 * what a TCP client without the key can make an instance hold (buffers,
 * time) before its frame opens.
 * Every name starts with gossip_ (run them with `tests/unit gossip_`).
 */
#include "agent/auth/clusterkey_file.h"
#include "agent/cluster/gossip.h"
#include "agent/cluster/gossip_impl.h"
#include "tests/unit/unit.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#define UT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UT_ASAN 1
#endif
#endif
#if defined(UT_ASAN)
/* the sanitizer runtime's (sanitizer/allocator_interface.h, not always installed) */
size_t __sanitizer_get_current_allocated_bytes(void);
#else
#include <malloc.h>
#endif

/* ---- helpers ---------------------------------------------------------------- */

static void rand_bytes(uint8_t *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (uint8_t)ut_rand_u64();
}

static uint32_t rand_below(uint32_t n)
{
	return (uint32_t)(ut_rand_u64() % n);
}

static void rand_name(char *out, size_t min, size_t max)
{
	size_t n = min + rand_below((uint32_t)(max - min + 1));
	for (size_t i = 0; i < n; i++)
		out[i] = (char)(0x21 + rand_below(0x7e - 0x21 + 1));
	out[n] = '\0';
}

static uint8_t meta_store[16][GOSSIP_META_MAX];

/* A random valid message of the given type (meta points into meta_store[slot]). */
static void rand_msg(gossip_msg *m, int type, int slot)
{
	memset(m, 0, sizeof *m);
	m->type = type;
	m->seq = (uint32_t)ut_rand_u64();
	rand_bytes(m->id, GOSSIP_ID_LEN);
	rand_bytes(m->from, GOSSIP_ID_LEN);
	m->incarnation = (uint32_t)ut_rand_u64();
	m->ip = (uint32_t)ut_rand_u64();
	m->port = (uint16_t)(1 + rand_below(65535));
	m->boot = ut_rand_u64();
	if (type == GOSSIP_MSG_PING_REQ)
		m->want_nack = (uint8_t)rand_below(2);
	if (type == GOSSIP_MSG_PUSH_PULL) {
		m->flags = (uint8_t)rand_below(8); /* JOIN | REFER | REFERRED */
		m->count = (uint16_t)ut_rand_u64();
	}
	if (type == GOSSIP_MSG_ALIVE || type == GOSSIP_MSG_STATE) {
		rand_name(m->name, 1, GOSSIP_NAME_MAX);
		m->state = (uint8_t)rand_below(4);
		m->meta_len = rand_below(4) == 0 ? 0 : rand_below(GOSSIP_META_MAX + 1);
		rand_bytes(meta_store[slot], m->meta_len);
		m->meta = m->meta_len ? meta_store[slot] : NULL;
	}
}

/* Compares the fields that type carries. */
static int msg_equal(const gossip_msg *a, const gossip_msg *b)
{
	if (a->type != b->type)
		return 0;
	switch (a->type) {
	case GOSSIP_MSG_PING:
		return a->seq == b->seq && !memcmp(a->id, b->id, 16);
	case GOSSIP_MSG_PING_REQ:
		return a->seq == b->seq && !memcmp(a->id, b->id, 16) && a->ip == b->ip &&
		       a->port == b->port && a->want_nack == b->want_nack;
	case GOSSIP_MSG_ACK:
	case GOSSIP_MSG_NACK:
		return a->seq == b->seq;
	case GOSSIP_MSG_SUSPECT:
	case GOSSIP_MSG_DEAD:
		return !memcmp(a->id, b->id, 16) && a->incarnation == b->incarnation &&
		       !memcmp(a->from, b->from, 16);
	case GOSSIP_MSG_PUSH_PULL:
		return a->flags == b->flags && a->count == b->count;
	case GOSSIP_MSG_ALIVE:
	case GOSSIP_MSG_STATE:
		return !memcmp(a->id, b->id, 16) && a->incarnation == b->incarnation &&
		       a->ip == b->ip && a->port == b->port && a->boot == b->boot &&
		       !strcmp(a->name, b->name) && a->meta_len == b->meta_len &&
		       (!a->meta_len || !memcmp(a->meta, b->meta, a->meta_len)) &&
		       (a->type != GOSSIP_MSG_STATE || a->state == b->state);
	}
	return 0;
}

static clusterkey_ring ring_of(uint8_t id, const uint8_t key[32])
{
	clusterkey_ring k;
	memset(&k, 0, sizeof k);
	k.n = 1;
	k.id[0] = id;
	memcpy(k.key[0], key, 32);
	return k;
}

/* ---- codec ------------------------------------------------------------------ */

TEST(gossip_codec_roundtrip_every_type)
{
	for (int iter = 0; iter < 400; iter++) {
		uint8_t buf[8192];
		size_t len = 0;
		gossip_msg in[8], out;
		int n = 1 + (int)rand_below(8);
		for (int i = 0; i < n; i++) {
			rand_msg(&in[i], 1 + (int)rand_below(9), i);
			CHECK_EQ(gossip_msg_put(buf, sizeof buf, &len, &in[i]), DS_OK);
		}
		CHECK_EQ(gossip_msgs_check(buf, len), n);
		size_t off = 0;
		for (int i = 0; i < n; i++) {
			CHECK_EQ(gossip_msg_next(buf, len, &off, &out), 1);
			CHECK(msg_equal(&in[i], &out));
		}
		CHECK_EQ(gossip_msg_next(buf, len, &off, &out), 0);
		CHECK_EQ(off, len);
	}
}

TEST(gossip_codec_refuses_what_it_cannot_decode)
{
	uint8_t buf[2048];
	size_t len = 0;
	gossip_msg m;
	rand_msg(&m, GOSSIP_MSG_ALIVE, 0);
	m.name[0] = '\0'; /* empty name */
	CHECK_EQ(gossip_msg_put(buf, sizeof buf, &len, &m), DS_EINVAL);
	rand_msg(&m, GOSSIP_MSG_ALIVE, 0);
	m.name[3] = ' '; /* space in a name */
	m.name[4] = '\0';
	CHECK_EQ(gossip_msg_put(buf, sizeof buf, &len, &m), DS_EINVAL);
	rand_msg(&m, GOSSIP_MSG_ALIVE, 0);
	m.port = 0;
	CHECK_EQ(gossip_msg_put(buf, sizeof buf, &len, &m), DS_EINVAL);
	rand_msg(&m, GOSSIP_MSG_STATE, 0);
	m.state = 4;
	CHECK_EQ(gossip_msg_put(buf, sizeof buf, &len, &m), DS_EINVAL);
	m.type = 42;
	CHECK_EQ(gossip_msg_put(buf, sizeof buf, &len, &m), DS_EINVAL);
	CHECK_EQ(len, 0);
	/* no room: DS_ERANGE, buffer untouched */
	rand_msg(&m, GOSSIP_MSG_PING, 0);
	len = 10;
	CHECK_EQ(gossip_msg_put(buf, 20, &len, &m), DS_ERANGE);
	CHECK_EQ(len, 10);
	/* an empty plaintext is malformed */
	CHECK_EQ(gossip_msgs_check(buf, 0), DS_EFORMAT);
	/* a push-pull with a flag bit nobody defined is malformed */
	rand_msg(&m, GOSSIP_MSG_PUSH_PULL, 0);
	m.flags = GOSSIP_PP_JOIN | GOSSIP_PP_REFERRED;
	len = 0;
	CHECK_EQ(gossip_msg_put(buf, sizeof buf, &len, &m), DS_OK);
	CHECK_EQ(gossip_msgs_check(buf, len), 1);
	buf[GOSSIP_MSG_HDR] |= 8;
	CHECK_EQ(gossip_msgs_check(buf, len), DS_EFORMAT);
}

TEST(gossip_codec_every_truncation_rejected)
{
	for (int iter = 0; iter < 40; iter++) {
		uint8_t buf[4096];
		size_t len = 0, bounds[8];
		gossip_msg m;
		int n = 1 + (int)rand_below(5);
		for (int i = 0; i < n; i++) {
			rand_msg(&m, 1 + (int)rand_below(9), i);
			CHECK_EQ(gossip_msg_put(buf, sizeof buf, &len, &m), DS_OK);
			bounds[i] = len;
		}
		/* A cut at a message boundary is a shorter valid packet; any other
		 * cut must fail, whatever the cut-off message was. */
		for (size_t cut = 0; cut < len; cut++) {
			int at = -1;
			for (int i = 0; i < n; i++)
				if (bounds[i] == cut)
					at = i;
			int rc = gossip_msgs_check(buf, cut);
			if (at >= 0)
				CHECK_EQ(rc, at + 1);
			else
				CHECK_EQ(rc, DS_EFORMAT);
		}
		/* a length field one byte too long or too short fails as well */
		if (len > 3) {
			uint16_t l0 = (uint16_t)(buf[1] << 8 | buf[2]);
			for (int d = -1; d <= 1; d += 2) {
				uint8_t c[4096];
				memcpy(c, buf, len);
				c[1] = (uint8_t)((l0 + d) >> 8);
				c[2] = (uint8_t)(l0 + d);
				size_t off = 0;
				CHECK_EQ(gossip_msg_next(c, bounds[0], &off, &m), DS_EFORMAT);
			}
		}
	}
}

/* Random bytes: never a crash or a read past the end (ASan), and whatever
 * decodes re-encodes to exactly the same bytes (the codec is canonical). */
TEST(gossip_codec_random_bytes)
{
	int accepted = 0;
	for (int iter = 0; iter < 20000; iter++) {
		uint8_t p[700];
		size_t len = rand_below(sizeof p);
		rand_bytes(p, len);
		if (len >= 3 && rand_below(2)) { /* plausible header half the time */
			p[0] = (uint8_t)rand_below(12);
			size_t body = len - 3 - (rand_below(4) == 0 ? rand_below((uint32_t)len - 2) : 0);
			p[1] = (uint8_t)(body >> 8);
			p[2] = (uint8_t)body;
			if (p[0] == GOSSIP_MSG_ALIVE && len > 38)
				p[3 + 34] = (uint8_t)rand_below(8);
		}
		uint8_t *heap = malloc(len ? len : 1); /* exact size: ASan sees overreads */
		memcpy(heap, p, len);
		int n = gossip_msgs_check(heap, len);
		if (n > 0) {
			accepted++;
			uint8_t re[2048];
			size_t rl = 0, off = 0;
			gossip_msg m;
			while (gossip_msg_next(heap, len, &off, &m) == 1)
				CHECK_EQ(gossip_msg_put(re, sizeof re, &rl, &m), DS_OK);
			CHECK_EQ(rl, len);
			CHECK(memcmp(re, heap, len) == 0);
		}
		free(heap);
	}
	CHECK(accepted > 0); /* the plausible headers did reach the decoders */
}

/* ---- sealing ---------------------------------------------------------------- */

TEST(gossip_seal_open_and_every_failure)
{
	CHECK(sodium_init() >= 0);
	uint8_t key[32], other[32], sender[16], plain[GOSSIP_UDP_PLAIN_MAX];
	rand_bytes(key, 32);
	rand_bytes(other, 32);
	rand_bytes(sender, 16);
	clusterkey_ring ring = ring_of(7, key), wrong = ring_of(7, other), wrong_id = ring_of(8, key);
	for (int iter = 0; iter < 20; iter++) {
		size_t plen = rand_below(sizeof plain + 1);
		rand_bytes(plain, plen);
		uint64_t epoch = ut_rand_u64(), seq = ut_rand_u64();
		uint8_t pkt[GOSSIP_UDP_MAX], out[GOSSIP_UDP_MAX];
		size_t n = 0, olen = 0;
		CHECK_EQ(gossip_seal(&ring, sender, epoch, seq, plain, plen, pkt, sizeof pkt, &n),
			 DS_OK);
		CHECK_EQ(n, plen + GOSSIP_OVERHEAD);
		gossip_hdr h;
		CHECK_EQ(gossip_open(&ring, pkt, n, GOSSIP_UDP_MAX, &h, out, &olen), GOSSIP_DROP_NONE);
		CHECK_EQ(olen, plen);
		CHECK(memcmp(out, plain, plen) == 0);
		CHECK(memcmp(h.sender, sender, 16) == 0);
		CHECK(h.epoch == epoch && h.seq == seq && h.key_id == 7);
		CHECK_EQ(gossip_open(&wrong, pkt, n, GOSSIP_UDP_MAX, &h, out, &olen),
			 GOSSIP_DROP_AUTH_FAIL);
		CHECK_EQ(gossip_open(&wrong_id, pkt, n, GOSSIP_UDP_MAX, &h, out, &olen),
			 GOSSIP_DROP_BAD_KEY);
		CHECK_EQ(gossip_open(&ring, pkt, n, n - 1, &h, out, &olen), GOSSIP_DROP_TOO_LARGE);
		/* every truncation */
		for (size_t cut = 0; cut < n; cut++)
			CHECK_EQ(gossip_open(&ring, pkt, cut, GOSSIP_UDP_MAX, &h, out, &olen),
				 cut < GOSSIP_OVERHEAD ? GOSSIP_DROP_MALFORMED : GOSSIP_DROP_AUTH_FAIL);
		/* one flipped bit anywhere: the header is associated data, so the
		 * epoch, sender and seq are authenticated too */
		for (size_t i = 0; i < n; i++) {
			uint8_t c[GOSSIP_UDP_MAX];
			memcpy(c, pkt, n);
			c[i] ^= (uint8_t)(1u << rand_below(8));
			int want = i == 0 ? GOSSIP_DROP_MALFORMED
				   : i == 1 ? GOSSIP_DROP_BAD_KEY
					    : GOSSIP_DROP_AUTH_FAIL;
			CHECK_EQ(gossip_open(&ring, c, n, GOSSIP_UDP_MAX, &h, out, &olen), want);
		}
	}
	/* a two-key ring opens packets of either key (rotation) */
	clusterkey_ring two = ring_of(7, key);
	two.n = 2;
	two.id[1] = 9;
	memcpy(two.key[1], other, 32);
	clusterkey_ring nine = ring_of(9, other);
	uint8_t pkt[256], out[256];
	size_t n = 0, olen = 0;
	gossip_hdr h;
	CHECK_EQ(gossip_seal(&nine, sender, 1, 2, plain, 10, pkt, sizeof pkt, &n), DS_OK);
	CHECK_EQ(gossip_open(&two, pkt, n, GOSSIP_UDP_MAX, &h, out, &olen), GOSSIP_DROP_NONE);
	CHECK_EQ(gossip_seal(&nine, sender, 1, 2, plain, 250, pkt, sizeof pkt, &n), DS_ERANGE);
}

/* ---- replay window ---------------------------------------------------------- */

TEST(gossip_replay_window)
{
	gossip_replay r;
	const uint64_t skew = 30000000; /* 30 s */
	CHECK_EQ(gossip_replay_init(&r, 4, skew), DS_OK);
	uint8_t a[16], b[16];
	rand_bytes(a, 16);
	rand_bytes(b, 16);
	uint64_t now = 1700000000000000ull + rand_below(1000000);
	/* increasing seqs accepted; each exactly once */
	uint64_t seqs[200];
	for (int i = 0; i < 200; i++) {
		seqs[i] = now - 1000000 + (uint64_t)i * 37 + rand_below(30);
		CHECK_EQ(gossip_replay_check(&r, a, seqs[i], now), GOSSIP_DROP_NONE);
	}
	for (int i = 200 - GOSSIP_REPLAY_WIN; i < 200; i++)
		CHECK_EQ(gossip_replay_check(&r, a, seqs[i], now), GOSSIP_DROP_REPLAY);
	/* below the window: cannot be told from a replay, refused */
	CHECK_EQ(gossip_replay_check(&r, a, seqs[10], now), GOSSIP_DROP_REPLAY);
	CHECK_EQ(gossip_replay_check(&r, a, seqs[199 - GOSSIP_REPLAY_WIN] + 1, now),
		 GOSSIP_DROP_REPLAY);
	/* reordered inside the window: accepted once */
	uint64_t gap = seqs[199] - 5;
	if (gap != seqs[198]) {
		CHECK_EQ(gossip_replay_check(&r, a, gap, now), GOSSIP_DROP_NONE);
		CHECK_EQ(gossip_replay_check(&r, a, gap, now), GOSSIP_DROP_REPLAY);
	}
	/* another sender has its own window */
	CHECK_EQ(gossip_replay_check(&r, b, seqs[0], now), GOSSIP_DROP_NONE);
	/* send time too far from our clock, either way */
	CHECK_EQ(gossip_replay_check(&r, b, now - skew - 1, now), GOSSIP_DROP_STALE);
	CHECK_EQ(gossip_replay_check(&r, b, now + skew + 1, now), GOSSIP_DROP_STALE);
	CHECK_EQ(gossip_replay_check(&r, b, now + skew, now), GOSSIP_DROP_NONE);
	/* a full table evicts the least recently heard sender */
	uint8_t c[4][16];
	for (int i = 0; i < 4; i++) {
		rand_bytes(c[i], 16);
		CHECK_EQ(gossip_replay_check(&r, c[i], now + 1 + (uint64_t)i, now + 10 + (uint64_t)i),
			 GOSSIP_DROP_NONE);
	}
	CHECK_EQ(r.n, 4);
	/* silence for 2 * skew forgets a sender; its old packets are stale anyway */
	uint64_t later = now + 2 * skew + 100;
	CHECK_EQ(gossip_replay_check(&r, a, later, later), GOSSIP_DROP_NONE);
	CHECK_EQ(r.n, 1);
	CHECK_EQ(gossip_replay_check(&r, a, seqs[199], later), GOSSIP_DROP_STALE);
	gossip_replay_free(&r);
}

/* ---- suspicion math --------------------------------------------------------- */

TEST(gossip_suspicion_timeout_math)
{
	gossip_timing lan;
	CHECK_EQ(gossip_timing_profile("lan", &lan, NULL), DS_OK);
	int64_t mn, mx;
	int k;
	/* docs: LAN defaults, 4..10 nodes: min 4 s, max 24 s, k = 2 */
	for (int n = 4; n <= 10; n++) {
		gossip_suspicion_bounds(&lan, n, &mn, &mx, &k);
		CHECK_EQ(mn, 4000);
		CHECK_EQ(mx, 24000);
		CHECK_EQ(k, 2);
	}
	CHECK_EQ(gossip_suspicion_timeout(4000, 24000, 2, 0), 24000);
	/* 24 - 20 * ln 2 / ln 3 = 11.381 s ("about 11.4 s after one confirmation") */
	CHECK_NEAR(gossip_suspicion_timeout(4000, 24000, 2, 1), 24000 - 20000 * log(2) / log(3), 1);
	CHECK_EQ(gossip_suspicion_timeout(4000, 24000, 2, 2), 4000);
	CHECK_EQ(gossip_suspicion_timeout(4000, 24000, 2, 5), 4000);
	/* 2-3 nodes: no confirmations wanted, the timer is min */
	gossip_suspicion_bounds(&lan, 3, &mn, &mx, &k);
	CHECK_EQ(k, 0);
	CHECK_EQ(gossip_suspicion_timeout(mn, mx, k, 0), 4000);
	/* log10 scaling above 10 nodes */
	gossip_suspicion_bounds(&lan, 100, &mn, &mx, &k);
	CHECK_EQ(mn, 8000);
	CHECK_EQ(mx, 48000);
	gossip_suspicion_bounds(&lan, 50, &mn, &mx, &k);
	CHECK_EQ(mn, (int64_t)llround(4 * log10(50.0) * 1000));
	/* monotone in confirmations, random bounds */
	for (int i = 0; i < 200; i++) {
		int64_t lo = 1 + rand_below(10000), hi = lo * (1 + rand_below(8));
		int kk = 1 + (int)rand_below(6);
		int64_t prev = hi + 1;
		for (int c = 0; c <= kk; c++) {
			int64_t t = gossip_suspicion_timeout(lo, hi, kk, c);
			CHECK(t <= prev && t >= lo && t <= hi);
			prev = t;
		}
		CHECK_EQ(prev, lo);
	}
	/* retransmits: mult * ceil(log10(n + 1)) */
	CHECK_EQ(gossip_retransmit_limit(4, 1), 4);
	CHECK_EQ(gossip_retransmit_limit(4, 9), 4);
	CHECK_EQ(gossip_retransmit_limit(4, 10), 8);
	CHECK_EQ(gossip_retransmit_limit(4, 50), 8);
	CHECK_EQ(gossip_retransmit_limit(4, 100), 12);
}

/* ---- membership table ------------------------------------------------------- */

typedef struct tabfx {
	gossip_tab tab;
	gossip_timing t;
	uint8_t self[16];
} tabfx;

static void tab_open(tabfx *f)
{
	gossip_member me;
	memset(&me, 0, sizeof me);
	rand_bytes(f->self, 16);
	memcpy(me.id, f->self, 16);
	snprintf(me.name, sizeof me.name, "self");
	snprintf(me.addr, sizeof me.addr, "10.0.0.1");
	me.port = 7946;
	me.boot = 1234;
	gossip_timing_profile("lan", &f->t, NULL);
	CHECK_EQ(gossip_tab_init(&f->tab, &f->t, &me, 1.7e9), DS_OK);
}

static gossip_msg alive_msg(const uint8_t id[16], uint32_t inc, const char *name, uint64_t boot)
{
	gossip_msg m;
	memset(&m, 0, sizeof m);
	m.type = GOSSIP_MSG_ALIVE;
	memcpy(m.id, id, 16);
	m.incarnation = inc;
	m.ip = htonl(0x0a000000u | (uint32_t)rand_below(250));
	m.port = 7946;
	m.boot = boot;
	snprintf(m.name, sizeof m.name, "%s", name);
	return m;
}

static gossip_msg accuse_msg(int type, const uint8_t id[16], uint32_t inc, const uint8_t from[16])
{
	gossip_msg m;
	memset(&m, 0, sizeof m);
	m.type = type;
	memcpy(m.id, id, 16);
	m.incarnation = inc;
	memcpy(m.from, from, 16);
	return m;
}

/* Kinds of the queued events, in order, then clears them. */
static size_t events(tabfx *f, int *kinds, size_t max)
{
	gossip_event *ev = NULL;
	size_t n = gossip_tab_events_take(&f->tab, &ev);
	for (size_t i = 0; i < n && i < max; i++)
		kinds[i] = ev[i].kind;
	free(ev);
	return n;
}

/* The incarnation of the queued broadcast about id (-1: none). */
static long long queued_inc(tabfx *f, const uint8_t id[16], int *type)
{
	for (size_t i = 0; i < f->tab.nb; i++)
		if (!memcmp(f->tab.bq[i].about, id, 16)) {
			gossip_msg m;
			size_t off = 0;
			if (gossip_msg_next(f->tab.bq[i].msg, f->tab.bq[i].len, &off, &m) != 1)
				return -2;
			if (type)
				*type = m.type;
			return m.incarnation;
		}
	return -1;
}

TEST(gossip_rules_alive_suspect_dead)
{
	tabfx f;
	tab_open(&f);
	uint8_t a[16], b[16], c[16];
	rand_bytes(a, 16);
	rand_bytes(b, 16);
	rand_bytes(c, 16);
	int k[8];
	uint32_t inc = 5 + rand_below(1000);
	gossip_msg m = alive_msg(a, inc, "a", 77);
	gossip_tab_alive(&f.tab, &m, 1000);
	CHECK_EQ(f.tab.n, 2);
	CHECK_EQ(events(&f, k, 8), 1);
	CHECK_EQ(k[0], GOSSIP_EV_JOIN);
	int type = 0;
	CHECK_EQ(queued_inc(&f, a, &type), inc);
	CHECK_EQ(type, GOSSIP_MSG_ALIVE);
	/* same or lower incarnation: ignored */
	gossip_msg old = alive_msg(a, inc, "renamed", 77);
	gossip_tab_alive(&f.tab, &old, 1100);
	old = alive_msg(a, inc - 1, "renamed", 77);
	gossip_tab_alive(&f.tab, &old, 1100);
	CHECK_STR(gossip_tab_find(&f.tab, a)->m.name, "a");
	CHECK_EQ(events(&f, k, 8), 0);
	/* suspect with an older incarnation: ignored; current: suspect */
	gossip_msg s = accuse_msg(GOSSIP_MSG_SUSPECT, a, inc - 1, b);
	gossip_tab_suspect(&f.tab, &s, 1200);
	CHECK_EQ(gossip_tab_find(&f.tab, a)->m.state, GOSSIP_ALIVE);
	s.incarnation = inc;
	gossip_tab_suspect(&f.tab, &s, 1200);
	CHECK_EQ(gossip_tab_find(&f.tab, a)->m.state, GOSSIP_SUSPECT);
	CHECK_EQ(events(&f, k, 8), 1);
	CHECK_EQ(k[0], GOSSIP_EV_SUSPECT);
	CHECK_EQ(queued_inc(&f, a, &type), inc);
	CHECK_EQ(type, GOSSIP_MSG_SUSPECT); /* replaced the alive broadcast */
	/* alive at the same incarnation does not clear a suspicion (suspect wins) */
	m = alive_msg(a, inc, "a", 77);
	gossip_tab_alive(&f.tab, &m, 1300);
	CHECK_EQ(gossip_tab_find(&f.tab, a)->m.state, GOSSIP_SUSPECT);
	/* the node refutes: higher incarnation clears it */
	m = alive_msg(a, inc + 1, "a", 77);
	gossip_tab_alive(&f.tab, &m, 1400);
	CHECK_EQ(gossip_tab_find(&f.tab, a)->m.state, GOSSIP_ALIVE);
	CHECK_EQ(gossip_tab_find(&f.tab, a)->m.incarnation, inc + 1);
	CHECK_EQ(events(&f, k, 8), 2); /* alive again + meta (its address moved) */
	CHECK_EQ(k[0], GOSSIP_EV_ALIVE);
	/* dead overrides alive at the same incarnation ... */
	gossip_msg d = accuse_msg(GOSSIP_MSG_DEAD, a, inc + 1, c);
	gossip_tab_dead(&f.tab, &d, 1500);
	CHECK_EQ(gossip_tab_find(&f.tab, a)->m.state, GOSSIP_DEAD);
	CHECK_EQ(events(&f, k, 8), 1);
	CHECK_EQ(k[0], GOSSIP_EV_DEAD);
	/* ... and an alive at that incarnation cannot undo it, a suspect neither */
	m = alive_msg(a, inc + 1, "a", 77);
	gossip_tab_alive(&f.tab, &m, 1600);
	s = accuse_msg(GOSSIP_MSG_SUSPECT, a, inc + 5, b);
	gossip_tab_suspect(&f.tab, &s, 1600);
	CHECK_EQ(gossip_tab_find(&f.tab, a)->m.state, GOSSIP_DEAD);
	CHECK_EQ(gossip_tab_find(&f.tab, a)->m.incarnation, inc + 1);
	/* a restarted process (new boot) with a higher incarnation is back */
	m = alive_msg(a, inc + 2, "a", 78);
	gossip_tab_alive(&f.tab, &m, 1700);
	CHECK_EQ(gossip_tab_find(&f.tab, a)->m.state, GOSSIP_ALIVE);
	size_t ne = events(&f, k, 8);
	CHECK(ne >= 2);
	CHECK_EQ(k[0], GOSSIP_EV_ALIVE);
	CHECK_EQ(k[1], GOSSIP_EV_RESTART);
	/* left: dead with from == id */
	d = accuse_msg(GOSSIP_MSG_DEAD, a, inc + 2, a);
	gossip_tab_dead(&f.tab, &d, 1800);
	CHECK_EQ(gossip_tab_find(&f.tab, a)->m.state, GOSSIP_LEFT);
	CHECK_EQ(events(&f, k, 8), 1);
	CHECK_EQ(k[0], GOSSIP_EV_LEFT);
	/* unknown members: suspect and dead are ignored, nothing is created */
	s = accuse_msg(GOSSIP_MSG_SUSPECT, b, 1, c);
	gossip_tab_suspect(&f.tab, &s, 1900);
	d = accuse_msg(GOSSIP_MSG_DEAD, b, 1, c);
	gossip_tab_dead(&f.tab, &d, 1900);
	CHECK(gossip_tab_find(&f.tab, b) == NULL);
	/* reaped reap_ms after leaving */
	CHECK_EQ(gossip_tab_tick(&f.tab, 1800 + f.t.reap_ms - 1), 1800 + f.t.reap_ms);
	gossip_tab_tick(&f.tab, 1800 + f.t.reap_ms);
	CHECK(gossip_tab_find(&f.tab, a) == NULL);
	CHECK_EQ(events(&f, k, 8), 1);
	CHECK_EQ(k[0], GOSSIP_EV_REAP);
	gossip_tab_free(&f.tab);
}

TEST(gossip_rules_refute_about_self)
{
	tabfx f;
	tab_open(&f);
	uint8_t x[16];
	rand_bytes(x, 16);
	int k[4];
	uint32_t mine = f.tab.nodes[0].m.incarnation;
	/* suspected with a higher incarnation than ours: jump above it */
	uint32_t accused = mine + 10 + rand_below(100);
	gossip_msg s = accuse_msg(GOSSIP_MSG_SUSPECT, f.self, accused, x);
	gossip_tab_suspect(&f.tab, &s, 100);
	CHECK_EQ(f.tab.nodes[0].m.state, GOSSIP_ALIVE);
	CHECK_EQ(f.tab.nodes[0].m.incarnation, accused + 1);
	CHECK_EQ(queued_inc(&f, f.self, NULL), accused + 1);
	CHECK_EQ(f.tab.awareness, 1); /* Lifeguard: refuting costs health */
	/* declared dead (e.g. after a restart): refute again */
	gossip_msg d = accuse_msg(GOSSIP_MSG_DEAD, f.self, accused + 1, x);
	gossip_tab_dead(&f.tab, &d, 200);
	CHECK_EQ(f.tab.nodes[0].m.incarnation, accused + 2);
	CHECK_EQ(f.tab.nodes[0].m.state, GOSSIP_ALIVE);
	/* an older process's alive with our id and a higher incarnation */
	gossip_msg a = alive_msg(f.self, accused + 7, "self", 1);
	gossip_tab_alive(&f.tab, &a, 300);
	CHECK_EQ(f.tab.nodes[0].m.incarnation, accused + 8);
	/* our own alive echoed back: nothing */
	gossip_tab_msg_alive(&f.tab.nodes[0], &a);
	gossip_tab_alive(&f.tab, &a, 400);
	CHECK_EQ(f.tab.nodes[0].m.incarnation, accused + 8);
	/* a stale accusation: nothing */
	s.incarnation = accused;
	gossip_tab_suspect(&f.tab, &s, 500);
	CHECK_EQ(f.tab.nodes[0].m.incarnation, accused + 8);
	CHECK_EQ(events(&f, k, 4), 0); /* no events about ourselves */
	/* leaving: our death is accepted, never refuted */
	gossip_tab_leave(&f.tab, 600);
	d = accuse_msg(GOSSIP_MSG_DEAD, f.self, accused + 8, x);
	gossip_tab_dead(&f.tab, &d, 700);
	CHECK_EQ(f.tab.nodes[0].m.state, GOSSIP_LEFT);
	CHECK_EQ(f.tab.nodes[0].m.incarnation, accused + 8);
	int type = 0;
	CHECK_EQ(queued_inc(&f, f.self, &type), accused + 8);
	CHECK_EQ(type, GOSSIP_MSG_DEAD);
	/* set_meta bumps the incarnation */
	tabfx g;
	tab_open(&g);
	uint8_t meta[40];
	rand_bytes(meta, sizeof meta);
	uint32_t before = g.tab.nodes[0].m.incarnation;
	gossip_tab_set_meta(&g.tab, meta, sizeof meta, 10);
	CHECK_EQ(g.tab.nodes[0].m.incarnation, before + 1);
	CHECK_EQ(g.tab.nodes[0].m.meta_len, sizeof meta);
	gossip_tab_free(&f.tab);
	gossip_tab_free(&g.tab);
}

TEST(gossip_rules_lifeguard_confirmations)
{
	tabfx f;
	tab_open(&f);
	uint8_t ids[8][16];
	for (int i = 0; i < 8; i++) {
		rand_bytes(ids[i], 16);
		char name[8];
		snprintf(name, sizeof name, "n%d", i);
		gossip_msg m = alive_msg(ids[i], 1, name, 1);
		gossip_tab_alive(&f.tab, &m, 0);
	}
	/* 9 live members: min 4 s, max 24 s, k = 2 */
	gossip_msg s = accuse_msg(GOSSIP_MSG_SUSPECT, ids[0], 1, ids[1]);
	gossip_tab_suspect(&f.tab, &s, 1000);
	gossip_node *nd = gossip_tab_find(&f.tab, ids[0]);
	CHECK_EQ(nd->susp_deadline_ms, 1000 + 24000);
	/* the first accuser again is no confirmation */
	gossip_tab_suspect(&f.tab, &s, 1500);
	CHECK_EQ(nd->susp_deadline_ms, 1000 + 24000);
	/* an independent one shrinks it (from the start of the suspicion) */
	s = accuse_msg(GOSSIP_MSG_SUSPECT, ids[0], 1, ids[2]);
	gossip_tab_suspect(&f.tab, &s, 2000);
	CHECK_NEAR(nd->susp_deadline_ms, 1000 + 24000 - 20000 * log(2) / log(3), 1);
	gossip_tab_suspect(&f.tab, &s, 2100); /* same confirmer twice */
	CHECK_NEAR(nd->susp_deadline_ms, 1000 + 24000 - 20000 * log(2) / log(3), 1);
	/* our own failed probe counts too */
	gossip_tab_accuse(&f.tab, ids[0], 2200);
	CHECK_EQ(nd->susp_deadline_ms, 1000 + 4000);
	CHECK_EQ(gossip_tab_tick(&f.tab, 4999), 5000);
	CHECK_EQ(nd->m.state, GOSSIP_SUSPECT);
	gossip_tab_tick(&f.tab, 5000);
	CHECK_EQ(gossip_tab_find(&f.tab, ids[0])->m.state, GOSSIP_DEAD);
	/* a push-pull that says "dead" only makes us suspect */
	gossip_msg st = alive_msg(ids[3], 1, "n3", 1);
	st.type = GOSSIP_MSG_STATE;
	st.state = GOSSIP_DEAD;
	gossip_tab_merge(&f.tab, &st, ids[4], 6000);
	CHECK_EQ(gossip_tab_find(&f.tab, ids[3])->m.state, GOSSIP_SUSPECT);
	st.state = GOSSIP_LEFT;
	gossip_tab_merge(&f.tab, &st, ids[4], 6000);
	CHECK_EQ(gossip_tab_find(&f.tab, ids[3])->m.state, GOSSIP_LEFT);
	/* awareness saturates at max - 1 and never goes below 0 */
	for (int i = 0; i < 50; i++)
		gossip_tab_awareness(&f.tab, 1);
	CHECK_EQ(f.tab.awareness, f.t.awareness_max - 1);
	for (int i = 0; i < 50; i++)
		gossip_tab_awareness(&f.tab, -1);
	CHECK_EQ(f.tab.awareness, 0);
	gossip_tab_free(&f.tab);
}

TEST(gossip_broadcast_queue)
{
	tabfx f;
	tab_open(&f);
	uint8_t ids[40][16];
	for (int i = 0; i < 40; i++) {
		rand_bytes(ids[i], 16);
		char name[8];
		snprintf(name, sizeof name, "n%d", i);
		gossip_msg m = alive_msg(ids[i], 1, name, 1);
		gossip_tab_alive(&f.tab, &m, 0);
	}
	CHECK_EQ(f.tab.nb, 40); /* one per member */
	int limit = gossip_retransmit_limit(f.t.retransmit_mult, 41);
	/* every packet fits its cap; every broadcast goes out exactly limit times */
	int sent[40] = {0};
	for (int round = 0; round < 1000 && f.tab.nb; round++) {
		uint8_t buf[GOSSIP_UDP_PLAIN_MAX];
		size_t len = 0;
		int added = gossip_tab_bcast_fill(&f.tab, buf, sizeof buf, &len);
		CHECK(added > 0 && len <= sizeof buf);
		CHECK_EQ(gossip_msgs_check(buf, len), added);
		size_t off = 0;
		gossip_msg m;
		while (gossip_msg_next(buf, len, &off, &m) == 1)
			for (int i = 0; i < 40; i++)
				if (!memcmp(m.id, ids[i], 16))
					sent[i]++;
	}
	CHECK_EQ(f.tab.nb, 0);
	for (int i = 0; i < 40; i++)
		CHECK_EQ(sent[i], limit);
	/* a newer update about the same node replaces the queued one */
	gossip_msg s = accuse_msg(GOSSIP_MSG_SUSPECT, ids[5], 1, ids[6]);
	gossip_tab_suspect(&f.tab, &s, 10);
	gossip_msg d = accuse_msg(GOSSIP_MSG_DEAD, ids[5], 1, ids[6]);
	gossip_tab_dead(&f.tab, &d, 20);
	CHECK_EQ(f.tab.nb, 1);
	int type = 0;
	queued_inc(&f, ids[5], &type);
	CHECK_EQ(type, GOSSIP_MSG_DEAD);
	/* a refutation about ourselves is queued with the new incarnation */
	gossip_msg me = accuse_msg(GOSSIP_MSG_DEAD, f.self, 9, ids[1]);
	gossip_tab_dead(&f.tab, &me, 40);
	CHECK_EQ(queued_inc(&f, f.self, NULL), 10);
	gossip_tab_free(&f.tab);
}

/* ---- metadata, key file, node id ------------------------------------------- */

TEST(gossip_meta_roundtrip)
{
	for (int iter = 0; iter < 100; iter++) {
		gossip_meta m, out;
		memset(&m, 0, sizeof m);
		rand_name(m.version, 0, sizeof m.version - 1);
		m.role = (uint8_t)ut_rand_u64();
		m.health = (uint8_t)ut_rand_u64();
		m.eligible = (uint8_t)rand_below(2);
		m.priority = (int32_t)ut_rand_u64();
		m.epoch = ut_rand_u64();
		if (rand_below(2)) {
			rand_bytes(m.head_id, 16);
			m.head_epoch = ut_rand_u64();
		}
		if (rand_below(2))
			rand_bytes(m.inventory, 32);
		m.control_port = (uint16_t)ut_rand_u64();
		m.api_port = (uint16_t)ut_rand_u64();
		uint8_t buf[GOSSIP_META_MAX + 8];
		size_t len = 0;
		CHECK_EQ(gossip_meta_encode(&m, buf, GOSSIP_META_MAX, &len, NULL), DS_OK);
		/* a record of a newer agent (type 200) is skipped */
		buf[len] = 200;
		buf[len + 1] = 3;
		buf[len + 2] = buf[len + 3] = buf[len + 4] = 0xee;
		CHECK_EQ(gossip_meta_decode(buf, len + 5, &out, NULL), DS_OK);
		CHECK(memcmp(&m, &out, sizeof m) == 0);
		/* truncations inside a record fail */
		CHECK_EQ(gossip_meta_decode(buf, len + 4, &out, NULL), DS_EFORMAT);
		CHECK_EQ(gossip_meta_decode(buf, 1, &out, NULL), DS_EFORMAT);
		CHECK_EQ(gossip_meta_encode(&m, buf, 10, &len, NULL), DS_ERANGE);
	}
	gossip_meta out;
	uint8_t bad9[] = {6, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9}; /* epochs: 1..8 bytes */
	CHECK_EQ(gossip_meta_decode(bad9, sizeof bad9, &out, NULL), DS_EFORMAT);
	uint8_t bad0[] = {8, 0};
	CHECK_EQ(gossip_meta_decode(bad0, sizeof bad0, &out, NULL), DS_EFORMAT);
	uint8_t bad_state[] = {12, 2, 3, 1}; /* role, health, eligible: 3 bytes */
	CHECK_EQ(gossip_meta_decode(bad_state, sizeof bad_state, &out, NULL), DS_EFORMAT);
	/* the one-field records (role 2, health 3, eligible 4, 8-byte epoch 6,
	 * ports 10 and 11) still decode, to the same fields */
	uint8_t old[] = {2, 1, 3, 3, 1, 5, 4, 1, 1, 6, 8, 0, 0, 0, 0, 0, 0, 1, 2,
			 10, 2, 0x1d, 0x41, 11, 2, 0x1f, 0x40};
	CHECK_EQ(gossip_meta_decode(old, sizeof old, &out, NULL), DS_OK);
	CHECK(out.role == 3 && out.health == 5 && out.eligible == 1 && out.epoch == 258 &&
	      out.control_port == 7489 && out.api_port == 8000);
	/* and the encoder's records are smaller: epoch 258 takes 2 bytes */
	gossip_meta m;
	memset(&m, 0, sizeof m);
	m.epoch = 258;
	uint8_t buf[64];
	size_t len = 0;
	CHECK_EQ(gossip_meta_encode(&m, buf, sizeof buf, &len, NULL), DS_OK);
	CHECK_EQ(len, 5 + 4 + 6); /* state, epoch, ports; no priority 0 */
	CHECK_EQ(gossip_meta_decode(buf, len, &out, NULL), DS_OK);
	CHECK(memcmp(&m, &out, sizeof m) == 0);
}

static void write_file(const char *path, const void *data, size_t n, mode_t mode)
{
	unlink(path);
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, mode);
	if (fd >= 0) {
		CHECK_EQ(write(fd, data, n), (long long)n);
		fchmod(fd, mode);
		close(fd);
	}
}

TEST(gossip_key_file)
{
	char *dir = ut_tmpdir_new("gossip");
	if (!dir)
		return;
	char path[600];
	snprintf(path, sizeof path, "%s/cluster.key", dir);
	uint8_t key[32], key2[32];
	rand_bytes(key, 32);
	rand_bytes(key2, 32);
	char b64[64], b642[64], text[512];
	sodium_bin2base64(b64, sizeof b64, key, 32, sodium_base64_VARIANT_ORIGINAL);
	sodium_bin2base64(b642, sizeof b642, key2, 32, sodium_base64_VARIANT_ORIGINAL);
	clusterkey_ring k;
	ds_err e = {0};
	/* missing */
	CHECK_EQ(clusterkey_file_load(path, &k, &e), DS_ENOTFOUND);
	/* one line, comments, a second key for rotation */
	int n = snprintf(text, sizeof text, "# cluster key\n  dsck1:a7:%s  \n\ndsck1:03:%s\n", b64,
			 b642);
	write_file(path, text, (size_t)n, 0600);
	CHECK_EQ(clusterkey_file_load(path, &k, &e), DS_OK);
	CHECK_EQ(k.n, 2);
	CHECK_EQ(k.id[0], 0xa7);
	CHECK_EQ(k.id[1], 0x03);
	CHECK(memcmp(k.key[0], key, 32) == 0 && memcmp(k.key[1], key2, 32) == 0);
	/* group- or world-readable: refused, the message says how to fix it */
	chmod(path, 0644);
	CHECK_EQ(clusterkey_file_load(path, &k, &e), DS_EPERM);
	CHECK(strstr(e.msg, "chmod 600") != NULL);
	chmod(path, 0640);
	CHECK_EQ(clusterkey_file_load(path, &k, &e), DS_EPERM);
	/* raw 32 bytes: key id 0 */
	write_file(path, key, 32, 0600);
	CHECK_EQ(clusterkey_file_load(path, &k, &e), DS_OK);
	CHECK_EQ(k.n, 1);
	CHECK_EQ(k.id[0], 0);
	/* not a key */
	const char *bad[] = {
		"",		  "dsck1:a7\n", "dsck2:a7:AAAA\n", "dsck1:g7:AAAA\n", "hello world\n",
		"dsck1:a7:not base64!\n",
	};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		write_file(path, bad[i], strlen(bad[i]), 0600);
		CHECK_EQ(clusterkey_file_load(path, &k, &e), DS_EFORMAT);
	}
	/* 31 raw bytes, a 16-byte key, a duplicate id */
	write_file(path, key, 31, 0600);
	CHECK_EQ(clusterkey_file_load(path, &k, &e), DS_EFORMAT);
	char short_b64[64];
	sodium_bin2base64(short_b64, sizeof short_b64, key, 16, sodium_base64_VARIANT_ORIGINAL);
	n = snprintf(text, sizeof text, "dsck1:01:%s\n", short_b64);
	write_file(path, text, (size_t)n, 0600);
	CHECK_EQ(clusterkey_file_load(path, &k, &e), DS_EFORMAT);
	n = snprintf(text, sizeof text, "dsck1:01:%s\ndsck1:01:%s\n", b64, b642);
	write_file(path, text, (size_t)n, 0600);
	CHECK_EQ(clusterkey_file_load(path, &k, &e), DS_EFORMAT);
	CHECK(strstr(e.msg, "twice") != NULL);
	/* the message never shows key material */
	CHECK(strstr(e.msg, b64) == NULL);
	ut_tmpdir_free(dir);
}

TEST(gossip_node_id_file)
{
	char *dir = ut_tmpdir_new("gossip");
	if (!dir)
		return;
	uint8_t id[16], again[16];
	int created = 0;
	ds_err e = {0};
	CHECK_EQ(gossip_node_id_load(dir, id, &created, &e), DS_OK);
	CHECK_EQ(created, 1);
	CHECK_EQ(gossip_node_id_load(dir, again, &created, &e), DS_OK);
	CHECK_EQ(created, 0);
	CHECK(memcmp(id, again, 16) == 0);
	char path[600];
	snprintf(path, sizeof path, "%s/node.id", dir);
	struct stat st;
	CHECK_EQ(stat(path, &st), 0);
	CHECK_EQ(st.st_mode & 0777, 0600);
	write_file(path, "xyz\n", 4, 0600);
	CHECK_EQ(gossip_node_id_load(dir, id, NULL, &e), DS_EFORMAT);
	write_file(path, "0123456789abcdef0123456789abcdeg\n", 33, 0600);
	CHECK_EQ(gossip_node_id_load(dir, id, NULL, &e), DS_EFORMAT);
	ut_tmpdir_free(dir);
}

/* ---- three instances on loopback -------------------------------------------- */

typedef struct evlog {
	int joins, lefts;
} evlog;

static void on_ev(void *ud, const gossip_event *ev)
{
	evlog *l = ud; /* written on the gossip thread, read by the test */
	if (ev->kind == GOSSIP_EV_JOIN)
		__atomic_add_fetch(&l->joins, 1, __ATOMIC_SEQ_CST);
	else if (ev->kind == GOSSIP_EV_LEFT)
		__atomic_add_fetch(&l->lefts, 1, __ATOMIC_SEQ_CST);
}

static void sleep_ms(int ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

static int count_alive(gossip *g)
{
	gossip_member ms[8];
	size_t n = gossip_members(g, ms, 8);
	int c = 0;
	for (size_t i = 0; i < n && i < 8; i++)
		c += ms[i].state == GOSSIP_ALIVE;
	return c;
}

static void send_udp(int fd, int port, const void *p, size_t n)
{
	struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
	to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	sendto(fd, p, n, 0, (struct sockaddr *)&to, sizeof to);
}

static uint64_t now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static uint64_t drops(const gossip_stats *s)
{
	return s->drop_malformed + s->drop_too_large + s->drop_bad_key + s->drop_auth_fail +
	       s->drop_replay + s->drop_stale + s->drop_wrong_target + s->drop_own_id +
	       s->drop_unknown_sender + s->drop_test;
}

TEST(gossip_three_instances_loopback)
{
	CHECK(sodium_init() >= 0);
	uint8_t key[32];
	rand_bytes(key, 32);
	clusterkey_ring ring = ring_of(0x42, key);
	gossip *g[3] = {NULL, NULL, NULL};
	evlog logs[3];
	memset(logs, 0, sizeof logs);
	char seed[64] = "";
	ds_err e = {0};
	for (int i = 0; i < 3; i++) {
		gossip_params p = gossip_default_params();
		CHECK_EQ(gossip_timing_profile("test", &p.timing, NULL), DS_OK);
		p.bind_addr = "127.0.0.1";
		p.port = 0;
		rand_bytes(p.node_id, 16);
		char name[16];
		snprintf(name, sizeof name, "u%d", i);
		p.node_name = name;
		p.keys = &ring;
		p.seeds = i ? seed : NULL;
		p.on_event = on_ev;
		p.ud = &logs[i];
		g[i] = gossip_new(&p, &e);
		CHECK(g[i] != NULL);
		if (!g[i])
			goto out;
		if (i == 0)
			snprintf(seed, sizeof seed, "127.0.0.1:%d", gossip_port(g[0]));
	}
	for (int t = 0; t < 300; t++) { /* up to 15 s: the events follow the table */
		int done = 1;
		for (int i = 0; i < 3; i++)
			done &= count_alive(g[i]) == 3 &&
				__atomic_load_n(&logs[i].joins, __ATOMIC_SEQ_CST) >= 2;
		if (done)
			break;
		sleep_ms(50);
	}
	for (int i = 0; i < 3; i++) {
		CHECK_EQ(count_alive(g[i]), 3);
		CHECK(gossip_joined(g[i]));
		CHECK_EQ(__atomic_load_n(&logs[i].joins, __ATOMIC_SEQ_CST), 2);
	}
	/* bad packets at g[0]: each lands in exactly one drop counter */
	gossip_stats before, after;
	gossip_stats_get(g[0], &before);
	int fd = socket(AF_INET, SOCK_DGRAM, 0);
	int port = gossip_port(g[0]);
	uint8_t junk[1500], pkt[GOSSIP_UDP_MAX];
	size_t n = 0;
	rand_bytes(junk, sizeof junk);
	junk[0] = 2; /* wrong version */
	send_udp(fd, port, junk, 200);
	send_udp(fd, port, junk, 10);   /* short */
	send_udp(fd, port, junk, 1401); /* too large */
	junk[0] = GOSSIP_WIRE_VERSION;
	junk[1] = 0x41; /* unknown key id */
	send_udp(fd, port, junk, 300);
	junk[1] = 0x42; /* our key id, garbage: fails to open */
	send_udp(fd, port, junk, 300);
	uint8_t fake[16];
	rand_bytes(fake, 16);
	gossip_member self;
	gossip_members(g[0], &self, 1);
	gossip_msg ping = {.type = GOSSIP_MSG_PING, .seq = 99};
	memcpy(ping.id, self.id, 16);
	uint8_t plain[64];
	size_t plen = 0;
	gossip_msg_put(plain, sizeof plain, &plen, &ping);
	gossip_seal(&ring, fake, 0, now_us(), plain, plen, pkt, sizeof pkt, &n);
	send_udp(fd, port, pkt, n); /* valid: answered */
	send_udp(fd, port, pkt, n); /* replayed */
	send_udp(fd, port, pkt, n - 1); /* truncated */
	gossip_seal(&ring, fake, 0, now_us() - 3600000000ull, plain, plen, pkt, sizeof pkt, &n);
	send_udp(fd, port, pkt, n); /* an hour old */
	rand_bytes(ping.id, 16);
	plen = 0;
	gossip_msg_put(plain, sizeof plain, &plen, &ping);
	gossip_seal(&ring, fake, 0, now_us(), plain, plen, pkt, sizeof pkt, &n);
	send_udp(fd, port, pkt, n); /* ping for someone else */
	plain[0] = 0; /* unknown message type */
	gossip_seal(&ring, fake, 0, now_us(), plain, plen, pkt, sizeof pkt, &n);
	send_udp(fd, port, pkt, n);
	gossip_seal(&ring, self.id, 0, now_us(), plain, plen, pkt, sizeof pkt, &n);
	send_udp(fd, port, pkt, n); /* our own id */
	close(fd);
	for (int t = 0; t < 400; t++) {
		gossip_stats_get(g[0], &after);
		if (drops(&after) - drops(&before) >= 11)
			break;
		sleep_ms(25);
	}
	CHECK_EQ(after.drop_malformed - before.drop_malformed, 3);
	CHECK_EQ(after.drop_too_large - before.drop_too_large, 1);
	CHECK_EQ(after.drop_bad_key - before.drop_bad_key, 1);
	CHECK_EQ(after.drop_auth_fail - before.drop_auth_fail, 2);
	CHECK_EQ(after.drop_replay - before.drop_replay, 1);
	CHECK_EQ(after.drop_stale - before.drop_stale, 1);
	CHECK_EQ(after.drop_wrong_target - before.drop_wrong_target, 1);
	CHECK_EQ(after.drop_own_id - before.drop_own_id, 1);
	CHECK_EQ(count_alive(g[0]), 3); /* the fake sender is no member */
	/* g[2] leaves: the others mark it left */
	gossip_leave(g[2], 0);
	/* the member table changes before the event callback runs: wait for
	 * both, generously (a loaded machine) */
	for (int t = 0; t < 400 && (count_alive(g[0]) != 2 ||
				    __atomic_load_n(&logs[0].lefts, __ATOMIC_SEQ_CST) < 1);
	     t++)
		sleep_ms(25);
	gossip_member ms[4];
	size_t nm = gossip_members(g[0], ms, 4);
	int left = 0;
	for (size_t i = 0; i < nm; i++)
		left += ms[i].state == GOSSIP_LEFT;
	CHECK_EQ(left, 1);
	CHECK_EQ(__atomic_load_n(&logs[0].lefts, __ATOMIC_SEQ_CST), 1);
	json_t *js = gossip_status_json(g[0]);
	CHECK(js && json_array_size(json_object_get(js, "members")) == 3);
	CHECK(json_is_true(json_object_get(json_object_get(js, "self"), "self")));
	CHECK(json_integer_value(json_object_get(json_object_get(js, "stats"), "drop_replay")) ==
	      (json_int_t)after.drop_replay);
	json_decref(js);
out:
	for (int i = 0; i < 3; i++)
		gossip_free(g[i]);
}

/* ---- TCP before authentication ------------------------------------------- */

/* What a frame's first bytes tell before the rest arrives: the same verdict
 * gossip_open gives the whole packet for a size, version or key id problem,
 * and nothing against a header that may still open. */
TEST(gossip_frame_head_check)
{
	CHECK(sodium_init() >= 0);
	uint8_t key[32], sender[16], plain[40], pkt[200];
	rand_bytes(key, 32);
	rand_bytes(sender, 16);
	rand_bytes(plain, sizeof plain);
	clusterkey_ring ring = ring_of(9, key);
	size_t n = 0;
	CHECK_EQ(gossip_seal(&ring, sender, 1, 2, plain, sizeof plain, pkt, sizeof pkt, &n), DS_OK);
	for (size_t have = 0; have <= GOSSIP_HDR_LEN; have++)
		CHECK_EQ(gossip_head_check(&ring, n, GOSSIP_FRAME_MAX, pkt, have), GOSSIP_DROP_NONE);
	CHECK_EQ(gossip_head_check(&ring, n, n - 1, NULL, 0), GOSSIP_DROP_TOO_LARGE);
	CHECK_EQ(gossip_head_check(&ring, GOSSIP_OVERHEAD - 1, GOSSIP_FRAME_MAX, NULL, 0),
		 GOSSIP_DROP_MALFORMED);
	uint8_t bad[GOSSIP_HDR_LEN];
	memcpy(bad, pkt, sizeof bad);
	bad[0] = GOSSIP_WIRE_VERSION + 1;
	CHECK_EQ(gossip_head_check(&ring, n, GOSSIP_FRAME_MAX, bad, 1), GOSSIP_DROP_MALFORMED);
	bad[0] = GOSSIP_WIRE_VERSION;
	bad[1] = 10;
	CHECK_EQ(gossip_head_check(&ring, n, GOSSIP_FRAME_MAX, bad, 1), GOSSIP_DROP_NONE);
	CHECK_EQ(gossip_head_check(&ring, n, GOSSIP_FRAME_MAX, bad, 2), GOSSIP_DROP_BAD_KEY);
	/* the limit before authentication: a table like ours fits, twice as
	 * many members plus the slack fit, 1 MiB is the most ever */
	size_t lone = gossip_frame_preauth_max(1);
	CHECK(lone >= GOSSIP_OVERHEAD + GOSSIP_MSG_HDR + 3 + (2 + GOSSIP_PREAUTH_SLACK) * GOSSIP_MSG_MAX);
	CHECK(lone < 64 * 1024);
	CHECK(gossip_frame_preauth_max(100) > lone);
	CHECK(gossip_frame_preauth_max(100) >= 200 * GOSSIP_MSG_MAX);
	CHECK_EQ(gossip_frame_preauth_max(GOSSIP_MAX_MEMBERS), GOSSIP_FRAME_MAX);
	CHECK_EQ(gossip_frame_preauth_max((size_t)-1), GOSSIP_FRAME_MAX);
}

/* Heap bytes this process has allocated and not freed: glibc's count over
 * every arena and mmap'd block, or the sanitizer allocator's under ASan. */
static size_t heap_in_use(void)
{
#if defined(UT_ASAN)
	return __sanitizer_get_current_allocated_bytes();
#else
	struct mallinfo2 mi = mallinfo2();
	return mi.uordblks + mi.hblkhd;
#endif
}

/* A blocking TCP client of 127.0.0.1:port that sent n bytes of p. */
static int tcp_send_to(int port, const void *p, size_t n)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
	to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (fd < 0 || connect(fd, (struct sockaddr *)&to, sizeof to) != 0 ||
	    send(fd, p, n, MSG_NOSIGNAL) != (ssize_t)n) {
		if (fd >= 0)
			close(fd);
		return -1;
	}
	return fd;
}

/* 1 when the other side closed fd (EOF or reset) within ms, 0 if not. */
static int closed_within(int fd, int ms)
{
	struct pollfd p = {.fd = fd, .events = POLLIN};
	if (poll(&p, 1, ms) != 1)
		return 0;
	char b[16];
	ssize_t r = recv(fd, b, sizeof b, MSG_DONTWAIT);
	return r == 0 || (r < 0 && errno != EAGAIN);
}

static int64_t mono_ms_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Clients without the key declare frames of up to 1 MiB (GOSSIP_FRAME_MAX,
 * the most any frame may be) and send a few bytes of it.  A lone node with
 * the lan profile would hold an exchange for 10 s; here each client is
 * closed at once and counted by reason, and the node allocates nothing for
 * their frames: a length past what an unauthenticated first frame may be
 * (a few dozen KiB for a node that knows one member) is refused on its
 * four bytes, a plausible one is read into a small buffer until the
 * header's version and key id are known. */
TEST(gossip_tcp_unauthenticated_frame_not_allocated)
{
	CHECK(sodium_init() >= 0);
	uint8_t key[32];
	rand_bytes(key, 32);
	clusterkey_ring ring = ring_of(0x42, key);
	gossip_params p = gossip_default_params();
	p.bind_addr = "127.0.0.1";
	p.port = 0;
	rand_bytes(p.node_id, 16);
	p.node_name = "solo";
	p.keys = &ring;
	ds_err e = {0};
	gossip *g = gossip_new(&p, &e);
	CHECK(g != NULL);
	if (!g)
		return;
	int port = gossip_port(g);
	enum { BIG = 8, BADVER = 4, BADKEY = 4, N = BIG + BADVER + BADKEY };
	int fds[N];
	gossip_stats s0, s1;
	gossip_stats_get(g, &s0);
	size_t heap0 = heap_in_use();
	for (int i = 0; i < N; i++) {
		uint8_t h[4 + 8];
		uint32_t len = i < BIG ? GOSSIP_FRAME_MAX : 30000; /* 30000: plausible */
		h[0] = (uint8_t)(len >> 24);
		h[1] = (uint8_t)(len >> 16);
		h[2] = (uint8_t)(len >> 8);
		h[3] = (uint8_t)len;
		rand_bytes(h + 4, 8);
		h[4] = i < BIG + BADVER && i >= BIG ? 2 : GOSSIP_WIRE_VERSION;
		h[5] = i >= BIG + BADVER ? 0x41 : 0x42;
		fds[i] = tcp_send_to(port, h, sizeof h);
		CHECK(fds[i] >= 0);
	}
	for (int t = 0; t < 200; t++) {
		gossip_stats_get(g, &s1);
		if (s1.tcp_accepted - s0.tcp_accepted >= N)
			break;
		sleep_ms(25);
	}
	CHECK_EQ(s1.tcp_accepted - s0.tcp_accepted, N);
	sleep_ms(300); /* the node has read what each client sent */
	size_t heap1 = heap_in_use();
	CHECK(heap1 < heap0 + 64 * 1024);
	if (heap1 >= heap0 + 64 * 1024)
		fprintf(stderr, "  heap grew by %zu bytes for %d unauthenticated frames\n",
			heap1 - heap0, N);
	int64_t t0 = mono_ms_now();
	int closed = 0;
	for (int i = 0; i < N; i++) {
		int left = (int)(t0 + 3000 - mono_ms_now());
		closed += fds[i] >= 0 && closed_within(fds[i], left > 0 ? left : 0);
	}
	CHECK_EQ(closed, N); /* within 3 s, not the 10 s of an exchange */
	gossip_stats_get(g, &s1);
	CHECK_EQ(s1.drop_too_large - s0.drop_too_large, BIG);
	CHECK_EQ(s1.drop_malformed - s0.drop_malformed, BADVER);
	CHECK_EQ(s1.drop_bad_key - s0.drop_bad_key, BADKEY);
	for (int i = 0; i < N; i++)
		if (fds[i] >= 0)
			close(fds[i]);
	gossip_free(g);
}

/* A client that sends a plausible length and a header with the right
 * version and key id, then nothing: it could be a member, so its frame gets
 * a buffer, but it must be whole within the first-frame deadline (2 s in
 * the lan profile), not the 10 s of an exchange. */
TEST(gossip_tcp_first_frame_deadline)
{
	CHECK(sodium_init() >= 0);
	uint8_t key[32];
	rand_bytes(key, 32);
	clusterkey_ring ring = ring_of(0x42, key);
	gossip_params p = gossip_default_params();
	p.bind_addr = "127.0.0.1";
	p.port = 0;
	rand_bytes(p.node_id, 16);
	p.node_name = "solo";
	p.keys = &ring;
	ds_err e = {0};
	gossip *g = gossip_new(&p, &e);
	CHECK(g != NULL);
	if (!g)
		return;
	gossip_stats s0, s1;
	gossip_stats_get(g, &s0);
	uint8_t h[4 + GOSSIP_HDR_LEN];
	rand_bytes(h, sizeof h);
	h[0] = h[1] = 0;
	h[2] = 1; /* 256 + ... bytes: plausible */
	h[4] = GOSSIP_WIRE_VERSION;
	h[5] = 0x42;
	int64_t t0 = mono_ms_now();
	int fd = tcp_send_to(gossip_port(g), h, sizeof h);
	CHECK(fd >= 0);
	int closed = fd >= 0 && closed_within(fd, 6000);
	int64_t took = mono_ms_now() - t0;
	CHECK(closed);
	CHECK(took >= 1500); /* not before its deadline */
	gossip_stats_get(g, &s1);
	CHECK_EQ(s1.tcp_first_timeouts - s0.tcp_first_timeouts, 1);
	if (fd >= 0)
		close(fd);
	gossip_free(g);
}
