"""Node discovery end to end: `dsagent --discover` on fixture sysroots
(tests/fixtures/sysroots.py) with fake GPUs (--fake-gpus), a fake NVML library
(tests/fixtures/fake_nvml.c built here with cc, loaded with --nvml-lib) or no
NVML, compared with the inventories the fixtures declare, key for key.

Also: the digest is BLAKE2b-256 of the canonical JSON without "health",
computed here independently; bad --fake-gpus specs exit 2 naming the problem;
an unreadable sysroot is a clear error; garbage in sysfs files becomes notes;
discovery of this machine (no sysroot) agrees with what Python sees."""
import copy
import hashlib
import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import binary  # noqa: E402
from tests.fixtures import sysroots as sr  # noqa: E402
from tests.fixtures.sysroots import Err  # noqa: E402

SWITCHES = ["0000:c5:00.0", "0000:c6:00.0", "0000:c7:00.0", "0000:c8:00.0"]


def discover(*args, env=None):
    r = subprocess.run([binary("dsagent"), "--discover", *args], capture_output=True, text=True,
                       timeout=30, env={**os.environ, **(env or {})}, cwd=ROOT)
    doc = json.loads(r.stdout) if r.returncode == 0 else None
    return r, doc


def digest_of(doc):
    d = copy.deepcopy(doc)
    d.pop("digest", None)
    for g in d["gpus"]:
        g.pop("health", None)
    text = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.blake2b(text.encode(), digest_size=32).hexdigest()


def first_diff(a, b, path="$"):
    if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                       and not isinstance(a, bool) and not isinstance(b, bool)):
        return f"{path}: {a!r} != {b!r}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            d = first_diff(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_diff(x, y, f"{path}[{i}]")
            if d:
                return d
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}: extra {(a[len(b):] or b[len(a):])[:3]}"
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def check(doc, exp):
    """The whole document equals the expected inventory (key order included) and
    carries the digest computed here."""
    got = dict(doc)
    dg = got.pop("digest")
    diff = first_diff(got, exp)
    assert diff is None, diff
    assert dg == digest_of(exp)


@pytest.fixture(scope="module")
def nvml_lib(tmp_path_factory):
    """tests/fixtures/fake_nvml.c as a shared library (and a variant missing a
    required entry point)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.fail("no C compiler (cc) to build tests/fixtures/fake_nvml.c")
    d = tmp_path_factory.mktemp("nvml")
    out = {}
    for name, flags in (("ok", []), ("nopci", ["-DFAKE_NVML_NO_PCI"])):
        lib = d / name / "libnvidia-ml.so.1"
        lib.parent.mkdir()
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", *flags,
                        "-o", str(lib), str(ROOT / "tests/fixtures/fake_nvml.c")], check=True)
        out[name] = lib
    return out


def run_nvml(root, lib, fn, tmp_path):
    cfg = tmp_path / "fake_nvml.conf"
    sr.write_nvml_config(cfg, fn)
    return discover("--sysroot", str(root), "--nvml-lib", str(lib),
                    env={"DS_FAKE_NVML": str(cfg)})


# ---- the fixture nodes ------------------------------------------------------------

def test_h100_node_with_fake_gpus(tmp_path):
    root = tmp_path / "root"
    node = sr.build("h100", root)
    spec = "8xH100-80GB:nvswitch"
    r, doc = discover("--sysroot", str(root), "--fake-gpus", spec)
    assert r.returncode == 0, r.stderr
    check(doc, sr.expected(node, sr.FakeSpec(spec)))
    # the acceptance facts, spelled out
    assert len(doc["ib_ports"]) == 8
    down = [p["device"] for p in doc["ib_ports"] if not p["usable"]]
    assert down == ["mlx5_5"]
    assert all(p["rate_gbps"] == 400 and p["speed"] == "NDR" for p in doc["ib_ports"] if p["usable"])
    assert {lk["level"] for lk in doc["gpu_links"]} == {"NV18"} and len(doc["gpu_links"]) == 28
    lv = {(e["gpu"], e["nic"]): e["level"] for e in doc["gpu_nic"]}
    assert all(lv[(i, f"mlx5_{i}")] == "PIX" for i in range(8))
    assert lv[(0, "mlx5_7")] == "SYS" and lv[(0, "mlx5_1")] == "PHB" and lv[(0, "mlx5_2")] == "NODE"
    assert doc["compute"] == {"kind": "gpu", "ranks": 8}


def test_h100_node_with_fake_nvml(tmp_path, nvml_lib):
    root = tmp_path / "root"
    node = sr.build("h100", root)
    rng = random.Random(61)
    gpus = []
    for i in range(8):
        p = 7 - i  # NVML's order is not the bus order
        g = {"bus": sr.fake_bus(p), "uuid": "GPU-%08x-%04x-%04x-%04x-%012x" % (
                 rng.getrandbits(32), rng.getrandbits(16), rng.getrandbits(16),
                 rng.getrandbits(16), rng.getrandbits(48)),
             "name": "NVIDIA H100 80GB HBM3", "mem_total": 85520809984,
             "mem_used": 584384512 + rng.randrange(1 << 20), "cc": "9.0", "numa": p // 4,
             "temp": rng.randrange(28, 70), "power": rng.randrange(60000, 700000),
             "ecc_vol": 0, "ecc_agg": rng.randrange(0, 4), "retired_sbe": Err(3),
             "remap": (rng.randrange(3), 0, 0, 0), "links": 18, "active": 18,
             "remote": ",".join(f"switch@{s}*{n}" for s, n in zip(SWITCHES, (5, 4, 4, 5)))}
        if p == 6:  # two links down: NV16 to everyone
            g["active"] = 16
            g["remote"] = ",".join(f"switch@{s}*{n}" for s, n in zip(SWITCHES, (5, 4, 4, 3)))
        if p == 3:  # remote type not reported: a remote that is no GPU is a switch
            g["remote"] = f"unk@{SWITCHES[0]}*18"
        gpus.append(g)
    fn = sr.FakeNvml(gpus)
    r, doc = run_nvml(root, nvml_lib["ok"], fn, tmp_path)
    assert r.returncode == 0, r.stderr
    check(doc, sr.expected(node, fn))
    assert doc["gpu_source"]["driver_version"] == "550.54.15"
    levels = {(lk["a"], lk["b"]): lk["level"] for lk in doc["gpu_links"]}
    assert levels[(0, 6)] == "NV16" and levels[(0, 1)] == "NV18" and levels[(3, 4)] == "NV18"
    assert [g["nvml_index"] for g in doc["gpus"]] == list(range(7, -1, -1))


def test_roce_node(tmp_path):
    root = tmp_path / "root"
    node = sr.build("roce", root)
    spec = "2xA100-80GB:pcie"
    r, doc = discover("--sysroot", str(root), "--fake-gpus", spec)
    assert r.returncode == 0, r.stderr
    check(doc, sr.expected(node, sr.FakeSpec(spec)))
    gid = {(p["device"], p["port"]): p["gid_index"] for p in doc["ib_ports"]}
    assert gid == {("mlx5_0", 1): 3, ("mlx5_1", 1): 6, ("mlx5_1", 2): None}
    assert [p["netdev"] for p in doc["ib_ports"]] == ["eth2", "eth3", "eth4"]
    assert doc["gpu_links"] == [{"a": 0, "b": 1, "level": "PXB", "nvlinks": 0, "nvswitch": False,
                                 "source": "sysfs"}]


def test_roce_node_with_nvlink_bridge_from_nvml(tmp_path, nvml_lib):
    root = tmp_path / "root"
    node = sr.build("roce", root)
    g0, g1 = "0000:08:00.0", "0000:18:00.0"
    base = {"name": "NVIDIA A100 80GB PCIe", "mem_total": 85899345920, "mem_used": 1 << 20,
            "cc": "8.0", "temp": 44, "power": 71000, "ecc_vol": 0, "ecc_agg": 0, "links": 12,
            "active": 12}
    fn = sr.FakeNvml([
        {**base, "bus": g0, "uuid": "GPU-a1a1a1a1-0000-4000-8000-000000000001", "numa": 0,
         "remap": (1, 0, 0, 0), "remote": f"gpu@{g1}*12"},
        {**base, "bus": g1, "uuid": "GPU-a1a1a1a1-0000-4000-8000-000000000002", "numa": 0,
         "remap": (0, 1, 1, 0), "remote": f"unk@{g0}*12"},
    ], driver="535.104.05", cuda=12020)
    r, doc = run_nvml(root, nvml_lib["ok"], fn, tmp_path)
    assert r.returncode == 0, r.stderr
    check(doc, sr.expected(node, fn))
    assert doc["gpu_links"][0]["level"] == "NV12" and not doc["gpu_links"][0]["nvswitch"]
    assert doc["gpus"][1]["health"]["remapped_rows_pending"] is True


def test_node_without_infiniband(tmp_path):
    root = tmp_path / "root"
    node = sr.build("noib", root)
    r, doc = discover("--sysroot", str(root), "--fake-gpus", "0")
    assert r.returncode == 0, r.stderr
    check(doc, sr.expected(node, sr.FakeSpec("0")))
    assert doc["notes"][-1] == {
        "source": "infiniband", "message": "absent: /sys/class/infiniband not found (no RDMA devices)"}
    assert doc["compute"] == {"kind": "cpu", "ranks": 2}
    assert doc["ib_ports"] == [] and doc["gpus"] == []


def test_fake_nvlink_pairs_without_sysfs(tmp_path):
    """GPUs the sysroot does not have: NUMA from spreading over the host's nodes,
    pairs joined by NVLink, the other levels from NUMA only."""
    root = tmp_path / "root"
    node = sr.build("noib", root)
    spec = "4xA100-40GB:nvlink"
    r, doc = discover("--sysroot", str(root), "--fake-gpus", spec)
    assert r.returncode == 0, r.stderr
    check(doc, sr.expected(node, sr.FakeSpec(spec)))
    lv = {(lk["a"], lk["b"]): (lk["level"], lk["source"]) for lk in doc["gpu_links"]}
    assert lv[(0, 1)] == ("NV12", "nvlink") and lv[(2, 3)] == ("NV12", "nvlink")
    assert lv[(0, 2)] == ("SYS", "numa")
    assert [g["numa_node"] for g in doc["gpus"]] == [0, 0, 1, 1]


def test_nvml_errors_lost_gpu_and_topology_fallbacks(tmp_path, nvml_lib):
    root = tmp_path / "root"
    node = sr.build("noib", root)
    fn = sr.FakeNvml([
        {"bus": "0000:41:00.0", "uuid": "GPU-v100v100-0000-4000-8000-000000000000",
         "name": "Tesla V100-SXM2-32GB", "mem_total": 34359738368, "mem_used": 0, "cc": "7.0",
         "numa": 1, "temp": 41, "power": 55000, "ecc_vol": 0, "ecc_agg": 3,
         "retired_sbe": 70, "retired_dbe": 1, "remap": Err(3), "links": 6, "active": 0},
        {"lost": Err(15)},
        {"bus": "0000:01:00.0", "uuid": "GPU-a100a100-0000-4000-8000-000000000002",
         "name": "NVIDIA A100-SXM4-40GB", "mem_total": 42949672960, "mem_used": 4 << 20,
         "cc": "8.0", "numa": 0, "temp": 35, "power": 90000, "ecc_vol": 0, "ecc_agg": 0,
         "remap": (0, 0, 0, 0)},
        {"bus": "0000:02:00.0", "uuid": "GPU-a100a100-0000-4000-8000-000000000003",
         "name": "NVIDIA A100-SXM4-40GB", "mem": Err(4), "cc": "8.0", "numa": Err(3),
         "temp": Err(3), "power": Err(999), "ecc_vol": 0, "ecc_agg": 0, "remap": (2, 0, 0, 0)},
    ], topo={(2, 3): 10})
    r, doc = run_nvml(root, nvml_lib["ok"], fn, tmp_path)
    assert r.returncode == 0, r.stderr
    check(doc, sr.expected(node, fn))
    assert [g["bus_id"] for g in doc["gpus"]] == ["0000:01:00.0", "0000:02:00.0", "0000:41:00.0"]
    lv = {(lk["a"], lk["b"]): (lk["level"], lk["source"]) for lk in doc["gpu_links"]}
    assert lv == {(0, 1): ("PIX", "nvml"), (0, 2): ("SYS", "numa"), (1, 2): ("unknown", "none")}
    assert doc["gpus"][2]["health"]["retired_pages_sbe"] == 70
    assert doc["gpus"][1]["health"]["temperature_c"] is None
    assert doc["compute"] == {"kind": "gpu", "ranks": 3}


def test_node_without_nvml(tmp_path):
    root = tmp_path / "root"
    node = sr.build("nonvml", root)
    missing = root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    r, doc = discover("--sysroot", str(root), "--nvml-lib", str(missing))
    assert r.returncode == 0, r.stderr
    check(doc, sr.expected(node, sr.NoNvml(f"absent: {missing} not found")))
    assert doc["compute"] == {"kind": "cpu", "ranks": 2}
    assert len(doc["pci_gpus"]) == 4 and doc["gpus"] == [] and doc["gpu_nic"] == []
    # the default library is not loaded under a sysroot: this machine's NVML
    # would describe another node
    r, doc = discover("--sysroot", str(root))
    assert r.returncode == 0, r.stderr
    check(doc, sr.expected(node, sr.NoNvml(
        "not loaded: --sysroot is set and no --nvml-lib was given (this machine's NVML "
        "would describe another node)")))


def test_vm_node_flat_pci_tree_without_numa(tmp_path):
    """A KVM guest (the vm fixture): every device alone on a root port of one
    host bridge, numa_node -1 everywhere.  What the planner's topology file
    starts from: every GPU-NIC pair PHB from sysfs, NICs with no NUMA node."""
    root = tmp_path / "root"
    node = sr.build("vm", root)
    spec = "8xH100-80GB:nvswitch"
    r, doc = discover("--sysroot", str(root), "--fake-gpus", spec)
    assert r.returncode == 0, r.stderr
    check(doc, sr.expected(node, sr.FakeSpec(spec)))
    assert all(p["numa_node"] is None for p in doc["ib_ports"] + doc["pci_gpus"])
    # fake GPUs keep their spread NUMA nodes when sysfs says -1
    assert [g["numa_node"] for g in doc["gpus"]] == [0] * 4 + [1] * 4
    assert {(e["level"], e["source"]) for e in doc["gpu_nic"]} == {("PHB", "sysfs")}
    assert [p["device"] for p in doc["ib_ports"] if not p["usable"]] == ["mlx5_5"]


def test_nvml_init_failure_and_missing_symbol(tmp_path, nvml_lib):
    root = tmp_path / "root"
    node = sr.build("noib", root)
    cfg = tmp_path / "init.conf"
    cfg.write_text("init\t9\n")
    r, doc = discover("--sysroot", str(root), "--nvml-lib", str(nvml_lib["ok"]),
                      env={"DS_FAKE_NVML": str(cfg)})
    assert r.returncode == 0, r.stderr
    check(doc, sr.expected(node, sr.NoNvml("failed: nvmlInit: DRIVER_NOT_LOADED (9)")))
    r, doc = discover("--sysroot", str(root), "--nvml-lib", str(nvml_lib["nopci"]),
                      env={"DS_FAKE_NVML": str(cfg)})
    assert r.returncode == 0, r.stderr
    check(doc, sr.expected(node, sr.NoNvml(
        f"failed: {nvml_lib['nopci']} has no nvmlDeviceGetPciInfo_v3")))


# ---- digest, bad inputs, garbage, this machine ---------------------------------------------------

def test_digest_ignores_health_but_not_hardware(tmp_path):
    root = tmp_path / "root"
    sr.build("roce", root)
    _, a = discover("--sysroot", str(root), "--fake-gpus", "2xA100-80GB:pcie")
    _, b = discover("--sysroot", str(root), "--fake-gpus", "2xA100-80GB:pcie")
    assert a == b  # deterministic
    (root / "sys/class/infiniband/mlx5_0/ports/1/state").write_text("1: DOWN\n")
    _, c = discover("--sysroot", str(root), "--fake-gpus", "2xA100-80GB:pcie")
    assert c["digest"] != a["digest"] and c["digest"] == digest_of(c)
    h = copy.deepcopy(a)
    h["gpus"][0]["health"]["temperature_c"] = 99
    assert digest_of(h) == a["digest"]


@pytest.mark.parametrize("spec,problem", [
    ("8xH100", "no '-MEMGB'"),
    ("8xH999-80GB", "unknown GPU model 'H999'"),
    ("99xH100-80GB", "count 99 is out of range"),
    ("8xH100-80GB:mesh", "topology 'mesh'"),
    ("8xH100-80XB", "does not end in GB"),
    ("8xH100-0GB", "not a number in [1, 1024]"),
    ("2xL40S-48GB:nvswitch", "has no NVLink"),
    ("eight", "no 'x' after the count"),
    ("-1xH100-80GB", "is not a number"),
    ("", "empty spec"),
])
def test_bad_fake_gpus_spec(tmp_path, spec, problem):
    r, _ = discover("--fake-gpus", spec)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "--fake-gpus" in r.stderr and problem in r.stderr, r.stderr
    # the agent refuses it at start-up too, before anything starts
    r = subprocess.run([binary("dsagent"), "--fake-gpus", spec, "--data-dir",
                        str(tmp_path / "d")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and problem in r.stderr, r.stderr


def test_unreadable_sysroot(tmp_path):
    r, _ = discover("--sysroot", str(tmp_path / "nope"))
    assert r.returncode == 1 and f"sysroot {tmp_path / 'nope'}: No such file" in r.stderr, r.stderr
    f = tmp_path / "file"
    f.write_text("x")
    r, _ = discover("--sysroot", str(f))
    assert r.returncode == 2 and "not a directory" in r.stderr, r.stderr


def test_garbage_in_sysfs_becomes_notes(tmp_path):
    root = tmp_path / "root"
    sr.build("roce", root)
    w = lambda rel, text: (root / rel).write_text(text)  # noqa: E731
    w("sys/class/infiniband/mlx5_0/ports/1/rate", "fast\n")
    w("sys/class/infiniband/mlx5_1/ports/2/state", "DOWN\n")
    w("sys/class/infiniband/mlx5_1/ports/2/link_layer", "Token Ring\n")
    w("sys/class/infiniband/mlx5_1/ports/1/gids/2", "zzzz\n")
    w("proc/meminfo", "MemTotal: lots\n")
    w("sys/devices/system/node/node1/cpulist", "zero-three\n")
    w("sys/bus/pci/devices/0000:18:00.0/numa_node", "banana\n")
    n_lines = len((root / "etc/dsagent-fixture/ifaddrs").read_text().splitlines())
    with open(root / "etc/dsagent-fixture/ifaddrs", "a") as f:
        f.write("eth9 inet 300.1.1.1/24\neth9 carrier pigeon\n")
    (root / "sys/class/infiniband/mlx5_0/ports/1/phys_state").unlink()
    r, doc = discover("--sysroot", str(root), "--fake-gpus", "2xA100-80GB:pcie")
    assert r.returncode == 0, r.stderr
    msgs = [(n["source"], n["message"]) for n in doc["notes"]]
    for src, text in [
        ("host", "/proc/meminfo: MemTotal ' lots' is not '<N> kB'"),
        ("numa", "node1/cpulist 'zero-three' is not a CPU list"),
        ("gpus", "0000:18:00.0: numa_node 'banana' is not a number"),
        ("nics", f"/etc/dsagent-fixture/ifaddrs:{n_lines + 1}: '300.1.1.1' is not an inet address "
                 "with a /prefix"),
        ("nics", f"/etc/dsagent-fixture/ifaddrs:{n_lines + 2}: expected 'IFNAME inet|inet6 ADDR/PREFIX' or 'IFNAME link'"),
        ("infiniband", "mlx5_0 port 1: phys_state not readable"),
        ("infiniband", "mlx5_0 port 1: rate 'fast' is not '<N> Gb/sec (<W>X <SPEED>)'"),
        ("infiniband", "mlx5_1 port 1: gids/2 'zzzz' is not a GID"),
        ("infiniband", "mlx5_1 port 2: state 'DOWN' is not '<n>: <NAME>'"),
        ("infiniband", "mlx5_1 port 2: link_layer 'Token Ring' is not InfiniBand or Ethernet"),
    ]:
        assert (src, text) in msgs, (src, text, msgs)
    assert doc["host"]["memory_bytes"] is None
    assert doc["host"]["numa_nodes"][1]["cpus"] is None
    ports = {(p["device"], p["port"]): p for p in doc["ib_ports"]}
    assert ports[("mlx5_0", 1)]["rate_gbps"] is None and not ports[("mlx5_0", 1)]["usable"]
    assert ports[("mlx5_1", 1)]["gid_index"] == 6  # the bad entry is skipped, not fatal
    assert ports[("mlx5_1", 2)]["state"] is None and ports[("mlx5_1", 2)]["link_layer"] is None
    assert doc["nics"] == [n for n in doc["nics"] if n["name"] != "eth9"]
    assert doc["digest"] == digest_of(doc)


def test_this_machine():
    r, doc = discover()
    assert r.returncode == 0, r.stderr
    assert doc["schema"] == 1 and doc["digest"] == digest_of(doc)
    assert doc["host"]["hostname"] == socket.gethostname()
    with open("/proc/cpuinfo") as f:
        assert doc["host"]["cpus"] == sum(1 for line in f if line.startswith("processor"))
    names = {n["name"] for n in doc["nics"]}
    assert {socket.if_indextoname(i) for i, _ in socket.if_nameindex()} <= names
    if doc["gpu_source"]["kind"] == "none":
        assert doc["compute"]["kind"] == "cpu" and doc["gpus"] == []
        assert any(n["source"] == "nvml" for n in doc["notes"])
    else:
        assert doc["compute"] == {"kind": "gpu", "ranks": len(doc["gpus"])}


def test_help_lists_discovery_options():
    r = subprocess.run([binary("dsagent"), "--help"], capture_output=True, text=True, timeout=30)
    for flag in ("--sysroot", "--fake-gpus", "--nvml-lib", "--discover"):
        assert flag in r.stdout
