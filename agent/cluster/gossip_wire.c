/*
 * gossip_wire.c - what gossip puts on the wire and on disk: the message
 * codec, packet sealing (XChaCha20-Poly1305), the replay window, the
 * suspicion-timeout math, timing profiles, metadata TLVs and the node id
 * file (formats in gossip_impl.h and docs/cluster.md; the cluster key file
 * is common/clusterkey.c and agent/auth/clusterkey_file.c).
 *
 * Callers: agent/cluster/gossip.c and gossip_state.c, agent/main.c and
 * agent/cluster/cluster.c (node id file), tests/unit/test_gossip.c.  Calls:
 * libsodium (sealing, random ids), common/fileutil (the node id file),
 * common/hex.
 *
 * Invariants:
 *  1. Every decoder reads only inside [p, p + len) and checks each length
 *     before using it; any byte string either decodes or is rejected, nothing
 *     from the network is asserted.
 *  2. gossip_msg_put only writes what gossip_msg_next accepts, so a message
 *     we send always decodes (the round-trip unit test holds both to it).
 *  3. A packet is "accepted" only after it opened with a key of the ring and
 *     its (sender, seq) passed the replay window.
 *
 * Threading: pure functions; a gossip_replay belongs to one caller (the
 * gossip thread).
 */
#include "agent/cluster/gossip_impl.h"
#include "common/fileutil.h"
#include "common/hex.h"
#include "common/strutil.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- big-endian helpers ---- */

static void put16(uint8_t *p, uint16_t v)
{
	p[0] = (uint8_t)(v >> 8);
	p[1] = (uint8_t)v;
}

static void put32(uint8_t *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (uint8_t)(v >> (24 - 8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (uint8_t)(v >> (56 - 8 * i));
}

static uint16_t get16(const uint8_t *p)
{
	return (uint16_t)((p[0] << 8) | p[1]);
}

static uint32_t get32(const uint8_t *p)
{
	return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static uint64_t get64(const uint8_t *p)
{
	uint64_t v = 0;
	for (int i = 0; i < 8; i++)
		v = (v << 8) | p[i];
	return v;
}

/* ---- sealing ---- */

static void hdr_write(uint8_t *out, uint8_t key_id, const uint8_t nonce[24],
		      const uint8_t sender[GOSSIP_ID_LEN], uint64_t epoch, uint64_t seq)
{
	out[0] = GOSSIP_WIRE_VERSION;
	out[1] = key_id;
	memcpy(out + 2, nonce, 24);
	memcpy(out + 26, sender, GOSSIP_ID_LEN);
	put64(out + 42, epoch);
	put64(out + 50, seq);
}

int gossip_seal(const clusterkey_ring *keys, const uint8_t sender[GOSSIP_ID_LEN], uint64_t epoch,
		uint64_t seq, const uint8_t *plain, size_t plen, uint8_t *out, size_t cap,
		size_t *outlen)
{
	if (keys->n < 1 || cap < GOSSIP_OVERHEAD || plen > cap - GOSSIP_OVERHEAD)
		return DS_ERANGE;
	uint8_t nonce[24];
	randombytes_buf(nonce, sizeof nonce);
	hdr_write(out, keys->id[0], nonce, sender, epoch, seq);
	unsigned long long clen = 0;
	crypto_aead_xchacha20poly1305_ietf_encrypt(out + GOSSIP_HDR_LEN, &clen, plain, plen, out,
						   GOSSIP_HDR_LEN, NULL, nonce, keys->key[0]);
	*outlen = GOSSIP_HDR_LEN + (size_t)clen;
	return DS_OK;
}

int gossip_head_check(const clusterkey_ring *keys, size_t len, size_t max_len,
		      const uint8_t *head, size_t have)
{
	if (len > max_len)
		return GOSSIP_DROP_TOO_LARGE;
	if (len < GOSSIP_OVERHEAD || (have >= 1 && head[0] != GOSSIP_WIRE_VERSION))
		return GOSSIP_DROP_MALFORMED;
	if (have >= 2) {
		for (int i = 0; i < keys->n; i++)
			if (keys->id[i] == head[1])
				return GOSSIP_DROP_NONE;
		return GOSSIP_DROP_BAD_KEY;
	}
	return GOSSIP_DROP_NONE;
}

size_t gossip_frame_preauth_max(size_t members)
{
	if (members > GOSSIP_MAX_MEMBERS)
		members = GOSSIP_MAX_MEMBERS;
	size_t entries = 2 * members + GOSSIP_PREAUTH_SLACK;
	size_t n = GOSSIP_OVERHEAD + GOSSIP_MSG_HDR + 3 + entries * GOSSIP_MSG_MAX;
	return n < GOSSIP_FRAME_MAX ? n : GOSSIP_FRAME_MAX;
}

int gossip_open(const clusterkey_ring *keys, const uint8_t *pkt, size_t len, size_t max_len,
		gossip_hdr *h, uint8_t *plain, size_t *plen)
{
	int why = gossip_head_check(keys, len, max_len, pkt,
				    len < GOSSIP_HDR_LEN ? len : GOSSIP_HDR_LEN);
	if (why)
		return why;
	const uint8_t *key = NULL;
	for (int i = 0; i < keys->n; i++)
		if (keys->id[i] == pkt[1])
			key = keys->key[i];
	if (!key)
		return GOSSIP_DROP_BAD_KEY;
	h->version = pkt[0];
	h->key_id = pkt[1];
	memcpy(h->nonce, pkt + 2, 24);
	memcpy(h->sender, pkt + 26, GOSSIP_ID_LEN);
	h->epoch = get64(pkt + 42);
	h->seq = get64(pkt + 50);
	unsigned long long mlen = 0;
	if (crypto_aead_xchacha20poly1305_ietf_decrypt(plain, &mlen, NULL, pkt + GOSSIP_HDR_LEN,
						       len - GOSSIP_HDR_LEN, pkt, GOSSIP_HDR_LEN,
						       h->nonce, key) != 0)
		return GOSSIP_DROP_AUTH_FAIL;
	*plen = (size_t)mlen;
	return GOSSIP_DROP_NONE;
}

/* ---- messages ---- */

static int name_ok(const char *s, size_t n)
{
	if (n < 1 || n > GOSSIP_NAME_MAX)
		return 0;
	for (size_t i = 0; i < n; i++)
		if ((unsigned char)s[i] <= 0x20 || (unsigned char)s[i] >= 0x7f)
			return 0;
	return 1;
}

/* Fixed body size of a type, or 0 for the variable ones (alive, state). */
static size_t fixed_len(int type)
{
	switch (type) {
	case GOSSIP_MSG_PING: return 4 + GOSSIP_ID_LEN;
	case GOSSIP_MSG_PING_REQ: return 4 + GOSSIP_ID_LEN + 4 + 2 + 1;
	case GOSSIP_MSG_ACK:
	case GOSSIP_MSG_NACK: return 4;
	case GOSSIP_MSG_SUSPECT:
	case GOSSIP_MSG_DEAD: return 2 * GOSSIP_ID_LEN + 4;
	case GOSSIP_MSG_PUSH_PULL: return 3;
	default: return 0;
	}
}

int gossip_msg_put(uint8_t *buf, size_t cap, size_t *len, const gossip_msg *m)
{
	uint8_t tmp[GOSSIP_MSG_MAX];
	uint8_t *b = tmp + GOSSIP_MSG_HDR;
	size_t n = 0;
	switch (m->type) {
	case GOSSIP_MSG_PING:
		put32(b, m->seq);
		memcpy(b + 4, m->id, GOSSIP_ID_LEN);
		n = 20;
		break;
	case GOSSIP_MSG_PING_REQ:
		put32(b, m->seq);
		memcpy(b + 4, m->id, GOSSIP_ID_LEN);
		memcpy(b + 20, &m->ip, 4);
		put16(b + 24, m->port);
		b[26] = m->want_nack ? 1 : 0;
		n = 27;
		if (!m->port)
			return DS_EINVAL;
		break;
	case GOSSIP_MSG_ACK:
	case GOSSIP_MSG_NACK:
		put32(b, m->seq);
		n = 4;
		break;
	case GOSSIP_MSG_SUSPECT:
	case GOSSIP_MSG_DEAD:
		memcpy(b, m->id, GOSSIP_ID_LEN);
		put32(b + 16, m->incarnation);
		memcpy(b + 20, m->from, GOSSIP_ID_LEN);
		n = 36;
		break;
	case GOSSIP_MSG_PUSH_PULL:
		b[0] = m->flags;
		put16(b + 1, m->count);
		n = 3;
		break;
	case GOSSIP_MSG_ALIVE:
	case GOSSIP_MSG_STATE: {
		size_t nl = strlen(m->name);
		if (!name_ok(m->name, nl) || m->meta_len > GOSSIP_META_MAX || !m->port ||
		    (m->type == GOSSIP_MSG_STATE && m->state > GOSSIP_LEFT))
			return DS_EINVAL;
		memcpy(b, m->id, GOSSIP_ID_LEN);
		put32(b + 16, m->incarnation);
		n = 20;
		if (m->type == GOSSIP_MSG_STATE)
			b[n++] = m->state;
		memcpy(b + n, &m->ip, 4);
		put16(b + n + 4, m->port);
		put64(b + n + 6, m->boot);
		n += 14;
		b[n++] = (uint8_t)nl;
		memcpy(b + n, m->name, nl);
		n += nl;
		put16(b + n, (uint16_t)m->meta_len);
		n += 2;
		if (m->meta_len)
			memcpy(b + n, m->meta, m->meta_len);
		n += m->meta_len;
		break;
	}
	default:
		return DS_EINVAL;
	}
	tmp[0] = (uint8_t)m->type;
	put16(tmp + 1, (uint16_t)n);
	if (*len > cap || cap - *len < GOSSIP_MSG_HDR + n)
		return DS_ERANGE;
	memcpy(buf + *len, tmp, GOSSIP_MSG_HDR + n);
	*len += GOSSIP_MSG_HDR + n;
	return DS_OK;
}

/* Decodes the variable part of alive/state bodies. */
static int decode_node(const uint8_t *b, size_t n, int with_state, gossip_msg *m)
{
	size_t need = 20 + (with_state ? 1 : 0) + 14 + 1;
	if (n < need)
		return DS_EFORMAT;
	memcpy(m->id, b, GOSSIP_ID_LEN);
	m->incarnation = get32(b + 16);
	size_t o = 20;
	if (with_state) {
		m->state = b[o++];
		if (m->state > GOSSIP_LEFT)
			return DS_EFORMAT;
	}
	memcpy(&m->ip, b + o, 4);
	m->port = get16(b + o + 4);
	m->boot = get64(b + o + 6);
	o += 14;
	size_t nl = b[o++];
	if (nl > n - o || !name_ok((const char *)b + o, nl) || m->port == 0)
		return DS_EFORMAT;
	memcpy(m->name, b + o, nl);
	m->name[nl] = '\0';
	o += nl;
	if (n - o < 2)
		return DS_EFORMAT;
	size_t ml = get16(b + o);
	o += 2;
	if (ml > GOSSIP_META_MAX || ml != n - o)
		return DS_EFORMAT;
	m->meta = ml ? b + o : NULL;
	m->meta_len = ml;
	return DS_OK;
}

int gossip_msg_next(const uint8_t *p, size_t len, size_t *off, gossip_msg *m)
{
	if (*off >= len)
		return 0;
	if (len - *off < GOSSIP_MSG_HDR)
		return DS_EFORMAT;
	const uint8_t *h = p + *off;
	int type = h[0];
	size_t n = get16(h + 1);
	if (n > len - *off - GOSSIP_MSG_HDR)
		return DS_EFORMAT;
	const uint8_t *b = h + GOSSIP_MSG_HDR;
	memset(m, 0, sizeof *m);
	m->type = type;
	size_t fl = fixed_len(type);
	switch (type) {
	case GOSSIP_MSG_PING:
	case GOSSIP_MSG_PING_REQ:
		if (n != fl)
			return DS_EFORMAT;
		m->seq = get32(b);
		memcpy(m->id, b + 4, GOSSIP_ID_LEN);
		if (type == GOSSIP_MSG_PING_REQ) {
			memcpy(&m->ip, b + 20, 4);
			m->port = get16(b + 24);
			if (b[26] > 1 || m->port == 0)
				return DS_EFORMAT;
			m->want_nack = b[26];
		}
		break;
	case GOSSIP_MSG_ACK:
	case GOSSIP_MSG_NACK:
		if (n != fl)
			return DS_EFORMAT;
		m->seq = get32(b);
		break;
	case GOSSIP_MSG_SUSPECT:
	case GOSSIP_MSG_DEAD:
		if (n != fl)
			return DS_EFORMAT;
		memcpy(m->id, b, GOSSIP_ID_LEN);
		m->incarnation = get32(b + 16);
		memcpy(m->from, b + 20, GOSSIP_ID_LEN);
		break;
	case GOSSIP_MSG_PUSH_PULL:
		if (n != fl || (b[0] & ~(GOSSIP_PP_JOIN | GOSSIP_PP_REFER | GOSSIP_PP_REFERRED)))
			return DS_EFORMAT;
		m->flags = b[0];
		m->count = get16(b + 1);
		break;
	case GOSSIP_MSG_ALIVE:
	case GOSSIP_MSG_STATE:
		if (decode_node(b, n, type == GOSSIP_MSG_STATE, m) != DS_OK)
			return DS_EFORMAT;
		break;
	default:
		return DS_EFORMAT;
	}
	*off += GOSSIP_MSG_HDR + n;
	return 1;
}

int gossip_msgs_check(const uint8_t *p, size_t len)
{
	size_t off = 0;
	int count = 0, rc;
	gossip_msg m;
	while ((rc = gossip_msg_next(p, len, &off, &m)) == 1)
		count++;
	if (rc < 0 || count == 0)
		return DS_EFORMAT;
	return count;
}

/* ---- replay window ---- */

int gossip_replay_init(gossip_replay *r, size_t cap, uint64_t skew_us)
{
	memset(r, 0, sizeof *r);
	r->e = calloc(cap, sizeof *r->e);
	if (!r->e)
		return DS_ENOMEM;
	r->cap = cap;
	r->skew_us = skew_us;
	return DS_OK;
}

void gossip_replay_free(gossip_replay *r)
{
	free(r->e);
	memset(r, 0, sizeof *r);
}

int gossip_replay_check(gossip_replay *r, const uint8_t id[GOSSIP_ID_LEN], uint64_t seq,
			uint64_t now_us)
{
	uint64_t d = seq > now_us ? seq - now_us : now_us - seq;
	if (d > r->skew_us)
		return GOSSIP_DROP_STALE;
	gossip_replay_ent *e = NULL, *lru = NULL;
	for (size_t i = 0; i < r->n; i++) {
		gossip_replay_ent *x = &r->e[i];
		if (now_us > x->last_us && now_us - x->last_us > 2 * r->skew_us) {
			/* Silent for 2 * skew: whatever it sent before is stale now. */
			*x = r->e[--r->n];
			i--;
			continue;
		}
		if (memcmp(x->id, id, GOSSIP_ID_LEN) == 0)
			e = x;
		else if (!lru || x->last_us < lru->last_us)
			lru = x;
	}
	if (!e) {
		if (r->n < r->cap)
			e = &r->e[r->n++];
		else
			e = lru; /* evict the least recently heard sender */
		memset(e, 0, sizeof *e);
		memcpy(e->id, id, GOSSIP_ID_LEN);
	}
	int lo = -1;
	for (int i = 0; i < e->n; i++) {
		if (e->seqs[i] == seq)
			return GOSSIP_DROP_REPLAY;
		if (lo < 0 || e->seqs[i] < e->seqs[lo])
			lo = i;
	}
	if (e->n == GOSSIP_REPLAY_WIN) {
		if (seq < e->seqs[lo])
			return GOSSIP_DROP_REPLAY; /* below the window: cannot tell, refuse */
		e->seqs[lo] = seq;
	} else {
		e->seqs[e->n++] = seq;
	}
	e->last_us = now_us;
	return GOSSIP_DROP_NONE;
}

/* ---- suspicion math ---- */

void gossip_suspicion_bounds(const gossip_timing *t, int n, int64_t *min_ms, int64_t *max_ms,
			     int *k)
{
	double scale = n > 1 ? log10((double)n) : 0.0;
	if (scale < 1.0)
		scale = 1.0;
	*min_ms = (int64_t)llround((double)t->suspicion_mult * scale * t->probe_interval_ms);
	*max_ms = (int64_t)t->suspicion_max_mult * *min_ms;
	int kk = t->suspicion_mult - 2;
	if (kk < 0 || n - 2 < kk)
		kk = 0;
	if (kk > GOSSIP_MAX_CONFIRM)
		kk = GOSSIP_MAX_CONFIRM;
	*k = kk;
}

int64_t gossip_suspicion_timeout(int64_t min_ms, int64_t max_ms, int k, int c)
{
	if (k <= 0 || c >= k)
		return min_ms;
	double frac = log((double)c + 1.0) / log((double)k + 1.0);
	double v = (double)max_ms - frac * (double)(max_ms - min_ms);
	int64_t r = (int64_t)floor(v);
	return r < min_ms ? min_ms : r;
}

int gossip_retransmit_limit(int mult, int n)
{
	int scale = (int)ceil(log10((double)n + 1.0));
	return mult * (scale < 1 ? 1 : scale);
}

/* ---- timing profiles ---- */

static const gossip_timing profiles[] = {
	/* hashicorp/memberlist DefaultLANConfig; reconnect and reap as Serf
	 * (ReconnectInterval 30 s), reap after an hour rather than 24 h; the
	 * join referral limit is ours (memberlist answers every join in full). */
	{
		.name = "lan",
		.probe_interval_ms = 1000,
		.probe_timeout_ms = 500,
		.indirect_checks = 3,
		.suspicion_mult = 4,
		.suspicion_max_mult = 6,
		.retransmit_mult = 4,
		.gossip_interval_ms = 200,
		.gossip_nodes = 3,
		.push_pull_ms = 30000,
		.gossip_to_dead_ms = 30000,
		.reconnect_ms = 30000,
		.reap_ms = 3600000,
		.tcp_timeout_ms = 10000,
		.tcp_first_ms = 2000,
		.awareness_max = 8,
		.join_backoff_min_ms = 1000,
		.join_backoff_max_ms = 30000,
		.max_skew_ms = 30000,
		.join_full_per_s = 4,
	},
	/* Fast timers for several agents on one machine: a crash is declared dead
	 * in about 1-5 s, a partition heals within a few seconds. */
	{
		.name = "test",
		.probe_interval_ms = 200,
		.probe_timeout_ms = 100,
		.indirect_checks = 2,
		.suspicion_mult = 3,
		.suspicion_max_mult = 6,
		.retransmit_mult = 3,
		.gossip_interval_ms = 50,
		.gossip_nodes = 3,
		.push_pull_ms = 2000,
		.gossip_to_dead_ms = 3000,
		.reconnect_ms = 1000,
		.reap_ms = 60000,
		.tcp_timeout_ms = 1000,
		.tcp_first_ms = 500,
		.awareness_max = 8,
		.join_backoff_min_ms = 100,
		.join_backoff_max_ms = 1000,
		.max_skew_ms = 30000,
		.join_full_per_s = 2,
	},
};

int gossip_timing_profile(const char *name, gossip_timing *out, ds_err *err)
{
	for (size_t i = 0; i < sizeof profiles / sizeof profiles[0]; i++)
		if (name && strcmp(name, profiles[i].name) == 0) {
			*out = profiles[i];
			return DS_OK;
		}
	return ds_err_set(err, DS_EINVAL, "gossip profile '%s' is not one of lan, test",
			  name ? name : "(none)");
}

/* ---- metadata TLVs ---- */

enum {
	META_VERSION = 1,
	META_ROLE = 2,
	META_HEALTH = 3,
	META_ELIGIBLE = 4,
	META_PRIORITY = 5,
	META_EPOCH = 6,
	META_HEAD_ID = 7,
	META_HEAD_EPOCH = 8,
	META_INVENTORY = 9,
	META_CONTROL_PORT = 10,
	META_API_PORT = 11,
	META_STATE = 12, /* role, health, eligible: what 2, 3, 4 say, in one record */
	META_PORTS = 13, /* control port, api port: what 10, 11 say, in one record */
};

static int tlv(uint8_t *out, size_t cap, size_t *len, int type, const void *v, size_t n)
{
	if (n > 255 || *len > cap || cap - *len < 2 + n)
		return DS_ERANGE;
	out[*len] = (uint8_t)type;
	out[*len + 1] = (uint8_t)n;
	memcpy(out + *len + 2, v, n);
	*len += 2 + n;
	return DS_OK;
}

static int all_zero(const uint8_t *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (p[i])
			return 0;
	return 1;
}

/* An epoch as 1..8 big-endian bytes, leading zero bytes dropped. */
static int tlv_u64(uint8_t *out, size_t cap, size_t *len, int type, uint64_t v)
{
	uint8_t b8[8];
	put64(b8, v);
	size_t skip = 0;
	while (skip < 7 && b8[skip] == 0)
		skip++;
	return tlv(out, cap, len, type, b8 + skip, 8 - skip);
}

/* Every member's metadata rides in every alive message and push-pull entry,
 * so the encoder writes the compact records: state and ports in one record
 * each, epochs without leading zero bytes, priority only when not 0.  The
 * decoder also reads the one-field records 2, 3, 4, 10 and 11. */
int gossip_meta_encode(const gossip_meta *m, uint8_t *out, size_t cap, size_t *len,
		       ds_err *err)
{
	size_t l = 0;
	uint8_t b8[8];
	int rc = DS_OK;
	size_t vl = strnlen(m->version, sizeof m->version);
	if (vl)
		rc |= tlv(out, cap, &l, META_VERSION, m->version, vl);
	uint8_t st[3] = {m->role, m->health, m->eligible};
	rc |= tlv(out, cap, &l, META_STATE, st, 3);
	if (m->priority) {
		put32(b8, (uint32_t)m->priority);
		rc |= tlv(out, cap, &l, META_PRIORITY, b8, 4);
	}
	rc |= tlv_u64(out, cap, &l, META_EPOCH, m->epoch);
	if (!all_zero(m->head_id, sizeof m->head_id)) {
		rc |= tlv(out, cap, &l, META_HEAD_ID, m->head_id, sizeof m->head_id);
		rc |= tlv_u64(out, cap, &l, META_HEAD_EPOCH, m->head_epoch);
	}
	if (!all_zero(m->inventory, sizeof m->inventory))
		rc |= tlv(out, cap, &l, META_INVENTORY, m->inventory, sizeof m->inventory);
	put16(b8, m->control_port);
	put16(b8 + 2, m->api_port);
	rc |= tlv(out, cap, &l, META_PORTS, b8, 4);
	if (rc)
		return ds_err_set(err, DS_ERANGE, "node metadata does not fit in %zu bytes", cap);
	*len = l;
	return DS_OK;
}

static uint64_t get_be(const uint8_t *v, size_t n)
{
	uint64_t x = 0;
	for (size_t i = 0; i < n; i++)
		x = x << 8 | v[i];
	return x;
}

int gossip_meta_decode(const uint8_t *in, size_t len, gossip_meta *m, ds_err *err)
{
	memset(m, 0, sizeof *m);
	size_t o = 0;
	while (o < len) {
		if (len - o < 2 || in[o + 1] > len - o - 2)
			return ds_err_set(err, DS_EFORMAT, "metadata record at byte %zu is truncated",
					  o);
		int type = in[o];
		size_t n = in[o + 1];
		const uint8_t *v = in + o + 2;
		/* bytes of each known type (0: any); epochs take 1..8 */
		static const uint8_t want[] = {0, 0, 1, 1, 1, 4, 0, 16, 0, 32, 2, 2, 3, 4};
		if (type < (int)sizeof want && want[type] && n != want[type])
			return ds_err_set(err, DS_EFORMAT,
					  "metadata record %d has %zu bytes, expected %u", type, n,
					  want[type]);
		if ((type == META_EPOCH || type == META_HEAD_EPOCH) && (n < 1 || n > 8))
			return ds_err_set(err, DS_EFORMAT,
					  "metadata record %d has %zu bytes, expected 1 to 8", type,
					  n);
		switch (type) {
		case META_VERSION:
			if (n >= sizeof m->version)
				return ds_err_set(err, DS_EFORMAT, "metadata version is too long");
			memcpy(m->version, v, n);
			m->version[n] = '\0';
			break;
		case META_ROLE: m->role = v[0]; break;
		case META_HEALTH: m->health = v[0]; break;
		case META_ELIGIBLE: m->eligible = v[0]; break;
		case META_PRIORITY: m->priority = (int32_t)get32(v); break;
		case META_EPOCH: m->epoch = get_be(v, n); break;
		case META_HEAD_ID: memcpy(m->head_id, v, 16); break;
		case META_HEAD_EPOCH: m->head_epoch = get_be(v, n); break;
		case META_INVENTORY: memcpy(m->inventory, v, 32); break;
		case META_CONTROL_PORT: m->control_port = get16(v); break;
		case META_API_PORT: m->api_port = get16(v); break;
		case META_STATE:
			m->role = v[0];
			m->health = v[1];
			m->eligible = v[2];
			break;
		case META_PORTS:
			m->control_port = get16(v);
			m->api_port = get16(v + 2);
			break;
		default: break; /* a newer agent's record: skipped */
		}
		o += 2 + n;
	}
	return DS_OK;
}

/* ---- names and tables ---- */

const char *gossip_state_name(int state)
{
	static const char *n[] = {"alive", "suspect", "dead", "left"};
	return state >= 0 && state <= GOSSIP_LEFT ? n[state] : "none";
}

const char *gossip_event_name(int kind)
{
	static const char *n[] = {"?",		  "member_join", "member_alive",
				  "member_suspect", "member_dead", "member_left",
				  "member_meta",    "member_restart", "member_reap"};
	return kind >= GOSSIP_EV_JOIN && kind <= GOSSIP_EV_REAP ? n[kind] : "member_unknown";
}

void gossip_id_hex(const uint8_t id[GOSSIP_ID_LEN], char out[GOSSIP_ID_HEX])
{
	ds_hex_encode(id, GOSSIP_ID_LEN, out);
}

void gossip_event_json(const gossip_event *ev, char *out, size_t n)
{
	char id[GOSSIP_ID_HEX], name[2 * GOSSIP_NAME_MAX + 1];
	size_t j = 0;
	for (const char *s = ev->member.name; *s && j + 2 < sizeof name; s++) {
		if (*s == '"' || *s == '\\')
			name[j++] = '\\';
		name[j++] = *s;
	}
	name[j] = '\0';
	gossip_id_hex(ev->member.id, id);
	snprintf(out, n,
		 "{\"name\":\"%s\",\"id\":\"%s\",\"addr\":\"%s:%u\",\"state\":\"%s\","
		 "\"prev_state\":\"%s\",\"incarnation\":%u,\"boot\":%llu}",
		 name, id, ev->member.addr, (unsigned)ev->member.port,
		 gossip_state_name(ev->member.state), gossip_state_name(ev->prev_state),
		 (unsigned)ev->member.incarnation, (unsigned long long)ev->member.boot);
}

#define S(f) {.name = #f, .offset = offsetof(gossip_stats, f)}
const gossip_stat_field gossip_stat_fields[] = {
	S(packets_in),	     S(bytes_in),	     S(packets_out),	S(bytes_out),
	S(tcp_accepted),     S(tcp_connected),	     S(tcp_failed),	S(tcp_evicted),
	S(tcp_first_timeouts), S(tcp_bytes_in),    S(tcp_bytes_out),	S(pings_out),
	S(acks_in),	     S(ping_reqs_out),	     S(nacks_in),	S(probes_failed),
	S(push_pulls),	     S(joins_ok),	     S(join_attempts), S(joins_referred),	S(drop_too_large),
	S(drop_malformed),   S(drop_bad_key),	     S(drop_auth_fail), S(drop_replay),
	S(drop_stale),	     S(drop_wrong_target),   S(drop_own_id),	S(drop_unknown_sender),
	S(drop_test),	     S(send_errors),	     S(events_lost),	S(table_full),
	{.name = NULL},
};
#undef S

/* ---- files: node id and cluster key ---- */

int gossip_node_id_load(const char *data_dir, uint8_t id[GOSSIP_ID_LEN], int *created,
			ds_err *err)
{
	char path[PATH_MAX];
	if (created)
		*created = 0;
	if ((size_t)snprintf(path, sizeof path, "%s/node.id", data_dir) >= sizeof path)
		return ds_err_set(err, DS_EINVAL, "data directory path too long: %s", data_dir);
	for (int attempt = 0; attempt < 2; attempt++) {
		char text[128];
		size_t len = 0;
		int rc = ds_file_read_small(path, 0, text, sizeof text - 1, &len, err);
		if (rc == DS_OK) {
			text[len] = '\0';
			while (len && (text[len - 1] == '\n' || text[len - 1] == '\r' ||
				       text[len - 1] == ' '))
				len--;
			if (len != 2 * GOSSIP_ID_LEN)
				return ds_err_set(err, DS_EFORMAT,
						  "%s must hold 32 hex digits (the node id); remove it "
						  "to make a new id",
						  path);
			if (ds_hex_decode(text, GOSSIP_ID_LEN, id) != 0)
				return ds_err_set(err, DS_EFORMAT,
						  "%s must hold 32 hex digits (the node id)", path);
			return DS_OK;
		}
		if (rc != DS_ENOTFOUND)
			return rc;
		uint8_t fresh[GOSSIP_ID_LEN];
		char hex[GOSSIP_ID_HEX + 1];
		randombytes_buf(fresh, sizeof fresh);
		gossip_id_hex(fresh, hex);
		hex[2 * GOSSIP_ID_LEN] = '\n';
		rc = ds_file_write_private(path, hex, 2 * GOSSIP_ID_LEN + 1, DS_WRITE_EXCL, err);
		if (rc == DS_EBUSY)
			continue; /* another process won: read its id */
		if (rc != DS_OK)
			return rc;
		memcpy(id, fresh, GOSSIP_ID_LEN);
		if (created)
			*created = 1;
		return DS_OK;
	}
	return ds_err_set(err, DS_EIO, "%s keeps appearing and disappearing", path);
}

