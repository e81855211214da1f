"""Independent float64 numpy reference of the DeepSeek-V2/V3 forward pass.

Written straight from the design docs' deepseek_v3_spec.md (sections 3-5);
it shares no code with the C engine.  Tests only.

    forward(model_dir, token_ids) -> logits float64 [T, vocab]   (positions 0..T-1)
    load(model_dir) -> Model (cached);  Model.forward(ids, absorbed=False, quirks=None, stats=None)

Two attention paths:
  absorbed=False  the naive form (spec 3.2): materialised per-head K = [k_nope, rope(k_pe)]
                  and V for the whole prompt, one causal-masked softmax.
  absorbed=True   the latent form (spec 3.4), run token by token like a decoder: a
                  cache of (kv_a_layernorm(c), rope(k_pe)) per position, q_lat = W_UK^T q_nope,
                  u = sum_j p_j c_j, o = W_UV u.  No mask: each step sees only the cache.

`quirks` (class Quirks) deliberately re-creates the pitfalls of spec section 9; it is
used only by the self-check to prove the tiny models detect each of them.

`stats` (a dict) receives, per MoE layer, the selected experts and the routing
margin of every token (distance between the last selected and the first rejected
candidate, in the score that decides; the smaller of the group and expert
margins for grouped routing).  A comparison against a float32 engine is only
meaningful when those margins are well above the engine's rounding.
"""
import functools
import json
import math
import pathlib
import re
from dataclasses import dataclass

import numpy as np

try:
    from tests.fixtures import safetensors_io as st
except ImportError:  # run from inside tests/
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    from tests.fixtures import safetensors_io as st


@dataclass(frozen=True)
class Quirks:
    group_mask_value: float = -math.inf   # spec 9.3: 0.0 is the bug
    ignore_bias: bool = False             # spec 9.2: loader dropped e_score_correction_bias
    bias_in_weights: bool = False         # spec 9.2: weights from biased scores
    group_score_max: bool = False         # group score = max instead of sum of top-2
    no_softmax_mscale: bool = False       # spec 9.4a
    amp_one: bool = False                 # spec 9.4c (ratio replaced by 1)
    amp_mscale_only: bool = False         # spec 9.4c (m(F, mscale) instead of the ratio)
    use_max_pos: bool = False             # spec 9.4d
    no_yarn: bool = False                 # spec 9.4e
    rope_neox: bool = False               # spec 9.5
    norm_k_pe: bool = False               # spec 9.6: k_pe RMS-normalised like the latent


NO_QUIRKS = Quirks()


# ---------------------------------------------------------------- YaRN (spec 5)

def yarn_mscale(factor, mu):
    """m(F, mu) = 1 if F <= 1 else 0.1 * mu * ln F + 1."""
    return 1.0 if factor <= 1 else 0.1 * mu * math.log(factor) + 1.0


def yarn_correction_range(dim, base, L0, beta_fast, beta_slow):
    def corr(r):
        return dim * math.log(L0 / (2 * math.pi * r)) / (2 * math.log(base))
    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), dim - 1)
    return low, high


def yarn_inv_freq(dim, base, factor, L0, beta_fast=32, beta_slow=1):
    """inv_freq[i], i < dim/2: original frequency below `low`, divided by F above
    `high`, linear blend between (spec 5 steps 1-2)."""
    low, high = yarn_correction_range(dim, base, L0, beta_fast, beta_slow)
    if low == high:
        high += 0.001
    i = np.arange(dim // 2, dtype=np.float64)
    f = base ** (-2.0 * i / dim)
    ramp = np.clip((i - low) / (high - low), 0.0, 1.0)
    return f * (1.0 - ramp) + (f / factor) * ramp


def rope_params(cfg, quirks=NO_QUIRKS):
    """(inv_freq [dr/2], cos/sin amplitude, attention softmax scale) from config."""
    dr = cfg["qk_rope_head_dim"]
    dqk = cfg["qk_nope_head_dim"] + dr
    base = float(cfg.get("rope_theta", 10000))
    rs = cfg.get("rope_scaling")
    scale = dqk ** -0.5
    if not rs or quirks.no_yarn:
        return base ** (-2.0 * np.arange(dr // 2) / dr), 1.0, scale
    kind = rs.get("type", rs.get("rope_type"))
    if kind != "yarn":
        raise ValueError(f"rope_scaling type {kind!r} is not supported by the reference")
    F = float(rs["factor"])
    L0 = float(rs["original_max_position_embeddings"])
    if quirks.use_max_pos:
        L0 = float(cfg["max_position_embeddings"])
    inv = yarn_inv_freq(dr, base, F, L0, rs.get("beta_fast", 32), rs.get("beta_slow", 1))
    ms, msa = float(rs.get("mscale", 1.0)), float(rs.get("mscale_all_dim", 0.0))
    amp = yarn_mscale(F, ms) / yarn_mscale(F, msa)
    if quirks.amp_one:
        amp = 1.0
    if quirks.amp_mscale_only:
        amp = yarn_mscale(F, ms)
    if msa and not quirks.no_softmax_mscale:
        scale *= yarn_mscale(F, msa) ** 2
    return inv, amp, scale


def rope(x, pos, inv_freq, amp, neox=False):
    """Rotate the last axis of x (even length) for token positions pos.
    x: [T, ..., d], pos: [T].  Interleaved pairs (2i, 2i+1) (spec 3.3)."""
    d = x.shape[-1]
    th = np.asarray(pos, dtype=np.float64)[:, None] * inv_freq[None, :]   # [T, d/2]
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (d // 2,)
    c = (np.cos(th) * amp).reshape(shape)
    s = (np.sin(th) * amp).reshape(shape)
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    y = np.empty_like(x)
    y[..., 0::2] = a * c - b * s
    y[..., 1::2] = a * s + b * c
    return y


# ---------------------------------------------------------------- routing (spec 4)

def _topk(x, k):
    """Indices of the k largest along the last axis, ties to the lower index."""
    return np.argsort(-x, axis=-1, kind="stable")[..., :k]


def _gap(sorted_desc, k):
    """sorted_desc[k-1] - sorted_desc[k] (inf when nothing is rejected or the
    first rejected is -inf)."""
    if sorted_desc.shape[-1] <= k:
        return np.full(sorted_desc.shape[:-1], np.inf)
    g = sorted_desc[..., k - 1] - sorted_desc[..., k]
    return np.where(np.isfinite(g), g, np.inf)


def route_sigmoid_noaux(logits, bias, k, n_group, topk_group, norm_topk_prob,
                        routed_scaling_factor, quirks=NO_QUIRKS):
    """V3 routing (spec 4.1).  logits [T, E] -> (idx [T, k], w [T, k], margin [T])."""
    T, E = logits.shape
    s = 1.0 / (1.0 + np.exp(-logits))
    b = s + (0.0 if (bias is None or quirks.ignore_bias) else bias[None, :])
    gsz = E // n_group
    grouped = b.reshape(T, n_group, gsz)
    if quirks.group_score_max:
        gs = grouped.max(axis=-1)
    else:
        gs = -np.sort(-grouped, axis=-1)[..., :2].sum(axis=-1)
    keep = _topk(gs, topk_group)                                   # [T, topk_group]
    gmask = np.zeros((T, n_group), dtype=bool)
    np.put_along_axis(gmask, keep, True, axis=-1)
    emask = np.repeat(gmask, gsz, axis=-1)
    masked = np.where(emask, b, quirks.group_mask_value)
    idx = _topk(masked, k)
    w = np.take_along_axis(b if quirks.bias_in_weights else s, idx, axis=-1)
    if k > 1 and norm_topk_prob:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    w = w * routed_scaling_factor
    margin = _gap(-np.sort(-masked, axis=-1), k)
    if topk_group < n_group:
        margin = np.minimum(margin, _gap(-np.sort(-gs, axis=-1), topk_group))
    return idx, w, margin


def route_softmax(logits, k, topk_method, n_group, topk_group, norm_topk_prob,
                  routed_scaling_factor):
    """V2 routing (spec 4.2): softmax, greedy or group_limited_greedy, then
    renormalise (top_k > 1 and norm_topk_prob) else multiply by the factor."""
    T, E = logits.shape
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    margin = np.full(T, np.inf)
    if topk_method in ("greedy", "gready"):
        sel = p
    elif topk_method == "group_limited_greedy":
        gsz = E // n_group
        gs = p.reshape(T, n_group, gsz).max(axis=-1)
        keep = _topk(gs, topk_group)
        gmask = np.zeros((T, n_group), dtype=bool)
        np.put_along_axis(gmask, keep, True, axis=-1)
        sel = np.where(np.repeat(gmask, gsz, axis=-1), p, -np.inf)
        if topk_group < n_group:
            margin = _gap(-np.sort(-gs, axis=-1), topk_group)
    else:
        raise ValueError(f"topk_method {topk_method!r} with softmax scoring is not supported")
    idx = _topk(sel, k)
    w = np.take_along_axis(p, idx, axis=-1)
    if k > 1 and norm_topk_prob:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    else:
        w = w * routed_scaling_factor
    margin = np.minimum(margin, _gap(-np.sort(-sel, axis=-1), k))
    return idx, w, margin


# ---------------------------------------------------------------- model

def _silu(z):
    return z / (1.0 + np.exp(-z))


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Model:
    """Weights of one checkpoint, dequantized to float64, MTP layer dropped."""

    def __init__(self, model_dir):
        self.dir = pathlib.Path(model_dir)
        cfg = json.loads((self.dir / "config.json").read_text())
        self.cfg = cfg
        if cfg.get("model_type") not in ("deepseek_v2", "deepseek_v3"):
            raise ValueError(f"model_type {cfg.get('model_type')!r} is not DeepSeek V2/V3")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not silu")
        self.nl = cfg["num_hidden_layers"]
        qc = cfg.get("quantization_config") or {}
        block = tuple(qc.get("weight_block_size") or (128, 128))
        idx = self.dir / "model.safetensors.index.json"
        if idx.exists():
            wmap = json.loads(idx.read_text())["weight_map"]
            files = sorted(set(wmap.values()))
        else:
            files = ["model.safetensors"]
        raw = {}
        for f in files:
            part, _ = st.read_file(self.dir / f)
            raw.update(part)
        self.w = {}
        for name, t in raw.items():
            m = _LAYER.match(name)
            if m and int(m.group(1)) >= self.nl:
                continue  # MTP layer: not part of the plain forward (spec 3.1, 9.9)
            if name.endswith("_scale_inv"):
                continue
            if t.dtype == "F8_E4M3":
                s = raw[name + "_scale_inv"]
                self.w[name] = st.dequantize_blocks(t.data, s.to_float64(), block)
            else:
                self.w[name] = t.to_float64()

    def W(self, name, shape):
        w = self.w.get(name)
        if w is None:
            raise KeyError(f"{self.dir}: tensor {name} is missing")
        if w.shape != tuple(shape):
            raise ValueError(f"{name}: shape {list(w.shape)}, expected {list(shape)}")
        return w

    def rmsnorm(self, v, name):
        w = self.W(name, (v.shape[-1],))
        eps = self.cfg.get("rms_norm_eps", 1e-6)
        return w * v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)

    # -- attention (spec 3.2 / 3.4)
    def attention(self, L, u, pos, absorbed, quirks):
        c = self.cfg
        H, nh = c["hidden_size"], c["num_attention_heads"]
        dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        dc, qr = c["kv_lora_rank"], c.get("q_lora_rank")
        p = f"model.layers.{L}.self_attn."
        T = u.shape[0]
        if qr:
            cq = self.rmsnorm(u @ self.W(p + "q_a_proj.weight", (qr, H)).T,
                              p + "q_a_layernorm.weight")
            q = cq @ self.W(p + "q_b_proj.weight", (nh * (dn + dr), qr)).T
        else:
            q = u @ self.W(p + "q_proj.weight", (nh * (dn + dr), H)).T
        q = q.reshape(T, nh, dn + dr)
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        a = u @ self.W(p + "kv_a_proj_with_mqa.weight", (dc + dr, H)).T
        lat, k_pe = a[:, :dc], a[:, dc:]
        cn = self.rmsnorm(lat, p + "kv_a_layernorm.weight")
        if quirks.norm_k_pe:
            k_pe = k_pe / np.sqrt(np.mean(k_pe * k_pe, axis=-1, keepdims=True) + 1e-6)
        inv, amp, scale = rope_params(c, quirks)
        q_pe = rope(q_pe, pos, inv, amp, quirks.rope_neox)
        k_pe = rope(k_pe, pos, inv, amp, quirks.rope_neox)
        wkv = self.W(p + "kv_b_proj.weight", (nh * (dn + dv), dc)).reshape(nh, dn + dv, dc)
        if not absorbed:
            kv = np.einsum("hec,tc->the", wkv, cn)
            k_nope, v = kv[..., :dn], kv[..., dn:]
            Q = np.concatenate([q_nope, q_pe], axis=-1)                        # [T, nh, dqk]
            K = np.concatenate([k_nope, np.broadcast_to(k_pe[:, None, :], (T, nh, dr))],
                               axis=-1)
            s = scale * np.einsum("ihd,jhd->hij", Q, K)
            s = np.where(np.triu(np.ones((T, T), dtype=bool), 1)[None], -np.inf, s)
            s -= s.max(axis=-1, keepdims=True)
            pr = np.exp(s)
            pr /= pr.sum(axis=-1, keepdims=True)
            o = np.einsum("hij,jhd->ihd", pr, v)
        else:
            w_uk, w_uv = wkv[:, :dn, :], wkv[:, dn:, :]
            C = np.zeros((0, dc))
            P = np.zeros((0, dr))
            o = np.zeros((T, nh, dv))
            for t in range(T):  # one decode step per position, cache grows
                C = np.vstack([C, cn[t:t + 1]])
                P = np.vstack([P, k_pe[t:t + 1]])
                q_lat = np.einsum("hd,hdc->hc", q_nope[t], w_uk)              # [nh, dc]
                sc = scale * (q_lat @ C.T + q_pe[t] @ P.T)                   # [nh, t+1]
                sc -= sc.max(axis=-1, keepdims=True)
                pr = np.exp(sc)
                pr /= pr.sum(axis=-1, keepdims=True)
                ul = pr @ C                                                   # [nh, dc]
                o[t] = np.einsum("hc,hdc->hd", ul, w_uv)
        return o.reshape(T, nh * dv) @ self.W(p + "o_proj.weight", (H, nh * dv)).T

    # -- MLPs (spec 3.5 / 3.6)
    def mlp(self, prefix, u, width):
        H = self.cfg["hidden_size"]
        g = u @ self.W(prefix + "gate_proj.weight", (width, H)).T
        up = u @ self.W(prefix + "up_proj.weight", (width, H)).T
        return (_silu(g) * up) @ self.W(prefix + "down_proj.weight", (H, width)).T

    def is_moe(self, L):
        c = self.cfg
        return (c.get("n_routed_experts") and L >= c.get("first_k_dense_replace", 0)
                and L % c.get("moe_layer_freq", 1) == 0)

    def moe(self, L, u, quirks, stats):
        c = self.cfg
        H, E, Im = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
        k = c["num_experts_per_tok"]
        m = f"model.layers.{L}.mlp."
        logits = u @ self.W(m + "gate.weight", (E, H)).T
        scoring = c.get("scoring_func", "softmax")
        if scoring == "sigmoid":
            if c.get("topk_method") != "noaux_tc":
                raise ValueError(f"sigmoid scoring with topk_method {c.get('topk_method')!r}")
            bias = self.w.get(m + "gate.e_score_correction_bias")
            if bias is not None and bias.shape != (E,):
                raise ValueError(f"e_score_correction_bias shape {bias.shape}")
            idx, w, margin = route_sigmoid_noaux(
                logits, bias, k, c.get("n_group") or 1, c.get("topk_group") or 1,
                bool(c.get("norm_topk_prob")), float(c.get("routed_scaling_factor", 1.0)),
                quirks)
        elif scoring == "softmax":
            idx, w, margin = route_softmax(
                logits, k, c.get("topk_method", "greedy"), c.get("n_group") or 1,
                c.get("topk_group") or 1, bool(c.get("norm_topk_prob")),
                float(c.get("routed_scaling_factor", 1.0)))
        else:
            raise ValueError(f"scoring_func {scoring!r} is not supported")
        if stats is not None:
            stats.setdefault("experts", []).append(idx)
            stats.setdefault("weights", []).append(w)
            stats.setdefault("route_margin", []).append(margin)
        y = np.zeros_like(u)
        for e in range(E):
            tok, slot = np.nonzero(idx == e)
            if tok.size:
                y[tok] += w[tok, slot, None] * self.mlp(f"{m}experts.{e}.", u[tok], Im)
        ns = c.get("n_shared_experts") or 0
        if ns:
            y += self.mlp(m + "shared_experts.", u, ns * Im)
        return y

    # -- top level (spec 3.1)
    def forward(self, token_ids, absorbed=False, quirks=None, stats=None):
        quirks = quirks or NO_QUIRKS
        c = self.cfg
        V, H = c["vocab_size"], c["hidden_size"]
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("token_ids must be a non-empty 1-D sequence")
        if ids.min() < 0 or ids.max() >= V:
            raise ValueError(f"token id out of range [0, {V})")
        pos = np.arange(ids.size)
        x = self.W("model.embed_tokens.weight", (V, H))[ids]
        for L in range(self.nl):
            p = f"model.layers.{L}."
            x = x + self.attention(L, self.rmsnorm(x, p + "input_layernorm.weight"), pos,
                                   absorbed, quirks)
            u = self.rmsnorm(x, p + "post_attention_layernorm.weight")
            if self.is_moe(L):
                x = x + self.moe(L, u, quirks, stats)
            else:
                x = x + self.mlp(p + "mlp.", u, c["intermediate_size"])
        h = self.rmsnorm(x, "model.norm.weight")
        return h @ self.W("lm_head.weight", (V, H)).T


@functools.lru_cache(maxsize=8)
def _load(path):
    return Model(path)


def load(model_dir):
    return _load(str(pathlib.Path(model_dir).resolve()))


def forward(model_dir, token_ids, absorbed=False, quirks=None, stats=None):
    """logits float64 [len(token_ids), vocab_size] for positions 0..T-1."""
    return load(model_dir).forward(token_ids, absorbed=absorbed, quirks=quirks, stats=stats)
