/*
 * discover_impl.h - what the files of discovery share (agent/node/discover*.c):
 * the per-run state, the helpers that read files under the sysroot, and each
 * source's entry point, in the order disc_run calls them:
 *
 *   disc_host_scan (discover_host.c) -> disc_pci_scan (discover_pci.c)
 *   -> disc_gpus_fake | disc_nvml_gpus (discover_nvml.c)
 *   -> disc_gpus_cross_check (discover_pci.c) -> disc_nics_scan,
 *   disc_ib_scan (discover_net.c) -> disc_links_build, disc_gpu_nic_build
 *   (discover_pci.c); discover_json.c turns the result into JSON and its
 *   digest.
 *
 * Private to agent/node: nothing outside discover*.c includes it.  One scan
 * belongs to one disc_run (one thread).
 */
#ifndef DS_AGENT_DISCOVER_IMPL_H
#define DS_AGENT_DISCOVER_IMPL_H

#include "agent/node/discover.h"

#include <limits.h>
#include <stddef.h>

#define NUMA_MAX 256
#define IB_PORTS_MAX 256
#define NICS_MAX 256
#define PCI_GPUS_MAX 256
#define SOCKETS_MAX 256
#define NVLINK_MAX 36 /* NVML_NVLINK_MAX_LINKS in NVML API 13 */
#define PATH_COMPONENTS_MAX 32
#define FIXTURE_IFADDRS "/etc/dsagent-fixture/ifaddrs"
#define FIXTURE_IFADDRS_MAX (1u << 20) /* bytes of that file */

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

/* Directory entries (not "." or ".."), sorted in natural order; caller frees
 * with disc_names_free. */
typedef struct names {
	char **v;
	size_t n;
} names;

/* ---- discover.c: the run and files under the root ---- */

/* Appends one zeroed element (at most max); NULL when full or out of memory
 * (then s->oom is set). */
void *disc_grow(scan *s, void *arrp, size_t *n, size_t *cap, size_t size, size_t max);
/* Adds a note of source src to the inventory (counted when the notes are full). */
void disc_note_add(scan *s, const char *src, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* <root><fmt...> into out.  DS_ERANGE when it does not fit. */
int disc_path_of(const scan *s, char *out, size_t size, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
/* The small text file <root><fmt...>, trailing whitespace removed.  DS_OK,
 * DS_ENOTFOUND (absent) or DS_EIO (unreadable; errno kept). */
int disc_rd(const scan *s, char *buf, size_t size, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
/* The directory <root><fmt...> (at most max entries).  DS_ENOTFOUND when it
 * is absent. */
int disc_list_dir(scan *s, names *ns, size_t max, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
void disc_names_free(names *ns);
/* Resolves <root><rel> (a symlink into /sys/devices, as sysfs has them) to
 * its path relative to the root, "/sys/devices/...".  DS_ENOTFOUND when it
 * does not exist or lands outside <root>/sys/devices. */
int disc_sys_resolve(const scan *s, const char *rel, char *out, size_t size);

/* ---- discover_host.c ---- */

/* Host name, CPU model, sockets and cores, memory, NUMA nodes. */
void disc_host_scan(scan *s);

/* ---- discover_pci.c ---- */

/* The NUMA node of the device directory dir_rel (-1 when unknown, noted). */
int disc_dev_numa(scan *s, const char *src, const char *what, const char *dir_rel);
/* NVIDIA display functions on the PCI bus into inv->pci_gpus. */
void disc_pci_scan(scan *s);
/* One more GPU in the scan (NULL when full, noted, or out of memory). */
gscan *disc_gscan_add(scan *s);
/* The GPU's sysfs path and NUMA node from its bus id. */
void disc_gpu_sysfs(scan *s, gscan *gs);
/* Notes about GPUs on the PCI bus that the GPU source does not list. */
void disc_gpus_cross_check(scan *s);
/* The distance of every GPU pair (NVLink, sysfs, NVML when nv, NUMA). */
void disc_links_build(scan *s, nvml_api *nv);
/* The distance of every GPU to every RDMA device. */
void disc_gpu_nic_build(scan *s);

/* ---- discover_nvml.c ---- */

/* The GPUs of a --fake-gpus spec.  DS_OK or DS_ENOMEM. */
int disc_gpus_fake(scan *s, const disc_fake_spec *f);
/* The GPUs NVML lists; the library stays loaded (for disc_nvml_level) until
 * disc_nvml_close.  NULL when NVML is not used or not usable (noted). */
nvml_api *disc_nvml_gpus(scan *s);
/* 1 and *level when NVML knows the common ancestor of the two GPUs. */
int disc_nvml_level(nvml_api *nv, const gscan *a, const gscan *b, disc_level *level);
/* nvmlShutdown, unloads the library, frees.  NULL is a no-op. */
void disc_nvml_close(nvml_api *nv);

/* ---- discover_net.c ---- */

/* NICs: getifaddrs on the live system, else the fixture file. */
void disc_nics_scan(scan *s);
/* InfiniBand / RoCE ports from sysfs (RoCE v2 GIDs need the NICs first). */
void disc_ib_scan(scan *s);

#endif
