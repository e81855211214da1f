/*
 * discover.c - node discovery: host, GPUs (NVML or --fake-gpus), PCI NVIDIA
 * functions, NICs, InfiniBand/RoCE ports and the distances between them
 * (see discover.h for the JSON schema, docs/cluster.md "Discovery").
 *
 * This file holds the run (disc_run) and the helpers every source uses
 * (notes, capped arrays, files under the sysroot); the sources are
 * discover_host.c, discover_pci.c, discover_nvml.c and discover_net.c, the
 * JSON output and digest discover_json.c (discover_impl.h lists them).
 *
 * Callers: agent/main.c (`dsagent --discover`, later the agent's start-up and
 * its gossip metadata via disc_digest), agent/options.c (validates
 * --fake-gpus), tests.  Calls: the file system under the sysroot, getifaddrs
 * (live only), NVML through dlopen/dlsym, libsodium (BLAKE2b), jansson.
 *
 * Order of one run (each step may add notes, none fails the run):
 *
 *   sysroot -> host (hostname, cpuinfo, meminfo) -> NUMA nodes -> PCI scan
 *   (NVIDIA display functions) -> GPUs: fake spec | NVML | none -> NICs
 *   (getifaddrs | fixture file) -> InfiniBand ports (+ RoCE v2 GID, which
 *   needs the NICs' IPv4 addresses) -> GPU pair links -> GPU<->RDMA device
 *   distances -> compute kind and ranks
 *
 * Invariants:
 *  1. Nothing outside the sysroot is read, except NVML (a library the caller
 *     names, or the default one only when the sysroot is "/") and getifaddrs
 *     (only when the sysroot is "/").
 *  2. A missing or malformed input never fails the run: the field is unknown
 *     (DISC_NONE / "") and, unless its absence is normal, a note says why.
 *     Only a bad fake spec (DS_EINVAL), an unreadable sysroot and ENOMEM fail.
 *  3. Every array has a hard cap (DISC_*_MAX, *_MAX of discover_impl.h); what
 *     is past it is noted.
 *  4. The output depends only on the inputs: lists are sorted (bus ids,
 *     natural names), fake values are derived from the spec and a seed.
 *
 * Threading: no globals of our own; NVML init/shutdown is process-wide, so one
 * disc_run at a time.
 */
#include "agent/node/discover_impl.h"
#include "common/strutil.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- notes and capped arrays ---- */

/* Appends one zeroed element (at most max); NULL when full or out of memory
 * (then s->oom is set). */
void *disc_grow(scan *s, void *arrp, size_t *n, size_t *cap, size_t size, size_t max)
{
	char **arr = arrp;
	if (*n >= max)
		return NULL;
	if (*n == *cap) {
		size_t nc = *cap ? *cap * 2 : 8;
		if (nc > max)
			nc = max;
		char *na = realloc(*arr, nc * size);
		if (!na) {
			s->oom = 1;
			return NULL;
		}
		*arr = na;
		*cap = nc;
	}
	char *e = *arr + *n * size;
	memset(e, 0, size);
	(*n)++;
	return e;
}

void disc_note_add(scan *s, const char *src, const char *fmt, ...)
{
	disc_inventory *inv = s->inv;
	disc_note *n = disc_grow(s, &inv->notes, &inv->n_notes, &s->cap_notes, sizeof *n, DISC_NOTES_MAX);
	if (!n) {
		s->dropped_notes++;
		return;
	}
	ds_strlcpy(n->source, src, sizeof n->source);
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(n->message, sizeof n->message, fmt, ap);
	va_end(ap);
}

/* ---- files under the root ----------------------------------------------------- */

static int vpath(const scan *s, char *out, size_t size, const char *fmt, va_list ap)
{
	size_t r = ds_strlcpy(out, s->root, size);
	if (r >= size)
		return DS_ERANGE;
	int n = vsnprintf(out + r, size - r, fmt, ap);
	return n < 0 || (size_t)n >= size - r ? DS_ERANGE : DS_OK;
}

int disc_path_of(const scan *s, char *out, size_t size, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int rc = vpath(s, out, size, fmt, ap);
	va_end(ap);
	return rc;
}

/* Reads a small text file, trailing whitespace removed.  DS_OK, DS_ENOTFOUND
 * (absent) or DS_EIO (unreadable; errno kept). */
static int read_text(const char *path, char *buf, size_t size)
{
	buf[0] = '\0';
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errno == ENOENT || errno == ENOTDIR ? DS_ENOTFOUND : DS_EIO;
	size_t len = 0;
	int rc = DS_OK;
	while (len + 1 < size) {
		ssize_t r = read(fd, buf + len, size - 1 - len);
		if (r < 0) {
			if (errno == EINTR)
				continue;
			rc = DS_EIO;
			break;
		}
		if (r == 0)
			break;
		len += (size_t)r;
	}
	int e = errno;
	close(fd);
	errno = e;
	buf[len] = '\0';
	while (len > 0 && isspace((unsigned char)buf[len - 1]))
		buf[--len] = '\0';
	return rc;
}

/* read_text of <root><fmt...>. */
int disc_rd(const scan *s, char *buf, size_t size, const char *fmt, ...)
{
	char path[PATH_MAX];
	va_list ap;
	va_start(ap, fmt);
	int rc = vpath(s, path, sizeof path, fmt, ap);
	va_end(ap);
	if (rc) {
		buf[0] = '\0';
		return DS_ENOTFOUND;
	}
	return read_text(path, buf, size);
}

static int cmp_natural(const void *a, const void *b)
{
	return strverscmp(*(char *const *)a, *(char *const *)b);
}

void disc_names_free(names *ns)
{
	for (size_t i = 0; i < ns->n; i++)
		free(ns->v[i]);
	free(ns->v);
	ns->v = NULL;
	ns->n = 0;
}

int disc_list_dir(scan *s, names *ns, size_t max, const char *fmt, ...)
{
	char path[PATH_MAX];
	ns->v = NULL;
	ns->n = 0;
	va_list ap;
	va_start(ap, fmt);
	int rc = vpath(s, path, sizeof path, fmt, ap);
	va_end(ap);
	if (rc)
		return DS_ENOTFOUND;
	DIR *d = opendir(path);
	if (!d)
		return errno == ENOENT || errno == ENOTDIR ? DS_ENOTFOUND : DS_EIO;
	size_t cap = 0;
	struct dirent *de;
	while ((de = readdir(d))) {
		if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
			continue;
		if (ns->n >= max)
			break;
		if (ns->n == cap) {
			size_t nc = cap ? cap * 2 : 16;
			char **nv = realloc(ns->v, nc * sizeof *nv);
			if (!nv) {
				s->oom = 1;
				break;
			}
			ns->v = nv;
			cap = nc;
		}
		if (!(ns->v[ns->n] = strdup(de->d_name))) {
			s->oom = 1;
			break;
		}
		ns->n++;
	}
	closedir(d);
	if (ns->n)
		qsort(ns->v, ns->n, sizeof *ns->v, cmp_natural);
	return DS_OK;
}

/* Resolves <root><rel> (a symlink into /sys/devices, as sysfs has them) to
 * its path relative to the root, "/sys/devices/...".  DS_ENOTFOUND when it
 * does not exist or lands outside <root>/sys/devices. */
int disc_sys_resolve(const scan *s, const char *rel, char *out, size_t size)
{
	char path[PATH_MAX], real[PATH_MAX];
	out[0] = '\0';
	if (disc_path_of(s, path, sizeof path, "%s", rel) || !realpath(path, real))
		return DS_ENOTFOUND;
	size_t rl = strlen(s->root);
	if (strncmp(real, s->root, rl) != 0 || strncmp(real + rl, "/sys/devices/", 13) != 0)
		return DS_ENOTFOUND;
	return ds_strlcpy(out, real + rl, size) < size ? DS_OK : DS_ENOTFOUND;
}

/* ---- the run ----------------------------------------------------------------------------- */

static int cmp_gscan(const void *a, const void *b)
{
	return strcmp(((const gscan *)a)->g.bus_id, ((const gscan *)b)->g.bus_id);
}

disc_params disc_default_params(void)
{
	disc_params p = {0};
	p.sysroot = "/";
	return p;
}

void disc_free(disc_inventory *inv)
{
	if (!inv)
		return;
	free(inv->host.numa);
	free(inv->gpus);
	free(inv->pci_gpus);
	free(inv->links);
	free(inv->ib_ports);
	free(inv->nics);
	free(inv->gpu_nic);
	free(inv->notes);
	free(inv);
}

int disc_run(const disc_params *p, disc_inventory **out, ds_err *err)
{
	scan s;
	nvml_api *nv = NULL;
	disc_fake_spec fake;
	int rc = DS_OK;
	memset(&s, 0, sizeof s);
	*out = NULL;
	s.p = p;
	if (p->fake_gpus && (rc = disc_fake_parse(p->fake_gpus, &fake, err)) != DS_OK) {
		ds_err_wrap(err, "--fake-gpus");
		return rc;
	}
	const char *root = p->sysroot && *p->sysroot ? p->sysroot : "/";
	struct stat st;
	if (!realpath(root, s.root) || stat(s.root, &st) != 0)
		return ds_err_set(err, errno == ENOENT || errno == ENOTDIR ? DS_ENOTFOUND : DS_EIO,
				  "sysroot %s: %s", root, strerror(errno));
	if (!S_ISDIR(st.st_mode))
		return ds_err_set(err, DS_EINVAL, "sysroot %s: not a directory", root);
	if (access(s.root, R_OK | X_OK) != 0)
		return ds_err_set(err, DS_EIO, "sysroot %s: %s", root, strerror(errno));
	if (!strcmp(s.root, "/")) {
		s.root[0] = '\0';
		s.live = 1;
	}
	if (!(s.inv = calloc(1, sizeof *s.inv)))
		return ds_err_set(err, DS_ENOMEM, "out of memory");
	disc_inventory *inv = s.inv;
	inv->cuda_driver_version = DISC_NONE;

	disc_host_scan(&s);
	disc_pci_scan(&s);
	if (p->fake_gpus)
		rc = disc_gpus_fake(&s, &fake);
	else
		nv = disc_nvml_gpus(&s);
	if (rc)
		goto out;
	if (s.n_gs)
		qsort(s.gs, s.n_gs, sizeof *s.gs, cmp_gscan);
	disc_gpus_cross_check(&s);
	disc_nics_scan(&s);
	disc_ib_scan(&s);
	disc_links_build(&s, nv);
	disc_gpu_nic_build(&s);
	if (s.n_gs && !(inv->gpus = calloc(s.n_gs, sizeof *inv->gpus))) {
		s.oom = 1;
	} else {
		for (size_t i = 0; i < s.n_gs; i++) {
			inv->gpus[i] = s.gs[i].g;
			inv->gpus[i].index = (int)i;
		}
		inv->n_gpus = s.n_gs;
	}
	inv->compute_gpu = inv->n_gpus > 0;
	inv->ranks = inv->n_gpus ? (int)inv->n_gpus : inv->host.n_numa ? (int)inv->host.n_numa : 1;
	if (s.dropped_notes && inv->n_notes) {
		disc_note *last = &inv->notes[inv->n_notes - 1];
		ds_strlcpy(last->source, "notes", sizeof last->source);
		snprintf(last->message, sizeof last->message, "%zu further notes were dropped",
			 s.dropped_notes + 1);
	}
out:
	disc_nvml_close(nv);
	free(s.gs);
	free(s.ib);
	if (!rc && s.oom)
		rc = ds_err_set(err, DS_ENOMEM, "discovery: out of memory");
	else if (rc)
		ds_err_set(err, rc, "discovery: %s", ds_status_name(rc));
	if (rc) {
		disc_free(inv);
		return rc;
	}
	*out = inv;
	return DS_OK;
}

