"""Micro-benchmark of DIFF V1 attention alone: one function per kernel strategy, timed per dtype, phase and length.

The quantity every strategy computes is V1's differential attention (Ye et al., "Differential Transformer", arXiv
2410.05258, Eq. 1; docs/model.md, "What it computes"), for every differential head ``h = g·n + r`` of KV group ``g``::

    O_h = (softmax(Q1 K1ᵀ/√d + M) − λ·softmax(Q2 K2ᵀ/√d + M)) · [V_g,0 | V_g,1]        (T × 2d)

with ``M`` the causal mask aligned bottom-right (query ``t`` of ``T`` sees keys ``s ≤ t + S − T``). The per-head
RMSNorm and ``(1 − λinit)`` come after and are common to all strategies; they are timed separately with the other
ops around attention (:func:`decode_op_counts`, :func:`time_around_ops`).

Inputs are laid out as the modeling file holds them right before its kernel call: the query after RoPE,
``(B, T, 2H, d)`` with group-major rows ``(g, c, r)`` (docs/model.md, "What it computes": the row order), and the KV
cache both as the current packed layout ``(B, G, S, 2d)`` (``[K1 | K2]``, ``[V_g,0 | V_g,1]``) and as Llama's standard
``(B, 2G, S, d)`` (same bytes, a different cache layout): a strategy reads whichever layout it needs, as if the model
cached that one.

Before it is timed, every strategy is checked against a float64 evaluation of the formula above
(:func:`reference_attention`), so a fast but wrong strategy is reported as ``WRONG`` and never recommended.
The yardstick row ``llama_sdpa`` is what a same-config Llama runs: one SDPA call over 2H query heads of width d.

Strategies (see ``STRATEGIES``):

* ``padded_sdpa``    (a) the modeling file's previous sdpa path (still what any non-``"sdpa"`` attention function
  receives): zero-padded 2d-wide queries, one SDPA call over the packed cache, through transformers'
  ``sdpa_attention_forward``, then ``differential_combine``.
* ``two_sdpa``       (b) DiffLlama's: two d-wide SDPA calls sharing Q and K over the two value halves (values
  repeated to the key heads, i.e. a copy of the V cache per call, as ``DiffLlamaAttention`` does).
* ``four_sdpa``      (c) four d-wide SDPA calls (map c × value half j) on views of a standard-layout cache.
* ``blocked``        (d) materialise ``A1 − λA2`` per query block (``--block`` rows) against only the keys the block
  can see, then one matmul with the 2d-wide value (packed cache, no copy of it).
* ``flex``           (e) ``torch.compile``d ``flex_attention`` on the padded queries over the packed cache.
* ``direct``         (f) decode formulation: two batched matmuls on d-wide views of the packed key cache, float32
  softmax, combine on the (tiny) map, one matmul with the packed value cache: each cache byte is read once.
* ``direct_padded``  (f') as ``direct`` but one matmul with zero-padded queries against the whole packed key.
* ``packed_sdpa``    (g) decode: the 2n padded queries of a group as the rows of one SDPA query head (one fast call,
  no mask, each packed cache byte read once); other phases fall back to ``padded_sdpa``.
* ``ours``           (h) the current modeling file's V1 kernel under ``"sdpa"`` (``differential_sdpa_attention``):
  ``packed_decode_attention`` (``packed_sdpa``) for one token without autograd, else
  ``blocked_differential_attention`` (blocks of rows chosen from the key length, recomputing backward: keeps no
  T×S map for training).

Run ``python benchmarks/attention_micro.py --help``. Timings are per call, median over ``--reps`` repetitions with
the strategies interleaved (order rotated every repetition), so that load from other processes hits all of them.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from difftransformer.kernels_difftransformer import needs_grad, query_padding
from difftransformer.modeling_difftransformer import CACHE_NAME, differential_combine

# Run as a script, the repository root is not on sys.path; the `ours_v1_padded` decode kind imports `benchmarks.*`.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Max error allowed against the float64 reference, relative to max |reference|: float32 rounding of softmax
# and sums over S ≤ 2048 keys stays near 1e-6; bf16 keeps 8 mantissa bits (≈ 4e-3 per rounding) and the kernels
# round inputs, maps and outputs, so a few 1e-2 is the honest bound there. A wrong pairing or mask gives O(1).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@dataclass
class AttentionInputs:
    """One V1 attention problem, laid out as the modeling file holds it before the kernel call (module docstring)."""

    query: torch.Tensor  # (B, T, 2H, d), rows (g, c, r), RoPE applied
    key_packed: torch.Tensor  # (B, G, S, 2d) = [K_g,0 | K_g,1]
    value_packed: torch.Tensor  # (B, G, S, 2d) = [V_g,0 | V_g,1]
    key_std: torch.Tensor  # (B, 2G, S, d), KV head 2g + c (Llama layout, same values)
    value_std: torch.Tensor  # (B, 2G, S, d)
    lam: torch.Tensor  # float32 scalar λ
    n: int  # differential heads per KV group
    scaling: float = field(init=False)

    def __post_init__(self):
        self.scaling = self.query.shape[-1] ** -0.5

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """(B, T, S, H, G, d)."""
        b, t, hq, d = self.query.shape
        return b, t, self.key_packed.shape[2], hq // 2, self.key_packed.shape[1], d

    def requires_grad_(self) -> AttentionInputs:
        for tensor in (self.query, self.key_packed, self.value_packed, self.key_std, self.value_std):
            tensor.requires_grad_(True)
        return self


def make_inputs(
    batch: int = 1,
    q_len: int = 512,
    kv_len: int | None = None,
    num_heads: int = 8,
    num_groups: int = 4,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    lam: float = 0.55,
    seed: int = 0,
) -> AttentionInputs:
    """Random inputs for ``num_heads`` differential heads over ``num_groups`` KV groups (``n = H / G``).

    q and k are N(0, 1) so that scores ``q·k/√d`` are N(0, 1): softmax maps neither uniform nor one-hot.
    """
    kv_len = q_len if kv_len is None else kv_len
    if num_heads % num_groups:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_groups ({num_groups}).")
    if kv_len < q_len:
        raise ValueError(f"kv_len ({kv_len}) must be >= q_len ({q_len}): the queries are the last q_len positions.")
    gen = torch.Generator().manual_seed(seed)
    b, t, s, h, g, d = batch, q_len, kv_len, num_heads, num_groups, head_dim
    query = torch.randn(b, t, 2 * h, d, generator=gen)
    key_std = torch.randn(b, 2 * g, s, d, generator=gen)
    value_std = torch.randn(b, 2 * g, s, d, generator=gen)

    def pack(std: torch.Tensor) -> torch.Tensor:  # (B, 2G, S, d) → (B, G, S, 2d): heads 2g, 2g+1 side by side
        return std.view(b, g, 2, s, d).transpose(2, 3).reshape(b, g, s, 2 * d)

    return AttentionInputs(
        query=query.to(dtype),
        key_packed=pack(key_std).to(dtype),
        value_packed=pack(value_std).to(dtype),
        key_std=key_std.to(dtype),
        value_std=value_std.to(dtype),
        lam=torch.tensor(lam, dtype=torch.float32),
        n=h // g,
    )


def reference_attention(x: AttentionInputs) -> torch.Tensor:
    """V1's differential attention (docs/model.md, "What it computes") in float64, written from the formula (not from any strategy): returns ``(B, T, H, 2d)``."""
    b, t, s, h, g, d = x.shape
    q = x.query.double().view(b, t, g, 2, x.n, d)  # (b, t, g, c, r, d)
    k = x.key_std.double().view(b, g, 2, s, d)  # (b, g, c, s, d)
    v = x.value_std.double().view(b, g, 2, s, d).transpose(2, 3).reshape(b, g, s, 2 * d)  # [V_g,0 | V_g,1]
    scores = torch.einsum("btgcrd,bgcsd->bgcrts", q, k) / math.sqrt(d)
    visible = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t)
    scores = scores.masked_fill(~visible, float("-inf"))
    maps = scores.softmax(-1)
    diff = maps[:, :, 0] - x.lam.double() * maps[:, :, 1]  # (b, g, r, t, s)
    out = torch.einsum("bgrts,bgse->btgre", diff, v)
    return out.reshape(b, t, h, 2 * d)


# ----------------------------------------------------------------------------------------------------------------
# Strategies. Each takes AttentionInputs and returns the combined output (B, T, H, 2d) in the inputs' dtype.
# ----------------------------------------------------------------------------------------------------------------


class _KernelModule:
    """What transformers' ``sdpa_attention_forward`` reads from the calling module."""

    def __init__(self, num_key_value_groups: int, layer_idx: int = 0):
        self.num_key_value_groups = num_key_value_groups
        self.is_causal = True
        self.layer_idx = layer_idx


def _causal_args(q_len: int, kv_len: int, device: torch.device) -> dict:
    """SDPA arguments for a bottom-right causal mask: ``is_causal`` when square, nothing for one query, else a mask."""
    if q_len == 1:
        return {}
    if q_len == kv_len:
        return {"is_causal": True}
    visible = torch.arange(kv_len, device=device)[None, :] <= torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return {"attn_mask": visible}


def _mask(x: AttentionInputs) -> torch.Tensor | None:
    """The mask transformers passes to a kernel: none for one token or square attention, else bottom-right causal
    (transformers' sdpa path reads ``None`` with ``T < S`` as a prefill into an empty static cache, top-left)."""
    mask = _causal_args(x.query.shape[1], x.key_packed.shape[2], x.query.device).get("attn_mask")
    return None if mask is None else mask[None, None]  # (1, 1, T, S), as transformers' mask builders return


def _query_pad(like: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``(2, 1, 2, 1)``: ``scale`` on the diagonal. Multiplied into queries viewed ``(..., 2, n, 1, d)`` and flattened,
    it zero-pads map 1's rows to ``[Q1|0]`` and map 2's to ``[0|Q2]`` (the padded call of docs/model.md)."""
    return query_padding(1, 1, like.dtype, like.device).view(2, 1, 2, 1).mul_(scale)  # the model's pattern, one row each


def llama_sdpa(x: AttentionInputs) -> torch.Tensor:
    """Yardstick: a same-config Llama's attention (2H d-wide query heads, 2G KV heads), output ``(B, T, 2H, d)``."""
    out, _ = sdpa_attention_forward(_KernelModule(x.n), x.query.transpose(1, 2), x.key_std, x.value_std, _mask(x), scaling=x.scaling)
    return out


def padded_sdpa(x: AttentionInputs) -> torch.Tensor:
    """(a) The modeling file's previous sdpa path, line for line (``DiffTransformerAttention.forward`` for any
    attention function other than ``"sdpa"``): zero-padded queries, one SDPA call, ``differential_combine``."""
    b, t, s, h, g, d = x.shape
    pad = _query_pad(x.query)
    query = (x.query.unflatten(2, (-1, 2, x.n, 1)) * pad).reshape(b, t, -1, 2 * d).transpose(1, 2)
    out, _ = sdpa_attention_forward(_KernelModule(2 * x.n), query, x.key_packed, x.value_packed, _mask(x), scaling=x.scaling)
    return differential_combine(out, x.lam, x.n, dim=2)


def two_sdpa(x: AttentionInputs) -> torch.Tensor:
    """(b) DiffLlama's: ``SDPA(Q, K, V_j)`` for the value halves j = 0, 1 (d-wide, fast kernel), V_j repeated."""
    b, t, s, h, g, d = x.shape
    query = x.query.transpose(1, 2)
    halves = x.value_std.view(b, g, 2, s, d)
    outs = []
    for j in range(2):
        value = halves[:, :, j : j + 1].expand(b, g, 2, s, d).reshape(b, 2 * g, s, d)  # head 2g+c holds V_g,j (copy)
        outs.append(sdpa_attention_forward(_KernelModule(x.n), query, x.key_std, value, _mask(x), scaling=x.scaling)[0])
    return differential_combine(torch.cat(outs, dim=-1), x.lam, x.n, dim=2)


def four_sdpa(x: AttentionInputs) -> torch.Tensor:
    """(c) ``SDPA(Q_c, K_c, V_j)`` for maps c and value halves j on d-wide views of a standard-layout cache."""
    b, t, s, h, g, d = x.shape
    query = x.query.view(b, t, g, 2, x.n, d)
    keys, values = x.key_std.view(b, g, 2, s, d), x.value_std.view(b, g, 2, s, d)
    causal = _causal_args(t, s, x.query.device)
    maps = []
    for c in range(2):
        q_c = query[:, :, :, c].reshape(b, t, h, d).transpose(1, 2)  # (B, H, T, d), head g·n + r
        maps.append(
            torch.cat(
                [
                    F.scaled_dot_product_attention(q_c, keys[:, :, c], values[:, :, j], scale=x.scaling, enable_gqa=True, **causal)
                    for j in range(2)
                ],
                dim=-1,
            )
        )
    return (maps[0] - x.lam * maps[1]).transpose(1, 2)


def _materialised(q1, q2, k1, k2, value, lam, mask, out_dtype):
    """``(softmax(q1 k1ᵀ + M) − λ softmax(q2 k2ᵀ + M)) · value`` with float32 softmax; scaling is already in q."""
    s1 = torch.matmul(q1, k1.transpose(-1, -2))
    s2 = torch.matmul(q2, k2.transpose(-1, -2))
    if mask is not None:
        s1 = s1.masked_fill(mask, float("-inf"))
        s2 = s2.masked_fill(mask, float("-inf"))
    diff = torch.softmax(s1, -1, dtype=torch.float32) - lam * torch.softmax(s2, -1, dtype=torch.float32)
    return torch.matmul(diff.to(out_dtype), value)


def blocked(x: AttentionInputs, block: int = 256) -> torch.Tensor:
    """(d) ``A1 − λA2`` materialised per block of ``block`` queries against only the keys it can see (packed cache).

    Rows of a block are ordered (r, t) so that one batched matmul per map serves the n heads of a group. Masking is
    needed only where a block reaches the diagonal.
    """
    b, t, s, h, g, d = x.shape
    q = (x.query * x.scaling).view(b, t, g, 2, x.n, d).permute(0, 2, 3, 4, 1, 5)  # (B, G, 2, n, T, d)
    k1, k2 = x.key_packed[..., :d], x.key_packed[..., d:]  # (B, G, S, d) views, no copy
    offset = s - t
    out = x.query.new_empty(b, t, g, x.n, 2 * d)
    for t0 in range(0, t, block):
        t1 = min(t, t0 + block)
        visible = t1 + offset  # keys beyond the block's last query are never seen
        mask = None
        if visible > t0 + offset + 1:  # the block reaches the diagonal: key s hidden from query i iff s > i + offset
            rows = torch.arange(t0, t1, device=q.device)[:, None] + offset
            mask = torch.arange(visible, device=q.device)[None, :] > rows  # (Tb, Sv)
        qb = q[:, :, :, :, t0:t1].reshape(b, g, 2, -1, d)  # (B, G, 2, n·Tb, d)
        res = _materialised(
            qb[:, :, 0], qb[:, :, 1], k1[:, :, :visible], k2[:, :, :visible],
            x.value_packed[:, :, :visible], x.lam, None if mask is None else mask.repeat(x.n, 1), x.query.dtype,
        )  # (B, G, n·Tb, 2d)
        out[:, t0:t1] = res.view(b, g, x.n, t1 - t0, 2 * d).permute(0, 3, 1, 2, 4)
    return out.view(b, t, h, 2 * d)


def direct(x: AttentionInputs) -> torch.Tensor:
    """(f) Decode: one-shot materialisation on d-wide views of the packed cache (each cache byte read once)."""
    b, t, s, h, g, d = x.shape
    q = (x.query * x.scaling).view(b, t, g, 2, x.n, d).permute(0, 2, 3, 4, 1, 5).reshape(b, g, 2, -1, d)  # (B,G,2,nT,d)
    mask = None
    if t > 1:
        rows = torch.arange(t, device=q.device)[:, None] + (s - t)
        mask = (torch.arange(s, device=q.device)[None, :] > rows).repeat(x.n, 1)
    k = x.key_packed
    res = _materialised(q[:, :, 0], q[:, :, 1], k[..., :d], k[..., d:], x.value_packed, x.lam, mask, x.query.dtype)
    return res.view(b, g, x.n, t, 2 * d).permute(0, 3, 1, 2, 4).reshape(b, t, h, 2 * d)


def direct_padded(x: AttentionInputs) -> torch.Tensor:
    """(f') Decode: ``[Q1|0]``, ``[0|Q2]`` (scale folded into the pad) times the whole packed key in one matmul."""
    b, t, s, h, g, d = x.shape
    pad = _query_pad(x.query, x.scaling)
    q = (x.query.view(b, t, g, 2, x.n, 1, d) * pad).permute(0, 2, 3, 4, 1, 5, 6).reshape(b, g, -1, 2 * d)  # (B,G,2nT,2d)
    scores = torch.matmul(q, x.key_packed.transpose(-1, -2))  # (B, G, 2·n·T, S)
    if t > 1:
        rows = torch.arange(t, device=q.device)[:, None] + (s - t)
        scores = scores.masked_fill(torch.arange(s, device=q.device)[None, :] > rows.repeat(2 * x.n, 1), float("-inf"))
    maps = torch.softmax(scores, -1, dtype=torch.float32).view(b, g, 2, -1, s)
    diff = (maps[:, :, 0] - x.lam * maps[:, :, 1]).to(x.query.dtype)
    res = torch.matmul(diff, x.value_packed)  # (B, G, n·T, 2d)
    return res.view(b, g, x.n, t, 2 * d).permute(0, 3, 1, 2, 4).reshape(b, t, h, 2 * d)


def packed_sdpa(x: AttentionInputs) -> torch.Tensor:
    """(g) Decode (T = 1): the 2n padded query rows of a group become the rows of ONE query "head" per group
    (transformers' ``pack_gqa`` idea), so a single fast SDPA call reads each packed cache byte once, no mask needed.
    For T > 1 it needs a per-row causal mask, so it is offered for decode only (falls back to ``padded_sdpa``)."""
    b, t, s, h, g, d = x.shape
    if t != 1:
        return padded_sdpa(x)
    pad = _query_pad(x.query)
    q = (x.query.view(b, g, 2, x.n, 1, d) * pad).view(b, g, 2 * x.n, 2 * d)  # rows (c, r): [Q1|0], [0|Q2]
    out = F.scaled_dot_product_attention(q, x.key_packed, x.value_packed, scale=x.scaling).view(b, g, 2, x.n, 2 * d)
    return (out[:, :, 0] - x.lam * out[:, :, 1]).view(b, 1, h, 2 * d)


def ours(x: AttentionInputs) -> torch.Tensor:
    """(h) The current modeling file's V1 kernel under ``"sdpa"``, as ``differential_sdpa_attention`` dispatches it:
    ``packed_decode_attention`` for one token without autograd, else ``blocked_differential_attention`` (blocked
    ``A1 − λA2`` with a recomputing backward)."""
    from difftransformer.modeling_difftransformer import blocked_differential_attention, packed_decode_attention

    b, t, s, h, g, d = x.shape
    grad = needs_grad(x.query, x.key_packed, x.value_packed, x.lam)
    if t == 1 and not grad:
        query = x.query.view(b, g, 2, x.n, d)  # (B, G, 2, n, d): a free view of the one token's heads
        return packed_decode_attention(query, x.key_packed, x.value_packed, x.lam, x.scaling).reshape(b, 1, h, 2 * d)
    q = x.query.view(b, t, g, 2, x.n, d).permute(0, 2, 3, 4, 1, 5)  # (B, G, 2, n, T, d) view
    out = blocked_differential_attention(q[:, :, 0], q[:, :, 1], x.key_packed, x.value_packed, x.lam, x.scaling, _mask(x))
    return out.view(b, t, h, 2 * d)  # (B, T, G, n, 2d) → heads h = g·n + r


_FLEX_CACHE: dict = {}


def flex(x: AttentionInputs) -> torch.Tensor:
    """(e) ``torch.compile(flex_attention)`` on padded queries over the packed cache (GQA 2n), causal block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, t, s, h, g, d = x.shape
    if "fn" not in _FLEX_CACHE:
        _FLEX_CACHE["fn"] = torch.compile(flex_attention, dynamic=False)
    mask = None
    if t > 1:
        key = (t, s, x.query.device)
        if key not in _FLEX_CACHE:
            offset = s - t
            _FLEX_CACHE[key] = create_block_mask(lambda _b, _h, qi, ki: ki <= qi + offset, None, None, t, s, device=x.query.device)
        mask = _FLEX_CACHE[key]
    pad = _query_pad(x.query)
    query = (x.query.unflatten(2, (-1, 2, x.n, 1)) * pad).reshape(b, t, -1, 2 * d).transpose(1, 2)
    out = _FLEX_CACHE["fn"](query, x.key_packed, x.value_packed, block_mask=mask, scale=x.scaling, enable_gqa=True)
    return differential_combine(out.transpose(1, 2), x.lam, x.n, dim=2)


STRATEGIES: dict[str, Callable[[AttentionInputs], torch.Tensor]] = {
    "padded_sdpa": padded_sdpa,
    "two_sdpa": two_sdpa,
    "four_sdpa": four_sdpa,
    "blocked": blocked,
    "flex": flex,
    "direct": direct,
    "direct_padded": direct_padded,
    "packed_sdpa": packed_sdpa,
    "ours": ours,
    "blocked64": functools.partial(blocked, block=64),
    "blocked128": functools.partial(blocked, block=128),
}
# Strategies that materialise maps: their memory grows with T·S (autograd keeps every block), so they are offered
# for inference only; training rows time them for information.
MATERIALISING = {"blocked", "blocked64", "blocked128", "direct", "direct_padded"}
# Strategies left out of the default run: exploratory block sizes (``--block`` sets the one of ``blocked``).
OPTIONAL = {"blocked64", "blocked128"}


def check_strategy(fn: Callable[[AttentionInputs], torch.Tensor] | str, x: AttentionInputs,
                   reference: torch.Tensor | None = None) -> dict:
    """Run a strategy (function or name) once and compare with the float64 reference: ``{"max_err", "rel_err", "ok"}``."""
    fn = STRATEGIES[fn] if isinstance(fn, str) else fn
    reference = reference_attention(x) if reference is None else reference
    with torch.no_grad():
        out = fn(x)
    if out.shape != reference.shape:
        return {"max_err": float("inf"), "rel_err": float("inf"), "ok": False, "error": f"shape {tuple(out.shape)}"}
    err = (out.double() - reference).abs().max().item()
    rel = err / reference.abs().max().item()
    return {"max_err": err, "rel_err": rel, "ok": bool(rel <= TOLERANCE[x.query.dtype])}


# ----------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------


# --clock name → harness clock: ``cpu`` is this thread's CPU time (with --threads 1 it leaves out the time other
# processes hold the core, which makes comparisons on a shared machine far less noisy).
CLOCKS = {"wall": "wall", "cpu": "thread"}


def set_clock(name: str) -> None:
    """``wall`` (what a user waits) or ``cpu`` (this thread's CPU time) for every later timing of the process."""
    if name not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {name!r}")
    harness.set_clock(CLOCKS[name])


@dataclass
class Case:
    """One row group of the micro-benchmark."""

    dtype: str
    phase: str  # "prefill" (T = S), "decode" (T = 1), "train" (prefill forward + backward)
    kv_len: int
    n: int
    batch: int = 1
    num_heads: int = 8
    head_dim: int = 64

    @property
    def q_len(self) -> int:
        return 1 if self.phase == "decode" else self.kv_len

    @property
    def label(self) -> str:
        return f"{self.dtype} {self.phase} B={self.batch} T={self.q_len} S={self.kv_len} n={self.n}"


def default_cases(smoke: bool = False, batch: int = 1) -> list[Case]:
    """The brief's grid: fp32/bf16 × n ∈ {2, 1} × prefill 512/2048, decode 128/512/2048, train 512."""
    if smoke:
        return [Case("fp32", "prefill", 64, 2, batch, 4, 16), Case("fp32", "decode", 64, 1, batch, 4, 16),
                Case("bf16", "train", 32, 2, batch, 4, 16)]
    grid = []
    for dtype in ("fp32", "bf16"):
        for n in (2, 1):
            grid += [Case(dtype, "prefill", s, n, batch) for s in (512, 2048)]
            grid += [Case(dtype, "decode", s, n, batch) for s in (128, 512, 2048)]
            grid.append(Case(dtype, "train", 512, n, batch))
    return grid


def run_case(case: Case, strategies: list[str], reps: int, block: int = 256, min_seconds: float = 0.02, progress=None) -> dict:
    """Check every strategy against the float64 reference, then time the correct ones and the Llama yardstick."""
    dtype = DTYPES[case.dtype]
    x = make_inputs(case.batch, case.q_len, case.kv_len, case.num_heads, case.num_heads // case.n, case.head_dim, dtype)
    reference = reference_attention(x)
    fns: dict[str, Callable[[], object]] = {}
    checks: dict[str, dict] = {}
    for name in strategies:
        fn = functools.partial(blocked, block=block) if name == "blocked" else STRATEGIES[name]
        try:
            checks[name] = check_strategy(fn, x, reference)
        except Exception as exc:  # a strategy that cannot run here (e.g. flex on an old torch) is reported, not fatal
            checks[name] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
            continue
        if checks[name]["ok"]:
            fns[name] = _timed_call(fn, x, case.phase)
    fns = {"llama_sdpa": _timed_call(llama_sdpa, x, case.phase), **fns}
    samples = harness.time_interleaved(fns, reps, min_seconds=min_seconds, progress=progress)
    base = statistics.median(samples["llama_sdpa"])
    rows = {}
    for name in ["llama_sdpa", *strategies]:
        row = dict(checks.get(name, {}))
        if name in samples:
            row.update(harness.call_stats(samples[name]))
            row["ratio"] = row["median_s"] / base
        rows[name] = row
    return {"case": case.__dict__ | {"q_len": case.q_len, "label": case.label}, "rows": rows}


def _timed_call(fn, x: AttentionInputs, phase: str) -> Callable[[], object]:
    """Inference phases run under ``no_grad`` (as generate does); ``train`` runs forward and backward."""
    if phase != "train":
        def call():
            with torch.no_grad():
                return fn(x)
        return call
    xg = AttentionInputs(*(t.detach().clone().requires_grad_(True) for t in (x.query, x.key_packed, x.value_packed, x.key_std, x.value_std)),
                         lam=x.lam.detach().clone().requires_grad_(True), n=x.n)
    grad = torch.randn_like(fn(xg))

    def call():
        out = fn(xg)
        out.backward(grad)
        for t in (xg.query, xg.key_packed, xg.value_packed, xg.key_std, xg.value_std, xg.lam):
            t.grad = None
    return call


# ----------------------------------------------------------------------------------------------------------------
# Ops around attention in one decode step
# ----------------------------------------------------------------------------------------------------------------


class _OpCounter(torch.overrides.TorchFunctionMode):
    """Counts top-level torch calls (functions and Tensor methods; attribute reads such as ``.shape`` excluded)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name != "__get__":
            self.names.append(name)
        return func(*args, **(kwargs or {}))


# ours_v1: the modeling file's V1 kernel under "sdpa"; ours_v1_padded: its previous one-padded-SDPA-call path.
DECODE_KINDS = ("llama", "diffllama", "ours_v1", "ours_v2", "ours_v1_padded")


def _decode_setup(kind: str, past: int, batch: int, dtype: torch.dtype, hidden: int, heads: int, kv_heads: int):
    """One attention module of ``kind`` with a DynamicCache holding ``past`` tokens and a one-token decode input."""
    from transformers import DiffLlamaConfig, LlamaConfig
    from transformers.cache_utils import DynamicCache
    from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    from difftransformer import DiffTransformerConfig
    from difftransformer.modeling_difftransformer import DIFF_ATTENTION_CLASSES

    common = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=1,
                  intermediate_size=4 * hidden, vocab_size=128)
    if kind.startswith("ours"):
        cfg = DiffTransformerConfig(**common, diff_version=2 if kind == "ours_v2" else 1)
        module = DIFF_ATTENTION_CLASSES[cfg.diff_version](cfg, 0)
        with torch.no_grad():
            for p in (module.lambda_q1, module.lambda_k1, module.lambda_q2, module.lambda_k2) if cfg.diff_version == 1 else ():
                p.normal_(0, 0.1)
    elif kind == "diffllama":
        cfg = DiffLlamaConfig(**common)
        module = DiffLlamaAttention(cfg, 0)
    else:
        cfg = LlamaConfig(**common)
        module = LlamaAttention(cfg, 0)
    cfg._attn_implementation = "sdpa"
    if kind == "ours_v1_padded":
        from benchmarks.padded_sdpa import PADDED_SDPA

        cfg._attn_implementation = PADDED_SDPA
    module = module.to(dtype).eval()
    rotary = LlamaRotaryEmbedding(cfg)
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        prompt = torch.randn(batch, past, hidden, dtype=dtype)
        module(prompt, rotary(prompt, torch.arange(past)[None]), None, **{CACHE_NAME: cache})
        step = torch.randn(batch, 1, hidden, dtype=dtype)
        pos = rotary(step, torch.tensor([[past]]))
    return module, cache, step, pos


def decode_op_counts(past: int = 128, batch: int = 1, dtype: torch.dtype = torch.float32, hidden: int = 512,
                     heads: int = 8, kv_heads: int = 4) -> dict[str, dict]:
    """Top-level torch calls and time of one attention module's decode step, for ours V1/V2, DiffLlama and Llama.

    The cache is cropped back after every call so each sample decodes the same position.
    """
    result = {}
    for kind in DECODE_KINDS:
        module, cache, step, pos = _decode_setup(kind, past, batch, dtype, hidden, heads, kv_heads)
        with torch.no_grad():
            counter = _OpCounter()
            with counter:
                module(step, pos, None, **{CACHE_NAME: cache})
            cache.crop(-1)
        result[kind] = {"ops": len(counter.names), "op_names": counter.names}
    return result


def time_around_ops(past: int = 128, batch: int = 1, dtype: torch.dtype = torch.float32, reps: int = 15,
                    hidden: int = 512, heads: int = 8, kv_heads: int = 4, min_seconds: float = 0.02) -> dict[str, dict]:
    """Per-call time of the V1 decode-step pieces around the kernel, next to whole attention-module decode steps.

    "query padding" and "combine" are separate ops of the padded path (``ours_v1_padded``); ``ours_v1``'s
    ``packed_decode_attention`` pads inside the kernel call and combines on its ``(B, G, 2, n, 2d)`` output."""
    from difftransformer.modeling_difftransformer import differential_combine as combine

    mods = {kind: _decode_setup(kind, past, batch, dtype, hidden, heads, kv_heads) for kind in DECODE_KINDS}
    v1 = mods["ours_v1"][0]
    d, n = v1.head_dim, v1.pair_stride
    h = v1.num_heads
    query = torch.randn(batch, 1, 2 * h, d, dtype=dtype)
    maps_out = torch.randn(batch, 1, 2 * h, 2 * d, dtype=dtype)
    combined = torch.randn(batch, 1, h, 2 * d, dtype=dtype)
    lam = v1.lambda_full().detach()

    def pad():
        return (query.unflatten(2, (-1, 2, n, 1)) * _query_pad(query)).reshape(batch, 1, -1, 2 * d)

    def norm():  # the module's own per-head norm call, as DiffTransformerAttention.forward makes it
        return v1.subln(combined, scale=1.0 - v1.lambda_init)

    def step(kind):
        module, cache, x, pos = mods[kind]

        def call():
            module(x, pos, None, **{CACHE_NAME: cache})
            cache.crop(-1)
        return call

    fns = {
        "v1 λ recompute": v1.lambda_full,
        "v1 query padding": pad,
        "v1 combine": lambda: combine(maps_out, lam, n, dim=2),
        "v1 per-head RMSNorm·(1−λinit)": norm,
        **{f"attention step {kind}": step(kind) for kind in mods},
    }
    with torch.no_grad():
        samples = harness.time_interleaved(fns, reps, min_seconds=min_seconds)
    return {name: harness.call_stats(s) for name, s in samples.items()}


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------


def format_table(results: list[dict]) -> str:
    """Markdown table: one line per (case, strategy), median time per call, ratio to Llama's SDPA, spread, check."""
    lines = ["| case | strategy | median ms | × llama_sdpa | IQR | max rel err |", "|---|---|---|---|---|---|"]
    for res in results:
        for name, row in res["rows"].items():
            if "median_s" in row:
                err = "" if name == "llama_sdpa" else f"{row['rel_err']:.1e}"
                lines.append(f"| {res['case']['label']} | {name} | {row['median_s'] * 1e3:.3f} | {row['ratio']:.2f} | "
                             f"{row['iqr'] * 100:.0f}% | {err} |")
            else:
                why = row.get("error") or f"WRONG (rel err {row.get('rel_err', float('nan')):.1e})"
                lines.append(f"| {res['case']['label']} | {name} | – | – | – | {why} |")
    return "\n".join(lines)


def pivot_table(results: list[dict]) -> str:
    """Markdown: one line per case, one column per strategy, each cell the median time relative to ``llama_sdpa``
    (the case's Llama time in ms in the second column); ``✗`` marks a strategy that failed its float64 check."""
    names = [n for n in results[0]["rows"] if n != "llama_sdpa"] if results else []
    lines = ["| case | llama ms | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for res in results:
        rows = res["rows"]
        cells = [res["case"]["label"], f"{rows['llama_sdpa']['median_s'] * 1e3:.3g}"]
        for name in names:
            row = rows.get(name, {})
            cells.append(f"{row['ratio']:.2f}" if "ratio" in row else ("✗" if row.get("ok") is False else "–"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default=",".join(s for s in STRATEGIES if s not in OPTIONAL),
                   help=f"comma-separated strategies to check and time, from: {', '.join(STRATEGIES)} "
                   f"(default: all but {', '.join(sorted(OPTIONAL))})")
    p.add_argument("--dtype", default="fp32,bf16", help="comma-separated dtypes: fp32, bf16 (default: both)")
    p.add_argument("--phase", default="prefill,decode,train", help="comma-separated phases: prefill, decode, train")
    p.add_argument("--n", default="2,1", help="comma-separated differential heads per KV group (GQA n; default 2,1)")
    p.add_argument("--lengths", default=None, help="comma-separated KV lengths overriding the defaults "
                   "(prefill 512,2048; decode 128,512,2048; train 512)")
    p.add_argument("--batch", type=int, default=1, help="batch size of every case (default 1)")
    p.add_argument("--block", type=int, default=256, help="query rows per block of the `blocked` strategy (default 256)")
    p.add_argument("--reps", type=int, default=15, help="timed repetitions per strategy; medians are reported (default 15)")
    p.add_argument("--min-time", type=float, default=0.02, help="seconds per timing sample; short calls are looped (default 0.02)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS), help="wall: elapsed time (default); cpu: this "
                   "thread's CPU time — use with --threads 1 on a shared machine")
    p.add_argument("--around", action="store_true", help="also count and time the ops around attention in a decode step")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: checks that everything runs (CI)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    set_clock(args.clock)
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu measures one thread's CPU time: use it with --threads 1")
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        raise SystemExit(f"--strategies: unknown {unknown}; allowed: {', '.join(STRATEGIES)}")
    dtypes, phases = args.dtype.split(","), args.phase.split(",")
    for flag, values, allowed in (("--dtype", dtypes, DTYPES), ("--phase", phases, ("prefill", "decode", "train"))):
        if set(values) - set(allowed):
            raise SystemExit(f"{flag}: unknown {sorted(set(values) - set(allowed))}; allowed: {', '.join(allowed)}")
    ns = [int(v) for v in args.n.split(",")]
    if args.smoke:
        cases, reps, min_time = default_cases(smoke=True, batch=args.batch), 1, 0.0
        if "flex" in strategies and "--strategies" not in " ".join(sys.argv if argv is None else argv):
            strategies.remove("flex")  # compiling takes ~15 s: not in the smoke run unless asked for explicitly
    else:
        reps, min_time = args.reps, args.min_time
        cases = [c for c in default_cases(batch=args.batch) if c.dtype in dtypes and c.phase in phases and c.n in ns]
        if args.lengths:
            lengths = [int(v) for v in args.lengths.split(",")]
            cases = [Case(dt, ph, s, n, args.batch) for dt in dtypes for n in ns for ph in phases for s in lengths]
    results = []
    with tqdm(total=len(cases) * reps, desc="attention micro", file=sys.stderr) as bar:
        for case in cases:
            names = [s for s in strategies if not (case.phase == "train" and s == "flex")]  # flex backward: not compiled here
            results.append(run_case(case, names, reps, args.block, min_time, bar))
    print(format_table(results))
    print("\nTime relative to a same-config Llama's SDPA call (medians):\n")
    print(pivot_table(results))
    out = {"machine": harness.machine_info(torch.get_num_threads()), "args": vars(args), "results": results}
    if args.around:
        around = {}
        for dtype_name in dtypes:
            counts = decode_op_counts(dtype=DTYPES[dtype_name]) if not args.smoke else decode_op_counts(8, 1, DTYPES[dtype_name], 64, 4, 2)
            timing = time_around_ops(dtype=DTYPES[dtype_name], reps=reps, min_seconds=min_time) if not args.smoke else \
                time_around_ops(8, 1, DTYPES[dtype_name], 1, 64, 4, 2, 0.0)
            around[dtype_name] = {"op_counts": {k: v["ops"] for k, v in counts.items()}, "op_names": {k: v["op_names"] for k, v in counts.items()},
                                  "timing": timing}
            print(f"\n{dtype_name}: top-level torch calls in one attention decode step: "
                  + ", ".join(f"{k} {v['ops']}" for k, v in counts.items()))
            for name, row in timing.items():
                print(f"  {name:34s} {row['median_s'] * 1e6:9.1f} µs  (IQR {row['iqr'] * 100:.0f}%)")
        out["around"] = around
    out["provenance"] = harness.provenance("attention_micro.py", argv)
    if args.json:
        harness.write_json(args.json, out, "attention_micro.py", argv)
    return out


if __name__ == "__main__":
    main()
