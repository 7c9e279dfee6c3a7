"""Independent plain-torch re-implementation of Motif Technologies' published forward (Motif-2.6B: DIFF V1 attention;
Motif-2-12.7B: grouped differential attention, GDA), for use as a test oracle.

Nothing here imports ``difftransformer``: the code was written from the math of the public sources below, on purpose
loop-simple (one Python loop over batch rows and heads, one explicit softmax per map) so that it can be read against
those sources line by line. It runs in any float dtype; float64 is the default for oracle use.

Public API
----------
- ``motif_config(kind, **overrides)``: a config dict in Motif's ``config.json`` format. ``kind`` is ``"2.6b"`` or
  ``"12.7b"`` (the released shapes; see "Real configs" below for what is verified), ``"tiny"`` / ``"tiny-mha"``
  (DIFF V1, r = 1, MHA), ``"tiny-gqa"`` (DIFF V1, r = 1, two query pairs per KV pair) or ``"tiny-gda"`` (GDA, r = 4).
- ``random_motif_checkpoint(config, seed, dtype)``: random weights in Motif's exact key layout and shapes.
- ``motif_state_dict_shapes(config)``: the expected key -> shape map.
- ``motif_forward(config, state_dict, input_ids, attention_mask=None, dtype=torch.float64)``: logits (B, T, vocab).
- ``polynorm(x, weight, bias, eps=1e-6)``, ``rms_norm``, ``lambda_init``, ``motif_head_layout``,
  ``differential_attention_core`` (the attention after RoPE, on tensors), ``gda_as_diff_v1`` (the published GDA ->
  plain r = 1 rewrite by duplicating noise query rows).

Sources (read from stored copies of the public repositories; "commit" is the version that was read)
---------------------------------------------------------------------------------------------------
[V-M]  vllm-project/vllm ``vllm/model_executor/models/motif.py`` (added by PR #23414 "New model support for
       Motif-1-Tiny", removed by PR #25866), read at commit 130dd6e8e3cefbe27a3eda92f6aa4fca7650cdeb. Header:
       "Adapted from https://huggingface.co/Motif-Technologies/Motif-2.6B/blob/main/modeling_motif.py".
[V-B]  vllm-project/vllm ``vllm/attention/backends/differential_flash_attn.py`` (PR #20702, removed by PR #25351),
       read at commit 03f861174cf622c3c2c418fc6b048c30167bda49 (class ``DifferentialFlashAttentionImpl``).
[F-M]  MotifTechnologies/vllm ``vllm/model_executor/models/motif.py`` at 477e4d791899562c067d89c788beaf603f682529
       (the GDA-capable model; upstream re-submission: vLLM PR #27396 "Re-support MotifForCausalLM", closed).
[F-B]  MotifTechnologies/vllm ``vllm/v1/attention/backends/grouped_diff_attn.py`` at
       2b73efaca4faed921844ccddae6dae3413558cc9 (class ``GroupedDifferentialAttentionImpl``).
[V-L]  vllm-project/vllm ``vllm/model_executor/layers/layernorm.py`` class ``PolyNorm`` (``forward_native``) and
       ``RMSNorm`` (the norms [V-M]/[F-M] instantiate).
[MLX]  junhoyeo/mlx-motif ``src/mlx_motif/model.py`` at 04fb0f8f1700a96bb682aaac68d216addb116540, fixtures
       ``tests/fixtures/motif_parity_cases.json`` and ``swift/Tests/MotifKitTests/Fixtures/motif_golden_config.json`` at
       05f28ea58fb28ebb93f7e55f7732221eeab99533, ``README.md`` (shapes measured on the real 12.7B weights).
[HF]   Motif's Hugging Face remote code (``modeling_motif.py``) itself is not stored in any corpus reachable here; only
       (a) the diff excerpt of Motif-2.6B commit cfa11bc ("Update modeling_motif.py", lines 409-443:
       ``self.num_key_value_heads //= 2``; ``self.n_rep = self.num_heads // self.num_key_value_heads``;
       ``q_proj = Linear(hidden, hidden)``; ``k_proj = Linear(hidden, hidden // n_rep)``) and (b) a verbatim copy of its
       ``PolyNorm`` (third-party file citing ``Motif-2.6B/blob/main/modeling_motif.py#L26``) were readable.

Every detail and the source it follows
--------------------------------------
1. Half-head counting [V-M, F-M, HF(a), MLX]: ``num_attention_heads`` (Hq) counts query *half-heads* of width
   ``head_dim`` (d) and ``num_key_value_heads`` (Hkv) counts key/value half-heads. ``head_dim`` defaults to
   ``hidden_size // num_attention_heads`` [V-M, F-M]; [F-M] requires it explicitly when ``num_noise_heads`` is set.
2. Noise heads [F-M]: ``num_noise_heads`` (Hn) defaults to ``num_attention_heads / 2`` (``safe_half``) when absent
   (Motif-2.6B). Signal heads Hs = Hq - Hn, ratio r = Hs / Hn (Motif-2-12.7B: 32 / 8 = 4).
3. Query row order [F-B ``split_q_heads``; V-B ``split_heads``]: the Hq query half-heads form Hn groups of r + 1
   consecutive half-heads, ``[signal x r, noise]``; signal j of group g is Q1 head g*r + j, the noise of group g is Q2
   head g. For r = 1 this is [V-B]'s ``"... (H two) D -> ... H two D"``: half-head 2h is map 1 of head h, 2h + 1 map 2.
4. Keys and values [V-B, F-B ``split_heads``]: ``"(H two)"`` as well: even half-heads 0, 2, 4 ... are K1 / V1, odd ones
   K2 / V2, Hkv / 2 heads each. ``k_ratio`` (12.7B config) is ignored by [F-M, F-B]; [MLX] generalises keys to groups of
   ``[K1 x k_ratio, K2]``, which equals the even/odd split for k_ratio = 1, the only published value. This module
   rejects k_ratio != 1.
5. Four standard causal attentions with flash-attention's GQA rule (query head i reads KV head i // (Hq' / Hk')) and
   scale d^-0.5 [V-B, F-B]: Q1 (Hs heads) over K1 (Hkv/2 heads) with values V1 and with V2; Q2 (Hn heads) over K2 with
   V1 and with V2. Signal output ``[A1 V1 ; A1 V2]`` (width 2d), noise output ``[A2 V1 ; A2 V2]``; the noise outputs
   are repeated r times (``repeat "... H D -> ... (H r) D"``) so signal head i subtracts noise head i // r [F-B].
   [F-B] asserts Hs % (Hkv/2) == 0 and Hn % (Hkv/2) == 0; so does ``motif_head_layout``.
6. lambda [V-B, F-B]: ``lambda = exp(sum(lambda_q1 * lambda_k1)) - exp(sum(lambda_q2 * lambda_k2)) + lambda_init``, one
   scalar per layer from four vectors of length d (float32 parameters initialised N(0, 0.1) [V-M, F-M]). The sources
   compute each exp in float32 and cast it to the activation dtype (``.type_as(q)``) before the subtraction; here all
   of it is in the forward dtype.
7. lambda_init [V-M, F-M, MLX]: ``0.8 - 0.6 * exp(-0.3 * (layer_index - 1))`` with the 0-based layer index
   (``extract_layer_index``): one layer later than the paper's schedule; layer 0 gets 0.8 - 0.6 e^0.3 = -0.00992.
8. Per-head norm [V-M, F-M, V-B, F-B]: ``subln = RMSNorm(2 * head_dim, eps=config.attn_rms_norm_eps)`` with a learnable
   weight of length 2d (shared by all heads), applied to each signal head's ``signal - lambda * noise`` (width 2d),
   then ``* (1 - lambda_init)``.
9. Output layout [V-B, F-B]: ``"... H (two D) -> ... (H two) D"`` then flattened: signal head i owns ``o_proj`` input
   columns [2 i d, 2 i d + 2 d), the V1 half first. ``o_proj`` input width is 2 * Hs * d [F-M] (= Hq * d when r = 1
   [V-M]).
10. RoPE [V-M, F-M ``is_neox_style = True``, ``rotary_dim = head_dim``; MLX ``traditional=False``]: NeoX / rotate-half
    over the full d, ``base = rope_theta``, applied to every query and key half-head before the split. Only
    ``rope_scaling = None`` is implemented (a non-null value raises).
11. MLP [V-M, F-M, MLX]: ``down_proj(PolyNorm(gate_proj(x)) * up_proj(x))``; ``hidden_act`` must be ``"poly_norm"``
    (the ports raise otherwise). Checkpoint keys are separate ``gate_proj`` / ``up_proj`` (vLLM merges them into
    ``gate_up_proj`` at load time through Llama's stacked-parameter mapping).
12. PolyNorm [V-L, HF(b), MLX]: over the last dimension, computed in float32 in the sources (cast back afterwards),
    ``w0 N(x^3) + w1 N(x^2) + w2 N(x) + b``, ``N(z) = z / sqrt(mean(z^2) + eps)``, ``weight`` shape [3] (init 1/3),
    ``bias`` shape [1] (init 0), eps = 1e-6 fixed (the constructor default; no config field feeds it).
    Test vectors: [MLX] ``motif_parity_cases.json`` "polynorm_reference_2x3" and ``motif_golden_config.json``.
13. Norms and residuals [V-M, F-M: Llama's fused add-norm; MLX spelled out]: ``h = x + attn(input_layernorm(x))``;
    ``out = h + mlp(post_attention_layernorm(h))``; final ``model.norm``; all three RMSNorms use ``rms_norm_eps``.
    RMSNorm: normalise in (at least) float32, cast back, multiply by the weight.
14. Head [V-M, F-M inherit ``LlamaForCausalLM``; MLX]: ``lm_head.weight`` unless ``tie_word_embeddings``, in which
    case logits use ``model.embed_tokens.weight`` and the checkpoint has no ``lm_head.weight``. No embedding scaling.
15. Biases [V-M, F-M]: ``attention_bias = config.attention_bias or config.use_bias`` gives q/k/v/o biases (``o_proj``
    follows it; ``qkv_bias``, when present, overrides q/k/v only); ``use_bias`` gives the three MLP biases. The
    released configs use ``use_bias = false`` (per [MLX] fixtures); biases are implemented but untested against any
    real checkpoint.
16. Sliding windows [V-M, F-M: ``sliding_window = None`` hard-coded]: ``use_sliding_window`` / ``sliding_window`` /
    ``max_window_layers`` are ignored, as in both vLLM ports. ``fused_rope`` and ``expanded`` (seen in [MLX] fixtures)
    change no math and are ignored.
17. Padding (not in the vLLM sources, which pack sequences): an optional ``attention_mask`` (B, T) of 1/0 for left
    padding masks padded keys and uses ``position_ids = cumsum(mask) - 1`` (the transformers convention). Logits at
    padded positions are meaningless.

Details easy to miss: (a) the sources cast lambda to the activation dtype before use (its exps are computed in
float32); (b) ``k_ratio`` is ignored by Motif's own vLLM code; [MLX] interprets it as a key-group width, identical for
k_ratio = 1; (c) ``o_proj`` gets a bias whenever attention bias is on [V-M, F-M].

Real configs
------------
Motif's config.json files themselves were not reachable (no stored copy of the Hugging Face repos). What is verified:
12.7B: hidden 4096, 40 query half-heads, 16 KV half-heads, 8 noise heads, head_dim 128 (q/k/v out 5120 + 2048 + 2048 =
9216), o_proj in 8192, intermediate 16384 ([MLX] README's measured shapes, its fixtures); k_ratio 1, rms_norm_eps 1e-6,
attn_rms_norm_eps 1e-5, use_bias false, hidden_act poly_norm ([MLX] golden fixture). 2.6B: 16 query half-heads, head_dim
= hidden / 16 ([MLX] docstring: "orig 16, halved -> 8 effective heads"), hidden 2048, intermediate 8192 ([MLX] golden
fixture). INFERRED, not read: 12.7B 40 layers (fixture) and vocab 219520 with untied embeddings (the only combination
of the fixture shapes that gives 12.70 B parameters); 2.6B 32 layers, 16 KV half-heads (MHA), vocab 219520, tied
embeddings (gives 2.597 B); rope_theta, max_position_embeddings. ``UNVERIFIED_FIELDS`` lists them per kind.
"""

from __future__ import annotations

import copy
import math

import torch

# --------------------------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------------------------

_COMMON = {
    "architectures": ["MotifForCausalLM"],
    "model_type": "Motif",
    "hidden_act": "poly_norm",
    "rms_norm_eps": 1e-6,
    "attn_rms_norm_eps": 1e-5,
    "rope_scaling": None,
    "use_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}

_KINDS = {
    # Motif-Technologies/Motif-2.6B: DIFF V1 (r = 1), MHA.
    "2.6b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 219520,
        "max_position_embeddings": 16384,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    # Motif-Technologies/Motif-2-12.7B: GDA, 8 groups of 4 signal + 1 noise, 16 KV half-heads.
    "12.7b": {
        "hidden_size": 4096,
        "intermediate_size": 16384,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 16,
        "num_noise_heads": 8,
        "k_ratio": 1,
        "head_dim": 128,
        "vocab_size": 219520,
        "max_position_embeddings": 16384,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "tiny-mha": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 128,
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "tiny-gqa": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "vocab_size": 128,
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    # The 12.7B topology scaled down: 2 groups of 4 signal + 1 noise, 4 KV half-heads (K1 and K2 two heads each).
    "tiny-gda": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 10,
        "num_key_value_heads": 4,
        "num_noise_heads": 2,
        "k_ratio": 1,
        "head_dim": 16,
        "vocab_size": 128,
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
}
_KINDS["tiny"] = _KINDS["tiny-mha"]

# Fields of the released configs that were inferred (parameter-count arithmetic, fixtures), not read from config.json.
UNVERIFIED_FIELDS = {
    "2.6b": (
        "num_hidden_layers",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "rope_theta",
        "tie_word_embeddings",
        "rms_norm_eps",
        "attn_rms_norm_eps",
    ),
    "12.7b": ("num_hidden_layers", "vocab_size", "max_position_embeddings", "rope_theta", "tie_word_embeddings"),
}


def motif_config(kind: str = "tiny", **overrides) -> dict:
    """A config dict in Motif's config.json format. ``kind``: "2.6b", "12.7b", "tiny" (= "tiny-mha"), "tiny-gqa",
    "tiny-gda". ``overrides`` replace or add fields; an override of ``None`` removes the field (e.g.
    ``num_noise_heads=None`` to rely on its default)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(_KINDS)}")
    cfg = {**copy.deepcopy(_COMMON), **copy.deepcopy(_KINDS[kind])}
    for key, value in overrides.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    motif_head_layout(cfg)  # validate
    return cfg


def motif_head_layout(config: dict) -> dict:
    """Derived attention sizes (§1-§5 of the module docstring), validated the way [F-M]/[F-B] assert them."""
    hidden = int(config["hidden_size"])
    hq = int(config["num_attention_heads"])
    hkv = int(config.get("num_key_value_heads", hq))
    d = config.get("head_dim")
    d = int(d) if d is not None else hidden // hq
    if config.get("num_noise_heads") is not None:
        hn = int(config["num_noise_heads"])
    else:
        if hq % 2:
            raise ValueError(f"num_attention_heads={hq} must be even when num_noise_heads is absent")
        hn = hq // 2
    if config.get("k_ratio", 1) != 1:
        raise NotImplementedError(
            f"k_ratio={config['k_ratio']}: only k_ratio = 1 is published (and Motif's vLLM code ignores the field)"
        )
    hs = hq - hn
    if hn <= 0 or hs <= 0 or hs % hn:
        raise ValueError(
            f"num_attention_heads={hq}, num_noise_heads={hn}: signal heads {hs} must be a positive multiple of the "
            "noise heads"
        )
    if hkv % 2:
        raise ValueError(f"num_key_value_heads={hkv} must be even (K1/K2 and V1/V2 are its even/odd half-heads)")
    g = hkv // 2
    if hs % g or hn % g:
        raise ValueError(f"signal heads {hs} and noise heads {hn} must both be multiples of num_key_value_heads/2={g}")
    if config.get("hidden_act", "poly_norm") != "poly_norm":
        raise NotImplementedError(f"hidden_act={config['hidden_act']!r}: Motif uses poly_norm")
    if config.get("rope_scaling") not in (None, {}):
        raise NotImplementedError(
            f"rope_scaling={config['rope_scaling']!r} is not implemented (the released models use none)"
        )
    return {
        "hidden": hidden,
        "d": d,
        "hq": hq,
        "hkv": hkv,
        "hn": hn,
        "hs": hs,
        "r": hs // hn,
        "kv_pairs": g,
        "signal_per_kv": hs // g,
        "noise_per_kv": hn // g,
    }


def _biases(config: dict) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, MLP bias), following [V-M]/[F-M] ``MotifDecoderLayer.__init__``."""
    attention_bias = bool(config.get("attention_bias", False) or config.get("use_bias", False))
    o_bias = attention_bias
    qkv_bias = bool(config["qkv_bias"]) if "qkv_bias" in config else attention_bias
    return qkv_bias, o_bias, bool(config.get("use_bias", False))


# --------------------------------------------------------------------------------------------------------------------
# Checkpoint layout and random weights
# --------------------------------------------------------------------------------------------------------------------


def motif_state_dict_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every key of a Motif checkpoint with its shape."""
    lay = motif_head_layout(config)
    e, d, i_size, vocab = lay["hidden"], lay["d"], int(config["intermediate_size"]), int(config["vocab_size"])
    qkv_bias, o_bias, mlp_bias = _biases(config)
    shapes = {"model.embed_tokens.weight": (vocab, e)}
    for layer in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (e,)
        shapes[p + "self_attn.q_proj.weight"] = (lay["hq"] * d, e)
        shapes[p + "self_attn.k_proj.weight"] = (lay["hkv"] * d, e)
        shapes[p + "self_attn.v_proj.weight"] = (lay["hkv"] * d, e)
        shapes[p + "self_attn.o_proj.weight"] = (e, 2 * lay["hs"] * d)
        if qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (lay["hq"] * d,)
            shapes[p + "self_attn.k_proj.bias"] = (lay["hkv"] * d,)
            shapes[p + "self_attn.v_proj.bias"] = (lay["hkv"] * d,)
        if o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (e,)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            shapes[p + f"self_attn.{name}"] = (d,)
        shapes[p + "self_attn.subln.weight"] = (2 * d,)
        shapes[p + "post_attention_layernorm.weight"] = (e,)
        shapes[p + "mlp.gate_proj.weight"] = (i_size, e)
        shapes[p + "mlp.up_proj.weight"] = (i_size, e)
        shapes[p + "mlp.down_proj.weight"] = (e, i_size)
        if mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (i_size,)
            shapes[p + "mlp.up_proj.bias"] = (i_size,)
            shapes[p + "mlp.down_proj.bias"] = (e,)
        shapes[p + "mlp.act_fn.weight"] = (3,)
        shapes[p + "mlp.act_fn.bias"] = (1,)
    shapes["model.norm.weight"] = (e,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, e)
    return shapes


def parameter_count(kind: str, **overrides) -> int:
    """The parameters of a Motif checkpoint of ``kind`` (with ``overrides``), from its key shapes: how
    docs/reports/2026-11-26-motif-sources.md infers the released models' vocabularies, layer counts and tying."""
    return sum(math.prod(shape) for shape in motif_state_dict_shapes(motif_config(kind, **overrides)).values())


def random_motif_checkpoint(
    config: dict, seed: int = 0, dtype: torch.dtype = torch.float32, lambda_std: float = 0.25
) -> dict[str, torch.Tensor]:
    """Random weights in Motif's exact key layout, scaled so every stage carries O(1) activations and the logits have a
    spread of a few units (not a near-uniform distribution): projections N(0, 1/fan_in); embeddings N(0, 1) (untied)
    or N(0, 9/hidden) (tied, so logits stay O(3)); lm_head N(0, 9/hidden); norm weights 1 + N(0, 0.1^2) and subln
    likewise (so a swapped or ignored weight shows); PolyNorm weight 1/3 + N(0, 0.1^2), bias N(0, 0.05^2); biases
    N(0, 0.02^2). The lambda vectors are N(0, lambda_std^2): Motif initialises them N(0, 0.1^2); the default 0.25 makes
    lambda depart measurably from lambda_init so that a wrong lambda formula shows."""
    gen = torch.Generator().manual_seed(seed)
    e = int(config["hidden_size"])
    tied = bool(config.get("tie_word_embeddings", False))
    out = {}
    for key, shape in motif_state_dict_shapes(config).items():
        leaf = key.rsplit(".", 2)
        if key == "model.embed_tokens.weight":
            std, base = (3.0 / math.sqrt(e) if tied else 1.0), 0.0
        elif key == "lm_head.weight":
            std, base = 3.0 / math.sqrt(e), 0.0
        elif "lambda_" in key:
            std, base = lambda_std, 0.0
        elif key.endswith("act_fn.weight"):
            std, base = 0.1, 1.0 / 3.0
        elif key.endswith("act_fn.bias"):
            std, base = 0.05, 0.0
        elif key.endswith("norm.weight") or key.endswith("subln.weight"):
            std, base = 0.1, 1.0
        elif leaf[-1] == "bias":
            std, base = 0.02, 0.0
        else:  # a Linear weight (out, in)
            std, base = 1.0 / math.sqrt(shape[1]), 0.0
        out[key] = torch.empty(shape, dtype=torch.float32).normal_(base, std, generator=gen).to(dtype)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def polynorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Motif's PolyNorm over the last dimension (§12): w0 N(x^3) + w1 N(x^2) + w2 N(x) + b with
    N(z) = z / sqrt(mean(z^2) + eps), computed in float32 (float64 for float64 input), returned in x's dtype."""
    cd = _compute_dtype(x.dtype)
    xf = x.to(cd)
    w = weight.to(cd)
    b = bias.to(cd)

    def norm(z):
        return z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + eps)

    y = w[0] * norm(xf**3) + w[1] * norm(xf**2) + w[2] * norm(xf) + b
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: normalise in float32 (float64 for float64), cast back, times the weight."""
    cd = _compute_dtype(x.dtype)
    xf = x.to(cd)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight.to(x.dtype)


def lambda_init(layer_index: int) -> float:
    """§7: Motif's schedule, with the 0-based layer index shifted by one relative to the paper."""
    return 0.8 - 0.6 * math.exp(-0.3 * (layer_index - 1))


def _linear(x, weight, bias=None):
    y = x @ weight.t()
    return y + bias if bias is not None else y


def _rope_cos_sin(position_ids: torch.Tensor, d: int, theta: float, dtype: torch.dtype):
    """NeoX RoPE tables (B, T, d), computed in float64 and cast."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = position_ids.to(torch.float64)[..., None] * inv_freq  # (B, T, d/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, d); rotate-half over the full head width (§10)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _softmax_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float):
    """One standard attention map for one head of one sequence: q (T, d), k (S, d), v (S, d), allowed (T, S) bool."""
    scores = (q @ k.t()) * scale
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    return probs @ v


def differential_attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor | float,
    lam_init: float,
    subln_weight: torch.Tensor,
    eps: float,
    layout: dict,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Motif's attention after RoPE (§3-§9), written as explicit loops.

    q (B, Hq, T, d), k and v (B, Hkv, S, d) in checkpoint half-head order; ``allowed`` (B, T, S) bool (default:
    causal with the queries aligned to the last T keys). Returns (B, T, 2 * Hs * d), the ``o_proj`` input.
    """
    bsz, _, t, d = q.shape
    s = k.shape[2]
    r, hn, hs = layout["r"], layout["hn"], layout["hs"]
    if allowed is None:
        allowed = torch.ones(t, s, dtype=torch.bool).tril(s - t)[None].expand(bsz, t, s)
    scale = d**-0.5
    out = q.new_zeros(bsz, t, 2 * hs * d)
    for b in range(bsz):
        # noise outputs, one per noise head (Q2 head g is query half-head g * (r + 1) + r)
        noise = []
        for g in range(hn):
            kv = g // layout["noise_per_kv"]  # flash GQA rule over the Hkv/2 K2 heads
            q2 = q[b, g * (r + 1) + r]
            k2, v1, v2 = k[b, 2 * kv + 1], v[b, 2 * kv], v[b, 2 * kv + 1]
            noise.append(
                torch.cat(
                    [_softmax_attend(q2, k2, v1, allowed[b], scale), _softmax_attend(q2, k2, v2, allowed[b], scale)],
                    dim=-1,
                )
            )
        for i in range(hs):
            g, j = divmod(i, r)  # signal head i is signal j of group g; Q1 head i = query half-head g * (r + 1) + j
            kv = i // layout["signal_per_kv"]  # flash GQA rule over the Hkv/2 K1 heads
            q1 = q[b, g * (r + 1) + j]
            k1, v1, v2 = k[b, 2 * kv], v[b, 2 * kv], v[b, 2 * kv + 1]
            signal = torch.cat(
                [_softmax_attend(q1, k1, v1, allowed[b], scale), _softmax_attend(q1, k1, v2, allowed[b], scale)], dim=-1
            )
            head = rms_norm(signal - lam * noise[g], subln_weight, eps) * (1.0 - lam_init)
            out[b, :, 2 * i * d : 2 * (i + 1) * d] = head
    return out


# --------------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------------


def _attention_block(config, layout, sd, prefix, layer, x, cos, sin, allowed):
    qkv_bias, o_bias, _ = _biases(config)
    bsz, t, _ = x.shape
    d = layout["d"]
    q = _linear(x, sd[prefix + "q_proj.weight"], sd.get(prefix + "q_proj.bias") if qkv_bias else None)
    k = _linear(x, sd[prefix + "k_proj.weight"], sd.get(prefix + "k_proj.bias") if qkv_bias else None)
    v = _linear(x, sd[prefix + "v_proj.weight"], sd.get(prefix + "v_proj.bias") if qkv_bias else None)
    q = q.view(bsz, t, layout["hq"], d).transpose(1, 2)
    k = k.view(bsz, t, layout["hkv"], d).transpose(1, 2)
    v = v.view(bsz, t, layout["hkv"], d).transpose(1, 2)
    q, k = _rope_neox(q, cos, sin), _rope_neox(k, cos, sin)
    lam_init = lambda_init(layer)
    lam = (
        torch.exp(torch.sum(sd[prefix + "lambda_q1"] * sd[prefix + "lambda_k1"]))
        - torch.exp(torch.sum(sd[prefix + "lambda_q2"] * sd[prefix + "lambda_k2"]))
        + lam_init
    )
    attn = differential_attention_core(
        q, k, v, lam, lam_init, sd[prefix + "subln.weight"], float(config["attn_rms_norm_eps"]), layout, allowed
    )
    return _linear(attn, sd[prefix + "o_proj.weight"], sd.get(prefix + "o_proj.bias") if o_bias else None)


def _mlp_block(config, sd, prefix, x):
    _, _, mlp_bias = _biases(config)
    gate = _linear(x, sd[prefix + "gate_proj.weight"], sd.get(prefix + "gate_proj.bias") if mlp_bias else None)
    up = _linear(x, sd[prefix + "up_proj.weight"], sd.get(prefix + "up_proj.bias") if mlp_bias else None)
    act = polynorm(gate, sd[prefix + "act_fn.weight"], sd[prefix + "act_fn.bias"])
    return _linear(act * up, sd[prefix + "down_proj.weight"], sd.get(prefix + "down_proj.bias") if mlp_bias else None)


@torch.no_grad()
def motif_forward(
    config: dict,
    state_dict: dict,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Logits (B, T, vocab) of Motif's forward (§13, §14) for ``input_ids`` (B, T), causal, computed in ``dtype``.

    ``attention_mask`` (B, T) of 1/0 supports left padding (§17). The state dict must have Motif's key names; extra
    keys (e.g. ``rotary_emb.inv_freq``) are ignored, missing ones raise KeyError.
    """
    layout = motif_head_layout(config)
    expected = motif_state_dict_shapes(config)
    sd = {}
    for key, shape in expected.items():
        tensor = state_dict[key]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{key}: shape {tuple(tensor.shape)}, expected {shape}")
        sd[key] = tensor.to(dtype)
    bsz, t = input_ids.shape
    if attention_mask is None:
        position_ids = torch.arange(t)[None].expand(bsz, t)
        key_ok = torch.ones(bsz, t, dtype=torch.bool)
    else:
        mask = attention_mask.to(torch.long)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        key_ok = mask.bool()
    allowed = torch.ones(t, t, dtype=torch.bool).tril()[None] & key_ok[:, None, :]
    cos, sin = _rope_cos_sin(position_ids, layout["d"], float(config["rope_theta"]), dtype)
    eps = float(config["rms_norm_eps"])

    h = sd["model.embed_tokens.weight"][input_ids]
    for layer in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{layer}."
        h = h + _attention_block(
            config,
            layout,
            sd,
            p + "self_attn.",
            layer,
            rms_norm(h, sd[p + "input_layernorm.weight"], eps),
            cos,
            sin,
            allowed,
        )
        h = h + _mlp_block(config, sd, p + "mlp.", rms_norm(h, sd[p + "post_attention_layernorm.weight"], eps))
    h = rms_norm(h, sd["model.norm.weight"], eps)
    head = sd["model.embed_tokens.weight"] if config.get("tie_word_embeddings", False) else sd["lm_head.weight"]
    return h @ head.t()


# --------------------------------------------------------------------------------------------------------------------
# GDA -> plain DIFF V1 (r = 1) by duplicating noise query rows
# --------------------------------------------------------------------------------------------------------------------


def gda_as_diff_v1(config: dict, state_dict: dict) -> tuple[dict, dict]:
    """The GDA model rewritten as an r = 1 Motif model computing the same function: each signal head i gets its own
    copy of its group's noise query rows, so the query half-heads become ``[signal i, noise i // r]`` pairs ("(H two)"
    order), ``num_attention_heads = 2 * Hs`` and ``num_noise_heads`` is dropped (default Hq / 2). K, V, o_proj, lambda,
    subln and everything else are unchanged. Costs r - 1 extra query rows per group."""
    lay = motif_head_layout(config)
    d, r = lay["d"], lay["r"]
    new_cfg = {k: v for k, v in config.items() if k not in ("num_noise_heads", "k_ratio")}
    new_cfg["num_attention_heads"] = 2 * lay["hs"]
    new_cfg["head_dim"] = d
    rows = []
    for i in range(lay["hs"]):
        g, j = divmod(i, r)
        rows += [g * (r + 1) + j, g * (r + 1) + r]
    index = torch.tensor([h * d + c for h in rows for c in range(d)])
    new_sd = dict(state_dict)
    for key in list(state_dict):
        if key.endswith("self_attn.q_proj.weight") or key.endswith("self_attn.q_proj.bias"):
            new_sd[key] = state_dict[key].index_select(0, index).clone()
    motif_head_layout(new_cfg)
    return new_cfg, new_sd
