"""Low-bit attention, an analysis option: quantise the attention logits, or q and k, inside any model's attention path.

The Differential Transformer paper (Ye et al., arXiv 2410.05258, §3.7) argues that differential attention has smaller
activation outliers than softmax attention, in its attention logits and its hidden states, and so keeps its accuracy
when the attention logits are quantised to few bits (it reports DIFF holding up from 16 down to 6 bits, where the
Transformer's accuracy drops, and 4-bit DIFF matching 6-bit Transformer). This module lets anyone measure that on any
model the package runs, ours (V1, V2) and standard transformers ones (Llama, ...), without touching a model file:

* :func:`low_bit_attention` (a context manager) switches a model to the attention function registered here under
  :data:`ATTN_IMPLEMENTATION` (transformers' ``AttentionInterface``; its mask is transformers' eager mask) and picks
  what it quantises: ``target="logits"`` (``q·kᵀ·scale`` before the mask and the softmax), ``target="qk"`` (the rotated
  queries and keys before their product) or ``None`` (nothing: the eager computation, for the unquantised baseline),
  with ``bits`` and ``granularity`` (``"tensor"``: one scale per sequence and layer; ``"head"``: one per sequence,
  layer and head — per softmax map for logits and queries, per key head for keys). A model that runs inside the
  block without its attention calling the function (attention that bypasses ``AttentionInterface``) makes the block
  raise, instead of passing unquantised results off as quantised.
* :func:`quantize_symmetric`: symmetric uniform fake quantisation, ``round(x / s)·s`` clamped to ``±qmax·s`` with
  ``qmax = 2^(bits−1) − 1`` and ``s = max|x| / qmax`` over the chosen dimensions (the valid, unmasked entries only).
  Scales are per sequence, so a result does not depend on which other sequences share the batch.
* :func:`activation_statistics`: the top activations of the attention logits (valid entries) and of the hidden states
  (every decoder layer's output), per layer: top-1/10/100 magnitudes, median magnitude, kurtosis.

How the attention function covers every model. Our attention modules call the kernel with V1's zero-padded queries
``[Q1 | 0]``, ``[0 | Q2]`` (``(B, 2H, T, 2d)``) over packed keys ``[K1 | K2]`` (``(B, G, S, 2d)``), so every padded
logit equals ``q_c·k_c``, or with V2's ``(B, 2H, T, d)`` queries over ``(B, G, S, d)`` keys, and pass ``diff_lambda``
(docs/model.md, "What it computes"); a standard model passes ``(B, Hq, T, d)`` over ``(B, Hkv, S, d)`` and no λ.
Without logit quantisation or statistics the function calls the eager implementation itself (ours:
``modeling_difftransformer.eager_attention_forward``, which returns the combined heads and the differential maps;
standard models: Llama's eager), so ``target=None`` and ``target="qk"`` run exactly the eager arithmetic; with them it
computes the logits, transforms them, and finishes as those eager functions do: ours through the model's own
:func:`~difftransformer.modeling_difftransformer.attention_logits` and ``attention_from_logits`` (the two halves of its
eager function), a standard model's with Llama's arithmetic (the tests check it reproduces both).
For V1's queries quantisation acts on the padded tensor, whose zero halves stay zero and do not change any maximum,
so it equals quantising the unpadded queries; V1's keys are quantised per key head (each half of a packed group) under
``"head"``.

Not a training feature: the rounding has no straight-through gradient, and the models are trained in full precision.
"""

from __future__ import annotations

import contextlib
import contextvars
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager_attention_forward
from transformers.models.llama.modeling_llama import repeat_kv

from ..modeling_difftransformer import attention_from_logits, attention_logits, eager_attention_forward

ATTN_IMPLEMENTATION = "difftransformer_lowbit"
TARGETS = ("logits", "qk")
GRANULARITIES = ("tensor", "head")
TOP_K = (1, 10, 100)


@dataclass(frozen=True)
class QuantSpec:
    """What the attention function quantises: ``target`` (None, "logits" or "qk"), ``bits``, ``granularity``."""

    target: str | None = None
    bits: int | None = None
    granularity: str = "tensor"

    def __post_init__(self):
        if self.target is not None and self.target not in TARGETS:
            raise ValueError(f"`target` must be None or one of {TARGETS}, got {self.target!r}.")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"`granularity` must be one of {GRANULARITIES}, got {self.granularity!r}.")
        if self.target is None and self.bits is not None:
            raise ValueError(f"`bits`={self.bits} given without a `target`: say what to quantise ({TARGETS}).")
        if self.target is not None and (not isinstance(self.bits, int) or not 2 <= self.bits <= 24):
            raise ValueError(f"`bits` must be an integer in [2, 24] with target={self.target!r}, got {self.bits!r}.")


@dataclass
class LogitRecorder:
    """Collects, per layer, the valid attention logits each call saw (flattened, float32) and, with ``keep``, the
    logits before and after quantisation as the function used them ((B, heads, T, S), masked entries included)."""

    keep: bool = False
    logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    kept: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


_SPEC: contextvars.ContextVar[QuantSpec] = contextvars.ContextVar("difftransformer_lowbit_spec", default=QuantSpec())
_RECORDER: contextvars.ContextVar[LogitRecorder | None] = contextvars.ContextVar(
    "difftransformer_lowbit_recorder", default=None
)
# Calls of the attention function inside the innermost low_bit_attention block (a one-element list per block).
_CALLS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("difftransformer_lowbit_calls", default=None)


def quantize_symmetric(
    x: torch.Tensor, bits: int, dims: tuple[int, ...], valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Symmetric uniform fake quantisation of ``x`` with one scale per slice over ``dims``.

    ``s = max|x| / qmax`` over ``dims`` (only where ``valid``, a boolean tensor broadcastable to ``x``, is True),
    ``qmax = 2^(bits−1) − 1``; returns ``clamp(round(x / s), −qmax, qmax)·s`` in ``x``'s dtype, computed in float32 (or
    float64 for float64 input). A slice whose valid entries are all zero is returned unchanged (zero stays zero)."""
    if not isinstance(bits, int) or bits < 2:
        raise ValueError(f"`bits` must be an integer >= 2, got {bits!r}.")
    qmax = 2 ** (bits - 1) - 1
    work = x.to(torch.promote_types(x.dtype, torch.float32))
    magnitude = work.abs() if valid is None else work.abs().masked_fill(~valid, 0)
    amax = magnitude.amax(dim=dims, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return (torch.clamp(torch.round(work / scale), -qmax, qmax) * scale).to(x.dtype)


def _dims(granularity: str, ndim: int) -> tuple[int, ...]:
    # (B, heads, T, S or w): per sequence (all heads) or per sequence and head
    return tuple(range(1, ndim)) if granularity == "tensor" else tuple(range(2, ndim))


def _quantize_keys(key: torch.Tensor, spec: QuantSpec, module) -> torch.Tensor:
    if spec.granularity == "head" and getattr(module, "diff_version", None) == 1:
        # V1's packed group [K1 | K2] holds two key heads: one scale per half
        halves = key.unflatten(-1, (2, -1))  # (B, G, S, 2, d)
        return quantize_symmetric(halves, spec.bits, (2, 4)).flatten(-2)
    return quantize_symmetric(key, spec.bits, _dims(spec.granularity, key.dim()))


def _valid_positions(attention_mask: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
    """Boolean (B or 1, 1, T, S): the key positions each query may attend to."""
    if attention_mask is None:  # causal over the last T of S keys
        q_len, k_len = scores.shape[-2:]
        q_pos = torch.arange(k_len - q_len, k_len, device=scores.device)[:, None]
        return (torch.arange(k_len, device=scores.device)[None, :] <= q_pos)[None, None]
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask == 0


def lowbit_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling: float,
    dropout: float = 0.0,
    diff_lambda: torch.Tensor | None = None,
    **kwargs,
):
    """The attention function registered as :data:`ATTN_IMPLEMENTATION` (module docstring). Returns what the eager
    implementation of the calling model returns: ours, the combined heads ``(B, T, H, w)`` and the differential maps;
    a standard model, ``(B, T, Hq, d)`` and its softmax maps."""
    spec, recorder, calls = _SPEC.get(), _RECORDER.get(), _CALLS.get()
    if calls is not None:
        calls[0] += 1
    differential = diff_lambda is not None
    if spec.target == "qk":
        query = quantize_symmetric(query, spec.bits, _dims(spec.granularity, query.dim()))
        key = _quantize_keys(key, spec, module)
    if spec.target != "logits" and recorder is None:
        if differential:
            return eager_attention_forward(
                module, query, key, value, attention_mask, scaling, dropout, diff_lambda=diff_lambda, **kwargs
            )
        return llama_eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

    # The eager computation with the logits exposed: ours through the model's own two halves of its eager function,
    # a standard model's as Llama's eager function does it (its softmax in float32).
    scores = attention_logits(module, query, key, scaling)
    valid = _valid_positions(attention_mask, scores)
    if recorder is not None:
        recorder.logits.setdefault(module.layer_idx, []).append(
            scores.detach().float().masked_select(valid.expand_as(scores))
        )
    if spec.target == "logits":
        quantized = quantize_symmetric(scores, spec.bits, _dims(spec.granularity, scores.dim()), valid)
        if recorder is not None and recorder.keep:
            recorder.kept.setdefault(module.layer_idx, []).append((scores.detach(), quantized.detach()))
        scores = quantized
    if differential:
        return attention_from_logits(module, scores, value, attention_mask, diff_lambda, dtype=query.dtype)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, repeat_kv(value, module.num_key_value_groups)).transpose(1, 2).contiguous(), weights


AttentionInterface.register(ATTN_IMPLEMENTATION, lowbit_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)


@contextlib.contextmanager
def low_bit_attention(
    model,
    target: str | None = "logits",
    bits: int | None = 8,
    granularity: str = "tensor",
    recorder: LogitRecorder | None = None,
) -> Iterator[QuantSpec]:
    """Run ``model`` with its attention logits (``target="logits"``) or queries and keys (``"qk"``) quantised to
    ``bits`` (``granularity`` ``"tensor"`` or ``"head"``), or with nothing quantised (``target=None``; ``bits`` is
    then ignored), inside the block; ``recorder`` collects the logits. Restores the model's attention implementation
    on leaving, errors included.

    Loud where it would be silently wrong: if the model ran inside the block but its attention never called the
    function (a model whose attention does not go through transformers' ``AttentionInterface``), leaving the block
    raises a ``RuntimeError`` instead of letting unquantised results pass for quantised ones."""
    spec = QuantSpec(target, bits if target is not None else None, granularity)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ran, calls = [], [0]
    hook = model.register_forward_pre_hook(lambda module, args: ran.append(True))
    spec_token, recorder_token, calls_token = _SPEC.set(spec), _RECORDER.set(recorder), _CALLS.set(calls)
    try:
        yield spec
    finally:
        _SPEC.reset(spec_token)
        _RECORDER.reset(recorder_token)
        _CALLS.reset(calls_token)
        hook.remove()
        model.set_attn_implementation(previous)
    if ran and not calls[0]:
        raise RuntimeError(
            f"low_bit_attention: {type(model).__name__} ran {len(ran)} time(s) inside the block, but its attention "
            f"never called the {ATTN_IMPLEMENTATION!r} attention function, so nothing was quantised or recorded: its "
            "attention modules do not dispatch through transformers' AttentionInterface "
            "(config._attn_implementation)."
        )


def tensor_statistics(values: torch.Tensor) -> dict:
    """Magnitude statistics of a flat tensor: ``max``, ``top10`` / ``top100`` (the 10th / 100th largest magnitude),
    ``median`` magnitude, ``kurtosis`` (Pearson, E[(x−μ)⁴]/σ⁴ in float64: 3 for a Gaussian) and ``count``."""
    x = values.detach().double().flatten()
    mags = x.abs()
    top = torch.topk(mags, min(max(TOP_K), mags.numel())).values
    centred = x - x.mean()
    var = centred.pow(2).mean()
    out = {
        "max": float(top[0]),
        "median": float(mags.median()),
        "count": int(x.numel()),
        "kurtosis": float(centred.pow(4).mean() / var.pow(2)) if var > 0 else float("nan"),
    }
    for k in TOP_K[1:]:
        out[f"top{k}"] = float(top[min(k, top.numel()) - 1])
    return out


@torch.no_grad()
def activation_statistics(model, input_ids: torch.Tensor) -> dict:
    """Per layer, :func:`tensor_statistics` of the attention logits (every valid query–key pair of ``input_ids``,
    before any softmax; for our models the logits of both maps) and of the hidden states (each decoder layer's
    output, the residual stream). Returns ``{"logits": [...], "hidden": [...]}``, one dict per layer."""
    recorder = LogitRecorder()
    with low_bit_attention(model, target=None, recorder=recorder):
        out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states[1 : 1 + model.config.num_hidden_layers]
    return {
        "logits": [
            {"layer": layer, **tensor_statistics(torch.cat(recorder.logits[layer]))}
            for layer in sorted(recorder.logits)
        ],
        "hidden": [{"layer": layer, **tensor_statistics(h)} for layer, h in enumerate(hidden)],
    }


def summarize_statistics(stats: dict) -> dict:
    """Across layers: the largest ``max`` and ``kurtosis`` and the mean median, for logits and hidden states."""
    return {
        kind: {
            "max": max(s["max"] for s in rows),
            "kurtosis": max(s["kurtosis"] for s in rows),
            "median": statistics.mean(s["median"] for s in rows),
        }
        for kind, rows in stats.items()
    }


__all__ = [
    "ATTN_IMPLEMENTATION",
    "GRANULARITIES",
    "TARGETS",
    "LogitRecorder",
    "QuantSpec",
    "activation_statistics",
    "low_bit_attention",
    "lowbit_attention_forward",
    "quantize_symmetric",
    "summarize_statistics",
    "tensor_statistics",
]
