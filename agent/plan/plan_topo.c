/*
 * plan_topo.c - the NCCL topology file (NCCL_TOPO_FILE) of a GPU node whose
 * PCI topology NCCL cannot see, as in most VMs: plan_topo_hidden decides from
 * the node's inventory, plan_topo_xml writes the file's text
 * (docs/cluster.md "The environment of each node").
 *
 * Called by plan.c (plan_make, once per GPU node).  Calls jansson and
 * common/buf.  No global state.
 *
 * How NCCL reads the file (NVIDIA/nccl src/graph/xml.cc and topo.cc, 2.30;
 * ../shared/docs/cluster.md section 5.2), which decides what is written:
 *   - it loads the file, then completes each element it reaches from the
 *     node itself: a GPU's <pci> from NVML when its rank opens it, a NIC's
 *     <pci> from sysfs when its net plugin reports the device, and on the
 *     way up the <cpu> above either (arch, vendor, family and model by
 *     cpuid, affinity from numaid); what the file says already is kept;
 *   - a <net name=...> already in the file is taken as found: NCCL then
 *     reads neither its PCI link nor its CPU, and a <cpu> left without
 *     arch and vendor makes topology loading fail.  The inventory knows no
 *     CPU family or model and no PCIe link, so NICs are written as their
 *     PCI functions only (what cloud providers' VM files do) and NCCL fills
 *     in each <net> (its device index, speed, port, GPUDirect support);
 *   - elements nothing reaches (a virtual bridge) must be complete: they get
 *     class and link attributes here;
 *   - elements no rank of a communicator uses are trimmed by NCCL, so the
 *     file lists every GPU and every RDMA device with a usable port.
 *
 * Invariants:
 *   1. only what the inventory says is written; where it says nothing (a
 *      NUMA node, a GPU's compute capability) the attribute is left out for
 *      NCCL to read on the node, or the device goes to the CPU NCCL uses for
 *      unknown ones (numaid -1);
 *   2. every attribute value is a number, a validated PCI address or a CPU
 *      mask built here: no inventory string reaches the XML unchecked;
 *   3. devices that discovery places at PIX or PXB (gpu_links, gpu_nic)
 *      share a virtual bridge, so NCCL finds the same distance: a device
 *      with a PIX partner sits directly under the bridge, one with PXB
 *      partners only behind a second bridge of its own.
 */
#include "agent/plan/plan_impl.h"
#include "common/buf.h"
#include "common/strutil.h"

#include <stdlib.h>
#include <string.h>

#define TOPO_DEVS_MAX 512      /* GPUs plus RDMA devices of one node */
#define TOPO_CPUS_MAX 16384    /* highest CPU number + 1 a cpulist may name */
#define TOPO_ATTR_MAX 255      /* NCCL's longest attribute value */
#define NVSWITCH_TARGET "fffffff:ffff:ff" /* NCCL's name for an NVSwitch it cannot see */
/* A virtual bridge's link to its CPU: PCIe Gen5 x16, what the GPUs and NICs
 * that need a topology file have (Hopper, ConnectX-7).  NCCL cannot read a
 * bridge that is not on the bus, and without these it assumes Gen3. */
#define BRIDGE_LINK_SPEED "32.0 GT/s PCIe"
#define BRIDGE_LINK_WIDTH 16

typedef struct tdev {
	int gpu;           /* 1: gpus[index]; 0: the RDMA device `name` */
	int index;         /* gpus[] position (GPUs) */
	char name[64];     /* RDMA device (NICs) */
	char bus[24];      /* PCI address, lower case */
	int numa;          /* -1 = unknown */
	int ib;            /* InfiniBand link layer (else Ethernet) */
	int parent;        /* union-find over PIX/PXB relations */
	int pix;           /* has a PIX partner */
	const json_t *g;   /* the gpus[] entry (GPUs), borrowed */
} tdev;

static int64_t jint(const json_t *o, const char *k, int64_t dflt)
{
	const json_t *v = json_object_get(o, k);
	return json_is_integer(v) ? json_integer_value(v) : dflt;
}

static const char *jstr(const json_t *o, const char *k)
{
	return json_string_value(json_object_get(o, k));
}

static int is_hex(char c)
{
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* "0000:18:00.0" (4..8 hex digits of domain) into out in lower case; 0 when
 * s is not a PCI address. */
static int busid_norm(const char *s, char *out, size_t size)
{
	size_t n = s ? strlen(s) : 0, d = 0;
	while (d < n && is_hex(s[d]))
		d++;
	if (d < 4 || d > 8 || n != d + 8 || n >= size || s[d] != ':' || !is_hex(s[d + 1]) ||
	    !is_hex(s[d + 2]) || s[d + 3] != ':' || !is_hex(s[d + 4]) || !is_hex(s[d + 5]) ||
	    s[d + 6] != '.' || s[d + 7] < '0' || s[d + 7] > '7')
		return 0;
	for (size_t i = 0; i <= n; i++)
		out[i] = (s[i] >= 'A' && s[i] <= 'F') ? (char)(s[i] - 'A' + 'a') : s[i];
	return 1;
}

static int uf_find(tdev *d, int i)
{
	while (d[i].parent != i)
		i = d[i].parent = d[d[i].parent].parent;
	return i;
}

static void uf_join(tdev *d, int a, int b)
{
	a = uf_find(d, a);
	b = uf_find(d, b);
	if (a != b)
		d[a > b ? a : b].parent = a < b ? a : b; /* the first device is the root */
}

/* Whether port p is usable (ACTIVE and LinkUp, as discovery says). */
static int port_usable(const json_t *p)
{
	return json_is_true(json_object_get(p, "usable"));
}

int plan_topo_hidden(const json_t *inv, char *why, size_t size)
{
	const json_t *gpus = json_object_get(inv, "gpus"), *pci = json_object_get(inv, "pci_gpus");
	const json_t *g, *p;
	size_t i, k;
	int multi_numa = json_array_size(json_object_get(json_object_get(inv, "host"),
							 "numa_nodes")) > 1;
	/* a GPU the node's PCI bus does not show: NCCL cannot walk to it */
	json_array_foreach(gpus, i, g) {
		const char *bus = jstr(g, "bus_id");
		int seen = 0;
		json_array_foreach(pci, k, p) {
			const char *pb = jstr(p, "bus_id");
			if (bus && pb && strcmp(bus, pb) == 0)
				seen = 1;
		}
		if (!seen) {
			snprintf(why, size, "GPU %zu (%s) is not on the PCI bus its sysfs shows", i,
				 bus ? bus : "no bus id");
			return 1;
		}
	}
	/* devices without a NUMA node on a host with several */
	if (multi_numa) {
		json_array_foreach(gpus, i, g) {
			if (!json_is_integer(json_object_get(g, "numa_node"))) {
				snprintf(why, size, "GPU %zu has no NUMA node on a host with several", i);
				return 1;
			}
		}
		json_array_foreach(json_object_get(inv, "ib_ports"), i, p) {
			/* one without a PCI address is NCCL's to place either way */
			if (port_usable(p) && jstr(p, "bus_id") &&
			    !json_is_integer(json_object_get(p, "numa_node"))) {
				snprintf(why, size, "RDMA device %s has no NUMA node on a host with "
					 "several", jstr(p, "device") ? jstr(p, "device") : "?");
				return 1;
			}
		}
	}
	/* Nothing else: a GPU-NIC distance is unknown only for a device named
	 * above, and a node whose only gap is an RDMA device without a PCI
	 * address gains nothing, as the file leaves such a device to NCCL. */
	return 0;
}

/* Parses a cpulist ("0-55,112-167") into the bitset cpus (TOPO_CPUS_MAX
 * bits); *top gets the highest CPU + 1.  0 when malformed. */
static int cpulist_parse(const char *s, uint32_t *cpus, int *top)
{
	const char *c = s;
	while (*c) {
		char *end;
		long a = strtol(c, &end, 10), b;
		if (end == c || a < 0 || a >= TOPO_CPUS_MAX)
			return 0;
		c = end;
		b = a;
		if (*c == '-') {
			b = strtol(c + 1, &end, 10);
			if (end == c + 1 || b < a || b >= TOPO_CPUS_MAX)
				return 0;
			c = end;
		}
		for (long x = a; x <= b; x++)
			cpus[x / 32] |= 1u << (x % 32);
		if (b + 1 > *top)
			*top = (int)b + 1;
		if (*c == ',')
			c++;
		else if (*c)
			return 0;
	}
	return 1;
}

/* The affinity mask of numaid (-1: every CPU of the host) as NCCL and the
 * kernel's cpumap write it: 32-bit hex words, most significant first.  ""
 * when the inventory has no CPU list for it or the mask would be longer than
 * NCCL takes (NCCL then reads it on the node). */
static int affinity_of(const json_t *inv, int numaid, const char *who, char *out, size_t size,
		       ds_err *err)
{
	uint32_t all[TOPO_CPUS_MAX / 32] = {0}, one[TOPO_CPUS_MAX / 32] = {0};
	int top = 0, found = 0;
	size_t i;
	const json_t *nn;
	out[0] = '\0';
	json_array_foreach(json_object_get(json_object_get(inv, "host"), "numa_nodes"), i, nn) {
		const char *cl = jstr(nn, "cpulist");
		int id = (int)jint(nn, "id", -2);
		if (!cl || !cl[0])
			continue;
		if (!cpulist_parse(cl, all, &top))
			return ds_err_set(err, DS_EFORMAT, "%s: NUMA node %d: cpulist '%.40s' is not "
					  "a list of CPUs", who, id, cl);
		if (id == numaid || numaid < 0) {
			int t = 0;
			cpulist_parse(cl, one, &t);
			found = 1;
		}
	}
	int words = (top + 31) / 32; /* the host's width, as every node's cpumap has it */
	if (!found || words * 9 - 1 > TOPO_ATTR_MAX || (size_t)(words * 9) > size)
		return DS_OK;
	size_t at = 0;
	for (int w = words - 1; w >= 0; w--)
		at += (size_t)snprintf(out + at, size - at, "%08x%s", one[w], w ? "," : "");
	return DS_OK;
}

/* Where a device or group goes: the NUMA node, or on a host with one NUMA
 * node (or none listed) that node, else -1. */
static int cpu_of(const json_t *inv, int numa)
{
	const json_t *nodes = json_object_get(json_object_get(inv, "host"), "numa_nodes");
	if (numa >= 0)
		return numa;
	if (json_array_size(nodes) <= 1)
		return (int)jint(json_array_get(nodes, 0), "id", 0);
	return -1;
}

/* Adds the GPU devices and the RDMA devices with a usable port. */
static int collect(const json_t *inv, const char *who, json_t *notes, tdev *d, int *n,
		   ds_err *err)
{
	size_t i;
	const json_t *g, *p;
	json_array_foreach(json_object_get(inv, "gpus"), i, g) {
		if (*n == TOPO_DEVS_MAX)
			return ds_err_set(err, DS_EFORMAT, "%s: more than %d devices", who,
					  TOPO_DEVS_MAX);
		tdev *t = &d[*n];
		memset(t, 0, sizeof *t);
		t->gpu = 1;
		t->index = (int)i;
		t->g = g;
		t->numa = (int)jint(g, "numa_node", -1);
		if (!busid_norm(jstr(g, "bus_id"), t->bus, sizeof t->bus))
			return ds_err_set(err, DS_EFORMAT, "%s: gpu %zu: bus_id '%.40s' is not a PCI "
					  "address", who, i, jstr(g, "bus_id") ? jstr(g, "bus_id") : "");
		t->parent = (*n)++;
	}
	json_array_foreach(json_object_get(inv, "ib_ports"), i, p) {
		const char *dev = jstr(p, "device"), *bus = jstr(p, "bus_id");
		int dup = 0;
		if (!dev || !port_usable(p))
			continue;
		for (int k = 0; k < *n; k++)
			dup |= !d[k].gpu && strcmp(d[k].name, dev) == 0;
		if (dup)
			continue;
		if (!bus) {
			char m[200];
			snprintf(m, sizeof m, "RDMA device %.64s has no PCI address: the topology file "
				 "leaves it to NCCL (which puts it on the first CPU)", dev);
			if (json_array_append_new(notes, json_string(m)))
				return DS_ENOMEM;
			continue;
		}
		if (*n == TOPO_DEVS_MAX)
			return ds_err_set(err, DS_EFORMAT, "%s: more than %d devices", who,
					  TOPO_DEVS_MAX);
		tdev *t = &d[*n];
		memset(t, 0, sizeof *t);
		t->index = -1;
		ds_strlcpy(t->name, dev, sizeof t->name);
		t->numa = (int)jint(p, "numa_node", -1);
		const char *ll = jstr(p, "link_layer");
		t->ib = !ll || strcmp(ll, "Ethernet") != 0;
		if (!busid_norm(bus, t->bus, sizeof t->bus))
			return ds_err_set(err, DS_EFORMAT, "%s: RDMA device %.64s: bus_id '%.40s' is "
					  "not a PCI address", who, dev, bus);
		t->parent = (*n)++;
	}
	return DS_OK;
}

/* Invariant 3: joins devices discovery places at PIX or PXB. */
static void relate(const json_t *inv, tdev *d, int n)
{
	size_t i;
	const json_t *e;
	json_array_foreach(json_object_get(inv, "gpu_links"), i, e) {
		const char *lv = jstr(e, "level");
		int a = (int)jint(e, "a", -1), b = (int)jint(e, "b", -1), ia = -1, ib = -1;
		if (!lv || (strcmp(lv, "PIX") != 0 && strcmp(lv, "PXB") != 0))
			continue;
		for (int k = 0; k < n; k++) {
			if (d[k].gpu && d[k].index == a)
				ia = k;
			if (d[k].gpu && d[k].index == b)
				ib = k;
		}
		if (ia < 0 || ib < 0 || ia == ib)
			continue;
		uf_join(d, ia, ib);
		if (strcmp(lv, "PIX") == 0)
			d[ia].pix = d[ib].pix = 1;
	}
	json_array_foreach(json_object_get(inv, "gpu_nic"), i, e) {
		const char *lv = jstr(e, "level"), *nic = jstr(e, "nic");
		int g = (int)jint(e, "gpu", -1), ig = -1, in = -1;
		if (!lv || !nic || (strcmp(lv, "PIX") != 0 && strcmp(lv, "PXB") != 0))
			continue;
		for (int k = 0; k < n; k++) {
			if (d[k].gpu && d[k].index == g)
				ig = k;
			if (!d[k].gpu && strcmp(d[k].name, nic) == 0)
				in = k;
		}
		if (ig < 0 || in < 0)
			continue;
		uf_join(d, ig, in);
		if (strcmp(lv, "PIX") == 0)
			d[ig].pix = d[in].pix = 1;
	}
}

/* Writes one GPU or NIC function at indent. */
static int put_dev(buf *b, const json_t *inv, const tdev *d, int n, const tdev *t, int indent)
{
	int rc;
	if (!t->gpu)
		return buf_printf(b, "%*s<pci busid=\"%s\" class=\"%s\"/>\n", indent, "", t->bus,
				  t->ib ? "0x020700" : "0x020000");
	/* dev is NVML's index, as NCCL writes it; sm from the compute capability */
	int64_t dev = jint(t->g, "nvml_index", -1);
	const char *cc = jstr(t->g, "compute_capability");
	char sm[16] = "";
	if (dev < 0)
		dev = t->index;
	if (cc) {
		char *dot = NULL, *end = NULL;
		long ma = strtol(cc, &dot, 10);
		if (dot != cc && *dot == '.' && ma >= 0 && ma < 100) {
			long mi = strtol(dot + 1, &end, 10);
			if (end != dot + 1 && *end == '\0' && mi >= 0 && mi < 10)
				snprintf(sm, sizeof sm, " sm=\"%ld\"", ma * 10 + mi);
		}
	}
	if ((rc = buf_printf(b, "%*s<pci busid=\"%s\" class=\"0x030200\">\n", indent, "", t->bus)) ||
	    (rc = buf_printf(b, "%*s<gpu dev=\"%lld\"%s>\n", indent + 2, "", (long long)dev, sm)))
		return rc;
	/* NVLinks: to each GPU joined directly, and the rest to NVSwitches */
	int64_t total = jint(t->g, "nvlinks", 0), direct = 0;
	size_t i;
	const json_t *e;
	json_array_foreach(json_object_get(inv, "gpu_links"), i, e) {
		const char *lv = jstr(e, "level");
		int a = (int)jint(e, "a", -1), bb = (int)jint(e, "b", -1);
		int64_t cnt = jint(e, "nvlinks", 0);
		if (!lv || strncmp(lv, "NV", 2) != 0 || json_is_true(json_object_get(e, "nvswitch")) ||
		    cnt <= 0 || (a != t->index && bb != t->index))
			continue;
		int other = a == t->index ? bb : a;
		for (int k = 0; k < n; k++) {
			if (!d[k].gpu || d[k].index != other)
				continue;
			if ((rc = buf_printf(b, "%*s<nvlink target=\"%s\" count=\"%lld\" "
					     "tclass=\"0x030200\"/>\n", indent + 4, "", d[k].bus,
					     (long long)cnt)))
				return rc;
			direct += cnt;
		}
	}
	if (json_is_true(json_object_get(t->g, "nvswitch")) && total > direct &&
	    (rc = buf_printf(b, "%*s<nvlink target=\"%s\" count=\"%lld\" tclass=\"0x068000\"/>\n",
			     indent + 4, "", NVSWITCH_TARGET, (long long)(total - direct))))
		return rc;
	if ((rc = buf_printf(b, "%*s</gpu>\n", indent + 2, "")))
		return rc;
	return buf_printf(b, "%*s</pci>\n", indent, "");
}

/* Opens virtual bridge number *bridges (invariant 3) at indent. */
static int put_bridge_open(buf *b, int domain, int *bridges, int indent, const char *who,
			   ds_err *err)
{
	int k = (*bridges)++;
	if (k >= 32 * 0x100)
		return ds_err_set(err, DS_ERANGE, "%s: more than %d groups of PCI devices", who,
				  32 * 0x100);
	return buf_printf(b, "%*s<pci busid=\"%04x:%02x:%02x.0\" class=\"0x060400\" "
			  "link_speed=\"%s\" link_width=\"%d\">\n", indent, "", domain,
			  0xff - k / 32, k % 32, BRIDGE_LINK_SPEED, BRIDGE_LINK_WIDTH);
}

/* Writes the devices of CPU id: single devices as they are, each group of
 * devices under its bridge (invariant 3), in device order. */
static int put_cpu(buf *b, const json_t *inv, const tdev *d, int n, const int *cpu, int id,
		   int domain, int *bridges, const char *who, ds_err *err)
{
	char aff[TOPO_ATTR_MAX + 1];
	int rc = affinity_of(inv, id, who, aff, sizeof aff, err);
	if (rc)
		return rc;
	if ((rc = aff[0] ? buf_printf(b, "  <cpu numaid=\"%d\" affinity=\"%s\">\n", id, aff)
			 : buf_printf(b, "  <cpu numaid=\"%d\">\n", id)))
		return rc;
	for (int i = 0; i < n; i++) {
		if (cpu[i] != id)
			continue;
		int r = d[i].parent, size = 0;
		for (int k = 0; k < n; k++)
			size += d[k].parent == r;
		if (size == 1) {
			if ((rc = put_dev(b, inv, d, n, &d[i], 4)))
				return rc;
			continue;
		}
		if (r != i) /* a group is written where its first device comes */
			continue;
		if ((rc = put_bridge_open(b, domain, bridges, 4, who, err)))
			return rc;
		for (int k = 0; k < n; k++) {
			if (d[k].parent != r)
				continue;
			if (d[k].pix)
				rc = put_dev(b, inv, d, n, &d[k], 6);
			else if (!(rc = put_bridge_open(b, domain, bridges, 6, who, err)) &&
				 !(rc = put_dev(b, inv, d, n, &d[k], 8)))
				rc = buf_puts(b, "      </pci>\n");
			if (rc)
				return rc;
		}
		if ((rc = buf_puts(b, "    </pci>\n")))
			return rc;
	}
	return buf_puts(b, "  </cpu>\n");
}

static int cmp_cpu(const void *a, const void *b)
{
	int x = *(const int *)a, y = *(const int *)b;
	if ((x < 0) != (y < 0))
		return x < 0 ? 1 : -1; /* the unknown CPU last */
	return (x > y) - (x < y);
}

int plan_topo_xml(const json_t *inv, const char *who, json_t *notes, char **out, ds_err *err)
{
	tdev *d = calloc(TOPO_DEVS_MAX, sizeof *d);
	int *cpu = calloc(TOPO_DEVS_MAX, sizeof *cpu), *gnuma = calloc(TOPO_DEVS_MAX, sizeof *gnuma);
	int *ids = calloc(TOPO_DEVS_MAX, sizeof *ids);
	int n = 0, n_ids = 0, bridges = 0, rc;
	buf b;
	*out = NULL;
	buf_init(&b, PLAN_TOPO_XML_MAX);
	if (!d || !cpu || !gnuma || !ids) {
		rc = ds_err_set(err, DS_ENOMEM, "out of memory");
		goto out;
	}
	if ((rc = collect(inv, who, notes, d, &n, err)) != DS_OK)
		goto out;
	relate(inv, d, n);
	for (int i = 0; i < n; i++) /* from here on, parent is the group's first device */
		d[i].parent = uf_find(d, i);
	/* a group's NUMA node: that of its first device with a known one */
	for (int i = 0; i < n; i++)
		gnuma[i] = -1;
	for (int i = 0; i < n; i++)
		if (gnuma[d[i].parent] < 0)
			gnuma[d[i].parent] = d[i].numa;
	for (int i = 0; i < n; i++) {
		cpu[i] = cpu_of(inv, gnuma[d[i].parent]);
		int seen = 0;
		for (int k = 0; k < n_ids; k++)
			seen |= ids[k] == cpu[i];
		if (!seen)
			ids[n_ids++] = cpu[i];
	}
	qsort(ids, (size_t)n_ids, sizeof *ids, cmp_cpu);
	/* virtual bridges take a PCI domain no device of the node has */
	int domain = 0xffff;
	for (int i = 0; i < n; i++)
		if (strtol(d[i].bus, NULL, 16) == domain) {
			domain--;
			i = -1;
		}
	if ((rc = buf_puts(&b, "<system version=\"1\">\n")))
		goto out;
	for (int k = 0; k < n_ids; k++)
		if ((rc = put_cpu(&b, inv, d, n, cpu, ids[k], domain, &bridges, who, err)))
			goto out;
	if ((rc = buf_puts(&b, "</system>\n")))
		goto out;
	if (!(*out = buf_take(&b)))
		rc = ds_err_set(err, DS_ENOMEM, "out of memory");
out:
	if (rc == DS_ERANGE && err && !err->msg[0])
		ds_err_set(err, DS_ERANGE, "%s: its NCCL topology file would pass %zu bytes", who,
			   (size_t)PLAN_TOPO_XML_MAX);
	buf_free(&b);
	free(ids);
	free(gnuma);
	free(cpu);
	free(d);
	return rc;
}
