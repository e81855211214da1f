/*
 * cluster.c - the cluster layer of one agent (see cluster.h).
 *
 * Callers: agent/main.c (new, start, free, membership events) and
 * agent/api/control.c (the cluster routes).  Calls: agent/node/discover (this node),
 * agent/cluster/gossip (view, metadata), agent/cluster/election (the head), agent/cluster/rpc (votes,
 * heartbeats, inventory fetches, forwarding) and agent/store/store (the record).
 *
 * Data flow:
 *
 *   gossip view --election thread--> election_set_view, election_tick
 *        |                                 | send: POST /v1/cluster/election
 *        |                                 v       to each peer (rpc_run)
 *        |                           role, epoch, head --> gossip metadata
 *        |
 *        +--inventory thread--> this node: disc_run every health_ms -> store
 *                               head: members whose metadata digest differs
 *                               from the record, or whose health is older than
 *                               health_ms: GET /v1/node (rpc_run, in parallel)
 *                               -> store_node_put, one transaction per node
 *
 * Invariants:
 *  1. Only the head writes other nodes' rows; every node writes its own.
 *  2. Agent-to-agent requests are signed (rpc.h); a request to or from a
 *     member on the test drop list is neither sent nor answered.
 *  3. The metadata is republished only when a field changed (each change
 *     bumps the gossip incarnation).
 *  4. cluster_free stops and joins both threads before anything they use is
 *     freed.
 *  5. This file is the only writer of this node's gossip metadata: the
 *     metadata gossip starts with comes from cluster_meta_initial, every
 *     later version from publish_meta, both built by meta_encode, so no peer
 *     ever sees a default role, eligibility or priority for this node.
 *
 * Threading: c->mu guards inv, digest, ports, the drop list and the peer
 * table; the election, gossip, store and rpc_auth have their own locks.  Two
 * threads of our own (election, inventory) and the HTTP threads of the
 * control API call in.
 */
#include "agent/cluster/cluster.h"
#include "agent/auth/clusterkey_file.h"
#include "agent/plan/plan.h"
#include "common/hex.h"
#include "common/jsonx.h"
#include "common/log.h"
#include "common/strutil.h"

#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define INVENTORY_MAX (8u << 20)  /* one node's /v1/node answer */
#define NODES_MAX (64u << 20)     /* a forwarded /v1/cluster/nodes answer */
#define FETCH_TIMEOUT_MS 3000
#define FORWARD_TIMEOUT_MS 5000
#define HISTORY_SHOWN 16

struct peer {
	uint8_t id[GOSSIP_ID_LEN];
	char digest[DISC_DIGEST_HEX]; /* of the inventory in the record */
	int64_t fetched_ms;           /* last successful fetch (0: never) */
	int64_t tried_ms;
	char seen[96];                /* status|role|epoch|addr|ports last written */
};

struct cluster {
	cluster_params p;
	uint8_t self_id[GOSSIP_ID_LEN];
	char self_hex[GOSSIP_ID_HEX];
	store *st;
	gossip *g;
	election *el;
	rpc_auth *auth;
	int tick_ms;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int stop;
	int started;
	pthread_t el_th, inv_th;
	/* guarded by mu */
	json_t *inv;
	char digest[DISC_DIGEST_HEX];
	int64_t inv_unix;
	int control_port, api_port;
	char (*drop)[GOSSIP_NAME_MAX + 1];
	size_t n_drop;
	struct peer *peers;
	size_t n_peers, cap_peers;
	/* election thread only */
	uint8_t meta[GOSSIP_META_MAX];
	size_t meta_len;
	uint64_t gossip_epoch;
	/* inventory thread only */
	int was_head;
	char self_seen[96];
};

cluster_params cluster_default_params(void)
{
	cluster_params p;
	memset(&p, 0, sizeof p);
	p.disc = disc_default_params();
	p.settle_ms = 3000;
	p.lease_ms = 5000;
	p.health_ms = 10000;
	p.eligible = 1;
	return p;
}

/* Monotonic milliseconds, the clock the election runs on. */
static int64_t cluster_now_ms(void)
{
	return (int64_t)(ds_now_ns() / 1000000u);
}

static int64_t unix_now(void)
{
	return (int64_t)time(NULL);
}

rpc_auth *cluster_rpc_auth(cluster *c)
{
	return c->auth;
}

/* ---- the gossip view ---- */

/* The gossip instance (NULL before cluster_start and for a single node);
 * cluster_start sets it while HTTP threads may already ask. */
static gossip *gossip_of(cluster *c)
{
	pthread_mutex_lock(&c->mu);
	gossip *g = c->g;
	pthread_mutex_unlock(&c->mu);
	return g;
}

/* A malloc'd copy of the member list (self first); *n members. */
static gossip_member *view_copy(cluster *c, size_t *n)
{
	*n = 0;
	gossip *g = gossip_of(c);
	if (!g)
		return NULL;
	size_t cap = 32;
	for (int tries = 0; tries < 4; tries++) {
		gossip_member *m = malloc(cap * sizeof *m);
		if (!m)
			return NULL;
		size_t total = gossip_members(g, m, cap);
		if (total <= cap) {
			*n = total;
			return m;
		}
		free(m);
		cap = total + 16;
	}
	return NULL;
}

static int meta_of(const gossip_member *m, gossip_meta *md)
{
	if (!m->meta_len || gossip_meta_decode(m->meta, m->meta_len, md, NULL) != DS_OK) {
		memset(md, 0, sizeof *md);
		return 0;
	}
	return 1;
}

static int zero_bytes(const uint8_t *b, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (b[i])
			return 0;
	return 1;
}

static int dropped_name(cluster *c, const char *name)
{
	int hit = 0;
	pthread_mutex_lock(&c->mu);
	for (size_t i = 0; i < c->n_drop && !hit; i++)
		hit = strcmp(c->drop[i], name) == 0;
	pthread_mutex_unlock(&c->mu);
	return hit;
}

static const gossip_member *find_member(const gossip_member *v, size_t n,
					const uint8_t id[GOSSIP_ID_LEN])
{
	for (size_t i = 0; i < n; i++)
		if (memcmp(v[i].id, id, GOSSIP_ID_LEN) == 0)
			return &v[i];
	return NULL;
}

/* The name of a node id in the view, or its hex. */
static void name_of(const gossip_member *v, size_t n, const uint8_t id[GOSSIP_ID_LEN],
		    char *out, size_t size)
{
	const gossip_member *m = find_member(v, n, id);
	if (m) {
		ds_strlcpy(out, m->name, size);
	} else {
		char h[GOSSIP_ID_HEX];
		gossip_id_hex(id, h);
		ds_strlcpy(out, h, size);
	}
}

/* name_of, knowing this node's own name without gossip too. */
static void id_name(const cluster *c, const gossip_member *v, size_t n,
		    const uint8_t id[GOSSIP_ID_LEN], char *out, size_t size)
{
	if (memcmp(id, c->self_id, GOSSIP_ID_LEN) == 0)
		ds_strlcpy(out, c->p.node_name, size);
	else
		name_of(v, n, id, out, size);
}

/* ---- election transport ---- */

static void el_send(void *ud, const election_msg *m, const uint8_t (*to)[ELECTION_ID_LEN],
		    size_t n, int timeout_ms, election_reply *rep, int *ans)
{
	cluster *c = ud;
	size_t nv = 0;
	gossip_member *v = view_copy(c, &nv);
	rpc_call *calls = calloc(n, sizeof *calls);
	size_t *slot = calloc(n, sizeof *slot);
	json_t *j = election_msg_json(m);
	char *body = j ? json_dumps(j, JSON_COMPACT) : NULL;
	json_decref(j);
	size_t k = 0;
	if (!calls || !slot || !body)
		goto out;
	for (size_t i = 0; i < n; i++) {
		const gossip_member *mb = find_member(v, nv, to[i]);
		gossip_meta md;
		if (!mb || !meta_of(mb, &md) || !md.control_port || dropped_name(c, mb->name))
			continue;
		if (rpc_call_init(&calls[k], mb->addr, md.control_port, "POST",
				  "/v1/cluster/election", body, strlen(body)) != DS_OK)
			continue;
		slot[k++] = i;
	}
	rpc_run(calls, k, c->auth, timeout_ms, 64 << 10);
	for (size_t i = 0; i < k; i++) {
		rpc_call *rc = &calls[i];
		if (rc->rc != DS_OK || rc->status != 200)
			continue;
		json_t *r = jsonx_parse(rc->resp.data, rc->resp.len, 8, NULL);
		if (r && election_reply_parse(r, &rep[slot[i]], NULL) == DS_OK)
			ans[slot[i]] = 1;
		json_decref(r);
	}
out:
	for (size_t i = 0; calls && i < k; i++)
		rpc_call_free(&calls[i]);
	free(calls);
	free(slot);
	free(body);
	free(v);
}

/* ---- the election thread ---- */

static void push_view(cluster *c, int64_t now)
{
	size_t n = 0;
	gossip_member *v = view_copy(c, &n);
	election_member *em = n ? calloc(n, sizeof *em) : NULL;
	if (n && !em) {
		free(v);
		return;
	}
	for (size_t i = 0; i < n; i++) {
		gossip_meta md;
		meta_of(&v[i], &md);
		memcpy(em[i].id, v[i].id, GOSSIP_ID_LEN);
		ds_strlcpy(em[i].name, v[i].name, sizeof em[i].name);
		em[i].state = v[i].state;
		em[i].is_self = v[i].is_self;
		em[i].eligible = md.eligible;
		em[i].priority = md.priority;
		em[i].role = md.role;
		em[i].epoch = md.epoch > v[i].epoch ? md.epoch : v[i].epoch;
		em[i].head_epoch = md.head_epoch;
	}
	election_set_view(c->el, em, n, now);
	free(em);
	free(v);
}

/* This node's metadata: version, the election's view (role, epoch, head),
 * the operator's eligible and priority, the inventory digest and the ports
 * once cluster_start knows them.  The one builder of it (invariant 5). */
static int meta_encode(cluster *c, int64_t now, uint8_t *out, size_t cap, size_t *len,
		       ds_err *err)
{
	election_status es;
	gossip_meta md;
	election_status_get(c->el, now, &es);
	memset(&md, 0, sizeof md);
	ds_strlcpy(md.version, c->p.version ? c->p.version : "", sizeof md.version);
	md.role = (uint8_t)es.role;
	md.health = GOSSIP_HEALTH_OK;
	md.eligible = (uint8_t)!!c->p.eligible;
	md.priority = c->p.priority;
	md.epoch = es.epoch;
	if (es.has_head)
		memcpy(md.head_id, es.head, GOSSIP_ID_LEN);
	md.head_epoch = es.has_head ? es.head_epoch : 0;
	pthread_mutex_lock(&c->mu);
	if (strlen(c->digest) != 2 * sizeof md.inventory ||
	    ds_hex_decode(c->digest, sizeof md.inventory, md.inventory) != 0)
		memset(md.inventory, 0, sizeof md.inventory); /* none yet */
	md.control_port = (uint16_t)c->control_port;
	md.api_port = (uint16_t)c->api_port;
	pthread_mutex_unlock(&c->mu);
	return gossip_meta_encode(&md, out, cap, len, err);
}

int cluster_meta_initial(cluster *c, uint8_t *out, size_t cap, size_t *len, ds_err *err)
{
	int rc = meta_encode(c, cluster_now_ms(), out, cap, len, err);
	if (rc == DS_OK && *len <= sizeof c->meta) { /* what gossip starts with */
		memcpy(c->meta, out, *len);
		c->meta_len = *len;
	}
	return rc;
}

/* Republishes this node's metadata when a field changed. */
static void publish_meta(cluster *c, int64_t now)
{
	election_status es;
	uint8_t mb[GOSSIP_META_MAX];
	size_t len = 0;
	if (meta_encode(c, now, mb, sizeof mb, &len, NULL) != DS_OK)
		return;
	election_status_get(c->el, now, &es);
	if (len != c->meta_len || memcmp(mb, c->meta, len) != 0) {
		ds_err err = {0};
		if (gossip_set_meta(c->g, mb, len, &err) == DS_OK) {
			memcpy(c->meta, mb, len);
			c->meta_len = len;
		} else {
			log_warn("cluster", "cannot publish metadata", "error=\"%s\"", err.msg);
		}
	}
	if (es.epoch != c->gossip_epoch) {
		gossip_set_epoch(c->g, es.epoch);
		c->gossip_epoch = es.epoch;
	}
}

static int wait_or_stop(cluster *c, int ms)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of c->cv (cluster_new) */
	ts.tv_sec += ms / 1000;
	ts.tv_nsec += (long)(ms % 1000) * 1000000L;
	if (ts.tv_nsec >= 1000000000L) {
		ts.tv_sec++;
		ts.tv_nsec -= 1000000000L;
	}
	pthread_mutex_lock(&c->mu);
	if (!c->stop)
		pthread_cond_timedwait(&c->cv, &c->mu, &ts);
	int stop = c->stop;
	pthread_mutex_unlock(&c->mu);
	return stop;
}

static void *election_main(void *arg)
{
	cluster *c = arg;
	do {
		int64_t now = cluster_now_ms();
		push_view(c, now);
		election_tick(c->el, now);
		publish_meta(c, cluster_now_ms());
	} while (!wait_or_stop(c, c->tick_ms));
	return NULL;
}

/* ---- this node's inventory ---- */

static void self_node(cluster *c, store_node *n, int64_t now_ms)
{
	election_status es;
	election_status_get(c->el, now_ms, &es);
	memset(n, 0, sizeof *n);
	ds_strlcpy(n->id, c->self_hex, sizeof n->id);
	ds_strlcpy(n->name, c->p.node_name, sizeof n->name);
	gossip *g = gossip_of(c);
	ds_strlcpy(n->addr, g ? gossip_advertise_addr(g) : "", sizeof n->addr);
	pthread_mutex_lock(&c->mu);
	n->control_port = c->control_port;
	n->api_port = c->api_port;
	pthread_mutex_unlock(&c->mu);
	ds_strlcpy(n->status, "alive", sizeof n->status);
	ds_strlcpy(n->role, election_role_name(es.role), sizeof n->role);
	n->epoch = (int64_t)es.epoch;
	n->last_seen = unix_now();
}

/* Runs discovery and writes this node's row.  DS_OK or disc_run's error. */
static int refresh_own(cluster *c, ds_err *err)
{
	disc_inventory *inv = NULL;
	char dg[DISC_DIGEST_HEX];
	int rc = disc_run(&c->p.disc, &inv, err);
	if (rc)
		return rc;
	json_t *j = disc_to_json(inv);
	rc = j ? disc_digest(inv, dg, err) : ds_err_set(err, DS_ENOMEM, "out of memory");
	disc_free(inv);
	if (rc) {
		json_decref(j);
		return rc;
	}
	int changed;
	pthread_mutex_lock(&c->mu);
	changed = strcmp(c->digest, dg) != 0;
	json_decref(c->inv);
	c->inv = j;
	ds_strlcpy(c->digest, dg, sizeof c->digest);
	c->inv_unix = unix_now();
	json_incref(j);
	pthread_mutex_unlock(&c->mu);
	if (changed)
		log_info("cluster", "inventory", "digest=%s", dg);
	store_node self;
	ds_err e = {0};
	self_node(c, &self, cluster_now_ms());
	if (store_node_put(c->st, &self, j, dg, unix_now(), &e) != DS_OK)
		log_warn("cluster", "cannot record this node", "error=\"%s\"", e.msg);
	json_decref(j);
	return DS_OK;
}

/* ---- the head's record ---- */

static struct peer *peer_get(cluster *c, const uint8_t id[GOSSIP_ID_LEN])
{
	for (size_t i = 0; i < c->n_peers; i++)
		if (memcmp(c->peers[i].id, id, GOSSIP_ID_LEN) == 0)
			return &c->peers[i];
	if (c->n_peers == c->cap_peers) {
		size_t nc = c->cap_peers ? c->cap_peers * 2 : 16;
		struct peer *p = realloc(c->peers, nc * sizeof *p);
		if (!p)
			return NULL;
		c->peers = p;
		c->cap_peers = nc;
	}
	struct peer *p = &c->peers[c->n_peers++];
	memset(p, 0, sizeof *p);
	memcpy(p->id, id, GOSSIP_ID_LEN);
	return p;
}

static void member_node(const gossip_member *m, const gossip_meta *md, store_node *n)
{
	memset(n, 0, sizeof *n);
	gossip_id_hex(m->id, n->id);
	ds_strlcpy(n->name, m->name, sizeof n->name);
	ds_strlcpy(n->addr, m->addr, sizeof n->addr);
	n->control_port = md->control_port;
	n->api_port = md->api_port;
	ds_strlcpy(n->status, gossip_state_name(m->state), sizeof n->status);
	ds_strlcpy(n->role, election_role_name(md->role), sizeof n->role);
	n->epoch = (int64_t)md->epoch;
	n->last_seen = m->state == GOSSIP_ALIVE ? unix_now() : (int64_t)m->changed_s;
	if (n->last_seen <= 0)
		n->last_seen = unix_now();
}

struct fetch {
	rpc_call call;
	gossip_member m;
	gossip_meta md;
};

/* Stores one fetched GET /v1/node answer. */
static void store_fetched(cluster *c, struct fetch *f, int64_t now)
{
	char id[GOSSIP_ID_HEX];
	ds_err e = {0};
	gossip_id_hex(f->m.id, id);
	if (f->call.rc != DS_OK || f->call.status != 200) {
		log_debug("cluster", "inventory fetch failed", "node=%s status=%d error=\"%s\"",
			  f->m.name, f->call.status, f->call.rc ? f->call.err : "");
		return;
	}
	json_t *doc = jsonx_parse(f->call.resp.data, f->call.resp.len, 32, &e);
	const json_t *inv = json_object_get(doc, "inventory");
	const char *rid = json_string_value(json_object_get(doc, "id"));
	const char *dg = json_string_value(json_object_get(doc, "digest"));
	if (!doc || !json_is_object(inv) || !rid || strcmp(rid, id) != 0) {
		log_warn("cluster", "bad inventory answer", "node=%s error=\"%s\"", f->m.name,
			 doc ? "no inventory object or another node id" : e.msg);
		json_decref(doc);
		return;
	}
	store_node n;
	member_node(&f->m, &f->md, &n);
	if (store_node_put(c->st, &n, inv, dg, unix_now(), &e) != DS_OK) {
		log_warn("cluster", "cannot record a node", "node=%s error=\"%s\"", f->m.name, e.msg);
	} else {
		pthread_mutex_lock(&c->mu);
		struct peer *p = peer_get(c, f->m.id);
		if (p) {
			ds_strlcpy(p->digest, dg ? dg : "", sizeof p->digest);
			p->fetched_ms = now;
		}
		pthread_mutex_unlock(&c->mu);
	}
	json_decref(doc);
}

/* On the head: liveness of every member into the record, and the
 * inventories that changed or whose health is older than health_ms. */
static void collect(cluster *c, int64_t now)
{
	election_status es;
	election_status_get(c->el, now, &es);
	int head = es.has_head && es.role == GOSSIP_ROLE_HEAD;
	if (!head || !c->g) { /* this node's own row: its role and epoch as they change */
		store_node n;
		char seen[96];
		ds_err e = {0};
		c->was_head = 0;
		self_node(c, &n, now);
		snprintf(seen, sizeof seen, "%s|%lld|%d|%d", n.role, (long long)n.epoch,
			 n.control_port, n.api_port);
		if (strcmp(seen, c->self_seen) != 0) {
			ds_strlcpy(c->self_seen, seen, sizeof c->self_seen);
			if (store_node_seen(c->st, &n, unix_now(), &e) != DS_OK)
				log_warn("cluster", "cannot record this node", "error=\"%s\"", e.msg);
		}
		return;
	}
	c->self_seen[0] = '\0';
	if (!c->was_head) { /* a new reign: fetch everybody now */
		c->was_head = 1;
		pthread_mutex_lock(&c->mu);
		for (size_t i = 0; i < c->n_peers; i++)
			c->peers[i].fetched_ms = c->peers[i].tried_ms = 0;
		pthread_mutex_unlock(&c->mu);
	}
	size_t nv = 0;
	gossip_member *v = view_copy(c, &nv);
	struct fetch *f = nv ? calloc(nv, sizeof *f) : NULL;
	size_t k = 0;
	for (size_t i = 0; f && i < nv; i++) {
		gossip_member *m = &v[i];
		gossip_meta md;
		store_node n;
		ds_err e = {0};
		meta_of(m, &md);
		if (m->is_self) {
			self_node(c, &n, now);
		} else {
			member_node(m, &md, &n);
		}
		char seen[96], dg[DISC_DIGEST_HEX] = "";
		snprintf(seen, sizeof seen, "%s|%s|%lld|%s|%d|%d", n.status, n.role,
			 (long long)n.epoch, n.addr, n.control_port, n.api_port);
		if (!zero_bytes(md.inventory, sizeof md.inventory))
			ds_hex_encode(md.inventory, sizeof md.inventory, dg);
		int write_seen = 0, fetch = 0;
		pthread_mutex_lock(&c->mu);
		struct peer *p = peer_get(c, m->id);
		if (p && strcmp(p->seen, seen) != 0) {
			ds_strlcpy(p->seen, seen, sizeof p->seen);
			write_seen = 1;
		}
		if (p && !m->is_self && m->state == GOSSIP_ALIVE && md.control_port &&
		    (strcmp(p->digest, dg) != 0 || now - p->fetched_ms >= c->p.health_ms) &&
		    now - p->tried_ms >= (c->p.health_ms < 1000 ? c->p.health_ms : 1000)) {
			p->tried_ms = now;
			fetch = 1;
		}
		pthread_mutex_unlock(&c->mu);
		if (write_seen && store_node_seen(c->st, &n, unix_now(), &e) != DS_OK)
			log_warn("cluster", "cannot record a node", "node=%s error=\"%s\"", m->name,
				 e.msg);
		if (!fetch || dropped_name(c, m->name))
			continue;
		if (rpc_call_init(&f[k].call, m->addr, md.control_port, "GET", "/v1/node", NULL, 0) !=
		    DS_OK)
			continue;
		f[k].m = *m;
		f[k].md = md;
		k++;
	}
	if (k) {
		rpc_call *calls = calloc(k, sizeof *calls);
		if (calls) {
			for (size_t i = 0; i < k; i++)
				calls[i] = f[i].call;
			rpc_run(calls, k, c->auth, FETCH_TIMEOUT_MS, INVENTORY_MAX);
			for (size_t i = 0; i < k; i++) {
				f[i].call = calls[i];
				store_fetched(c, &f[i], now);
				rpc_call_free(&f[i].call);
			}
			free(calls);
		}
	}
	free(f);
	free(v);
}

static void *inventory_main(void *arg)
{
	cluster *c = arg;
	int64_t next_own = cluster_now_ms() + c->p.health_ms; /* cluster_new ran it once */
	do {
		int64_t now = cluster_now_ms();
		if (now >= next_own) {
			ds_err e = {0};
			if (refresh_own(c, &e) != DS_OK)
				log_warn("cluster", "discovery failed", "error=\"%s\"", e.msg);
			next_own = now + c->p.health_ms;
		}
		collect(c, now);
	} while (!wait_or_stop(c, 200));
	return NULL;
}

/* ---- life cycle ---- */

cluster *cluster_new(const cluster_params *p, ds_err *err)
{
	cluster *c = calloc(1, sizeof *c);
	clusterkey_ring keys;
	int have_keys = 0;
	memset(&keys, 0, sizeof keys);
	if (!c) {
		ds_err_set(err, DS_ENOMEM, "out of memory");
		return NULL;
	}
	c->p = *p;
	c->st = p->store;
	pthread_mutex_init(&c->mu, NULL);
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* waits are intervals */
	pthread_cond_init(&c->cv, &ca);
	pthread_condattr_destroy(&ca);
	int rc = DS_OK;
	if (!p->store || !p->node_name || !p->data_dir || p->lease_ms < 30 || p->health_ms < 50) {
		rc = ds_err_set(err, DS_EINVAL, "cluster: bad parameters");
		goto out;
	}
	c->tick_ms = p->lease_ms / 20 < 10 ? 10 : p->lease_ms / 20 > 100 ? 100 : p->lease_ms / 20;
	if ((rc = gossip_node_id_load(p->data_dir, c->self_id, NULL, err)) != DS_OK)
		goto out;
	gossip_id_hex(c->self_id, c->self_hex);
	if (p->cluster_key) {
		if ((rc = clusterkey_file_load(p->cluster_key, &keys, err)) != DS_OK)
			goto out;
		have_keys = 1;
		if (!(c->auth = rpc_auth_new((const uint8_t(*)[RPC_KEY_LEN])keys.key, keys.n,
					     c->self_id, err))) {
			rc = err ? err->code : DS_EINVAL;
			goto out;
		}
	}
	election_params ep = election_default_params();
	memcpy(ep.self_id, c->self_id, GOSSIP_ID_LEN);
	ep.expect = p->expect;
	ep.settle_ms = p->settle_ms;
	ep.lease_ms = p->lease_ms;
	ep.eligible = p->eligible;
	ep.priority = p->priority;
	ep.single = !p->cluster_key;
	ep.store = p->store;
	ep.send = el_send;
	ep.ud = c;
	randombytes_buf(&ep.seed, sizeof ep.seed);
	if (!(c->el = election_new(&ep, cluster_now_ms(), err))) {
		rc = err ? err->code : DS_EINVAL;
		goto out;
	}
	if ((rc = refresh_own(c, err)) != DS_OK) {
		ds_err_wrap(err, "discovery");
		goto out;
	}
out:
	if (have_keys)
		clusterkey_wipe(&keys);
	if (rc) {
		cluster_free(c);
		return NULL;
	}
	return c;
}

int cluster_start(cluster *c, gossip *g, int control_port, int api_port, ds_err *err)
{
	if (!!g != !!c->p.cluster_key)
		return ds_err_set(err, DS_EINVAL, "cluster: gossip given %s a cluster key",
				  g ? "without" : "but no gossip with");
	pthread_mutex_lock(&c->mu);
	c->g = g;
	c->control_port = control_port;
	c->api_port = api_port;
	pthread_mutex_unlock(&c->mu);
	store_node self;
	ds_err e = {0};
	self_node(c, &self, cluster_now_ms());
	if (store_node_seen(c->st, &self, unix_now(), &e) != DS_OK)
		log_warn("cluster", "cannot record this node", "error=\"%s\"", e.msg);
	if (g) /* the ports join the metadata now, before the election thread runs */
		publish_meta(c, cluster_now_ms());
	if (pthread_create(&c->inv_th, NULL, inventory_main, c) != 0)
		return ds_err_set(err, DS_EINTERNAL, "cannot start the inventory thread");
	if (g && pthread_create(&c->el_th, NULL, election_main, c) != 0) {
		pthread_mutex_lock(&c->mu);
		c->stop = 1;
		pthread_cond_broadcast(&c->cv);
		pthread_mutex_unlock(&c->mu);
		pthread_join(c->inv_th, NULL);
		return ds_err_set(err, DS_EINTERNAL, "cannot start the election thread");
	}
	c->started = g ? 2 : 1;
	return DS_OK;
}

void cluster_free(cluster *c)
{
	if (!c)
		return;
	pthread_mutex_lock(&c->mu);
	c->stop = 1;
	pthread_cond_broadcast(&c->cv);
	pthread_mutex_unlock(&c->mu);
	if (c->started >= 1)
		pthread_join(c->inv_th, NULL);
	if (c->started >= 2)
		pthread_join(c->el_th, NULL);
	election_free(c->el);
	rpc_auth_free(c->auth);
	json_decref(c->inv);
	free(c->drop);
	free(c->peers);
	pthread_cond_destroy(&c->cv);
	pthread_mutex_destroy(&c->mu);
	free(c);
}

void cluster_member_event(cluster *c, const gossip_event *ev)
{
	if (!c)
		return;
	char id[GOSSIP_ID_HEX];
	ds_err e = {0};
	gossip_id_hex(ev->member.id, id);
	if (store_member_event_add(c->st, unix_now(), id, ev->member.name,
				   ev->member.addr, gossip_event_name(ev->kind),
				   gossip_state_name(ev->member.state),
				   ev->prev_state >= 0 ? gossip_state_name(ev->prev_state) : NULL,
				   ev->member.incarnation, &e) != DS_OK)
		log_warn("cluster", "cannot record a membership event", "error=\"%s\"", e.msg);
}

/* ---- JSON answers ---- */

static json_t *int_or_null(int ok, int64_t v)
{
	return ok ? json_integer((json_int_t)v) : json_null();
}

/* Totals of an inventory for the one-line views. */
static json_t *summary_of(const json_t *inv)
{
	const json_t *gpus = json_object_get(inv, "gpus");
	const json_t *ports = json_object_get(inv, "ib_ports");
	const json_t *comp = json_object_get(inv, "compute");
	int64_t mem_total = 0, mem_used = 0, temp = 0, ev = 0, ea = 0;
	int have_total = 0, have_used = 0, have_temp = 0, have_ev = 0, have_ea = 0;
	for (size_t i = 0; i < json_array_size(gpus); i++) {
		const json_t *g = json_array_get(gpus, i);
		const json_t *h = json_object_get(g, "health");
		const json_t *x;
		if (json_is_integer(x = json_object_get(g, "memory_total_bytes"))) {
			mem_total += json_integer_value(x);
			have_total = 1;
		}
		if (json_is_integer(x = json_object_get(h, "memory_used_bytes"))) {
			mem_used += json_integer_value(x);
			have_used = 1;
		}
		if (json_is_integer(x = json_object_get(h, "temperature_c")) &&
		    (!have_temp || json_integer_value(x) > temp)) {
			temp = json_integer_value(x);
			have_temp = 1;
		}
		if (json_is_integer(x = json_object_get(h, "ecc_uncorrected_volatile"))) {
			ev += json_integer_value(x);
			have_ev = 1;
		}
		if (json_is_integer(x = json_object_get(h, "ecc_uncorrected_aggregate"))) {
			ea += json_integer_value(x);
			have_ea = 1;
		}
	}
	int up = 0;
	double rmin = 0, rmax = 0;
	for (size_t i = 0; i < json_array_size(ports); i++) {
		const json_t *p = json_array_get(ports, i);
		const json_t *r = json_object_get(p, "rate_gbps");
		if (!json_is_true(json_object_get(p, "usable")))
			continue;
		if (json_is_number(r)) {
			double v = json_number_value(r);
			rmin = up == 0 || v < rmin ? v : rmin;
			rmax = up == 0 || v > rmax ? v : rmax;
		}
		up++;
	}
	const char *kind = json_string_value(json_object_get(comp, "kind"));
	const json_t *ranks = json_object_get(comp, "ranks");
	return json_pack("{s:i,s:o,s:o,s:o,s:o,s:o,s:i,s:i,s:o,s:o,s:s?,s:o}", "gpus",
			 (int)json_array_size(gpus), "gpu_memory_total_bytes",
			 int_or_null(have_total, mem_total), "gpu_memory_used_bytes",
			 int_or_null(have_used, mem_used), "max_temperature_c",
			 int_or_null(have_temp, temp), "ecc_uncorrected_volatile",
			 int_or_null(have_ev, ev), "ecc_uncorrected_aggregate",
			 int_or_null(have_ea, ea), "ib_ports_up", up, "ib_ports_total",
			 (int)json_array_size(ports), "ib_rate_gbps_min",
			 up ? json_real(rmin) : json_null(), "ib_rate_gbps_max",
			 up ? json_real(rmax) : json_null(), "compute", kind, "ranks",
			 json_is_integer(ranks) ? json_integer(json_integer_value(ranks))
						: json_null());
}

static json_t *opt_time(int64_t t)
{
	return t > 0 ? json_integer((json_int_t)t) : json_null();
}

static json_t *str_or_null(const char *s)
{
	return s && *s ? json_string(s) : json_null();
}

/* One node of /v1/cluster/nodes; inv is stolen (may be NULL). */
static json_t *node_json(const store_node *n, json_t *inv, int self)
{
	json_t *o = json_pack("{s:s,s:s,s:o,s:o,s:o,s:s,s:o,s:I,s:o,s:o,s:o,s:o,s:o,s:b}", "id",
			      n->id, "name", n->name, "addr", str_or_null(n->addr),
			      "control_port", n->control_port ? json_integer(n->control_port) : json_null(),
			      "api_port", n->api_port ? json_integer(n->api_port) : json_null(),
			      "status", n->status[0] ? n->status : "unknown", "role",
			      str_or_null(n->role), "epoch", (json_int_t)n->epoch, "first_seen",
			      opt_time(n->first_seen), "last_seen", opt_time(n->last_seen),
			      "inventory_at", opt_time(n->inventory_at), "health_at",
			      opt_time(n->health_at), "digest", str_or_null(n->digest), "self", self);
	if (!o) {
		json_decref(inv);
		return NULL;
	}
	json_t *sum = inv ? summary_of(inv) : json_null();
	if (json_object_set_new(o, "summary", sum ? sum : json_null()) != 0 ||
	    json_object_set_new(o, "inventory", inv ? inv : json_null()) != 0) {
		json_decref(o);
		return NULL;
	}
	return o;
}

static int by_name(const void *a, const void *b)
{
	const json_t *x = *(json_t *const *)a, *y = *(json_t *const *)b;
	int d = strcmp(json_string_value(json_object_get(x, "name")),
		       json_string_value(json_object_get(y, "name")));
	return d ? d : strcmp(json_string_value(json_object_get(x, "id")),
			      json_string_value(json_object_get(y, "id")));
}

static json_t *sorted_array(json_t **v, size_t n)
{
	json_t *a = json_array();
	qsort(v, n, sizeof *v, by_name);
	for (size_t i = 0; i < n; i++)
		if (!a || json_array_append_new(a, v[i]) != 0) {
			json_decref(v[i]);
			json_decref(a);
			a = NULL;
		}
	return a;
}

json_t *cluster_node_json(cluster *c)
{
	election_status es;
	store_node n;
	self_node(c, &n, cluster_now_ms());
	election_status_get(c->el, cluster_now_ms(), &es);
	char head[GOSSIP_ID_HEX];
	gossip_id_hex(es.head, head);
	pthread_mutex_lock(&c->mu);
	json_t *inv = c->inv ? json_deep_copy(c->inv) : json_null();
	ds_strlcpy(n.digest, c->digest, sizeof n.digest);
	n.inventory_at = n.health_at = c->inv_unix;
	pthread_mutex_unlock(&c->mu);
	json_t *o = json_pack("{s:s,s:s,s:o,s:o,s:o,s:s,s:I,s:o,s:I,s:o,s:o,s:o}", "id", n.id,
			      "name", n.name, "addr", str_or_null(n.addr), "control_port",
			      n.control_port ? json_integer(n.control_port) : json_null(),
			      "api_port", n.api_port ? json_integer(n.api_port) : json_null(), "role",
			      n.role, "epoch", (json_int_t)n.epoch, "head",
			      es.has_head ? json_string(head) : json_null(), "head_epoch",
			      (json_int_t)(es.has_head ? es.head_epoch : 0), "digest",
			      str_or_null(n.digest), "inventory_at", opt_time(n.inventory_at),
			      "inventory", inv ? inv : json_null());
	return o;
}

static json_t *member_json(const gossip_member *m)
{
	gossip_meta md;
	char id[GOSSIP_ID_HEX], head[GOSSIP_ID_HEX];
	int has = meta_of(m, &md);
	gossip_id_hex(m->id, id);
	gossip_id_hex(md.head_id, head);
	return json_pack("{s:s,s:s,s:s,s:i,s:s,s:s,s:I,s:o,s:I,s:b,s:i,s:o,s:o,s:b,s:f}", "id", id,
			 "name", m->name, "addr", m->addr, "port", m->port, "state",
			 gossip_state_name(m->state), "role", election_role_name(md.role), "epoch",
			 (json_int_t)md.epoch, "head",
			 has && !zero_bytes(md.head_id, GOSSIP_ID_LEN) ? json_string(head)
								       : json_null(),
			 "head_epoch", (json_int_t)md.head_epoch, "eligible", md.eligible,
			 "priority", md.priority, "control_port",
			 md.control_port ? json_integer(md.control_port) : json_null(),
			 "api_port", md.api_port ? json_integer(md.api_port) : json_null(), "self",
			 m->is_self, "changed", m->changed_s);
}

json_t *cluster_state_json(cluster *c)
{
	election_status es;
	int64_t now = cluster_now_ms();
	election_status_get(c->el, now, &es);
	size_t nv = 0;
	gossip_member *v = view_copy(c, &nv);
	char head[GOSSIP_ID_HEX], hname[GOSSIP_NAME_MAX + 1], voted[GOSSIP_ID_HEX];
	gossip_id_hex(es.head, head);
	id_name(c, v, nv, es.head, hname, sizeof hname);
	gossip_id_hex(es.voted_for, voted);
	json_t *members = json_array();
	if (gossip_of(c)) {
		for (size_t i = 0; members && i < nv; i++) {
			json_t *m = member_json(&v[i]);
			if (m && v[i].is_self) { /* live, not as last published (one tick ago) */
				json_object_set_new(m, "role", json_string(election_role_name(es.role)));
				json_object_set_new(m, "epoch", json_integer((json_int_t)es.epoch));
				json_object_set_new(m, "head", es.has_head ? json_string(head) : json_null());
				json_object_set_new(m, "head_epoch",
						    json_integer((json_int_t)(es.has_head ? es.head_epoch : 0)));
			}
			if (!m || json_array_append_new(members, m) != 0) {
				json_decref(members);
				members = NULL;
			}
		}
	} else if (members) { /* single node: itself */
		json_t *m = json_pack("{s:s,s:s,s:n,s:n,s:s,s:s,s:I,s:s,s:I,s:b,s:i,s:b}", "id",
				      c->self_hex, "name", c->p.node_name, "addr", "port", "state",
				      "alive", "role", election_role_name(es.role), "epoch",
				      (json_int_t)es.epoch, "head", c->self_hex, "head_epoch",
				      (json_int_t)es.head_epoch, "eligible", c->p.eligible, "priority",
				      c->p.priority, "self", 1);
		if (!m || json_array_append_new(members, m) != 0) {
			json_decref(members);
			members = NULL;
		}
	}
	store_election *rows = NULL;
	size_t nrows = 0;
	json_t *hist = json_array();
	if (store_election_list(c->st, HISTORY_SHOWN, &rows, &nrows, NULL) == DS_OK) {
		for (size_t i = 0; hist && i < nrows; i++) {
			store_election *r = &rows[i];
			char hn[GOSSIP_NAME_MAX + 1] = "", cn[GOSSIP_NAME_MAX + 1] = "";
			uint8_t idb[GOSSIP_ID_LEN];
			if (r->head[0] && election_id_parse(r->head, idb) == DS_OK)
				id_name(c, v, nv, idb, hn, sizeof hn);
			if (r->candidate[0] && election_id_parse(r->candidate, idb) == DS_OK)
				id_name(c, v, nv, idb, cn, sizeof cn);
			json_t *o = json_pack(
				"{s:I,s:o,s:o,s:o,s:o,s:o,s:o,s:s,s:I,s:o}", "epoch",
				(json_int_t)r->epoch, "head", str_or_null(r->head), "head_name",
				str_or_null(hn), "candidate", str_or_null(r->candidate),
				"candidate_name", str_or_null(cn), "votes",
				r->votes >= 0 ? json_integer(r->votes) : json_null(), "quorum",
				r->quorum >= 0 ? json_integer(r->quorum) : json_null(), "outcome",
				r->outcome, "ts", (json_int_t)r->ts, "decided", opt_time(r->decided));
			if (!o || json_array_append_new(hist, o) != 0) {
				json_decref(hist);
				hist = NULL;
			}
		}
	}
	free(rows);
	json_t *o = json_pack(
		"{s:{s:s,s:s},s:s,s:I,s:b,s:o,s:I,s:I,s:i,s:i,s:i,s:i,s:b,s:b,s:b,s:i,s:o,s:o,"
		"s:o,s:o}",
		"self", "id", c->self_hex, "name", c->p.node_name, "role",
		election_role_name(es.role), "epoch", (json_int_t)es.epoch, "has_head", es.has_head,
		"head",
		es.has_head ? json_pack("{s:s,s:s}", "id", head, "name", hname) : json_null(),
		"head_epoch", (json_int_t)es.head_epoch, "lease_left_ms",
		(json_int_t)es.lease_left_ms, "expect", es.expect, "quorum", es.quorum, "alive",
		es.alive, "known", es.known, "formed", es.formed, "single", es.single, "eligible",
		es.eligible, "priority", es.priority, "voted",
		es.voted_epoch ? json_pack("{s:I,s:s}", "epoch", (json_int_t)es.voted_epoch,
					   "candidate", voted)
			       : json_null(),
		"why", es.has_head ? json_null() : json_string(es.why), "members",
		members ? members : json_null(), "elections", hist ? hist : json_null());
	free(v);
	return o;
}

/* The answer from this node's own view: itself in full, the others from
 * gossip (no inventory); stale with a reason. */
static json_t *local_nodes(cluster *c, const char *reason)
{
	size_t nv = 0;
	gossip_member *v = view_copy(c, &nv);
	json_t **items = calloc(nv + 1, sizeof *items);
	size_t k = 0;
	election_status es;
	election_status_get(c->el, cluster_now_ms(), &es);
	if (!items) {
		free(v);
		return NULL;
	}
	store_node self;
	self_node(c, &self, cluster_now_ms());
	pthread_mutex_lock(&c->mu);
	json_t *inv = c->inv ? json_deep_copy(c->inv) : NULL;
	ds_strlcpy(self.digest, c->digest, sizeof self.digest);
	self.inventory_at = self.health_at = c->inv_unix;
	pthread_mutex_unlock(&c->mu);
	items[k] = node_json(&self, inv, 1);
	if (items[k])
		k++;
	for (size_t i = 0; i < nv; i++) {
		if (v[i].is_self)
			continue;
		gossip_meta md;
		store_node n;
		meta_of(&v[i], &md);
		member_node(&v[i], &md, &n);
		if (!zero_bytes(md.inventory, sizeof md.inventory))
			ds_hex_encode(md.inventory, sizeof md.inventory, n.digest);
		if ((items[k] = node_json(&n, NULL, 0)))
			k++;
	}
	free(v);
	json_t *nodes = sorted_array(items, k);
	free(items);
	char head[GOSSIP_ID_HEX];
	gossip_id_hex(es.head, head);
	return json_pack("{s:I,s:o,s:s,s:b,s:s,s:s,s:o}", "epoch", (json_int_t)es.epoch, "head",
			 es.has_head ? json_pack("{s:s}", "id", head) : json_null(), "source",
			 "local", "stale", 1, "reason", reason, "answered_by", c->p.node_name,
			 "nodes", nodes ? nodes : json_null());
}

/* The head's answer from its record, with liveness from the gossip view. */
static json_t *record_nodes(cluster *c, ds_err *err)
{
	store_node *rows = NULL;
	size_t nrows = 0, nv = 0;
	if (store_node_list(c->st, &rows, &nrows, err) != DS_OK)
		return NULL;
	gossip_member *v = view_copy(c, &nv);
	json_t **items = calloc(nrows + nv + 1, sizeof *items);
	size_t k = 0;
	int64_t now = cluster_now_ms();
	election_status es;
	election_status_get(c->el, now, &es);
	if (!items)
		goto out;
	for (size_t i = 0; i < nrows; i++) {
		store_node *n = &rows[i];
		uint8_t id[GOSSIP_ID_LEN];
		int self = strcmp(n->id, c->self_hex) == 0;
		const gossip_member *m = NULL;
		if (election_id_parse(n->id, id) == DS_OK)
			m = find_member(v, nv, id);
		if (self) {
			store_node live;
			self_node(c, &live, now);
			ds_strlcpy(n->status, live.status, sizeof n->status);
			ds_strlcpy(n->role, live.role, sizeof n->role);
			n->epoch = live.epoch;
			n->last_seen = live.last_seen;
			n->control_port = live.control_port;
			n->api_port = live.api_port;
		} else if (m) {
			gossip_meta md;
			store_node live;
			meta_of(m, &md);
			member_node(m, &md, &live);
			ds_strlcpy(n->status, live.status, sizeof n->status);
			ds_strlcpy(n->role, live.role, sizeof n->role);
			ds_strlcpy(n->addr, live.addr, sizeof n->addr);
			n->epoch = live.epoch;
			n->last_seen = live.last_seen;
		}
		json_t *inv = n->inventory ? jsonx_parse(n->inventory, strlen(n->inventory), 32, NULL)
					   : NULL;
		if ((items[k] = node_json(n, inv, self)))
			k++;
	}
	for (size_t i = 0; i < nv; i++) { /* members the record does not hold yet */
		char id[GOSSIP_ID_HEX];
		gossip_id_hex(v[i].id, id);
		int known = 0;
		for (size_t j = 0; j < nrows && !known; j++)
			known = strcmp(rows[j].id, id) == 0;
		if (known)
			continue;
		gossip_meta md;
		store_node n;
		meta_of(&v[i], &md);
		member_node(&v[i], &md, &n);
		if ((items[k] = node_json(&n, NULL, v[i].is_self)))
			k++;
	}
out:;
	json_t *nodes = items ? sorted_array(items, k) : NULL;
	free(items);
	store_nodes_free(rows, nrows);
	free(v);
	char head[GOSSIP_ID_HEX];
	gossip_id_hex(c->self_id, head);
	json_t *o = json_pack("{s:I,s:{s:s,s:s},s:s,s:b,s:s,s:o}", "epoch",
			      (json_int_t)es.head_epoch, "head", "id", head, "name",
			      c->p.node_name, "source", "head", "stale", 0, "answered_by",
			      c->p.node_name, "nodes", nodes ? nodes : json_null());
	if (!o)
		ds_err_set(err, DS_ENOMEM, "out of memory");
	return o;
}

/* METHOD path (with body) at the head, whose answer must be a JSON object
 * with "source": "head"; it gets "via": this node.  NULL with why in reason
 * when the head is not known, not reachable or answered something else
 * (status: its HTTP status, 0 when none came; the answer's error message
 * joins the reason; *answer, when answer is not NULL, gets that answer if it
 * was a JSON object). */
static json_t *forward_call(cluster *c, const election_status *es, const char *method,
			    const char *path, const char *body, size_t body_len, size_t max,
			    int *status, json_t **answer, char *reason, size_t rsize)
{
	size_t nv = 0;
	gossip_member *v = view_copy(c, &nv);
	const gossip_member *h = find_member(v, nv, es->head);
	gossip_meta md;
	rpc_call call;
	json_t *out = NULL;
	*status = 0;
	if (answer)
		*answer = NULL;
	memset(&call, 0, sizeof call);
	buf_init(&call.resp, 0);
	if (!h || !meta_of(h, &md) || !md.control_port) {
		snprintf(reason, rsize, "the head is not in this node's member list or has no control "
			 "port");
	} else if (dropped_name(c, h->name)) {
		snprintf(reason, rsize, "head %s unreachable: dropped (test)", h->name);
	} else if (rpc_call_init(&call, h->addr, md.control_port, method, path, body, body_len) !=
		   DS_OK) {
		snprintf(reason, rsize, "head %s: %s", h->name, call.err);
	} else {
		rpc_run(&call, 1, c->auth, FORWARD_TIMEOUT_MS, max);
		*status = call.rc == DS_OK ? call.status : 0;
		json_t *doc = call.rc == DS_OK ? jsonx_parse(call.resp.data, call.resp.len, 32, NULL)
					       : NULL;
		const char *src = json_string_value(json_object_get(doc, "source"));
		if (call.status == 200 && json_is_object(doc) && src && strcmp(src, "head") == 0) {
			json_object_set_new(doc, "via", json_string(c->p.node_name));
			out = doc;
			doc = NULL;
		} else if (call.rc != DS_OK) {
			snprintf(reason, rsize, "head %s unreachable: %s", h->name, call.err);
		} else {
			const char *msg = json_string_value(
				json_object_get(json_object_get(doc, "error"), "message"));
			snprintf(reason, rsize, "head %s answered %d%s%s", h->name, call.status,
				 msg ? ": " : " without its record", msg ? msg : "");
			if (answer && json_is_object(doc)) {
				json_object_set_new(doc, "via", json_string(c->p.node_name));
				*answer = doc;
				doc = NULL;
			}
		}
		json_decref(doc);
	}
	rpc_call_free(&call);
	free(v);
	return out;
}

int cluster_is_head(cluster *c, uint64_t *epoch)
{
	election_status es;
	election_status_get(c->el, cluster_now_ms(), &es);
	if (epoch)
		*epoch = es.head_epoch;
	return es.has_head && es.role == GOSSIP_ROLE_HEAD;
}

/* One signed call to member m's control API. */
static int member_call(cluster *c, const gossip_member *m, const char *method, const char *path,
		       const char *body, size_t len, int timeout_ms, int *status, json_t **answer,
		       ds_err *err)
{
	gossip_meta md;
	rpc_call call;
	int rc = DS_OK;
	*status = 0;
	*answer = NULL;
	memset(&call, 0, sizeof call);
	buf_init(&call.resp, 0);
	if (!meta_of(m, &md) || !md.control_port)
		rc = ds_err_set(err, DS_ENOTFOUND, "node %s has no control port in its metadata",
				m->name);
	else if (dropped_name(c, m->name))
		rc = ds_err_set(err, DS_EIO, "node %s unreachable: dropped (test)", m->name);
	else if (rpc_call_init(&call, m->addr, md.control_port, method, path, body, len) != DS_OK)
		rc = ds_err_set(err, DS_EINVAL, "node %s: %s", m->name, call.err);
	if (rc == DS_OK) {
		rpc_run(&call, 1, c->auth, timeout_ms, NODES_MAX);
		if (call.rc != DS_OK) {
			rc = ds_err_set(err, call.rc == DS_ETIMEOUT ? DS_ETIMEOUT : DS_EIO,
					"node %s (%s:%d) unreachable: %s", m->name, m->addr,
					md.control_port, call.err);
		} else {
			*status = call.status;
			json_t *doc = jsonx_parse(call.resp.data, call.resp.len, 32, NULL);
			if (json_is_object(doc))
				*answer = doc;
			else
				json_decref(doc);
		}
	}
	rpc_call_free(&call);
	return rc;
}

int cluster_node_call(cluster *c, const char *node_id, const char *method, const char *path,
		      const char *body, size_t len, int timeout_ms, int *status, json_t **answer,
		      ds_err *err)
{
	size_t nv = 0;
	gossip_member *v = view_copy(c, &nv);
	const gossip_member *m = NULL;
	char hex[GOSSIP_ID_HEX];
	for (size_t i = 0; i < nv && !m; i++) {
		gossip_id_hex(v[i].id, hex);
		if (strcmp(hex, node_id) == 0)
			m = &v[i];
	}
	int rc = m ? member_call(c, m, method, path, body, len, timeout_ms, status, answer, err)
		   : ds_err_set(err, DS_ENOTFOUND, "node %.32s is not in this node's member list",
				node_id);
	free(v);
	return rc;
}

int cluster_head_call(cluster *c, const char *method, const char *path, const char *body,
		      size_t len, int timeout_ms, int *status, json_t **answer, ds_err *err)
{
	election_status es;
	election_status_get(c->el, cluster_now_ms(), &es);
	*status = 0;
	*answer = NULL;
	if (!es.has_head)
		return ds_err_set(err, DS_EBUSY, "no head: %s", es.why);
	char hex[GOSSIP_ID_HEX];
	gossip_id_hex(es.head, hex);
	int rc = cluster_node_call(c, hex, method, path, body, len, timeout_ms, status, answer, err);
	return rc == DS_OK ? DS_OK : (ds_err_wrap(err, "the head"), DS_EBUSY);
}

static json_t *forward_get(cluster *c, const election_status *es, const char *path, size_t max,
			   int *status, char *reason, size_t rsize)
{
	return forward_call(c, es, "GET", path, NULL, 0, max, status, NULL, reason, rsize);
}

int cluster_nodes_json(cluster *c, int forward, json_t **out, ds_err *err)
{
	election_status es;
	char reason[512];
	*out = NULL;
	election_status_get(c->el, cluster_now_ms(), &es);
	if (es.has_head && es.role == GOSSIP_ROLE_HEAD) {
		*out = record_nodes(c, err);
		return *out ? DS_OK : (err && err->code ? err->code : DS_ENOMEM);
	}
	if (!es.has_head) {
		snprintf(reason, sizeof reason, "no head: %s", es.why);
	} else if (!forward) {
		snprintf(reason, sizeof reason, "asked by a peer: answered locally (no forwarding)");
	} else {
		int status;
		*out = forward_get(c, &es, "/v1/cluster/nodes", NODES_MAX, &status, reason,
				   sizeof reason);
		if (*out)
			return DS_OK;
	}
	*out = local_nodes(c, reason);
	return *out ? DS_OK : ds_err_set(err, DS_ENOMEM, "out of memory");
}

/* ---- the shard plan (store_plan_*; docs/cluster.md "Shard plans in SQLite") ---- */

/* A JSON text column as a value (null when it does not parse). */
static json_t *json_col(const char *text)
{
	json_t *j = text ? jsonx_parse(text, strlen(text), 64, NULL) : NULL;
	return j ? j : json_null();
}

static json_t *known_int(int64_t v)
{
	return v >= 0 ? json_integer((json_int_t)v) : json_null();
}

/* The plan as `GET /v1/cluster/plan` answers it: the plans row, "ranks"
 * (plan_ranks rows) and "comm_groups", each column under its own name. */
static json_t *plan_json(const store_plan *p)
{
	json_t *ranks = json_array(), *groups = json_array();
	for (int r = 0; r < p->world_size; r++) {
		const store_plan_rank *k = &p->ranks[r];
		json_array_append_new(
			ranks, json_pack("{s:i,s:s,s:s?,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:o,s:o,s:o}",
					 "rank", k->rank, "node_id", k->node_id, "node_name",
					 k->node_name[0] ? k->node_name : NULL, "device", k->device,
					 "stage", k->stage, "tp_rank", k->tp_rank, "ep_rank",
					 k->ep_rank, "layer_first", k->layer_first, "layer_count",
					 k->layer_count, "expert_first", k->expert_first,
					 "expert_count", k->expert_count, "weight_bytes",
					 known_int(k->weight_bytes), "kv_bytes", known_int(k->kv_bytes),
					 "env", json_col(k->env)));
	}
	for (size_t i = 0; i < p->n_groups; i++)
		json_array_append_new(groups, json_pack("{s:s,s:o}", "name", p->groups[i].name,
							"ranks", json_col(p->groups[i].ranks)));
	return json_pack("{s:I,s:I,s:I,s:s?,s:s,s:i,s:i,s:i,s:i,s:o,s:o,s:s,s:I,s:s?,s:o,s:o,s:o}",
			 "version", (json_int_t)p->id, "epoch", (json_int_t)p->epoch, "created",
			 (json_int_t)p->created, "head_id", p->head_id[0] ? p->head_id : NULL,
			 "model", p->model, "tp", p->tp, "pp", p->pp, "ep", p->ep, "world_size",
			 p->world_size, "max_ctx", known_int(p->max_ctx), "max_seqs",
			 known_int(p->max_seqs), "status", p->status, "status_at",
			 (json_int_t)p->status_at, "reason", p->reason[0] ? p->reason : NULL,
			 "document", json_col(p->document), "ranks", ranks, "comm_groups", groups);
}

int cluster_fence(cluster *c, uint64_t epoch, ds_err *err)
{
	return election_fence(c->el, epoch, cluster_now_ms(), err);
}

int cluster_plan_json(cluster *c, int forward, json_t **out, ds_err *err)
{
	election_status es;
	char reason[512];
	*out = NULL;
	election_status_get(c->el, cluster_now_ms(), &es);
	if (es.has_head && es.role == GOSSIP_ROLE_HEAD) {
		store_plan p;
		int rc = store_plan_get(c->st, 0, &p, err);
		if (rc)
			return rc;
		json_t *doc = plan_json(&p);
		store_plan_free(&p);
		if (doc && json_object_set_new(doc, "source", json_string("head")) == 0 &&
		    json_object_set_new(doc, "answered_by", json_string(c->p.node_name)) == 0) {
			*out = doc;
			return DS_OK;
		}
		json_decref(doc);
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	}
	if (!es.has_head)
		return ds_err_set(err, DS_EBUSY, "no head: %s", es.why);
	if (!forward)
		return ds_err_set(err, DS_EBUSY, "asked by a peer: only the head answers with the plan");
	int status;
	*out = forward_get(c, &es, "/v1/cluster/plan", NODES_MAX, &status, reason, sizeof reason);
	if (*out)
		return DS_OK;
	return ds_err_set(err, status == 404 ? DS_ENOTFOUND : DS_EBUSY, "%s", reason);
}

/* A range [a, b) of the planner's JSON: first and count. */
static void plan_range(const json_t *r, int *first, int *count)
{
	*first = (int)json_integer_value(json_array_get(r, 0));
	*count = (int)json_integer_value(json_array_get(r, 1)) - *first;
}

/* The store rows of a planner document (agent/plan/plan.h, plan_to_json)
 * whose node i is ids[i] / names[i].  Strings point into doc or are
 * malloc'd into *texts (freed by the caller with free(), *n_texts of them). */
static int plan_rows(const json_t *doc, char (*ids)[STORE_ID_HEX], char (*names)[STORE_NAME_MAX + 1],
		     int n_nodes, store_plan *p, char ***texts, size_t *n_texts, ds_err *err)
{
	const json_t *ranks = json_object_get(doc, "ranks"), *nodes = json_object_get(doc, "nodes");
	const json_t *groups = json_object_get(doc, "groups");
	int W = (int)json_integer_value(json_object_get(doc, "world"));
	size_t n_groups = 1 + json_array_size(json_object_get(groups, "stages")) +
			  json_array_size(json_object_get(groups, "tp"));
	if (W < 1 || json_array_size(ranks) != (size_t)W)
		return ds_err_set(err, DS_EINTERNAL, "the planner's document has %zu ranks for a world "
				  "of %d", json_array_size(ranks), W);
	p->ranks = calloc((size_t)W, sizeof *p->ranks);
	p->groups = calloc(n_groups, sizeof *p->groups);
	*texts = calloc((size_t)W + n_groups, sizeof **texts);
	*n_texts = 0;
	if (!p->ranks || !p->groups || !*texts)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	for (int r = 0; r < W; r++) {
		const json_t *k = json_array_get(ranks, (size_t)r);
		store_plan_rank *q = &p->ranks[r];
		int node = (int)json_integer_value(json_object_get(k, "node"));
		if (node < 0 || node >= n_nodes)
			return ds_err_set(err, DS_EINTERNAL, "the planner put rank %d on node %d of %d", r,
					  node, n_nodes);
		const json_t *mem = json_object_get(k, "memory");
		q->rank = r;
		ds_strlcpy(q->node_id, ids[node], sizeof q->node_id);
		ds_strlcpy(q->node_name, names[node], sizeof q->node_name);
		const json_t *nd = json_array_get(nodes, (size_t)node);
		const char *kind = json_string_value(json_object_get(nd, "kind"));
		/* the table's convention: -1 for a CPU rank (the document keeps its
		 * index on the node) */
		q->device = kind && strcmp(kind, "cpu") == 0
				    ? -1
				    : (int)json_integer_value(json_object_get(k, "device"));
		q->stage = (int)json_integer_value(json_object_get(k, "stage"));
		q->tp_rank = (int)json_integer_value(json_object_get(k, "tp_rank"));
		q->ep_rank = (int)json_integer_value(json_object_get(k, "ep_rank"));
		plan_range(json_object_get(k, "layers"), &q->layer_first, &q->layer_count);
		plan_range(json_object_get(k, "experts"), &q->expert_first, &q->expert_count);
		q->weight_bytes = json_is_integer(json_object_get(mem, "weights"))
					  ? json_integer_value(json_object_get(mem, "weights")) : -1;
		q->kv_bytes = json_is_integer(json_object_get(mem, "kv"))
				      ? json_integer_value(json_object_get(mem, "kv")) : -1;
		const json_t *env = json_object_get(nd, "env");
		char *t = json_dumps(json_is_object(env) ? env : json_object(), JSON_COMPACT);
		if (!t)
			return ds_err_set(err, DS_ENOMEM, "out of memory");
		(*texts)[(*n_texts)++] = t;
		q->env = t;
	}
	/* world, stage<s>, tp<s>.<e>: the names the worker joins (worker/worker.c) */
	size_t g = 0;
	const json_t *lists[3] = {json_object_get(groups, "world"), json_object_get(groups, "stages"),
				  json_object_get(groups, "tp")};
	int epn = (int)json_integer_value(json_object_get(doc, "ep"));
	for (int kind = 0; kind < 3; kind++) {
		size_t n = kind == 0 ? 1 : json_array_size(lists[kind]);
		for (size_t i = 0; i < n; i++, g++) {
			const json_t *members = kind == 0 ? lists[0] : json_array_get(lists[kind], i);
			if (kind == 0)
				ds_strlcpy(p->groups[g].name, "world", sizeof p->groups[g].name);
			else if (kind == 1)
				snprintf(p->groups[g].name, sizeof p->groups[g].name, "stage%zu", i);
			else
				snprintf(p->groups[g].name, sizeof p->groups[g].name, "tp%zu.%zu",
					 i / (size_t)(epn > 0 ? epn : 1), i % (size_t)(epn > 0 ? epn : 1));
			char *t = json_dumps(members, JSON_COMPACT);
			if (!t)
				return ds_err_set(err, DS_ENOMEM, "out of memory");
			(*texts)[(*n_texts)++] = t;
			p->groups[g].ranks = t;
		}
	}
	p->n_groups = g;
	return DS_OK;
}

/* Every alive node of the record with an inventory, the head first, then by
 * name: the planner's node order (rank 0 on the head's first device). */
static int plan_nodes(cluster *c, store_node **rows, size_t *nrows, json_t ***invs,
		      const char ***addrs, char (**ids)[STORE_ID_HEX],
		      char (**names)[STORE_NAME_MAX + 1], int *n, ds_err *err)
{
	*n = 0;
	if (store_node_list(c->st, rows, nrows, err) != DS_OK)
		return err ? err->code : DS_EIO;
	*invs = calloc(*nrows + 1, sizeof **invs);
	*addrs = calloc(*nrows + 1, sizeof **addrs);
	*ids = calloc(*nrows + 1, sizeof **ids);
	*names = calloc(*nrows + 1, sizeof **names);
	if (!*invs || !*addrs || !*ids || !*names)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	for (int pass = 0; pass < 2; pass++) {
		for (size_t i = 0; i < *nrows; i++) {
			store_node *r = &(*rows)[i];
			int self = strcmp(r->id, c->self_hex) == 0;
			if (self != (pass == 0))
				continue;
			if (!self && strcmp(r->status, "alive") != 0)
				continue;
			json_t *inv = r->inventory ? jsonx_parse(r->inventory, strlen(r->inventory), 32,
								  NULL)
						   : NULL;
			if (!json_is_object(inv)) {
				json_decref(inv);
				continue;
			}
			(*invs)[*n] = inv;
			(*addrs)[*n] = r->addr[0] ? r->addr : NULL;
			ds_strlcpy((*ids)[*n], r->id, STORE_ID_HEX);
			ds_strlcpy((*names)[*n], r->name, STORE_NAME_MAX + 1);
			(*n)++;
		}
	}
	if (!*n)
		return ds_err_set(err, DS_ENOTFOUND, "no alive node with an inventory");
	/* every alive member must be in the plan: a new head fetches the
	 * inventories within a second of its election (collect) */
	size_t nv = 0;
	gossip_member *v = view_copy(c, &nv);
	int rc = DS_OK;
	for (size_t i = 0; i < nv && rc == DS_OK; i++) {
		char hex[GOSSIP_ID_HEX];
		int found = 0;
		if (v[i].state != GOSSIP_ALIVE)
			continue;
		gossip_id_hex(v[i].id, hex);
		for (int k = 0; k < *n && !found; k++)
			found = strcmp((*ids)[k], hex) == 0;
		if (!found)
			rc = ds_err_set(err, DS_EBUSY, "the head has no inventory of node %s yet "
					"(it is being fetched): retry shortly", v[i].name);
	}
	free(v);
	return rc;
}

/* The head plans over its record and writes the plan (fenced). */
static int plan_on_head(cluster *c, const election_status *es, const json_t *req, json_t **out,
			ds_err *err)
{
	const char *model = NULL;
	int64_t tp = 0, pp = 0, ep = 0, max_ctx = 0;
	double frac = 0.9;
	if (jsonx_get_str(req, "model", 1, &model, err) ||
	    jsonx_get_i64(req, "tp", 0, 0, 65536, &tp, err) ||
	    jsonx_get_i64(req, "pp", 0, 0, 65536, &pp, err) ||
	    jsonx_get_i64(req, "ep", 0, 0, 65536, &ep, err) ||
	    jsonx_get_i64(req, "max_ctx", 0, 0, 1 << 24, &max_ctx, err) ||
	    jsonx_get_double(req, "mem_fraction", 0, 0.01, 1.0, &frac, err))
		return DS_EINVAL;
	uint64_t epoch = es->head_epoch;
	int rc = election_fence(c->el, epoch, cluster_now_ms(), err);
	if (rc)
		return rc;
	store_node *rows = NULL;
	size_t nrows = 0, n_texts = 0;
	json_t **invs = NULL;
	const char **addrs = NULL;
	char(*ids)[STORE_ID_HEX] = NULL;
	char(*names)[STORE_NAME_MAX + 1] = NULL;
	char **texts = NULL;
	plan *pl = NULL;
	json_t *doc = NULL;
	store_plan sp;
	int n = 0;
	memset(&sp, 0, sizeof sp);
	rc = plan_nodes(c, &rows, &nrows, &invs, &addrs, &ids, &names, &n, err);
	if (rc)
		goto out;
	plan_params pa = plan_default_params();
	pa.inventories = invs;
	pa.addresses = addrs;
	pa.n_nodes = n;
	pa.model_path = model;
	pa.mem_fraction = frac;
	pa.tp = (int)tp;
	pa.pp = (int)pp;
	pa.ep = (int)ep;
	pa.max_ctx = (int)max_ctx;
	rc = plan_make(&pa, &pl, err);
	if (rc)
		goto out;
	doc = plan_to_json(pl);
	if (!doc) {
		rc = ds_err_set(err, DS_ENOMEM, "out of memory");
		goto out;
	}
	for (int i = 0; i < n; i++) { /* which agent each node of the plan is */
		json_t *nd = json_array_get(json_object_get(doc, "nodes"), (size_t)i);
		json_object_set_new(nd, "name", json_string(names[i]));
		json_object_set_new(nd, "node_id", json_string(ids[i]));
	}
	if (!plan_fits(pl)) {
		rc = ds_err_set(err, DS_ERANGE, "the model does not fit these nodes (see shortfall)");
		goto out;
	}
	rc = plan_rows(doc, ids, names, n, &sp, &texts, &n_texts, err);
	if (rc)
		goto out;
	char *doc_text = json_dumps(doc, JSON_COMPACT);
	sp.epoch = (int64_t)epoch;
	sp.created = unix_now();
	ds_strlcpy(sp.head_id, c->self_hex, sizeof sp.head_id);
	sp.model = (char *)model;
	sp.tp = (int)json_integer_value(json_object_get(doc, "tp"));
	sp.pp = (int)json_integer_value(json_object_get(doc, "pp"));
	sp.ep = (int)json_integer_value(json_object_get(doc, "ep"));
	sp.world_size = sp.tp * sp.pp * sp.ep;
	const json_t *kv = json_object_get(doc, "kv");
	sp.max_ctx = (int)json_integer_value(json_object_get(kv, "max_ctx"));
	sp.max_seqs = (int)json_integer_value(json_object_get(kv, "concurrency"));
	ds_strlcpy(sp.status, "planned", sizeof sp.status);
	sp.document = doc_text;
	rc = doc_text ? store_plan_insert(c->st, &sp, err) : ds_err_set(err, DS_ENOMEM, "out of memory");
	free(doc_text);
	if (rc == DS_OK)
		json_object_set_new(doc, "version", json_integer((json_int_t)sp.id));
out:
	if (doc) {
		json_object_set_new(doc, "source", json_string("head"));
		json_object_set_new(doc, "answered_by", json_string(c->p.node_name));
		json_object_set_new(doc, "epoch", json_integer((json_int_t)epoch));
	}
	*out = doc;
	for (size_t i = 0; texts && i < n_texts; i++)
		free(texts[i]);
	free(texts);
	free(sp.ranks);
	free(sp.groups);
	plan_free(pl);
	for (int i = 0; invs && i < n; i++)
		json_decref(invs[i]);
	free(invs);
	free(addrs);
	free(ids);
	free(names);
	store_nodes_free(rows, nrows);
	return rc;
}

int cluster_plan_post(cluster *c, int forward, const char *body, size_t len, json_t **out,
		      ds_err *err)
{
	election_status es;
	char reason[512];
	*out = NULL;
	election_status_get(c->el, cluster_now_ms(), &es);
	if (es.has_head && es.role == GOSSIP_ROLE_HEAD) {
		json_t *req = jsonx_parse(body, len, 8, err);
		if (!json_is_object(req)) {
			json_decref(req);
			return ds_err_set(err, DS_EINVAL, "the body is not a JSON object");
		}
		int rc = plan_on_head(c, &es, req, out, err);
		json_decref(req);
		return rc;
	}
	if (!es.has_head)
		return ds_err_set(err, DS_EBUSY, "no head: %s", es.why);
	if (!forward)
		return ds_err_set(err, DS_EBUSY, "asked by a peer: only the head plans");
	int status;
	json_t *answer = NULL;
	*out = forward_call(c, &es, "POST", "/v1/cluster/plan", body, len, NODES_MAX, &status,
			    &answer, reason, sizeof reason);
	if (*out)
		return DS_OK;
	*out = answer; /* the head's refusal, passed on with its status */
	if (status == 400)
		return ds_err_set(err, DS_EINVAL, "%s", reason);
	if (status == 422)
		return ds_err_set(err, DS_ERANGE, "%s", reason);
	if (status == 404)
		return ds_err_set(err, DS_ENOTFOUND, "%s", reason);
	return ds_err_set(err, DS_EBUSY, "%s", reason);
}

int cluster_election_post(cluster *c, const char *sender, const char *body, size_t len,
			  json_t **reply, ds_err *err)
{
	election_msg m;
	election_reply r;
	char from[GOSSIP_ID_HEX];
	*reply = NULL;
	json_t *j = jsonx_parse(body, len, 6, err);
	if (!j) { /* the parser's message, prefixed in place (not printed into itself) */
		if (err)
			err->code = DS_EFORMAT;
		ds_err_wrap(err, "the body is not JSON");
		return DS_EFORMAT;
	}
	int rc = election_msg_parse(j, &m, err);
	json_decref(j);
	if (rc)
		return rc;
	election_id_hex(m.from, from);
	if (strcmp(from, sender) != 0)
		return ds_err_set(err, DS_EPERM, "message from %s signed by %s", from, sender);
	election_handle(c->el, &m, cluster_now_ms(), &r);
	*reply = election_reply_json(&r);
	return *reply ? DS_OK : ds_err_set(err, DS_ENOMEM, "out of memory");
}

int cluster_test_drop(cluster *c, const char *names_csv, ds_err *err)
{
	size_t cap = 1;
	for (const char *p = names_csv ? names_csv : ""; *p; p++)
		cap += *p == ',';
	char(*list)[GOSSIP_NAME_MAX + 1] = calloc(cap, sizeof *list);
	size_t n = 0;
	if (!list)
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	const char *p = names_csv ? names_csv : "";
	while (*p) {
		const char *e = strchr(p, ',');
		size_t l = e ? (size_t)(e - p) : strlen(p);
		if (l == 0 || l > GOSSIP_NAME_MAX) {
			free(list);
			return ds_err_set(err, DS_EINVAL, "bad member name list '%s'", names_csv);
		}
		memcpy(list[n], p, l);
		list[n++][l] = '\0';
		p += l + (e ? 1 : 0);
	}
	pthread_mutex_lock(&c->mu);
	free(c->drop);
	c->drop = list;
	c->n_drop = n;
	pthread_mutex_unlock(&c->mu);
	return DS_OK;
}

int cluster_sender_dropped(cluster *c, const char *sender)
{
	uint8_t id[GOSSIP_ID_LEN];
	size_t nv = 0;
	if (election_id_parse(sender, id) != DS_OK)
		return 0;
	pthread_mutex_lock(&c->mu);
	size_t nd = c->n_drop;
	pthread_mutex_unlock(&c->mu);
	if (!nd)
		return 0;
	gossip_member *v = view_copy(c, &nv);
	const gossip_member *m = find_member(v, nv, id);
	int hit = m && dropped_name(c, m->name);
	free(v);
	return hit;
}
