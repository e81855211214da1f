/*
 * discover_host.c - discovery of the host: hostname, CPU model, sockets and
 * cores (/proc/cpuinfo), memory (/proc/meminfo), NUMA nodes with their CPUs
 * and memory (/sys/devices/system/node), and the cpulist parser.
 *
 * Callers: disc_run (discover.c) through disc_host_scan; disc_cpulist_count
 * is public (discover.h, tests).  Calls: the files under the sysroot
 * (discover.c helpers).
 *
 * Invariants: discover.c's 1-4 (only the sysroot is read, nothing missing
 * fails the run, arrays are capped, output sorted).  /proc files report no
 * size, so they are read to their end with getline, not with the fixed-size
 * readers of common/fileutil.
 *
 * Threading: one scan per thread.
 */
#include "agent/node/discover_impl.h"
#include "common/strutil.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- parsers ---- */

int disc_cpulist_count(const char *s, int *count)
{
	if (!s)
		return DS_EFORMAT;
	int total = 0;
	const char *p = s;
	if (!*p) {
		*count = 0;
		return DS_OK;
	}
	for (;;) {
		long a = 0, b;
		if (!isdigit((unsigned char)*p))
			return DS_EFORMAT;
		while (isdigit((unsigned char)*p)) {
			a = a * 10 + (*p++ - '0');
			if (a > 1 << 20)
				return DS_EFORMAT;
		}
		b = a;
		if (*p == '-') {
			p++;
			if (!isdigit((unsigned char)*p))
				return DS_EFORMAT;
			b = 0;
			while (isdigit((unsigned char)*p)) {
				b = b * 10 + (*p++ - '0');
				if (b > 1 << 20)
					return DS_EFORMAT;
			}
			if (b < a)
				return DS_EFORMAT;
		}
		total += (int)(b - a + 1);
		if (total > 1 << 20)
			return DS_EFORMAT;
		if (*p == '\0')
			break;
		if (*p++ != ',')
			return DS_EFORMAT;
	}
	*count = total;
	return DS_OK;
}

/* ---- host ----------------------------------------------------------------------- */

/* "<digits> kB" (spaces before allowed) into bytes. */
static int parse_kb(const char *v, int64_t *bytes)
{
	while (*v == ' ' || *v == '\t')
		v++;
	char num[32];
	size_t n = 0;
	while (isdigit((unsigned char)v[n]) && n < sizeof num - 1) {
		num[n] = v[n];
		n++;
	}
	num[n] = '\0';
	int64_t kb;
	if (n == 0 || strcmp(v + n, " kB") != 0 ||
	    ds_parse_i64(num, 0, INT64_MAX / 1024, &kb) != DS_OK)
		return DS_EFORMAT;
	*bytes = kb * 1024;
	return DS_OK;
}

static void host_hostname(scan *s)
{
	disc_host *h = &s->inv->host;
	if (s->live) {
		char b[256] = "";
		if (gethostname(b, sizeof b - 1) == 0)
			ds_strlcpy(h->hostname, b, sizeof h->hostname);
		else
			disc_note_add(s, "host", "gethostname: %s", strerror(errno));
		return;
	}
	char b[512];
	int rc = disc_rd(s, b, sizeof b, "/etc/hostname");
	if (rc) {
		disc_note_add(s, "host", "/etc/hostname: %s", rc == DS_ENOTFOUND ? "not found" : strerror(errno));
		return;
	}
	char *nl = strchr(b, '\n');
	if (nl)
		*nl = '\0';
	ds_strlcpy(h->hostname, b, sizeof h->hostname);
}

static void host_cpuinfo(scan *s)
{
	disc_host *h = &s->inv->host;
	char path[PATH_MAX];
	h->cpus = h->sockets = DISC_NONE;
	if (disc_path_of(s, path, sizeof path, "/proc/cpuinfo"))
		return;
	FILE *f = fopen(path, "re");
	if (!f) {
		disc_note_add(s, "host", "/proc/cpuinfo: %s", strerror(errno));
		return;
	}
	int ids[SOCKETS_MAX], n_ids = 0, cpus = 0, bad_ids = 0;
	char *line = NULL;
	size_t cap = 0;
	ssize_t len;
	while ((len = getline(&line, &cap, f)) >= 0) {
		while (len > 0 && isspace((unsigned char)line[len - 1]))
			line[--len] = '\0';
		char *colon = strchr(line, ':');
		if (!colon)
			continue;
		char *v = colon + 1;
		while (*v == ' ' || *v == '\t')
			v++;
		char *ke = colon;
		while (ke > line && (ke[-1] == ' ' || ke[-1] == '\t'))
			ke--;
		*ke = '\0';
		if (!strcmp(line, "processor")) {
			cpus++;
		} else if (!strcmp(line, "model name") && !h->cpu_model[0]) {
			ds_strlcpy(h->cpu_model, v, sizeof h->cpu_model);
		} else if (!strcmp(line, "physical id")) {
			int id;
			if (ds_parse_int(v, 0, 1 << 20, &id) != DS_OK) {
				bad_ids++;
				continue;
			}
			int seen = 0;
			for (int i = 0; i < n_ids; i++)
				seen |= ids[i] == id;
			if (!seen && n_ids < SOCKETS_MAX)
				ids[n_ids++] = id;
		}
	}
	free(line);
	fclose(f);
	if (cpus > 0)
		h->cpus = cpus;
	else
		disc_note_add(s, "host", "/proc/cpuinfo: no 'processor' lines");
	if (!h->cpu_model[0])
		disc_note_add(s, "host", "/proc/cpuinfo: no 'model name' line");
	if (bad_ids)
		disc_note_add(s, "host", "/proc/cpuinfo: %d 'physical id' values are not numbers", bad_ids);
	else if (n_ids > 0)
		h->sockets = n_ids;
}

static void host_meminfo(scan *s)
{
	disc_host *h = &s->inv->host;
	h->memory_bytes = DISC_NONE;
	char b[8192];
	int rc = disc_rd(s, b, sizeof b, "/proc/meminfo");
	if (rc) {
		disc_note_add(s, "host", "/proc/meminfo: %s", rc == DS_ENOTFOUND ? "not found" : strerror(errno));
		return;
	}
	char *save = NULL;
	for (char *l = strtok_r(b, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
		if (strncmp(l, "MemTotal:", 9) != 0)
			continue;
		if (parse_kb(l + 9, &h->memory_bytes) != DS_OK) {
			h->memory_bytes = DISC_NONE;
			disc_note_add(s, "host", "/proc/meminfo: MemTotal '%.60s' is not '<N> kB'", l + 9);
		}
		return;
	}
	disc_note_add(s, "host", "/proc/meminfo: no MemTotal line");
}

static int cmp_numa(const void *a, const void *b)
{
	const disc_numa *x = a, *y = b;
	return (x->id > y->id) - (x->id < y->id);
}

static void host_numa(scan *s)
{
	disc_host *h = &s->inv->host;
	names ns;
	if (disc_list_dir(s, &ns, 4096, "/sys/devices/system/node") != DS_OK) {
		disc_note_add(s, "numa", "/sys/devices/system/node: not found (no NUMA information)");
		return;
	}
	for (size_t i = 0; i < ns.n; i++) {
		int id;
		const char *nm = ns.v[i];
		if (strncmp(nm, "node", 4) != 0 || !isdigit((unsigned char)nm[4]) ||
		    ds_parse_int(nm + 4, 0, 1 << 16, &id) != DS_OK)
			continue;
		disc_numa *n = disc_grow(s, &h->numa, &h->n_numa, &s->cap_numa, sizeof *n, NUMA_MAX);
		if (!n) {
			if (!s->oom)
				disc_note_add(s, "numa", "more than %d NUMA nodes; the rest are left out", NUMA_MAX);
			break;
		}
		n->id = id;
		n->cpus = DISC_NONE;
		n->memory_bytes = DISC_NONE;
		char b[4096];
		int rc = disc_rd(s, b, sizeof b, "/sys/devices/system/node/%s/cpulist", nm);
		if (rc == DS_OK) {
			int ok = disc_cpulist_count(b, &n->cpus) == DS_OK &&
				 ds_strlcpy(n->cpulist, b, sizeof n->cpulist) < sizeof n->cpulist;
			if (!ok) {
				n->cpus = DISC_NONE;
				n->cpulist[0] = '\0';
				disc_note_add(s, "numa", "%s/cpulist '%.60s' is not a CPU list", nm, b);
			}
		} else {
			disc_note_add(s, "numa", "%s/cpulist: %s", nm, rc == DS_ENOTFOUND ? "not found" : strerror(errno));
		}
		rc = disc_rd(s, b, sizeof b, "/sys/devices/system/node/%s/meminfo", nm);
		char *mt = rc == DS_OK ? strstr(b, "MemTotal:") : NULL;
		if (mt) {
			char *nl = strchr(mt, '\n');
			if (nl)
				*nl = '\0';
			if (parse_kb(mt + 9, &n->memory_bytes) != DS_OK) {
				n->memory_bytes = DISC_NONE;
				disc_note_add(s, "numa", "%s/meminfo: MemTotal '%.60s' is not '<N> kB'", nm, mt + 9);
			}
		} else {
			disc_note_add(s, "numa", "%s/meminfo: %s", nm, rc == DS_OK ? "no MemTotal" : "not readable");
		}
	}
	disc_names_free(&ns);
	if (h->n_numa)
		qsort(h->numa, h->n_numa, sizeof *h->numa, cmp_numa);
}


void disc_host_scan(scan *s)
{
	host_hostname(s);
	host_cpuinfo(s);
	host_meminfo(s);
	host_numa(s);
}
