"""Attention-noise lens: where does attention go, on the answer or on the noise?

The Differential Transformer paper (Ye et al., arXiv 2410.05258, Fig. 1 and the attention-score table of the
key-information-retrieval experiment, §3) measures, for the query tokens of a retrieval prompt, the share of
attention placed on the *answer span* ("attention to answer") and on the rest of the context ("attention
noise"): a standard Transformer spreads most of its mass over irrelevant context, differential attention
cancels it. This module measures the same quantities for

* our models (``model_type == "difftransformer"``, V1 and V2): the differential maps ``A1 − λ·A2`` that the
  output is computed from, *and* each of the two softmax maps ``A1``, ``A2`` separately;
* any standard transformers causal LM (Llama, Qwen2, GPT-2, ...): its softmax maps,

so that the two can be compared side by side, plus λ per layer (V1) or per-token λ statistics (V2) and
heatmap PNGs.

How the maps are obtained. Eager ``output_attentions=True`` returns the differential maps for our models and
the softmax maps for standard ones; the lens switches the model to eager attention for the call and back
afterwards. The two raw softmax maps of a differential head are not returned by the model, so a forward
pre-hook on every ``DiffTransformerAttention`` captures its inputs (hidden states after the input RMSNorm,
rotary ``cos``/``sin``, additive mask) and :func:`softmax_maps` recomputes ``q``/``k`` with the module's own
projections and transformers' ``apply_rotary_pos_emb``. With the row order of docs/model.md ("What it computes")
the standard GQA rule (query head ``i`` reads key head ``i // (Hq/Hkv)``) gives exactly the paper's pairing for both
versions; :func:`split_pairs` then separates the maps of every differential head ``h = g·n + r`` (V1 rows
``(g, c, r)``, V2 rows ``(h, c)``). ``tests/research/test_analysis.py`` checks that ``A1 − λ·A2`` recomputed this way
equals the model's own differential maps.

Shares (:func:`attention_shares`). For one query row with weights ``w`` over key positions, the key positions
are split into three disjoint regions: the answer span, the *context* outside the answer (noise) and everything
else (``other``: e.g. the question itself, when a context span is given; empty otherwise). Softmax rows are
non-negative and sum to one, so the three shares are simply the masses. Differential rows are signed and sum
to ``1 − λ`` (V1: scalar λ; V2: ``1 − λ_t``), so a normalisation must be chosen:

* ``"positive"`` (default): shares of the positive mass, ``Σ_region max(w, 0) / Σ max(w, 0)``. In ``[0, 1]``,
  sums to one, comparable with softmax shares: "of what the head attends to, how much is the answer".
  Negative weights (cancelled noise) count as zero.
* ``"signed"``: signed mass over the signed row sum, ``Σ_region w / Σ w``. Sums to one; cancelled noise shows as
  a small or negative noise share; unstable when the row sum is near zero (λ near 1).
* ``"raw"``: the unnormalised signed mass ``Σ_region w`` (the row sums to ``1 − λ``). For softmax maps it equals
  the other two.

Shares are averaged over the chosen query rows (default: the last token, which predicts the answer).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

SHARE_MODES = ("positive", "signed", "raw")
REGIONS = ("answer", "noise", "other")
DIFF_KINDS = ("diff", "softmax1", "softmax2")  # kinds of maps for our models; standard models have "softmax"


def is_differential(model) -> bool:
    """True for our models (also when loaded as remote code: the check uses ``model_type``, never a class)."""
    return getattr(model.config, "model_type", None) == "difftransformer"


def diff_attention_modules(model) -> list[torch.nn.Module]:
    # By class name, not isinstance: under trust_remote_code the class is a second copy (docs/ecosystem.md, "Hub").
    mods = [m for m in model.modules() if any(c.__name__ == "DiffTransformerAttention" for c in type(m).__mro__)]
    return sorted(mods, key=lambda m: m.layer_idx)


@contextlib.contextmanager
def eager_attention(model) -> Iterator[None]:
    """Temporarily switch ``model`` to eager attention: the only implementation that materialises the maps."""
    previous = model.config._attn_implementation
    if previous != "eager":
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if previous != "eager":
            model.set_attn_implementation(previous)


def _additive_mask(mask: torch.Tensor | None, q_len: int, k_len: int, device, dtype=torch.float32) -> torch.Tensor:
    """The mask a layer received, as an additive float mask broadcastable to ``(B, heads, T, S)``."""
    if mask is None:  # a kernel that relies on `is_causal`: rebuild the causal mask (queries are the last T keys)
        q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
        allowed = torch.arange(k_len, device=device)[None, :] <= q_pos
        return torch.where(allowed, 0.0, float("-inf")).to(dtype)
    if mask.dtype == torch.bool:  # sdpa-style boolean mask, True = may attend
        return torch.where(mask, 0.0, float("-inf")).to(dtype)
    return mask[..., :k_len].to(dtype)


def softmax_maps(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every softmax map of one ``DiffTransformerAttention`` call, float32 ``(B, 2H, T, S)`` in q_proj row order.

    Recomputes ``softmax(q kᵀ/√d + M)`` from the module's inputs with its own ``q_proj``/``k_proj`` and
    transformers' rotate-half RoPE (docs/model.md, "What it computes"). Query head ``i`` reads key head
    ``i // (Hq/Hkv)``: with the row order of docs/model.md this is the paper's pairing for V1 (query ``(g, c, r)`` reads
    key ``(g, c)``) and for V2 (query ``2h + c`` reads key ``h // n``). No cache: the lens runs one full forward.
    """
    bsz, q_len, _ = hidden_states.shape
    d = module.head_dim
    query = module.q_proj(hidden_states).view(bsz, q_len, -1, d)
    key = module.k_proj(hidden_states).view(bsz, q_len, -1, d)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=2)
    query, key = query.transpose(1, 2).float(), key.transpose(1, 2).float()  # (B, 2H, T, d), (B, Hkv, S, d)
    key = repeat_kv(key, query.shape[1] // key.shape[1])
    scores = torch.matmul(query, key.transpose(2, 3)) * module.scaling
    scores = scores + _additive_mask(attention_mask, q_len, key.shape[2], scores.device)
    return torch.softmax(scores, dim=-1)


def split_pairs(
    maps: torch.Tensor, pair_stride: int, dim: int = 1, noise_ratio: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``2H`` softmax maps along ``dim`` into ``(A1, A2)``, each with the H differential heads in order
    ``h = g·n + r``. Same layout rule as the modeling file's ``differential_combine`` (V1: ``pair_stride = n``,
    rows ``(g, c, r)``; V2: ``pair_stride = 1``, rows ``(h, c)``). With grouped differential attention
    (``noise_ratio`` r > 1) each head's ``A2`` is its shared noise map (repeated for the r heads that share it)."""
    if noise_ratio == 1:
        first, second = maps.unflatten(dim, (-1, 2, pair_stride)).unbind(dim + 1)
        return first.flatten(dim, dim + 1), second.flatten(dim, dim + 1)
    blocks = maps.unflatten(dim, (-1, pair_stride + pair_stride // noise_ratio))
    first = blocks.narrow(dim + 1, 0, pair_stride)
    second = blocks.narrow(dim + 1, pair_stride, pair_stride // noise_ratio).repeat_interleave(noise_ratio, dim + 1)
    return first.flatten(dim, dim + 1), second.flatten(dim, dim + 1)


@dataclass
class LayerMaps:
    """The attention maps of one layer for a batch: ``maps[kind]`` is float32 ``(B, heads, T, S)``.

    Kinds: ``"diff"``, ``"softmax1"``, ``"softmax2"`` for our models (``heads = H``), ``"softmax"`` for standard
    models (``heads = num_attention_heads``). ``lam`` is the layer's λ: a float32 scalar (V1), ``(B, T, H)`` (V2),
    ``None`` for standard models.
    """

    layer: int
    maps: dict[str, torch.Tensor]
    lam: torch.Tensor | None = None


@torch.no_grad()
def attention_maps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[LayerMaps]:
    """One forward pass of ``model`` (eager attention, no cache), returning every layer's maps (:class:`LayerMaps`).

    Works for our models (differential maps as returned by the model plus both recomputed softmax maps) and for
    any transformers causal LM whose eager attention returns its softmax maps through ``output_attentions``.
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    input_ids = input_ids.to(model.device)
    if attention_mask is not None:
        attention_mask = attention_mask.to(model.device)
    if not is_differential(model):
        with eager_attention(model):
            out = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True, use_cache=False)
        if not out.attentions or out.attentions[0] is None:
            raise ValueError(f"{type(model).__name__} returned no attention maps with eager output_attentions=True.")
        return [LayerMaps(i, {"softmax": a.float()}) for i, a in enumerate(out.attentions)]

    captured: dict[int, dict] = {}
    modules = diff_attention_modules(model)

    def hook(module, args, kwargs):
        captured[module.layer_idx] = {
            "hidden_states": kwargs["hidden_states"] if "hidden_states" in kwargs else args[0],
            "position_embeddings": kwargs["position_embeddings"],
            "attention_mask": kwargs.get("attention_mask"),
        }

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    try:
        with eager_attention(model):
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                output_attentions=True,
                output_lambdas=True,
                use_cache=False,
            )
    finally:
        for handle in handles:
            handle.remove()
    layers = []
    for module, diff, lam in zip(modules, out.attentions, out.lambdas):
        a1, a2 = split_pairs(
            softmax_maps(module, **captured[module.layer_idx]), module.pair_stride, noise_ratio=module.noise_ratio
        )
        layers.append(LayerMaps(module.layer_idx, {"diff": diff.float(), "softmax1": a1, "softmax2": a2}, lam.float()))
    return layers


def _span_mask(span, length: int, name: str, device=None) -> torch.Tensor:
    """A boolean mask over ``length`` key positions from a ``(start, end)`` span (end exclusive) or a mask."""
    if isinstance(span, torch.Tensor) and span.dtype == torch.bool:
        if span.shape != (length,):
            raise ValueError(f"`{name}` mask must have shape ({length},), got {tuple(span.shape)}.")
        return span.to(device)
    try:
        start, end = (int(x) for x in span)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a (start, end) token span or a boolean mask, got {span!r}.") from None
    if not 0 <= start < end <= length:
        raise ValueError(f"`{name}` span ({start}, {end}) must satisfy 0 <= start < end <= {length} (sequence length).")
    mask = torch.zeros(length, dtype=torch.bool, device=device)
    mask[start:end] = True
    return mask


def attention_shares(
    maps: torch.Tensor,
    answer,
    context=None,
    query_positions: Sequence[int] | None = None,
    mode: str = "positive",
) -> torch.Tensor:
    """Share of attention on the answer span, on the noise and on the rest: tensor ``(..., 3)`` over ``REGIONS``.

    ``maps``: ``(..., T, S)`` attention weights (softmax or differential). ``answer``/``context``: ``(start, end)``
    token spans over key positions (end exclusive) or boolean masks of length ``S``. Noise is the context outside
    the answer; ``context=None`` means every key position, so ``other`` is zero. ``query_positions``: the rows to
    average over (default: the last row). ``mode``: ``"positive"``, ``"signed"`` or ``"raw"``, see the module
    docstring. For softmax maps the three modes agree and ``answer + noise + other = 1``.
    """
    if mode not in SHARE_MODES:
        raise ValueError(f"`mode` must be one of {SHARE_MODES}, got {mode!r}.")
    q_len, k_len = maps.shape[-2:]
    answer_mask = _span_mask(answer, k_len, "answer", maps.device)
    context_mask = (
        torch.ones_like(answer_mask) if context is None else _span_mask(context, k_len, "context", maps.device)
    )
    regions = torch.stack([answer_mask, context_mask & ~answer_mask, ~context_mask & ~answer_mask], -1).to(maps.dtype)
    rows = [q_len - 1] if query_positions is None else [int(p) for p in query_positions]
    if not rows or any(not -q_len <= p < q_len for p in rows):
        raise ValueError(f"`query_positions` must be non-empty positions in [0, {q_len}), got {list(rows)}.")
    weights = maps[..., rows, :]  # (..., Q, S)
    if mode == "positive":
        weights = weights.clamp(min=0)
    mass = weights @ regions  # (..., Q, 3)
    if mode != "raw":
        mass = mass / mass.sum(-1, keepdim=True)
    return mass.mean(-2)


@dataclass
class LensReport:
    """What :func:`lens` measured for one prompt.

    ``shares[kind]``: float tensor ``(L, heads, 3)``, the shares over ``REGIONS`` per layer and head;
    ``lambdas``: V1 ``(L,)`` λ per layer; V2 ``(L, H, 4)`` per-token λ statistics (mean, std, min, max over the
    prompt's tokens); ``None`` for standard models. ``maps`` keeps the per-layer maps for heatmaps.
    """

    model_name: str
    kinds: tuple[str, ...]
    shares: dict[str, torch.Tensor]
    answer_span: tuple[int, int]
    context_span: tuple[int, int] | None
    query_positions: list[int]
    mode: str
    tokens: list[str] = field(default_factory=list)
    lambdas: torch.Tensor | None = None
    diff_version: int | None = None
    maps: list[LayerMaps] = field(default_factory=list, repr=False)

    def rows(self) -> list[dict]:
        """One row per (kind, layer, head): ``answer``, ``noise``, ``other`` shares."""
        out = []
        for kind in self.kinds:
            for layer, per_head in enumerate(self.shares[kind].tolist()):
                for head, values in enumerate(per_head):
                    out.append(
                        {
                            "model": self.model_name,
                            "kind": kind,
                            "layer": layer,
                            "head": head,
                            **dict(zip(REGIONS, values)),
                        }
                    )
        return out

    def summary(self) -> dict[str, dict[str, float]]:
        """Mean share per kind over all layers and heads, plus the best head's answer share."""
        return {
            kind: {**{r: float(s[..., i].mean()) for i, r in enumerate(REGIONS)}, "max_answer": float(s[..., 0].max())}
            for kind, s in self.shares.items()
        }

    def lambda_rows(self) -> list[dict]:
        """λ per layer (V1) or per-token λ statistics per layer and head (V2); empty for standard models."""
        if self.lambdas is None:
            return []
        if self.lambdas.dim() == 1:
            return [{"layer": i, "lambda": float(v)} for i, v in enumerate(self.lambdas)]
        return [
            {"layer": i, "head": h, **dict(zip(("mean", "std", "min", "max"), stats))}
            for i, per_head in enumerate(self.lambdas.tolist())
            for h, stats in enumerate(per_head)
        ]

    def to_markdown(self) -> str:
        """The per-layer table (shares averaged over heads, best head's answer share) and λ, as Markdown."""
        lines = [f"### {self.model_name}: attention shares ({self.mode}; query rows {self.query_positions})", ""]
        lines += ["| kind | layer | answer | noise | other | best head (answer) |", "|---|---|---|---|---|---|"]
        for kind in self.kinds:
            for layer, s in enumerate(self.shares[kind]):
                best = int(s[:, 0].argmax())
                lines.append(
                    f"| {kind} | {layer} | {s[:, 0].mean():.3f} | {s[:, 1].mean():.3f} | {s[:, 2].mean():.3f} | "
                    f"h{best}: {s[best, 0]:.3f} |"
                )
        if self.lambdas is not None:
            lines += ["", "| layer | λ |" if self.lambdas.dim() == 1 else "| layer | λ mean | λ std | λ min | λ max |"]
            lines += ["|---|---|" if self.lambdas.dim() == 1 else "|---|---|---|---|---|"]
            for i, v in enumerate(self.lambdas):
                if v.dim() == 0:
                    lines.append(f"| {i} | {float(v):.4f} |")
                else:  # V2: average the per-head statistics over heads for the table
                    m = v.mean(0)
                    lines.append(f"| {i} | {m[0]:.4f} | {m[1]:.4f} | {v[:, 2].min():.4f} | {v[:, 3].max():.4f} |")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "model": self.model_name,
            "mode": self.mode,
            "answer_span": list(self.answer_span),
            "context_span": None if self.context_span is None else list(self.context_span),
            "query_positions": self.query_positions,
            "diff_version": self.diff_version,
            "summary": self.summary(),
            "shares": self.rows(),
            "lambdas": self.lambda_rows(),
        }


def lambda_statistics(lam: torch.Tensor) -> torch.Tensor:
    """V2 λ ``(B, T, H)`` → per-head statistics over tokens ``(H, 4)``: mean, std, min, max."""
    flat = lam.reshape(-1, lam.shape[-1]).float()
    std = flat.std(0) if flat.shape[0] > 1 else torch.zeros_like(flat[0])
    return torch.stack([flat.mean(0), std, flat.min(0).values, flat.max(0).values], -1)


def lens(
    model,
    input_ids: torch.Tensor,
    answer_span: tuple[int, int],
    context_span: tuple[int, int] | None = None,
    query_positions: Sequence[int] | None = None,
    mode: str = "positive",
    tokenizer=None,
    model_name: str | None = None,
    keep_maps: bool = True,
) -> LensReport:
    """Measure attention to the answer and attention noise for one prompt, per layer, head and kind of map.

    ``input_ids``: ``(T,)`` or ``(1, T)``. Spans are token indices ``(start, end)``, end exclusive;
    :func:`find_token_span` turns a substring into one. See :func:`attention_shares` for the regions and modes.
    """
    if mode not in SHARE_MODES:
        raise ValueError(f"`mode` must be one of {SHARE_MODES}, got {mode!r}.")
    if input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise ValueError(
            f"lens() analyses one prompt: `input_ids` must have shape (T,) or (1, T), got {tuple(input_ids.shape)}."
        )
    input_ids = input_ids.reshape(1, -1)
    seq_len = input_ids.shape[1]
    _span_mask(answer_span, seq_len, "answer_span")  # validate before the forward pass
    if context_span is not None:
        _span_mask(context_span, seq_len, "context_span")
    layers = attention_maps(model, input_ids)
    kinds = tuple(layers[0].maps)
    shares = {
        kind: torch.stack(
            [attention_shares(lm.maps[kind][0], answer_span, context_span, query_positions, mode) for lm in layers]
        )
        for kind in kinds
    }
    lambdas, version = None, None
    if is_differential(model):
        version = model.config.diff_version
        if version == 1:
            lambdas = torch.stack([lm.lam.reshape(()) for lm in layers])
        else:
            lambdas = torch.stack([lambda_statistics(lm.lam) for lm in layers])
    tokens = tokenizer.convert_ids_to_tokens(input_ids[0].tolist()) if tokenizer is not None else []
    rows = [seq_len - 1] if query_positions is None else [int(p) % seq_len for p in query_positions]
    return LensReport(
        model_name=model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
        kinds=kinds,
        shares=shares,
        answer_span=tuple(int(x) for x in answer_span),
        context_span=None if context_span is None else tuple(int(x) for x in context_span),
        query_positions=rows,
        mode=mode,
        tokens=tokens,
        lambdas=lambdas,
        diff_version=version,
        maps=layers if keep_maps else [],
    )


def char_span_to_tokens(offsets: Sequence[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """Token span ``(first, last + 1)`` of every token whose characters overlap ``[start, end)``.

    ``offsets`` is a fast tokenizer's ``offset_mapping``; special tokens (empty offsets) never overlap.
    """
    toks = [i for i, (a, b) in enumerate(offsets) if a < end and b > start and b > a]
    if not toks:
        raise ValueError(f"no token covers the characters [{start}, {end}) of the prompt.")
    return toks[0], toks[-1] + 1


def find_token_span(
    tokenizer, text: str, substring: str, occurrence: int = 0, add_special_tokens: bool = True
) -> tuple[int, int]:
    """Token span ``(start, end)`` of the ``occurrence``-th occurrence of ``substring`` in ``text``.

    Uses the fast tokenizer's character offsets (``return_offsets_mapping``); every token overlapping the
    substring's characters belongs to the span. The indices refer to
    ``tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]``.
    """
    if not substring:
        raise ValueError("`substring` must be a non-empty string.")
    start = -1
    for _ in range(occurrence + 1):
        start = text.find(substring, start + 1)
        if start < 0:
            raise ValueError(f"{substring!r} occurs fewer than {occurrence + 1} time(s) in the prompt.")
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=add_special_tokens)
    return char_span_to_tokens(enc["offset_mapping"], start, start + len(substring))


@dataclass
class ExamplesLens:
    """:func:`lens_on_examples` result: ``shares[kind]`` ``(L, heads, 3)`` and ``lambdas`` (V1 ``(L,)``; V2
    ``(L, H, 4)`` per-token statistics; ``None`` for standard models), averaged over the examples."""

    shares: dict[str, torch.Tensor]
    lambdas: torch.Tensor | None
    examples: int
    # :func:`lens_on_spans` with extra regions: ``region_shares[region][kind]`` ``(L, heads)``, the share of the
    # attention (same mode) that falls on that region.
    region_shares: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


@dataclass
class SpanExample:
    """A tokenised prompt for :func:`lens_on_spans`: ``input_ids`` ``(T,)``, the ``answer`` token span, the ``context``
    span (``None``: the whole prompt) and optional extra ``regions`` (name → token span or boolean mask of length T)
    whose shares are reported beside answer / noise / other, e.g. the distractors of a multi-needle prompt."""

    input_ids: torch.Tensor
    answer: tuple[int, int]
    context: tuple[int, int] | None = None
    regions: dict = field(default_factory=dict)


def lens_on_spans(model, examples: Sequence[SpanExample], mode: str = "positive") -> ExamplesLens:
    """Mean attention shares over tokenised prompts whose spans are known in tokens (synthetic tasks without a
    tokenizer, :mod:`difftransformer.research.retrieval_tasks`), from the last token (which predicts the answer).

    ``shares[kind]`` ``(L, heads, 3)`` over ``REGIONS`` as in :func:`lens`; ``region_shares[name][kind]`` ``(L,
    heads)``: the share of each extra region (its mass over all mass of the row, same ``mode``; every example must name
    the same regions)."""
    if not examples:
        raise ValueError("`examples` is empty.")
    names = set(examples[0].regions)
    if any(set(ex.regions) != names for ex in examples):
        raise ValueError(f"every example must name the same `regions`, got {[sorted(ex.regions) for ex in examples]}.")
    total: dict[str, torch.Tensor] = {}
    regions: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    lambdas = None
    for ex in examples:
        ids = ex.input_ids.reshape(-1)
        report = lens(model, ids, ex.answer, ex.context, None, mode, keep_maps=bool(names))
        for kind, s in report.shares.items():
            total[kind] = total.get(kind, 0) + s
        for name in names:
            mask = _span_mask(ex.regions[name], ids.shape[0], name)
            for kind in report.kinds:
                # the region as "answer", no context: its share of the whole row
                s = torch.stack(
                    [attention_shares(lm.maps[kind][0], mask, None, None, mode)[..., 0] for lm in report.maps]
                )
                regions[name][kind] = regions[name].get(kind, 0) + s
        if report.lambdas is not None:
            lambdas = report.lambdas if lambdas is None else lambdas + report.lambdas
    n = len(examples)
    return ExamplesLens(
        {kind: s / n for kind, s in total.items()},
        None if lambdas is None else lambdas / n,
        n,
        {name: {kind: s / n for kind, s in per.items()} for name, per in regions.items()},
    )


def lens_on_examples(model, tokenizer, examples, mode: str = "positive") -> ExamplesLens:
    """Mean attention shares over probe examples (:class:`difftransformer.research.probes.ProbeExample`).

    For every example: answer span = the evidence (``evidence_span``, e.g. the queried needle's value), context =
    everything before the question (``question_start``), so noise = the rest of the haystack and ``other`` = the
    question; query row = the last prompt token (it predicts the answer).
    """
    if not examples:
        raise ValueError("`examples` is empty.")
    total: dict[str, torch.Tensor] = {}
    lambdas = None
    for ex in examples:
        enc = tokenizer(ex.prompt, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        answer = char_span_to_tokens(offsets, *ex.evidence_span)
        q_start = char_span_to_tokens(offsets, ex.question_start, len(ex.prompt))[0]
        report = lens(model, torch.tensor(enc["input_ids"]), answer, (0, q_start), None, mode, keep_maps=False)
        for kind, s in report.shares.items():
            total[kind] = total.get(kind, 0) + s
        if report.lambdas is not None:
            lambdas = report.lambdas if lambdas is None else lambdas + report.lambdas
    n = len(examples)
    return ExamplesLens({kind: s / n for kind, s in total.items()}, None if lambdas is None else lambdas / n, n)


# ----------------------------------------------------------------------------------------------- plots


def plot_heatmaps(
    report: LensReport,
    path: str,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    kinds: Sequence[str] | None = None,
    last_rows: int | None = 48,
) -> str:
    """Heatmap PNG: one row of panels per chosen (layer, head), one column per kind of map.

    Softmax maps use a sequential colour scale from 0; differential maps a diverging scale centred on 0 (negative
    weights are cancelled attention). The answer span is outlined in green on every panel, and the query rows
    used for the shares are marked. ``last_rows`` shows only the last query rows (long prompts); ``None`` shows all.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    if not report.maps:
        raise ValueError("the report holds no maps: call lens(..., keep_maps=True).")
    kinds = list(kinds or report.kinds)
    for kind in kinds:
        if kind not in report.kinds:
            raise ValueError(f"`kinds` entries must be among {report.kinds}, got {kind!r}.")
    num_layers, num_heads = len(report.maps), report.shares[kinds[0]].shape[1]
    layers = list(range(num_layers)) if layers is None else list(layers)
    heads = [0] if heads is None else list(heads)
    for name, values, bound in (("layers", layers, num_layers), ("heads", heads, num_heads)):
        if not values or any(not 0 <= v < bound for v in values):
            raise ValueError(f"`{name}` must be non-empty indices in [0, {bound}), got {values}.")
    pairs = [(layer, h) for layer in layers for h in heads]
    seq_len = report.maps[0].maps[kinds[0]].shape[-1]
    first_row = 0 if last_rows is None else max(0, seq_len - last_rows)
    fig, axes = plt.subplots(len(pairs), len(kinds), figsize=(4.2 * len(kinds), 3.2 * len(pairs)), squeeze=False)
    a0, a1 = report.answer_span
    for i, (layer, head) in enumerate(pairs):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            m = report.maps[layer].maps[kind][0, head, first_row:].cpu().numpy()
            if kind == "diff":
                bound = max(float(abs(m).max()), 1e-6)
                im = ax.imshow(
                    m, aspect="auto", cmap="RdBu_r", norm=TwoSlopeNorm(0.0, -bound, bound), interpolation="nearest"
                )
            else:
                im = ax.imshow(m, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest")
            ax.add_patch(Rectangle((a0 - 0.5, -0.5), a1 - a0, m.shape[0], fill=False, edgecolor="lime", linewidth=1.2))
            for q in report.query_positions:
                if q >= first_row:
                    ax.axhline(q - first_row, color="orange", linewidth=0.6, linestyle=":")
            share = report.shares[kind][layer, head]
            ax.set_title(f"L{layer} H{head} {kind}: ans {share[0]:.2f} / noise {share[1]:.2f}", fontsize=8)
            ax.set_xlabel("key position", fontsize=7)
            ax.set_ylabel(f"query position (from {first_row})", fontsize=7)
            ax.tick_params(labelsize=6)
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02).ax.tick_params(labelsize=6)
    fig.suptitle(f"{report.model_name}: green = answer span, dotted = query rows", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_shares(reports: Sequence[LensReport], path: str) -> str:
    """Side-by-side PNG: per layer, the answer share and the noise share (mean over heads) of every model/kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for report in reports:
        for kind in report.kinds:
            s = report.shares[kind].mean(1).cpu()  # (L, 3)
            style = "-" if kind in ("diff", "softmax") else ":"
            for ax, idx in zip(axes, (0, 1)):
                ax.plot(range(len(s)), s[:, idx].numpy(), style, marker="o", label=f"{report.model_name} {kind}")
    for ax, title in zip(axes, ("attention to answer", "attention noise")):
        ax.set_title(f"{title} (mean over heads, {reports[0].mode} shares)", fontsize=9)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------- CLI


def _int_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m difftransformer.research.analysis",
        description="Attention-noise lens: per layer and head, the share of attention on a marked answer span vs the "
        "rest (attention to answer / attention noise, Differential Transformer paper §3, Fig. 1), for our V1/V2 "
        "models (differential map and both softmax maps) and for any transformers causal LM (softmax maps), with "
        "heatmap PNGs and λ statistics. Writes lens.md, lens.json, shares.png and one heatmap PNG per model.",
    )
    p.add_argument(
        "--model",
        action="append",
        required=True,
        help="A model folder or Hub id (repeat to compare several models side by side). Loaded with "
        "AutoModelForCausalLM (trust_remote_code=True).",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="Tokenizer folder or id; default: the first model's folder. All models must share it.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="The prompt text.")
    src.add_argument("--prompt-file", help="A UTF-8 file holding the prompt text.")
    p.add_argument(
        "--answer", required=True, help="Substring of the prompt that is the answer span (e.g. the needle's value)."
    )
    p.add_argument(
        "--occurrence", type=int, default=0, help="Which occurrence of --answer to mark (0 = first). Default 0."
    )
    p.add_argument(
        "--question",
        default=None,
        help="Substring where the question starts: tokens from there on count as 'other', not noise (the context is "
        "everything before it). Default: no question; noise = everything but the answer.",
    )
    p.add_argument(
        "--query-positions",
        type=_int_list,
        default=None,
        help="Comma-separated query rows to average the shares over (negative = from the end). Default: the last "
        "token.",
    )
    p.add_argument(
        "--mode",
        choices=SHARE_MODES,
        default="positive",
        help="How signed differential maps are normalised: positive (share of positive mass, default), signed (signed "
        "mass / row sum), raw (unnormalised mass). Softmax maps give the same numbers in every mode.",
    )
    p.add_argument(
        "--layers", type=_int_list, default=None, help="Comma-separated layers to draw in the heatmaps. Default: all."
    )
    p.add_argument(
        "--heads", type=_int_list, default=None, help="Comma-separated heads to draw in the heatmaps. Default: 0."
    )
    p.add_argument(
        "--last-rows", type=int, default=48, help="Heatmaps show only the last N query rows (0 = all). Default 48."
    )
    p.add_argument("--out", default="lens_out", help="Output folder. Default: lens_out.")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda. Default: cpu.")
    return p


def main(argv: Sequence[str] | None = None) -> list[LensReport]:
    args = build_parser().parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import difftransformer  # noqa: F401  (registers our model type with the Auto classes)

    text = args.prompt if args.prompt is not None else open(args.prompt_file, encoding="utf-8").read()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model[0])
    input_ids = torch.tensor(tokenizer(text)["input_ids"])
    answer = find_token_span(tokenizer, text, args.answer, args.occurrence)
    context = None
    if args.question is not None:
        q_start = find_token_span(tokenizer, text, args.question)[0]
        if q_start == 0:
            raise ValueError("--question marks the start of the prompt: nothing would be left as context.")
        context = (0, q_start)
    os.makedirs(args.out, exist_ok=True)
    reports = []
    for i, name in enumerate(args.model):
        model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=True).to(args.device).eval()
        report = lens(
            model,
            input_ids,
            answer,
            context,
            args.query_positions,
            args.mode,
            tokenizer,
            model_name=f"m{i}:{os.path.basename(name.rstrip('/'))}",
        )
        plot_heatmaps(
            report,
            os.path.join(args.out, f"heatmap_m{i}.png"),
            args.layers,
            args.heads,
            last_rows=args.last_rows or None,
        )
        reports.append(report)
        print(report.to_markdown(), "\n")
    plot_shares(reports, os.path.join(args.out, "shares.png"))
    with open(os.path.join(args.out, "lens.md"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(r.to_markdown() for r in reports) + "\n")
    with open(os.path.join(args.out, "lens.json"), "w", encoding="utf-8") as f:
        json.dump([r.to_json() for r in reports], f, indent=1)
    print(f"wrote {args.out}/lens.md, lens.json, shares.png, heatmap_m*.png")
    return reports


if __name__ == "__main__":
    main()
