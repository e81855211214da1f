/*
 * discover_pci.c - discovery of the PCI tree: bus ids, NVIDIA display
 * functions, each GPU's sysfs path and NUMA node, and the distances between
 * GPUs and from GPUs to RDMA devices (NVLink, the PCI path, NVML's common
 * ancestor, else NUMA), with the nvidia-smi topo level names.
 *
 * Callers: disc_run (discover.c); discover_nvml.c (GPU slots, sysfs paths)
 * and discover_net.c (device NUMA nodes); disc_busid_normalize and
 * disc_pci_level are public (discover.h, tests).  Calls: the files under the
 * sysroot (discover.c helpers), disc_nvml_level.
 *
 * Invariants: discover.c's 1-4.  A link's level comes from the first source
 * that knows it, in the order NVLink, sysfs, NVML, NUMA; its source says which.
 *
 * Threading: one scan per thread.
 */
#include "agent/node/discover_impl.h"
#include "common/hex.h"
#include "common/strutil.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- bus ids and PCI paths ---- */

/* n hex digits (1..max) into *v; returns the count consumed, 0 on none. */
static int hexn(const char *p, int max, unsigned long *v)
{
	int k = 0;
	*v = 0;
	while (k < max && ds_hex_digit(p[k]) >= 0) {
		*v = *v * 16 + (unsigned long)ds_hex_digit(p[k]);
		k++;
	}
	return ds_hex_digit(p[k]) >= 0 ? 0 : k;
}

int disc_busid_normalize(const char *in, char *out, size_t size)
{
	if (!in)
		return DS_EFORMAT;
	unsigned long dom = 0, bus, dev, fn;
	const char *p = in;
	int colons = 0;
	for (const char *q = in; *q; q++)
		colons += *q == ':';
	if (colons == 2) {
		int k = hexn(p, 8, &dom);
		if (!k || p[k] != ':')
			return DS_EFORMAT;
		p += k + 1;
	} else if (colons != 1) {
		return DS_EFORMAT;
	}
	int k = hexn(p, 2, &bus);
	if (!k || p[k] != ':')
		return DS_EFORMAT;
	p += k + 1;
	k = hexn(p, 2, &dev);
	if (!k || p[k] != '.' || dev > 0x1f)
		return DS_EFORMAT;
	p += k + 1;
	k = hexn(p, 1, &fn);
	if (!k || p[k] != '\0' || fn > 7)
		return DS_EFORMAT;
	int n = snprintf(out, size, "%04lx:%02lx:%02lx.%lx", dom, bus, dev, fn);
	return n > 0 && (size_t)n < size ? DS_OK : DS_ERANGE;
}

/* Splits "/sys/devices/pciD:B/c1/.../dev" into components after /sys/devices/. */
static int split_sys_path(const char *path, char *buf, size_t size, char **comp, int max)
{
	if (!path || strncmp(path, "/sys/devices/", 13) != 0 ||
	    ds_strlcpy(buf, path + 13, size) >= size)
		return -1;
	int n = 0;
	char *save = NULL;
	for (char *t = strtok_r(buf, "/", &save); t; t = strtok_r(NULL, "/", &save)) {
		if (n == max)
			return -1;
		comp[n++] = t;
	}
	if (n < 2 || strncmp(comp[0], "pci", 3) != 0)
		return -1;
	return n;
}

disc_level disc_pci_level(const char *path_a, const char *path_b, int same_numa)
{
	char ba[PATH_MAX], bb[PATH_MAX];
	char *ca[PATH_COMPONENTS_MAX], *cb[PATH_COMPONENTS_MAX];
	int na = split_sys_path(path_a, ba, sizeof ba, ca, PATH_COMPONENTS_MAX);
	int nb = split_sys_path(path_b, bb, sizeof bb, cb, PATH_COMPONENTS_MAX);
	if (na < 0 || nb < 0)
		return DISC_LEVEL_UNKNOWN;
	if (strcmp(ca[0], cb[0]) != 0)
		return same_numa ? DISC_LEVEL_NODE : DISC_LEVEL_SYS;
	/* bridges: components 1 .. n-2; the device itself is the last one */
	int la = na - 2, lb = nb - 2, k = 0;
	while (k < la && k < lb && strcmp(ca[1 + k], cb[1 + k]) == 0)
		k++;
	if (k == 0)
		return DISC_LEVEL_PHB;
	return la - k <= 1 && lb - k <= 1 ? DISC_LEVEL_PIX : DISC_LEVEL_PXB;
}

/* ---- PCI -------------------------------------------------------------------------- */

static int parse_hex(const char *s, unsigned long max, unsigned long *out)
{
	if (strncmp(s, "0x", 2) != 0)
		return DS_EFORMAT;
	int k = hexn(s + 2, 8, out);
	return k && s[2 + k] == '\0' && *out <= max ? DS_OK : DS_EFORMAT;
}

/* numa_node of a device directory (relative to the root); DISC_NONE when
 * absent or -1; a malformed value is noted. */
int disc_dev_numa(scan *s, const char *src, const char *what, const char *dir_rel)
{
	char b[64];
	int v;
	if (disc_rd(s, b, sizeof b, "%s/numa_node", dir_rel) != DS_OK)
		return DISC_NONE;
	if (ds_parse_int(b, -1, 1 << 16, &v) != DS_OK) {
		disc_note_add(s, src, "%s: numa_node '%.40s' is not a number", what, b);
		return DISC_NONE;
	}
	return v < 0 ? DISC_NONE : v;
}

static int cmp_pci_gpu(const void *a, const void *b)
{
	return strcmp(((const disc_pci_gpu *)a)->bus_id, ((const disc_pci_gpu *)b)->bus_id);
}

void disc_pci_scan(scan *s)
{
	disc_inventory *inv = s->inv;
	names ns;
	if (disc_list_dir(s, &ns, 1 << 16, "/sys/bus/pci/devices") != DS_OK) {
		disc_note_add(s, "pci", "/sys/bus/pci/devices: not found");
		return;
	}
	for (size_t i = 0; i < ns.n; i++) {
		char bdf[DISC_BUSID_SIZE], b[64], dir[128];
		unsigned long vendor, cls, device;
		if (disc_busid_normalize(ns.v[i], bdf, sizeof bdf) != DS_OK)
			continue;
		snprintf(dir, sizeof dir, "/sys/bus/pci/devices/%s", ns.v[i]);
		if (disc_rd(s, b, sizeof b, "%s/vendor", dir) != DS_OK || parse_hex(b, 0xffff, &vendor) ||
		    vendor != 0x10de)
			continue;
		if (disc_rd(s, b, sizeof b, "%s/class", dir) != DS_OK || parse_hex(b, 0xffffff, &cls)) {
			disc_note_add(s, "pci", "%s: NVIDIA function with an unreadable class '%.20s'", bdf, b);
			continue;
		}
		if (cls >> 16 != 0x03) /* display controllers only: not NVSwitches, not audio */
			continue;
		if (disc_rd(s, b, sizeof b, "%s/device", dir) != DS_OK || parse_hex(b, 0xffff, &device)) {
			disc_note_add(s, "pci", "%s: device id '%.20s' is not 0xNNNN", bdf, b);
			device = 0;
		}
		disc_pci_gpu *g = disc_grow(s, &inv->pci_gpus, &inv->n_pci_gpus, &s->cap_pci, sizeof *g,
				       PCI_GPUS_MAX);
		if (!g)
			break;
		ds_strlcpy(g->bus_id, bdf, sizeof g->bus_id);
		g->vendor = (unsigned)vendor;
		g->device = (unsigned)device;
		g->numa_node = disc_dev_numa(s, "pci", bdf, dir);
	}
	disc_names_free(&ns);
	if (inv->n_pci_gpus)
		qsort(inv->pci_gpus, inv->n_pci_gpus, sizeof *inv->pci_gpus, cmp_pci_gpu);
}

/* Fills gs->path and, when the sysfs device is there, gs->g.numa_node. */
void disc_gpu_sysfs(scan *s, gscan *gs)
{
	char rel[128];
	snprintf(rel, sizeof rel, "/sys/bus/pci/devices/%s", gs->g.bus_id);
	if (disc_sys_resolve(s, rel, gs->path, sizeof gs->path) != DS_OK) {
		gs->path[0] = '\0';
		return;
	}
	int numa = disc_dev_numa(s, "gpus", gs->g.bus_id, rel);
	if (numa != DISC_NONE)
		gs->g.numa_node = numa;
}

gscan *disc_gscan_add(scan *s)
{
	gscan *g = disc_grow(s, &s->gs, &s->n_gs, &s->cap_gs, sizeof *g, DISC_GPUS_MAX);
	if (!g)
		return NULL;
	disc_gpu *d = &g->g;
	d->nvml_index = d->numa_node = d->cc_major = d->cc_minor = DISC_NONE;
	d->memory_total_bytes = DISC_NONE;
	disc_gpu_health *h = &d->health;
	h->temperature_c = h->power_mw = h->memory_used_bytes = DISC_NONE;
	h->ecc_uncorrected_volatile = h->ecc_uncorrected_aggregate = DISC_NONE;
	h->retired_pages_sbe = h->retired_pages_dbe = DISC_NONE;
	h->remapped_rows_correctable = h->remapped_rows_uncorrectable = DISC_NONE;
	h->remapped_rows_pending = h->remapped_rows_failed = DISC_NONE;
	return g;
}

/* ---- links and distances ------------------------------------------------------------------- */

static int host_same_numa(const scan *s, int a, int b)
{
	return s->inv->host.n_numa <= 1 || (a >= 0 && a == b);
}

void disc_links_build(scan *s, nvml_api *nv)
{
	disc_inventory *inv = s->inv;
	for (size_t a = 0; a < s->n_gs; a++) {
		for (size_t b = a + 1; b < s->n_gs; b++) {
			gscan *ga = &s->gs[a], *gb = &s->gs[b];
			disc_gpu_link *l = disc_grow(s, &inv->links, &inv->n_links, &s->cap_links, sizeof *l,
						DISC_GPUS_MAX * DISC_GPUS_MAX / 2);
			if (!l)
				return;
			l->a = (int)a;
			l->b = (int)b;
			/* direct links counted from a's side, else b's */
			int direct = 0;
			for (int k = 0; k < ga->nvl_gpu_n; k++)
				direct += !strcmp(ga->nvl_gpu_bus[k], gb->g.bus_id);
			if (!direct)
				for (int k = 0; k < gb->nvl_gpu_n; k++)
					direct += !strcmp(gb->nvl_gpu_bus[k], ga->g.bus_id);
			int sw = ga->nvl_switch < gb->nvl_switch ? ga->nvl_switch : gb->nvl_switch;
			int pa = ga->g.numa_node, pb = gb->g.numa_node;
			if (direct || sw) {
				l->level = DISC_LEVEL_NV;
				l->nvlinks = direct ? direct : sw;
				l->nvswitch = !direct;
				l->source = DISC_SRC_NVLINK;
			} else if (ga->path[0] && gb->path[0] &&
				   (l->level = disc_pci_level(ga->path, gb->path,
							      host_same_numa(s, pa, pb))) !=
					   DISC_LEVEL_UNKNOWN) {
				l->source = DISC_SRC_SYSFS;
			} else if (disc_nvml_level(nv, ga, gb, &l->level)) {
				l->source = DISC_SRC_NVML;
			} else if (s->inv->host.n_numa <= 1 || (pa >= 0 && pb >= 0)) {
				l->level = host_same_numa(s, pa, pb) ? DISC_LEVEL_NODE : DISC_LEVEL_SYS;
				l->source = DISC_SRC_NUMA;
			} else {
				l->level = DISC_LEVEL_UNKNOWN;
				l->source = DISC_SRC_NONE;
			}
		}
	}
}

void disc_gpu_nic_build(scan *s)
{
	disc_inventory *inv = s->inv;
	for (size_t g = 0; g < s->n_gs; g++) {
		for (size_t i = 0; i < s->n_ib; i++) {
			const gscan *gs = &s->gs[g];
			const ibdev *d = &s->ib[i];
			disc_gpu_nic *e = disc_grow(s, &inv->gpu_nic, &inv->n_gpu_nic, &s->cap_gn, sizeof *e,
					       DISC_GPUS_MAX * 1024);
			if (!e)
				return;
			e->gpu = (int)g;
			ds_strlcpy(e->nic, d->name, sizeof e->nic);
			int pa = gs->g.numa_node, pb = d->numa;
			e->level = DISC_LEVEL_UNKNOWN;
			e->source = DISC_SRC_NONE;
			if (gs->path[0] && d->path[0] &&
			    (e->level = disc_pci_level(gs->path, d->path, host_same_numa(s, pa, pb))) !=
				    DISC_LEVEL_UNKNOWN) {
				e->source = DISC_SRC_SYSFS;
			} else if (s->inv->host.n_numa <= 1 || (pa >= 0 && pb >= 0)) {
				e->level = host_same_numa(s, pa, pb) ? DISC_LEVEL_NODE : DISC_LEVEL_SYS;
				e->source = DISC_SRC_NUMA;
			}
		}
	}
}

/* GPUs on the PCI bus that the GPU source does not list, or that are unusable. */
void disc_gpus_cross_check(scan *s)
{
	disc_inventory *inv = s->inv;
	if (inv->gpu_kind == DISC_GPUS_NONE) {
		if (inv->n_pci_gpus)
			disc_note_add(s, "gpus", "%zu NVIDIA GPUs on the PCI bus are unusable without NVML: "
					"CPU ranks only", inv->n_pci_gpus);
		return;
	}
	for (size_t i = 0; i < inv->n_pci_gpus; i++) {
		int found = 0;
		for (size_t k = 0; k < s->n_gs; k++)
			found |= !strcmp(s->gs[k].g.bus_id, inv->pci_gpus[i].bus_id);
		if (!found)
			disc_note_add(s, "gpus", "%s is an NVIDIA GPU on the PCI bus that %s does not list",
			     inv->pci_gpus[i].bus_id,
			     inv->gpu_kind == DISC_GPUS_FAKE ? "--fake-gpus" : "NVML");
	}
}

