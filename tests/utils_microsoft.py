"""Microsoft's DIFF Transformer layout for the converter's tests: an independent float64 model in that layout and
random full-model state dicts with their config.json.

The reference re-implements Microsoft's layout from its description (microsoft/unilm
``Diff-Transformer/multihead_diffattn.py``, ``multihead_flashdiff_1.py``, ``Diff-Transformer-V2/
multihead_flashdiffv2.py``): interleaved (GPT-J) rotary, query heads ordered (g, r, c) with the two maps of a head
adjacent, ``out_proj``, λ and ``subln`` as in the paper, and Llama blocks around attention. It shares no code with
the converter or the model.
"""

import json
import math

import torch
from safetensors.torch import save_file

VOCAB, E, LAYERS, FFN, THETA, EPS = 61, 32, 2, 64, 10000.0, 1e-6


# ---------------------------------------------------------------- float64 reference in Microsoft's layout


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotary_interleaved(x, theta):
    """x: (T, heads, d). Pairs (2i, 2i+1) rotate by angle t·theta^(-2i/d) (flash_attn's interleaved=True)."""
    T, _, d = x.shape
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def causal_softmax(q, k, d):
    T = q.shape[0]
    scores = (q @ k.T) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1)


def ms_attention_v1(sd, p, x, H, G, layer, naive):
    """MultiheadFlashDiff1/2 (naive=False) or MultiheadDiffAttn (naive=True) on one sequence x: (T, E)."""
    T = x.shape[0]
    d = E // H // 2
    n = H // G
    q = rotary_interleaved((x @ sd[p + "q_proj.weight"].T).view(T, 2 * H, d), THETA)
    k = rotary_interleaved((x @ sd[p + "k_proj.weight"].T).view(T, 2 * G, d), THETA)
    v = (x @ sd[p + "v_proj.weight"].T).view(T, G, 2 * d)
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * layer)
    lam = (
        torch.exp(torch.dot(sd[p + "lambda_q1"], sd[p + "lambda_k1"]))
        - torch.exp(torch.dot(sd[p + "lambda_q2"], sd[p + "lambda_k2"]))
        + lam_init
    )
    w = sd.get(p + "subln.weight", torch.ones(2 * d, dtype=torch.float64))
    heads = []
    for h in range(H):
        maps = []
        for c in range(2):
            qi = 2 * h + c  # their query rows: head h's two maps adjacent
            # flash files: map c of head h reads key c of group h // n; the naive file repeats 2G key heads over
            # 2H query heads, so query head i reads key head i // n.
            kj = (h // n) * 2 + c if not naive else qi // n
            maps.append(causal_softmax(q[:, qi], k[:, kj], d))
        o = (maps[0] - lam * maps[1]) @ v[:, h // n]
        heads.append(rms(o, w, 1e-5) * (1 - lam_init))
    return torch.cat(heads, -1) @ sd[p + "out_proj.weight"].T


def ms_attention_v2(sd, p, x, H, G, d):
    """MultiheadFlashDiffV2: 2H query heads, GQA over G heads, o_h = a_2h − sigmoid(x Wλ)_h · a_2h+1."""
    T = x.shape[0]
    q = rotary_interleaved((x @ sd[p + "q_proj.weight"].T).view(T, 2 * H, d), THETA)
    k = rotary_interleaved((x @ sd[p + "k_proj.weight"].T).view(T, G, d), THETA)
    v = (x @ sd[p + "v_proj.weight"].T).view(T, G, d)
    rep = 2 * H // G
    a = torch.stack(
        [causal_softmax(q[:, j], k[:, j // rep], d) @ v[:, j // rep] for j in range(2 * H)], 1
    )  # (T, 2H, d)
    lam = torch.sigmoid(x @ sd[p + "lambda_proj.weight"].T)  # (T, H)
    o = a[:, 0::2] - lam[..., None] * a[:, 1::2]
    return o.reshape(T, H * d) @ sd[p + "o_proj.weight"].T


def ms_model_logits(sd, ids, version, H, G, naive=False, d=None, tied=False, eps=EPS):
    sd = {k: v.double() for k, v in sd.items()}
    x = sd["model.embed_tokens.weight"][ids]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        h = rms(x, sd[p + "input_layernorm.weight"], eps)
        a = p + "self_attn."
        x = x + (ms_attention_v1(sd, a, h, H, G, layer, naive) if version == 1 else ms_attention_v2(sd, a, h, H, G, d))
        h = rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        mlp = torch.nn.functional.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ sd[p + "mlp.down_proj.weight"].T
    x = rms(x, sd["model.norm.weight"], eps)
    return x @ (sd["model.embed_tokens.weight"] if tied else sd["lm_head.weight"]).T


# ---------------------------------------------------------------- random Microsoft-format checkpoints


def ms_state_dict(version, H, G, d=None, seed=0, tied=False):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, std=0.2: torch.randn(*shape, generator=g) * std  # noqa: E731
    sd = {"model.embed_tokens.weight": rnd(VOCAB, E, std=1.0), "model.norm.weight": 1 + rnd(E, std=0.1)}
    if not tied:
        sd["lm_head.weight"] = rnd(VOCAB, E)
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        sd[p + "input_layernorm.weight"] = 1 + rnd(E, std=0.1)
        sd[p + "post_attention_layernorm.weight"] = 1 + rnd(E, std=0.1)
        sd[p + "mlp.gate_proj.weight"] = rnd(FFN, E)
        sd[p + "mlp.up_proj.weight"] = rnd(FFN, E)
        sd[p + "mlp.down_proj.weight"] = rnd(E, FFN)
        a = p + "self_attn."
        if version == 1:
            hd = E // H // 2
            sd[a + "q_proj.weight"] = rnd(E, E, std=0.4)
            sd[a + "k_proj.weight"] = rnd(2 * G * hd, E, std=0.4)
            sd[a + "v_proj.weight"] = rnd(2 * G * hd, E)
            sd[a + "out_proj.weight"] = rnd(E, E)
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                sd[a + name] = rnd(hd, std=0.4)
            sd[a + "subln.weight"] = 1 + rnd(2 * hd, std=0.2)
        else:
            sd[a + "q_proj.weight"] = rnd(2 * H * d, E, std=0.4)
            sd[a + "k_proj.weight"] = rnd(G * d, E, std=0.4)
            sd[a + "v_proj.weight"] = rnd(G * d, E)
            sd[a + "o_proj.weight"] = rnd(E, H * d)
            sd[a + "lambda_proj.weight"] = rnd(H, E, std=0.5)
    return sd


def ms_config(H, G, d=None, module=None, tied=False):
    cfg = {
        "vocab_size": VOCAB,
        "hidden_size": E,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_heads": H,
        "num_kv_heads": G,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 64,
    }
    if d is not None:
        cfg["head_dim"] = d
    if module is not None:
        cfg["attention_module"] = module
    return cfg


def write_source(folder, sd, cfg):
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder
