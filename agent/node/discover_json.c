/*
 * discover_json.c - the inventory as JSON (the schema of discover.h), its
 * digest (BLAKE2b-256 of the canonical JSON without health, which gossip
 * metadata carries) and `dsagent --discover`'s output.
 *
 * Callers: agent/main.c (disc_print), agent/cluster/cluster.c (disc_to_json,
 * disc_digest), tests.  Calls: disc_run, jansson, libsodium.
 *
 * Invariants: the digest depends only on the inventory without its health
 * fields (keys sorted, compact, ASCII), so health changes do not change it.
 *
 * Threading: pure functions of the inventory.
 */
#include "agent/node/discover_impl.h"
#include "common/hex.h"

#include <errno.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- names ---- */

const char *disc_level_name(disc_level level, int nvlinks, char *buf, size_t size)
{
	switch (level) {
	case DISC_LEVEL_NV:
		snprintf(buf, size, "NV%d", nvlinks);
		return buf;
	case DISC_LEVEL_PIX: return "PIX";
	case DISC_LEVEL_PXB: return "PXB";
	case DISC_LEVEL_PHB: return "PHB";
	case DISC_LEVEL_NODE: return "NODE";
	case DISC_LEVEL_SYS: return "SYS";
	default: return "unknown";
	}
}

static const char *disc_src_name(disc_src src)
{
	switch (src) {
	case DISC_SRC_NVLINK: return "nvlink";
	case DISC_SRC_SYSFS: return "sysfs";
	case DISC_SRC_NVML: return "nvml";
	case DISC_SRC_NUMA: return "numa";
	default: return "none";
	}
}

/* ---- JSON ------------------------------------------------------------------------------------ */

typedef struct jb {
	int bad;
} jb;

static void put(jb *b, json_t *o, const char *k, json_t *v)
{
	if (!v || !o || json_object_set_new(o, k, v) != 0)
		b->bad = 1;
}

static void push(jb *b, json_t *a, json_t *v)
{
	if (!v || !a || json_array_append_new(a, v) != 0)
		b->bad = 1;
}

static json_t *jint(int64_t v)
{
	return v < 0 ? json_null() : json_integer(v);
}

static json_t *jstr(const char *v)
{
	return v && *v ? json_string(v) : json_null();
}

static json_t *jbool3(int v)
{
	return v < 0 ? json_null() : json_boolean(v);
}

static json_t *jnum(double v)
{
	if (v < 0)
		return json_null();
	if (v == (double)(int64_t)v)
		return json_integer((int64_t)v);
	return json_real(v);
}

static json_t *host_json(jb *b, const disc_host *h)
{
	json_t *o = json_object(), *nn = json_array();
	put(b, o, "hostname", jstr(h->hostname));
	put(b, o, "cpu_model", jstr(h->cpu_model));
	put(b, o, "cpus", jint(h->cpus));
	put(b, o, "sockets", jint(h->sockets));
	put(b, o, "memory_bytes", jint(h->memory_bytes));
	for (size_t i = 0; i < h->n_numa; i++) {
		const disc_numa *n = &h->numa[i];
		json_t *e = json_object();
		put(b, e, "id", json_integer(n->id));
		put(b, e, "cpulist", n->cpus >= 0 ? json_string(n->cpulist) : json_null());
		put(b, e, "cpus", jint(n->cpus));
		put(b, e, "memory_bytes", jint(n->memory_bytes));
		push(b, nn, e);
	}
	put(b, o, "numa_nodes", nn);
	return o;
}

static json_t *health_json(jb *b, const disc_gpu_health *h)
{
	json_t *o = json_object();
	put(b, o, "temperature_c", jint(h->temperature_c));
	put(b, o, "power_mw", jint(h->power_mw));
	put(b, o, "memory_used_bytes", jint(h->memory_used_bytes));
	put(b, o, "ecc_uncorrected_volatile", jint(h->ecc_uncorrected_volatile));
	put(b, o, "ecc_uncorrected_aggregate", jint(h->ecc_uncorrected_aggregate));
	put(b, o, "retired_pages_sbe", jint(h->retired_pages_sbe));
	put(b, o, "retired_pages_dbe", jint(h->retired_pages_dbe));
	put(b, o, "remapped_rows_correctable", jint(h->remapped_rows_correctable));
	put(b, o, "remapped_rows_uncorrectable", jint(h->remapped_rows_uncorrectable));
	put(b, o, "remapped_rows_pending", jbool3(h->remapped_rows_pending));
	put(b, o, "remapped_rows_failed", jbool3(h->remapped_rows_failed));
	return o;
}

static json_t *inv_json(const disc_inventory *inv, int with_health)
{
	jb b = {0};
	char lv[16];
	json_t *o = json_object();
	put(&b, o, "schema", json_integer(DISC_SCHEMA));
	put(&b, o, "host", host_json(&b, &inv->host));

	json_t *c = json_object();
	put(&b, c, "kind", json_string(inv->compute_gpu ? "gpu" : "cpu"));
	put(&b, c, "ranks", json_integer(inv->ranks));
	put(&b, o, "compute", c);

	json_t *src = json_object();
	put(&b, src, "kind", json_string(inv->gpu_kind == DISC_GPUS_NVML   ? "nvml"
					 : inv->gpu_kind == DISC_GPUS_FAKE ? "fake"
									    : "none"));
	put(&b, src, "spec", jstr(inv->fake_spec));
	put(&b, src, "driver_version", jstr(inv->driver_version));
	put(&b, src, "cuda_driver_version", jint(inv->cuda_driver_version));
	put(&b, o, "gpu_source", src);

	json_t *a = json_array();
	for (size_t i = 0; i < inv->n_gpus; i++) {
		const disc_gpu *g = &inv->gpus[i];
		json_t *e = json_object();
		char cc[24];
		snprintf(cc, sizeof cc, "%d.%d", g->cc_major, g->cc_minor);
		put(&b, e, "index", json_integer(g->index));
		put(&b, e, "nvml_index", jint(g->nvml_index));
		put(&b, e, "uuid", jstr(g->uuid));
		put(&b, e, "name", jstr(g->name));
		put(&b, e, "bus_id", json_string(g->bus_id));
		put(&b, e, "numa_node", jint(g->numa_node));
		put(&b, e, "compute_capability", g->cc_major >= 0 ? json_string(cc) : json_null());
		put(&b, e, "memory_total_bytes", jint(g->memory_total_bytes));
		put(&b, e, "nvlinks", json_integer(g->nvlinks));
		put(&b, e, "nvswitch", json_boolean(g->nvswitch));
		if (with_health)
			put(&b, e, "health", health_json(&b, &g->health));
		push(&b, a, e);
	}
	put(&b, o, "gpus", a);

	a = json_array();
	for (size_t i = 0; i < inv->n_pci_gpus; i++) {
		const disc_pci_gpu *g = &inv->pci_gpus[i];
		json_t *e = json_object();
		char id[16];
		snprintf(id, sizeof id, "%04x:%04x", g->vendor, g->device);
		put(&b, e, "bus_id", json_string(g->bus_id));
		put(&b, e, "pci_id", json_string(id));
		put(&b, e, "numa_node", jint(g->numa_node));
		push(&b, a, e);
	}
	put(&b, o, "pci_gpus", a);

	a = json_array();
	for (size_t i = 0; i < inv->n_links; i++) {
		const disc_gpu_link *l = &inv->links[i];
		json_t *e = json_object();
		put(&b, e, "a", json_integer(l->a));
		put(&b, e, "b", json_integer(l->b));
		put(&b, e, "level", json_string(disc_level_name(l->level, l->nvlinks, lv, sizeof lv)));
		put(&b, e, "nvlinks", json_integer(l->nvlinks));
		put(&b, e, "nvswitch", json_boolean(l->nvswitch));
		put(&b, e, "source", json_string(disc_src_name(l->source)));
		push(&b, a, e);
	}
	put(&b, o, "gpu_links", a);

	a = json_array();
	for (size_t i = 0; i < inv->n_ib_ports; i++) {
		const disc_ib_port *p = &inv->ib_ports[i];
		json_t *e = json_object();
		put(&b, e, "device", json_string(p->device));
		put(&b, e, "port", json_integer(p->port));
		put(&b, e, "bus_id", jstr(p->bus_id));
		put(&b, e, "numa_node", jint(p->numa_node));
		put(&b, e, "hca_type", jstr(p->hca_type));
		put(&b, e, "fw_ver", jstr(p->fw_ver));
		put(&b, e, "link_layer", jstr(p->link_layer));
		put(&b, e, "state", jstr(p->state));
		put(&b, e, "phys_state", jstr(p->phys_state));
		put(&b, e, "rate_gbps", jnum(p->rate_gbps));
		put(&b, e, "width", jint(p->width));
		put(&b, e, "speed", jstr(p->speed));
		put(&b, e, "netdev", jstr(p->netdev));
		put(&b, e, "gid_index", jint(p->gid_index));
		put(&b, e, "usable", json_boolean(p->usable));
		push(&b, a, e);
	}
	put(&b, o, "ib_ports", a);

	a = json_array();
	for (size_t i = 0; i < inv->n_nics; i++) {
		const disc_nic *n = &inv->nics[i];
		json_t *e = json_object(), *v4 = json_array(), *v6 = json_array();
		put(&b, e, "name", json_string(n->name));
		for (int k = 0; k < n->n_ipv4; k++)
			push(&b, v4, json_string(n->ipv4[k]));
		for (int k = 0; k < n->n_ipv6; k++)
			push(&b, v6, json_string(n->ipv6[k]));
		put(&b, e, "ipv4", v4);
		put(&b, e, "ipv6", v6);
		push(&b, a, e);
	}
	put(&b, o, "nics", a);

	a = json_array();
	for (size_t i = 0; i < inv->n_gpu_nic; i++) {
		const disc_gpu_nic *g = &inv->gpu_nic[i];
		json_t *e = json_object();
		put(&b, e, "gpu", json_integer(g->gpu));
		put(&b, e, "nic", json_string(g->nic));
		put(&b, e, "level", json_string(disc_level_name(g->level, 0, lv, sizeof lv)));
		put(&b, e, "source", json_string(disc_src_name(g->source)));
		push(&b, a, e);
	}
	put(&b, o, "gpu_nic", a);

	a = json_array();
	for (size_t i = 0; i < inv->n_notes; i++) {
		json_t *e = json_object();
		put(&b, e, "source", json_string(inv->notes[i].source));
		put(&b, e, "message", json_string(inv->notes[i].message));
		push(&b, a, e);
	}
	put(&b, o, "notes", a);
	if (b.bad) {
		json_decref(o);
		return NULL;
	}
	return o;
}

json_t *disc_to_json(const disc_inventory *inv)
{
	return inv ? inv_json(inv, 1) : NULL;
}

int disc_digest(const disc_inventory *inv, char hex[DISC_DIGEST_HEX], ds_err *err)
{
	json_t *j = inv ? inv_json(inv, 0) : NULL;
	if (!j)
		return ds_err_set(err, DS_ENOMEM, "inventory digest: out of memory");
	char *text = json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS | JSON_ENSURE_ASCII);
	json_decref(j);
	if (!text)
		return ds_err_set(err, DS_ENOMEM, "inventory digest: out of memory");
	unsigned char h[32];
	int rc = DS_OK;
	if (sodium_init() < 0 ||
	    crypto_generichash(h, sizeof h, (const unsigned char *)text, strlen(text), NULL, 0) != 0)
		rc = ds_err_set(err, DS_EINTERNAL, "inventory digest: BLAKE2b failed");
	else
		ds_hex_encode(h, sizeof h, hex);
	free(text);
	return rc;
}

int disc_print(const disc_params *p, FILE *f, ds_err *err)
{
	disc_inventory *inv = NULL;
	json_t *j = NULL;
	char *text = NULL, hex[DISC_DIGEST_HEX];
	int rc = disc_run(p, &inv, err);
	if (rc)
		goto out;
	if ((rc = disc_digest(inv, hex, err)))
		goto out;
	if (!(j = disc_to_json(inv)) || json_object_set_new(j, "digest", json_string(hex)) != 0 ||
	    !(text = json_dumps(j, JSON_INDENT(2)))) {
		rc = ds_err_set(err, DS_ENOMEM, "inventory JSON: out of memory");
		goto out;
	}
	if (fprintf(f, "%s\n", text) < 0 || fflush(f) != 0)
		rc = ds_err_set(err, DS_EIO, "writing the inventory: %s", strerror(errno));
out:
	free(text);
	json_decref(j);
	disc_free(inv);
	return rc;
}
