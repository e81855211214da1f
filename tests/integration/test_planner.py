"""The shard planner (agent/plan/, `dsagent plan`; docs/cluster.md "The shard planner").

Inventories come from `dsagent --discover --fake-gpus SPEC --sysroot ROOT` on the
sysfs fixtures of tests/fixtures/sysroots.py (the h100 tree has 8 NDR ports with
mlx5_5 DOWN; the noib tree has no RDMA device).  Models are config.json files with
no weights (DeepSeek-V3 and V2-Lite values of ../shared/docs/deepseek_v3_spec.md),
one tiny checkpoint whose safetensors headers give the bytes, and GGUF files: the
default model (llama, skipped when absent), tiny llama and tiny deepseek2 files
written by the fixtures; their sizes and bytes are read here with the gguf package.
CPU inventories come from the noib fixture, cut to one NUMA node for the one-rank
nodes of `dsctl cluster up --local N`.

Every expected number is computed here from the config or GGUF file, the split
rules of docs/distributed.md and the planner's stated constants (4 GiB reserve per
GPU, 1 GiB per CPU rank, f32 KV cache rows of kv_lora_rank + qk_rope_head_dim values,
or for Llama K and V of a rank's kv heads); nothing is copied from the planner's
output.  Where tests/plan_check is built, the GGUF bytes are also checked against
what the engine holds after loading each rank.
"""
import json
import math
import os
import pathlib
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import binary  # noqa: E402
from tests.fixtures import sysroots as sr  # noqa: E402

GiB = 1 << 30
RESERVE_GPU = 4 * GiB
KV_ELEM = 4  # the engine keeps MLA latent rows in f32 ...
KV_ELEM_LLAMA = 2  # ... and llama K/V in halves (--kv-cache-dtype auto)

V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
      "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
      "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
      "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
      "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
      "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
      "first_k_dense_replace": 3, "moe_layer_freq": 1, "topk_method": "noaux_tc",
      "max_position_embeddings": 163840, "num_nextn_predict_layers": 1,
      "torch_dtype": "bfloat16",
      "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                              "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
V3_BF16 = {k: v for k, v in V3.items() if k != "quantization_config"}
V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
           "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
           "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
           "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
           "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy",
           "max_position_embeddings": 163840, "torch_dtype": "bfloat16"}


# ---- the split rules, written out independently ------------------------------------------

def split_range(n, parts, i):
    base, rem = divmod(n, parts)
    return i * base + min(i, rem), base + (1 if i < rem else 0)


def stage_layers(n_layers, pp, s):
    first, count = split_range(n_layers, pp, s)
    return first, first + count


def tensors(cfg):
    """(where, layer, split, n, expert, bytes) of every weight the engine loads:
    where in all/first/last/layer, split in whole/stage/expert."""
    fp8 = (cfg.get("quantization_config") or {}).get("quant_method") == "fp8"
    D, H, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    kvl, rope, vd = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ql, I, mI = cfg.get("q_lora_rank") or 0, cfg["intermediate_size"], cfg["moe_intermediate_size"]
    E, ns = cfg["n_routed_experts"], cfg["n_shared_experts"]

    def lin(rows, cols, quant=True):
        if fp8 and quant:  # e4m3 weight + f32 scale per 128x128 block
            return [rows * cols, math.ceil(rows / 128) * math.ceil(cols / 128) * 4]
        return [rows * cols * 2]

    out = [("first", -1, "whole", 0, -1, b) for b in lin(V, D, False)]
    for L in range(cfg["num_hidden_layers"]):
        def add(split, n, parts, e=-1):
            out.extend(("layer", L, split, n, e, b) for b in parts)
        add("whole", 0, [D * 2, D * 2])  # the two layer norms
        if ql:
            add("whole", 0, lin(ql, D) + [ql * 2])
            add("stage", H, lin(H * qk, ql))
        else:
            add("stage", H, lin(H * qk, D))
        add("whole", 0, lin(kvl + rope, D) + [kvl * 2])
        add("stage", H, lin(H * (cfg["qk_nope_head_dim"] + vd), kvl))
        add("stage", H, lin(D, H * vd))
        if L < cfg["first_k_dense_replace"]:
            add("stage", I, lin(I, D) * 2 + lin(D, I))
            continue
        add("whole", 0, lin(E, D, False))
        if cfg.get("topk_method") == "noaux_tc":
            add("whole", 0, [E * 4])
        for e in range(E):
            add("expert", mI, lin(mI, D) * 2 + lin(D, mI), e)
        add("stage", ns * mI, lin(ns * mI, D) * 2 + lin(D, ns * mI))
    out.append(("last", -1, "whole", 0, -1, D * 2))
    out.extend(("last", -1, "stage", V, -1, b) for b in lin(V, D, False))
    return out


def rank_weights(cfg, tp, pp, ep, r, cache={}):
    key = json.dumps(cfg, sort_keys=True)
    if key not in cache:
        cache.clear()
        cache[key] = tensors(cfg)
    S = tp * ep
    stage, local = divmod(r, S)
    ep_rank, tp_rank = divmod(local, tp)
    f, e = stage_layers(cfg["num_hidden_layers"], pp, stage)
    e0, ec = split_range(cfg["n_routed_experts"], ep, ep_rank)
    total = 0
    for where, layer, split, n, expert, b in cache[key]:
        if where == "first" and stage != 0 or where == "last" and stage != pp - 1:
            continue
        if where == "layer" and not f <= layer < e:
            continue
        if split == "whole":
            total += b
        elif split == "stage":
            total += b * split_range(n, S, local)[1] // n
        elif e0 <= expert < e0 + ec:
            total += b * split_range(n, tp, tp_rank)[1] // n
    return total


def kv_per_token(cfg, pp, stage):
    f, e = stage_layers(cfg["num_hidden_layers"], pp, stage)
    return (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * KV_ELEM * (e - f)


# ---- helpers -------------------------------------------------------------------------------

def discover(tmp, spec, kind, host):
    root = tmp / f"root-{kind}"
    if not root.exists():
        sr.build(kind, str(root))
    r = subprocess.run([binary("dsagent"), "--discover", "--fake-gpus", spec, "--sysroot",
                        str(root)], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    inv = json.loads(r.stdout)
    inv["host"]["hostname"] = host
    path = tmp / f"{host}.json"
    path.write_text(json.dumps(inv))
    return path, inv


def model_dir(tmp, name, cfg):
    d = tmp / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def plan(invs, model, *extra, addrs=None):
    args = [binary("dsagent"), "plan", "--json", "--model", str(model)]
    for i, p in enumerate(invs):
        args += ["--inventory", str(p)]
        if addrs and addrs[i]:
            args += ["--addr", addrs[i]]
    r = subprocess.run(args + list(extra), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def devices(invs):
    return [(n, g) for n, inv in enumerate(invs) for g in inv["gpus"]]


def check_plan(doc, cfg, invs, frac=0.9, max_ctx=4096):
    """The plan fits its KV budget by our arithmetic, and follows the layout rules."""
    tp, pp, ep = doc["tp"], doc["pp"], doc["ep"]
    devs = devices(invs)
    assert tp * pp * ep == len(devs) == doc["world"]
    S = tp * ep
    tokens = doc["kv"]["tokens"]
    assert tokens >= max_ctx
    assert doc["kv"]["concurrency"] == tokens // max_ctx
    assert doc["kv"]["bytes_per_token_layer"] == (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    for r, rank in enumerate(doc["ranks"]):
        node, gpu = devs[r]
        stage, local = divmod(r, S)
        ep_rank, tp_rank = divmod(local, tp)
        assert (rank["rank"], rank["node"], rank["device"]) == (r, node, gpu["index"])
        assert (rank["stage"], rank["tp_rank"], rank["ep_rank"]) == (stage, tp_rank, ep_rank)
        assert tuple(rank["layers"]) == stage_layers(cfg["num_hidden_layers"], pp, stage)
        e0, ec = split_range(cfg["n_routed_experts"], ep, ep_rank)
        assert tuple(rank["experts"]) == (e0, e0 + ec)
        w = rank_weights(cfg, tp, pp, ep, r)
        kv = tokens * kv_per_token(cfg, pp, stage)
        mem = rank["memory"]
        assert (mem["weights"], mem["kv"], mem["reserve"]) == (w, kv, RESERVE_GPU)
        assert w + kv + RESERVE_GPU <= frac * gpu["memory_total_bytes"]
        assert mem["total"] == gpu["memory_total_bytes"]
    # groups: world rank = stage*tp*ep + ep_rank*tp + tp_rank
    assert doc["groups"]["world"] == list(range(len(devs)))
    assert doc["groups"]["stages"] == [list(range(s * S, (s + 1) * S)) for s in range(pp)]
    assert doc["groups"]["tp"] == [list(range(s * S + e * tp, s * S + e * tp + tp))
                                   for s in range(pp) for e in range(ep)]
    # TP inside one node's NVLink/NVSwitch domain
    for g in doc["groups"]["tp"]:
        nodes = {devs[r][0] for r in g}
        assert len(nodes) == 1
        gpus = [devs[r][1] for r in g]
        if len(g) > 1:
            assert all(x["nvswitch"] or x["nvlinks"] > 0 for x in gpus)


def active_hca(inv):
    ports = [f"{p['device']}:{p['port']}" for p in inv["ib_ports"] if p["usable"]]
    return "=" + ",".join(ports) if ports else None


def check_env(doc, invs, ifnames):
    for n, inv in enumerate(invs):
        env = doc["nodes"][n]["env"]
        hca = active_hca(inv)
        if hca:
            assert env["NCCL_IB_HCA"] == hca
            assert "NCCL_IB_DISABLE" not in env
        else:
            assert "NCCL_IB_HCA" not in env
            assert env["NCCL_IB_DISABLE"] == "1"
        if ifnames[n]:
            assert env["NCCL_SOCKET_IFNAME"] == "=" + ifnames[n]
            assert env["GLOO_SOCKET_IFNAME"] == ifnames[n]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("planner")


# ---- the cases ---------------------------------------------------------------------

def test_v3_fp8_2x8_h100_one_port_down(tmp):
    invs = [discover(tmp, "8xH100-80GB:nvswitch", "h100", f"h100-{i}") for i in range(2)]
    m = model_dir(tmp, "v3", V3)
    rc, doc = plan([p for p, _ in invs], m, addrs=["10.1.0.11", "10.1.0.11"])
    inv = [i for _, i in invs]
    assert rc == 0 and doc["fits"]
    assert doc["fp8_dequant"] == "native"
    assert "config.json" in doc["model"]["weights_source"]
    assert doc["model"]["weight_bytes"] == sum(t[-1] for t in tensors(V3))
    check_plan(doc, V3, inv)
    check_env(doc, inv, ["eth0", "eth0"])
    hca = doc["nodes"][0]["env"]["NCCL_IB_HCA"]
    assert hca == "=mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1,mlx5_4:1,mlx5_6:1,mlx5_7:1"
    # GPU 5's own NIC is DOWN: its nearest active one (mlx5_4) is across a host bridge
    assert doc["nodes"][0]["env"]["NCCL_NET_GDR_LEVEL"] == "PHB"
    assert "NCCL_IB_GID_INDEX" not in doc["nodes"][0]["env"]  # InfiniBand, not RoCE


def test_v3_fp8_2x8_h20(tmp):
    invs = [discover(tmp, "8xH20-96GB:nvswitch", "h100", f"h20-{i}") for i in range(2)]
    rc, doc = plan([p for p, _ in invs], model_dir(tmp, "v3", V3), addrs=["10.1.0.11"] * 2)
    assert rc == 0 and doc["fits"] and doc["fp8_dequant"] == "native"
    check_plan(doc, V3, [i for _, i in invs])
    check_env(doc, [i for _, i in invs], ["eth0", "eth0"])


@pytest.mark.parametrize("cfg,name,dequant", [(V3, "v3", "in-kernel"), (V3_BF16, "v3bf16", None)])
def test_v3_4x8_a100(tmp, cfg, name, dequant):
    invs = [discover(tmp, "8xA100-80GB:nvswitch", "h100", f"a100-{i}") for i in range(4)]
    rc, doc = plan([p for p, _ in invs], model_dir(tmp, name, cfg), addrs=["10.1.0.11"] * 4)
    assert rc == 0 and doc["fits"]
    assert doc["fp8_dequant"] == dequant  # FP8 below compute capability 8.9: planned, flagged
    assert doc["model"]["dtype"] == ("fp8" if dequant else "bf16")
    check_plan(doc, cfg, [i for _, i in invs])
    check_env(doc, [i for _, i in invs], ["eth0"] * 4)


def test_v2_lite_1x1_a100(tmp):
    path, inv = discover(tmp, "1xA100-80GB", "h100", "a100-single")
    rc, doc = plan([path], model_dir(tmp, "v2lite", V2_LITE), addrs=["10.1.0.11"])
    assert rc == 0 and (doc["tp"], doc["pp"], doc["ep"]) == (1, 1, 1)
    assert doc["ranks"][0]["memory"]["weights"] == sum(t[-1] for t in tensors(V2_LITE))
    check_plan(doc, V2_LITE, [inv])
    check_env(doc, [inv], ["eth0"])


def test_one_node_without_ib_socket_fallback(tmp):
    a = discover(tmp, "8xH100-80GB:nvswitch", "h100", "ib-node")
    b = discover(tmp, "8xH100-80GB:nvswitch", "noib", "socket-node")
    rc, doc = plan([a[0], b[0]], model_dir(tmp, "v3", V3), addrs=["10.1.0.11", "172.16.4.3"])
    assert rc == 0 and doc["fits"]
    check_plan(doc, V3, [a[1], b[1]])
    check_env(doc, [a[1], b[1]], ["eth0", "eno1"])
    assert doc["nodes"][0]["rdma"] and not doc["nodes"][1]["rdma"]
    # the IB node keeps IB; only the node without a usable port falls back to sockets
    assert "NCCL_IB_DISABLE" not in doc["nodes"][0]["env"]
    assert doc["nodes"][1]["env"]["NCCL_IB_DISABLE"] == "1"
    # 10 Gb/s assumed for the socket node, shared by its 8 GPUs
    assert doc["nodes"][1]["net_bytes_per_s_per_device"] == pytest.approx(1.25e9 / 8)


def test_l40s_pcie_prefers_pp_over_tp(tmp):
    path, inv = discover(tmp, "8xL40S-48GB:pcie", "h100", "l40s")
    rc, doc = plan([path], model_dir(tmp, "v2lite", V2_LITE), addrs=["10.1.0.11"])
    assert rc == 0 and doc["fits"]
    assert doc["tp"] == 1  # no NVLink: no TP
    assert doc["nodes"][0]["nvlink_domain"] == 1
    check_plan(doc, V2_LITE, [inv])
    # every rejected layout with tp > 1 was rejected for leaving the NVLink domain
    for x in doc["cost"]["rejected"]:
        if x["tp"] > 1:
            assert "NVLink" in x["reason"]
    # an explicit --tp 2 is honoured, with a warning
    rc, forced = plan([path], model_dir(tmp, "v2lite", V2_LITE), "--tp", "2")
    assert forced["tp"] == 2 and any("NVLink" in w for w in forced["warnings"])


def shortfall(cfg, tp, pp, ep, mem, frac=0.9, ctx=4096):
    usable = math.floor(frac * mem)
    shorts = [rank_weights(cfg, tp, pp, ep, r) + RESERVE_GPU
              + ctx * kv_per_token(cfg, pp, r // (tp * ep)) - usable
              for r in range(tp * pp * ep)]
    return max(shorts), sum(s for s in shorts if s > 0)


def test_v3_bf16_2x8_a100_40gb_does_not_fit(tmp):
    invs = [discover(tmp, "8xA100-40GB:nvswitch", "h100", f"a40-{i}") for i in range(2)]
    mem = invs[0][1]["gpus"][0]["memory_total_bytes"]
    m = model_dir(tmp, "v3bf16", V3_BF16)
    rc, doc = plan([p for p, _ in invs], m, "--tp", "8", "--pp", "2", "--ep", "1")
    assert rc == 1 and not doc["fits"]
    worst, total = shortfall(V3_BF16, 8, 2, 1, mem)
    assert worst > 0
    assert doc["shortfall"]["bytes"] == worst
    assert doc["shortfall"]["total_bytes"] == total
    sug = " ".join(doc["shortfall"]["suggestions"])
    assert "more nodes" in sug and "FP8" in sug
    # what would fit: the FP8 file of the same config, sized by our arithmetic
    fp8_worst, _ = shortfall(V3, 8, 2, 1, mem)
    assert doc["shortfall"]["fp8_weight_bytes"] == sum(t[-1] for t in tensors(V3))
    assert doc["shortfall"]["fp8_fits"] == (fp8_worst <= 0)
    # the weights alone do not fit: no context would
    assert doc["shortfall"]["max_ctx_that_fits"] is None
    # the whole model cannot fit 16 such GPUs whatever the layout
    rc, auto = plan([p for p, _ in invs], m)
    assert rc == 1 and not auto["fits"]
    floor_bytes = sum(t[-1] for t in tensors(V3_BF16)) + 16 * RESERVE_GPU - 16 * math.floor(0.9 * mem)
    assert auto["shortfall"]["total_bytes"] >= floor_bytes > 0
    # the human summary says it too
    r = subprocess.run([binary("dsagent"), "plan", "--model", str(m), "--inventory",
                        str(invs[0][0]), "--inventory", str(invs[1][0]), "--tp", "8", "--pp", "2"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1 and f"short by {worst} bytes" in r.stdout


def test_v3_fp8_on_one_8xh100_node_is_short(tmp):
    """8 x 80 GB cannot hold V3's FP8 weights: whatever layout the planner picks,
    its shortfall is the one our arithmetic gives for that layout."""
    path, inv = discover(tmp, "8xH100-80GB:nvswitch", "h100", "h100-ctx")
    mem = inv["gpus"][0]["memory_total_bytes"]
    rc, doc = plan([path], model_dir(tmp, "v3", V3), "--max-ctx", "163840")
    assert rc == 1 and not doc["fits"]
    tp, pp, ep = doc["tp"], doc["pp"], doc["ep"]
    worst, total = shortfall(V3, tp, pp, ep, mem, ctx=163840)
    assert (doc["shortfall"]["bytes"], doc["shortfall"]["total_bytes"]) == (worst, total)


def test_long_context_on_16_gpus_names_the_context_that_fits(tmp):
    invs = [discover(tmp, "8xH100-80GB:nvswitch", "h100", f"h100-lc{i}") for i in range(2)]
    mem = invs[0][1]["gpus"][0]["memory_total_bytes"]
    rc, doc = plan([p for p, _ in invs], model_dir(tmp, "v3", V3), "--max-ctx", "163840",
                   "--mem-fraction", "0.6", "--tp", "8", "--pp", "2")
    assert rc == 1
    usable = math.floor(0.6 * mem)
    fit = min((usable - rank_weights(V3, 8, 2, 1, r) - RESERVE_GPU) // kv_per_token(V3, 2, r // 8)
              for r in range(16))
    assert 0 < fit < 163840
    assert doc["shortfall"]["max_ctx_that_fits"] == fit
    rc, ok = plan([p for p, _ in invs], model_dir(tmp, "v3", V3), "--max-ctx", str(fit),
                  "--mem-fraction", "0.6", "--tp", "8", "--pp", "2")
    assert rc == 0 and ok["kv"]["tokens"] >= fit


def test_roce_gid_index_and_exact_ports(tmp):
    path, inv = discover(tmp, "4xH100-80GB:nvswitch", "roce", "roce")
    rc, doc = plan([path], model_dir(tmp, "v2lite", V2_LITE), addrs=["192.168.1.20"])
    assert rc == 0
    env = doc["nodes"][0]["env"]
    # mlx5_1 port 2 is DOWN: port-exact names keep it out
    assert env["NCCL_IB_HCA"] == active_hca(inv) == "=mlx5_0:1,mlx5_1:1"
    roce = [p["gid_index"] for p in inv["ib_ports"] if p["usable"] and p["link_layer"] == "Ethernet"]
    assert env["NCCL_IB_GID_INDEX"] == roce[0]
    assert env["NCCL_SOCKET_IFNAME"] == "=eth0"
    if len(set(roce)) > 1:
        assert any("GID" in n for n in doc["nodes"][0]["notes"])
    check_plan(doc, V2_LITE, [inv])


def test_cpu_nodes(tmp):
    """Nodes without GPUs: one rank per NUMA node, its memory, 1 GiB reserve."""
    root = tmp / "root-cpu"
    sr.build("noib", str(root))
    r = subprocess.run([binary("dsagent"), "--discover", "--sysroot", str(root)],
                       capture_output=True, text=True, timeout=30, cwd=ROOT)
    inv = json.loads(r.stdout)
    path = tmp / "cpu.json"
    path.write_text(r.stdout)
    rc, doc = plan([path, path], model_dir(tmp, "v2lite", V2_LITE), "--pp", "2",
                   addrs=["172.16.4.3", "172.16.4.3"])
    assert rc == 0 and doc["fits"] and doc["world"] == 4
    mems = [n["memory_bytes"] for n in inv["host"]["numa_nodes"]] * 2
    tok = doc["kv"]["tokens"]
    for r, rank in enumerate(doc["ranks"]):
        w = rank_weights(V2_LITE, doc["tp"], 2, doc["ep"], r)
        kv = tok * kv_per_token(V2_LITE, 2, rank["stage"])
        assert (rank["memory"]["weights"], rank["memory"]["reserve"]) == (w, GiB)
        assert w + kv + GiB <= 0.9 * mems[r]
    assert doc["nodes"][1]["env"]["NCCL_IB_DISABLE"] == "1"
    assert doc["nodes"][1]["env"]["GLOO_SOCKET_IFNAME"] == "eno1"
    # CPU ranks never get an NCCL topology file
    assert [n["nccl_topo_xml"] for n in doc["nodes"]] == [None, None]


# ---- the NCCL topology file of a node whose topology NCCL cannot see ------------------------

def cpu_mask(cpulists, words):
    """A cpumap-style mask (32-bit hex words, most significant first) of the CPUs
    of the given cpulists."""
    bits = 0
    for cl in cpulists:
        for part in cl.split(","):
            a, _, b = part.partition("-")
            for c in range(int(a), int(b or a) + 1):
                bits |= 1 << c
    return ",".join(f"{(bits >> (32 * w)) & 0xffffffff:08x}" for w in reversed(range(words)))


def topo_tree(xml):
    """The parsed file: the root, each element's parent, and the <pci> element
    of every GPU or NIC bus id."""
    root = ET.fromstring(xml)
    parent = {c: p for p in root.iter() for c in p}
    pci = {e.get("busid"): e for e in root.iter("pci") if e.get("class") != "0x060400"}
    return root, parent, pci


def cpu_above(parent, e):
    while e.tag != "cpu":
        e = parent[e]
    return e


def xml_level(parent, a, b):
    """NCCL's PCI distance between elements a and b of the file: PIX when one
    bridge joins them, PXB when several, PHB when only their CPU, SYS when
    different CPUs."""
    up = []
    x = parent[a]
    while x is not None:
        up.append(x)
        x = parent.get(x)
    x = parent[b]
    while x not in up:
        x = parent[x]
    if x.tag == "system":
        return "SYS"
    if x.tag == "cpu":
        return "PHB"
    return "PIX" if x is parent[a] and x is parent[b] else "PXB"


def test_vm_node_gets_an_nccl_topology_file(tmp):
    """A KVM guest's flat PCI tree with NICs of no NUMA node (the vm fixture) gets
    a topology file listing exactly its GPUs and its RDMA devices with an ACTIVE
    port; a bare-metal node beside it (h100 fixture) gets none."""
    spec = "8xH100-80GB:nvswitch"
    vm_path, vm = discover(tmp, spec, "vm", "vm-0")
    hw_path, _ = discover(tmp, spec, "h100", "hw-1")
    rc, doc = plan([vm_path, hw_path], model_dir(tmp, "v3", V3))
    assert rc == 0 and doc["fits"], doc.get("shortfall")
    decl = sr.build("vm", tmp / "vm-declared")  # the fixture as declared
    numa_ids = decl.numa_ids()
    cc_major, cc_minor, links = sr.FAKE_MODELS["H100"]
    # what the file must say, from the declaration and the fake-GPU rules
    want_gpus = {(sr.fake_bus(i), numa_ids[i * len(numa_ids) // 8], i, cc_major * 10 + cc_minor)
                 for i in range(8)}
    want_nics = {p["bus_id"] for p in decl.ib_ports if p["usable"]}
    assert len(want_nics) == 7  # mlx5_5 is DOWN

    node = doc["nodes"][0]
    assert "NCCL_TOPO_FILE" not in node["env"]  # its path is the node's business
    assert any("nccl_topo_xml" in n and "NUMA" in n for n in node["notes"]), node["notes"]
    root, parent, pci = topo_tree(node["nccl_topo_xml"])
    assert root.tag == "system" and root.get("version") == "1"
    got_gpus = set()
    for g in root.iter("gpu"):
        e = parent[g]
        got_gpus.add((e.get("busid"), int(cpu_above(parent, e).get("numaid")), int(g.get("dev")),
                      int(g.get("sm"))))
        assert e.get("class").startswith("0x03")
        # every link reaches the NVSwitches NCCL cannot see in a guest
        assert [(x.get("target"), x.get("count"), x.get("tclass")) for x in g.iter("nvlink")] == \
            [("fffffff:ffff:ff", str(links), "0x068000")]
        assert g.get("rank") is None and g.get("gdr") is None  # NCCL's, per communicator
    assert got_gpus == want_gpus
    nics = {b: e for b, e in pci.items() if e.get("class").startswith("0x02")}
    assert set(nics) == want_nics
    # the NICs have no NUMA node on a two-node host: NCCL's unknown CPU (-1)
    assert {int(cpu_above(parent, e).get("numaid")) for e in nics.values()} == {-1}
    assert not list(root.iter("net"))  # NCCL fills each <net> from its plugin
    assert len(pci) == len(want_gpus) + len(want_nics)  # nothing else, no bridges
    assert not [e for e in root.iter("pci") if e.get("class") == "0x060400"]
    cpulists = {n[0]: n[1] for n in decl.numa}
    words = (max(int(c) for cl in cpulists.values() for c in cl.replace("-", ",").split(",")) + 32) // 32
    for c in root.findall("cpu"):
        nid = int(c.get("numaid"))
        want = cpu_mask([cpulists[nid]] if nid >= 0 else list(cpulists.values()), words)
        assert c.get("affinity") == want, (nid, c.get("affinity"), want)
    # the visible node: no file, no note
    assert doc["nodes"][1]["nccl_topo_xml"] is None
    assert not any("nccl_topo_xml" in n for n in doc["nodes"][1]["notes"])


def test_topology_file_keeps_the_pci_distances_discovery_knows(tmp):
    """GPUs the PCI bus does not show (4 fake GPUs on the roce fixture's 2): the
    file puts every GPU and active NIC at the distance the inventory gives
    (PIX, PXB under shared bridges; NODE as PHB, NCCL's name; SYS across CPUs)."""
    path, inv = discover(tmp, "4xH100-80GB:nvswitch", "roce", "roce-hidden")
    rc, doc = plan([path], model_dir(tmp, "v2lite", V2_LITE))
    assert rc == 0
    node = doc["nodes"][0]
    assert any("not on the PCI bus" in n for n in node["notes"]), node["notes"]
    root, parent, pci = topo_tree(node["nccl_topo_xml"])
    usable = {p["device"]: p["bus_id"] for p in inv["ib_ports"] if p["usable"]}
    gpu_bus = [g["bus_id"] for g in inv["gpus"]]
    assert {b for b, e in pci.items() if e.find("gpu") is not None} == set(gpu_bus)
    assert {b for b, e in pci.items() if e.find("gpu") is None} == set(usable.values())
    nccl = {"PIX": "PIX", "PXB": "PXB", "PHB": "PHB", "NODE": "PHB", "SYS": "SYS"}
    levels = set()
    for e in inv["gpu_nic"]:
        if e["nic"] not in usable:
            continue
        got = xml_level(parent, pci[gpu_bus[e["gpu"]]], pci[usable[e["nic"]]])
        assert got == nccl[e["level"]], (e, got)
        levels.add(e["level"])
    assert {"PIX", "PXB", "SYS"} <= levels  # the fixture has each kind
    for g in inv["gpus"]:
        assert int(cpu_above(parent, pci[g["bus_id"]]).get("numaid")) == g["numa_node"]


def test_topology_file_refuses_a_malformed_inventory(tmp):
    """A hidden node's bus id or CPU list that does not parse stops the plan
    (exit 2) naming it."""
    _, vm = discover(tmp, "8xH100-80GB:nvswitch", "vm", "vm-bad")
    m = model_dir(tmp, "v2lite", V2_LITE)
    bad_bus = json.loads(json.dumps(vm))
    bad_bus["gpus"][3]["bus_id"] = "38:00.0"
    bad_cpus = json.loads(json.dumps(vm))
    bad_cpus["host"]["numa_nodes"][1]["cpulist"] = "8-x"
    for doc, word in ((bad_bus, "gpu 3: bus_id '38:00.0' is not a PCI address"),
                      (bad_cpus, "cpulist '8-x' is not a list of CPUs")):
        p = tmp / "bad-topo.json"
        p.write_text(json.dumps(doc))
        r = run_plan("--inventory", str(p), "--model", str(m))
        assert r.returncode == 2 and word in r.stderr, (r.returncode, r.stderr)


def cpu_inventory(tmp, name, numa_nodes):
    """A CPU node's inventory (discovered on the noib fixture) cut to its first
    numa_nodes NUMA nodes: one CPU rank each.  With 1 it is what each agent of
    `dsctl cluster up --local N` reports on a one-socket machine."""
    root = tmp / "root-cpu"
    if not root.exists():
        sr.build("noib", str(root))
    r = subprocess.run([binary("dsagent"), "--discover", "--sysroot", str(root)],
                       capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    inv = json.loads(r.stdout)
    assert inv["compute"]["kind"] == "cpu"
    inv["host"]["numa_nodes"] = inv["host"]["numa_nodes"][:numa_nodes]
    inv["compute"]["ranks"] = numa_nodes
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(inv))
    return path, inv


def check_cpu_plan(doc, cfg, invs, tp, pp, ep, frac=0.9, max_ctx=4096):
    """A plan of CPU ranks: one rank per NUMA node, in node order, 1 GiB reserve,
    the KV budget the tightest rank leaves, all by our arithmetic."""
    devs = [(n, i, numa["memory_bytes"]) for n, inv in enumerate(invs)
            for i, numa in enumerate(inv["host"]["numa_nodes"])]
    W = tp * pp * ep
    assert (doc["tp"], doc["pp"], doc["ep"], doc["world"]) == (tp, pp, ep, W) and W == len(devs)
    S = tp * ep
    room = [math.floor(frac * mem) - rank_weights(cfg, tp, pp, ep, r) - GiB
            for r, (_, _, mem) in enumerate(devs)]
    tokens = min(room[r] // kv_per_token(cfg, pp, r // S) for r in range(W))
    assert tokens >= max_ctx
    assert doc["kv"]["tokens"] == tokens
    for r, rank in enumerate(doc["ranks"]):
        node, index, mem = devs[r]
        stage, local = divmod(r, S)
        ep_rank, tp_rank = divmod(local, tp)
        assert (rank["rank"], rank["node"], rank["device"]) == (r, node, index)
        assert (rank["stage"], rank["tp_rank"], rank["ep_rank"]) == (stage, tp_rank, ep_rank)
        assert tuple(rank["layers"]) == stage_layers(cfg["num_hidden_layers"], pp, stage)
        e0, ec = split_range(cfg["n_routed_experts"], ep, ep_rank)
        assert tuple(rank["experts"]) == (e0, e0 + ec)
        m = rank["memory"]
        assert (m["total"], m["weights"], m["reserve"]) == (mem, rank_weights(cfg, tp, pp, ep, r), GiB)
        assert m["kv"] == tokens * kv_per_token(cfg, pp, stage)
    assert doc["groups"]["tp"] == [list(range(s * S + e * tp, s * S + e * tp + tp))
                                   for s in range(pp) for e in range(ep)]
    assert doc["warnings"] == []  # CPU ranks have no NVLink domain to leave


@pytest.mark.parametrize("nodes,tp,pp,ep", [(2, 2, 1, 1), (3, 1, 3, 1), (4, 2, 1, 2), (2, 1, 2, 1)])
def test_local_cpu_nodes_of_one_rank(tmp, nodes, tp, pp, ep):
    """`dsctl cluster up --local N --tp/--pp/--ep`: N agents of one CPU rank each.
    A tp group of CPU ranks may span nodes (their collectives are TCP anyway)."""
    path, inv = cpu_inventory(tmp, "cpu1", 1)
    m = model_dir(tmp, "v2lite", V2_LITE)
    flags = [f for k, v in (("--tp", tp), ("--pp", pp), ("--ep", ep)) if v > 1 for f in (k, str(v))]
    rc, doc = plan([path] * nodes, m, *flags, addrs=["127.0.0.1"] * nodes)
    assert rc == 0 and doc["fits"] and doc["overridden"]
    check_cpu_plan(doc, V2_LITE, [inv] * nodes, tp, pp, ep)
    # rank r on node r: rank 0 on node 0, and a tp group over tp nodes
    assert [k["node"] for k in doc["ranks"]] == list(range(nodes))
    for g in doc["groups"]["tp"]:
        assert [doc["ranks"][r]["node"] for r in g] == g


def test_cpu_tp_across_nodes_is_planned_by_cost(tmp):
    """No override: every layout of CPU ranks is a candidate, cross-node tp
    included; the one chosen is the cheapest, and it is a valid plan."""
    path, inv = cpu_inventory(tmp, "cpu2", 2)
    m = model_dir(tmp, "v2lite", V2_LITE)
    rc, doc = plan([path, path], m, addrs=["172.16.4.3", "172.16.4.4"])
    assert rc == 0 and doc["fits"] and not doc["overridden"]
    check_cpu_plan(doc, V2_LITE, [inv, inv], doc["tp"], doc["pp"], doc["ep"])
    assert doc["ranks"][0]["node"] == 0 and doc["ranks"][0]["device"] == 0
    # 4 ranks: tp*pp*ep = 4 with ep <= 64 experts: 6 layouts, all allowed
    layouts = {(x["tp"], x["pp"], x["ep"]) for x in doc["cost"]["rejected"]}
    layouts.add((doc["tp"], doc["pp"], doc["ep"]))
    assert layouts == {(t, p, 4 // t // p) for t in (1, 2, 4) for p in (1, 2, 4) if 4 % (t * p) == 0}
    for x in doc["cost"]["rejected"]:
        assert "span" not in x["reason"] and "NVLink" not in x["reason"]
        assert x["seconds_per_token"] >= doc["cost"]["seconds_per_token"]
    # tp 4 over the two nodes' two ranks each, asked for: planned
    rc, wide = plan([path, path], m, "--tp", "4")
    assert rc == 0
    check_cpu_plan(wide, V2_LITE, [inv, inv], 4, 1, 1)
    assert [k["node"] for k in wide["ranks"]] == [0, 0, 1, 1]


def test_max_ctx_and_mem_fraction(tmp):
    path, inv = discover(tmp, "1xA100-80GB", "h100", "a100-ctx")
    m = model_dir(tmp, "v2lite", V2_LITE)
    rc, doc = plan([path], m, "--max-ctx", "32768", "--mem-fraction", "0.8")
    assert rc == 0
    check_plan(doc, V2_LITE, [inv], frac=0.8, max_ctx=32768)
    w = sum(t[-1] for t in tensors(V2_LITE))
    room = math.floor(0.8 * inv["gpus"][0]["memory_total_bytes"]) - w - RESERVE_GPU
    assert doc["kv"]["tokens"] == room // kv_per_token(V2_LITE, 1, 0)


# ---- weights from safetensors headers ------------------------------------------------------

TINY = dict(V2_LITE, vocab_size=512, hidden_size=64, intermediate_size=96,
            moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            max_position_embeddings=2048)


def write_safetensors(path, items):
    """items: [(name, bytes)] as BF16 1-D tensors; the data is zeros."""
    header, off = {}, 0
    for name, nbytes in items:
        header[name] = {"dtype": "BF16", "shape": [nbytes // 2], "data_offsets": [off, off + nbytes]}
        off += nbytes
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + bytes(off))


def test_safetensors_headers_give_the_bytes(tmp):
    d = model_dir(tmp, "tiny", TINY)
    D, H, mI, V = 64, 4, 32, 512
    qk, kvd = 16 + 8, 16 + 16
    items = [("model.embed_tokens.weight", V * D * 2), ("model.norm.weight", D * 2),
             ("lm_head.weight", V * D * 2)]
    for L in range(4):
        p = f"model.layers.{L}."
        items += [(p + "input_layernorm.weight", D * 2), (p + "post_attention_layernorm.weight", D * 2),
                  (p + "self_attn.q_proj.weight", H * qk * D * 2),
                  (p + "self_attn.kv_a_proj_with_mqa.weight", (32 + 8) * D * 2),
                  (p + "self_attn.kv_a_layernorm.weight", 32 * 2),
                  (p + "self_attn.kv_b_proj.weight", H * kvd * 32 * 2),
                  (p + "self_attn.o_proj.weight", D * H * 16 * 2)]
        if L == 0:
            items += [(p + f"mlp.{k}.weight", 96 * D * 2) for k in ("gate_proj", "up_proj", "down_proj")]
            continue
        items.append((p + "mlp.gate.weight", 8 * D * 2))
        for e in range(8):
            items += [(p + f"mlp.experts.{e}.{k}.weight", mI * D * 2)
                      for k in ("gate_proj", "up_proj", "down_proj")]
        items += [(p + f"mlp.shared_experts.{k}.weight", mI * D * 2)
                  for k in ("gate_proj", "up_proj", "down_proj")]
    items.append(("model.layers.4.self_attn.o_proj.weight", 12345 * 2))  # MTP: not loaded
    write_safetensors(d / "model-00001-of-00002.safetensors", items[: len(items) // 2])
    write_safetensors(d / "model-00002-of-00002.safetensors", items[len(items) // 2:])
    invs = [discover(tmp, "4xH100-80GB:nvswitch", "h100", f"tiny-{i}") for i in range(2)]
    rc, doc = plan([p for p, _ in invs], d, "--tp", "2", "--pp", "2", "--ep", "2")
    assert rc == 0
    assert doc["model"]["weights_source"] == "safetensors headers"
    assert doc["model"]["weight_bytes"] == sum(b for n, b in items) - 12345 * 2
    # the same bytes as the config arithmetic for BF16: the per-rank shares agree
    check_plan(doc, TINY, [i for _, i in invs], max_ctx=2048)


# ---- GGUF files ----------------------------------------------------------------------------
# The sizes come from the file's metadata and tensor infos, read here with llama.cpp's gguf
# package; the split rules are the engine's (docs/distributed.md "Llama-family models under
# a plan", "DeepSeek under a plan"), written out again below.

from conftest import BUILD  # noqa: E402

DEFAULT_GGUF = ROOT / "models" / "default.gguf"
needs_default = pytest.mark.skipif(not DEFAULT_GGUF.exists(),
                                   reason="models/default.gguf is absent (make model)")
needs_plan_check = pytest.mark.skipif(not (BUILD / "tests" / "plan_check").exists(),
                                      reason="tests/plan_check is not built (make tests-bin)")


def read_gguf(path):
    """(metadata value getter, {tensor name: (bytes, row-major shape, ggml block size)})."""
    import gguf
    r = gguf.GGUFReader(str(path))

    def meta(key, default=None):
        f = r.fields.get(key)
        return default if f is None else f.contents()
    tensors = {t.name: (int(t.n_bytes), [int(x) for x in reversed(t.shape)],
                        gguf.GGML_QUANT_SIZES[t.tensor_type][0]) for t in r.tensors}
    return meta, tensors


def llama_facts(path):
    meta, t = read_gguf(path)
    assert meta("general.architecture") == "llama"
    D, H = meta("llama.embedding_length"), meta("llama.attention.head_count")
    return dict(tensors=t, D=D, H=H, KV=meta("llama.attention.head_count_kv", H),
                F=meta("llama.feed_forward_length"), L=meta("llama.block_count"),
                hd=meta("llama.attention.key_length", D // H),
                ctx=meta("llama.context_length", 4096), V=t["token_embd.weight"][1][0],
                tied="output.weight" not in t)


def part(nbytes, n, parts, i):
    return nbytes * split_range(n, parts, i)[1] // n


def llama_rank(g, tp, pp, r):
    """(weight bytes, KV bytes per token) of rank r: llama.c under tp x pp (ep 1)."""
    t, stage, tpr = g["tensors"], r // tp, r % tp
    f, e = stage_layers(g["L"], pp, stage)
    w = t["token_embd.weight"][0] if stage == 0 else 0
    if stage == pp - 1:
        w += t["output_norm.weight"][0]
        if not g["tied"]:
            w += part(t["output.weight"][0], g["V"], tp, tpr)
        elif pp > 1:  # the last stage's own rows of the embedding
            w += part(t["token_embd.weight"][0], g["V"], tp, tpr)
    by = {"attn_norm": 0, "ffn_norm": 0, "attn_q": g["KV"], "attn_k": g["KV"], "attn_v": g["KV"],
          "attn_output": g["D"], "ffn_gate": g["F"], "ffn_up": g["F"], "ffn_down": g["D"]}
    for L in range(f, e):
        for name, n in by.items():
            b = t[f"blk.{L}.{name}.weight"][0]
            w += part(b, n, tp, tpr) if n else b
    gc = split_range(g["KV"], tp, tpr)[1]
    row = 2 * gc * g["hd"] * KV_ELEM_LLAMA if gc else KV_ELEM_LLAMA  # one unused half without kv heads
    return w, row * (e - f)


def check_gguf_plan(doc, invs, tp, pp, ep, rank_of, total, max_ctx):
    """rank_of(r) -> (weights, KV bytes per token); CPU ranks, one per NUMA node."""
    devs = [(n, i, numa["memory_bytes"]) for n, inv in enumerate(invs)
            for i, numa in enumerate(inv["host"]["numa_nodes"])]
    W, S = tp * pp * ep, tp * ep
    assert (doc["tp"], doc["pp"], doc["ep"], doc["world"]) == (tp, pp, ep, W) == (tp, pp, ep, len(devs))
    assert doc["model"]["weights_source"] == "GGUF tensor infos"
    assert doc["model"]["weight_bytes"] == total
    want = [rank_of(r) for r in range(W)]
    tokens = min((math.floor(0.9 * devs[r][2]) - want[r][0] - GiB) // want[r][1] for r in range(W))
    assert doc["kv"]["tokens"] == tokens >= max_ctx
    assert doc["kv"]["max_ctx"] == max_ctx
    for r, rank in enumerate(doc["ranks"]):
        stage, local = divmod(r, S)
        assert (rank["node"], rank["device"]) == devs[r][:2]
        assert (rank["stage"], rank["ep_rank"], rank["tp_rank"]) == (stage, *divmod(local, tp))
        m = rank["memory"]
        assert (m["weights"], m["kv"], m["reserve"]) == (want[r][0], tokens * want[r][1], GiB), r


def plan_check_bytes(model, tp, pp, ep=1):
    """The weight bytes each rank of the engine holds (tests/plan_check loads the model)."""
    r = subprocess.run([str(BUILD / "tests" / "plan_check"), "-m", str(model), "--tp", str(tp),
                        "--pp", str(pp), "--ep", str(ep), "--tol", "1"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    line = [x for x in r.stdout.splitlines() if "weight bytes per rank" in x]
    assert line, r.stdout + r.stderr
    return [int(x) for x in line[0].split("per rank")[1].split("(")[0].split()]


@needs_default
@pytest.mark.parametrize("tp,pp", [(1, 2), (3, 1), (2, 1), (1, 1)])
def test_default_gguf_on_local_cpu_nodes(tmp, tp, pp):
    """`dsctl cluster up --local N --pp 2 --model models/default.gguf`: one-rank CPU
    nodes; tp 3 puts one of the 3 kv heads on each rank."""
    g = llama_facts(DEFAULT_GGUF)
    path, inv = cpu_inventory(tmp, "cpu1", 1)
    W = tp * pp
    flags = [f for k, v in (("--tp", tp), ("--pp", pp)) if v > 1 for f in (k, str(v))]
    rc, doc = plan([path] * W, DEFAULT_GGUF, *flags, addrs=["127.0.0.1"] * W)
    assert rc == 0 and doc["fits"]
    m = doc["model"]
    assert (m["model_type"], m["layers"], m["attention_heads"], m["hidden_size"]) == \
        ("llama", g["L"], g["H"], g["D"])
    assert m["llama"] == {"kv_heads": g["KV"], "head_dim": g["hd"], "tied_embeddings": g["tied"]}
    assert m["routed_experts"] == 0 and doc["ep"] == 1
    import gguf
    by_type = {}
    for t in gguf.GGUFReader(str(DEFAULT_GGUF)).tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
    assert m["dtype"] == max(by_type, key=by_type.get)
    assert doc["kv"]["bytes_per_token_layer"] == 2 * g["KV"] * g["hd"] * KV_ELEM_LLAMA
    assert doc["kv"]["elem_bytes"] == KV_ELEM_LLAMA
    check_gguf_plan(doc, [inv] * W, tp, pp, 1, lambda r: llama_rank(g, tp, pp, r),
                    sum(b for b, _, _ in g["tensors"].values()), min(g["ctx"], 4096))
    assert doc["groups"]["tp"] == [list(range(s * tp, s * tp + tp)) for s in range(pp)]


@needs_default
def test_default_gguf_auto_plan(tmp):
    """No override over two one-rank CPU nodes: a valid plan whatever the cost picks,
    with every layout of 2 ranks costed (ep needs experts: this model has none)."""
    g = llama_facts(DEFAULT_GGUF)
    path, inv = cpu_inventory(tmp, "cpu1", 1)
    rc, doc = plan([path, path], DEFAULT_GGUF)
    assert rc == 0 and doc["fits"] and not doc["overridden"]
    tp, pp = doc["tp"], doc["pp"]
    check_gguf_plan(doc, [inv, inv], tp, pp, 1, lambda r: llama_rank(g, tp, pp, r),
                    sum(b for b, _, _ in g["tensors"].values()), min(g["ctx"], 4096))
    assert {(x["tp"], x["pp"], x["ep"]) for x in doc["cost"]["rejected"]} | {(tp, pp, 1)} == \
        {(2, 1, 1), (1, 2, 1)}


@needs_default
@needs_plan_check
@pytest.mark.parametrize("tp,pp", [(1, 2), (3, 1), (2, 2)])
def test_default_gguf_bytes_are_what_the_engine_loads(tmp, tp, pp):
    """The planner's bytes per rank against the engine's own count after loading
    the model under the same plan (model_weight_bytes of each rank)."""
    path, _ = cpu_inventory(tmp, "cpu1", 1)
    rc, doc = plan([path] * (tp * pp), DEFAULT_GGUF, "--tp", str(tp), "--pp", str(pp))
    assert rc == 0
    assert [k["memory"]["weights"] for k in doc["ranks"]] == plan_check_bytes(DEFAULT_GGUF, tp, pp)


def tiny_llama_gguf(tmp, name, tied, **cfg):
    from tests.fixtures import tiny_llama
    d, c, w = tiny_llama.write_hf(tmp / (name + "-hf"), tie_word_embeddings=tied, **cfg)
    return tiny_llama.write_gguf(tmp / (name + ".gguf"), c, w, dtype="F16"), c, w


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp,pp", [(2, 2), (3, 1), (1, 2)])
def test_tiny_llama_gguf_heads_and_vocab(tmp, tied, tp, pp):
    """A head of its own (output.weight, vocab rows over the stage) or tied to the
    embedding; 4 heads over 2 kv heads, so tp 3 leaves a rank without kv heads."""
    path, _, _ = tiny_llama_gguf(tmp, f"tl-{int(tied)}", tied, num_hidden_layers=3)
    g = llama_facts(path)
    assert g["tied"] == tied and g["KV"] == 2
    inv_path, inv = cpu_inventory(tmp, "cpu1", 1)
    W = tp * pp
    rc, doc = plan([inv_path] * W, path, "--tp", str(tp), "--pp", str(pp), "--max-ctx", "256")
    assert rc == 0
    check_gguf_plan(doc, [inv] * W, tp, pp, 1, lambda r: llama_rank(g, tp, pp, r),
                    sum(b for b, _, _ in g["tensors"].values()), 256)
    if tp == 3:  # kv heads 1, 1, 0: the last rank keeps one half per token and layer
        assert [k["memory"]["kv"] for k in doc["ranks"]][2] == doc["kv"]["tokens"] * KV_ELEM_LLAMA * 3


def mla_facts(path):
    meta, t = read_gguf(path)
    assert meta("general.architecture") == "deepseek2"
    A = "deepseek2."
    H, rope = meta(A + "attention.head_count"), meta(A + "rope.dimension_count")
    qk = meta(A + "attention.key_length_mla", meta(A + "attention.key_length"))
    return dict(tensors=t, H=H, rope=rope, nope=qk - rope,
                vd=meta(A + "attention.value_length_mla", meta(A + "attention.value_length")),
                lora=meta(A + "attention.kv_lora_rank"), D=meta(A + "embedding_length"),
                I=meta(A + "feed_forward_length"), E=meta(A + "expert_count"),
                mI=meta(A + "expert_feed_forward_length"),
                S=meta(A + "expert_shared_count", 0) * meta(A + "expert_feed_forward_length"),
                L=meta(A + "block_count") - meta(A + "nextn_predict_layers", 0),
                ctx=meta(A + "context_length"), V=t["token_embd.weight"][1][0])


def col_part(nbytes, rows, n, unit, parts, i, block):
    """A column window: whole rows of its blocks, or f32 when it cuts a block
    (deepseek.c window_quant_cols)."""
    first, count = split_range(n, parts, i)
    if block > 1 and count and ((first * unit) % block or (count * unit) % block):
        return rows * count * unit * 4
    return nbytes * count // n


def mla_rank(g, tp, pp, ep, r):
    """(weight bytes, of which 1-D tensors, KV bytes per token) of rank r: deepseek.c."""
    t, S = g["tensors"], tp * ep
    stage, local = divmod(r, S)
    ep_rank, tp_rank = divmod(local, tp)
    f, e = stage_layers(g["L"], pp, stage)
    e0, ec = split_range(g["E"], ep, ep_rank)
    w = vec = 0
    for name, (b, shape, block) in t.items():
        if name == "token_embd.weight":
            w += b if stage == 0 else 0
            continue
        if name in ("output_norm.weight", "output.weight"):
            if stage == pp - 1:
                w += b if name == "output_norm.weight" else part(b, g["V"], S, local)
                vec += b if len(shape) == 1 else 0
            continue
        L, sub = int(name.split(".")[1]), name.split(".", 2)[2].rsplit(".", 1)[0]
        if not f <= L < e:
            continue
        if sub in ("attn_k_b", "attn_v_b") and f"blk.{L}.attn_kv_b.weight" in t:
            continue  # the engine uses attn_kv_b when a file has both
        if sub in ("attn_q_b", "attn_q", "attn_kv_b", "attn_k_b", "attn_v_b"):
            b = part(b, g["H"], S, local)
        elif sub == "attn_output":
            b = col_part(b, g["D"], g["H"], g["vd"], S, local, block)
        elif sub in ("ffn_gate", "ffn_up"):
            b = part(b, g["I"], S, local)
        elif sub == "ffn_down":
            b = col_part(b, g["D"], g["I"], 1, S, local, block)
        elif sub in ("ffn_gate_shexp", "ffn_up_shexp"):
            b = part(b, g["S"], S, local)
        elif sub == "ffn_down_shexp":
            b = col_part(b, g["D"], g["S"], 1, S, local, block)
        elif sub in ("ffn_gate_exps", "ffn_up_exps"):
            b = ec * part(b // g["E"], g["mI"], tp, tp_rank)
        elif sub == "ffn_down_exps":
            b = ec * col_part(b // g["E"], g["D"], g["mI"], 1, tp, tp_rank, block)
        elif len(shape) == 1:
            vec += b
        w += b
    return w, vec, (g["lora"] + g["rope"]) * KV_ELEM * (e - f)


MLA_LAYOUTS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (2, 1, 2), (1, 2, 1), (1, 1, 4), (2, 2, 1)]


@pytest.fixture(scope="module")
def mla_ggufs(tmp):
    """Tiny V3 (split attn_k_b / attn_v_b, Q8_0 where rows allow; sizes chosen so that
    tp column windows of attn_output, ffn_down and the experts' down cut Q8_0 blocks)
    and V2-Lite (attn_kv_b whole, no q LoRA, softmax routing) converted as llama.cpp does."""
    from tests.fixtures import tiny_deepseek_gguf as tdg
    from tests.fixtures import tiny_models
    out = {}
    for kind, form, over in (("v3", "split", {"v_head_dim": 16, "moe_intermediate_size": 64,
                                              "intermediate_size": 96}),
                             ("v2-lite", "kv_b", None)):
        hf = tmp / f"mla-{kind}-hf"
        tiny_models.write_model(kind, str(hf), overrides=over)
        out[kind] = tmp / f"mla-{kind}.gguf"
        tdg.convert(hf, out[kind], kv_form=form, dtype="Q8_0")
    return out


@pytest.mark.parametrize("kind", ["v3", "v2-lite"])
@pytest.mark.parametrize("tp,pp,ep", MLA_LAYOUTS)
def test_deepseek_gguf(tmp, mla_ggufs, kind, tp, pp, ep):
    g = mla_facts(mla_ggufs[kind])
    path, inv = cpu_inventory(tmp, "cpu1", 1)
    W = tp * pp * ep
    rc, doc = plan([path] * W, mla_ggufs[kind], "--tp", str(tp), "--pp", str(pp), "--ep", str(ep))
    assert rc == 0 and doc["model"]["model_type"] == "deepseek2"
    assert (doc["model"]["layers"], doc["model"]["routed_experts"]) == (g["L"], g["E"])
    assert doc["kv"]["bytes_per_token_layer"] == (g["lora"] + g["rope"]) * KV_ELEM
    assert doc["fp8_dequant"] is None
    check_gguf_plan(doc, [inv] * W, tp, pp, ep, lambda r: mla_rank(g, tp, pp, ep, r)[::2],
                    sum(b for b, _, _ in g["tensors"].values()), min(g["ctx"], 4096))
    for r, k in enumerate(doc["ranks"]):
        e0, ec = split_range(g["E"], ep, r % (tp * ep) // tp)
        assert tuple(k["experts"]) == (e0, e0 + ec)


@needs_plan_check
@pytest.mark.parametrize("tp,pp,ep", [(4, 1, 1), (2, 1, 2), (1, 2, 1)])
def test_deepseek_gguf_bytes_are_what_the_engine_loads(tmp, mla_ggufs, tp, pp, ep):
    """deepseek.c counts its weight windows (the f32 ones included) and keeps the 1-D
    tensors as f32 copies beside them: the plan's bytes less those are its count."""
    g = mla_facts(mla_ggufs["v3"])
    path, _ = cpu_inventory(tmp, "cpu1", 1)
    rc, doc = plan([path] * (tp * pp * ep), mla_ggufs["v3"], "--tp", str(tp), "--pp", str(pp),
                   "--ep", str(ep))
    assert rc == 0
    vecs = [mla_rank(g, tp, pp, ep, r)[1] for r in range(tp * pp * ep)]
    assert [k["memory"]["weights"] - v for k, v in zip(doc["ranks"], vecs)] == \
        plan_check_bytes(mla_ggufs["v3"], tp, pp, ep)


def test_gguf_refusals(tmp):
    """What the engine would refuse at load is refused by name."""
    import gguf
    path, _ = cpu_inventory(tmp, "cpu1", 1)
    cases = []
    bad = tmp / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    cases.append((bad, "GGUF version 0"))
    nosuffix = tmp / "model-gguf-bin"
    nosuffix.write_bytes(b"GGUF" + bytes(64))
    cases.append((nosuffix, ".gguf suffix"))
    qwen = tmp / "qwen.gguf"
    wr = gguf.GGUFWriter(str(qwen), "qwen2")
    wr.add_tensor("token_embd.weight", bytes_to_f32(8, 4))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    cases.append((qwen, 'general.architecture "qwen2"'))
    from tests.fixtures import tiny_llama
    _, c, w = tiny_llama.write_hf(tmp / "tl-missing-hf")
    del w["model.layers.1.self_attn.k_proj.weight"]
    cases.append((tiny_llama.write_gguf(tmp / "tl-missing.gguf", c, w), "blk.1.attn_k.weight is missing"))
    _, c, w = tiny_llama.write_hf(tmp / "tl-shape-hf")
    w["model.layers.0.mlp.up_proj.weight"] = w["model.layers.0.mlp.up_proj.weight"][:64]
    cases.append((tiny_llama.write_gguf(tmp / "tl-shape.gguf", c, w), "blk.0.ffn_up.weight is [64 x 64]"))
    for model, word in cases:
        r = run_plan("--inventory", str(path), "--model", str(model))
        assert r.returncode == 2, (model, r.stdout, r.stderr)
        assert word in r.stderr, (model, r.stderr)
        assert str(model) in r.stderr


def bytes_to_f32(rows, cols):
    import numpy as np
    return np.zeros((rows, cols), dtype=np.float32)


# ---- refusals ------------------------------------------------------------------------------

def run_plan(*args):
    return subprocess.run([binary("dsagent"), "plan", *args], capture_output=True, text=True,
                          timeout=30, cwd=ROOT)


def test_bad_flags_and_files_exit_2(tmp):
    path, _ = discover(tmp, "8xH100-80GB:nvswitch", "h100", "flags")
    m = model_dir(tmp, "v3", V3)
    gguf = tmp / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    bad_inv = tmp / "bad.json"
    bad_inv.write_text("{not json")
    cases = [
        (["--model", str(m)], "--inventory"),
        (["--inventory", str(path)], "--model"),
        (["--inventory", str(tmp / "missing.json"), "--model", str(m)], "missing.json"),
        (["--inventory", str(bad_inv), "--model", str(m)], "bad.json"),
        (["--inventory", str(path), "--model", str(tmp / "nomodel")], "nomodel"),
        (["--inventory", str(path), "--model", str(gguf)], "GGUF version 0"),
        (["--inventory", str(path), "--model", str(m), "--tp", "x"], "--tp"),
        (["--inventory", str(path), "--model", str(m), "--tp", "3"], "--tp"),
        (["--inventory", str(path), "--model", str(m), "--mem-fraction", "1.5"], "--mem-fraction"),
        (["--inventory", str(path), "--model", str(m), "--max-ctx", "999999999"], "max_position"),
        (["--inventory", str(path), "--model", str(m), "--bogus"], "--bogus"),
        (["--inventory", str(path), "--inventory", str(path), "--model", str(m), "--tp", "16"],
         "span nodes"),
        (["--addr", "10.0.0.1", "--inventory", str(path), "--model", str(m)], "--addr"),
    ]
    for args, word in cases:
        r = run_plan(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert word in r.stderr, (args, r.stderr)
    r = run_plan("--help")
    assert r.returncode == 0 and "--inventory" in r.stdout
