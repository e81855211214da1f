/*
 * discover_net.c - discovery of the network: NICs and their addresses
 * (getifaddrs on the live system, a fixture file under a sysroot),
 * InfiniBand and RoCE ports from /sys/class/infiniband (state, rate, link
 * layer, netdev, the RoCE v2 GID of the NIC's IPv4 address), and the parsers
 * of their sysfs texts.
 *
 * Callers: disc_run (discover.c) through disc_nics_scan and disc_ib_scan;
 * the parsers are public (discover.h, tests).  Calls: getifaddrs (live
 * only), the files under the sysroot (discover.c helpers), disc_dev_numa.
 *
 * Invariants: discover.c's 1-4; the fixture file stands in for getifaddrs
 * only under a sysroot, and is read whole (ds_file_read_all, capped).
 *
 * Threading: one scan per thread.
 */
#include "agent/node/discover_impl.h"
#include "common/fileutil.h"
#include "common/strutil.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

/* ---- parsers of sysfs texts ---- */

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

/* ---- NICs --------------------------------------------------------------------------------- */

static disc_nic *nic_get(scan *s, const char *name)
{
	disc_inventory *inv = s->inv;
	for (size_t i = 0; i < inv->n_nics; i++)
		if (!strcmp(inv->nics[i].name, name))
			return &inv->nics[i];
	disc_nic *n = disc_grow(s, &inv->nics, &inv->n_nics, &s->cap_nics, sizeof *n, NICS_MAX);
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
		disc_note_add(s, "nics", "%s: more than %d addresses of one family; %s left out", n->name,
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
		disc_note_add(s, "nics", "getifaddrs: %s", strerror(errno));
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
	if (disc_path_of(s, path, sizeof path, FIXTURE_IFADDRS))
		return;
	char *text = NULL;
	size_t len = 0;
	ds_err err = {0};
	int rc = ds_file_read_all(path, FIXTURE_IFADDRS_MAX, &text, &len, &err);
	if (rc == DS_ENOMEM)
		s->oom = 1;
	if (rc != DS_OK) {
		disc_note_add(s, "nics", "%s: %s (under --sysroot, addresses come from this file)",
			      FIXTURE_IFADDRS, rc == DS_ENOTFOUND ? "not found" : err.msg);
		return;
	}
	int lineno = 0;
	for (char *line = text, *next; line < text + len; line = next) {
		char *nl = memchr(line, '\n', (size_t)(text + len - line));
		next = nl ? nl + 1 : text + len;
		if (nl)
			*nl = '\0';
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
			disc_note_add(s, "nics", "%s:%d: expected 'IFNAME inet|inet6 ADDR/PREFIX' or 'IFNAME link'",
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
				disc_note_add(s, "nics", "%s:%d: '%s' is not an %s address with a /prefix",
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
	free(text);
}

static int cmp_nic(const void *a, const void *b)
{
	return strverscmp(((const disc_nic *)a)->name, ((const disc_nic *)b)->name);
}

void disc_nics_scan(scan *s)
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
		disc_note_add(s, "infiniband", "%s port %d: netdev %s has no IPv4 address, so no RoCE v2 GID",
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
	if (disc_list_dir(s, &ns, 4096, "/sys/class/infiniband/%s/ports/%d/gids", dev, pt->port) != DS_OK) {
		disc_note_add(s, "infiniband", "%s port %d: no gids directory", dev, pt->port);
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
		if (disc_rd(s, b, sizeof b, "/sys/class/infiniband/%s/ports/%d/gids/%d", dev, pt->port,
		       idx) != DS_OK)
			continue;
		if (disc_parse_gid(b, gid) != DS_OK) {
			if (!bad++)
				disc_note_add(s, "infiniband", "%s port %d: gids/%d '%.60s' is not a GID", dev,
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
		if (disc_rd(s, b, sizeof b, "/sys/class/infiniband/%s/ports/%d/gid_attrs/types/%d", dev,
		       pt->port, idx) != DS_OK || strcasecmp(b, "RoCE v2") != 0)
			continue;
		if (disc_rd(s, b, sizeof b, "/sys/class/infiniband/%s/ports/%d/gid_attrs/ndevs/%d", dev,
		       pt->port, idx) != DS_OK || strcmp(b, pt->netdev) != 0)
			continue;
		best = idx;
	}
	disc_names_free(&ns);
	if (best != INT_MAX)
		pt->gid_index = best;
	else
		disc_note_add(s, "infiniband", "%s port %d: no RoCE v2 GID carries an IPv4 address of %s", dev,
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
		if (disc_rd(s, b, sizeof b, "/sys/class/infiniband/%s/device/net/%s/dev_port", dev,
		       nets->v[i]) == DS_OK &&
		    ds_parse_int(b, 0, 1 << 16, &dp) == DS_OK && dp == pt->port - 1) {
			ds_strlcpy(pt->netdev, nets->v[i], sizeof pt->netdev);
			return;
		}
	}
	if (nets->n > 1)
		disc_note_add(s, "infiniband", "%s port %d: %zu netdevs and none has dev_port %d", dev, pt->port,
		     nets->n, pt->port - 1);
}

static void ib_port(scan *s, const char *dev, const ibdev *d, const names *nets, int port,
		    const char *hca, const char *fw)
{
	disc_inventory *inv = s->inv;
	disc_ib_port *pt = disc_grow(s, &inv->ib_ports, &inv->n_ib_ports, &s->cap_ib, sizeof *pt, IB_PORTS_MAX);
	if (!pt) {
		if (!s->oom)
			disc_note_add(s, "infiniband", "more than %d ports; the rest are left out", IB_PORTS_MAX);
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
	if (disc_rd(s, b, sizeof b, "%s/%s/ports/%d/state", pre, dev, port) != DS_OK)
		disc_note_add(s, "infiniband", "%s port %d: state not readable", dev, port);
	else if (disc_parse_state(b, &pt->state_code, pt->state, sizeof pt->state) != DS_OK)
		disc_note_add(s, "infiniband", "%s port %d: state '%.40s' is not '<n>: <NAME>'", dev, port, b);
	if (disc_rd(s, b, sizeof b, "%s/%s/ports/%d/phys_state", pre, dev, port) != DS_OK)
		disc_note_add(s, "infiniband", "%s port %d: phys_state not readable", dev, port);
	else if (disc_parse_state(b, &pt->phys_state_code, pt->phys_state, sizeof pt->phys_state))
		disc_note_add(s, "infiniband", "%s port %d: phys_state '%.40s' is not '<n>: <Name>'", dev, port, b);
	if (disc_rd(s, b, sizeof b, "%s/%s/ports/%d/rate", pre, dev, port) != DS_OK) {
		disc_note_add(s, "infiniband", "%s port %d: rate not readable", dev, port);
	} else if (disc_parse_rate(b, &pt->rate_gbps, &pt->width, pt->speed, sizeof pt->speed)) {
		pt->rate_gbps = -1;
		pt->width = DISC_NONE;
		pt->speed[0] = '\0';
		disc_note_add(s, "infiniband", "%s port %d: rate '%.40s' is not '<N> Gb/sec (<W>X <SPEED>)'",
		     dev, port, b);
	}
	if (disc_rd(s, b, sizeof b, "%s/%s/ports/%d/link_layer", pre, dev, port) != DS_OK)
		disc_note_add(s, "infiniband", "%s port %d: link_layer not readable", dev, port);
	else if (!strcmp(b, "InfiniBand") || !strcmp(b, "Ethernet"))
		ds_strlcpy(pt->link_layer, b, sizeof pt->link_layer);
	else
		disc_note_add(s, "infiniband", "%s port %d: link_layer '%.40s' is not InfiniBand or Ethernet",
		     dev, port, b);
	ib_netdev(s, dev, nets, pt);
	pt->usable = pt->state_code == 4 && pt->phys_state_code == 5;
	if (pt->usable && !strcmp(pt->link_layer, "Ethernet")) {
		if (pt->netdev[0])
			ib_gid(s, dev, pt);
		else
			disc_note_add(s, "infiniband", "%s port %d: RoCE port without a netdev", dev, port);
	}
}

void disc_ib_scan(scan *s)
{
	names devs;
	if (disc_list_dir(s, &devs, 1024, "/sys/class/infiniband") != DS_OK) {
		disc_note_add(s, "infiniband", "absent: /sys/class/infiniband not found (no RDMA devices)");
		return;
	}
	for (size_t i = 0; i < devs.n; i++) {
		const char *dev = devs.v[i];
		ibdev *d = disc_grow(s, &s->ib, &s->n_ib, &s->cap_ibdev, sizeof *d, 1024);
		if (!d)
			break;
		ds_strlcpy(d->name, dev, sizeof d->name);
		d->numa = DISC_NONE;
		char rel[PATH_MAX], hca[32], fw[32];
		snprintf(rel, sizeof rel, "/sys/class/infiniband/%s/device", dev);
		if (disc_sys_resolve(s, rel, d->path, sizeof d->path) == DS_OK) {
			char bdf[DISC_BUSID_SIZE];
			const char *base = strrchr(d->path, '/');
			if (!base || disc_busid_normalize(base + 1, bdf, sizeof bdf) != DS_OK) {
				d->path[0] = '\0'; /* not a PCI function (soft RoCE, ...) */
			} else {
				ds_strlcpy(d->bus_id, bdf, sizeof d->bus_id);
				d->numa = disc_dev_numa(s, "infiniband", dev, rel);
			}
		}
		if (disc_rd(s, hca, sizeof hca, "/sys/class/infiniband/%s/hca_type", dev) != DS_OK)
			hca[0] = '\0';
		if (disc_rd(s, fw, sizeof fw, "/sys/class/infiniband/%s/fw_ver", dev) != DS_OK)
			fw[0] = '\0';
		names nets, ports; /* empty when the directory is absent */
		disc_list_dir(s, &nets, 64, "/sys/class/infiniband/%s/device/net", dev);
		if (disc_list_dir(s, &ports, 64, "/sys/class/infiniband/%s/ports", dev) != DS_OK)
			disc_note_add(s, "infiniband", "%s: no ports directory", dev);
		for (size_t k = 0; k < ports.n; k++) {
			int port;
			if (ds_parse_int(ports.v[k], 1, 255, &port) != DS_OK) {
				disc_note_add(s, "infiniband", "%s: port '%s' is not a number", dev, ports.v[k]);
				continue;
			}
			ib_port(s, dev, d, &nets, port, hca, fw);
		}
		disc_names_free(&nets);
		disc_names_free(&ports);
	}
	disc_names_free(&devs);
}

