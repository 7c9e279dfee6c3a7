"""Shared test helpers: tiny configs and an explicit float64 implementation of SPEC §1–§3.

The reference is deliberately written differently from the model: a Python loop over differential heads,
materialised softmaxes, and head indices computed from the SPEC §3 row order (no repeat_kv, no packing, no
zero-padded queries), straight from the state dict.
"""

import math

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from difftransformer import DiffTransformerConfig

# Shapes of every call the "contract_sdpa" attention function received: a test that selects it asserts that the
# model really went through it (so the contract checks below cannot pass by not running).
CONTRACT_CALLS: list[tuple] = []


def _contract_sdpa(module, query, key, value, attention_mask, **kwargs):
    """The flash-attention contract, asserted on every call: equal q/k/v head sizes, whole GQA groups, k/v alike;
    then transformers' sdpa does the work. Registered as ``attn_implementation="contract_sdpa"``."""
    assert query.shape[-1] == key.shape[-1] == value.shape[-1], (query.shape, key.shape, value.shape)
    assert key.shape == value.shape, (key.shape, value.shape)
    assert query.shape[1] % key.shape[1] == 0 and query.shape[1] // key.shape[1] == module.num_key_value_groups
    assert query.shape[-1] <= 256  # flash kernels' largest head size
    CONTRACT_CALLS.append((tuple(query.shape), tuple(key.shape)))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("contract_sdpa", _contract_sdpa)
AttentionMaskInterface.register("contract_sdpa", sdpa_mask)

# (diff_version, num_attention_heads, num_key_value_heads): MHA and GQA (n > 1) for both versions.
LAYOUTS = {
    "v1_mha": (1, 8, 8),  # H=4, G=4, n=1
    "v1_gqa": (1, 8, 4),  # H=4, G=2, n=2
    "v1_gqa4": (1, 8, 2),  # H=4, G=1, n=4
    "v2_mha": (2, 8, 4),  # H=4, G=4, n=1
    "v2_gqa": (2, 8, 2),  # H=4, G=2, n=2
}


def tiny_config(layout="v1_gqa", **overrides) -> DiffTransformerConfig:
    version, hq, hkv = LAYOUTS[layout]
    kwargs = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=8,
        diff_version=version,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    return DiffTransformerConfig(**kwargs)


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, positions, theta):
    # x: (T, d) one head; rotate-half convention (transformers' Llama).
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    rot = torch.cat([-x[:, d // 2 :], x[:, : d // 2]], -1)
    return x * cos + rot * sin


def reference_attention(sd, prefix, cfg, x, positions, allowed, layer_idx):
    """SPEC §1 (V1) / §2 (V2) for one sequence. x: (T, E) float64; allowed: (T, S=T) bool.

    Returns (output (T, E), differential maps (H, T, T), lambda (scalar or (T, H)))."""
    d, H = cfg.head_dim, cfg.num_attention_heads // 2
    G = cfg.num_key_value_heads // 2 if cfg.diff_version == 1 else cfg.num_key_value_heads
    n = H // G
    theta = cfg.rope_parameters["rope_theta"]
    W = lambda name: sd[prefix + name].double()  # noqa: E731
    q_all = (x @ W("q_proj.weight").T).view(x.shape[0], -1, d)
    k_all = (x @ W("k_proj.weight").T).view(x.shape[0], -1, d)
    v_all = (x @ W("v_proj.weight").T).view(x.shape[0], -1, d)
    q_head = lambda i: _rope(q_all[:, i], positions, theta)  # noqa: E731
    k_head = lambda j: _rope(k_all[:, j], positions, theta)  # noqa: E731

    def softmax_map(qi, kj):
        s = q_head(qi) @ k_head(kj).T / math.sqrt(d)
        s = s.masked_fill(~allowed, float("-inf"))
        return torch.softmax(s, dim=-1)

    outs, maps = [], []
    if cfg.diff_version == 1:
        lam_init = cfg.lambda_init if cfg.lambda_init is not None else 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
        lam = (
            torch.exp((W("lambda_q1") * W("lambda_k1")).sum())
            - torch.exp((W("lambda_q2") * W("lambda_k2")).sum())
            + lam_init
        )
        for h in range(H):
            g, r = divmod(h, n)
            a1 = softmax_map((2 * g + 0) * n + r, 2 * g + 0)
            a2 = softmax_map((2 * g + 1) * n + r, 2 * g + 1)
            value = torch.cat([v_all[:, 2 * g], v_all[:, 2 * g + 1]], dim=-1)  # (S, 2d), half 0 first
            diff = a1 - lam * a2
            o = _rms(diff @ value, W("subln.weight"), cfg.subln_eps) * (1 - lam_init)
            outs.append(o)
            maps.append(diff)
    else:
        lam = torch.sigmoid(x @ W("lambda_proj.weight").T)  # (T, H)
        for h in range(H):
            g = h // n
            a1, a2 = softmax_map(2 * h, g), softmax_map(2 * h + 1, g)
            diff = a1 - lam[:, h : h + 1] * a2
            outs.append(diff @ v_all[:, g])
            maps.append(diff)
    out = torch.cat(outs, dim=-1) @ W("o_proj.weight").T
    return out, torch.stack(maps), lam


def reference_forward(model, input_ids, attention_mask=None, position_ids=None):
    """Float64 logits (B, T, V) and per-layer differential maps of a DiffTransformerForCausalLM, from its state dict."""
    cfg = model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    B, T = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones(B, T, dtype=torch.long)
    if position_ids is None:
        position_ids = torch.arange(T).expand(B, T)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    logits, all_maps = [], []
    for b in range(B):
        allowed = causal & attention_mask[b].bool()[None, :]
        allowed = allowed | torch.eye(T, dtype=torch.bool)  # keep fully padded query rows finite (never compared)
        x = sd["model.embed_tokens.weight"].double()[input_ids[b]]
        maps_b = []
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            h = _rms(x, sd[p + "input_layernorm.weight"].double(), cfg.rms_norm_eps)
            attn, maps, _ = reference_attention(sd, p + "self_attn.", cfg, h, position_ids[b], allowed, layer)
            maps_b.append(maps)
            x = x + attn
            h = _rms(x, sd[p + "post_attention_layernorm.weight"].double(), cfg.rms_norm_eps)
            gate, up = h @ sd[p + "mlp.gate_proj.weight"].double().T, h @ sd[p + "mlp.up_proj.weight"].double().T
            x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].double().T
        x = _rms(x, sd["model.norm.weight"].double(), cfg.rms_norm_eps)
        logits.append(x @ sd["lm_head.weight"].double().T)
        all_maps.append(maps_b)
    maps = [torch.stack([all_maps[b][layer] for b in range(B)]) for layer in range(cfg.num_hidden_layers)]
    return torch.stack(logits), maps


def left_padded_batch(vocab_size, lengths, seed=0, pad_token_id=0):
    """Random prompts of the given lengths, left padded: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, length in enumerate(lengths):
        ids[b, T - length :] = torch.randint(3, vocab_size, (length,), generator=g)
        mask[b, T - length :] = 1
    return ids, mask


def randomize_norms(model, seed=0):
    """Non-trivial RMSNorm / subln weights so that the reference test sees them (they initialise to ones)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight") or "subln" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return model
