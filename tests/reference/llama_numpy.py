"""Independent float64 forward pass of the llama-family graph (tests only),
from the Hugging Face weights: RMSNorm, GQA attention with half-split RoPE
(rotate_half), SwiGLU MLP, causal mask, optional tied embeddings.  With
kv_f16 the keys (after RoPE) and values are rounded to IEEE halves, as an
f16 KV cache stores them."""
import numpy as np


def rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope_half(x, pos, theta):
    """x [T, H, d]: pairs (i, i + d/2) rotated by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def forward(cfg, w, ids, kv_f16=False):
    w = {k: v.astype(np.float64) for k, v in w.items()}
    d, h, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, T = d // h, cfg["rms_norm_eps"], len(ids)
    pos = np.arange(T, dtype=np.float64)
    x = w["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        u = rmsnorm(x, w[p + "input_layernorm.weight"], eps)
        q = (u @ w[p + "self_attn.q_proj.weight"].T).reshape(T, h, hd)
        k = (u @ w[p + "self_attn.k_proj.weight"].T).reshape(T, kv, hd)
        v = (u @ w[p + "self_attn.v_proj.weight"].T).reshape(T, kv, hd)
        q, k = rope_half(q, pos, cfg["rope_theta"]), rope_half(k, pos, cfg["rope_theta"])
        if kv_f16:
            k, v = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)
        o = np.zeros((T, h, hd))
        for i in range(h):
            j = i // (h // kv)
            s = q[:, i] @ k[:, j].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, i] = (s / s.sum(-1, keepdims=True)) @ v[:, j]
        x = x + o.reshape(T, h * hd) @ w[p + "self_attn.o_proj.weight"].T
        u = rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = u @ w[p + "mlp.gate_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (u @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = rmsnorm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T
