/*
 * discover.h - what this node has: host, GPUs, InfiniBand/RoCE ports, NICs and
 * the distances between them (agent/node/discover.c; docs/cluster.md "Discovery").
 *
 *     disc_params p = disc_default_params();
 *     p.sysroot = "/";                  (or a fixture tree)
 *     disc_inventory *inv = NULL;
 *     if (disc_run(&p, &inv, &err) == DS_OK) { json_t *j = disc_to_json(inv); ... }
 *     disc_free(inv);
 *
 * Every path is read under `sysroot`.  GPUs come from NVML (dlopen'd, never
 * linked), or from a `--fake-gpus` spec.  Each source fails soft: an absent
 * file, library or symbol, an NVML error or a malformed sysfs value becomes a
 * note in the inventory (`notes`), never an error.  No GPU and no NVML is a
 * node with CPU ranks (`compute.kind = "cpu"`).
 *
 * JSON (disc_to_json; keys in this order; null = unknown):
 *
 *   { "schema": 1,
 *     "host": { "hostname": s, "cpu_model": s, "cpus": n, "sockets": n, "memory_bytes": n,
 *               "numa_nodes": [ {"id": n, "cpulist": s, "cpus": n, "memory_bytes": n} ] },
 *     "compute": { "kind": "gpu"|"cpu", "ranks": n },        gpu: one rank per GPU;
 *                                                           cpu: one per NUMA node (>= 1)
 *     "gpu_source": { "kind": "nvml"|"fake"|"none", "spec": s, "driver_version": s,
 *                     "cuda_driver_version": n },
 *     "gpus": [ { "index": n, "nvml_index": n, "uuid": s, "name": s, "bus_id": s,
 *                 "numa_node": n, "compute_capability": "9.0", "memory_total_bytes": n,
 *                 "nvlinks": n, "nvswitch": b,
 *                 "health": { "temperature_c", "power_mw", "memory_used_bytes",
 *                             "ecc_uncorrected_volatile", "ecc_uncorrected_aggregate",
 *                             "retired_pages_sbe", "retired_pages_dbe",
 *                             "remapped_rows_correctable", "remapped_rows_uncorrectable": n,
 *                             "remapped_rows_pending", "remapped_rows_failed": b } } ],
 *     "pci_gpus": [ { "bus_id": s, "pci_id": "10de:2330", "numa_node": n } ],
 *     "gpu_links": [ { "a": n, "b": n, "level": "NV18"|"PIX"|"PXB"|"PHB"|"NODE"|"SYS"|"unknown",
 *                      "nvlinks": n, "nvswitch": b,
 *                      "source": "nvlink"|"sysfs"|"nvml"|"numa"|"none" } ],
 *     "ib_ports": [ { "device": s, "port": n, "bus_id": s, "numa_node": n, "hca_type": s,
 *                     "fw_ver": s, "link_layer": s, "state": s, "phys_state": s,
 *                     "rate_gbps": x, "width": n, "speed": s, "netdev": s,
 *                     "gid_index": n, "usable": b } ],
 *     "nics": [ { "name": s, "ipv4": ["10.0.0.1/24"], "ipv6": ["fe80::1/64"] } ],
 *     "gpu_nic": [ { "gpu": n, "nic": s, "level": s, "source": s } ],
 *     "notes": [ { "source": s, "message": s } ] }
 *
 * gpus are ordered by bus id ("index" is that order, as CUDA_DEVICE_ORDER=
 * PCI_BUS_ID numbers them); gpu_links has one entry per pair a < b; gpu_nic
 * one per GPU x RDMA device; ib_ports and nics are in natural name order.
 *
 * Threading: disc_run touches no global state except NVML's (it calls
 * nvmlInit/nvmlShutdown), so run it from one thread at a time.
 */
#ifndef DS_AGENT_DISCOVER_H
#define DS_AGENT_DISCOVER_H

#include "common/status.h"

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define DISC_SCHEMA 1
#define DISC_NONE (-1)       /* unknown integer field (JSON null) */
#define DISC_BUSID_SIZE 16   /* "0000:18:00.0" (5-digit VMD domains fit too) */
#define DISC_GPUS_MAX 64
#define DISC_FAKE_MAX 16     /* --fake-gpus count */
#define DISC_NIC_ADDRS 16    /* addresses kept per family per NIC */
#define DISC_NOTES_MAX 256
#define DISC_DIGEST_HEX 65   /* BLAKE2b-256 as hex + NUL */
#define DISC_NVML_DEFAULT "libnvidia-ml.so.1"

typedef struct disc_params {
	const char *sysroot;   /* everything is read under it; NULL or "/" = this machine */
	const char *fake_gpus; /* NULL = NVML; else a spec (disc_fake_parse) */
	const char *nvml_lib;  /* NULL = DISC_NVML_DEFAULT, which is not loaded under a
				* sysroot other than "/" (it would describe this machine);
				* tests point it at tests/fixtures/fake_nvml.c built as a .so */
	const char *fake_seed; /* seed of fake GPU UUIDs; NULL = the discovered hostname */
} disc_params;

disc_params disc_default_params(void);

/* Topology level between two devices, nearest first (nvidia-smi topo -m names). */
typedef enum disc_level {
	DISC_LEVEL_NV = 0,  /* NVLink (with a link count: "NV18") */
	DISC_LEVEL_PIX,     /* at most one PCIe switch */
	DISC_LEVEL_PXB,     /* several PCIe bridges, no host bridge */
	DISC_LEVEL_PHB,     /* through one host bridge (root complex) */
	DISC_LEVEL_NODE,    /* different host bridges, same NUMA node */
	DISC_LEVEL_SYS,     /* across the inter-socket link */
	DISC_LEVEL_UNKNOWN,
} disc_level;

/* Where a level came from. */
typedef enum disc_src {
	DISC_SRC_NONE = 0,
	DISC_SRC_NVLINK, /* NVLink state and remote ends */
	DISC_SRC_SYSFS,  /* PCI paths under /sys/devices */
	DISC_SRC_NVML,   /* nvmlDeviceGetTopologyCommonAncestor */
	DISC_SRC_NUMA,   /* NUMA nodes only (a device has no sysfs path) */
} disc_src;

typedef enum disc_gpu_kind { DISC_GPUS_NONE = 0, DISC_GPUS_NVML, DISC_GPUS_FAKE } disc_gpu_kind;

typedef struct disc_numa {
	int id;
	char cpulist[256];    /* "0-55,112-167"; "" = unknown */
	int cpus;             /* DISC_NONE = unknown */
	int64_t memory_bytes; /* DISC_NONE = unknown */
} disc_numa;

typedef struct disc_host {
	char hostname[256];   /* "" = unknown */
	char cpu_model[128];  /* "" = unknown */
	int cpus, sockets;    /* DISC_NONE = unknown */
	int64_t memory_bytes; /* MemTotal; DISC_NONE = unknown */
	disc_numa *numa;      /* sorted by id */
	size_t n_numa;
} disc_host;

/* Readings that change while the node runs; left out of the digest.
 * Every field is DISC_NONE when NVML does not support it or failed. */
typedef struct disc_gpu_health {
	int64_t temperature_c, power_mw, memory_used_bytes;
	int64_t ecc_uncorrected_volatile, ecc_uncorrected_aggregate;
	int64_t retired_pages_sbe, retired_pages_dbe;          /* pre-Ampere */
	int64_t remapped_rows_correctable, remapped_rows_uncorrectable; /* Ampere+ */
	int remapped_rows_pending, remapped_rows_failed;       /* 0/1 or DISC_NONE */
} disc_gpu_health;

typedef struct disc_gpu {
	int index;                 /* position in bus id order */
	int nvml_index;            /* NVML's own index (not stable across boots) */
	char uuid[96];             /* "GPU-..."; "" = unknown */
	char name[96];             /* "" = unknown */
	char bus_id[DISC_BUSID_SIZE]; /* normalised: "0000:18:00.0" */
	int numa_node;             /* DISC_NONE = unknown */
	int cc_major, cc_minor;    /* DISC_NONE = unknown */
	int64_t memory_total_bytes; /* DISC_NONE = unknown */
	int nvlinks;               /* active NVLinks */
	int nvswitch;              /* 1 when active links reach an NVSwitch */
	disc_gpu_health health;
} disc_gpu;

/* An NVIDIA display-class function on the PCI bus (whether or not NVML works). */
typedef struct disc_pci_gpu {
	char bus_id[DISC_BUSID_SIZE];
	unsigned vendor, device;
	int numa_node;
} disc_pci_gpu;

typedef struct disc_gpu_link {
	int a, b;       /* gpus[] indexes, a < b */
	disc_level level;
	int nvlinks;    /* > 0 only for DISC_LEVEL_NV */
	int nvswitch;
	disc_src source;
} disc_gpu_link;

typedef struct disc_ib_port {
	char device[64];              /* "mlx5_0" */
	int port;
	char bus_id[DISC_BUSID_SIZE]; /* "" = not a PCI device (e.g. soft RoCE) */
	int numa_node;
	char hca_type[32], fw_ver[32]; /* "" = absent */
	char link_layer[16];          /* "InfiniBand" | "Ethernet"; "" = unknown */
	char state[32], phys_state[32]; /* "ACTIVE", "LinkUp"; "" = unknown */
	int state_code, phys_state_code; /* 4, 5; DISC_NONE = unknown */
	double rate_gbps;             /* < 0 = unknown */
	int width;                    /* lanes, 4 for "4X"; DISC_NONE = unknown */
	char speed[8];                /* "NDR"; "" = unknown */
	char netdev[64];              /* "" = none */
	int gid_index;                /* RoCE v2 GID of the netdev's IPv4; DISC_NONE */
	int usable;                   /* ACTIVE and LinkUp */
} disc_ib_port;

typedef struct disc_nic {
	char name[64];
	char ipv4[DISC_NIC_ADDRS][24]; /* "10.0.0.1/24" */
	char ipv6[DISC_NIC_ADDRS][56]; /* "fe80::1/64" */
	int n_ipv4, n_ipv6;
} disc_nic;

typedef struct disc_gpu_nic {
	int gpu;        /* gpus[] index */
	char nic[64];   /* RDMA device name */
	disc_level level;
	disc_src source;
} disc_gpu_nic;

typedef struct disc_note {
	char source[16];   /* "host", "numa", "pci", "nvml", "gpus", "nics", "infiniband", "notes" */
	char message[320];
} disc_note;

typedef struct disc_inventory {
	disc_host host;
	int compute_gpu; /* 1 = GPU ranks, 0 = CPU ranks */
	int ranks;
	disc_gpu_kind gpu_kind;
	char fake_spec[64];       /* the --fake-gpus spec when gpu_kind is FAKE */
	char driver_version[80];  /* "" = unknown */
	int cuda_driver_version;  /* 12040 = 12.4; DISC_NONE = unknown */
	disc_gpu *gpus;
	size_t n_gpus;
	disc_pci_gpu *pci_gpus;
	size_t n_pci_gpus;
	disc_gpu_link *links;
	size_t n_links;
	disc_ib_port *ib_ports;
	size_t n_ib_ports;
	disc_nic *nics;
	size_t n_nics;
	disc_gpu_nic *gpu_nic;
	size_t n_gpu_nic;
	disc_note *notes;
	size_t n_notes;
} disc_inventory;

/* Discovers the node.  Errors only for bad parameters: DS_EINVAL (a malformed
 * fake_gpus spec; *out stays NULL), DS_ENOTFOUND / DS_EIO (the sysroot is not a
 * readable directory), DS_ENOMEM.  Everything else is a note.  The caller frees
 * *out with disc_free. */
int disc_run(const disc_params *p, disc_inventory **out, ds_err *err);
void disc_free(disc_inventory *inv);

/* The inventory as JSON (schema above); new reference, NULL on ENOMEM. */
json_t *disc_to_json(const disc_inventory *inv);

/* BLAKE2b-256 (hex) of the canonical JSON: disc_to_json without the GPUs'
 * "health" objects, keys sorted, compact separators, ASCII only.  It changes
 * when the hardware, addresses or links change, not with temperature. */
int disc_digest(const disc_inventory *inv, char hex[DISC_DIGEST_HEX], ds_err *err);

/* dsagent --discover: runs discovery and writes one JSON document (the
 * inventory plus "digest") to f.  Returns disc_run's code. */
int disc_print(const disc_params *p, FILE *f, ds_err *err);

/* "NV18" for DISC_LEVEL_NV with 18 links, else "PIX" ... "unknown". */
const char *disc_level_name(disc_level level, int nvlinks, char *buf, size_t size);

/* ---- parsers (exposed for tests/unit/test_discover.c) ---------------------- */

/* "400 Gb/sec (4X NDR)", "2.5 Gb/sec (1X SDR)", "10 Gb/sec (4X)":
 * DS_OK with *gbps, *width and speed ("" when absent), else DS_EFORMAT. */
int disc_parse_rate(const char *s, double *gbps, int *width, char *speed, size_t speed_size);

/* "4: ACTIVE", "5: LinkUp": DS_OK with *code and name, else DS_EFORMAT. */
int disc_parse_state(const char *s, int *code, char *name, size_t name_size);

/* A GID as sysfs prints it ("fe80:0000:0000:0000:e41d:2d03:007c:0001") or any
 * IPv6 text: DS_OK with the 16 bytes, else DS_EFORMAT. */
int disc_parse_gid(const char *s, uint8_t gid[16]);

/* 1 with *ipv4 (host order) when gid is IPv4-mapped (::ffff:a.b.c.d), else 0. */
int disc_gid_ipv4(const uint8_t gid[16], uint32_t *ipv4);

/* PCI address in any common spelling ("00000000:18:00.0" from NVML, "0000:18:00.0",
 * "18:00.0", upper or lower case) to sysfs form "0000:18:00.0" (domain at least 4
 * lower-case hex digits).  DS_EFORMAT when it is not a PCI address. */
int disc_busid_normalize(const char *in, char *out, size_t size);

/* Number of CPUs in a cpulist ("0-3,8,10-11" = 7); DS_EFORMAT when malformed. */
int disc_cpulist_count(const char *s, int *count);

/* Level between two PCI devices from their resolved sysfs paths
 * ("/sys/devices/pci0000:00/0000:00:01.0/.../0000:18:00.0"): same host bridge
 * and at most one switch between them = PIX, more bridges below a common one =
 * PXB, only the host bridge in common = PHB; different host bridges = NODE when
 * same_numa, else SYS.  DISC_LEVEL_UNKNOWN when a path is not of that form. */
disc_level disc_pci_level(const char *path_a, const char *path_b, int same_numa);

typedef enum disc_fake_topo { DISC_FAKE_PCIE = 0, DISC_FAKE_NVLINK, DISC_FAKE_NVSWITCH } disc_fake_topo;

typedef struct disc_fake_spec {
	int n;             /* 0..DISC_FAKE_MAX */
	char model[16];    /* canonical spelling: "H100" */
	int memory_gb;     /* 1..1024 */
	disc_fake_topo topo;
	int cc_major, cc_minor, nvlinks; /* from the model table */
} disc_fake_spec;

/* "NxMODEL-MEMGB[:nvswitch|nvlink|pcie]" (default pcie) or "0".  DS_EINVAL with
 * the problem named in err. */
int disc_fake_parse(const char *spec, disc_fake_spec *out, ds_err *err);

/* Deterministic fake GPU i: bus id "0000:%02x:00.0" with bus 0x08 + 0x10*i, and
 * UUID "GPU-" + BLAKE2b-128("<seed>/<i>") as 8-4-4-4-12 hex. */
void disc_fake_bus_id(int i, char out[DISC_BUSID_SIZE]);
int disc_fake_uuid(const char *seed, int i, char *out, size_t size);

#endif
