/*
 * plan.c - the shard planner: node inventories + a model -> tp/pp/ep, the
 * rank -> device map, each rank's layers, experts and memory, the groups, the
 * KV budget and each node's NCCL environment (docs/cluster.md "The shard
 * planner").
 *
 * Called by `dsagent plan` (plan_cli.c) and the head (agent/cluster).  Calls
 * plan_model.c for the tensor list, engine/model.h for the split rules,
 * jansson.  No global state.
 *
 * Steps of plan_make:
 *   inventories -> devices (one per GPU, or per CPU rank) and nodes
 *   -> model (tensors with their split rule)
 *   -> every (tp, pp, ep) with tp*pp*ep = devices that the rules allow
 *      (candidate_check), each sized (eval: weights per rank, KV tokens,
 *      shortfall) and costed (cost: seconds per decode token)
 *   -> the cheapest that fits, else the one short by the fewest bytes
 *   -> per-node environment (node_env) and, for a GPU node whose topology
 *      NCCL cannot see, its NCCL topology file (node_topo, plan_topo.c).
 * Invariants:
 *   - world rank r runs on device r in node order (node 0's devices first,
 *     each node's in its inventory's order), so rank 0 is on node 0 and a tp
 *     group (consecutive ranks) of GPUs lies in one node whenever the check
 *     allows it (one of CPU ranks may span nodes);
 *   - rank coordinates, layer ranges and expert ranges are the engine's
 *     (model_rank_coords, model_stage_layers, model_split_range);
 *   - every rank has the same KV pages (the engine's rule), so the KV token
 *     budget is the smallest any rank can hold.
 */
#include "agent/plan/plan_impl.h"
#include "common/strutil.h"
#include "engine/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NV_LINK_BW 25e9      /* bytes/s per NVLink (one direction, 4th gen ~ 25 GB/s) */
#define NV_DEFAULT_BW 300e9  /* NVSwitch peer without a link count */
#define PCIE_BW 25e9         /* Gen4 x16, one direction */
#define SHM_BW 20e9          /* CPU ranks of one node */
#define SOCKET_BW 1.25e9     /* 10 Gb/s assumed for a node without RDMA */
#define ALPHA_NV 3e-6        /* seconds per collective step */
#define ALPHA_PCIE 10e-6
#define ALPHA_SHM 2e-6
#define ALPHA_RDMA 10e-6
#define ALPHA_SOCKET 50e-6
#define CPU_MEM_BW 20e9      /* weight reads per CPU rank */
#define ACT_BYTES 4          /* the engine's collectives move f32 */

typedef struct pdev {
	int node, index;    /* node index, device index in that node */
	int64_t memory;
	double hbm_bw;      /* bytes/s of weight reads */
	int cc_major, cc_minor;
	int domain;         /* NVLink domain id (unique per node x component) */
	int nvlinks;
	char name[96];
} pdev;

typedef struct pnode {
	char host[256];
	char addr[64];
	int gpu;
	int first, n_dev;
	double net_bw;      /* inter-node bytes/s per device */
	int rdma;           /* a usable RDMA port */
	int domain_max;     /* largest NVLink domain */
	json_t *env;        /* ordered NCCL variables */
	json_t *notes;      /* strings */
	char *topo_xml;     /* NCCL topology file (hidden topology only), or NULL */
} pnode;

typedef struct cand {
	int tp, pp, ep;
	int ok;                   /* the rules allow it */
	char why[200];            /* when not ok */
	int fits;
	int64_t worst_short;      /* bytes over on the worst device (<= 0 = fits) */
	int worst_rank;
	int64_t total_short;      /* sum of the positive shortfalls */
	int64_t kv_tokens;        /* the KV budget in tokens (same on every rank) */
	double read_s, comm_s, cost_s;
} cand;

struct plan {
	plan_params p;
	plan_model m;
	pdev *dev;
	int n_dev;
	pnode *node;
	int n_node;
	int max_ctx;
	int64_t kv_row;           /* KV bytes per token per layer, the whole model's row */
	const char *dequant;      /* NULL, "native" or "in-kernel" */
	cand *cands;
	int n_cands;
	int chosen;               /* index in cands */
	int overridden;
	json_t *warnings;
	/* when the chosen layout does not fit and the file is not FP8: the same
	 * layout with the FP8 checkpoint of this config (-1 = not computed) */
	int fp8_fits;
	int64_t fp8_bytes, fp8_worst_short;
};

plan_params plan_default_params(void)
{
	plan_params p = {0};
	p.mem_fraction = 0.9;
	p.reserve_gpu = PLAN_RESERVE_GPU;
	p.reserve_cpu = PLAN_RESERVE_CPU;
	return p;
}

/* ---- inventories ---------------------------------------------------------- */

static double hbm_bw_of(const char *name, int64_t mem)
{
	/* vendor figures, bytes/s; unknown GPUs get 1 TB/s */
	if (strstr(name, "H200"))
		return 4.8e12;
	if (strstr(name, "B200"))
		return 8e12;
	if (strstr(name, "H100") || strstr(name, "H800"))
		return 3.35e12;
	if (strstr(name, "H20"))
		return 4.0e12;
	if (strstr(name, "A100") || strstr(name, "A800"))
		return mem <= ((int64_t)48 << 30) ? 1.55e12 : 2.0e12;
	if (strstr(name, "L40"))
		return 0.864e12;
	return 1e12;
}

static int64_t jint(json_t *o, const char *k, int64_t dflt)
{
	json_t *v = json_object_get(o, k);
	return json_is_integer(v) ? json_integer_value(v) : dflt;
}

static int union_find(int *par, int i)
{
	while (par[i] != i)
		i = par[i] = par[par[i]];
	return i;
}

/* Level names as discover prints them, nearest first; NV* = 0. */
static int level_rank(const char *s)
{
	static const char *const names[] = {"NV", "PIX", "PXB", "PHB", "NODE", "SYS"};
	if (!s)
		return 99;
	if (strncmp(s, "NV", 2) == 0)
		return 0;
	for (int i = 1; i < 6; i++)
		if (strcmp(s, names[i]) == 0)
			return i;
	return 99;
}

static int add_note(json_t *a, const char *msg)
{
	return json_array_append_new(a, json_string(msg)) == 0 ? DS_OK : DS_ENOMEM;
}

static int load_node(plan *pl, int ni, json_t *inv, const char *addr, ds_err *err)
{
	pnode *n = &pl->node[ni];
	if (!json_is_object(inv))
		return ds_err_set(err, DS_EFORMAT, "inventory %d: not a JSON object", ni + 1);
	if (jint(inv, "schema", -1) != 1)
		return ds_err_set(err, DS_EFORMAT, "inventory %d: \"schema\" is not 1 (is it "
				  "what `dsagent --discover` prints?)", ni + 1);
	json_t *host = json_object_get(inv, "host"), *compute = json_object_get(inv, "compute");
	const char *hn = json_string_value(json_object_get(host, "hostname"));
	const char *kind = json_string_value(json_object_get(compute, "kind"));
	if (!kind || (strcmp(kind, "gpu") != 0 && strcmp(kind, "cpu") != 0))
		return ds_err_set(err, DS_EFORMAT, "inventory %d: compute.kind is not \"gpu\" or \"cpu\"",
				  ni + 1);
	if (hn && *hn)
		ds_strlcpy(n->host, hn, sizeof n->host);
	else
		snprintf(n->host, sizeof n->host, "node%d", ni);
	if (addr)
		ds_strlcpy(n->addr, addr, sizeof n->addr);
	n->gpu = strcmp(kind, "gpu") == 0;
	n->first = pl->n_dev;
	if (!(n->env = json_object()) || !(n->notes = json_array()))
		return DS_ENOMEM;

	json_t *gpus = json_object_get(inv, "gpus");
	size_t ng = n->gpu ? json_array_size(gpus) : 0;
	int64_t ranks = jint(compute, "ranks", 1);
	if (n->gpu && ng == 0)
		return ds_err_set(err, DS_EFORMAT, "inventory %d (%s): compute.kind is gpu but "
				  "\"gpus\" is empty", ni + 1, n->host);
	if (!n->gpu && (ranks < 1 || ranks > 1024))
		return ds_err_set(err, DS_EFORMAT, "inventory %d (%s): compute.ranks %lld out of range",
				  ni + 1, n->host, (long long)ranks);
	n->n_dev = n->gpu ? (int)ng : (int)ranks;
	pdev *nd = realloc(pl->dev, (size_t)(pl->n_dev + n->n_dev) * sizeof *nd);
	if (!nd)
		return DS_ENOMEM;
	pl->dev = nd;
	int par[1024];
	if (n->n_dev > 1024)
		return ds_err_set(err, DS_EFORMAT, "inventory %d: more than 1024 devices", ni + 1);
	for (int i = 0; i < n->n_dev; i++)
		par[i] = i;
	for (int i = 0; i < n->n_dev; i++) {
		pdev *d = &pl->dev[pl->n_dev + i];
		memset(d, 0, sizeof *d);
		d->node = ni;
		d->index = i;
		if (n->gpu) {
			json_t *g = json_array_get(gpus, (size_t)i);
			const char *nm = json_string_value(json_object_get(g, "name"));
			const char *cc = json_string_value(json_object_get(g, "compute_capability"));
			d->memory = jint(g, "memory_total_bytes", -1);
			if (d->memory <= 0)
				return ds_err_set(err, DS_EFORMAT, "inventory %d (%s): gpu %d has no "
						  "memory_total_bytes", ni + 1, n->host, i);
			d->index = (int)jint(g, "index", i);
			ds_strlcpy(d->name, nm ? nm : "GPU", sizeof d->name);
			d->cc_major = d->cc_minor = -1;
			if (cc) {
				char *e = NULL;
				long ma = strtol(cc, &e, 10);
				if (e != cc && *e == '.') {
					d->cc_major = (int)ma;
					d->cc_minor = (int)strtol(e + 1, NULL, 10);
				}
			}
			d->nvlinks = (int)jint(g, "nvlinks", 0);
			d->hbm_bw = hbm_bw_of(d->name, d->memory);
		} else {
			/* a CPU rank per NUMA node: its node's memory, else an equal share */
			json_t *numa = json_array_get(json_object_get(host, "numa_nodes"), (size_t)i);
			int64_t hm = jint(host, "memory_bytes", -1);
			d->memory = jint(numa, "memory_bytes", -1);
			if (d->memory <= 0 && hm > 0)
				d->memory = hm / ranks;
			if (d->memory <= 0)
				return ds_err_set(err, DS_EFORMAT, "inventory %d (%s): CPU node without "
						  "host.memory_bytes", ni + 1, n->host);
			snprintf(d->name, sizeof d->name, "cpu rank %d", i);
			d->hbm_bw = CPU_MEM_BW;
		}
	}
	/* NVLink domains: NV* links, or both ends on an NVSwitch */
	if (n->gpu) {
		size_t i;
		json_t *l;
		json_array_foreach(json_object_get(inv, "gpu_links"), i, l) {
			int a = (int)jint(l, "a", -1), b = (int)jint(l, "b", -1);
			const char *lv = json_string_value(json_object_get(l, "level"));
			if (a < 0 || b < 0 || a >= n->n_dev || b >= n->n_dev || level_rank(lv) != 0)
				continue;
			par[union_find(par, a)] = union_find(par, b);
		}
		for (int a = 0; a < n->n_dev; a++)
			for (int b = a + 1; b < n->n_dev; b++)
				if (json_is_true(json_object_get(json_array_get(gpus, (size_t)a), "nvswitch")) &&
				    json_is_true(json_object_get(json_array_get(gpus, (size_t)b), "nvswitch")))
					par[union_find(par, a)] = union_find(par, b);
	}
	int count[1024] = {0};
	for (int i = 0; i < n->n_dev; i++) {
		int root = n->gpu ? union_find(par, i) : i;
		pl->dev[pl->n_dev + i].domain = ni * 1024 + root;
		if (++count[root] > n->domain_max)
			n->domain_max = count[root];
	}
	if (!n->gpu)
		n->domain_max = 1;
	pl->n_dev += n->n_dev;
	return DS_OK;
}

/* The environment of node ni (docs/cluster.md "The shard planner"). */
static int node_env(plan *pl, int ni, json_t *inv, ds_err *err)
{
	pnode *n = &pl->node[ni];
	json_t *ports = json_object_get(inv, "ib_ports"), *p;
	size_t i;
	char hca[1024] = "", note[512];
	size_t used = 0;
	int gid = -1, gid_mixed = 0, n_active = 0;
	double rate = 0;
	int rc = DS_OK;
	if (n->gpu)
		json_object_set_new(n->env, "CUDA_DEVICE_ORDER", json_string("PCI_BUS_ID"));
	json_array_foreach(ports, i, p) {
		const char *dev = json_string_value(json_object_get(p, "device"));
		int64_t port = jint(p, "port", -1);
		if (!dev || port < 0 || !json_is_true(json_object_get(p, "usable")))
			continue;
		if (n_active == 32) { /* NCCL takes at most 32 HCAs */
			add_note(n->notes, "more than 32 active RDMA ports: NCCL_IB_HCA lists the first 32");
			break;
		}
		int w = snprintf(hca + used, sizeof hca - used, "%s%s:%lld", n_active ? "," : "=",
				 dev, (long long)port);
		if (w < 0 || (size_t)w >= sizeof hca - used)
			return ds_err_set(err, DS_ERANGE, "inventory %d: RDMA port names too long", ni + 1);
		used += (size_t)w;
		n_active++;
		json_t *r = json_object_get(p, "rate_gbps");
		if (json_is_number(r) && json_number_value(r) > 0)
			rate += json_number_value(r) * 1e9 / 8;
		const char *ll = json_string_value(json_object_get(p, "link_layer"));
		int64_t g = jint(p, "gid_index", -1);
		if (ll && strcmp(ll, "Ethernet") == 0 && g >= 0) {
			if (gid >= 0 && g != gid)
				gid_mixed = 1;
			else
				gid = (int)g;
		}
	}
	n->rdma = n_active > 0;
	if (n->rdma) {
		json_object_set_new(n->env, "NCCL_IB_HCA", json_string(hca));
		if (gid >= 0) {
			json_object_set_new(n->env, "NCCL_IB_GID_INDEX", json_integer(gid));
			if (gid_mixed)
				add_note(n->notes, "RoCE ports have different RoCE v2 GID indexes; "
					 "NCCL_IB_GID_INDEX is the first port's");
		}
		/* GDR level: each GPU's nearest active RDMA device, the farthest of those */
		int worst = -1;
		if (n->gpu) {
			json_t *gn = json_object_get(inv, "gpu_nic");
			for (int g = 0; g < n->n_dev && worst < 99; g++) {
				int best = 99;
				size_t k;
				json_t *e;
				json_array_foreach(gn, k, e) {
					if (jint(e, "gpu", -1) != pl->dev[n->first + g].index)
						continue;
					const char *nic = json_string_value(json_object_get(e, "nic"));
					if (!nic || !strstr(hca, nic))
						continue;
					/* exact device match: the name followed by ':' in hca */
					char key[80];
					snprintf(key, sizeof key, "%s:", nic);
					const char *at = strstr(hca, key);
					if (!at || (at[-1] != '=' && at[-1] != ','))
						continue;
					int lr = level_rank(json_string_value(json_object_get(e, "level")));
					if (lr < best)
						best = lr;
				}
				if (best > worst)
					worst = best;
			}
		}
		/* NCCL's levels: PIX PXB PHB SYS; a path across host bridges of one
		 * NUMA node (NODE) is NCCL's PHB */
		static const char *const gdr[] = {"PIX", "PIX", "PXB", "PHB", "PHB", "SYS"};
		if (worst >= 0 && worst <= 5)
			json_object_set_new(n->env, "NCCL_NET_GDR_LEVEL", json_string(gdr[worst]));
		else if (n->gpu)
			add_note(n->notes, "GPU-NIC distance unknown: NCCL_NET_GDR_LEVEL left to NCCL");
		n->net_bw = rate / n->n_dev;
	} else {
		json_object_set_new(n->env, "NCCL_IB_DISABLE", json_string("1"));
		add_note(n->notes, "no usable RDMA port: NCCL uses its socket transport on this node");
		n->net_bw = SOCKET_BW / n->n_dev;
	}
	/* the interface carrying the node's address */
	json_t *nics = json_object_get(inv, "nics"), *nic;
	const char *ifname = NULL;
	if (n->addr[0]) {
		json_array_foreach(nics, i, nic) {
			size_t k;
			json_t *a;
			json_array_foreach(json_object_get(nic, "ipv4"), k, a) {
				const char *s = json_string_value(a);
				size_t al = strlen(n->addr);
				if (s && strncmp(s, n->addr, al) == 0 && (s[al] == '/' || s[al] == 0))
					ifname = json_string_value(json_object_get(nic, "name"));
			}
		}
		if (!ifname) {
			snprintf(note, sizeof note, "no interface has the address %s: "
				 "NCCL_SOCKET_IFNAME left unset", n->addr);
			add_note(n->notes, note);
		}
	} else {
		const char *only = NULL;
		int cnt = 0;
		json_array_foreach(nics, i, nic) {
			const char *nm = json_string_value(json_object_get(nic, "name"));
			if (!nm || strcmp(nm, "lo") == 0 || json_array_size(json_object_get(nic, "ipv4")) == 0)
				continue;
			only = nm;
			cnt++;
		}
		if (cnt == 1) {
			ifname = only;
			add_note(n->notes, "no address given: NCCL_SOCKET_IFNAME is the one interface "
				 "with an IPv4 address");
		} else {
			add_note(n->notes, "no address given and several interfaces: NCCL_SOCKET_IFNAME "
				 "left unset (give --addr)");
		}
	}
	if (ifname) {
		char v[80];
		snprintf(v, sizeof v, "=%s", ifname);
		json_object_set_new(n->env, "NCCL_SOCKET_IFNAME", json_string(v));
		/* Gloo matches the name itself; it has no "=" syntax */
		json_object_set_new(n->env, "GLOO_SOCKET_IFNAME", json_string(ifname));
	}
	return rc;
}

/* The NCCL topology file of GPU node ni when its topology is hidden
 * (plan_topo.c).  The file's path is known only on the node, so the plan
 * carries its text and the launcher writes it ("files" of POST /v1/ranks)
 * and sets NCCL_TOPO_FILE there; env does not name it. */
static int node_topo(plan *pl, int ni, json_t *inv, ds_err *err)
{
	pnode *n = &pl->node[ni];
	char why[200], who[300], note[600];
	if (!n->gpu || !plan_topo_hidden(inv, why, sizeof why))
		return DS_OK;
	snprintf(who, sizeof who, "inventory %d (%s)", ni + 1, n->host);
	int rc = plan_topo_xml(inv, who, n->notes, &n->topo_xml, err);
	if (rc)
		return rc;
	snprintf(note, sizeof note, "topology hidden from NCCL (%s): nccl_topo_xml describes what "
		 "discovery knows; the launcher writes it to a file and sets NCCL_TOPO_FILE "
		 "(\"files\" of POST /v1/ranks)", why);
	return add_note(n->notes, note);
}

/* ---- sizing --------------------------------------------------------------- */

/* Bytes of part i of t over `parts` (plan_impl.h, plan_tensor). */
static int64_t part_bytes(const plan_tensor *t, int parts, int i)
{
	int64_t first, count;
	model_split_range(t->n, parts, i, &first, &count);
	if (t->col_unit > 0 && t->block > 1 && count > 0 &&
	    ((first * t->col_unit) % t->block || (count * t->col_unit) % t->block))
		return t->rows * count * t->col_unit * (int64_t)sizeof(float);
	return t->bytes * count / t->n;
}

/* Weight bytes of world rank r under c: all, and the routed experts' part. */
static void rank_weights(const plan *pl, const cand *c, int r, int64_t *all, int64_t *routed)
{
	model_plan mp = {.tp = c->tp, .pp = c->pp, .ep = c->ep};
	int stage, tpr, epr, f, e;
	int64_t e0 = 0, ec = 0;
	model_rank_coords(&mp, r, &stage, &tpr, &epr);
	model_stage_layers(pl->m.c.layers, c->pp, stage, &f, &e);
	if (pl->m.c.experts > 0)
		model_split_range(pl->m.c.experts, c->ep, epr, &e0, &ec);
	const int S = c->tp * c->ep, l = epr * c->tp + tpr;
	int64_t a = 0, ro = 0;
	for (size_t i = 0; i < pl->m.n; i++) {
		const plan_tensor *t = &pl->m.t[i];
		int64_t b = 0;
		switch (t->where) {
		case PLAN_T_SKIP:
			continue;
		case PLAN_T_FIRST:
			if (stage != 0)
				continue;
			break;
		case PLAN_T_LAST:
			if (stage != c->pp - 1)
				continue;
			break;
		case PLAN_T_LAST_OWN:
			if (stage != c->pp - 1 || stage == 0)
				continue;
			break;
		case PLAN_T_LAYER:
			if (t->layer < f || t->layer >= e)
				continue;
			break;
		default:
			break;
		}
		if (t->split == PLAN_S_WHOLE || t->n < 1) {
			b = t->bytes;
		} else if (t->split == PLAN_S_STAGE) {
			b = part_bytes(t, S, l);
		} else if (t->split == PLAN_S_TP) {
			b = part_bytes(t, c->tp, tpr);
		} else {
			if (t->expert < e0 || t->expert >= e0 + ec)
				continue;
			b = part_bytes(t, c->tp, tpr);
			ro += b;
		}
		a += b;
	}
	*all = a;
	*routed = ro;
}

/* KV bytes per token of world rank r: its stage's layers, each a full MLA
 * row (replicated over the stage), or under Llama K and V of the rank's kv
 * heads (llama.c: one unused float for a rank past the kv heads). */
static int64_t rank_kv_per_token(const plan *pl, const cand *c, int r)
{
	const plan_mcfg *mc = &pl->m.c;
	model_plan mp = {.tp = c->tp, .pp = c->pp, .ep = c->ep};
	int stage, tpr, epr, f, e;
	int64_t row = pl->kv_row;
	model_rank_coords(&mp, r, &stage, &tpr, &epr);
	model_stage_layers(mc->layers, c->pp, stage, &f, &e);
	if (mc->arch == PLAN_ARCH_LLAMA) {
		int64_t g0, gc;
		model_split_range(mc->kv_heads, c->tp, tpr, &g0, &gc);
		row = gc > 0 ? 2 * gc * mc->head_dim * PLAN_KV_ELEM_BYTES_LLAMA : PLAN_KV_ELEM_BYTES_LLAMA;
	}
	return row * (e - f);
}

static int64_t usable_of(const plan *pl, const pdev *d)
{
	return (int64_t)floor(pl->p.mem_fraction * (double)d->memory);
}

static int64_t reserve_of(const plan *pl, const pdev *d)
{
	return pl->node[d->node].gpu ? pl->p.reserve_gpu : pl->p.reserve_cpu;
}

/* The link between two devices: bandwidth (bytes/s) and per-step latency. */
static void link_of(const plan *pl, int a, int b, double *bw, double *alpha)
{
	const pdev *x = &pl->dev[a], *y = &pl->dev[b];
	const pnode *nx = &pl->node[x->node], *ny = &pl->node[y->node];
	if (x->node == y->node) {
		if (!nx->gpu) {
			*bw = SHM_BW;
			*alpha = ALPHA_SHM;
		} else if (x->domain == y->domain) {
			int nl = x->nvlinks < y->nvlinks ? x->nvlinks : y->nvlinks;
			*bw = nl > 0 ? nl * NV_LINK_BW : NV_DEFAULT_BW;
			*alpha = ALPHA_NV;
		} else {
			*bw = PCIE_BW;
			*alpha = ALPHA_PCIE;
		}
		return;
	}
	*bw = nx->net_bw < ny->net_bw ? nx->net_bw : ny->net_bw;
	*alpha = nx->rdma && ny->rdma ? ALPHA_RDMA : ALPHA_SOCKET;
}

/* One all-reduce of `bytes` over world ranks first, first+stride, ... (n of
 * them): 2*ceil(log2 n) latency steps (NCCL's tree / LL protocols for small
 * messages) + the ring's 2(n-1)/n * bytes over the slowest link of the ring. */
static double allreduce_s(const plan *pl, const int *ranks, int n, double bytes)
{
	if (n < 2)
		return 0;
	double bw_min = INFINITY, alpha_max = 0;
	for (int i = 0; i < n; i++) {
		double bw, al;
		link_of(pl, ranks[i], ranks[(i + 1) % n], &bw, &al);
		if (bw < bw_min)
			bw_min = bw;
		if (al > alpha_max)
			alpha_max = al;
	}
	return 2 * ceil(log2((double)n)) * alpha_max + 2.0 * (n - 1) / n * bytes / bw_min;
}

/* One all-gather of `bytes` in all (each rank's part 1/n): ceil(log2 n)
 * latency steps + the ring's (n-1)/n * bytes over the slowest link. */
static double allgather_s(const plan *pl, const int *ranks, int n, double bytes)
{
	return n < 2 ? 0 : allreduce_s(pl, ranks, n, bytes) / 2;
}

/* The collectives of one layer on a stage of ranks[n]: DeepSeek's two
 * all-reduces of hidden_size f32 values; llama.c's four all-gathers over
 * the tp ranks (attention outputs, x after o, gate*up, x after down). */
static double layer_comm_s(const plan *pl, const int *ranks, int n)
{
	const plan_mcfg *mc = &pl->m.c;
	if (mc->arch != PLAN_ARCH_LLAMA)
		return 2 * allreduce_s(pl, ranks, n, (double)mc->hidden * ACT_BYTES);
	double q = (double)mc->heads * mc->head_dim, d = mc->hidden, f = mc->inter;
	return allgather_s(pl, ranks, n, q * ACT_BYTES) + 2 * allgather_s(pl, ranks, n, d * ACT_BYTES) +
	       allgather_s(pl, ranks, n, f * ACT_BYTES);
}

/* Sizes and costs c (c->ok already set by candidate_check). */
static void eval(const plan *pl, cand *c)
{
	const plan_mcfg *mc = &pl->m.c;
	const int S = c->tp * c->ep;
	double frac = mc->experts > 0 ? (double)mc->top_k / mc->experts : 0;
	int64_t kv_min = INT64_MAX;
	c->fits = 1;
	c->worst_short = INT64_MIN;
	c->total_short = 0;
	c->read_s = c->comm_s = 0;
	int ranks[4096];
	for (int s = 0; s < c->pp; s++) {
		double read = 0;
		for (int l = 0; l < S; l++) {
			int r = s * S + l;
			int64_t w, ro, kvpt = rank_kv_per_token(pl, c, r);
			const pdev *d = &pl->dev[r];
			rank_weights(pl, c, r, &w, &ro);
			int64_t base = w + reserve_of(pl, d), use = usable_of(pl, d);
			int64_t sh = base + (int64_t)pl->max_ctx * kvpt - use;
			if (sh > c->worst_short) {
				c->worst_short = sh;
				c->worst_rank = r;
			}
			if (sh > 0) {
				c->fits = 0;
				c->total_short += sh;
			}
			int64_t tok = use > base && kvpt > 0 ? (use - base) / kvpt : 0;
			if (tok < kv_min)
				kv_min = tok;
			double rd = ((double)(w - ro) + (double)ro * frac) / d->hbm_bw;
			if (rd > read)
				read = rd;
			ranks[l] = r;
		}
		int f, e;
		model_stage_layers(mc->layers, c->pp, s, &f, &e);
		c->read_s += read;
		c->comm_s += (e - f) * layer_comm_s(pl, ranks, S);
		if (s + 1 < c->pp) {
			double bw, al;
			link_of(pl, s * S, (s + 1) * S, &bw, &al);
			c->comm_s += al + (double)mc->hidden * ACT_BYTES / bw;
		}
	}
	c->kv_tokens = kv_min == INT64_MAX ? 0 : kv_min;
	c->cost_s = c->read_s + c->comm_s;
}

/* The rules: DS_OK, or why not in c->why.  `strict` (an override) turns only
 * engine limits and cross-node TP into errors; TP outside an NVLink domain is
 * then a warning.  CPU ranks have no NVLink domain and reach each other over
 * TCP (Gloo) whether they share a node or not, so a tp group of CPU ranks may
 * span nodes: the cost model alone weighs its all-reduces. */
static int candidate_check(const plan *pl, cand *c, int *nv_warn)
{
	const plan_mcfg *mc = &pl->m.c;
	*nv_warn = 0;
	if (c->tp > mc->heads) {
		snprintf(c->why, sizeof c->why, "tp %d exceeds the %d attention heads", c->tp, mc->heads);
		return DS_EINVAL;
	}
	if (c->pp > mc->layers) {
		snprintf(c->why, sizeof c->why, "pp %d exceeds the %d layers", c->pp, mc->layers);
		return DS_EINVAL;
	}
	if (mc->experts == 0 ? c->ep != 1 : c->ep > mc->experts) {
		snprintf(c->why, sizeof c->why, "ep %d: the model has %d routed experts", c->ep,
			 mc->experts);
		return DS_EINVAL;
	}
	for (int g = 0; g < pl->n_dev; g += c->tp) {
		for (int k = 1; k < c->tp; k++) {
			const pdev *a = &pl->dev[g], *b = &pl->dev[g + k];
			if (!pl->node[a->node].gpu && !pl->node[b->node].gpu)
				continue;
			if (a->node != b->node) {
				snprintf(c->why, sizeof c->why, "a tp group of GPUs would span nodes %s "
					 "and %s (inventories %d and %d)", pl->node[a->node].host,
					 pl->node[b->node].host, a->node + 1, b->node + 1);
				return DS_EINVAL;
			}
			if (a->domain != b->domain)
				*nv_warn = 1;
		}
	}
	if (*nv_warn)
		snprintf(c->why, sizeof c->why, "tp %d leaves the NVLink domain (largest: %d GPUs)",
			 c->tp, pl->node[pl->dev[0].node].domain_max);
	return DS_OK;
}

static int choose(plan *pl, ds_err *err)
{
	const int N = pl->n_dev;
	const plan_params *p = &pl->p;
	pl->cands = calloc((size_t)N * 64, sizeof *pl->cands);
	if (!pl->cands)
		return DS_ENOMEM;
	pl->overridden = p->tp || p->pp || p->ep;
	char last_why[200] = "";
	for (int tp = 1; tp <= N; tp++) {
		if (N % tp || (p->tp && tp != p->tp))
			continue;
		for (int pp = 1; pp <= N / tp; pp++) {
			if ((N / tp) % pp || (p->pp && pp != p->pp))
				continue;
			int ep = N / tp / pp;
			if (p->ep && ep != p->ep)
				continue;
			if (pl->n_cands == N * 64)
				break;
			cand *c = &pl->cands[pl->n_cands];
			c->tp = tp;
			c->pp = pp;
			c->ep = ep;
			int nv = 0;
			if (candidate_check(pl, c, &nv) != DS_OK) {
				ds_strlcpy(last_why, c->why, sizeof last_why);
				if (pl->overridden)
					return ds_err_set(err, DS_EINVAL, "--tp %d --pp %d --ep %d: %s", tp, pp,
							  ep, c->why);
				continue;
			}
			c->ok = !nv || pl->overridden;
			if (nv && pl->overridden) {
				char w[300];
				snprintf(w, sizeof w, "override: %s (its all-reduces go over PCIe)", c->why);
				json_array_append_new(pl->warnings, json_string(w));
			}
			eval(pl, c);
			pl->n_cands++;
		}
	}
	pl->chosen = -1;
	for (int i = 0; i < pl->n_cands; i++) {
		const cand *c = &pl->cands[i], *b = pl->chosen >= 0 ? &pl->cands[pl->chosen] : NULL;
		if (!c->ok)
			continue;
		int better;
		if (!b)
			better = 1;
		else if (c->fits != b->fits)
			better = c->fits;
		else if (!c->fits)
			better = c->worst_short < b->worst_short;
		else if (fabs(c->cost_s - b->cost_s) > 1e-9 * b->cost_s)
			better = c->cost_s < b->cost_s;
		else /* a tie: keep TP inside the NVLink domain large, PP small */
			better = c->tp > b->tp || (c->tp == b->tp && c->pp < b->pp);
		if (better)
			pl->chosen = i;
	}
	if (pl->chosen < 0) {
		if (pl->overridden)
			return ds_err_set(err, DS_EINVAL, "--tp/--pp/--ep: no tp*pp*ep equals the %d devices "
					  "of the inventories", N);
		return ds_err_set(err, DS_EINVAL, "no layout of %d devices follows the rules%s%s", N,
				  last_why[0] ? ": " : "", last_why);
	}
	return DS_OK;
}

int plan_make(const plan_params *p, plan **out, ds_err *err)
{
	int rc = DS_OK;
	*out = NULL;
	if (p->n_nodes < 1 || p->n_nodes > PLAN_NODES_MAX || !p->inventories)
		return ds_err_set(err, DS_EINVAL, "1 to %d inventories are needed", PLAN_NODES_MAX);
	if (!(p->mem_fraction > 0 && p->mem_fraction <= 1))
		return ds_err_set(err, DS_EINVAL, "memory fraction %g is not in (0, 1]", p->mem_fraction);
	if (p->tp < 0 || p->pp < 0 || p->ep < 0 || p->max_ctx < 0)
		return ds_err_set(err, DS_EINVAL, "tp, pp, ep and max_ctx must not be negative");
	plan *pl = calloc(1, sizeof *pl);
	if (!pl)
		return DS_ENOMEM;
	pl->p = *p;
	if (!(pl->node = calloc((size_t)p->n_nodes, sizeof *pl->node)) ||
	    !(pl->warnings = json_array())) {
		rc = DS_ENOMEM;
		goto out;
	}
	pl->n_node = p->n_nodes;
	for (int i = 0; i < p->n_nodes; i++) {
		const char *addr = p->addresses ? p->addresses[i] : NULL;
		if ((rc = load_node(pl, i, p->inventories[i], addr, err)) != DS_OK ||
		    (rc = node_env(pl, i, p->inventories[i], err)) != DS_OK ||
		    (rc = node_topo(pl, i, p->inventories[i], err)) != DS_OK)
			goto out;
		if (pl->node[i].gpu != pl->node[0].gpu) {
			rc = ds_err_set(err, DS_EUNSUPPORTED, "inventory %d (%s) has %s ranks, inventory 1 "
					"%s ranks: a plan uses one kind", i + 1, pl->node[i].host,
					pl->node[i].gpu ? "GPU" : "CPU", pl->node[0].gpu ? "GPU" : "CPU");
			goto out;
		}
	}
	if (pl->n_dev > 4096) {
		rc = ds_err_set(err, DS_EINVAL, "%d devices: at most 4096 are planned", pl->n_dev);
		goto out;
	}
	if ((rc = plan_model_load(p->model_path, &pl->m, err)) != DS_OK)
		goto out;
	const plan_mcfg *mc = &pl->m.c;
	pl->kv_row = mc->arch == PLAN_ARCH_LLAMA
			     ? 2 * (int64_t)mc->kv_heads * mc->head_dim * PLAN_KV_ELEM_BYTES_LLAMA
			     : (int64_t)(mc->kv_lora + mc->rope) * PLAN_KV_ELEM_BYTES_MLA;
	pl->max_ctx = p->max_ctx ? p->max_ctx : (mc->max_pos < 4096 ? mc->max_pos : 4096);
	if (pl->max_ctx > mc->max_pos) {
		rc = ds_err_set(err, DS_EINVAL, "--max-ctx %d is longer than the model's "
				"max_position_embeddings %d", pl->max_ctx, mc->max_pos);
		goto out;
	}
	if (mc->fp8) {
		pl->dequant = "native";
		for (int i = 0; i < pl->n_dev; i++) {
			const pdev *d = &pl->dev[i];
			if (!pl->node[d->node].gpu || d->cc_major < 8 || (d->cc_major == 8 && d->cc_minor < 9))
				pl->dequant = "in-kernel";
		}
	}
	if ((rc = choose(pl, err)) != DS_OK)
		goto out;
	pl->fp8_fits = -1;
	if (!pl->cands[pl->chosen].fits && !mc->fp8 && pl->m.source != PLAN_SRC_GGUF) {
		plan what = *pl; /* shallow: only m differs, and eval reads only */
		plan_mcfg qc = *mc;
		cand c = pl->cands[pl->chosen];
		qc.fp8 = 1;
		if ((rc = plan_model_from_config(&qc, &what.m, err)) != DS_OK)
			goto out;
		eval(&what, &c);
		pl->fp8_fits = c.fits;
		pl->fp8_bytes = what.m.total_bytes;
		pl->fp8_worst_short = c.worst_short;
		plan_model_free(&what.m);
	}
	*out = pl;
	pl = NULL;
out:
	if (rc == DS_ENOMEM && err && !err->msg[0])
		ds_err_set(err, DS_ENOMEM, "out of memory");
	plan_free(pl);
	return rc;
}

void plan_free(plan *pl)
{
	if (!pl)
		return;
	for (int i = 0; i < pl->n_node; i++) {
		json_decref(pl->node[i].env);
		json_decref(pl->node[i].notes);
		free(pl->node[i].topo_xml);
	}
	json_decref(pl->warnings);
	free(pl->cands);
	plan_model_free(&pl->m);
	free(pl->dev);
	free(pl->node);
	free(pl);
}

int plan_fits(const plan *pl)
{
	return pl->cands[pl->chosen].fits;
}

/* ---- output --------------------------------------------------------------- */

static json_t *range(int64_t a, int64_t b)
{
	return json_pack("[II]", (json_int_t)a, (json_int_t)b);
}

json_t *plan_to_json(const plan *pl)
{
	const cand *c = &pl->cands[pl->chosen];
	const plan_mcfg *mc = &pl->m.c;
	const int S = c->tp * c->ep, W = S * c->pp;
	json_t *o = json_object(), *ranks = json_array(), *groups = json_object(),
	       *nodes = json_array(), *rej = json_array();
	if (!o || !ranks || !groups || !nodes || !rej)
		goto fail;
	json_object_set_new(o, "schema", json_integer(PLAN_SCHEMA));
	json_object_set_new(o, "fits", json_boolean(c->fits));
	json_object_set_new(o, "model", json_pack("{s:s, s:s, s:s, s:I, s:i, s:i, s:i, s:i}",
		"path", pl->p.model_path, "model_type", mc->model_type,
		"weights_source", plan_source_name(pl->m.source),
		"weight_bytes", (json_int_t)pl->m.total_bytes, "layers", mc->layers,
		"routed_experts", mc->experts, "experts_per_token", mc->top_k,
		"hidden_size", mc->hidden));
	json_object_set_new(json_object_get(o, "model"), "dtype",
			    json_string(pl->m.dtype));
	json_object_set_new(json_object_get(o, "model"), "attention_heads", json_integer(mc->heads));
	if (mc->arch == PLAN_ARCH_LLAMA)
		json_object_set_new(json_object_get(o, "model"), "llama",
				    json_pack("{s:i, s:i, s:b}", "kv_heads", mc->kv_heads, "head_dim",
					      mc->head_dim, "tied_embeddings", mc->tied));
	json_object_set_new(o, "fp8_dequant", pl->dequant ? json_string(pl->dequant) : json_null());
	json_object_set_new(o, "tp", json_integer(c->tp));
	json_object_set_new(o, "pp", json_integer(c->pp));
	json_object_set_new(o, "ep", json_integer(c->ep));
	json_object_set_new(o, "dp", json_integer(1));
	json_object_set_new(o, "world", json_integer(W));
	json_object_set_new(o, "overridden", json_boolean(pl->overridden));
	json_object_set_new(o, "mem_fraction", json_real(pl->p.mem_fraction));
	json_object_set_new(o, "kv", json_pack("{s:I, s:I, s:i, s:I, s:I}",
		"elem_bytes", (json_int_t)(pl->m.c.arch == PLAN_ARCH_LLAMA ? PLAN_KV_ELEM_BYTES_LLAMA
									: PLAN_KV_ELEM_BYTES_MLA),
		"bytes_per_token_layer", (json_int_t)pl->kv_row, "max_ctx", pl->max_ctx,
		"tokens", (json_int_t)c->kv_tokens,
		"concurrency", (json_int_t)(pl->max_ctx ? c->kv_tokens / pl->max_ctx : 0)));
	for (int r = 0; r < W; r++) {
		model_plan mp = {.tp = c->tp, .pp = c->pp, .ep = c->ep};
		int st, tpr, epr, f, e;
		int64_t e0 = 0, ec = 0, w, ro;
		const pdev *d = &pl->dev[r];
		model_rank_coords(&mp, r, &st, &tpr, &epr);
		model_stage_layers(mc->layers, c->pp, st, &f, &e);
		if (mc->experts > 0)
			model_split_range(mc->experts, c->ep, epr, &e0, &ec);
		rank_weights(pl, c, r, &w, &ro);
		int64_t use = usable_of(pl, d), res = reserve_of(pl, d);
		int64_t kv = c->kv_tokens * rank_kv_per_token(pl, c, r);
		int64_t free_b = use - w - res - kv;
		json_t *ro_j = json_pack("{s:i, s:i, s:s, s:i, s:i, s:i, s:i, s:o, s:o}", "rank", r,
			"node", d->node, "hostname", pl->node[d->node].host, "device", d->index,
			"stage", st, "tp_rank", tpr, "ep_rank", epr, "layers", range(f, e),
			"experts", range(e0, e0 + ec));
		json_object_set_new(ro_j, "memory", json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I}",
			"total", (json_int_t)d->memory, "usable", (json_int_t)use,
			"weights", (json_int_t)w, "routed_weights", (json_int_t)ro,
			"kv", (json_int_t)kv, "reserve", (json_int_t)res, "free", (json_int_t)free_b));
		json_array_append_new(ranks, ro_j);
	}
	json_object_set_new(o, "ranks", ranks);
	ranks = NULL;
	json_t *world = json_array(), *stages = json_array(), *tps = json_array();
	for (int r = 0; r < W; r++)
		json_array_append_new(world, json_integer(r));
	for (int s = 0; s < c->pp; s++) {
		json_t *g = json_array();
		for (int l = 0; l < S; l++)
			json_array_append_new(g, json_integer(s * S + l));
		json_array_append_new(stages, g);
		for (int e = 0; e < c->ep; e++) {
			json_t *t = json_array();
			for (int k = 0; k < c->tp; k++)
				json_array_append_new(t, json_integer(s * S + e * c->tp + k));
			json_array_append_new(tps, t);
		}
	}
	json_object_set_new(groups, "world", world);
	json_object_set_new(groups, "stages", stages);
	json_object_set_new(groups, "tp", tps);
	json_object_set_new(o, "groups", groups);
	groups = NULL;
	for (int i = 0; i < pl->n_node; i++) {
		const pnode *n = &pl->node[i];
		json_t *nj = json_pack("{s:i, s:s, s:s?, s:s, s:i, s:i, s:b, s:f, s:O, s:s?, s:O}",
			"index", i, "hostname", n->host, "address", n->addr[0] ? n->addr : NULL,
			"kind", n->gpu ? "gpu" : "cpu", "devices", n->n_dev, "nvlink_domain",
			n->domain_max, "rdma", n->rdma, "net_bytes_per_s_per_device", n->net_bw,
			"env", n->env, "nccl_topo_xml", n->topo_xml, "notes", n->notes);
		json_array_append_new(nodes, nj);
	}
	json_object_set_new(o, "nodes", nodes);
	nodes = NULL;
	json_object_set_new(o, "cost", json_pack("{s:s, s:f, s:f, s:f}", "model",
		"seconds per decode token = sum over stages of (slowest rank's weight reads / memory "
		"bandwidth + each layer's collectives: 2 all-reduces (DeepSeek) or 4 all-gathers "
		"(Llama)) + stage-to-stage sends",
		"seconds_per_token", c->cost_s, "read_s", c->read_s, "comm_s", c->comm_s));
	for (int i = 0; i < pl->n_cands; i++) {
		const cand *x = &pl->cands[i];
		if (i == pl->chosen)
			continue;
		json_t *xj = json_pack("{s:i, s:i, s:i, s:b, s:f, s:s}", "tp", x->tp, "pp", x->pp,
			"ep", x->ep, "fits", x->fits, "seconds_per_token", x->cost_s, "reason",
			!x->ok ? x->why : !x->fits ? "does not fit" :
			!c->fits ? "short by more bytes" :
			fabs(x->cost_s - c->cost_s) <= 1e-9 * c->cost_s ? "same cost: larger tp, then smaller pp, kept" :
			"slower");
		json_array_append_new(rej, xj);
	}
	json_object_set_new(json_object_get(o, "cost"), "rejected", rej);
	rej = NULL;
	if (!c->fits) {
		int64_t w, ro;
		json_t *sj = json_object(), *sug = json_array();
		json_object_set_new(sj, "bytes", json_integer(c->worst_short));
		json_object_set_new(sj, "rank", json_integer(c->worst_rank));
		json_object_set_new(sj, "total_bytes", json_integer(c->total_short));
		/* all devices alike: what the whole layout needs over what one node gives */
		int64_t need = 0, node_use = 0;
		for (int r = 0; r < W; r++) {
			rank_weights(pl, c, r, &w, &ro);
			need += w + reserve_of(pl, &pl->dev[r]) +
				(int64_t)pl->max_ctx * rank_kv_per_token(pl, c, r);
		}
		for (int k = 0; k < pl->node[0].n_dev; k++)
			node_use += usable_of(pl, &pl->dev[pl->node[0].first + k]) -
				    reserve_of(pl, &pl->dev[pl->node[0].first + k]);
		int64_t nodes_needed = node_use > 0 ? (need - (int64_t)W * reserve_of(pl, &pl->dev[0]) +
						       node_use - 1) / node_use : -1;
		char msg[400];
		if (nodes_needed > pl->n_node) {
			json_object_set_new(sj, "nodes_needed", json_integer(nodes_needed));
			snprintf(msg, sizeof msg, "more nodes: about %lld nodes like %s (weights, reserve "
				 "and KV of the whole layout over one node's usable memory)",
				 (long long)nodes_needed, pl->node[0].host);
			json_array_append_new(sug, json_string(msg));
		}
		/* the longest context every rank holds once its weights and reserve fit */
		int64_t ctx = INT64_MAX;
		for (int r = 0; r < W && ctx > 0; r++) {
			rank_weights(pl, c, r, &w, &ro);
			int64_t rm = usable_of(pl, &pl->dev[r]) - w - reserve_of(pl, &pl->dev[r]);
			int64_t kt = rank_kv_per_token(pl, c, r);
			int64_t x = rm > 0 && kt > 0 ? rm / kt : 0;
			if (x < ctx)
				ctx = x;
		}
		if (ctx > 0 && ctx < pl->max_ctx) {
			json_object_set_new(sj, "max_ctx_that_fits", json_integer(ctx));
			snprintf(msg, sizeof msg, "a smaller context: --max-ctx %lld fits", (long long)ctx);
			json_array_append_new(sug, json_string(msg));
		} else {
			json_object_set_new(sj, "max_ctx_that_fits", json_null());
		}
		if (pl->fp8_fits >= 0) {
			json_object_set_new(sj, "fp8_weight_bytes", json_integer(pl->fp8_bytes));
			json_object_set_new(sj, "fp8_fits", json_boolean(pl->fp8_fits));
			if (pl->fp8_fits)
				snprintf(msg, sizeof msg, "a quantized file: the FP8 checkpoint of this model "
					 "(%lld bytes of weights) fits this layout", (long long)pl->fp8_bytes);
			else
				snprintf(msg, sizeof msg, "a quantized file: the FP8 checkpoint (%lld bytes) "
					 "would still be short by %lld bytes on a device", (long long)pl->fp8_bytes,
					 (long long)pl->fp8_worst_short);
			json_array_append_new(sug, json_string(msg));
		}
		json_object_set_new(sj, "suggestions", sug);
		json_object_set_new(o, "shortfall", sj);
	} else {
		json_object_set_new(o, "shortfall", json_null());
	}
	json_object_set_new(o, "warnings", json_incref(pl->warnings));
	return o;
fail:
	json_decref(o);
	json_decref(ranks);
	json_decref(groups);
	json_decref(nodes);
	json_decref(rej);
	return NULL;
}

static double gib(int64_t b) { return (double)b / (double)(1 << 30); }

void plan_print(const plan *pl, FILE *f)
{
	const cand *c = &pl->cands[pl->chosen];
	const plan_mcfg *mc = &pl->m.c;
	fprintf(f, "model %s (%s, %s, %.1f GiB of weights, from %s)\n", pl->p.model_path,
		mc->model_type, pl->m.dtype, gib(pl->m.total_bytes),
		plan_source_name(pl->m.source));
	if (pl->dequant)
		fprintf(f, "fp8 weights: %s%s\n", pl->dequant,
			strcmp(pl->dequant, "in-kernel") == 0 ? " dequantization (compute capability < 8.9)" : " fp8 GEMMs");
	fprintf(f, "plan: tp %d x pp %d x ep %d = %d ranks on %d node(s)%s; %s\n", c->tp, c->pp, c->ep,
		c->tp * c->pp * c->ep, pl->n_node, pl->overridden ? " (overridden)" : "",
		c->fits ? "fits" : "DOES NOT FIT");
	fprintf(f, "cost: %.3f ms per decode token (reads %.3f ms, communication %.3f ms)\n",
		c->cost_s * 1e3, c->read_s * 1e3, c->comm_s * 1e3);
	fprintf(f, "KV: %lld tokens (%lld B per token per layer); max context %d, %lld sequences of it\n",
		(long long)c->kv_tokens, (long long)pl->kv_row, pl->max_ctx,
		(long long)(c->kv_tokens / pl->max_ctx));
	json_t *j = plan_to_json(pl);
	size_t i;
	json_t *r;
	json_array_foreach(json_object_get(j, "ranks"), i, r) {
		json_t *m = json_object_get(r, "memory");
		json_t *L = json_object_get(r, "layers"), *E = json_object_get(r, "experts");
		fprintf(f, "  rank %3lld %s/%lld stage %lld tp %lld ep %lld layers [%lld,%lld) experts "
			"[%lld,%lld)  weights %.2f kv %.2f reserve %.2f free %.2f GiB\n",
			(long long)jint(r, "rank", 0), json_string_value(json_object_get(r, "hostname")),
			(long long)jint(r, "device", 0), (long long)jint(r, "stage", 0),
			(long long)jint(r, "tp_rank", 0), (long long)jint(r, "ep_rank", 0),
			(long long)json_integer_value(json_array_get(L, 0)),
			(long long)json_integer_value(json_array_get(L, 1)),
			(long long)json_integer_value(json_array_get(E, 0)),
			(long long)json_integer_value(json_array_get(E, 1)), gib(jint(m, "weights", 0)),
			gib(jint(m, "kv", 0)), gib(jint(m, "reserve", 0)), gib(jint(m, "free", 0)));
	}
	json_t *n;
	json_array_foreach(json_object_get(j, "nodes"), i, n) {
		fprintf(f, "node %zu %s:\n", i, json_string_value(json_object_get(n, "hostname")));
		const char *k;
		json_t *v;
		json_object_foreach(json_object_get(n, "env"), k, v) {
			if (json_is_integer(v))
				fprintf(f, "  %s=%lld\n", k, (long long)json_integer_value(v));
			else
				fprintf(f, "  %s=%s\n", k, json_string_value(v));
		}
		const char *xml = json_string_value(json_object_get(n, "nccl_topo_xml"));
		if (xml)
			fprintf(f, "  NCCL topology file: %zu bytes (nccl_topo_xml)\n", strlen(xml));
		size_t q;
		json_t *note;
		json_array_foreach(json_object_get(n, "notes"), q, note)
			fprintf(f, "  note: %s\n", json_string_value(note));
	}
	json_t *s = json_object_get(j, "shortfall");
	if (json_is_object(s)) {
		fprintf(f, "short by %lld bytes on rank %lld (%lld bytes over all devices); would fit:\n",
			(long long)jint(s, "bytes", 0), (long long)jint(s, "rank", 0),
			(long long)jint(s, "total_bytes", 0));
		size_t q;
		json_t *sg;
		json_array_foreach(json_object_get(s, "suggestions"), q, sg)
			fprintf(f, "  - %s\n", json_string_value(sg));
	}
	json_array_foreach(json_object_get(j, "warnings"), i, r)
		fprintf(f, "warning: %s\n", json_string_value(r));
	json_decref(j);
}
