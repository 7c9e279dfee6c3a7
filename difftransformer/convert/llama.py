"""Llama / Mistral / Qwen2 → DIFF (docs/convert.md): exact V2 upcycling, and two V1 initialisations.

V2 (exact): every query head ``j`` becomes heads ``2j, 2j+1``, ``lambda_proj = 0`` (λ = 0.5), ``o_proj = 2·Wo``.

V1, ``v1_init="pair"`` (docs/convert.md, needs an even ``num_key_value_heads``): q, k, v unchanged, so adjacent source
heads become the two maps of one differential head; ``o_proj`` column blocks move to the V1 head layout. Not
function-preserving.

V1, ``v1_init="duplicate"`` (any head layout): with ``Hq`` query heads, ``Hkv`` KV heads, ``n = Hq / Hkv``, the result
has ``2·Hq`` query heads and ``2·Hkv`` KV heads of the same width ``d`` (``H = Hq`` differential heads in ``G = Hkv``
groups). Query row block ``(2g + c)·n + r`` ← source query head ``g·n + r`` and KV head ``2g + c`` ← source KV head
``g``, for both maps ``c``: the two maps of head ``h`` are identical, ``A1 − λA2 = (1 − λ)A``, and with
``V = [v_g; v_g]`` the head computes ``(1 − λ)[o_h; o_h]``, ``o_h`` the source head's output. The per-head norm makes
that ``(1 − λinit)·[o_h; o_h]/rms(o_h)`` (the ``(1 − λ)`` cancels; with eps, ``rms`` becomes
``sqrt(rms² + eps/(1 − λ)²)``). Each half of head ``h``'s ``o_proj`` columns is the source's ``Wo`` block of head ``h``
times ``s_{l,h}/2``, ``s_{l,h} = sqrt(ρ_{l,h}² + eps/(1 − λ_l)²) / (1 − λinit(l))``: the output equals the source's
exactly for every token whose head output has ``rms(o_h) = ρ_{l,h}``. ``ρ`` is calibrated
(:func:`calibrate_v1_output_scales`): the mean over calibration tokens of the per-token rms, which minimises the
squared error of that one-scalar approximation.
"""

from __future__ import annotations

import re

import torch
from transformers import AutoModelForCausalLM

from ..configuration_difftransformer import POSITIVE_INT_FIELDS, DiffTransformerConfig
from ..modeling_difftransformer import DiffTransformerForCausalLM, lambda_init_fn
from .engine import (
    DROPPABLE_BUFFER,
    ConversionError,
    Plan,
    Step,
    attention_prefix,
    common_steps,
    copy_of,
    expand_heads,
    meta_shapes,
    rows_of,
    shared_fields,
    tied_lm_head_shapes,
)

LLAMA_STYLE_MODEL_TYPES = ("llama", "mistral", "qwen2")
V1_INITS = ("auto", "pair", "duplicate")
V1_CALIBRATIONS = ("auto", "corpus", "random", "none")
# Calibration input: a few thousand tokens are enough for one mean per layer and head.
CALIBRATION_SEQUENCES = 4
CALIBRATION_LENGTH = 256
# duplicate: a layer's λ vectors are redrawn while 1 − λ < LAMBDA_MARGIN·(1 − λinit) (see _draw_lambdas).
LAMBDA_MARGIN = 0.5
_LAMBDA_NAMES = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def check_source_fields(src) -> None:
    """Every field of a Llama-style source config that the conversion reads, checked before any model is built: a
    ``ValueError`` naming the field (the caller adds the file). Without it a negative head count reaches torch as a
    tensor of negative size. ``src`` is a config object, or a ``SimpleNamespace`` of the raw config.json (checked
    before transformers' own config class divides by a zero head count)."""
    for name in POSITIVE_INT_FIELDS:
        value = getattr(src, name, None)
        if value is None and name in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            continue  # optional in Llama-style configs: derived from the other fields
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    eps = getattr(src, "rms_norm_eps", None)
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0):
        raise ValueError(f"`rms_norm_eps` must be a positive number, got {eps!r}.")
    hq = src.num_attention_heads
    if getattr(src, "head_dim", None) is None and src.hidden_size % hq:
        raise ValueError(
            f"`hidden_size` ({src.hidden_size}) must be divisible by `num_attention_heads` ({hq}) when `head_dim` is "
            "not set."
        )
    hq, hkv, head_dim = _head_counts(src)
    if head_dim % 2:
        raise ValueError(f"`head_dim` must be even (rotary embeddings rotate pairs of features), got {head_dim}.")
    if hq % hkv:
        raise ValueError(f"`num_attention_heads` ({hq}) must be a multiple of `num_key_value_heads` ({hkv}).")


def _head_counts(src) -> tuple[int, int, int]:
    hq = src.num_attention_heads
    hkv = getattr(src, "num_key_value_heads", None) or hq
    head_dim = getattr(src, "head_dim", None) or src.hidden_size // hq
    return hq, hkv, head_dim


def resolve_v1_init(src, v1_init: str = "auto") -> str:
    """``"pair"`` or ``"duplicate"``: ``"auto"`` takes ``"pair"`` when ``num_key_value_heads`` is even, else
    duplicates."""
    if v1_init not in V1_INITS:
        raise ConversionError(f"--v1-init {v1_init!r}; allowed: {list(V1_INITS)}.")
    if v1_init != "auto":
        return v1_init
    return "pair" if _head_counts(src)[1] % 2 == 0 else "duplicate"


def _llama_notes(src) -> list[str]:
    notes = []
    layer_types = getattr(src, "layer_types", None) or []
    sliding = getattr(src, "sliding_window", None)
    uses_window = sliding is not None and (
        src.model_type == "mistral" or "sliding_attention" in layer_types or getattr(src, "use_sliding_window", False)
    )
    if uses_window and sliding < src.max_position_embeddings:
        notes.append(
            f"The source uses sliding-window attention (sliding_window={sliding}); difftransformer attends to the "
            f"whole context, so outputs match only for sequences of at most {sliding} tokens."
        )
    return notes


def config_from_llama(
    src,
    diff_version: int,
    source_shapes: dict[str, tuple] | None = None,
    v1_init: str = "auto",
    v1_subln_eps: float | None = None,
) -> DiffTransformerConfig:
    """Llama-style config → ours. V2 doubles the query heads (docs/convert.md); V1 ``pair`` keeps every count, V1
    ``duplicate`` doubles both query and KV heads. ``v1_subln_eps``: V1's per-head norm eps (default: the source's
    ``rms_norm_eps``)."""
    if src.model_type not in LLAMA_STYLE_MODEL_TYPES:
        raise ConversionError(
            f"--from llama expects a Llama-style causal LM; config.json has model_type {src.model_type!r}, "
            f"supported: {list(LLAMA_STYLE_MODEL_TYPES)}."
        )
    if diff_version not in (1, 2):
        raise ConversionError(f"--diff-version must be 1 or 2 for --from llama, got {diff_version!r}.")
    check_source_fields(src)
    hq, hkv, head_dim = _head_counts(src)
    if getattr(src, "attention_dropout", 0.0) not in (None, 0, 0.0):
        raise ConversionError(
            f"attention_dropout={src.attention_dropout}: difftransformer defines no attention dropout; set it to 0."
        )
    method = resolve_v1_init(src, v1_init) if diff_version == 1 else None
    if method == "pair" and hkv % 2:
        raise ConversionError(
            "Llama → V1 with --v1-init pair needs an even num_key_value_heads (each V1 KV group holds two key and two "
            f"value heads); the source has {hkv}. Use --v1-init duplicate (or auto), or --diff-version 2, which is "
            "exact for every head count."
        )
    # Qwen2 has q/k/v biases but no o_proj bias; our attention_bias covers all four, o_proj's is then zero.
    has_bias = (
        any(k.endswith("self_attn.q_proj.bias") for k in source_shapes)
        if source_shapes
        else bool(getattr(src, "attention_bias", False))
    )
    return DiffTransformerConfig(
        **shared_fields(src),
        num_attention_heads=hq if method == "pair" else 2 * hq,
        num_key_value_heads=2 * hkv if method == "duplicate" else hkv,
        head_dim=head_dim,
        attention_bias=has_bias,
        mlp_bias=bool(getattr(src, "mlp_bias", False)),
        diff_version=diff_version,
        # V1: by default the per-head norm gets the model's eps, so that the result can also be exported to DiffLlama
        # exactly. A large eps makes the norm near-linear at the start (docs/convert.md, "Llama-style → DIFF V1
        # (approximate upcycling)", on --v1-subln-eps). V2 has no per-head norm: the field keeps its default there.
        **({"subln_eps": src.rms_norm_eps if v1_subln_eps is None else v1_subln_eps} if diff_version == 1 else {}),
    )


def _layer_lambda_init(config: DiffTransformerConfig, layer: int) -> float:
    return config.lambda_init if config.lambda_init is not None else lambda_init_fn(layer)


def _lambda_of(vectors: dict[str, torch.Tensor], lambda_init: float) -> float:
    """λ as the V1 module computes it: ``exp(λq1·λk1) − exp(λq2·λk2) + λinit`` in float32."""
    q1, k1, q2, k2 = (vectors[name].float() for name in _LAMBDA_NAMES)
    return (torch.exp(torch.dot(q1, k1)) - torch.exp(torch.dot(q2, k2)) + lambda_init).item()


def _draw_lambdas(
    seed: int, layer: int, d: int, std: float, lambda_init: float | None = None
) -> dict[str, torch.Tensor]:
    """λ vectors ``N(0, std)`` from a generator seeded per layer.

    With ``lambda_init`` given (the duplicate method), draws are repeated from the same generator while
    ``1 − λ < LAMBDA_MARGIN·(1 − λinit)``: at ``λ = 1`` the head output ``(1 − λ)[o; o]`` vanishes and the per-head norm
    divides by (almost) zero, and beyond it the sign flips; training would start on that singularity.
    """
    gen = torch.Generator().manual_seed(seed * 100_003 + layer)
    for _ in range(1000):
        vectors = {name: torch.randn(d, generator=gen) * std for name in _LAMBDA_NAMES}
        if lambda_init is None or 1 - _lambda_of(vectors, lambda_init) >= LAMBDA_MARGIN * (1 - lambda_init):
            return vectors
    raise ConversionError(
        f"Layer {layer}: no λ vectors with 1 − λ ≥ {LAMBDA_MARGIN}·(1 − λinit) in 1000 draws of N(0, {std}); lower "
        "lambda_std."
    )


def v1_output_scales(rho: torch.Tensor, lam: float, lambda_init: float, eps: float) -> torch.Tensor:
    """``s = sqrt(ρ² + eps/(1 − λ)²) / (1 − λinit)`` per head: with it, a duplicated head whose output has
    ``rms(o_h) = ρ`` reproduces the source exactly (module docstring)."""
    rho = rho.double()
    return torch.sqrt(rho**2 + eps / (1 - lam) ** 2) / (1 - lambda_init)


def _duplicate_o_proj(weight: torch.Tensor, scales: torch.Tensor, d: int) -> torch.Tensor:
    """Source ``Wo`` ``(E, Hq·d)`` → ours ``(E, Hq·2d)``: both halves of head ``h`` are the source block times
    ``s_h/2``."""
    blocks = weight.double().unflatten(1, (-1, d)) * (scales.double()[:, None] / 2)  # (E, Hq, d)
    return torch.stack([blocks, blocks], dim=2).flatten(1).to(torch.promote_types(weight.dtype, torch.float32))


def plan_from_llama(
    src,
    diff_version: int,
    seed: int = 0,
    v1_init: str = "auto",
    v1_output_rms: torch.Tensor | None = None,
    v1_subln_eps: float | None = None,
) -> Plan:
    """Llama → V2 (exact) or V1 (``pair`` or ``duplicate``), docs/convert.md.

    ``v1_output_rms``: for ``duplicate``, ``ρ`` of shape ``(num_hidden_layers, num_attention_heads)`` (from
    :func:`calibrate_v1_output_scales`); ``None`` takes ``ρ = 1`` (uncalibrated).
    """
    check_source_fields(src)
    source_shapes = {k: v for k, v in meta_shapes(AutoModelForCausalLM, src).items()}
    config = config_from_llama(src, diff_version, source_shapes, v1_init, v1_subln_eps)
    method = resolve_v1_init(src, v1_init) if diff_version == 1 else None
    target_shapes = meta_shapes(DiffTransformerForCausalLM, config)
    hq, hkv, d = _head_counts(src)
    E = config.hidden_size
    if method == "duplicate":
        rho = (
            torch.ones(config.num_hidden_layers, hq)
            if v1_output_rms is None
            else torch.as_tensor(v1_output_rms).detach().cpu()
        )
        if tuple(rho.shape) != (config.num_hidden_layers, hq) or not (torch.isfinite(rho).all() and (rho > 0).all()):
            raise ConversionError(
                f"v1_output_rms must be a positive finite tensor of shape (num_hidden_layers, num_attention_heads) = "
                f"{(config.num_hidden_layers, hq)}; got shape {tuple(rho.shape)}."
            )
    steps = common_steps(target_shapes)
    src_bias = config.attention_bias
    src_o_bias = any(k.endswith("self_attn.o_proj.bias") for k in source_shapes)
    kinds = ("weight", "bias") if src_bias else ("weight",)
    scales = []
    for layer in range(config.num_hidden_layers):
        p = attention_prefix(layer)
        kv_rows = None  # k and v copied unchanged
        if diff_version == 2:
            # Query head j → heads 2j, 2j+1; λ = sigmoid(0) = 0.5, so o_h = a_j − 0.5·a_j and o_proj doubles.
            q_rows = expand_heads(torch.arange(hq).repeat_interleave(2), d)
            for kind in kinds:
                steps.append(Step(f"{p}q_proj.{kind}", (f"{p}q_proj.{kind}",), rows_of(f"{p}q_proj.{kind}", q_rows)))
            steps.append(
                Step(f"{p}o_proj.weight", (f"{p}o_proj.weight",), lambda get, k=f"{p}o_proj.weight": get(k) * 2)
            )
            steps.append(Step(p + "lambda_proj.weight", (), lambda get: torch.zeros(config.num_diff_heads, E)))
        elif method == "pair":
            # Source query head i = (2g + c)·n + r becomes map c of head h = g·n + r (same key and value head);
            # its o_proj column block moves to half c of head h. Not function-preserving (docs/convert.md).
            G = config.num_kv_groups
            n = config.num_diff_heads // G
            cols = expand_heads(_v1_output_blocks(G, n), d)
            for kind in kinds:
                steps.append(Step(f"{p}q_proj.{kind}", (f"{p}q_proj.{kind}",), copy_of(f"{p}q_proj.{kind}")))
            steps.append(
                Step(
                    f"{p}o_proj.weight",
                    (f"{p}o_proj.weight",),
                    lambda get, k=f"{p}o_proj.weight", c=cols: get(k).index_select(1, c),
                )
            )
            lambdas = _draw_lambdas(seed, layer, d, config.lambda_std)
            for name, value in lambdas.items():
                steps.append(Step(p + name, (), lambda get, v=value: v, keep_float32=True))
            steps.append(Step(p + "subln.weight", (), lambda get: torch.ones(2 * d)))
        else:  # duplicate
            n = hq // hkv
            q_rows = expand_heads(torch.tensor([g * n + r for g in range(hkv) for c in range(2) for r in range(n)]), d)
            kv_rows = expand_heads(torch.arange(hkv).repeat_interleave(2), d)
            for kind in kinds:
                steps.append(Step(f"{p}q_proj.{kind}", (f"{p}q_proj.{kind}",), rows_of(f"{p}q_proj.{kind}", q_rows)))
            lambda_init = _layer_lambda_init(config, layer)
            lambdas = _draw_lambdas(seed, layer, d, config.lambda_std, lambda_init)
            scale = v1_output_scales(rho[layer], _lambda_of(lambdas, lambda_init), lambda_init, config.subln_eps)
            scales.append(scale)
            steps.append(
                Step(
                    f"{p}o_proj.weight",
                    (f"{p}o_proj.weight",),
                    lambda get, k=f"{p}o_proj.weight", s=scale: _duplicate_o_proj(get(k), s, d),
                )
            )
            for name, value in lambdas.items():
                steps.append(Step(p + name, (), lambda get, v=value: v, keep_float32=True))
            steps.append(Step(p + "subln.weight", (), lambda get: torch.ones(2 * d)))
        for proj in ("k_proj", "v_proj"):
            for kind in kinds:
                key = f"{p}{proj}.{kind}"
                steps.append(Step(key, (key,), copy_of(key) if kv_rows is None else rows_of(key, kv_rows)))
        if src_bias:
            if src_o_bias:
                steps.append(Step(f"{p}o_proj.bias", (f"{p}o_proj.bias",), copy_of(f"{p}o_proj.bias")))
            else:
                steps.append(Step(f"{p}o_proj.bias", (), lambda get: torch.zeros(E)))
    optional = tied_lm_head_shapes(config, E)
    for key in list(source_shapes):
        if DROPPABLE_BUFFER.search(key):
            optional[key] = source_shapes.pop(key)
    plan = Plan(source_shapes, optional, steps, config, target_shapes, exact=diff_version == 2, notes=_llama_notes(src))
    if method is not None:
        plan.info["v1_init"] = method
    if method == "pair":
        plan.notes.append(
            "Llama → V1 upcycling is approximate (docs/convert.md): the result computes a different function and needs "
            "continued training before use."
        )
    elif method == "duplicate":
        plan.info["v1_output_rms"] = rho
        plan.info["v1_output_scales"] = torch.stack(scales)
        plan.notes.append(
            "Llama → V1 by duplication (--v1-init duplicate): every query head and every KV head is duplicated into "
            f"the two maps of a differential head, so num_attention_heads {hq} → {2 * hq} and num_key_value_heads "
            f"{hkv} → {2 * hkv}: the KV cache per token doubles ({2 * hkv * d} instead of {hkv * d} values per layer "
            "for keys, as many for values). The result equals the source wherever a head's output has the calibrated "
            "rms; elsewhere it is approximate (see docs/convert.md) and continued training is advised."
        )
    return plan


def _v1_output_blocks(num_groups: int, n: int) -> torch.Tensor:
    """Our o_proj column blocks are ordered (h, c) with h = g·n + r; the query heads feeding them are (g, c, r).

    Returns, for every output block in (h, c) order, the position of its query head in (g, c, r) order."""
    return torch.tensor([(2 * g + c) * n + r for g in range(num_groups) for r in range(n) for c in range(2)])


# ----------------------------------------------------------------------------------------------------------------
# Calibration of the duplicate method's o_proj scales
# ----------------------------------------------------------------------------------------------------------------

_O_PROJ = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.o_proj$")


@torch.no_grad()
def calibrate_v1_output_scales(
    source_model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``ρ`` of shape ``(num_hidden_layers, num_attention_heads)``: for every layer and query head of a Llama-style
    model, the mean over tokens of the per-token rms (over the head's ``d`` features) of the head's attention output,
    the input of ``o_proj``. It is the scalar minimising ``Σ_t (rms_t − ρ)²``, hence the squared error of
    approximating ``o_t`` by ``ρ·o_t/rms(o_t)``. Padding tokens (``attention_mask == 0``) are left out.

    The model runs one sequence at a time in eval mode (its training mode is restored); rms is computed in float32.
    """
    config = source_model.config
    hq, _, d = _head_counts(config)
    layers = {}
    for name, module in source_model.named_modules():
        match = _O_PROJ.search(name)
        if match:
            layers[int(match.group(1))] = module
    if sorted(layers) != list(range(config.num_hidden_layers)):
        raise ConversionError(
            f"calibrate_v1_output_scales: found o_proj modules for layers {sorted(layers)}, expected "
            f"0..{config.num_hidden_layers - 1}."
        )
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    sums = torch.zeros(config.num_hidden_layers, hq, dtype=torch.float64)
    counts = torch.zeros(config.num_hidden_layers, dtype=torch.float64)
    current_mask = {}

    def hook_for(layer):
        def hook(module, args):
            rms = args[0].float().unflatten(-1, (hq, d)).pow(2).mean(-1).sqrt()  # (B, T, Hq)
            keep = current_mask["mask"].to(rms.device).bool()
            sums[layer] += rms[keep].double().sum(0).cpu()
            counts[layer] += keep.sum().item()

        return hook

    handles = [module.register_forward_pre_hook(hook_for(layer)) for layer, module in layers.items()]
    was_training = source_model.training
    source_model.eval()
    device = next(source_model.parameters()).device
    try:
        for row in range(input_ids.shape[0]):
            current_mask["mask"] = attention_mask[row : row + 1]
            source_model(
                input_ids=input_ids[row : row + 1].to(device),
                attention_mask=attention_mask[row : row + 1].to(device),
                use_cache=False,
            )
    finally:
        for handle in handles:
            handle.remove()
        source_model.train(was_training)
    if (counts == 0).any():
        raise ConversionError(
            "calibrate_v1_output_scales: no calibration token reached every layer (empty input or all padding)."
        )
    return (sums / counts[:, None]).float()


def calibration_input_ids(
    vocab_size: int,
    max_length: int | None = None,
    tokenizer=None,
    seed: int = 0,
    sequences: int = CALIBRATION_SEQUENCES,
    length: int = CALIBRATION_LENGTH,
) -> tuple[torch.Tensor, str]:
    """Calibration input ``(sequences, length)`` and a description of it.

    With a tokenizer: consecutive tokens of the embedded corpus's training split (``difftransformer.research.data``), so
    the held-out validation split stays unseen. Without one: random token ids from a generator seeded with ``seed``.
    """
    if max_length:
        length = min(length, max_length)
    needed = sequences * length
    if tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(
            vocab_size, (sequences, length), generator=gen
        ), f"{sequences}×{length} random token ids (seed {seed})"
    from ..data import corpus_texts

    text = "\n".join(corpus_texts("train", max_chars=16 * needed))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    rows = min(sequences, len(ids) // length)
    if rows == 0:
        raise ConversionError(
            f"Calibration: the corpus slice gave only {len(ids)} tokens, fewer than one sequence of {length}."
        )
    ids = torch.tensor(ids[: rows * length]).view(rows, length)
    if int(ids.max()) >= vocab_size:
        raise ConversionError(
            f"Calibration: the tokenizer gives token id {int(ids.max())}, beyond the model's vocab_size {vocab_size}."
        )
    return ids, f"{rows}×{length} tokens of the embedded corpus (train split) through the source's tokenizer"


def describe_output_rms(rho: torch.Tensor) -> str:
    return f"ρ per layer and head: mean {rho.mean().item():.4g}, min {rho.min().item():.4g}, max {rho.max().item():.4g}"


__all__ = [
    "LLAMA_STYLE_MODEL_TYPES",
    "V1_CALIBRATIONS",
    "V1_INITS",
    "calibrate_v1_output_scales",
    "calibration_input_ids",
    "config_from_llama",
    "plan_from_llama",
    "resolve_v1_init",
    "v1_output_scales",
]
