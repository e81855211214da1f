/*
 * test_discover.c - unit tests of agent/node/discover: the parsers (rates, states,
 * GIDs, PCI bus ids, cpulists, --fake-gpus specs), the PCI level rule on
 * synthetic sysfs paths, and whole runs (disc_run -> JSON -> digest -> free)
 * on a small sysroot written here and on this machine, so the sanitizer build
 * covers the scanners.  Inputs are random where a generator can state the
 * answer independently; edge cases are listed.  Names start with disc_.
 */
#include "agent/node/discover.h"
#include "tests/unit/unit.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static unsigned rnd(unsigned n)
{
	return (unsigned)(ut_rand_u64() % n);
}

/* ---- rates ------------------------------------------------------------------ */

TEST(disc_rate_random)
{
	static const char *speeds[] = {"SDR", "DDR", "QDR", "FDR10", "FDR", "EDR", "HDR", "NDR", "XDR", ""};
	static const int widths[] = {1, 2, 4, 8, 12};
	for (int it = 0; it < 2000; it++) {
		int whole = (int)rnd(3200);
		int half = rnd(4) == 0;
		int w = widths[rnd(5)];
		const char *sp = speeds[rnd(10)];
		int paren = rnd(5) != 0;
		char s[96], got_sp[8] = "?";
		double g = -1;
		int gw = -7;
		if (!paren)
			snprintf(s, sizeof s, "%d%s Gb/sec", whole, half ? ".5" : "");
		else
			snprintf(s, sizeof s, "%d%s Gb/sec (%dX%s%s)", whole, half ? ".5" : "", w,
				 *sp ? " " : "", sp);
		CHECK_EQ(disc_parse_rate(s, &g, &gw, got_sp, sizeof got_sp), DS_OK);
		CHECK_NEAR(g, whole + (half ? 0.5 : 0.0), 0);
		CHECK_EQ(gw, paren ? w : DISC_NONE);
		CHECK_STR(got_sp, paren ? sp : "");
	}
}

TEST(disc_rate_rejects)
{
	static const char *bad[] = {
		"", "400", "400 Gb/s", "400 Gb/sec (4x NDR)", "400 Gb/sec (0X NDR)",
		"400 Gb/sec (4X NDR", "400 Gb/sec (4X NDR) ", ".5 Gb/sec", "4. Gb/sec",
		"400 Gb/sec(4X NDR)", "400 Gb/sec (4X )", "-1 Gb/sec", "400  Gb/sec",
		"400 Gb/sec (X NDR)", "400 Gb/sec (99X NDR)", "400 Gb/sec (4X N-R)", "fast",
		"400 Gb/sec ()", "1e3 Gb/sec", "400 Gb/sec (4X NDR)\n", "12345678901234567890123456789012345 Gb/sec",
	};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		double g = 123;
		int w = 77;
		char sp[8] = "keep";
		if (disc_parse_rate(bad[i], &g, &w, sp, sizeof sp) != DS_EFORMAT)
			ut_fail(__FILE__, __LINE__, "accepted '%s'", bad[i]);
		CHECK_NEAR(g, 123, 0); /* untouched on failure */
		CHECK_EQ(w, 77);
		CHECK_STR(sp, "keep");
	}
	/* random bytes over the rate alphabet: never a crash, and any accepted
	 * string has a non-negative rate */
	static const char alpha[] = "0123456789. Gb/sec()XNDRH";
	for (int it = 0; it < 5000; it++) {
		char s[40];
		size_t n = rnd(sizeof s - 1);
		for (size_t k = 0; k < n; k++)
			s[k] = alpha[rnd(sizeof alpha - 1)];
		s[n] = '\0';
		double g = -1;
		int w;
		char sp[8];
		if (disc_parse_rate(s, &g, &w, sp, sizeof sp) == DS_OK)
			CHECK(g >= 0);
	}
}

/* ---- states ----------------------------------------------------------------------- */

TEST(disc_state_random_and_edges)
{
	static const char *names[] = {"ACTIVE", "DOWN", "INIT", "ARMED", "ACTIVE_DEFER", "LinkUp",
				      "Polling", "Disabled", "PortConfigurationTraining",
				      "LinkErrorRecovery", "Phy Test", "Sleep"};
	for (int it = 0; it < 1000; it++) {
		int code = (int)rnd(256);
		const char *nm = names[rnd(12)];
		char s[64], got[32];
		int c = -1;
		snprintf(s, sizeof s, "%d:%s%s", code, rnd(2) ? " " : "  ", nm);
		CHECK_EQ(disc_parse_state(s, &c, got, sizeof got), DS_OK);
		CHECK_EQ(c, code);
		CHECK_STR(got, nm);
	}
	static const char *bad[] = {"ACTIVE", "4:ACTIVE", "4: ", "4: ACTIVE ", "256: X", ": X",
				    "4: 1abc", "4; ACTIVE", "", "4: AC-TIVE", "x4: ACTIVE",
				    "4: ThisNameIsFarTooLongForTheBuffer"};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		int c = 9;
		char got[32] = "keep";
		if (disc_parse_state(bad[i], &c, got, sizeof got) != DS_EFORMAT)
			ut_fail(__FILE__, __LINE__, "accepted '%s'", bad[i]);
		CHECK_EQ(c, 9);
		CHECK_STR(got, "keep");
	}
}

/* ---- GIDs --------------------------------------------------------------------------- */

TEST(disc_gid_random)
{
	for (int it = 0; it < 1000; it++) {
		uint8_t b[16], got[16];
		for (int k = 0; k < 16; k++)
			b[k] = (uint8_t)rnd(256);
		int mapped = rnd(3) == 0;
		if (mapped) {
			memset(b, 0, 10);
			b[10] = b[11] = 0xff;
		} else if (rnd(2)) {
			b[0] |= 1; /* surely not mapped */
		}
		char s[64], c[INET6_ADDRSTRLEN];
		/* the sysfs spelling: 8 groups of 4 hex digits */
		snprintf(s, sizeof s, "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x",
			 b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
			 b[13], b[14], b[15]);
		CHECK_EQ(disc_parse_gid(s, got), DS_OK);
		CHECK(memcmp(got, b, 16) == 0);
		/* and any IPv6 text */
		inet_ntop(AF_INET6, b, c, sizeof c);
		memset(got, 0, 16);
		CHECK_EQ(disc_parse_gid(c, got), DS_OK);
		CHECK(memcmp(got, b, 16) == 0);
		uint32_t v4 = 0;
		int is = disc_gid_ipv4(got, &v4);
		int expect = b[0] == 0 && b[1] == 0 && b[2] == 0 && b[3] == 0 && b[4] == 0 &&
			     b[5] == 0 && b[6] == 0 && b[7] == 0 && b[8] == 0 && b[9] == 0 &&
			     b[10] == 0xff && b[11] == 0xff;
		CHECK_EQ(is, expect);
		if (mapped)
			CHECK_EQ(v4, (uint32_t)b[12] << 24 | (uint32_t)b[13] << 16 | (uint32_t)b[14] << 8 | b[15]);
	}
	uint8_t g[16];
	uint32_t v4;
	CHECK_EQ(disc_parse_gid("::ffff:10.200.1.10", g), DS_OK);
	CHECK_EQ(disc_gid_ipv4(g, &v4), 1);
	CHECK_EQ(v4, 0x0ac8010au);
	static const char *bad[] = {"fe80", "zzzz", "", "1:2:3:4:5:6:7:8:9", "fe80::1/64",
				    "0000:0000:0000:0000:0000:ffff:0ac8:010a:0000", "10.0.0.1"};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
		if (disc_parse_gid(bad[i], g) != DS_EFORMAT)
			ut_fail(__FILE__, __LINE__, "accepted '%s'", bad[i]);
}

/* ---- PCI bus ids ----------------------------------------------------------------------- */

TEST(disc_busid_random)
{
	for (int it = 0; it < 2000; it++) {
		unsigned dom = rnd(4) ? 0 : rnd(0x10000), bus = rnd(256), dev = rnd(32), fn = rnd(8);
		if (rnd(20) == 0)
			dom = 0x10000 + rnd(0x1000); /* VMD domains have five digits */
		char want[24], in[40], out[DISC_BUSID_SIZE];
		snprintf(want, sizeof want, "%04x:%02x:%02x.%x", dom, bus, dev, fn);
		switch (rnd(4)) {
		case 0: snprintf(in, sizeof in, "%08X:%02X:%02X.%X", dom, bus, dev, fn); break; /* NVML */
		case 1: snprintf(in, sizeof in, "%04x:%02x:%02x.%x", dom, bus, dev, fn); break; /* sysfs */
		case 2: snprintf(in, sizeof in, "%04X:%02X:%02X.%x", dom, bus, dev, fn); break; /* legacy */
		default:
			if (dom == 0)
				snprintf(in, sizeof in, "%02x:%02x.%x", bus, dev, fn); /* lspci */
			else
				snprintf(in, sizeof in, "%x:%x:%x.%x", dom, bus, dev, fn);
		}
		CHECK_EQ(disc_busid_normalize(in, out, sizeof out), DS_OK);
		CHECK_STR(out, want);
	}
	static const char *bad[] = {"0000:18:20.0", "0000:18:00.8", "0000:18:00", "0000:118:00.0",
				    "000000000:18:00.0", "g000:18:00.0", "", "0000:18:00.0x",
				    "a:b:c:d.0", "0000::00.0", "0000:18:.0", "0000:18:00.", ":18:00.0"};
	char out[DISC_BUSID_SIZE];
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
		if (disc_busid_normalize(bad[i], out, sizeof out) == DS_OK)
			ut_fail(__FILE__, __LINE__, "accepted '%s'", bad[i]);
}

/* ---- cpulists -------------------------------------------------------------------------------- */

TEST(disc_cpulist_random)
{
	for (int it = 0; it < 500; it++) {
		unsigned char on[512] = {0};
		int count = 0;
		int density = 1 + (int)rnd(8);
		for (int c = 0; c < 512; c++)
			if ((int)rnd(10) < density) {
				on[c] = 1;
				count++;
			}
		char s[4096] = "";
		size_t len = 0;
		for (int c = 0; c < 512;) {
			if (!on[c]) {
				c++;
				continue;
			}
			int e = c;
			while (e + 1 < 512 && on[e + 1])
				e++;
			len += (size_t)snprintf(s + len, sizeof s - len, "%s%d", len ? "," : "", c);
			if (e > c)
				len += (size_t)snprintf(s + len, sizeof s - len, "-%d", e);
			c = e + 1;
		}
		int got = -1;
		CHECK_EQ(disc_cpulist_count(s, &got), DS_OK);
		CHECK_EQ(got, count);
	}
	int n = -1;
	CHECK_EQ(disc_cpulist_count("", &n), DS_OK);
	CHECK_EQ(n, 0);
	CHECK_EQ(disc_cpulist_count("0-55,112-167", &n), DS_OK);
	CHECK_EQ(n, 112);
	static const char *bad[] = {"1-", "-1", "3-1", "1,,2", "a", "1 2", ",1", "1,", "0-99999999",
				    "zero-three"};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
		if (disc_cpulist_count(bad[i], &n) == DS_OK)
			ut_fail(__FILE__, __LINE__, "accepted '%s'", bad[i]);
}

/* ---- --fake-gpus ------------------------------------------------------------------------------- */

TEST(disc_fake_spec_random)
{
	static const struct {
		const char *model;
		int major, minor, links;
	} models[] = {{"H100", 9, 0, 18}, {"H200", 9, 0, 18}, {"H800", 9, 0, 8}, {"A100", 8, 0, 12},
		      {"A800", 8, 0, 8},  {"L40S", 8, 9, 0},  {"V100", 7, 0, 6},  {"B200", 10, 0, 18}};
	static const char *topos[] = {"", ":pcie", ":nvlink", ":nvswitch"};
	for (int it = 0; it < 1000; it++) {
		int m = (int)rnd(8), n = (int)rnd(DISC_FAKE_MAX + 1), mem = 1 + (int)rnd(1024);
		int t = (int)rnd(4);
		char spec[64];
		snprintf(spec, sizeof spec, "%dx%s-%dGB%s", n, models[m].model, mem, topos[t]);
		disc_fake_spec f;
		ds_err e = {0};
		int rc = disc_fake_parse(spec, &f, &e);
		if (t >= 2 && models[m].links == 0) {
			CHECK_EQ(rc, DS_EINVAL);
			CHECK(strstr(e.msg, "has no NVLink") != NULL);
			continue;
		}
		CHECK_EQ(rc, DS_OK);
		CHECK_EQ(f.n, n);
		CHECK_STR(f.model, models[m].model);
		CHECK_EQ(f.memory_gb, mem);
		CHECK_EQ(f.topo, t == 3 ? DISC_FAKE_NVSWITCH : t == 2 ? DISC_FAKE_NVLINK : DISC_FAKE_PCIE);
		CHECK_EQ(f.cc_major, models[m].major);
		CHECK_EQ(f.cc_minor, models[m].minor);
		CHECK_EQ(f.nvlinks, models[m].links);
	}
	disc_fake_spec f;
	ds_err e = {0};
	CHECK_EQ(disc_fake_parse("0", &f, &e), DS_OK);
	CHECK_EQ(f.n, 0);
	CHECK_EQ(disc_fake_parse("8xh100-80GB:nvswitch", &f, &e), DS_OK); /* model case-insensitive */
	CHECK_STR(f.model, "H100");
	static const struct {
		const char *spec, *problem;
	} bad[] = {
		{"8xH100", "no '-MEMGB'"}, {"8xH999-80GB", "unknown GPU model 'H999'"},
		{"17xH100-80GB", "count 17 is out of range"}, {"8xH100-80GB:mesh", "topology 'mesh'"},
		{"8xH100-80", "does not end in GB"}, {"8xH100-0GB", "[1, 1024]"},
		{"8xH100-2000GB", "[1, 1024]"}, {"8xH100--1GB", "[1, 1024]"}, {"x", "count '' is not"},
		{"+8xH100-80GB", "is not a number"}, {"8 xH100-80GB", "is not a number"},
		{"", "empty spec"}, {"8xH100-80GB:", "topology ''"},
		{"8xH100-80GB:nvswitch:extra", "topology 'nvswitch:extra'"},
		{"99999999999999999999xH100-80GB", "is not a number"},
		{"8xH100-80GB-and-a-very-long-tail-that-goes-on-and-on-for-ever-and-ever", "too long"},
	};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		ds_err be = {0};
		if (disc_fake_parse(bad[i].spec, &f, &be) != DS_EINVAL ||
		    !strstr(be.msg, bad[i].problem))
			ut_fail(__FILE__, __LINE__, "'%s': got '%s', want '%s'", bad[i].spec, be.msg,
				bad[i].problem);
	}
}

TEST(disc_fake_ids)
{
	char a[64], b[64], bus[DISC_BUSID_SIZE];
	for (int i = 0; i < DISC_FAKE_MAX; i++) {
		CHECK_EQ(disc_fake_uuid("node-a", i, a, sizeof a), DS_OK);
		CHECK_EQ(strlen(a), 40u);
		CHECK(!strncmp(a, "GPU-", 4) && a[12] == '-' && a[17] == '-' && a[22] == '-' && a[27] == '-');
		CHECK_EQ(disc_fake_uuid("node-a", i, b, sizeof b), DS_OK);
		CHECK_STR(a, b); /* deterministic */
		CHECK_EQ(disc_fake_uuid("node-b", i, b, sizeof b), DS_OK);
		CHECK(strcmp(a, b) != 0); /* per node */
		disc_fake_bus_id(i, bus);
		char want[DISC_BUSID_SIZE];
		snprintf(want, sizeof want, "0000:%02x:00.0", 0x08 + 0x10 * i);
		CHECK_STR(bus, want);
	}
	CHECK_EQ(disc_fake_uuid("x", 0, a, 20), DS_ERANGE);
}

/* ---- PCI levels on synthetic paths --------------------------------------------------------------- */

static void rand_chain(char *out, size_t size, const char *prefix, int n, unsigned tag)
{
	size_t len = (size_t)snprintf(out, size, "%s", prefix);
	for (int i = 0; i < n; i++)
		len += (size_t)snprintf(out + len, size - len, "/0000:%02x:%02x.0", (tag * 7 + (unsigned)i * 13) & 0xff,
					(tag + (unsigned)i) & 0x1f);
}

TEST(disc_pci_level_random)
{
	for (int it = 0; it < 1000; it++) {
		char hb[32], common[1024], a[2048], b[2048];
		snprintf(hb, sizeof hb, "/sys/devices/pci%04x:%02x", rnd(2), rnd(256));
		unsigned tag = (unsigned)rnd(1000);
		int k = 1 + (int)rnd(4); /* common bridges below the host bridge */
		char base[64];
		snprintf(base, sizeof base, "%s", hb);
		rand_chain(common, sizeof common, base, k, tag);
		int kind = (int)rnd(5);
		disc_level want;
		switch (kind) {
		case 0: /* both below one downstream port, or each below its own port of one switch */
			if (rnd(2)) {
				snprintf(a, sizeof a, "%s/0000:aa:00.0", common);
				snprintf(b, sizeof b, "%s/0000:aa:00.1", common);
			} else {
				snprintf(a, sizeof a, "%s/0000:e0:00.0/0000:aa:00.0", common);
				snprintf(b, sizeof b, "%s/0000:e0:01.0/0000:bb:00.0", common);
			}
			want = DISC_LEVEL_PIX;
			break;
		case 1: /* a second switch on one side, or two bridges (PCIe-to-PCI) */
			if (rnd(2))
				snprintf(a, sizeof a, "%s/0000:e0:00.0/0000:e1:00.0/0000:e2:00.0/0000:aa:00.0", common);
			else
				snprintf(a, sizeof a, "%s/0000:e0:00.0/0000:e1:00.0/0000:aa:00.0", common);
			snprintf(b, sizeof b, "%s/0000:e0:01.0/0000:bb:00.0", common);
			want = DISC_LEVEL_PXB;
			break;
		case 2: /* different root ports of one host bridge */
			rand_chain(a, sizeof a, hb, 1 + (int)rnd(4), tag + 1);
			rand_chain(b, sizeof b, hb, 1 + (int)rnd(4), tag + 500);
			strncat(a, "/0000:aa:00.0", sizeof a - strlen(a) - 1);
			strncat(b, "/0000:bb:00.0", sizeof b - strlen(b) - 1);
			want = DISC_LEVEL_PHB;
			break;
		default: { /* different host bridges */
			char hb2[48];
			snprintf(hb2, sizeof hb2, "%sf", hb); /* another name */
			snprintf(a, sizeof a, "%s/0000:aa:00.0", common);
			rand_chain(b, sizeof b, hb2, 1 + (int)rnd(4), tag);
			strncat(b, "/0000:bb:00.0", sizeof b - strlen(b) - 1);
			want = kind == 3 ? DISC_LEVEL_NODE : DISC_LEVEL_SYS;
		}
		}
		int same = kind != 4;
		CHECK_EQ(disc_pci_level(a, b, same), want);
		CHECK_EQ(disc_pci_level(b, a, same), want); /* symmetric */
	}
	/* two devices straight on the root bus (a VM) share only the host bridge */
	CHECK_EQ(disc_pci_level("/sys/devices/pci0000:00/0000:00:05.0", "/sys/devices/pci0000:00/0000:00:06.0", 1),
		 DISC_LEVEL_PHB);
	static const char *bad[] = {"/sys/devices/platform/x/y", "/other/pci0000:00/0000:00:01.0",
				    "/sys/devices/pci0000:00", "", "sys/devices/pci0000:00/0000:00:01.0"};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
		CHECK_EQ(disc_pci_level(bad[i], "/sys/devices/pci0000:00/0000:00:01.0", 1), DISC_LEVEL_UNKNOWN);
	char lv[16];
	CHECK_STR(disc_level_name(DISC_LEVEL_NV, 18, lv, sizeof lv), "NV18");
	CHECK_STR(disc_level_name(DISC_LEVEL_PXB, 0, lv, sizeof lv), "PXB");
	CHECK_STR(disc_level_name(DISC_LEVEL_UNKNOWN, 0, lv, sizeof lv), "unknown");
}

/* ---- whole runs ---------------------------------------------------------------------------------- */

static void put_file(const char *root, const char *rel, const char *text)
{
	char p[1024];
	snprintf(p, sizeof p, "%s%s", root, rel);
	for (char *s = strchr(p + strlen(root) + 1, '/'); s; s = strchr(s + 1, '/')) {
		*s = '\0';
		mkdir(p, 0755);
		*s = '/';
	}
	FILE *f = fopen(p, "w");
	if (!f) {
		ut_fail(__FILE__, __LINE__, "%s: %s", p, strerror(errno));
		return;
	}
	fputs(text, f);
	fclose(f);
}

static void put_link(const char *root, const char *rel, const char *target)
{
	char p[1024];
	snprintf(p, sizeof p, "%s%s", root, rel);
	put_file(root, rel, "");
	remove(p);
	if (symlink(target, p) != 0)
		ut_fail(__FILE__, __LINE__, "symlink %s: %s", p, strerror(errno));
}

/* One socket; a switch holding a GPU and a RoCE NIC (PIX); the NIC's port
 * ACTIVE with the IPv4 GID at index 2 (index 1 is RoCE v1). */
static char *small_sysroot(void)
{
	char *r = ut_tmpdir_new("disc");
	if (!r)
		return NULL;
	put_file(r, "/etc/hostname", "unit-node\n");
	put_file(r, "/proc/cpuinfo", "processor\t: 0\nmodel name\t: Unit CPU\nphysical id\t: 0\n\n"
				     "processor\t: 1\nmodel name\t: Unit CPU\nphysical id\t: 0\n");
	put_file(r, "/proc/meminfo", "MemTotal:       1024 kB\n");
	put_file(r, "/sys/devices/system/node/node0/cpulist", "0-1\n");
	put_file(r, "/sys/devices/system/node/node0/meminfo", "Node 0 MemTotal:       1024 kB\n");
	const char *sw = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0";
	char p[512];
	snprintf(p, sizeof p, "%s/0000:02:00.0/0000:08:00.0", sw);
	char q[512];
	snprintf(q, sizeof q, "%s/vendor", p);
	put_file(r, q, "0x10de\n");
	snprintf(q, sizeof q, "%s/class", p);
	put_file(r, q, "0x030200\n");
	snprintf(q, sizeof q, "%s/device", p);
	put_file(r, q, "0x2330\n");
	put_link(r, "/sys/bus/pci/devices/0000:08:00.0",
		 "../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:08:00.0");
	snprintf(p, sizeof p, "%s/0000:02:01.0/0000:09:00.0", sw);
	snprintf(q, sizeof q, "%s/net/eth1/dev_port", p);
	put_file(r, q, "0\n");
	put_link(r, "/sys/class/infiniband/rocep9s0/device",
		 "../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:09:00.0");
	const char *pt = "/sys/class/infiniband/rocep9s0/ports/1";
	char x[256];
	static const char *files[][2] = {
		{"state", "4: ACTIVE"}, {"phys_state", "5: LinkUp"}, {"rate", "25 Gb/sec (1X EDR)"},
		{"link_layer", "Ethernet"},
		{"gids/0", "fe80:0000:0000:0000:0000:0000:0000:0001"}, {"gid_attrs/types/0", "IB/RoCE v1"},
		{"gid_attrs/ndevs/0", "eth1"},
		{"gids/1", "0000:0000:0000:0000:0000:ffff:c000:0207"}, {"gid_attrs/types/1", "IB/RoCE v1"},
		{"gid_attrs/ndevs/1", "eth1"},
		{"gids/2", "0000:0000:0000:0000:0000:ffff:c000:0207"}, {"gid_attrs/types/2", "RoCE v2"},
		{"gid_attrs/ndevs/2", "eth1"},
	};
	for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
		snprintf(x, sizeof x, "%s/%s", pt, files[i][0]);
		put_file(r, x, files[i][1]);
	}
	put_file(r, "/etc/dsagent-fixture/ifaddrs", "lo inet 127.0.0.1/8\neth1 inet 192.0.2.7/24\n");
	/* a second RDMA device on another host bridge, NUMA node unknown (-1), no
	 * ports: with one NUMA node on the host it is NODE from the GPU */
	put_file(r, "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0/numa_node", "-1\n");
	put_link(r, "/sys/class/infiniband/rocep129s0/device",
		 "../../../devices/pci0000:80/0000:80:01.0/0000:81:00.0");
	return r;
}

TEST(disc_run_small_sysroot)
{
	char *root = small_sysroot();
	if (!root)
		return;
	disc_params p = disc_default_params();
	p.sysroot = root;
	p.fake_gpus = "1xH100-80GB:nvswitch";
	disc_inventory *inv = NULL;
	ds_err e = {0};
	CHECK_EQ(disc_run(&p, &inv, &e), DS_OK);
	if (inv) {
		CHECK_STR(inv->host.hostname, "unit-node");
		CHECK_EQ(inv->host.cpus, 2);
		CHECK_EQ(inv->host.memory_bytes, 1024 * 1024);
		CHECK_EQ(inv->n_gpus, 1u);
		CHECK_STR(inv->gpus[0].bus_id, "0000:08:00.0");
		CHECK_EQ(inv->n_pci_gpus, 1u);
		CHECK_EQ(inv->n_ib_ports, 1u);
		CHECK_EQ(inv->ib_ports[0].gid_index, 2);
		CHECK_STR(inv->ib_ports[0].netdev, "eth1");
		CHECK_EQ(inv->ib_ports[0].usable, 1);
		CHECK_NEAR(inv->ib_ports[0].rate_gbps, 25, 0);
		CHECK_EQ(inv->n_gpu_nic, 2u);
		CHECK_STR(inv->gpu_nic[0].nic, "rocep9s0"); /* natural order: 9 < 129 */
		CHECK_EQ(inv->gpu_nic[0].level, DISC_LEVEL_PIX);
		CHECK_EQ(inv->gpu_nic[0].source, DISC_SRC_SYSFS);
		CHECK_STR(inv->gpu_nic[1].nic, "rocep129s0");
		CHECK_EQ(inv->gpu_nic[1].level, DISC_LEVEL_NODE);
		CHECK_EQ(inv->gpu_nic[1].source, DISC_SRC_SYSFS);
		int noted = 0;
		for (size_t i = 0; i < inv->n_notes; i++)
			noted |= !strcmp(inv->notes[i].message, "rocep129s0: no ports directory");
		CHECK(noted);
		CHECK_EQ(inv->compute_gpu, 1);
		json_t *j = disc_to_json(inv);
		CHECK(j != NULL);
		if (j) {
			json_t *gpus = json_object_get(j, "gpus");
			CHECK_EQ(json_array_size(gpus), 1u);
			CHECK_STR(json_string_value(json_object_get(json_array_get(gpus, 0), "compute_capability")), "9.0");
			json_decref(j);
		}
		char h1[DISC_DIGEST_HEX], h2[DISC_DIGEST_HEX];
		CHECK_EQ(disc_digest(inv, h1, &e), DS_OK);
		inv->gpus[0].health.temperature_c += 7; /* health is not in the digest */
		CHECK_EQ(disc_digest(inv, h2, &e), DS_OK);
		CHECK_STR(h1, h2);
		inv->ib_ports[0].usable = 0; /* the hardware is */
		CHECK_EQ(disc_digest(inv, h2, &e), DS_OK);
		CHECK(strcmp(h1, h2) != 0);
	}
	disc_free(inv);
	/* a bad spec fails before anything is read, naming the option */
	inv = NULL;
	p.fake_gpus = "3xH100";
	CHECK_EQ(disc_run(&p, &inv, &e), DS_EINVAL);
	CHECK(inv == NULL && strstr(e.msg, "--fake-gpus") != NULL);
	/* NVML missing: CPU ranks, a note */
	p.fake_gpus = NULL;
	p.nvml_lib = "/nonexistent/libnvidia-ml.so.1";
	CHECK_EQ(disc_run(&p, &inv, &e), DS_OK);
	if (inv) {
		CHECK_EQ(inv->compute_gpu, 0);
		CHECK_EQ(inv->ranks, 1);
		CHECK(inv->n_notes >= 1 && strstr(inv->notes[0].message, "absent") != NULL);
	}
	disc_free(inv);
	ut_tmpdir_free(root);
	disc_free(NULL);
}

TEST(disc_run_this_machine_and_bad_sysroot)
{
	disc_params p = disc_default_params();
	disc_inventory *inv = NULL;
	ds_err e = {0};
	CHECK_EQ(disc_run(&p, &inv, &e), DS_OK);
	if (inv) {
		CHECK(inv->host.cpus > 0);
		CHECK(inv->ranks >= 1);
		char h[DISC_DIGEST_HEX];
		CHECK_EQ(disc_digest(inv, h, &e), DS_OK);
		CHECK_EQ(strlen(h), 64u);
	}
	disc_free(inv);
	inv = NULL;
	p.sysroot = "/nonexistent-sysroot-for-dsagent";
	CHECK_EQ(disc_run(&p, &inv, &e), DS_ENOTFOUND);
	CHECK(inv == NULL && strstr(e.msg, "sysroot") != NULL);
}
