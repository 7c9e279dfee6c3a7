"""DIFF V1 differential attention as one fused Triton kernel: both softmax maps in one pass over keys and values.

The equation (arXiv 2410.05258, §2.1; docs/model.md), per differential head ``h`` of KV group ``g``::

    A1 = softmax(Q1 K1ᵀ · scale + mask),   A2 = softmax(Q2 K2ᵀ · scale + mask)
    O_h = (A1 − λ·A2) · [V0 | V1]                                   (B, T, H, 2d), value half 0 first

with ``scale = 1/sqrt(d)`` and λ the layer's scalar. Grouped differential attention (``noise_ratio`` r > 1) gives a
group fewer noise rows than signal rows: signal head ``j`` of a group subtracts the group's noise row ``j // r``.

Layout (the standard one every transformers cache holds)::

    query  (B, T, Hq, d)   per KV group g: its n signal rows, then its m = n / r noise rows
                           (r = 1: query head i = (2g + c)·n + j, the checkpoint's row order)
    key    (B, 2G, S, d)   head 2g = K1 (map 1), head 2g + 1 = K2 (map 2)
    value  (B, 2G, S, d)   head 2g = V0, head 2g + 1 = V1: both maps multiply the 2d-wide [V0 | V1]
    output (B, T, G·n, 2d) in the query's dtype

Any strides are accepted (a transposed view of a ``(B, S, 2G, d)`` projection, a slice of a preallocated static cache);
only the last axis is taken to be contiguous (a tensor whose last axis is not is copied first). The T queries are the
last T of the S key positions (query ``t`` sits at position ``S − T + t``): without a mask attention is causal
(bottom-right aligned, which is the usual top-left causal mask when ``T == S`` and "every key" when ``T == 1``); a
boolean mask (True = visible, broadcastable to ``(B, 1, T, S)``, transformers' sdpa mask) is intersected with that
causal mask unless ``is_causal=False``. A query row that sees no key (a padding row) outputs exactly 0 and has zero
gradients.

The kernels (one file, in the layout of Liger-Kernel's ``ops/`` files and Triton's fused-attention tutorial):

* ``_diff_attn_fwd``: a program owns a block of query positions of one KV group and some of its noise rows with their
  r signal rows each, packed as the rows of two tiles (signal rows ordered (signal index, noise row, position), noise
  rows (noise row, position)). Each K/V block is loaded once and serves both maps: two online softmaxes (running
  maximum and sum per row, float32), both maps times the 2d-wide value block, and ``O = acc1/l1 − λ·acc2/l2`` at the
  end. Blocks above the causal diagonal are skipped; blocks wholly below it run without any masking; the boolean mask
  is loaded tile by tile when given. The noise map is computed once for its r signal maps.
* decode (one query token, no autograd): the same kernel with all of a group's n + m rows in one program's tiles, so
  every cache byte is read once per group, split over the keys (flash-decoding) when the batch has too few groups to
  fill the GPU, and ``_diff_attn_decode_combine`` merging the splits.
* backward (flash-attention style, recomputing each map from its saved per-row log-sum-exp; no T×S map is stored):
  ``_diff_attn_bwd_preprocess`` computes ``δ1 = rowsum(dO ∘ O1)`` and ``δ2 = rowsum(dO' ∘ O2)`` with
  ``O1 = O + λ·O2`` and ``dO'`` the sum of dO over a noise row's r signal heads; ``_diff_attn_bwd_dkdv`` owns a block
  of keys of one group and loops over every query row of the group (all n + m heads), so key and value gradients are
  summed over the group's heads in registers (deterministic, no atomics); ``_diff_attn_bwd_dq`` owns query rows like
  the forward.
  Map 1 back-propagates ``dO``, map 2 ``−λ·dO'``; ``dλ = −Σ δ2`` over every noise row.

Memory saved for the backward: the inputs and the output (references: the projections and the next operation keep
them too, unless that operation saves a converted copy), the per-row log-sum-exp of both maps (float32,
``(B, G·n, T)`` and ``(B, G·m, T)``) and one extra tensor, the noise map's un-differenced output ``O2 = A2·V``
(``(B, T, G·m, 2d)`` in the input dtype: the size of the output when r = 1, 1/r of it otherwise), from which
``O1 = O + λ·O2`` is rebuilt for ``δ1``. Without it the backward would need a third pass over keys and values.

Arithmetic: both maps' scores together are a same-shape Llama's ``QKᵀ`` (the Llama has 2H query heads of width d);
both maps times the 2d-wide value are twice a Llama's ``PV``: 1.5× a Llama's attention arithmetic, against 2× for the
zero-padded single call. Under autograd the backward recomputes scores twice (once for key/value gradients, once for
query gradients), as Triton's fused-attention tutorial does.

The host code runs as three PyTorch custom ops (``torch.library.custom_op``, namespace ``difftransformer``), eager
and compiled alike: ``diff_attn_v1_forward`` (output, ``O2`` and both log-sum-exps: what the backward needs; its
autograd formula is ``diff_attn_v1_backward``, which returns the gradients of q, k, v and λ) and
``diff_attn_v1_inference`` (no autograd: the decode path for one query token, else the forward without statistics).
Their fake implementations give the outputs' shapes, dtypes and strides, so ``torch.compile(fullgraph=True)`` traces
them without graph breaks and inductor (CUDA graphs included) calls them as opaque kernels. The backward op is not
differentiable (a second-order gradient raises).

Triton is optional: without it (or without a CUDA device, unless ``TRITON_INTERPRET=1``) :func:`is_available` is
False, the module still imports and nothing here runs. The kernels are decorated with ``triton.jit`` on first use,
so ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, which tests/test_triton_difftransformer.py uses) takes effect
whenever it is set before the first call, even after triton itself was imported.
"""

import contextlib
import math
import os

import torch

try:  # optional dependency: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Launch parameters by kernel for H100/H200 (bf16/fp16 at head_dim 64 and 128). Chosen without a GPU: each kernel was
# compiled for sm_90 with Triton 3.9's own ptxas over a small grid of tile sizes and warps, and these are the largest
# tiles that fit in registers without spilling at r = 1 and no mask (about 210–255 registers per thread). float32
# tiles take twice the registers of 16-bit ones, so float32 inputs get the tiles of a head twice as wide. Not yet
# timed: the first thing to tune on a GPU. ``rows``: signal rows of a tile (query positions × r; at least 16
# positions, as tl.dot needs 16 rows on the GPU); ``block_n``: keys of a tile; ``units`` (forward, dq; default 1):
# noise rows of a group per program, with their signal rows, sharing each K/V tile (GQA reads K/V once per ``units``
# noise rows instead of once per noise row; the decode path always takes all of a group's rows). ``_TUNING`` overrides
# them per kernel (the tests shrink the tiles so that tiny problems cross several; a decode entry may fix ``splits``).
_TUNING: dict[str, dict] = {}
_MIN_DOT = 16  # the smallest tile side tl.dot accepts on NVIDIA GPUs


def _launch_config(kind: str, d_pad: int, dtype: torch.dtype) -> dict:
    small = d_pad * (2 if dtype == torch.float32 else 1) <= 64
    defaults = {
        "forward": dict(rows=64 if small else 32, block_n=32, num_warps=8, num_stages=2),
        "decode": dict(block_n=64 if dtype != torch.float32 else 32, num_warps=8, num_stages=2, max_units=32,
                       min_split_blocks=2),
        "preprocess": dict(rows=32 if small else 16, num_warps=4),
        "dkdv": dict(rows=16, block_n=32, num_warps=8, num_stages=2),
        "dq": dict(rows=64 if small else 32, block_n=32, num_warps=8, num_stages=2),
    }[kind]
    return {**defaults, **_TUNING.get(kind, {})}


def _block_t(rows: int, r_pad: int, units: int = 1) -> int:
    """Query positions per tile: ``rows`` signal rows shared by r_pad × units rows per position, at least 16."""
    return max(_MIN_DOT, rows // (r_pad * units))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def is_available(device) -> bool:
    """Whether the fused kernel can run on ``device``: Triton is importable and the device is a CUDA device (any device
    when Triton's CPU interpreter is on, ``TRITON_INTERPRET=1``)."""
    if triton is None:
        return False
    return _interpreting() or torch.device(device).type == "cuda"


# ----------------------------------------------------------------------------------------------------------------------
# Kernels. Defined as plain functions and decorated with triton.jit on first use (see _jitted), so that the
# interpreter switch is read when a kernel first runs, not when this module is imported.
# ----------------------------------------------------------------------------------------------------------------------

_JIT_NAMES: list[str] = []
_RAW_FUNCTIONS: dict = {}
_INTERPRETED_FUNCTIONS: dict = {}  # the interpreter's versions of some device functions (see _sum)
_JIT_STATE: dict = {"interpret": None}


def _jit(fn):
    _JIT_NAMES.append(fn.__name__)
    _RAW_FUNCTIONS[fn.__name__] = fn
    return fn


def _jitted():
    """Decorate every kernel (and device function) with triton.jit, again if the interpreter switch changed since.
    Device functions call each other through this module's globals, so the decorated objects replace them there."""
    interpret = _interpreting()
    if _JIT_STATE["interpret"] is not interpret:
        for name in _JIT_NAMES:
            fn = _INTERPRETED_FUNCTIONS.get(name, _RAW_FUNCTIONS[name]) if interpret else _RAW_FUNCTIONS[name]
            globals()[name] = triton.jit(fn)
        _JIT_STATE["interpret"] = interpret
    return globals()



if triton is not None:
    # Conventions shared by the kernels. IN_DTYPE: the inputs' element type. OP_DTYPE: the type of tl.dot operands,
    # IN_DTYPE except under Triton's CPU interpreter with bfloat16 inputs, which multiplies bfloat16 tiles as their
    # raw bits: there tiles are widened to float32 after loading (exact: the product of two bfloat16 values is exact
    # in float32 and the accumulation is float32, as on the GPU's tensor cores), and the probabilities fed to the
    # value product are still rounded to IN_DTYPE first. DOT_PREC: "ieee" for float32 inputs (no TF32).
    # Rows of the 2d-wide value and output: column c·D_PAD + i is value half c, feature i (i < HEAD_DIM).
    # Log-sum-exps are base 2 (scores are scaled by scale·log2(e) and exponentiated with exp2).

    # Reductions: tl.sum / tl.max on the GPU. Under the interpreter, tl.reduce with Triton's own combine functions
    # (which the interpreter evaluates with numpy): tl.sum and tl.max are themselves jit functions, decorated when
    # triton is imported, so they run under the interpreter only if TRITON_INTERPRET was set before that import (in a
    # test run, torch._dynamo usually imports triton first); builtins and this module's functions do not care.
    @_jit
    def _sum(x, AXIS: tl.constexpr):
        return tl.sum(x, AXIS)

    @_jit
    def _max(x, AXIS: tl.constexpr):
        return tl.max(x, AXIS)

    def _sum_interpreted(x, AXIS: tl.constexpr):
        return tl.reduce(x, AXIS, tl.standard._sum_combine)

    def _max_interpreted(x, AXIS: tl.constexpr):
        return tl.reduce(x, AXIS, tl.standard._elementwise_max)

    if all(hasattr(getattr(tl, "standard", None), name) for name in ("_sum_combine", "_elementwise_max")):
        _INTERPRETED_FUNCTIONS.update(_sum=_sum_interpreted, _max=_max_interpreted)

    @_jit
    def _visible(t_rows, t_ok, keys, MASK_B, stride_mt, stride_ms, S, T, IS_CAUSAL: tl.constexpr,
                 HAS_MASK: tl.constexpr, KEYS_FIRST: tl.constexpr):
        # Which keys the query rows (index t, position S − T + t) see: in range, causal, and the boolean mask.
        # Shape (rows, keys), or (keys, rows) with KEYS_FIRST.
        if KEYS_FIRST:
            t_b = t_rows[None, :]
            k_b = keys[:, None]
            vis = (k_b < S) & t_ok[None, :]
        else:
            t_b = t_rows[:, None]
            k_b = keys[None, :]
            vis = (k_b < S) & t_ok[:, None]
        if IS_CAUSAL:
            vis = vis & (k_b <= S - T + t_b)
        if HAS_MASK:
            bits = tl.load(MASK_B + t_b * stride_mt + k_b * stride_ms, mask=vis, other=0)
            vis = vis & (bits != 0)
        return vis

    @_jit
    def _packed_rows(t0, u0, T, M_NOISE, R: tl.constexpr, R_PAD: tl.constexpr, UNITS: tl.constexpr,
                     BLOCK_T: tl.constexpr):
        # The rows of a program's two tiles. Noise tile: (noise row u0 + i, position t0 + j), UNITS × BLOCK_T rows.
        # Signal tile: (signal index s < r, noise row, position), R_PAD × UNITS × BLOCK_T rows, so that signal row i
        # pairs with noise row i mod (UNITS · BLOCK_T). Returns each row's head within the group, position, validity.
        ROWS_N: tl.constexpr = UNITS * BLOCK_T
        i_s = tl.arange(0, R_PAD * ROWS_N)
        sig = i_s // ROWS_N
        unit_s = u0 + (i_s // BLOCK_T) % UNITS
        t_s = t0 + i_s % BLOCK_T
        ok_s = (sig < R) & (unit_s < M_NOISE) & (t_s < T)
        i_n = tl.arange(0, ROWS_N)
        unit_n = u0 + i_n // BLOCK_T
        t_n = t0 + i_n % BLOCK_T
        ok_n = (unit_n < M_NOISE) & (t_n < T)
        return unit_s * R + sig, t_s, ok_s, unit_n, t_n, ok_n

    @_jit
    def _key_ranges(lo, span, t0, S, T, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                    HAS_MASK: tl.constexpr):
        # Keys [lo, hi) a block of query rows t0 … t0 + BLOCK_T − 1 can see (causal blocks above the diagonal are
        # skipped), and the end of the whole K/V blocks from lo on that every row sees in full (run without masks).
        hi = tl.minimum(S, lo + span)
        full = hi
        if IS_CAUSAL:
            hi = tl.minimum(hi, S - T + t0 + BLOCK_T)
            full = tl.minimum(full, S - T + t0 + 1)
        full = lo + tl.maximum(full - lo, 0) // BLOCK_N * BLOCK_N
        if HAS_MASK:
            full = lo
        return hi, full

    @_jit
    def _fwd_inner(acc1, l1, m1, acc2, l2, m2, q1, q2, K1_B, K2_B, V_ROW, MASK_B, t_s, ok_s, t_n, ok_n, d_ok, c_ok,
                   stride_ks, stride_vs, stride_mt, stride_ms, S, T, qk_scale, start, end,
                   D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                   HAS_MASK: tl.constexpr, IN_DTYPE: tl.constexpr, OP_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):
        # One sweep over K/V blocks [start, end) for both maps: each block's K1, K2 and 2d-wide value loaded once.
        # MASKED=False only for blocks that every row sees in full.
        offs_d = tl.arange(0, D_PAD)
        for n0 in range(start, end, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            k_ok = keys < S
            k_mask = k_ok[:, None] & d_ok[None, :]
            k1 = tl.load(K1_B + keys[:, None] * stride_ks + offs_d[None, :], mask=k_mask, other=0.0).to(OP_DTYPE)
            k2 = tl.load(K2_B + keys[:, None] * stride_ks + offs_d[None, :], mask=k_mask, other=0.0).to(OP_DTYPE)
            v = tl.load(V_ROW[None, :] + keys[:, None] * stride_vs, mask=k_ok[:, None] & c_ok[None, :],
                        other=0.0).to(OP_DTYPE)
            s1 = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC) * qk_scale
            s2 = tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) * qk_scale
            if MASKED:
                vis1 = _visible(t_s, ok_s, keys, MASK_B, stride_mt, stride_ms, S, T, IS_CAUSAL, HAS_MASK, False)
                vis2 = _visible(t_n, ok_n, keys, MASK_B, stride_mt, stride_ms, S, T, IS_CAUSAL, HAS_MASK, False)
                s1 = tl.where(vis1, s1, float("-inf"))
                s2 = tl.where(vis2, s2, float("-inf"))
            # Online softmax. A row that has seen no key yet keeps max −inf and sum 0; its exponents are taken
            # against 0 so that no −inf − (−inf) appears.
            m1_new = tl.maximum(m1, _max(s1, 1))
            m1_ref = tl.where(m1_new == float("-inf"), 0.0, m1_new)
            p1 = tl.math.exp2(s1 - m1_ref[:, None])
            alpha1 = tl.math.exp2(m1 - m1_ref)
            l1 = l1 * alpha1 + _sum(p1, 1)
            acc1 = tl.dot(p1.to(IN_DTYPE).to(OP_DTYPE), v, acc1 * alpha1[:, None], input_precision=DOT_PREC)
            m1 = m1_new
            m2_new = tl.maximum(m2, _max(s2, 1))
            m2_ref = tl.where(m2_new == float("-inf"), 0.0, m2_new)
            p2 = tl.math.exp2(s2 - m2_ref[:, None])
            alpha2 = tl.math.exp2(m2 - m2_ref)
            l2 = l2 * alpha2 + _sum(p2, 1)
            acc2 = tl.dot(p2.to(IN_DTYPE).to(OP_DTYPE), v, acc2 * alpha2[:, None], input_precision=DOT_PREC)
            m2 = m2_new
        return acc1, l1, m1, acc2, l2, m2

    @_jit
    def _diff_attn_fwd(Q, K, V, LAM, MASK, OUT, O2, LSE1, LSE2,
                       stride_qb, stride_qt, stride_qh, stride_kb, stride_kh, stride_ks,
                       stride_vb, stride_vh, stride_vs, stride_mb, stride_mt, stride_ms,
                       stride_os, stride_ob, stride_ot, stride_oh, stride_ps, stride_pb, stride_pt, stride_ph,
                       stride_l1s, stride_l2s, T, S, G, N_SIG, M_NOISE, split_len, qk_scale,
                       HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
                       UNITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                       HAS_MASK: tl.constexpr, SPLIT: tl.constexpr, SAVE_STATS: tl.constexpr,
                       IN_DTYPE: tl.constexpr, OP_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):
        # Grid: (query blocks, B × G × noise-row blocks, key splits). SPLIT: write each split's normalised outputs
        # of both maps and their log-sum-exps (OUT, O2, LSE1, LSE2 are then float32 partials) for the combine kernel.
        ROWS_N: tl.constexpr = UNITS * BLOCK_T
        ROWS_S: tl.constexpr = R_PAD * ROWS_N
        pid_t = tl.program_id(0)
        pid_bgu = tl.program_id(1)
        pid_s = tl.program_id(2)
        unit_blocks = (M_NOISE + UNITS - 1) // UNITS
        u0 = (pid_bgu % unit_blocks) * UNITS
        g = (pid_bgu // unit_blocks) % G
        b = (pid_bgu // unit_blocks // G).to(tl.int64)
        t0 = pid_t * BLOCK_T
        head_s, t_s, ok_s, unit_n, t_n, ok_n = _packed_rows(t0, u0, T, M_NOISE, R, R_PAD, UNITS, BLOCK_T)
        group_q = g * (N_SIG + M_NOISE)
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < HEAD_DIM
        cols = tl.arange(0, 2 * D_PAD)
        half = cols // D_PAD
        c_d = cols % D_PAD
        c_ok = c_d < HEAD_DIM
        out_cols = half * HEAD_DIM + c_d

        Q_B = Q + b * stride_qb
        q1 = tl.load(Q_B + t_s[:, None] * stride_qt + (group_q + head_s)[:, None] * stride_qh + offs_d[None, :],
                     mask=ok_s[:, None] & d_ok[None, :], other=0.0).to(OP_DTYPE)
        q2 = tl.load(Q_B + t_n[:, None] * stride_qt + (group_q + N_SIG + unit_n)[:, None] * stride_qh
                     + offs_d[None, :], mask=ok_n[:, None] & d_ok[None, :], other=0.0).to(OP_DTYPE)
        K1_B = K + b * stride_kb + (2 * g) * stride_kh
        K2_B = K1_B + stride_kh
        V_ROW = V + b * stride_vb + (2 * g + half) * stride_vh + c_d
        MASK_B = MASK + b * stride_mb

        acc1 = tl.full((ROWS_S, 2 * D_PAD), 0.0, dtype=tl.float32)
        l1 = tl.full((ROWS_S,), 0.0, dtype=tl.float32)
        m1 = tl.full((ROWS_S,), float("-inf"), dtype=tl.float32)
        acc2 = tl.full((ROWS_N, 2 * D_PAD), 0.0, dtype=tl.float32)
        l2 = tl.full((ROWS_N,), 0.0, dtype=tl.float32)
        m2 = tl.full((ROWS_N,), float("-inf"), dtype=tl.float32)

        lo = pid_s * split_len
        hi, full = _key_ranges(lo, split_len, t0, S, T, BLOCK_T, BLOCK_N, IS_CAUSAL, HAS_MASK)
        acc1, l1, m1, acc2, l2, m2 = _fwd_inner(
            acc1, l1, m1, acc2, l2, m2, q1, q2, K1_B, K2_B, V_ROW, MASK_B, t_s, ok_s, t_n, ok_n, d_ok, c_ok,
            stride_ks, stride_vs, stride_mt, stride_ms, S, T, qk_scale, lo, full,
            D_PAD, BLOCK_N, False, IS_CAUSAL, HAS_MASK, IN_DTYPE, OP_DTYPE, DOT_PREC)
        acc1, l1, m1, acc2, l2, m2 = _fwd_inner(
            acc1, l1, m1, acc2, l2, m2, q1, q2, K1_B, K2_B, V_ROW, MASK_B, t_s, ok_s, t_n, ok_n, d_ok, c_ok,
            stride_ks, stride_vs, stride_mt, stride_ms, S, T, qk_scale, full, hi,
            D_PAD, BLOCK_N, True, IS_CAUSAL, HAS_MASK, IN_DTYPE, OP_DTYPE, DOT_PREC)

        # A row that saw no key has l = 0 and acc = 0: its outputs are 0.
        l1_div = tl.where(l1 == 0.0, 1.0, l1)
        l2_div = tl.where(l2 == 0.0, 1.0, l2)
        o1 = acc1 / l1_div[:, None]
        o2 = acc2 / l2_div[:, None]
        store_s = ok_s[:, None] & c_ok[None, :]
        store_n = ok_n[:, None] & c_ok[None, :]
        OUT_S = (OUT + pid_s * stride_os + b * stride_ob + t_s[:, None] * stride_ot
                 + (g * N_SIG + head_s)[:, None] * stride_oh + out_cols[None, :])
        O2_N = (O2 + pid_s * stride_ps + b * stride_pb + t_n[:, None] * stride_pt
                + (g * M_NOISE + unit_n)[:, None] * stride_ph + out_cols[None, :])
        LSE1_S = LSE1 + pid_s * stride_l1s + ((b * G + g) * N_SIG + head_s) * T + t_s
        LSE2_N = LSE2 + pid_s * stride_l2s + ((b * G + g) * M_NOISE + unit_n) * T + t_n
        if SPLIT:
            tl.store(OUT_S, o1, mask=store_s)
            tl.store(O2_N, o2, mask=store_n)
            tl.store(LSE1_S, tl.where(l1 == 0.0, float("-inf"), m1 + tl.math.log2(l1_div)), mask=ok_s)
            tl.store(LSE2_N, tl.where(l2 == 0.0, float("-inf"), m2 + tl.math.log2(l2_div)), mask=ok_n)
        else:
            lam = tl.load(LAM)
            if R_PAD == 1:
                o2_s = o2
            else:  # the noise row of signal row i is row i mod ROWS_N
                o2_s = tl.reshape(tl.broadcast_to(tl.reshape(o2, (1, ROWS_N, 2 * D_PAD)), (R_PAD, ROWS_N, 2 * D_PAD)),
                                  (ROWS_S, 2 * D_PAD))
            tl.store(OUT_S, (o1 - lam * o2_s).to(OUT.dtype.element_ty), mask=store_s)
            if SAVE_STATS:
                # The backward's row statistics: log-sum-exp, +inf for a row that sees no key (its P is 0 there).
                tl.store(O2_N, o2.to(O2.dtype.element_ty), mask=store_n)
                tl.store(LSE1_S, tl.where(l1 == 0.0, float("inf"), m1 + tl.math.log2(l1_div)), mask=ok_s)
                tl.store(LSE2_N, tl.where(l2 == 0.0, float("inf"), m2 + tl.math.log2(l2_div)), mask=ok_n)

    @_jit
    def _merge_splits(PO, PL, row, rows_total, b, t, B, T, NSPLIT, out_cols, c_ok, HEAD_DIM: tl.constexpr,
                      SPLITS_PAD: tl.constexpr):
        # Σ_s 2^lse_s · o_s / Σ_s 2^lse_s over the key splits of one row (0 for a row no split saw a key of).
        sp = tl.arange(0, SPLITS_PAD)
        sp_ok = sp < NSPLIT
        lse = tl.load(PL + sp * (B * rows_total * T) + (b * rows_total + row) * T + t, mask=sp_ok, other=float("-inf"))
        top = _max(lse, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.math.exp2(lse - top)
        den = _sum(w, 0)
        parts = tl.load(PO + ((sp * B + b) * T + t)[:, None] * (rows_total * 2 * HEAD_DIM) + row * (2 * HEAD_DIM)
                        + out_cols[None, :], mask=sp_ok[:, None] & c_ok[None, :], other=0.0)
        return _sum(w[:, None] * parts, 0) / tl.where(den == 0.0, 1.0, den)

    @_jit
    def _diff_attn_decode_combine(PO1, PO2, PL1, PL2, LAM, OUT, stride_ob, stride_ot, stride_oh, B, T, G, N_SIG,
                                  M_NOISE, NSPLIT, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, R: tl.constexpr,
                                  SPLITS_PAD: tl.constexpr):
        # Grid: (B × T, G × n). Merges one signal row's splits and its noise row's, then O = O1 − λ·O2.
        pid_bt = tl.program_id(0)
        h = tl.program_id(1)
        b = (pid_bt // T).to(tl.int64)
        t = pid_bt % T
        g = h // N_SIG
        noise = g * M_NOISE + (h % N_SIG) // R
        cols = tl.arange(0, 2 * D_PAD)
        c_d = cols % D_PAD
        c_ok = c_d < HEAD_DIM
        out_cols = (cols // D_PAD) * HEAD_DIM + c_d
        o1 = _merge_splits(PO1, PL1, h, G * N_SIG, b, t, B, T, NSPLIT, out_cols, c_ok, HEAD_DIM, SPLITS_PAD)
        o2 = _merge_splits(PO2, PL2, noise, G * M_NOISE, b, t, B, T, NSPLIT, out_cols, c_ok, HEAD_DIM, SPLITS_PAD)
        out = o1 - tl.load(LAM) * o2
        tl.store(OUT + b * stride_ob + t * stride_ot + h * stride_oh + out_cols, out.to(OUT.dtype.element_ty),
                 mask=c_ok)

    @_jit
    def _diff_attn_bwd_preprocess(OUT, O2, DO, LAM, DELTA1, DELTA2, stride_ob, stride_ot, stride_oh,
                                  stride_pb, stride_pt, stride_ph, stride_db, stride_dt, stride_dh, T, G, N_SIG,
                                  M_NOISE, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, R: tl.constexpr,
                                  BLOCK_T: tl.constexpr):
        # Grid: (query blocks, B × G × m). δ1 = rowsum(dO ∘ (O + λ·O2)) for the r signal rows of a noise row and
        # δ2 = rowsum(dO' ∘ O2), dO' = the sum of their dO (map 2's gradient before its factor −λ).
        pid_t = tl.program_id(0)
        pid_bgu = tl.program_id(1)
        u = pid_bgu % M_NOISE
        g = (pid_bgu // M_NOISE) % G
        b = (pid_bgu // M_NOISE // G).to(tl.int64)
        t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < T
        cols = tl.arange(0, 2 * D_PAD)
        c_d = cols % D_PAD
        c_ok = c_d < HEAD_DIM
        out_cols = (cols // D_PAD) * HEAD_DIM + c_d
        ok = t_ok[:, None] & c_ok[None, :]
        lam = tl.load(LAM)
        o2 = tl.load(O2 + b * stride_pb + t[:, None] * stride_pt + (g * M_NOISE + u) * stride_ph + out_cols[None, :],
                     mask=ok, other=0.0).to(tl.float32)
        dsum = tl.full((BLOCK_T, 2 * D_PAD), 0.0, dtype=tl.float32)
        for s in tl.static_range(R):
            h = g * N_SIG + u * R + s
            do = tl.load(DO + b * stride_db + t[:, None] * stride_dt + h * stride_dh + out_cols[None, :], mask=ok,
                         other=0.0).to(tl.float32)
            o = tl.load(OUT + b * stride_ob + t[:, None] * stride_ot + h * stride_oh + out_cols[None, :], mask=ok,
                        other=0.0).to(tl.float32)
            tl.store(DELTA1 + (b * G * N_SIG + h) * T + t, _sum(do * (o + lam * o2), 1), mask=t_ok)
            dsum += do
        tl.store(DELTA2 + ((b * G + g) * M_NOISE + u) * T + t, _sum(dsum * o2, 1), mask=t_ok)

    @_jit
    def _bwd_kv_inner(dk1, dk2, dv, k1, k2, v, Q1_B, Q2_B, DO_B, L1_B, L2_B, D1_B, D2_B, MASK_B, lam, keys,
                      stride_qt, stride_qh, stride_dt, stride_dh, stride_mt, stride_ms, T, S, qk_scale, start, end,
                      HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
                      BLOCK_T: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                      IN_DTYPE: tl.constexpr, OP_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):
        # Query blocks [start, end) of one noise row and its r signal rows against one K/V block, in transposed
        # tiles (keys × rows). Map 1 back-propagates dO, map 2 −λ·dO' (dO' summed over the r signal rows).
        i_s = tl.arange(0, R_PAD * BLOCK_T)
        sig = i_s // BLOCK_T
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < HEAD_DIM
        cols = tl.arange(0, 2 * D_PAD)
        c_d = cols % D_PAD
        c_ok = c_d < HEAD_DIM
        out_cols = (cols // D_PAD) * HEAD_DIM + c_d
        for t0 in range(start, end, BLOCK_T):
            t_s = t0 + i_s % BLOCK_T
            ok_s = (sig < R) & (t_s < T)
            t_n = t0 + tl.arange(0, BLOCK_T)
            ok_n = t_n < T
            q1 = tl.load(Q1_B + t_s[:, None] * stride_qt + sig[:, None] * stride_qh + offs_d[None, :],
                         mask=ok_s[:, None] & d_ok[None, :], other=0.0).to(OP_DTYPE)
            do = tl.load(DO_B + t_s[:, None] * stride_dt + sig[:, None] * stride_dh + out_cols[None, :],
                         mask=ok_s[:, None] & c_ok[None, :], other=0.0)
            lse1 = tl.load(L1_B + sig * T + t_s, mask=ok_s, other=float("inf"))
            delta1 = tl.load(D1_B + sig * T + t_s, mask=ok_s, other=0.0)
            p1 = tl.math.exp2(tl.dot(k1, tl.trans(q1), input_precision=DOT_PREC) * qk_scale - lse1[None, :])
            if MASKED:
                p1 = tl.where(_visible(t_s, ok_s, keys, MASK_B, stride_mt, stride_ms, S, T, IS_CAUSAL, HAS_MASK, True),
                              p1, 0.0)
            if R_PAD == 1:
                dsum = do
            else:  # dO' of the noise row: the sum over its r signal rows, rounded to the inputs' type
                dsum = _sum(tl.reshape(do.to(tl.float32), (R_PAD, BLOCK_T, 2 * D_PAD)), 0).to(IN_DTYPE)
            do = do.to(OP_DTYPE)
            dsum = dsum.to(OP_DTYPE)
            dv = tl.dot(p1.to(IN_DTYPE).to(OP_DTYPE), do, dv, input_precision=DOT_PREC)
            ds1 = p1 * (tl.dot(v, tl.trans(do), input_precision=DOT_PREC) - delta1[None, :])
            dk1 = tl.dot(ds1.to(IN_DTYPE).to(OP_DTYPE), q1, dk1, input_precision=DOT_PREC)

            q2 = tl.load(Q2_B + t_n[:, None] * stride_qt + offs_d[None, :], mask=ok_n[:, None] & d_ok[None, :],
                         other=0.0).to(OP_DTYPE)
            lse2 = tl.load(L2_B + t_n, mask=ok_n, other=float("inf"))
            delta2 = tl.load(D2_B + t_n, mask=ok_n, other=0.0)
            p2 = tl.math.exp2(tl.dot(k2, tl.trans(q2), input_precision=DOT_PREC) * qk_scale - lse2[None, :])
            if MASKED:
                p2 = tl.where(_visible(t_n, ok_n, keys, MASK_B, stride_mt, stride_ms, S, T, IS_CAUSAL, HAS_MASK, True),
                              p2, 0.0)
            dv = tl.dot((p2 * -lam).to(IN_DTYPE).to(OP_DTYPE), dsum, dv, input_precision=DOT_PREC)
            ds2 = p2 * (tl.dot(v, tl.trans(dsum), input_precision=DOT_PREC) - delta2[None, :]) * -lam
            dk2 = tl.dot(ds2.to(IN_DTYPE).to(OP_DTYPE), q2, dk2, input_precision=DOT_PREC)
        return dk1, dk2, dv

    @_jit
    def _diff_attn_bwd_dkdv(Q, K, V, DO, LAM, MASK, LSE1, LSE2, DELTA1, DELTA2, DK, DV,
                            stride_qb, stride_qt, stride_qh, stride_kb, stride_kh, stride_ks,
                            stride_vb, stride_vh, stride_vs, stride_db, stride_dt, stride_dh,
                            stride_mb, stride_mt, stride_ms, stride_dkb, stride_dkh, stride_dks,
                            stride_dvb, stride_dvh, stride_dvs, T, S, G, N_SIG, M_NOISE, qk_scale, sm_scale,
                            HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                            HAS_MASK: tl.constexpr, IN_DTYPE: tl.constexpr, OP_DTYPE: tl.constexpr,
                            DOT_PREC: tl.constexpr):
        # Grid: (key blocks, B × G). The program loops over every query row of its group (n signal + m noise heads)
        # that can see its keys, so the K1/K2/V gradients sum over the group's heads in registers (deterministic).
        pid_n = tl.program_id(0)
        pid_bg = tl.program_id(1)
        g = pid_bg % G
        b = (pid_bg // G).to(tl.int64)
        n0 = pid_n * BLOCK_N
        keys = n0 + tl.arange(0, BLOCK_N)
        k_ok = keys < S
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < HEAD_DIM
        cols = tl.arange(0, 2 * D_PAD)
        half = cols // D_PAD
        c_d = cols % D_PAD
        c_ok = c_d < HEAD_DIM
        k_mask = k_ok[:, None] & d_ok[None, :]
        v_mask = k_ok[:, None] & c_ok[None, :]
        K1_B = K + b * stride_kb + (2 * g) * stride_kh + keys[:, None] * stride_ks + offs_d[None, :]
        k1 = tl.load(K1_B, mask=k_mask, other=0.0).to(OP_DTYPE)
        k2 = tl.load(K1_B + stride_kh, mask=k_mask, other=0.0).to(OP_DTYPE)
        v = tl.load(V + b * stride_vb + (2 * g + half)[None, :] * stride_vh + c_d[None, :] + keys[:, None] * stride_vs,
                    mask=v_mask, other=0.0).to(OP_DTYPE)
        lam = tl.load(LAM)
        dk1 = tl.full((BLOCK_N, D_PAD), 0.0, dtype=tl.float32)
        dk2 = tl.full((BLOCK_N, D_PAD), 0.0, dtype=tl.float32)
        dv = tl.full((BLOCK_N, 2 * D_PAD), 0.0, dtype=tl.float32)

        # Query blocks that see these keys: [t_lo, T) under the causal mask; those from t_full on see all of them.
        t_end = (T + BLOCK_T - 1) // BLOCK_T * BLOCK_T
        t_lo = 0
        t_full = 0
        if IS_CAUSAL:
            t_lo = tl.maximum(n0 - (S - T), 0) // BLOCK_T * BLOCK_T
            t_full = (tl.maximum(n0 + BLOCK_N - 1 - (S - T), 0) + BLOCK_T - 1) // BLOCK_T * BLOCK_T
            t_full = tl.maximum(tl.minimum(t_full, t_end), t_lo)
        if HAS_MASK:
            t_full = t_end
        t_full = tl.where(n0 + BLOCK_N > S, t_end, t_full)

        MASK_B = MASK + b * stride_mb
        for u in range(0, M_NOISE):
            Q1_B = Q + b * stride_qb + (g * (N_SIG + M_NOISE) + u * R) * stride_qh
            Q2_B = Q + b * stride_qb + (g * (N_SIG + M_NOISE) + N_SIG + u) * stride_qh
            DO_B = DO + b * stride_db + (g * N_SIG + u * R) * stride_dh
            row1 = ((b * G + g) * N_SIG + u * R) * T
            row2 = ((b * G + g) * M_NOISE + u) * T
            dk1, dk2, dv = _bwd_kv_inner(
                dk1, dk2, dv, k1, k2, v, Q1_B, Q2_B, DO_B, LSE1 + row1, LSE2 + row2, DELTA1 + row1, DELTA2 + row2,
                MASK_B, lam, keys, stride_qt, stride_qh, stride_dt, stride_dh, stride_mt, stride_ms, T, S, qk_scale,
                t_lo, t_full, HEAD_DIM, D_PAD, R, R_PAD, BLOCK_T, True, IS_CAUSAL, HAS_MASK, IN_DTYPE, OP_DTYPE,
                DOT_PREC)
            dk1, dk2, dv = _bwd_kv_inner(
                dk1, dk2, dv, k1, k2, v, Q1_B, Q2_B, DO_B, LSE1 + row1, LSE2 + row2, DELTA1 + row1, DELTA2 + row2,
                MASK_B, lam, keys, stride_qt, stride_qh, stride_dt, stride_dh, stride_mt, stride_ms, T, S, qk_scale,
                t_full, t_end, HEAD_DIM, D_PAD, R, R_PAD, BLOCK_T, False, IS_CAUSAL, HAS_MASK, IN_DTYPE, OP_DTYPE,
                DOT_PREC)

        DK1_B = DK + b * stride_dkb + (2 * g) * stride_dkh + keys[:, None] * stride_dks + offs_d[None, :]
        tl.store(DK1_B, (dk1 * sm_scale).to(DK.dtype.element_ty), mask=k_mask)
        tl.store(DK1_B + stride_dkh, (dk2 * sm_scale).to(DK.dtype.element_ty), mask=k_mask)
        tl.store(DV + b * stride_dvb + (2 * g + half)[None, :] * stride_dvh + c_d[None, :] + keys[:, None] * stride_dvs,
                 dv.to(DV.dtype.element_ty), mask=v_mask)

    @_jit
    def _bwd_q_inner(dq1, dq2, q1, q2, do, dsum, lse1, lse2, delta1, delta2, K1_B, K2_B, V_ROW, MASK_B,
                     t_s, ok_s, t_n, ok_n, d_ok, c_ok, stride_ks, stride_vs, stride_mt, stride_ms, S, T, qk_scale,
                     start, end, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                     IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, IN_DTYPE: tl.constexpr,
                     OP_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):
        offs_d = tl.arange(0, D_PAD)
        for n0 in range(start, end, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            k_ok = keys < S
            k_mask = k_ok[:, None] & d_ok[None, :]
            k1 = tl.load(K1_B + keys[:, None] * stride_ks + offs_d[None, :], mask=k_mask, other=0.0).to(OP_DTYPE)
            k2 = tl.load(K2_B + keys[:, None] * stride_ks + offs_d[None, :], mask=k_mask, other=0.0).to(OP_DTYPE)
            v = tl.load(V_ROW[None, :] + keys[:, None] * stride_vs, mask=k_ok[:, None] & c_ok[None, :],
                        other=0.0).to(OP_DTYPE)
            p1 = tl.math.exp2(tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC) * qk_scale - lse1[:, None])
            p2 = tl.math.exp2(tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) * qk_scale - lse2[:, None])
            if MASKED:
                p1 = tl.where(_visible(t_s, ok_s, keys, MASK_B, stride_mt, stride_ms, S, T, IS_CAUSAL, HAS_MASK, False),
                              p1, 0.0)
                p2 = tl.where(_visible(t_n, ok_n, keys, MASK_B, stride_mt, stride_ms, S, T, IS_CAUSAL, HAS_MASK, False),
                              p2, 0.0)
            ds1 = p1 * (tl.dot(do, tl.trans(v), input_precision=DOT_PREC) - delta1[:, None])
            dq1 = tl.dot(ds1.to(IN_DTYPE).to(OP_DTYPE), k1, dq1, input_precision=DOT_PREC)
            ds2 = p2 * (tl.dot(dsum, tl.trans(v), input_precision=DOT_PREC) - delta2[:, None])
            dq2 = tl.dot(ds2.to(IN_DTYPE).to(OP_DTYPE), k2, dq2, input_precision=DOT_PREC)
        return dq1, dq2

    @_jit
    def _diff_attn_bwd_dq(Q, K, V, DO, LAM, MASK, LSE1, LSE2, DELTA1, DELTA2, DQ,
                          stride_qb, stride_qt, stride_qh, stride_kb, stride_kh, stride_ks,
                          stride_vb, stride_vh, stride_vs, stride_db, stride_dt, stride_dh,
                          stride_mb, stride_mt, stride_ms, stride_dqb, stride_dqt, stride_dqh,
                          T, S, G, N_SIG, M_NOISE, qk_scale, sm_scale,
                          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
                          UNITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                          HAS_MASK: tl.constexpr, IN_DTYPE: tl.constexpr, OP_DTYPE: tl.constexpr,
                          DOT_PREC: tl.constexpr):
        # Grid: (query blocks, B × G × noise-row blocks), rows packed as in the forward.
        ROWS_N: tl.constexpr = UNITS * BLOCK_T
        pid_t = tl.program_id(0)
        pid_bgu = tl.program_id(1)
        unit_blocks = (M_NOISE + UNITS - 1) // UNITS
        u0 = (pid_bgu % unit_blocks) * UNITS
        g = (pid_bgu // unit_blocks) % G
        b = (pid_bgu // unit_blocks // G).to(tl.int64)
        t0 = pid_t * BLOCK_T
        head_s, t_s, ok_s, unit_n, t_n, ok_n = _packed_rows(t0, u0, T, M_NOISE, R, R_PAD, UNITS, BLOCK_T)
        group_q = g * (N_SIG + M_NOISE)
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < HEAD_DIM
        cols = tl.arange(0, 2 * D_PAD)
        half = cols // D_PAD
        c_d = cols % D_PAD
        c_ok = c_d < HEAD_DIM
        out_cols = half * HEAD_DIM + c_d
        q_mask_s = ok_s[:, None] & d_ok[None, :]
        q_mask_n = ok_n[:, None] & d_ok[None, :]

        Q_S = t_s[:, None] * stride_qt + (group_q + head_s)[:, None] * stride_qh + offs_d[None, :]
        Q_N = t_n[:, None] * stride_qt + (group_q + N_SIG + unit_n)[:, None] * stride_qh + offs_d[None, :]
        q1 = tl.load(Q + b * stride_qb + Q_S, mask=q_mask_s, other=0.0).to(OP_DTYPE)
        q2 = tl.load(Q + b * stride_qb + Q_N, mask=q_mask_n, other=0.0).to(OP_DTYPE)
        do = tl.load(DO + b * stride_db + t_s[:, None] * stride_dt + (g * N_SIG + head_s)[:, None] * stride_dh
                     + out_cols[None, :], mask=ok_s[:, None] & c_ok[None, :], other=0.0)
        if R_PAD == 1:
            dsum = do
        else:  # dO' of each noise row: the sum over its r signal rows, rounded to the inputs' type
            dsum = _sum(tl.reshape(do.to(tl.float32), (R_PAD, ROWS_N, 2 * D_PAD)), 0).to(IN_DTYPE)
        do = do.to(OP_DTYPE)
        dsum = dsum.to(OP_DTYPE)
        row1 = ((b * G + g) * N_SIG + head_s) * T + t_s
        row2 = ((b * G + g) * M_NOISE + unit_n) * T + t_n
        lse1 = tl.load(LSE1 + row1, mask=ok_s, other=float("inf"))
        lse2 = tl.load(LSE2 + row2, mask=ok_n, other=float("inf"))
        delta1 = tl.load(DELTA1 + row1, mask=ok_s, other=0.0)
        delta2 = tl.load(DELTA2 + row2, mask=ok_n, other=0.0)
        K1_B = K + b * stride_kb + (2 * g) * stride_kh
        K2_B = K1_B + stride_kh
        V_ROW = V + b * stride_vb + (2 * g + half) * stride_vh + c_d
        MASK_B = MASK + b * stride_mb

        dq1 = tl.full((R_PAD * ROWS_N, D_PAD), 0.0, dtype=tl.float32)
        dq2 = tl.full((ROWS_N, D_PAD), 0.0, dtype=tl.float32)
        hi, full = _key_ranges(0, S, t0, S, T, BLOCK_T, BLOCK_N, IS_CAUSAL, HAS_MASK)
        dq1, dq2 = _bwd_q_inner(dq1, dq2, q1, q2, do, dsum, lse1, lse2, delta1, delta2, K1_B, K2_B, V_ROW, MASK_B,
                                t_s, ok_s, t_n, ok_n, d_ok, c_ok, stride_ks, stride_vs, stride_mt, stride_ms, S, T,
                                qk_scale, 0, full, D_PAD, BLOCK_N, False, IS_CAUSAL, HAS_MASK, IN_DTYPE, OP_DTYPE,
                                DOT_PREC)
        dq1, dq2 = _bwd_q_inner(dq1, dq2, q1, q2, do, dsum, lse1, lse2, delta1, delta2, K1_B, K2_B, V_ROW, MASK_B,
                                t_s, ok_s, t_n, ok_n, d_ok, c_ok, stride_ks, stride_vs, stride_mt, stride_ms, S, T,
                                qk_scale, full, hi, D_PAD, BLOCK_N, True, IS_CAUSAL, HAS_MASK, IN_DTYPE, OP_DTYPE,
                                DOT_PREC)
        lam = tl.load(LAM)
        tl.store(DQ + b * stride_dqb + t_s[:, None] * stride_dqt + (group_q + head_s)[:, None] * stride_dqh
                 + offs_d[None, :], (dq1 * sm_scale).to(DQ.dtype.element_ty), mask=q_mask_s)
        tl.store(DQ + b * stride_dqb + t_n[:, None] * stride_dqt + (group_q + N_SIG + unit_n)[:, None] * stride_dqh
                 + offs_d[None, :], (dq2 * (-lam * sm_scale)).to(DQ.dtype.element_ty), mask=q_mask_n)


# ----------------------------------------------------------------------------------------------------------------------
# Host side: validation, launches, autograd.
# ----------------------------------------------------------------------------------------------------------------------


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _head_pad(d: int) -> int:
    """The head dimension of the tiles: a power of two (tl.arange), at least 16 (tl.dot); the padding is masked."""
    return max(_MIN_DOT, _next_pow2(d))


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _validate(query, key, value, lam, scaling, pair_stride, noise_ratio, attention_mask, is_causal):
    """Check the inputs; return (B, T, S, G, n, m, d, the boolean mask as a (B, 1, T, S) view or None)."""
    if triton is None:
        raise RuntimeError("differential_attention_triton needs triton (`pip install triton`); it is not installed")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-dimensional tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if query.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"query.dtype must be one of float32, bfloat16, float16, got {query.dtype}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if key.device != query.device or value.device != query.device:
        raise ValueError(
            f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}")
    b, t, hq, d = query.shape
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape (B, 2G, S, d), got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    kb, hkv, s, kd = key.shape
    if kb != b or kd != d:
        raise ValueError(f"key/value shape {tuple(key.shape)} does not match query shape {tuple(query.shape)}: "
                         "expected (B, 2G, S, d) with the query's batch size B and head_dim d")
    if hkv % 2:
        raise ValueError(f"key/value have {hkv} heads; DIFF V1 needs an even count (K1/V0 and K2/V1 per KV group)")
    if _head_pad(d) > 256:
        raise ValueError(f"head_dim must be at most 256 for the fused kernel, got {d}")
    if not isinstance(pair_stride, int) or pair_stride < 1:
        raise ValueError(f"pair_stride (signal heads per KV group, n) must be a positive int, got {pair_stride!r}")
    if not isinstance(noise_ratio, int) or noise_ratio < 1 or pair_stride % noise_ratio:
        raise ValueError(f"noise_ratio must be a positive int dividing pair_stride={pair_stride}, got {noise_ratio!r}")
    g, n = hkv // 2, pair_stride
    m = n // noise_ratio
    if hq != g * (n + m):
        raise ValueError(f"query has {hq} heads; with {hkv} key/value heads ({g} KV groups), pair_stride={n} and "
                         f"noise_ratio={noise_ratio} it must have {g} × ({n} + {m}) = {g * (n + m)}")
    if t > s:
        raise ValueError(f"query length {t} exceeds the key length {s}: the queries are the last T of the S keys")
    if not isinstance(lam, torch.Tensor) or lam.dim() != 0 or not lam.is_floating_point():
        raise ValueError(f"lam must be a 0-dimensional floating-point tensor (the layer's λ), got "
                         f"{getattr(lam, 'shape', type(lam).__name__)}")
    if lam.device != query.device:
        raise ValueError(f"lam must be on the query's device {query.device}, got {lam.device}")
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or not math.isfinite(scaling):
        raise ValueError(f"scaling must be a finite float, got {scaling!r}")
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
    mask = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
            raise TypeError("attention_mask must be a boolean tensor (True = visible) broadcastable to (B, 1, T, S), "
                            f"got {getattr(attention_mask, 'dtype', type(attention_mask).__name__)}")
        if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
            raise ValueError(
                f"attention_mask must have shape (B or 1, 1, T or 1, S), got {tuple(attention_mask.shape)}")
        if attention_mask.device != query.device:
            raise ValueError(
                f"attention_mask must be on the query's device {query.device}, got {attention_mask.device}")
        # transformers' sdpa path slices a longer mask to the keys the same way.
        mask = attention_mask[..., :s]
        try:
            mask = mask.expand(b, 1, t, s)
        except RuntimeError:
            raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} does not broadcast to "
                             f"(B, 1, T, S) = {(b, 1, t, s)}") from None
    return b, t, s, g, n, m, d, mask


def _on_device(device):
    """Triton launches on the current CUDA device: make it the tensors' one (a no-op on CPU, the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _mask_args(mask, fallback):
    if mask is None:
        return fallback, 0, 0, 0
    return mask, mask.stride(0), mask.stride(2), mask.stride(3)


def _dtype_flags(dtype) -> dict:
    """The kernels' dtype constexprs (see the note above the kernels)."""
    in_dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]
    upcast = _interpreting() and dtype == torch.bfloat16
    return dict(IN_DTYPE=in_dtype, OP_DTYPE=tl.float32 if upcast else in_dtype,
                DOT_PREC="ieee" if dtype == torch.float32 else "tf32")


def _forward(query, key, value, lam, scaling, n, r, mask, is_causal, save_stats):
    """The one-pass forward. Returns (out, o2, lse1, lse2); the last three are None unless save_stats."""
    k = _jitted()
    b, t, hq, d = query.shape
    s, g = key.shape[2], key.shape[1] // 2
    m = n // r
    d_pad, r_pad = _head_pad(d), _next_pow2(r)
    cfg = _launch_config("forward", d_pad, query.dtype)
    units = cfg.get("units", 1)
    block_t = _block_t(cfg["rows"], r_pad, units)
    out = query.new_empty(b, t, g * n, 2 * d)
    if save_stats:
        o2 = query.new_empty(b, t, g * m, 2 * d)
        lse1 = torch.empty(b, g * n, t, device=query.device, dtype=torch.float32)
        lse2 = torch.empty(b, g * m, t, device=query.device, dtype=torch.float32)
    else:
        o2, lse1, lse2 = out, out, out  # never written
    mask_t, smb, smt, sms = _mask_args(mask, key)
    grid = (triton.cdiv(t, block_t), b * g * triton.cdiv(m, units), 1)
    k["_diff_attn_fwd"][grid](
        query, key, value, lam, mask_t, out, o2, lse1, lse2,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), smb, smt, sms,
        0, out.stride(0), out.stride(1), out.stride(2), 0, o2.stride(0), o2.stride(1), o2.stride(2),
        0, 0, t, s, g, n, m, s, scaling * _LOG2E,
        HEAD_DIM=d, D_PAD=d_pad, R=r, R_PAD=r_pad, UNITS=units, BLOCK_T=block_t, BLOCK_N=cfg["block_n"],
        IS_CAUSAL=is_causal, HAS_MASK=mask is not None, SPLIT=False, SAVE_STATS=save_stats, **_dtype_flags(query.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, (o2 if save_stats else None), (lse1 if save_stats else None), (lse2 if save_stats else None)


def _decode_plan(b, g, m, s, r_pad, d_pad, dtype, device) -> dict:
    """Launch shape of the decode path: every noise row of a group (with its signal rows) in one program, so each
    cache byte is read once per group; keys split over programs when B × G programs would leave the GPU idle."""
    cfg = _launch_config("decode", d_pad, dtype)
    units = min(max(_next_pow2(m), _MIN_DOT), cfg["max_units"])  # the noise tile has `units` rows: at least 16
    unit_blocks = -(-m // units)
    block_n = cfg["block_n"]
    if "splits" in cfg:
        splits = cfg["splits"]
    else:
        sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if torch.device(device).type == "cuda" else 132)
        programs = b * g * unit_blocks
        splits = max(1, min(-(-2 * sms // programs), -(-s // (cfg["min_split_blocks"] * block_n))))
    split_len = -(-(-(-s // splits)) // block_n) * block_n
    return {**cfg, "units": units, "unit_blocks": unit_blocks, "splits": -(-s // split_len), "split_len": split_len}


def _decode(query, key, value, lam, scaling, n, r, mask, is_causal):
    """One query token per sequence, no autograd: a program per (batch, group, key split) reads the group's cache
    once for all its n + m query rows; a second kernel merges the splits."""
    k = _jitted()
    b, t, hq, d = query.shape
    s, g = key.shape[2], key.shape[1] // 2
    m = n // r
    d_pad, r_pad = _head_pad(d), _next_pow2(r)
    plan = _decode_plan(b, g, m, s, r_pad, d_pad, query.dtype, query.device)
    splits = plan["splits"]
    out = query.new_empty(b, t, g * n, 2 * d)
    mask_t, smb, smt, sms = _mask_args(mask, key)
    common = dict(HEAD_DIM=d, D_PAD=d_pad, R=r, R_PAD=r_pad, UNITS=plan["units"], BLOCK_T=1, BLOCK_N=plan["block_n"],
                  IS_CAUSAL=is_causal, HAS_MASK=mask is not None, SAVE_STATS=False, **_dtype_flags(query.dtype),
                  num_warps=plan["num_warps"], num_stages=plan["num_stages"])
    grid = (t, b * g * plan["unit_blocks"], splits)
    strides = (query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
               value.stride(0), value.stride(1), value.stride(2), smb, smt, sms)
    if splits == 1:
        k["_diff_attn_fwd"][grid](
            query, key, value, lam, mask_t, out, out, out, out, *strides,
            0, out.stride(0), out.stride(1), out.stride(2), 0, 0, 0, 0, 0, 0, t, s, g, n, m, s, scaling * _LOG2E,
            SPLIT=False, **common)
        return out
    f32 = dict(device=query.device, dtype=torch.float32)
    po1, po2 = torch.empty(splits, b, t, g * n, 2 * d, **f32), torch.empty(splits, b, t, g * m, 2 * d, **f32)
    pl1, pl2 = torch.empty(splits, b, g * n, t, **f32), torch.empty(splits, b, g * m, t, **f32)
    k["_diff_attn_fwd"][grid](
        query, key, value, lam, mask_t, po1, po2, pl1, pl2, *strides,
        po1.stride(0), po1.stride(1), po1.stride(2), po1.stride(3), po2.stride(0), po2.stride(1), po2.stride(2),
        po2.stride(3), pl1.stride(0), pl2.stride(0), t, s, g, n, m, plan["split_len"], scaling * _LOG2E,
        SPLIT=True, **common)
    k["_diff_attn_decode_combine"][(b * t, g * n)](
        po1, po2, pl1, pl2, lam, out, out.stride(0), out.stride(1), out.stride(2), b, t, g, n, m, splits,
        HEAD_DIM=d, D_PAD=d_pad, R=r, SPLITS_PAD=_next_pow2(splits), num_warps=4)
    return out


def _backward(dout, query, key, value, lam, out, o2, lse1, lse2, scaling, n, r, mask, is_causal):
    k = _jitted()
    b, t, hq, d = query.shape
    s, g = key.shape[2], key.shape[1] // 2
    m = n // r
    d_pad, r_pad = _head_pad(d), _next_pow2(r)
    dout = _last_contiguous(dout.to(query.dtype))
    mask_t, smb, smt, sms = _mask_args(mask, key)
    f32 = dict(device=query.device, dtype=torch.float32)
    delta1, delta2 = torch.empty(b, g * n, t, **f32), torch.empty(b, g * m, t, **f32)
    cfg = _launch_config("preprocess", d_pad, query.dtype)
    k["_diff_attn_bwd_preprocess"][(triton.cdiv(t, cfg["rows"]), b * g * m)](
        out, o2, dout, lam, delta1, delta2, out.stride(0), out.stride(1), out.stride(2),
        o2.stride(0), o2.stride(1), o2.stride(2), dout.stride(0), dout.stride(1), dout.stride(2), t, g, n, m,
        HEAD_DIM=d, D_PAD=d_pad, R=r, BLOCK_T=cfg["rows"], num_warps=cfg["num_warps"])
    # dλ = Σ_h Σ_t dO_h · (−O2 of its noise row) = −Σ δ2.
    dlam = -delta2.sum()

    q_strides = (query.stride(0), query.stride(1), query.stride(2))
    kv_strides = (key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2))
    d_strides = (dout.stride(0), dout.stride(1), dout.stride(2))
    flags = dict(HEAD_DIM=d, D_PAD=d_pad, R=r, R_PAD=r_pad, IS_CAUSAL=is_causal, HAS_MASK=mask is not None,
                 **_dtype_flags(query.dtype))
    qk_scale = scaling * _LOG2E

    dkey, dvalue = key.new_empty(key.shape), value.new_empty(value.shape)  # contiguous, as the ops' fake outputs
    cfg = _launch_config("dkdv", d_pad, query.dtype)
    block_t = _block_t(cfg["rows"], r_pad)
    k["_diff_attn_bwd_dkdv"][(triton.cdiv(s, cfg["block_n"]), b * g)](
        query, key, value, dout, lam, mask_t, lse1, lse2, delta1, delta2, dkey, dvalue,
        *q_strides, *kv_strides, *d_strides, smb, smt, sms, dkey.stride(0), dkey.stride(1), dkey.stride(2),
        dvalue.stride(0), dvalue.stride(1), dvalue.stride(2), t, s, g, n, m, qk_scale, scaling,
        BLOCK_T=block_t, BLOCK_N=cfg["block_n"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **flags)

    dquery = query.new_empty(query.shape)
    cfg = _launch_config("dq", d_pad, query.dtype)
    units = cfg.get("units", 1)
    block_t = _block_t(cfg["rows"], r_pad, units)
    k["_diff_attn_bwd_dq"][(triton.cdiv(t, block_t), b * g * triton.cdiv(m, units))](
        query, key, value, dout, lam, mask_t, lse1, lse2, delta1, delta2, dquery,
        *q_strides, *kv_strides, *d_strides, smb, smt, sms, dquery.stride(0), dquery.stride(1), dquery.stride(2),
        t, s, g, n, m, qk_scale, scaling, UNITS=units, BLOCK_T=block_t, BLOCK_N=cfg["block_n"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **flags)
    return dquery, dkey, dvalue, dlam


# ----------------------------------------------------------------------------------------------------------------------
# PyTorch custom ops (torch.library.custom_op), so that torch.compile (fullgraph, inductor, CUDA graphs) keeps the kernels
# in its graph as opaque calls: the dispatcher runs the host code above on real tensors, the fake implementations give
# the outputs' shapes, dtypes and strides to the tracer, and the autograd registration ties the backward op to the
# forward one. Eager calls go through the same ops and the same kernels.
# ----------------------------------------------------------------------------------------------------------------------

_OP_NAMESPACE = "difftransformer"
_ARGS = "Tensor query, Tensor key, Tensor value, Tensor lam, Tensor? mask, float scaling, int n, int r, bool is_causal"
_OP_SCHEMAS = {  # explicit schemas: the same on every torch from 2.7.1 on, whatever its annotation parser accepts
    "diff_attn_v1_forward": f"({_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)",
    "diff_attn_v1_backward": "(Tensor dout, Tensor query, Tensor key, Tensor value, Tensor lam, Tensor out, Tensor o2, "
                             "Tensor lse1, Tensor lse2, Tensor? mask, float scaling, int n, int r, bool is_causal) "
                             "-> (Tensor, Tensor, Tensor, Tensor)",
    "diff_attn_v1_inference": f"({_ARGS}) -> Tensor",
}


def _mask_bits(mask):
    """The boolean mask (True = visible) as the uint8 view the kernels load."""
    return None if mask is None else mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def _output_shapes(query, key, n, r):
    b, t, _, d = query.shape
    g = key.shape[1] // 2
    return (b, t, g * n, 2 * d), (b, t, g * (n // r), 2 * d), (b, g * n, t), (b, g * (n // r), t)


def _forward_impl(query, key, value, lam, mask, scaling, n, r, is_causal):
    query, key, value = _last_contiguous(query), _last_contiguous(key), _last_contiguous(value)
    with _on_device(query.device):
        return _forward(query, key, value, lam, scaling, n, r, _mask_bits(mask), is_causal, save_stats=True)


def _forward_fake(query, key, value, lam, mask, scaling, n, r, is_causal):
    out, o2, lse1, lse2 = _output_shapes(query, key, n, r)
    return (query.new_empty(out), query.new_empty(o2), query.new_empty(lse1, dtype=torch.float32),
            query.new_empty(lse2, dtype=torch.float32))


def _backward_impl(dout, query, key, value, lam, out, o2, lse1, lse2, mask, scaling, n, r, is_causal):
    query, key, value = _last_contiguous(query), _last_contiguous(key), _last_contiguous(value)
    out, o2 = _last_contiguous(out), _last_contiguous(o2)
    with _on_device(query.device):
        return _backward(dout, query, key, value, lam, out, o2, lse1.contiguous(), lse2.contiguous(), scaling, n, r,
                         _mask_bits(mask), is_causal)


def _backward_fake(dout, query, key, value, lam, out, o2, lse1, lse2, mask, scaling, n, r, is_causal):
    return (query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape),
            query.new_empty((), dtype=torch.float32))


def _inference_impl(query, key, value, lam, mask, scaling, n, r, is_causal):
    query, key, value = _last_contiguous(query), _last_contiguous(key), _last_contiguous(value)
    with _on_device(query.device):
        if query.shape[1] == 1:
            return _decode(query, key, value, lam, scaling, n, r, _mask_bits(mask), is_causal)
        return _forward(query, key, value, lam, scaling, n, r, _mask_bits(mask), is_causal, save_stats=False)[0]


def _inference_fake(query, key, value, lam, mask, scaling, n, r, is_causal):
    return query.new_empty(_output_shapes(query, key, n, r)[0])


def _setup_context(ctx, inputs, output):
    query, key, value, lam, mask, scaling, n, r, is_causal = inputs
    out, o2, lse1, lse2 = output
    ctx.save_for_backward(query, key, value, lam, out, o2, lse1, lse2, mask)
    ctx.args = (scaling, n, r, is_causal)
    ctx.mark_non_differentiable(o2, lse1, lse2)  # what the backward needs, not results
    ctx.set_materialize_grads(False)


def _backward_formula(ctx, dout, *_unused):
    """Gradients of query, key, value and λ from the saved statistics (the kernels recompute each map)."""
    query, key, value, lam, out, o2, lse1, lse2, mask = ctx.saved_tensors
    scaling, n, r, is_causal = ctx.args
    if dout is None:  # the output did not reach the loss
        return None, None, None, None, None, None, None, None, None
    dq, dk, dv, dlam = _OP_BACKWARD(dout, query, key, value, lam, out, o2, lse1, lse2, mask, scaling, n, r, is_causal)
    return dq, dk, dv, (dlam if ctx.needs_input_grad[3] else None), None, None, None, None, None


def _no_double_backward(ctx, *grads):
    raise RuntimeError(f"{_OP_NAMESPACE}::diff_attn_v1_backward is once_differentiable: the fused kernel's backward is "
                       "not itself differentiable (no second-order gradients through differential_attention_triton)")


def _define_ops():
    """Define the three ops, or find them where another copy of this file (a saved folder's remote code, imported
    beside the installed package) already defined them: an op name can be defined once per process."""
    namespace = getattr(torch.ops, _OP_NAMESPACE)
    if not all(hasattr(namespace, name) for name in _OP_SCHEMAS):
        _register_ops()
    return tuple(getattr(namespace, name).default for name in _OP_SCHEMAS)


def _register_ops():
    forward = torch.library.custom_op(f"{_OP_NAMESPACE}::diff_attn_v1_forward", _forward_impl, mutates_args=(),
                                      schema=_OP_SCHEMAS["diff_attn_v1_forward"])
    backward = torch.library.custom_op(f"{_OP_NAMESPACE}::diff_attn_v1_backward", _backward_impl, mutates_args=(),
                                       schema=_OP_SCHEMAS["diff_attn_v1_backward"])
    inference = torch.library.custom_op(f"{_OP_NAMESPACE}::diff_attn_v1_inference", _inference_impl,
                                        mutates_args=(), schema=_OP_SCHEMAS["diff_attn_v1_inference"])
    forward.register_fake(_forward_fake)
    backward.register_fake(_backward_fake)
    inference.register_fake(_inference_fake)
    forward.register_autograd(_backward_formula, setup_context=_setup_context)
    backward.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


# torch.ops.difftransformer.diff_attn_v1_forward / _backward / _inference (OpOverloads).
_OP_FORWARD, _OP_BACKWARD, _OP_INFERENCE = _define_ops()


def differential_attention_triton(query, key, value, lam, scaling, pair_stride, noise_ratio=1, attention_mask=None,
                                  is_causal=True):
    """DIFF V1 attention ``O_h = (A1 − λ·A2)·[V0 | V1]`` in one pass over keys and values (module docstring).

    ``query`` ``(B, T, Hq, d)`` in q_proj row order (per KV group its ``n = pair_stride`` signal rows, then its
    ``n / noise_ratio`` noise rows), ``key``/``value`` ``(B, 2G, S, d)`` (heads ``2g``, ``2g + 1``: K1, K2 and V0, V1
    of group g), any strides with a contiguous last axis; ``lam`` a 0-dim float tensor (may require grad);
    ``scaling`` the score scale (``1/sqrt(d)``); ``attention_mask`` None (causal, the T queries being the last T of S
    positions) or a boolean mask broadcastable to ``(B, 1, T, S)``, True = visible, intersected with the causal mask
    unless ``is_causal=False``. Returns ``(B, T, G·n, 2d)`` in the query's dtype, value half 0 first.

    One query token without autograd takes the decode path (the group's cache read once for all its rows); otherwise
    the forward kernel, with the flash-attention-style backward when any input requires grad.
    """
    b, t, s, g, n, m, d, mask = _validate(query, key, value, lam, scaling, pair_stride, noise_ratio, attention_mask,
                                          is_causal)
    if b == 0 or t == 0 or s == 0:
        return query.new_zeros(b, t, g * n, 2 * d)
    query, key, value = _last_contiguous(query), _last_contiguous(key), _last_contiguous(value)
    lam32 = lam.float()
    scaling = float(scaling)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value, lam)):
        return _OP_FORWARD(query, key, value, lam32, mask, scaling, n, noise_ratio, is_causal)[0]
    return _OP_INFERENCE(query, key, value, lam32, mask, scaling, n, noise_ratio, is_causal)


__all__ = ["differential_attention_triton", "is_available"]
