/*
 * gossip_state.c - the membership table of gossip: members, their states and
 * incarnations, Lifeguard suspicion timers, the broadcast queue and the event
 * queue (gossip_impl.h).  No I/O and no clock of its own: gossip.c calls it
 * with the monotonic time under its lock; the unit tests call it directly.
 *
 * State of one member, as this node sees it (edges name the function):
 *
 *               alive(inc > known)                     tick: suspicion timed out
 *   (new) --alive--> ALIVE --suspect/accuse--> SUSPECT -------------------> DEAD
 *                      ^  <----alive(inc > known)---'                       |  |
 *                      |                                                    |  |
 *                      +--------------alive(inc > known)--------------------+  |
 *                      +--------------alive(inc > known)------------ LEFT <----+-- dead(from == id)
 *                                                                     |
 *   DEAD, LEFT --tick: reap_ms later--> (removed)   <-----------------+
 *
 * Invariants:
 *  1. nodes[0] is this node; it is never suspect or dead here: any such
 *     rumour about it is refuted (incarnation = max(ours, accused) + 1),
 *     unless it is leaving.
 *  2. Only this node raises its own incarnation (refute, set_meta, set_addr).
 *  3. For another member, a message with an incarnation lower than known is
 *     ignored; at equal incarnation suspect beats alive and dead beats both.
 *  4. A suspicion's timer only shrinks, by confirmations from distinct
 *     members other than the first accuser, at most k of them.
 *  5. At most one queued broadcast per member (the newest); the queue, the
 *     event queue and the table are bounded (GOSSIP_*_MAX).
 *
 * Threading: none of its own; the caller serialises every call.
 */
#include "agent/cluster/gossip_impl.h"

#include <arpa/inet.h>
#include <stdlib.h>
#include <string.h>

static double wall_of(const gossip_tab *tab, int64_t now_ms)
{
	return tab->wall_offset_s + (double)now_ms / 1000.0;
}

static int same_id(const uint8_t *a, const uint8_t *b)
{
	return memcmp(a, b, GOSSIP_ID_LEN) == 0;
}

static void emit(gossip_tab *tab, int kind, int prev_state, uint32_t prev_inc,
		 const gossip_node *nd)
{
	if (nd == &tab->nodes[0])
		return; /* the owner knows what it did to itself */
	if (tab->nev == GOSSIP_EVQ_MAX) {
		tab->events_lost++;
		return;
	}
	gossip_event *ev = &tab->evq[tab->nev++];
	ev->kind = kind;
	ev->prev_state = prev_state;
	ev->prev_incarnation = prev_inc;
	ev->member = nd->m;
}

size_t gossip_tab_events_take(gossip_tab *tab, gossip_event **out)
{
	*out = NULL;
	size_t n = tab->nev;
	if (!n)
		return 0;
	*out = malloc(n * sizeof **out);
	if (!*out) {
		tab->events_lost += n;
		tab->nev = 0;
		return 0;
	}
	memcpy(*out, tab->evq, n * sizeof **out);
	tab->nev = 0;
	return n;
}

int gossip_tab_init(gossip_tab *tab, const gossip_timing *t, const gossip_member *self,
		    double wall_offset_s)
{
	memset(tab, 0, sizeof *tab);
	tab->t = *t;
	tab->wall_offset_s = wall_offset_s;
	tab->cap = 16;
	tab->nodes = calloc(tab->cap, sizeof *tab->nodes);
	tab->bq = calloc(GOSSIP_BCAST_MAX, sizeof *tab->bq);
	tab->evq = calloc(GOSSIP_EVQ_MAX, sizeof *tab->evq);
	if (!tab->nodes || !tab->bq || !tab->evq) {
		gossip_tab_free(tab);
		return DS_ENOMEM;
	}
	tab->n = 1;
	tab->nodes[0].m = *self;
	tab->nodes[0].m.is_self = 1;
	tab->nodes[0].m.state = GOSSIP_ALIVE;
	if (tab->nodes[0].m.incarnation == 0)
		tab->nodes[0].m.incarnation = 1;
	return DS_OK;
}

void gossip_tab_free(gossip_tab *tab)
{
	free(tab->nodes);
	free(tab->bq);
	free(tab->evq);
	memset(tab, 0, sizeof *tab);
}

gossip_node *gossip_tab_find(gossip_tab *tab, const uint8_t id[GOSSIP_ID_LEN])
{
	for (size_t i = 0; i < tab->n; i++)
		if (same_id(tab->nodes[i].m.id, id))
			return &tab->nodes[i];
	return NULL;
}

int gossip_tab_live_count(const gossip_tab *tab)
{
	int c = 0;
	for (size_t i = 0; i < tab->n; i++)
		c += tab->nodes[i].m.state == GOSSIP_ALIVE || tab->nodes[i].m.state == GOSSIP_SUSPECT;
	return c;
}

void gossip_tab_awareness(gossip_tab *tab, int delta)
{
	int v = tab->awareness + delta;
	int max = tab->t.awareness_max > 0 ? tab->t.awareness_max - 1 : 0;
	tab->awareness = v < 0 ? 0 : v > max ? max : v;
}

/* ---- broadcasts ---- */

void gossip_tab_bcast(gossip_tab *tab, const uint8_t about[GOSSIP_ID_LEN], const gossip_msg *m)
{
	uint8_t tmp[GOSSIP_MSG_MAX];
	size_t len = 0;
	if (gossip_msg_put(tmp, sizeof tmp, &len, m) != DS_OK)
		return; /* cannot happen for messages built from the table */
	gossip_bcast *slot = NULL;
	for (size_t i = 0; i < tab->nb; i++)
		if (same_id(tab->bq[i].about, about)) {
			slot = &tab->bq[i];
			break;
		}
	if (!slot && tab->nb < GOSSIP_BCAST_MAX)
		slot = &tab->bq[tab->nb++];
	if (!slot) { /* full: replace the most transmitted, oldest first */
		slot = &tab->bq[0];
		for (size_t i = 1; i < tab->nb; i++) {
			gossip_bcast *b = &tab->bq[i];
			if (b->transmits > slot->transmits ||
			    (b->transmits == slot->transmits && b->order < slot->order))
				slot = b;
		}
	}
	memcpy(slot->about, about, GOSSIP_ID_LEN);
	memcpy(slot->msg, tmp, len);
	slot->len = (uint16_t)len;
	slot->transmits = 0;
	slot->order = ++tab->bcast_order;
}

int gossip_tab_bcast_fill(gossip_tab *tab, uint8_t *buf, size_t cap, size_t *len)
{
	int limit = gossip_retransmit_limit(tab->t.retransmit_mult, gossip_tab_live_count(tab));
	int added = 0;
	/* Selection by repeated minimum: the queue is short in practice, and a
	 * packet holds few broadcasts. */
	uint64_t used_mark = tab->bcast_order + 1;
	uint64_t *saved = NULL;
	if (tab->nb == 0)
		return 0;
	saved = malloc(tab->nb * sizeof *saved);
	if (!saved)
		return 0;
	for (size_t i = 0; i < tab->nb; i++)
		saved[i] = 0;
	for (;;) {
		gossip_bcast *best = NULL;
		size_t bi = 0;
		for (size_t i = 0; i < tab->nb; i++) {
			gossip_bcast *b = &tab->bq[i];
			if (saved[i] == used_mark || *len + b->len > cap)
				continue;
			if (!best || b->transmits < best->transmits ||
			    (b->transmits == best->transmits && b->order > best->order)) {
				best = b;
				bi = i;
			}
		}
		if (!best)
			break;
		memcpy(buf + *len, best->msg, best->len);
		*len += best->len;
		best->transmits++;
		saved[bi] = used_mark;
		added++;
	}
	free(saved);
	for (size_t i = 0; i < tab->nb;) {
		if (tab->bq[i].transmits >= limit)
			tab->bq[i] = tab->bq[--tab->nb];
		else
			i++;
	}
	return added;
}

void gossip_tab_msg_alive(const gossip_node *nd, gossip_msg *m)
{
	memset(m, 0, sizeof *m);
	m->type = GOSSIP_MSG_ALIVE;
	memcpy(m->id, nd->m.id, GOSSIP_ID_LEN);
	m->incarnation = nd->m.incarnation;
	struct in_addr ia;
	m->ip = inet_pton(AF_INET, nd->m.addr, &ia) == 1 ? ia.s_addr : 0;
	m->port = nd->m.port;
	m->boot = nd->m.boot;
	memcpy(m->name, nd->m.name, sizeof m->name);
	m->meta = nd->m.meta;
	m->meta_len = nd->m.meta_len;
}

static void bcast_alive(gossip_tab *tab, const gossip_node *nd)
{
	gossip_msg m;
	gossip_tab_msg_alive(nd, &m);
	gossip_tab_bcast(tab, nd->m.id, &m);
}

static void bcast_accusation(gossip_tab *tab, int type, const uint8_t id[GOSSIP_ID_LEN],
			     uint32_t inc, const uint8_t from[GOSSIP_ID_LEN])
{
	gossip_msg m;
	memset(&m, 0, sizeof m);
	m.type = type;
	memcpy(m.id, id, GOSSIP_ID_LEN);
	m.incarnation = inc;
	memcpy(m.from, from, GOSSIP_ID_LEN);
	gossip_tab_bcast(tab, id, &m);
}

/* ---- the rules ---- */

static void refute(gossip_tab *tab, uint32_t accused, int64_t now_ms)
{
	gossip_node *self = &tab->nodes[0];
	uint32_t inc = self->m.incarnation > accused ? self->m.incarnation : accused;
	self->m.incarnation = inc + 1;
	gossip_tab_awareness(tab, 1);
	bcast_alive(tab, self);
}

static void node_fill(gossip_node *nd, const gossip_msg *a)
{
	struct in_addr ia = {.s_addr = a->ip};
	memcpy(nd->m.id, a->id, GOSSIP_ID_LEN);
	memcpy(nd->m.name, a->name, sizeof nd->m.name);
	inet_ntop(AF_INET, &ia, nd->m.addr, sizeof nd->m.addr);
	nd->m.port = a->port;
	nd->m.boot = a->boot;
	nd->m.incarnation = a->incarnation;
	nd->m.meta_len = a->meta_len;
	if (a->meta_len)
		memcpy(nd->m.meta, a->meta, a->meta_len);
}

/* 1 when a describes nd's name, address and metadata exactly. */
static int same_content(const gossip_node *nd, const gossip_msg *a)
{
	struct in_addr ia = {.s_addr = a->ip};
	char addr[16];
	inet_ntop(AF_INET, &ia, addr, sizeof addr);
	return strcmp(nd->m.name, a->name) == 0 && strcmp(nd->m.addr, addr) == 0 &&
	       nd->m.port == a->port && nd->m.meta_len == a->meta_len &&
	       (!a->meta_len || memcmp(nd->m.meta, a->meta, a->meta_len) == 0);
}

static void set_state(gossip_tab *tab, gossip_node *nd, int state, int64_t now_ms)
{
	nd->m.state = state;
	nd->changed_ms = now_ms;
	nd->m.changed_s = wall_of(tab, now_ms);
}

void gossip_tab_alive(gossip_tab *tab, const gossip_msg *a, int64_t now_ms)
{
	gossip_node *nd = gossip_tab_find(tab, a->id);
	if (nd == &tab->nodes[0]) {
		if (tab->leaving || a->incarnation < nd->m.incarnation)
			return;
		if (a->incarnation == nd->m.incarnation && a->boot == nd->m.boot &&
		    same_content(nd, a))
			return; /* our own alive coming back */
		refute(tab, a->incarnation, now_ms); /* an older process, or a forgery */
		return;
	}
	if (!nd) {
		if (tab->n == GOSSIP_MAX_MEMBERS) {
			tab->table_full++;
			return;
		}
		if (tab->n == tab->cap) {
			size_t nc = tab->cap * 2;
			gossip_node *nn = realloc(tab->nodes, nc * sizeof *nn);
			if (!nn) {
				tab->table_full++;
				return;
			}
			tab->nodes = nn;
			tab->cap = nc;
		}
		nd = &tab->nodes[tab->n++];
		memset(nd, 0, sizeof *nd);
		node_fill(nd, a);
		set_state(tab, nd, GOSSIP_ALIVE, now_ms);
		emit(tab, GOSSIP_EV_JOIN, -1, 0, nd);
		if (!tab->quiet)
			bcast_alive(tab, nd);
		return;
	}
	if (a->incarnation <= nd->m.incarnation)
		return;
	int prev = nd->m.state;
	uint32_t prev_inc = nd->m.incarnation;
	int changed = !same_content(nd, a);
	int restarted = nd->m.boot != a->boot;
	node_fill(nd, a);
	if (prev != GOSSIP_ALIVE) {
		set_state(tab, nd, GOSSIP_ALIVE, now_ms);
		emit(tab, GOSSIP_EV_ALIVE, prev, prev_inc, nd);
	}
	if (restarted)
		emit(tab, GOSSIP_EV_RESTART, prev, prev_inc, nd);
	if (changed)
		emit(tab, GOSSIP_EV_META, prev, prev_inc, nd);
	if (!tab->quiet)
		bcast_alive(tab, nd);
}

/* A confirmation from `from`: 1 when it counted (new, independent). */
static int confirm(gossip_node *nd, const uint8_t from[GOSSIP_ID_LEN])
{
	if (nd->n_conf >= nd->susp_k || same_id(from, nd->susp_from))
		return 0;
	for (int i = 0; i < nd->n_conf; i++)
		if (same_id(nd->conf[i], from))
			return 0;
	memcpy(nd->conf[nd->n_conf++], from, GOSSIP_ID_LEN);
	nd->susp_deadline_ms = nd->susp_start_ms + gossip_suspicion_timeout(nd->susp_min_ms,
									    nd->susp_max_ms,
									    nd->susp_k, nd->n_conf);
	return 1;
}

void gossip_tab_suspect(gossip_tab *tab, const gossip_msg *s, int64_t now_ms)
{
	gossip_node *nd = gossip_tab_find(tab, s->id);
	if (!nd || s->incarnation < nd->m.incarnation)
		return;
	if (nd->m.state == GOSSIP_SUSPECT) {
		if (confirm(nd, s->from))
			bcast_accusation(tab, GOSSIP_MSG_SUSPECT, s->id, nd->m.incarnation, s->from);
		return;
	}
	if (nd->m.state != GOSSIP_ALIVE)
		return;
	if (nd == &tab->nodes[0]) {
		if (!tab->leaving)
			refute(tab, s->incarnation, now_ms);
		return;
	}
	int prev = nd->m.state;
	uint32_t prev_inc = nd->m.incarnation;
	nd->m.incarnation = s->incarnation;
	set_state(tab, nd, GOSSIP_SUSPECT, now_ms);
	gossip_suspicion_bounds(&tab->t, gossip_tab_live_count(tab), &nd->susp_min_ms,
				&nd->susp_max_ms, &nd->susp_k);
	nd->susp_start_ms = now_ms;
	nd->n_conf = 0;
	memcpy(nd->susp_from, s->from, GOSSIP_ID_LEN);
	nd->susp_deadline_ms = now_ms + gossip_suspicion_timeout(nd->susp_min_ms, nd->susp_max_ms,
								 nd->susp_k, 0);
	bcast_accusation(tab, GOSSIP_MSG_SUSPECT, s->id, s->incarnation, s->from);
	emit(tab, GOSSIP_EV_SUSPECT, prev, prev_inc, nd);
}

void gossip_tab_dead(gossip_tab *tab, const gossip_msg *d, int64_t now_ms)
{
	gossip_node *nd = gossip_tab_find(tab, d->id);
	if (!nd || d->incarnation < nd->m.incarnation)
		return;
	if (nd->m.state == GOSSIP_DEAD || nd->m.state == GOSSIP_LEFT)
		return;
	if (nd == &tab->nodes[0]) {
		if (!tab->leaving)
			refute(tab, d->incarnation, now_ms);
		return;
	}
	int prev = nd->m.state;
	uint32_t prev_inc = nd->m.incarnation;
	int left = same_id(d->from, d->id);
	nd->m.incarnation = d->incarnation;
	nd->n_conf = 0;
	set_state(tab, nd, left ? GOSSIP_LEFT : GOSSIP_DEAD, now_ms);
	bcast_accusation(tab, GOSSIP_MSG_DEAD, d->id, d->incarnation, d->from);
	emit(tab, left ? GOSSIP_EV_LEFT : GOSSIP_EV_DEAD, prev, prev_inc, nd);
}

void gossip_tab_merge(gossip_tab *tab, const gossip_msg *st, const uint8_t from[GOSSIP_ID_LEN],
		      int64_t now_ms)
{
	gossip_msg m = *st;
	switch (st->state) {
	case GOSSIP_ALIVE:
		m.type = GOSSIP_MSG_ALIVE;
		gossip_tab_alive(tab, &m, now_ms);
		break;
	case GOSSIP_LEFT:
		m.type = GOSSIP_MSG_DEAD;
		memcpy(m.from, st->id, GOSSIP_ID_LEN);
		gossip_tab_dead(tab, &m, now_ms);
		break;
	default: /* suspect or dead elsewhere: we only suspect */
		m.type = GOSSIP_MSG_SUSPECT;
		memcpy(m.from, from, GOSSIP_ID_LEN);
		gossip_tab_suspect(tab, &m, now_ms);
		break;
	}
}

void gossip_tab_accuse(gossip_tab *tab, const uint8_t id[GOSSIP_ID_LEN], int64_t now_ms)
{
	gossip_node *nd = gossip_tab_find(tab, id);
	if (!nd || nd == &tab->nodes[0])
		return;
	gossip_msg s;
	memset(&s, 0, sizeof s);
	s.type = GOSSIP_MSG_SUSPECT;
	memcpy(s.id, id, GOSSIP_ID_LEN);
	s.incarnation = nd->m.incarnation;
	memcpy(s.from, tab->nodes[0].m.id, GOSSIP_ID_LEN);
	gossip_tab_suspect(tab, &s, now_ms);
}

void gossip_tab_set_meta(gossip_tab *tab, const uint8_t *meta, size_t len, int64_t now_ms)
{
	gossip_node *self = &tab->nodes[0];
	if (len > GOSSIP_META_MAX)
		return;
	if (len)
		memcpy(self->m.meta, meta, len);
	self->m.meta_len = len;
	self->m.incarnation++;
	bcast_alive(tab, self);
}

void gossip_tab_set_addr(gossip_tab *tab, uint32_t ip, uint16_t port, int64_t now_ms)
{
	gossip_node *self = &tab->nodes[0];
	struct in_addr ia = {.s_addr = ip};
	inet_ntop(AF_INET, &ia, self->m.addr, sizeof self->m.addr);
	self->m.port = port;
	self->m.incarnation++;
	bcast_alive(tab, self);
}

void gossip_tab_leave(gossip_tab *tab, int64_t now_ms)
{
	gossip_node *self = &tab->nodes[0];
	tab->leaving = 1;
	set_state(tab, self, GOSSIP_LEFT, now_ms);
	bcast_accusation(tab, GOSSIP_MSG_DEAD, self->m.id, self->m.incarnation, self->m.id);
}

int64_t gossip_tab_tick(gossip_tab *tab, int64_t now_ms)
{
	int64_t next = INT64_MAX;
	for (size_t i = 1; i < tab->n; i++) {
		gossip_node *nd = &tab->nodes[i];
		if (nd->m.state == GOSSIP_SUSPECT) {
			if (now_ms >= nd->susp_deadline_ms) {
				gossip_msg d;
				memset(&d, 0, sizeof d);
				d.type = GOSSIP_MSG_DEAD;
				memcpy(d.id, nd->m.id, GOSSIP_ID_LEN);
				d.incarnation = nd->m.incarnation;
				memcpy(d.from, tab->nodes[0].m.id, GOSSIP_ID_LEN);
				gossip_tab_dead(tab, &d, now_ms);
			} else if (nd->susp_deadline_ms < next) {
				next = nd->susp_deadline_ms;
			}
		}
		if (nd->m.state == GOSSIP_DEAD || nd->m.state == GOSSIP_LEFT) {
			int64_t at = nd->changed_ms + tab->t.reap_ms;
			if (now_ms >= at) {
				emit(tab, GOSSIP_EV_REAP, nd->m.state, nd->m.incarnation, nd);
				tab->nodes[i] = tab->nodes[tab->n - 1];
				tab->n--;
				i--;
			} else if (at < next) {
				next = at;
			}
		}
	}
	return next;
}
