/*
 * discover.c - node discovery: host, GPUs (NVML or --fake-gpus), PCI NVIDIA
 * functions, NICs, InfiniBand/RoCE ports and the distances between them
 * (see discover.h for the JSON schema, docs/cluster.md "Discovery").
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
 *  3. Every array has a hard cap (DISC_*_MAX below); what is past it is noted.
 *  4. The output depends only on the inputs: lists are sorted (bus ids,
 *     natural names), fake values are derived from the spec and a seed.
 *
 * Threading: no globals of our own; NVML init/shutdown is process-wide, so one
 * disc_run at a time.
 */
#include "agent/node/discover.h"
#include "common/strutil.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#define NUMA_MAX 256
#define IB_PORTS_MAX 256
#define NICS_MAX 256
#define PCI_GPUS_MAX 256
#define SOCKETS_MAX 256
#define NVLINK_MAX 36 /* NVML_NVLINK_MAX_LINKS in NVML API 13 */
#define PATH_COMPONENTS_MAX 32
#define FIXTURE_IFADDRS "/etc/dsagent-fixture/ifaddrs"

/* ---- private per-run state -------------------------------------------------- */

typedef struct nvml_api nvml_api;

/* What discovery knows about one GPU beyond disc_gpu, kept in step with it. */
typedef struct gscan {
	disc_gpu g;
	void *handle;           /* nvmlDevice_t, NVML only */
	char path[PATH_MAX];    /* resolved sysfs path relative to the root, "" = none */
	int nvl_switch;         /* active links whose remote is an NVSwitch */
	int nvl_gpu_n;          /* active links to other GPUs */
	char nvl_gpu_bus[NVLINK_MAX][DISC_BUSID_SIZE];
	int nvl_unk_n;          /* active links whose remote type NVML did not say */
	char nvl_unk_bus[NVLINK_MAX][DISC_BUSID_SIZE];
} gscan;

typedef struct ibdev {
	char name[64];
	char path[PATH_MAX]; /* resolved sysfs path; "" = no PCI device */
	char bus_id[DISC_BUSID_SIZE];
	int numa;
} ibdev;

typedef struct scan {
	const disc_params *p;
	char root[PATH_MAX]; /* realpath of the sysroot without trailing '/'; "" = "/" */
	int live;
	disc_inventory *inv;
	size_t cap_numa, cap_gpus, cap_pci, cap_links, cap_ib, cap_nics, cap_gn, cap_notes;
	gscan *gs;
	size_t n_gs, cap_gs;
	ibdev *ib;
	size_t n_ib, cap_ibdev;
	size_t dropped_notes;
	int oom;
} scan;

/* Appends one zeroed element (at most max); NULL when full or out of memory
 * (then s->oom is set). */
static void *grow(scan *s, void *arrp, size_t *n, size_t *cap, size_t size, size_t max)
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

static void note(scan *s, const char *src, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void note(scan *s, const char *src, const char *fmt, ...)
{
	disc_inventory *inv = s->inv;
	disc_note *n = grow(s, &inv->notes, &inv->n_notes, &s->cap_notes, sizeof *n, DISC_NOTES_MAX);
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

static int path_of(const scan *s, char *out, size_t size, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static int path_of(const scan *s, char *out, size_t size, const char *fmt, ...)
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
static int rd(const scan *s, char *buf, size_t size, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static int rd(const scan *s, char *buf, size_t size, const char *fmt, ...)
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

/* Directory entries (not "." or ".."), sorted in natural order; caller frees
 * with names_free.  DS_ENOTFOUND when the directory is absent. */
typedef struct names {
	char **v;
	size_t n;
} names;

static int cmp_natural(const void *a, const void *b)
{
	return strverscmp(*(char *const *)a, *(char *const *)b);
}

static void names_free(names *ns)
{
	for (size_t i = 0; i < ns->n; i++)
		free(ns->v[i]);
	free(ns->v);
	ns->v = NULL;
	ns->n = 0;
}

static int list_dir(scan *s, names *ns, size_t max, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static int list_dir(scan *s, names *ns, size_t max, const char *fmt, ...)
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
static int sys_resolve(const scan *s, const char *rel, char *out, size_t size)
{
	char path[PATH_MAX], real[PATH_MAX];
	out[0] = '\0';
	if (path_of(s, path, sizeof path, "%s", rel) || !realpath(path, real))
		return DS_ENOTFOUND;
	size_t rl = strlen(s->root);
	if (strncmp(real, s->root, rl) != 0 || strncmp(real + rl, "/sys/devices/", 13) != 0)
		return DS_ENOTFOUND;
	return ds_strlcpy(out, real + rl, size) < size ? DS_OK : DS_ENOTFOUND;
}

/* ---- parsers ------------------------------------------------------------------ */

int disc_parse_rate(const char *s, double *gbps, int *width, char *speed, size_t speed_size)
{
	const char *p = s;
	if (!s || !isdigit((unsigned char)*p))
		return DS_EFORMAT;
	char num[32];
	size_t n = 0;
	while (isdigit((unsigned char)*p) && n < sizeof num - 1)
		num[n++] = *p++;
	if (*p == '.') {
		num[n++] = *p++;
		if (!isdigit((unsigned char)*p))
			return DS_EFORMAT;
		while (isdigit((unsigned char)*p) && n < sizeof num - 1)
			num[n++] = *p++;
	}
	if (isdigit((unsigned char)*p))
		return DS_EFORMAT; /* longer than num */
	num[n] = '\0';
	if (strncmp(p, " Gb/sec", 7) != 0)
		return DS_EFORMAT;
	p += 7;
	double v;
	if (ds_parse_double(num, 0, 1e6, &v) != DS_OK)
		return DS_EFORMAT;
	int w = DISC_NONE;
	char sp[8] = "";
	if (*p) {
		if (strncmp(p, " (", 2) != 0)
			return DS_EFORMAT;
		p += 2;
		if (!isdigit((unsigned char)*p))
			return DS_EFORMAT;
		w = 0;
		while (isdigit((unsigned char)*p)) {
			w = w * 10 + (*p++ - '0');
			if (w > 64)
				return DS_EFORMAT;
		}
		if (w == 0 || *p++ != 'X')
			return DS_EFORMAT;
		if (*p == ' ') {
			p++;
			size_t k = 0;
			while (isalnum((unsigned char)*p) && k < sizeof sp - 1)
				sp[k++] = *p++;
			sp[k] = '\0';
			if (k == 0)
				return DS_EFORMAT;
		}
		if (*p++ != ')' || *p)
			return DS_EFORMAT;
	}
	*gbps = v;
	*width = w;
	if (speed && speed_size)
		ds_strlcpy(speed, sp, speed_size);
	return DS_OK;
}

int disc_parse_state(const char *s, int *code, char *name, size_t name_size)
{
	if (!s || !isdigit((unsigned char)*s))
		return DS_EFORMAT;
	int c = 0;
	const char *p = s;
	while (isdigit((unsigned char)*p)) {
		c = c * 10 + (*p++ - '0');
		if (c > 255)
			return DS_EFORMAT;
	}
	if (*p++ != ':' || *p != ' ')
		return DS_EFORMAT;
	while (*p == ' ')
		p++;
	if (!isalpha((unsigned char)*p))
		return DS_EFORMAT;
	size_t len = strlen(p);
	if (p[len - 1] == ' ' || len >= name_size)
		return DS_EFORMAT;
	for (size_t i = 0; i < len; i++)
		if (!isalnum((unsigned char)p[i]) && p[i] != ' ' && p[i] != '_')
			return DS_EFORMAT;
	*code = c;
	memcpy(name, p, len + 1);
	return DS_OK;
}

int disc_parse_gid(const char *s, uint8_t gid[16])
{
	struct in6_addr a;
	if (!s || inet_pton(AF_INET6, s, &a) != 1)
		return DS_EFORMAT;
	memcpy(gid, &a, 16);
	return DS_OK;
}

int disc_gid_ipv4(const uint8_t gid[16], uint32_t *ipv4)
{
	for (int i = 0; i < 10; i++)
		if (gid[i])
			return 0;
	if (gid[10] != 0xff || gid[11] != 0xff)
		return 0;
	*ipv4 = (uint32_t)gid[12] << 24 | (uint32_t)gid[13] << 16 | (uint32_t)gid[14] << 8 | gid[15];
	return 1;
}

/* n hex digits (1..max) into *v; returns the count consumed, 0 on none. */
static int hexn(const char *p, int max, unsigned long *v)
{
	int k = 0;
	*v = 0;
	while (k < max && isxdigit((unsigned char)p[k])) {
		int c = tolower((unsigned char)p[k]);
		*v = *v * 16 + (unsigned long)(c <= '9' ? c - '0' : c - 'a' + 10);
		k++;
	}
	return isxdigit((unsigned char)p[k]) ? 0 : k;
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

const char *disc_src_name(disc_src src)
{
	switch (src) {
	case DISC_SRC_NVLINK: return "nvlink";
	case DISC_SRC_SYSFS: return "sysfs";
	case DISC_SRC_NVML: return "nvml";
	case DISC_SRC_NUMA: return "numa";
	default: return "none";
	}
}

/* ---- fake GPUs ----------------------------------------------------------------- */

typedef struct fake_model {
	const char *name;
	int cc_major, cc_minor, nvlinks;
} fake_model;

/* Compute capability and NVLink count per model (NVIDIA data sheets). */
static const fake_model fake_models[] = {
	{"H100", 9, 0, 18}, {"H200", 9, 0, 18}, {"H800", 9, 0, 8},  {"H20", 9, 0, 18},
	{"GH200", 9, 0, 18}, {"B200", 10, 0, 18}, {"A100", 8, 0, 12}, {"A800", 8, 0, 8},
	{"A10", 8, 6, 0},   {"L40S", 8, 9, 0},   {"L4", 8, 9, 0},     {"V100", 7, 0, 6},
	{NULL, 0, 0, 0},
};

int disc_fake_parse(const char *spec, disc_fake_spec *out, ds_err *err)
{
	static const char form[] = "expected NxMODEL-MEMGB[:nvswitch|nvlink|pcie] "
				   "(e.g. 8xH100-80GB:nvswitch) or 0";
	disc_fake_spec f = {0};
	char buf[64], *model, *mem, *topo, *x, *dash;
	if (!spec || !*spec)
		return ds_err_set(err, DS_EINVAL, "empty spec: %s", form);
	if (ds_strlcpy(buf, spec, sizeof buf) >= sizeof buf)
		return ds_err_set(err, DS_EINVAL, "'%.40s...' is too long: %s", spec, form);
	if (!strcmp(buf, "0")) {
		*out = f;
		return DS_OK;
	}
	if (!(x = strchr(buf, 'x')))
		return ds_err_set(err, DS_EINVAL, "'%s': no 'x' after the count: %s", spec, form);
	*x = '\0';
	model = x + 1;
	if (ds_parse_int(buf, 0, 1 << 20, &f.n) != DS_OK || !isdigit((unsigned char)buf[0]))
		return ds_err_set(err, DS_EINVAL, "'%s': count '%s' is not a number: %s", spec, buf,
				  form);
	if (f.n > DISC_FAKE_MAX)
		return ds_err_set(err, DS_EINVAL, "'%s': count %d is out of range [0, %d]", spec,
				  f.n, DISC_FAKE_MAX);
	topo = strchr(model, ':');
	if (topo)
		*topo++ = '\0';
	if (!(dash = strchr(model, '-')))
		return ds_err_set(err, DS_EINVAL, "'%s': no '-MEMGB' after the model: %s", spec, form);
	*dash = '\0';
	mem = dash + 1;
	const fake_model *m = fake_models;
	while (m->name && strcasecmp(m->name, model) != 0)
		m++;
	if (!m->name)
		return ds_err_set(err, DS_EINVAL,
				  "'%s': unknown GPU model '%s' (known: H100 H200 H800 H20 GH200 "
				  "B200 A100 A800 A10 L40S L4 V100)",
				  spec, model);
	size_t ml = strlen(mem);
	if (ml < 3 || strcmp(mem + ml - 2, "GB") != 0)
		return ds_err_set(err, DS_EINVAL, "'%s': memory '%s' does not end in GB: %s", spec,
				  mem, form);
	mem[ml - 2] = '\0';
	if (!isdigit((unsigned char)mem[0]) || ds_parse_int(mem, 1, 1024, &f.memory_gb) != DS_OK)
		return ds_err_set(err, DS_EINVAL, "'%s': memory '%sGB' is not a number in [1, 1024]",
				  spec, mem);
	if (!topo || !strcmp(topo, "pcie"))
		f.topo = DISC_FAKE_PCIE;
	else if (!strcmp(topo, "nvlink"))
		f.topo = DISC_FAKE_NVLINK;
	else if (!strcmp(topo, "nvswitch"))
		f.topo = DISC_FAKE_NVSWITCH;
	else
		return ds_err_set(err, DS_EINVAL, "'%s': topology '%s' is not nvswitch, nvlink or pcie",
				  spec, topo);
	if (f.topo != DISC_FAKE_PCIE && m->nvlinks == 0)
		return ds_err_set(err, DS_EINVAL, "'%s': the %s has no NVLink; use :pcie", spec,
				  m->name);
	ds_strlcpy(f.model, m->name, sizeof f.model);
	f.cc_major = m->cc_major;
	f.cc_minor = m->cc_minor;
	f.nvlinks = m->nvlinks;
	*out = f;
	return DS_OK;
}

void disc_fake_bus_id(int i, char out[DISC_BUSID_SIZE])
{
	snprintf(out, DISC_BUSID_SIZE, "0000:%02x:00.0", (0x08 + 0x10 * i) & 0xff);
}

int disc_fake_uuid(const char *seed, int i, char *out, size_t size)
{
	char in[320];
	unsigned char h[16];
	int n = snprintf(in, sizeof in, "%s/%d", seed ? seed : "", i);
	if (n < 0 || (size_t)n >= sizeof in || size < 41)
		return DS_ERANGE;
	if (sodium_init() < 0 || crypto_generichash(h, sizeof h, (const unsigned char *)in,
						    (unsigned long long)n, NULL, 0) != 0)
		return DS_EINTERNAL;
	char hex[33];
	sodium_bin2hex(hex, sizeof hex, h, sizeof h);
	snprintf(out, size, "GPU-%.8s-%.4s-%.4s-%.4s-%.12s", hex, hex + 8, hex + 12, hex + 16,
		 hex + 20);
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
			note(s, "host", "gethostname: %s", strerror(errno));
		return;
	}
	char b[512];
	int rc = rd(s, b, sizeof b, "/etc/hostname");
	if (rc) {
		note(s, "host", "/etc/hostname: %s", rc == DS_ENOTFOUND ? "not found" : strerror(errno));
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
	if (path_of(s, path, sizeof path, "/proc/cpuinfo"))
		return;
	FILE *f = fopen(path, "re");
	if (!f) {
		note(s, "host", "/proc/cpuinfo: %s", strerror(errno));
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
		note(s, "host", "/proc/cpuinfo: no 'processor' lines");
	if (!h->cpu_model[0])
		note(s, "host", "/proc/cpuinfo: no 'model name' line");
	if (bad_ids)
		note(s, "host", "/proc/cpuinfo: %d 'physical id' values are not numbers", bad_ids);
	else if (n_ids > 0)
		h->sockets = n_ids;
}

static void host_meminfo(scan *s)
{
	disc_host *h = &s->inv->host;
	h->memory_bytes = DISC_NONE;
	char b[8192];
	int rc = rd(s, b, sizeof b, "/proc/meminfo");
	if (rc) {
		note(s, "host", "/proc/meminfo: %s", rc == DS_ENOTFOUND ? "not found" : strerror(errno));
		return;
	}
	char *save = NULL;
	for (char *l = strtok_r(b, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
		if (strncmp(l, "MemTotal:", 9) != 0)
			continue;
		if (parse_kb(l + 9, &h->memory_bytes) != DS_OK) {
			h->memory_bytes = DISC_NONE;
			note(s, "host", "/proc/meminfo: MemTotal '%.60s' is not '<N> kB'", l + 9);
		}
		return;
	}
	note(s, "host", "/proc/meminfo: no MemTotal line");
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
	if (list_dir(s, &ns, 4096, "/sys/devices/system/node") != DS_OK) {
		note(s, "numa", "/sys/devices/system/node: not found (no NUMA information)");
		return;
	}
	for (size_t i = 0; i < ns.n; i++) {
		int id;
		const char *nm = ns.v[i];
		if (strncmp(nm, "node", 4) != 0 || !isdigit((unsigned char)nm[4]) ||
		    ds_parse_int(nm + 4, 0, 1 << 16, &id) != DS_OK)
			continue;
		disc_numa *n = grow(s, &h->numa, &h->n_numa, &s->cap_numa, sizeof *n, NUMA_MAX);
		if (!n) {
			if (!s->oom)
				note(s, "numa", "more than %d NUMA nodes; the rest are left out", NUMA_MAX);
			break;
		}
		n->id = id;
		n->cpus = DISC_NONE;
		n->memory_bytes = DISC_NONE;
		char b[4096];
		int rc = rd(s, b, sizeof b, "/sys/devices/system/node/%s/cpulist", nm);
		if (rc == DS_OK) {
			int ok = disc_cpulist_count(b, &n->cpus) == DS_OK &&
				 ds_strlcpy(n->cpulist, b, sizeof n->cpulist) < sizeof n->cpulist;
			if (!ok) {
				n->cpus = DISC_NONE;
				n->cpulist[0] = '\0';
				note(s, "numa", "%s/cpulist '%.60s' is not a CPU list", nm, b);
			}
		} else {
			note(s, "numa", "%s/cpulist: %s", nm, rc == DS_ENOTFOUND ? "not found" : strerror(errno));
		}
		rc = rd(s, b, sizeof b, "/sys/devices/system/node/%s/meminfo", nm);
		char *mt = rc == DS_OK ? strstr(b, "MemTotal:") : NULL;
		if (mt) {
			char *nl = strchr(mt, '\n');
			if (nl)
				*nl = '\0';
			if (parse_kb(mt + 9, &n->memory_bytes) != DS_OK) {
				n->memory_bytes = DISC_NONE;
				note(s, "numa", "%s/meminfo: MemTotal '%.60s' is not '<N> kB'", nm, mt + 9);
			}
		} else {
			note(s, "numa", "%s/meminfo: %s", nm, rc == DS_OK ? "no MemTotal" : "not readable");
		}
	}
	names_free(&ns);
	if (h->n_numa)
		qsort(h->numa, h->n_numa, sizeof *h->numa, cmp_numa);
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
static int dev_numa(scan *s, const char *src, const char *what, const char *dir_rel)
{
	char b[64];
	int v;
	if (rd(s, b, sizeof b, "%s/numa_node", dir_rel) != DS_OK)
		return DISC_NONE;
	if (ds_parse_int(b, -1, 1 << 16, &v) != DS_OK) {
		note(s, src, "%s: numa_node '%.40s' is not a number", what, b);
		return DISC_NONE;
	}
	return v < 0 ? DISC_NONE : v;
}

static int cmp_pci_gpu(const void *a, const void *b)
{
	return strcmp(((const disc_pci_gpu *)a)->bus_id, ((const disc_pci_gpu *)b)->bus_id);
}

static void pci_scan(scan *s)
{
	disc_inventory *inv = s->inv;
	names ns;
	if (list_dir(s, &ns, 1 << 16, "/sys/bus/pci/devices") != DS_OK) {
		note(s, "pci", "/sys/bus/pci/devices: not found");
		return;
	}
	for (size_t i = 0; i < ns.n; i++) {
		char bdf[DISC_BUSID_SIZE], b[64], dir[128];
		unsigned long vendor, cls, device;
		if (disc_busid_normalize(ns.v[i], bdf, sizeof bdf) != DS_OK)
			continue;
		snprintf(dir, sizeof dir, "/sys/bus/pci/devices/%s", ns.v[i]);
		if (rd(s, b, sizeof b, "%s/vendor", dir) != DS_OK || parse_hex(b, 0xffff, &vendor) ||
		    vendor != 0x10de)
			continue;
		if (rd(s, b, sizeof b, "%s/class", dir) != DS_OK || parse_hex(b, 0xffffff, &cls)) {
			note(s, "pci", "%s: NVIDIA function with an unreadable class '%.20s'", bdf, b);
			continue;
		}
		if (cls >> 16 != 0x03) /* display controllers only: not NVSwitches, not audio */
			continue;
		if (rd(s, b, sizeof b, "%s/device", dir) != DS_OK || parse_hex(b, 0xffff, &device)) {
			note(s, "pci", "%s: device id '%.20s' is not 0xNNNN", bdf, b);
			device = 0;
		}
		disc_pci_gpu *g = grow(s, &inv->pci_gpus, &inv->n_pci_gpus, &s->cap_pci, sizeof *g,
				       PCI_GPUS_MAX);
		if (!g)
			break;
		ds_strlcpy(g->bus_id, bdf, sizeof g->bus_id);
		g->vendor = (unsigned)vendor;
		g->device = (unsigned)device;
		g->numa_node = dev_numa(s, "pci", bdf, dir);
	}
	names_free(&ns);
	if (inv->n_pci_gpus)
		qsort(inv->pci_gpus, inv->n_pci_gpus, sizeof *inv->pci_gpus, cmp_pci_gpu);
}

/* Fills gs->path and, when the sysfs device is there, gs->g.numa_node. */
static void gpu_sysfs(scan *s, gscan *gs)
{
	char rel[128];
	snprintf(rel, sizeof rel, "/sys/bus/pci/devices/%s", gs->g.bus_id);
	if (sys_resolve(s, rel, gs->path, sizeof gs->path) != DS_OK) {
		gs->path[0] = '\0';
		return;
	}
	int numa = dev_numa(s, "gpus", gs->g.bus_id, rel);
	if (numa != DISC_NONE)
		gs->g.numa_node = numa;
}

static gscan *gscan_add(scan *s)
{
	gscan *g = grow(s, &s->gs, &s->n_gs, &s->cap_gs, sizeof *g, DISC_GPUS_MAX);
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

/* ---- fake GPUs into the scan ---------------------------------------------------------- */

static int gpus_fake(scan *s, const disc_fake_spec *f)
{
	disc_inventory *inv = s->inv;
	const char *seed = s->p->fake_seed ? s->p->fake_seed : inv->host.hostname;
	inv->gpu_kind = DISC_GPUS_FAKE;
	ds_strlcpy(inv->fake_spec, s->p->fake_gpus, sizeof inv->fake_spec);
	note(s, "nvml", "not loaded: replaced by --fake-gpus %s", s->p->fake_gpus);
	for (int i = 0; i < f->n; i++) {
		gscan *g = gscan_add(s);
		if (!g)
			return DS_ENOMEM;
		disc_gpu *d = &g->g;
		d->nvml_index = i;
		int rc = disc_fake_uuid(seed, i, d->uuid, sizeof d->uuid);
		if (rc)
			return rc;
		snprintf(d->name, sizeof d->name, "NVIDIA %s %dGB", f->model, f->memory_gb);
		disc_fake_bus_id(i, d->bus_id);
		d->cc_major = f->cc_major;
		d->cc_minor = f->cc_minor;
		d->memory_total_bytes = (int64_t)f->memory_gb << 30;
		/* NUMA: the sysfs device when the sysroot has it, else GPUs spread
		 * evenly over the host's NUMA nodes in order. */
		if (s->inv->host.n_numa)
			d->numa_node = s->inv->host.numa[(size_t)i * s->inv->host.n_numa / (size_t)f->n].id;
		gpu_sysfs(s, g);
		if (f->topo == DISC_FAKE_NVSWITCH) {
			g->nvl_switch = f->nvlinks;
		} else if (f->topo == DISC_FAKE_NVLINK && (i ^ 1) < f->n) {
			/* pairs (0,1), (2,3), ... joined by every link */
			for (int l = 0; l < f->nvlinks; l++)
				disc_fake_bus_id(i ^ 1, g->nvl_gpu_bus[l]);
			g->nvl_gpu_n = f->nvlinks;
		}
		d->nvlinks = g->nvl_switch + g->nvl_gpu_n;
		d->nvswitch = g->nvl_switch > 0;
		disc_gpu_health *h = &d->health;
		h->temperature_c = 30 + i;
		h->power_mw = 100000 + 1000 * i;
		h->memory_used_bytes = 0;
		h->ecc_uncorrected_volatile = h->ecc_uncorrected_aggregate = 0;
		if (f->cc_major >= 8) { /* Ampere and later remap rows instead of retiring pages */
			h->remapped_rows_correctable = h->remapped_rows_uncorrectable = 0;
			h->remapped_rows_pending = h->remapped_rows_failed = 0;
		} else {
			h->retired_pages_sbe = h->retired_pages_dbe = 0;
		}
	}
	return DS_OK;
}

/* ---- NVML ---------------------------------------------------------------------------------
 *
 * Only the entry points and structs used here, with the layouts of the NVML
 * API (nvml.h of driver API 12/13; cluster.md section 3.2).  Enums travel as
 * int.  nvmlReturn_t codes that matter: */
enum {
	NV_SUCCESS = 0,
	NV_INVALID_ARGUMENT = 2,
	NV_NOT_SUPPORTED = 3,
	NV_INSUFFICIENT_SIZE = 7,
	NV_FUNCTION_NOT_FOUND = 13,
};

static const char *nv_err_name(int rc)
{
	static const char *const names_tab[] = {
		"SUCCESS", "UNINITIALIZED", "INVALID_ARGUMENT", "NOT_SUPPORTED", "NO_PERMISSION",
		"ALREADY_INITIALIZED", "NOT_FOUND", "INSUFFICIENT_SIZE", "INSUFFICIENT_POWER",
		"DRIVER_NOT_LOADED", "TIMEOUT", "IRQ_ISSUE", "LIBRARY_NOT_FOUND", "FUNCTION_NOT_FOUND",
		"CORRUPTED_INFOROM", "GPU_IS_LOST", "RESET_REQUIRED", "OPERATING_SYSTEM",
		"LIB_RM_VERSION_MISMATCH", "IN_USE", "MEMORY", "NO_DATA", "VGPU_ECC_NOT_ENABLED",
		"INSUFFICIENT_RESOURCES", "FREQ_NOT_SUPPORTED", "ARGUMENT_VERSION_MISMATCH",
		"DEPRECATED", "NOT_READY", "GPU_NOT_FOUND", "INVALID_STATE",
	};
	if (rc >= 0 && (size_t)rc < sizeof names_tab / sizeof names_tab[0])
		return names_tab[rc];
	return rc == 999 ? "UNKNOWN" : "unrecognised error";
}

typedef struct nv_pci {            /* nvmlPciInfo_t (v2 and v3), 68 bytes */
	char bus_id_legacy[16];
	unsigned domain, bus, device, pci_device_id, pci_subsystem_id;
	char bus_id[32];           /* "%08X:%02X:%02X.0" */
} nv_pci;
_Static_assert(sizeof(nv_pci) == 68, "nvmlPciInfo_t is 68 bytes");

typedef struct nv_mem {            /* nvmlMemory_t (v1): bytes */
	unsigned long long total, free, used;
} nv_mem;

typedef struct nvmlDevice_st *nvdev;

enum { NV_TEMPERATURE_GPU = 0, NV_MEMORY_ERROR_UNCORRECTED = 1, NV_VOLATILE_ECC = 0,
       NV_AGGREGATE_ECC = 1, NV_RETIRE_MULTIPLE_SBE = 0, NV_RETIRE_DBE = 1,
       NV_FEATURE_ENABLED = 1, NV_NVLINK_DEVICE_GPU = 0, NV_NVLINK_DEVICE_SWITCH = 2 };

struct nvml_api {
	void *lib;
	int (*init)(void);
	int (*shutdown)(void);
	int (*count)(unsigned *);
	int (*handle)(unsigned, nvdev *);
	int (*pci)(nvdev, nv_pci *);
	int (*uuid)(nvdev, char *, unsigned);
	int (*name)(nvdev, char *, unsigned);
	int (*mem)(nvdev, nv_mem *);
	int (*cc)(nvdev, int *, int *);
	int (*numa)(nvdev, unsigned *);
	int (*temp)(nvdev, int, unsigned *);
	int (*power)(nvdev, unsigned *);
	int (*ecc)(nvdev, int, int, unsigned long long *);
	int (*retired)(nvdev, int, unsigned *, unsigned long long *);
	int (*remapped)(nvdev, unsigned *, unsigned *, unsigned *, unsigned *);
	int (*nvl_state)(nvdev, unsigned, int *);
	int (*nvl_remote_pci)(nvdev, unsigned, nv_pci *);
	int (*nvl_remote_type)(nvdev, unsigned, int *);
	int (*ancestor)(nvdev, nvdev, int *);
	int (*driver)(char *, unsigned);
	int (*cuda)(int *);
};

typedef struct nv_sym {
	const char *name, *fallback; /* versioned name first, then the older one */
	size_t off;
	int required;
} nv_sym;

#define NVO(f) offsetof(struct nvml_api, f)
static const nv_sym nv_syms[] = {
	{"nvmlInit_v2", "nvmlInit", NVO(init), 1},
	{"nvmlShutdown", NULL, NVO(shutdown), 1},
	{"nvmlDeviceGetCount_v2", "nvmlDeviceGetCount", NVO(count), 1},
	{"nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex", NVO(handle), 1},
	{"nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo_v2", NVO(pci), 1},
	{"nvmlDeviceGetUUID", NULL, NVO(uuid), 0},
	{"nvmlDeviceGetName", NULL, NVO(name), 0},
	{"nvmlDeviceGetMemoryInfo", NULL, NVO(mem), 0},
	{"nvmlDeviceGetCudaComputeCapability", NULL, NVO(cc), 0},
	{"nvmlDeviceGetNumaNodeId", NULL, NVO(numa), 0},
	{"nvmlDeviceGetTemperature", NULL, NVO(temp), 0},
	{"nvmlDeviceGetPowerUsage", NULL, NVO(power), 0},
	{"nvmlDeviceGetTotalEccErrors", NULL, NVO(ecc), 0},
	{"nvmlDeviceGetRetiredPages", NULL, NVO(retired), 0},
	{"nvmlDeviceGetRemappedRows", NULL, NVO(remapped), 0},
	{"nvmlDeviceGetNvLinkState", NULL, NVO(nvl_state), 0},
	{"nvmlDeviceGetNvLinkRemotePciInfo_v2", "nvmlDeviceGetNvLinkRemotePciInfo",
	 NVO(nvl_remote_pci), 0},
	{"nvmlDeviceGetNvLinkRemoteDeviceType", NULL, NVO(nvl_remote_type), 0},
	{"nvmlDeviceGetTopologyCommonAncestor", NULL, NVO(ancestor), 0},
	{"nvmlSystemGetDriverVersion", NULL, NVO(driver), 0},
	{"nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion", NVO(cuda), 0},
	{NULL, NULL, 0, 0},
};

/* A per-field NVML result: DS_OK on success; NOT_SUPPORTED (and a missing
 * symbol) is a normal "unknown"; other codes are noted once per field. */
static int nv_ok(scan *s, const gscan *g, const char *field, int rc)
{
	if (rc == NV_SUCCESS)
		return 1;
	if (rc != NV_NOT_SUPPORTED && rc != NV_FUNCTION_NOT_FOUND)
		note(s, "nvml", "%s %s: %s: %s (%d)", g->g.bus_id, g->g.uuid[0] ? g->g.uuid : "",
		     field, nv_err_name(rc), rc);
	return 0;
}

static void nv_fields(scan *s, nvml_api *nv, gscan *g)
{
	disc_gpu *d = &g->g;
	disc_gpu_health *h = &d->health;
	nvdev dev = g->handle;
	int rc;
	char b[96];
	if (nv->uuid && nv_ok(s, g, "uuid", nv->uuid(dev, b, sizeof b))) {
		b[sizeof b - 1] = '\0';
		ds_strlcpy(d->uuid, b, sizeof d->uuid);
	}
	if (nv->name && nv_ok(s, g, "name", nv->name(dev, b, sizeof b))) {
		b[sizeof b - 1] = '\0';
		ds_strlcpy(d->name, b, sizeof d->name);
	}
	nv_mem m;
	if (nv->mem && nv_ok(s, g, "memory", nv->mem(dev, &m))) {
		d->memory_total_bytes = m.total > INT64_MAX ? DISC_NONE : (int64_t)m.total;
		h->memory_used_bytes = m.used > INT64_MAX ? DISC_NONE : (int64_t)m.used;
	}
	int ma, mi;
	if (nv->cc && nv_ok(s, g, "compute capability", nv->cc(dev, &ma, &mi)) && ma >= 0 &&
	    mi >= 0) {
		d->cc_major = ma;
		d->cc_minor = mi;
	}
	unsigned u;
	if (nv->numa && (rc = nv->numa(dev, &u)) == NV_SUCCESS && u < 1u << 16)
		d->numa_node = (int)u;
	if (nv->temp && nv_ok(s, g, "temperature", nv->temp(dev, NV_TEMPERATURE_GPU, &u)))
		h->temperature_c = u;
	if (nv->power && nv_ok(s, g, "power", nv->power(dev, &u)))
		h->power_mw = u;
	unsigned long long c;
	if (nv->ecc && nv_ok(s, g, "ecc volatile",
			     nv->ecc(dev, NV_MEMORY_ERROR_UNCORRECTED, NV_VOLATILE_ECC, &c)))
		h->ecc_uncorrected_volatile = c > INT64_MAX ? INT64_MAX : (int64_t)c;
	if (nv->ecc && nv_ok(s, g, "ecc aggregate",
			     nv->ecc(dev, NV_MEMORY_ERROR_UNCORRECTED, NV_AGGREGATE_ECC, &c)))
		h->ecc_uncorrected_aggregate = c > INT64_MAX ? INT64_MAX : (int64_t)c;
	if (nv->retired) {
		/* NVML wants a buffer; INSUFFICIENT_SIZE still returns the count. */
		unsigned long long addrs[64];
		int causes[2] = {NV_RETIRE_MULTIPLE_SBE, NV_RETIRE_DBE};
		int64_t *dst[2] = {&h->retired_pages_sbe, &h->retired_pages_dbe};
		for (int k = 0; k < 2; k++) {
			unsigned n = 64;
			rc = nv->retired(dev, causes[k], &n, addrs);
			if (rc == NV_SUCCESS || rc == NV_INSUFFICIENT_SIZE)
				*dst[k] = n;
			else
				nv_ok(s, g, k ? "retired pages dbe" : "retired pages sbe", rc);
		}
	}
	unsigned cr, ur, pend, fail;
	if (nv->remapped && nv_ok(s, g, "remapped rows", nv->remapped(dev, &cr, &ur, &pend, &fail))) {
		h->remapped_rows_correctable = cr;
		h->remapped_rows_uncorrectable = ur;
		h->remapped_rows_pending = pend != 0;
		h->remapped_rows_failed = fail != 0;
	}
	/* NVLinks: state per link; remote type and PCI address of each active one. */
	if (!nv->nvl_state)
		return;
	int noted = 0;
	for (unsigned l = 0; l < NVLINK_MAX; l++) {
		int st = 0;
		rc = nv->nvl_state(dev, l, &st);
		if (rc == NV_NOT_SUPPORTED || rc == NV_INVALID_ARGUMENT)
			continue; /* no NVLink, or past this GPU's link count */
		if (rc != NV_SUCCESS) {
			if (!noted++)
				nv_ok(s, g, "nvlink state", rc);
			continue;
		}
		if (st != NV_FEATURE_ENABLED)
			continue;
		d->nvlinks++;
		nv_pci rp;
		char rbus[DISC_BUSID_SIZE] = "";
		if (nv->nvl_remote_pci && nv->nvl_remote_pci(dev, l, &rp) == NV_SUCCESS) {
			rp.bus_id[sizeof rp.bus_id - 1] = '\0';
			if (disc_busid_normalize(rp.bus_id, rbus, sizeof rbus) != DS_OK)
				rbus[0] = '\0';
		}
		int type = -1;
		if (!nv->nvl_remote_type || nv->nvl_remote_type(dev, l, &type) != NV_SUCCESS)
			type = -1;
		if (type == NV_NVLINK_DEVICE_SWITCH)
			g->nvl_switch++;
		else if (type == NV_NVLINK_DEVICE_GPU && rbus[0])
			ds_strlcpy(g->nvl_gpu_bus[g->nvl_gpu_n++], rbus, DISC_BUSID_SIZE);
		else if (type == -1)
			ds_strlcpy(g->nvl_unk_bus[g->nvl_unk_n++], rbus, DISC_BUSID_SIZE);
	}
}

/* Links whose remote type is unknown (older drivers, or the call failed): a
 * remote that is one of our GPUs is a GPU, anything else an NVSwitch. */
static void nv_resolve_unknown(scan *s)
{
	for (size_t i = 0; i < s->n_gs; i++) {
		gscan *g = &s->gs[i];
		for (int k = 0; k < g->nvl_unk_n; k++) {
			int is_gpu = 0;
			for (size_t j = 0; j < s->n_gs && g->nvl_unk_bus[k][0]; j++)
				is_gpu |= j != i && !strcmp(s->gs[j].g.bus_id, g->nvl_unk_bus[k]);
			if (is_gpu)
				ds_strlcpy(g->nvl_gpu_bus[g->nvl_gpu_n++], g->nvl_unk_bus[k],
					   DISC_BUSID_SIZE);
			else
				g->nvl_switch++;
		}
		g->nvl_unk_n = 0;
		g->g.nvswitch = g->nvl_switch > 0;
	}
}

static int cmp_gscan(const void *a, const void *b)
{
	return strcmp(((const gscan *)a)->g.bus_id, ((const gscan *)b)->g.bus_id);
}

static void nv_close(nvml_api *nv)
{
	if (nv->lib)
		dlclose(nv->lib);
	nv->lib = NULL;
}

/* Opens the library and resolves the symbols; 0 or -1 (noted). */
static int nv_open(scan *s, nvml_api *nv, const char *lib)
{
	memset(nv, 0, sizeof *nv);
	if (strchr(lib, '/') && access(lib, F_OK) != 0) {
		note(s, "nvml", "absent: %s not found", lib);
		return -1;
	}
	dlerror();
	nv->lib = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
	if (!nv->lib) {
		const char *e = dlerror();
		note(s, "nvml", "absent: %s could not be loaded (%s)", lib, e ? e : "dlopen failed");
		return -1;
	}
	for (const nv_sym *y = nv_syms; y->name; y++) {
		void *f = dlsym(nv->lib, y->name);
		if (!f && y->fallback)
			f = dlsym(nv->lib, y->fallback);
		if (!f && y->required) {
			note(s, "nvml", "failed: %s has no %s", lib, y->name);
			nv_close(nv);
			return -1;
		}
		memcpy((char *)nv + y->off, &f, sizeof f);
	}
	return 0;
}

static void gpus_nvml(scan *s, nvml_api *nv)
{
	disc_inventory *inv = s->inv;
	const char *lib = s->p->nvml_lib ? s->p->nvml_lib : DISC_NVML_DEFAULT;
	if (!s->p->nvml_lib && !s->live) {
		note(s, "nvml", "not loaded: --sysroot is set and no --nvml-lib was given "
				"(this machine's NVML would describe another node)");
		return;
	}
	if (nv_open(s, nv, lib))
		return;
	int rc = nv->init();
	if (rc != NV_SUCCESS) {
		note(s, "nvml", "failed: nvmlInit: %s (%d)", nv_err_name(rc), rc);
		nv_close(nv);
		return;
	}
	inv->gpu_kind = DISC_GPUS_NVML;
	char b[96];
	if (nv->driver && nv->driver(b, sizeof b) == NV_SUCCESS) {
		b[sizeof b - 1] = '\0';
		ds_strlcpy(inv->driver_version, b, sizeof inv->driver_version);
	}
	int cv;
	if (nv->cuda && nv->cuda(&cv) == NV_SUCCESS && cv > 0)
		inv->cuda_driver_version = cv;
	unsigned count = 0;
	if ((rc = nv->count(&count)) != NV_SUCCESS) {
		note(s, "nvml", "nvmlDeviceGetCount: %s (%d)", nv_err_name(rc), rc);
		return;
	}
	if (count > DISC_GPUS_MAX) {
		note(s, "nvml", "%u GPUs; only the first %d are listed", count, DISC_GPUS_MAX);
		count = DISC_GPUS_MAX;
	}
	for (unsigned i = 0; i < count; i++) {
		nvdev dev = NULL;
		nv_pci pci;
		if ((rc = nv->handle(i, &dev)) != NV_SUCCESS) {
			note(s, "nvml", "GPU index %u: nvmlDeviceGetHandleByIndex: %s (%d); left out",
			     i, nv_err_name(rc), rc);
			continue;
		}
		if ((rc = nv->pci(dev, &pci)) != NV_SUCCESS) {
			note(s, "nvml", "GPU index %u: nvmlDeviceGetPciInfo: %s (%d); left out", i,
			     nv_err_name(rc), rc);
			continue;
		}
		gscan *g = gscan_add(s);
		if (!g)
			return;
		g->handle = dev;
		g->g.nvml_index = (int)i;
		pci.bus_id[sizeof pci.bus_id - 1] = '\0';
		if (disc_busid_normalize(pci.bus_id, g->g.bus_id, sizeof g->g.bus_id) != DS_OK)
			snprintf(g->g.bus_id, sizeof g->g.bus_id, "%04x:%02x:%02x.0",
				 pci.domain & 0xffff, pci.bus & 0xff, pci.device & 0x1f);
		nv_fields(s, nv, g);
		gpu_sysfs(s, g);
	}
	nv_resolve_unknown(s);
}

/* ---- NICs --------------------------------------------------------------------------------- */

static disc_nic *nic_get(scan *s, const char *name)
{
	disc_inventory *inv = s->inv;
	for (size_t i = 0; i < inv->n_nics; i++)
		if (!strcmp(inv->nics[i].name, name))
			return &inv->nics[i];
	disc_nic *n = grow(s, &inv->nics, &inv->n_nics, &s->cap_nics, sizeof *n, NICS_MAX);
	if (n)
		ds_strlcpy(n->name, name, sizeof n->name);
	return n;
}

static void nic_add_addr(scan *s, disc_nic *n, int family, const void *addr, int prefix)
{
	char a[INET6_ADDRSTRLEN];
	if (!inet_ntop(family, addr, a, sizeof a))
		return;
	if (family == AF_INET && n->n_ipv4 < DISC_NIC_ADDRS)
		snprintf(n->ipv4[n->n_ipv4++], sizeof n->ipv4[0], "%s/%d", a, prefix);
	else if (family == AF_INET6 && n->n_ipv6 < DISC_NIC_ADDRS)
		snprintf(n->ipv6[n->n_ipv6++], sizeof n->ipv6[0], "%s/%d", a, prefix);
	else
		note(s, "nics", "%s: more than %d addresses of one family; %s left out", n->name,
		     DISC_NIC_ADDRS, a);
}

static int mask_bits(const unsigned char *m, size_t len)
{
	int bits = 0;
	for (size_t i = 0; i < len; i++)
		for (int b = 7; b >= 0; b--)
			bits += (m[i] >> b) & 1;
	return bits;
}

static void nics_live(scan *s)
{
	struct ifaddrs *ifs = NULL;
	if (getifaddrs(&ifs) != 0) {
		note(s, "nics", "getifaddrs: %s", strerror(errno));
		return;
	}
	for (struct ifaddrs *a = ifs; a; a = a->ifa_next) {
		if (!a->ifa_name)
			continue;
		disc_nic *n = nic_get(s, a->ifa_name);
		if (!n)
			break;
		if (!a->ifa_addr)
			continue;
		if (a->ifa_addr->sa_family == AF_INET) {
			const struct sockaddr_in *in = (const void *)a->ifa_addr;
			const struct sockaddr_in *m = (const void *)a->ifa_netmask;
			nic_add_addr(s, n, AF_INET, &in->sin_addr,
				     m ? mask_bits((const unsigned char *)&m->sin_addr, 4) : 32);
		} else if (a->ifa_addr->sa_family == AF_INET6) {
			const struct sockaddr_in6 *in = (const void *)a->ifa_addr;
			const struct sockaddr_in6 *m = (const void *)a->ifa_netmask;
			nic_add_addr(s, n, AF_INET6, &in->sin6_addr,
				     m ? mask_bits((const unsigned char *)&m->sin6_addr, 16) : 128);
		}
	}
	freeifaddrs(ifs);
}

/* Under a sysroot: <root>/etc/dsagent-fixture/ifaddrs, lines
 * "IFNAME inet|inet6|link [ADDR/PREFIX]" ('#' comments).  "link" lists an
 * interface that has no address. */
static void nics_fixture(scan *s)
{
	char path[PATH_MAX];
	if (path_of(s, path, sizeof path, FIXTURE_IFADDRS))
		return;
	FILE *f = fopen(path, "re");
	if (!f) {
		note(s, "nics", "%s: %s (under --sysroot, addresses come from this file)",
		     FIXTURE_IFADDRS, errno == ENOENT ? "not found" : strerror(errno));
		return;
	}
	char *line = NULL;
	size_t cap = 0;
	int lineno = 0;
	while (getline(&line, &cap, f) >= 0) {
		lineno++;
		char *hash = strchr(line, '#');
		if (hash)
			*hash = '\0';
		char *save = NULL, *name = strtok_r(line, " \t\r\n", &save);
		if (!name)
			continue;
		char *fam = strtok_r(NULL, " \t\r\n", &save);
		char *addr = strtok_r(NULL, " \t\r\n", &save);
		char *extra = strtok_r(NULL, " \t\r\n", &save);
		int family = fam && !strcmp(fam, "inet") ? AF_INET
			     : fam && !strcmp(fam, "inet6") ? AF_INET6 : 0;
		int is_link = fam && !strcmp(fam, "link");
		if (extra || strlen(name) >= IF_NAMESIZE || (!family && !is_link) ||
		    (family && !addr) || (is_link && addr)) {
			note(s, "nics", "%s:%d: expected 'IFNAME inet|inet6 ADDR/PREFIX' or 'IFNAME link'",
			     FIXTURE_IFADDRS, lineno);
			continue;
		}
		unsigned char buf[16];
		int prefix = 0;
		char *slash = addr ? strchr(addr, '/') : NULL;
		if (family) {
			if (slash)
				*slash = '\0';
			if (!slash || inet_pton(family, addr, buf) != 1 ||
			    ds_parse_int(slash + 1, 0, family == AF_INET ? 32 : 128, &prefix) != DS_OK) {
				note(s, "nics", "%s:%d: '%s' is not an %s address with a /prefix",
				     FIXTURE_IFADDRS, lineno, addr, fam);
				continue;
			}
		}
		disc_nic *n = nic_get(s, name);
		if (!n)
			break;
		if (family)
			nic_add_addr(s, n, family, buf, prefix);
	}
	free(line);
	fclose(f);
}

static int cmp_nic(const void *a, const void *b)
{
	return strverscmp(((const disc_nic *)a)->name, ((const disc_nic *)b)->name);
}

static void nics_scan(scan *s)
{
	if (s->live)
		nics_live(s);
	else
		nics_fixture(s);
	if (s->inv->n_nics)
		qsort(s->inv->nics, s->inv->n_nics, sizeof *s->inv->nics, cmp_nic);
}

/* ---- InfiniBand / RoCE -------------------------------------------------------------------- */

/* The RoCE v2 GID index of port pt: the lowest index >= 1 whose GID is the
 * IPv4-mapped form of one of the netdev's IPv4 addresses, whose type is
 * "RoCE v2" and whose ndevs entry is that netdev (NCCL >= 2.21's choice plus
 * the netdev check; cluster.md section 4). */
static void ib_gid(scan *s, const char *dev, disc_ib_port *pt)
{
	const disc_nic *nic = NULL;
	for (size_t i = 0; i < s->inv->n_nics; i++)
		if (!strcmp(s->inv->nics[i].name, pt->netdev))
			nic = &s->inv->nics[i];
	if (!nic || nic->n_ipv4 == 0) {
		note(s, "infiniband", "%s port %d: netdev %s has no IPv4 address, so no RoCE v2 GID",
		     dev, pt->port, pt->netdev);
		return;
	}
	uint32_t want[DISC_NIC_ADDRS];
	for (int i = 0; i < nic->n_ipv4; i++) {
		char a[24];
		struct in_addr ia;
		ds_strlcpy(a, nic->ipv4[i], sizeof a);
		char *sl = strchr(a, '/');
		if (sl)
			*sl = '\0';
		want[i] = inet_pton(AF_INET, a, &ia) == 1 ? ntohl(ia.s_addr) : 0;
	}
	names ns;
	if (list_dir(s, &ns, 4096, "/sys/class/infiniband/%s/ports/%d/gids", dev, pt->port) != DS_OK) {
		note(s, "infiniband", "%s port %d: no gids directory", dev, pt->port);
		return;
	}
	int best = INT_MAX, bad = 0;
	for (size_t i = 0; i < ns.n; i++) {
		int idx;
		if (ds_parse_int(ns.v[i], 0, 1 << 16, &idx) != DS_OK || idx == 0 || idx >= best)
			continue;
		char b[128];
		uint8_t gid[16];
		uint32_t v4;
		if (rd(s, b, sizeof b, "/sys/class/infiniband/%s/ports/%d/gids/%d", dev, pt->port,
		       idx) != DS_OK)
			continue;
		if (disc_parse_gid(b, gid) != DS_OK) {
			if (!bad++)
				note(s, "infiniband", "%s port %d: gids/%d '%.60s' is not a GID", dev,
				     pt->port, idx, b);
			continue;
		}
		if (!disc_gid_ipv4(gid, &v4))
			continue;
		int match = 0;
		for (int k = 0; k < nic->n_ipv4; k++)
			match |= want[k] == v4;
		if (!match)
			continue;
		/* types/<i> of an unmapped index can fail with EINVAL in containers */
		if (rd(s, b, sizeof b, "/sys/class/infiniband/%s/ports/%d/gid_attrs/types/%d", dev,
		       pt->port, idx) != DS_OK || strcasecmp(b, "RoCE v2") != 0)
			continue;
		if (rd(s, b, sizeof b, "/sys/class/infiniband/%s/ports/%d/gid_attrs/ndevs/%d", dev,
		       pt->port, idx) != DS_OK || strcmp(b, pt->netdev) != 0)
			continue;
		best = idx;
	}
	names_free(&ns);
	if (best != INT_MAX)
		pt->gid_index = best;
	else
		note(s, "infiniband", "%s port %d: no RoCE v2 GID carries an IPv4 address of %s", dev,
		     pt->port, pt->netdev);
}

/* The netdev of a port: the only one on the PCI function, else the one whose
 * dev_port is port - 1 (dual-port cards). */
static void ib_netdev(scan *s, const char *dev, const names *nets, disc_ib_port *pt)
{
	if (nets->n == 1) {
		ds_strlcpy(pt->netdev, nets->v[0], sizeof pt->netdev);
		return;
	}
	for (size_t i = 0; i < nets->n; i++) {
		char b[32];
		int dp;
		if (rd(s, b, sizeof b, "/sys/class/infiniband/%s/device/net/%s/dev_port", dev,
		       nets->v[i]) == DS_OK &&
		    ds_parse_int(b, 0, 1 << 16, &dp) == DS_OK && dp == pt->port - 1) {
			ds_strlcpy(pt->netdev, nets->v[i], sizeof pt->netdev);
			return;
		}
	}
	if (nets->n > 1)
		note(s, "infiniband", "%s port %d: %zu netdevs and none has dev_port %d", dev, pt->port,
		     nets->n, pt->port - 1);
}

static void ib_port(scan *s, const char *dev, const ibdev *d, const names *nets, int port,
		    const char *hca, const char *fw)
{
	disc_inventory *inv = s->inv;
	disc_ib_port *pt = grow(s, &inv->ib_ports, &inv->n_ib_ports, &s->cap_ib, sizeof *pt, IB_PORTS_MAX);
	if (!pt) {
		if (!s->oom)
			note(s, "infiniband", "more than %d ports; the rest are left out", IB_PORTS_MAX);
		return;
	}
	ds_strlcpy(pt->device, dev, sizeof pt->device);
	pt->port = port;
	ds_strlcpy(pt->bus_id, d->bus_id, sizeof pt->bus_id);
	pt->numa_node = d->numa;
	ds_strlcpy(pt->hca_type, hca, sizeof pt->hca_type);
	ds_strlcpy(pt->fw_ver, fw, sizeof pt->fw_ver);
	pt->state_code = pt->phys_state_code = pt->width = pt->gid_index = DISC_NONE;
	pt->rate_gbps = -1;
	char b[128];
	const char *pre = "/sys/class/infiniband";
	if (rd(s, b, sizeof b, "%s/%s/ports/%d/state", pre, dev, port) != DS_OK)
		note(s, "infiniband", "%s port %d: state not readable", dev, port);
	else if (disc_parse_state(b, &pt->state_code, pt->state, sizeof pt->state) != DS_OK)
		note(s, "infiniband", "%s port %d: state '%.40s' is not '<n>: <NAME>'", dev, port, b);
	if (rd(s, b, sizeof b, "%s/%s/ports/%d/phys_state", pre, dev, port) != DS_OK)
		note(s, "infiniband", "%s port %d: phys_state not readable", dev, port);
	else if (disc_parse_state(b, &pt->phys_state_code, pt->phys_state, sizeof pt->phys_state))
		note(s, "infiniband", "%s port %d: phys_state '%.40s' is not '<n>: <Name>'", dev, port, b);
	if (rd(s, b, sizeof b, "%s/%s/ports/%d/rate", pre, dev, port) != DS_OK) {
		note(s, "infiniband", "%s port %d: rate not readable", dev, port);
	} else if (disc_parse_rate(b, &pt->rate_gbps, &pt->width, pt->speed, sizeof pt->speed)) {
		pt->rate_gbps = -1;
		pt->width = DISC_NONE;
		pt->speed[0] = '\0';
		note(s, "infiniband", "%s port %d: rate '%.40s' is not '<N> Gb/sec (<W>X <SPEED>)'",
		     dev, port, b);
	}
	if (rd(s, b, sizeof b, "%s/%s/ports/%d/link_layer", pre, dev, port) != DS_OK)
		note(s, "infiniband", "%s port %d: link_layer not readable", dev, port);
	else if (!strcmp(b, "InfiniBand") || !strcmp(b, "Ethernet"))
		ds_strlcpy(pt->link_layer, b, sizeof pt->link_layer);
	else
		note(s, "infiniband", "%s port %d: link_layer '%.40s' is not InfiniBand or Ethernet",
		     dev, port, b);
	ib_netdev(s, dev, nets, pt);
	pt->usable = pt->state_code == 4 && pt->phys_state_code == 5;
	if (pt->usable && !strcmp(pt->link_layer, "Ethernet")) {
		if (pt->netdev[0])
			ib_gid(s, dev, pt);
		else
			note(s, "infiniband", "%s port %d: RoCE port without a netdev", dev, port);
	}
}

static void ib_scan(scan *s)
{
	names devs;
	if (list_dir(s, &devs, 1024, "/sys/class/infiniband") != DS_OK) {
		note(s, "infiniband", "absent: /sys/class/infiniband not found (no RDMA devices)");
		return;
	}
	for (size_t i = 0; i < devs.n; i++) {
		const char *dev = devs.v[i];
		ibdev *d = grow(s, &s->ib, &s->n_ib, &s->cap_ibdev, sizeof *d, 1024);
		if (!d)
			break;
		ds_strlcpy(d->name, dev, sizeof d->name);
		d->numa = DISC_NONE;
		char rel[PATH_MAX], hca[32], fw[32];
		snprintf(rel, sizeof rel, "/sys/class/infiniband/%s/device", dev);
		if (sys_resolve(s, rel, d->path, sizeof d->path) == DS_OK) {
			char bdf[DISC_BUSID_SIZE];
			const char *base = strrchr(d->path, '/');
			if (!base || disc_busid_normalize(base + 1, bdf, sizeof bdf) != DS_OK) {
				d->path[0] = '\0'; /* not a PCI function (soft RoCE, ...) */
			} else {
				ds_strlcpy(d->bus_id, bdf, sizeof d->bus_id);
				d->numa = dev_numa(s, "infiniband", dev, rel);
			}
		}
		if (rd(s, hca, sizeof hca, "/sys/class/infiniband/%s/hca_type", dev) != DS_OK)
			hca[0] = '\0';
		if (rd(s, fw, sizeof fw, "/sys/class/infiniband/%s/fw_ver", dev) != DS_OK)
			fw[0] = '\0';
		names nets, ports; /* empty when the directory is absent */
		list_dir(s, &nets, 64, "/sys/class/infiniband/%s/device/net", dev);
		if (list_dir(s, &ports, 64, "/sys/class/infiniband/%s/ports", dev) != DS_OK)
			note(s, "infiniband", "%s: no ports directory", dev);
		for (size_t k = 0; k < ports.n; k++) {
			int port;
			if (ds_parse_int(ports.v[k], 1, 255, &port) != DS_OK) {
				note(s, "infiniband", "%s: port '%s' is not a number", dev, ports.v[k]);
				continue;
			}
			ib_port(s, dev, d, &nets, port, hca, fw);
		}
		names_free(&nets);
		names_free(&ports);
	}
	names_free(&devs);
}

/* ---- links and distances ------------------------------------------------------------------- */

static int host_same_numa(const scan *s, int a, int b)
{
	return s->inv->host.n_numa <= 1 || (a >= 0 && a == b);
}

static void links_build(scan *s, nvml_api *nv)
{
	disc_inventory *inv = s->inv;
	for (size_t a = 0; a < s->n_gs; a++) {
		for (size_t b = a + 1; b < s->n_gs; b++) {
			gscan *ga = &s->gs[a], *gb = &s->gs[b];
			disc_gpu_link *l = grow(s, &inv->links, &inv->n_links, &s->cap_links, sizeof *l,
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
			int anc;
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
			} else if (nv && nv->ancestor && ga->handle && gb->handle &&
				   nv->ancestor(ga->handle, gb->handle, &anc) == NV_SUCCESS) {
				l->level = anc <= 10 ? DISC_LEVEL_PIX : anc <= 20 ? DISC_LEVEL_PXB
					   : anc <= 30 ? DISC_LEVEL_PHB : anc <= 40 ? DISC_LEVEL_NODE
					   : DISC_LEVEL_SYS;
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

static void gpu_nic_build(scan *s)
{
	disc_inventory *inv = s->inv;
	for (size_t g = 0; g < s->n_gs; g++) {
		for (size_t i = 0; i < s->n_ib; i++) {
			const gscan *gs = &s->gs[g];
			const ibdev *d = &s->ib[i];
			disc_gpu_nic *e = grow(s, &inv->gpu_nic, &inv->n_gpu_nic, &s->cap_gn, sizeof *e,
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
static void gpus_cross_check(scan *s)
{
	disc_inventory *inv = s->inv;
	if (inv->gpu_kind == DISC_GPUS_NONE) {
		if (inv->n_pci_gpus)
			note(s, "gpus", "%zu NVIDIA GPUs on the PCI bus are unusable without NVML: "
					"CPU ranks only", inv->n_pci_gpus);
		return;
	}
	for (size_t i = 0; i < inv->n_pci_gpus; i++) {
		int found = 0;
		for (size_t k = 0; k < s->n_gs; k++)
			found |= !strcmp(s->gs[k].g.bus_id, inv->pci_gpus[i].bus_id);
		if (!found)
			note(s, "gpus", "%s is an NVIDIA GPU on the PCI bus that %s does not list",
			     inv->pci_gpus[i].bus_id,
			     inv->gpu_kind == DISC_GPUS_FAKE ? "--fake-gpus" : "NVML");
	}
}

/* ---- the run ----------------------------------------------------------------------------- */

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
	nvml_api nv;
	disc_fake_spec fake;
	int rc = DS_OK;
	memset(&s, 0, sizeof s);
	memset(&nv, 0, sizeof nv);
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

	host_hostname(&s);
	host_cpuinfo(&s);
	host_meminfo(&s);
	host_numa(&s);
	pci_scan(&s);
	if (p->fake_gpus)
		rc = gpus_fake(&s, &fake);
	else
		gpus_nvml(&s, &nv);
	if (rc)
		goto out;
	if (s.n_gs)
		qsort(s.gs, s.n_gs, sizeof *s.gs, cmp_gscan);
	gpus_cross_check(&s);
	nics_scan(&s);
	ib_scan(&s);
	links_build(&s, nv.lib ? &nv : NULL);
	gpu_nic_build(&s);
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
	if (nv.lib) {
		nv.shutdown();
		nv_close(&nv);
	}
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
		sodium_bin2hex(hex, DISC_DIGEST_HEX, h, sizeof h);
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
