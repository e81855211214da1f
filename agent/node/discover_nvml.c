/*
 * discover_nvml.c - the GPUs: from a --fake-gpus spec (model data sheets,
 * values derived from the spec and a seed), or from NVML loaded with dlopen
 * (identity, memory, compute capability, NUMA node, health counters, NVLink
 * peers).
 *
 * Callers: disc_run (discover.c) through disc_gpus_fake / disc_nvml_gpus /
 * disc_nvml_close, disc_links_build (discover_pci.c) through
 * disc_nvml_level; disc_fake_parse, disc_fake_bus_id and disc_fake_uuid are
 * public (discover.h; agent/options.c validates --fake-gpus).  Calls: NVML
 * through dlopen/dlsym, libsodium (BLAKE2b of fake UUIDs).
 *
 * Invariants: discover.c's 1-4; only the symbols listed in nv_syms are
 * called, each checked for presence (required ones fail the load, noted);
 * NVML is loaded from the library the caller names, or the default one only
 * when the sysroot is "/".
 *
 * Threading: NVML init/shutdown is process-wide, so one disc_run at a time.
 */
#include "agent/node/discover_impl.h"
#include "common/hex.h"
#include "common/strutil.h"

#include <ctype.h>
#include <dlfcn.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- fake GPUs ----------------------------------------------------------------- */

typedef struct fake_model {
	const char *name;
	int cc_major, cc_minor, nvlinks;
} fake_model;

/* Compute capability and NVLink count per model (NVIDIA data sheets). */
static const fake_model fake_models[] = {
	{.name = "H100", .cc_major = 9, .cc_minor = 0, .nvlinks = 18},
	{.name = "H200", .cc_major = 9, .cc_minor = 0, .nvlinks = 18},
	{.name = "H800", .cc_major = 9, .cc_minor = 0, .nvlinks = 8},
	{.name = "H20", .cc_major = 9, .cc_minor = 0, .nvlinks = 18},
	{.name = "GH200", .cc_major = 9, .cc_minor = 0, .nvlinks = 18},
	{.name = "B200", .cc_major = 10, .cc_minor = 0, .nvlinks = 18},
	{.name = "A100", .cc_major = 8, .cc_minor = 0, .nvlinks = 12},
	{.name = "A800", .cc_major = 8, .cc_minor = 0, .nvlinks = 8},
	{.name = "A10", .cc_major = 8, .cc_minor = 6, .nvlinks = 0},
	{.name = "L40S", .cc_major = 8, .cc_minor = 9, .nvlinks = 0},
	{.name = "L4", .cc_major = 8, .cc_minor = 9, .nvlinks = 0},
	{.name = "V100", .cc_major = 7, .cc_minor = 0, .nvlinks = 6},
	{.name = NULL},
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
	ds_hex_encode(h, sizeof h, hex);
	snprintf(out, size, "GPU-%.8s-%.4s-%.4s-%.4s-%.12s", hex, hex + 8, hex + 12, hex + 16,
		 hex + 20);
	return DS_OK;
}

/* ---- fake GPUs into the scan ---------------------------------------------------------- */

int disc_gpus_fake(scan *s, const disc_fake_spec *f)
{
	disc_inventory *inv = s->inv;
	const char *seed = s->p->fake_seed ? s->p->fake_seed : inv->host.hostname;
	inv->gpu_kind = DISC_GPUS_FAKE;
	ds_strlcpy(inv->fake_spec, s->p->fake_gpus, sizeof inv->fake_spec);
	disc_note_add(s, "nvml", "not loaded: replaced by --fake-gpus %s", s->p->fake_gpus);
	for (int i = 0; i < f->n; i++) {
		gscan *g = disc_gscan_add(s);
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
		disc_gpu_sysfs(s, g);
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
	{.name = "nvmlInit_v2", .fallback = "nvmlInit", .off = NVO(init), .required = 1},
	{.name = "nvmlShutdown", .fallback = NULL, .off = NVO(shutdown), .required = 1},
	{.name = "nvmlDeviceGetCount_v2",
	 .fallback = "nvmlDeviceGetCount",
	 .off = NVO(count),
	 .required = 1},
	{.name = "nvmlDeviceGetHandleByIndex_v2",
	 .fallback = "nvmlDeviceGetHandleByIndex",
	 .off = NVO(handle),
	 .required = 1},
	{.name = "nvmlDeviceGetPciInfo_v3",
	 .fallback = "nvmlDeviceGetPciInfo_v2",
	 .off = NVO(pci),
	 .required = 1},
	{.name = "nvmlDeviceGetUUID", .fallback = NULL, .off = NVO(uuid), .required = 0},
	{.name = "nvmlDeviceGetName", .fallback = NULL, .off = NVO(name), .required = 0},
	{.name = "nvmlDeviceGetMemoryInfo", .fallback = NULL, .off = NVO(mem), .required = 0},
	{.name = "nvmlDeviceGetCudaComputeCapability",
	 .fallback = NULL,
	 .off = NVO(cc),
	 .required = 0},
	{.name = "nvmlDeviceGetNumaNodeId", .fallback = NULL, .off = NVO(numa), .required = 0},
	{.name = "nvmlDeviceGetTemperature", .fallback = NULL, .off = NVO(temp), .required = 0},
	{.name = "nvmlDeviceGetPowerUsage", .fallback = NULL, .off = NVO(power), .required = 0},
	{.name = "nvmlDeviceGetTotalEccErrors", .fallback = NULL, .off = NVO(ecc), .required = 0},
	{.name = "nvmlDeviceGetRetiredPages", .fallback = NULL, .off = NVO(retired), .required = 0},
	{.name = "nvmlDeviceGetRemappedRows",
	 .fallback = NULL,
	 .off = NVO(remapped),
	 .required = 0},
	{.name = "nvmlDeviceGetNvLinkState",
	 .fallback = NULL,
	 .off = NVO(nvl_state),
	 .required = 0},
	{.name = "nvmlDeviceGetNvLinkRemotePciInfo_v2",
	 .fallback = "nvmlDeviceGetNvLinkRemotePciInfo",
	 .off = NVO(nvl_remote_pci),
	 .required = 0},
	{.name = "nvmlDeviceGetNvLinkRemoteDeviceType",
	 .fallback = NULL,
	 .off = NVO(nvl_remote_type),
	 .required = 0},
	{.name = "nvmlDeviceGetTopologyCommonAncestor",
	 .fallback = NULL,
	 .off = NVO(ancestor),
	 .required = 0},
	{.name = "nvmlSystemGetDriverVersion", .fallback = NULL, .off = NVO(driver), .required = 0},
	{.name = "nvmlSystemGetCudaDriverVersion_v2",
	 .fallback = "nvmlSystemGetCudaDriverVersion",
	 .off = NVO(cuda),
	 .required = 0},
	{.name = NULL},
};

/* A per-field NVML result: DS_OK on success; NOT_SUPPORTED (and a missing
 * symbol) is a normal "unknown"; other codes are noted once per field. */
static int nv_ok(scan *s, const gscan *g, const char *field, int rc)
{
	if (rc == NV_SUCCESS)
		return 1;
	if (rc != NV_NOT_SUPPORTED && rc != NV_FUNCTION_NOT_FOUND)
		disc_note_add(s, "nvml", "%s %s: %s: %s (%d)", g->g.bus_id, g->g.uuid[0] ? g->g.uuid : "",
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
		disc_note_add(s, "nvml", "absent: %s not found", lib);
		return -1;
	}
	dlerror();
	nv->lib = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
	if (!nv->lib) {
		const char *e = dlerror();
		disc_note_add(s, "nvml", "absent: %s could not be loaded (%s)", lib, e ? e : "dlopen failed");
		return -1;
	}
	for (const nv_sym *y = nv_syms; y->name; y++) {
		void *f = dlsym(nv->lib, y->name);
		if (!f && y->fallback)
			f = dlsym(nv->lib, y->fallback);
		if (!f && y->required) {
			disc_note_add(s, "nvml", "failed: %s has no %s", lib, y->name);
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
		disc_note_add(s, "nvml", "not loaded: --sysroot is set and no --nvml-lib was given "
				"(this machine's NVML would describe another node)");
		return;
	}
	if (nv_open(s, nv, lib))
		return;
	int rc = nv->init();
	if (rc != NV_SUCCESS) {
		disc_note_add(s, "nvml", "failed: nvmlInit: %s (%d)", nv_err_name(rc), rc);
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
		disc_note_add(s, "nvml", "nvmlDeviceGetCount: %s (%d)", nv_err_name(rc), rc);
		return;
	}
	if (count > DISC_GPUS_MAX) {
		disc_note_add(s, "nvml", "%u GPUs; only the first %d are listed", count, DISC_GPUS_MAX);
		count = DISC_GPUS_MAX;
	}
	for (unsigned i = 0; i < count; i++) {
		nvdev dev = NULL;
		nv_pci pci;
		if ((rc = nv->handle(i, &dev)) != NV_SUCCESS) {
			disc_note_add(s, "nvml", "GPU index %u: nvmlDeviceGetHandleByIndex: %s (%d); left out",
			     i, nv_err_name(rc), rc);
			continue;
		}
		if ((rc = nv->pci(dev, &pci)) != NV_SUCCESS) {
			disc_note_add(s, "nvml", "GPU index %u: nvmlDeviceGetPciInfo: %s (%d); left out", i,
			     nv_err_name(rc), rc);
			continue;
		}
		gscan *g = disc_gscan_add(s);
		if (!g)
			return;
		g->handle = dev;
		g->g.nvml_index = (int)i;
		pci.bus_id[sizeof pci.bus_id - 1] = '\0';
		if (disc_busid_normalize(pci.bus_id, g->g.bus_id, sizeof g->g.bus_id) != DS_OK)
			snprintf(g->g.bus_id, sizeof g->g.bus_id, "%04x:%02x:%02x.0",
				 pci.domain & 0xffff, pci.bus & 0xff, pci.device & 0x1f);
		nv_fields(s, nv, g);
		disc_gpu_sysfs(s, g);
	}
	nv_resolve_unknown(s);
}


nvml_api *disc_nvml_gpus(scan *s)
{
	nvml_api *nv = calloc(1, sizeof *nv);
	if (!nv) {
		s->oom = 1;
		return NULL;
	}
	gpus_nvml(s, nv);
	if (!nv->lib) { /* not there or not usable (noted) */
		free(nv);
		return NULL;
	}
	return nv;
}

int disc_nvml_level(nvml_api *nv, const gscan *a, const gscan *b, disc_level *level)
{
	int anc;
	if (!nv || !nv->ancestor || !a->handle || !b->handle ||
	    nv->ancestor(a->handle, b->handle, &anc) != NV_SUCCESS)
		return 0;
	*level = anc <= 10 ? DISC_LEVEL_PIX : anc <= 20 ? DISC_LEVEL_PXB
		 : anc <= 30 ? DISC_LEVEL_PHB : anc <= 40 ? DISC_LEVEL_NODE
		 : DISC_LEVEL_SYS;
	return 1;
}

void disc_nvml_close(nvml_api *nv)
{
	if (!nv)
		return;
	if (nv->lib) {
		nv->shutdown();
		nv_close(nv);
	}
	free(nv);
}
