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
  is loaded tile by tile when given (once for both maps when r = 1: their tiles hold the same positions). The noise map
  is computed once for its r signal maps.
* decode (one query token, no autograd): the same kernel with all of a group's n + m rows in one program's tiles, so
  every cache byte is read once per group, split over the keys (flash-decoding) when the batch has too few groups to
  fill the GPU, and ``_diff_attn_decode_combine`` merging the splits.
* backward (flash-attention style, recomputing each map from its saved per-row log-sum-exp; no T×S map is stored):
  ``_diff_attn_bwd_preprocess`` computes ``δ1 = rowsum(dO ∘ O1)`` and ``δ2 = rowsum(dO' ∘ O2)`` with
  ``O1 = O + λ·O2`` and ``dO'`` the sum of dO over a noise row's r signal heads; ``_diff_attn_bwd_dkdv`` owns a block
  of keys of one group and loops over every query row of the group (one noise row and its r signal rows at a time,
  all n + m heads in series), so key and value gradients are summed over the group's heads in registers
  (deterministic, no atomics); ``_diff_attn_bwd_dq`` owns query rows like the forward. Map 1 back-propagates ``dO``,
  map 2 ``−λ·dO'``; ``dλ = −Σ δ2`` over every noise row. With one noise row per signal row (r = 1, so ``dO' = dO``)
  both use the combined form of the CPU kernel (kernels_difftransformer.py): dK/dV forms ``D = P1 − λ·P2`` per row
  block and takes ``dV = Dᵀ·dO`` in one product, and one 2d-wide ``V·dOᵀ`` serves both maps' ``dS`` (in dK/dV and in
  dQ); r > 1 keeps the maps apart (each noise row's ``dO'`` is its own sum).

Arithmetic, per (query row, key) pair of one map: the forward is 1.5× a Llama's attention (both maps' scores equal a
same-shape Llama's ``QKᵀ``; both maps times the 2d-wide value are twice its ``PV``), against 2× for the zero-padded
single call. The backward recomputes scores twice (once for key/value gradients, once for query gradients), as
Triton's fused-attention tutorial does; at r = 1, per signal/noise row pair and key, dK/dV multiplies 8·d (both maps'
scores 2d, dV 2d, ``V·dOᵀ`` 2d, dK1 and dK2 2d) where the maps taken apart would take 12·d, and dQ 6·d instead of 8·d.

Memory saved for the backward: the inputs and the output (references: the projections and the next operation keep
them too, unless that operation saves a converted copy), the per-row log-sum-exp of both maps (float32,
``(B, G·n, T)`` and ``(B, G·m, T)``) and one extra tensor, the noise map's un-differenced output ``O2 = A2·V``
(``(B, T, G·m, 2d)`` in the input dtype: the size of the output when r = 1, 1/r of it otherwise), from which
``O1 = O + λ·O2`` is rebuilt for ``δ1``. Without it the backward would need a third pass over keys and values.

Launch configurations (``LAUNCH_CONFIGS``; none of them timed on a GPU yet: :func:`tuning_sweep` is what picks them).
Each kernel has a list of configurations (query positions ``BLOCK_T``, keys ``BLOCK_N``, noise rows per program
``UNITS``, ``num_warps``, ``num_stages``), in order of preference. On a GPU the forward, dK/dV and dQ kernels are
autotuned with ``triton.autotune``, as Triton's tutorial does on Hopper: ``_keep`` prunes each list per launch (tiles
within the problem; the fp32 accumulators a thread holds within half its registers; 8 warps only for tiles whose state
needs them, the tutorial's "no 8-warp tiles under 128×128" measured in state rather than area, since these tiles carry
two maps and a 2d-wide value; the pipelined tiles within shared memory; float32 counting double), and the autotuning
key is the head dim, every tensor's dtype, causal, mask, noise ratio, noise rows, groups and the power-of-two buckets
of the batch, query and key lengths. Every tuned kernel only writes its outputs (never accumulates into them), so the
autotuner's repeated launches leave them right. A shape's choice is cached with its grid (its launch plan), so
autotuning's per-call work runs once per shape. Nothing is timed under the interpreter (each list's first suitable
entry runs; the tests pick configurations explicitly through ``_TUNING``), for problems too small for it to matter,
while a CUDA graph is being captured (timing would break the capture: the default runs, the shape is tuned later), for
decode (its first suitable entry), or where :func:`set_configs` pinned a choice (``set_configs(..., autotune=False)``
turns autotuning off everywhere else). Autotuning compiles every configuration of the list at a key's first launch:
seconds per configuration, once per process (Triton caches the binaries on disk, not the choice;
``TRITON_CACHE_AUTOTUNING=1`` keeps the choice too), which :func:`set_configs` with a sweep's result avoids.

The defaults on sm_90 for 16-bit inputs give every dot an M that is a multiple of 64, so that Triton uses Hopper's
wgmma (tiles of 32 rows fall back to mma.sync): 64 keys for dK/dV (8 warps), 128 query rows per map for the forward
and dQ. Registers, from compiling each entry for sm_90 (Triton 3.9, its bundled CUDA 13 ptxas; d = 64, bf16, r = 1):
the forward's two 2d-wide accumulators of 128 rows each fit 8 warps without spilling; the dK/dV kernel holds dK1, dK2
and dV (keys × 4d in fp32) and its K1, K2 and V tiles, and every 64-key configuration spills some registers (about
200–900 bytes per thread, fewer with 8 warps and with the combined form, more with 64 query positions per step or
r = 2), where the previous 32-key tile (no wgmma, kept in the list to compare) spills none. Whether wgmma's throughput
outweighs those spills is what the sweep measures.

The host code runs as three PyTorch custom ops (``torch.library.custom_op``, namespace ``difftransformer``):
``diff_attn_v1_forward`` (output, ``O2`` and both log-sum-exps: what the backward needs; its autograd formula is
``diff_attn_v1_backward``, which returns the gradients of q, k, v and λ) and ``diff_attn_v1_inference`` (no autograd:
the decode path for one query token, else the forward without statistics). Their fake implementations give the
outputs' shapes, dtypes and strides (which no launch configuration changes), so ``torch.compile(fullgraph=True)``
traces them without graph breaks and inductor (CUDA graphs included) calls them as opaque kernels: the kernels are
picked and autotuned when the compiled graph first runs them, in inductor's warm-up run under CUDA graphs. The
backward op is not differentiable (a second-order gradient raises). An eager call without autograd (nothing compiling,
no dispatch mode active, plain tensors) calls the inference op's implementation directly, skipping the dispatcher; a
call's inputs are validated once per signature (shapes, strides, dtypes, devices, the scalars; a bounded cache).

Triton is optional: without it (or without a CUDA device, unless ``TRITON_INTERPRET=1``) :func:`is_available` is
False, the module still imports and nothing here runs. The kernels are decorated with ``triton.jit`` on first use,
so ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, which tests/kernels/test_triton_difftransformer.py uses) takes
effect whenever it is set before the first call, even after triton itself was imported.

This module lives in ``difftransformer.kernels.triton`` (the optional extra ``difftransformer[triton]``), outside the
flat model files: the model loads it by name only where the kernel is chosen (kernels_difftransformer.triton_kernels)
and no saved remote-code folder carries it. It imports nothing of the package, so that it also loads as a file alone.
"""

import contextlib
import json
import math
import os
import time
from functools import partial
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

try:  # optional dependency: the package imports and runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_MIN_DOT = 16  # the smallest tile side tl.dot accepts on NVIDIA GPUs (the interpreter accepts any)

# ----------------------------------------------------------------------------------------------------------------------
# Launch configurations. Each kernel's list is what triton.autotune times on a GPU (after _prune drops the entries that
# cannot suit the launch), in order of preference: the first entry _prune keeps is the kernel's default, used where
# nothing is timed (the interpreter, a CUDA graph being captured, set_configs(..., autotune=False), tiny problems).
# None of these has been timed on a GPU yet: the lists were checked only by compiling each entry for an H100 (sm_90,
# Triton's bundled ptxas: registers, spills, shared memory, whether the dots use Hopper's wgmma); tuning_sweep() times
# them on the GPU and set_configs() pins what it measured.
#
# Keys: BLOCK_T query positions of a tile (forward, dq: a tile holds UNITS noise rows × BLOCK_T positions and r times
# as many signal rows; dkdv: one noise row and its r signal rows per step); BLOCK_N keys of a tile; UNITS noise rows of
# a KV group per program, sharing each K/V tile (GQA reads K/V once per UNITS noise rows); num_warps, num_stages as in
# triton.Config. decode: BLOCK_N, warps and stages of the decode launch and when it splits the keys (min_split_blocks:
# the fewest K/V blocks a split gets); it always takes all of a group's rows (max_units bounds them).
# ----------------------------------------------------------------------------------------------------------------------


def _cfg(warps, stages, **blocks) -> dict:
    return {**blocks, "num_warps": warps, "num_stages": stages}


LAUNCH_CONFIGS: dict[str, tuple[dict, ...]] = {
    "forward": (
        _cfg(8, 3, BLOCK_T=128, BLOCK_N=32, UNITS=1),
        _cfg(8, 3, BLOCK_T=64, BLOCK_N=64, UNITS=1),
        _cfg(4, 3, BLOCK_T=64, BLOCK_N=32, UNITS=1),
        _cfg(8, 3, BLOCK_T=128, BLOCK_N=64, UNITS=1),
        _cfg(4, 3, BLOCK_T=64, BLOCK_N=64, UNITS=1),
        _cfg(4, 3, BLOCK_T=32, BLOCK_N=32, UNITS=2),
        _cfg(8, 2, BLOCK_T=64, BLOCK_N=32, UNITS=1),  # the previous default, kept to compare
        _cfg(4, 2, BLOCK_T=16, BLOCK_N=32, UNITS=1),
    ),
    "dkdv": (
        _cfg(8, 2, BLOCK_T=32, BLOCK_N=64),
        _cfg(8, 2, BLOCK_T=16, BLOCK_N=64),
        _cfg(4, 2, BLOCK_T=32, BLOCK_N=64),
        _cfg(8, 2, BLOCK_T=64, BLOCK_N=64),
        _cfg(8, 2, BLOCK_T=32, BLOCK_N=128),
        _cfg(8, 2, BLOCK_T=16, BLOCK_N=32),  # the previous default, kept to compare
    ),
    "dq": (
        _cfg(8, 3, BLOCK_T=128, BLOCK_N=32, UNITS=1),
        _cfg(8, 3, BLOCK_T=128, BLOCK_N=64, UNITS=1),
        _cfg(4, 3, BLOCK_T=64, BLOCK_N=64, UNITS=1),
        _cfg(4, 3, BLOCK_T=64, BLOCK_N=32, UNITS=1),
        _cfg(4, 3, BLOCK_T=32, BLOCK_N=64, UNITS=2),
        _cfg(8, 2, BLOCK_T=64, BLOCK_N=32, UNITS=1),  # the previous default, kept to compare
        _cfg(4, 2, BLOCK_T=16, BLOCK_N=32, UNITS=1),
    ),
    "decode": (
        dict(BLOCK_N=64, num_warps=4, num_stages=3, min_split_blocks=2, max_units=32),
        dict(BLOCK_N=128, num_warps=4, num_stages=3, min_split_blocks=2, max_units=32),
        dict(BLOCK_N=64, num_warps=8, num_stages=3, min_split_blocks=2, max_units=32),
        dict(BLOCK_N=64, num_warps=4, num_stages=3, min_split_blocks=8, max_units=32),
        dict(BLOCK_N=32, num_warps=4, num_stages=4, min_split_blocks=4, max_units=32),
    ),
}
# The one kernel not tuned: the backward's row reductions (memory-bound; one small launch per backward).
_PREPROCESS_CONFIG = dict(BLOCK_T=32, num_warps=4)
_TUNED_KINDS = ("forward", "dkdv", "dq")
_CONFIG_KEYS = {
    "forward": ("BLOCK_T", "BLOCK_N", "UNITS", "num_warps", "num_stages"),
    "dkdv": ("BLOCK_T", "BLOCK_N", "num_warps", "num_stages"),
    "dq": ("BLOCK_T", "BLOCK_N", "UNITS", "num_warps", "num_stages"),
    "decode": ("BLOCK_N", "num_warps", "num_stages", "min_split_blocks", "max_units", "splits"),
    "preprocess": ("BLOCK_T", "num_warps"),
}

# Test hook: kind -> entries that override the picked configuration (tests shrink the tiles so that tiny problems cross
# several; a decode entry may fix ``splits``). Nothing is autotuned or cached while it is non-empty.
_TUNING: dict[str, dict] = {}


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
_JIT_STATE: dict = {"interpret": None, "tuners": {}}


def _jit(fn):
    _JIT_NAMES.append(fn.__name__)
    _RAW_FUNCTIONS[fn.__name__] = fn
    return fn


# The autotuning buckets are kernel arguments only so that triton.autotune can key on them: never specialised on (a
# bucket or batch of 1 would otherwise compile a second variant).
_NOT_SPECIALISED = {
    name: ("t_bucket", "s_bucket", "b_bucket")
    for name in ("_diff_attn_fwd", "_diff_attn_bwd_dkdv", "_diff_attn_bwd_dq")
}


def _jitted():
    """Decorate every kernel (and device function) with triton.jit, again if the interpreter switch changed since.
    Device functions call each other through this module's globals, so the decorated objects replace them there."""
    interpret = _interpreting()
    if _JIT_STATE["interpret"] is not interpret:
        for name in _JIT_NAMES:
            fn = _INTERPRETED_FUNCTIONS.get(name, _RAW_FUNCTIONS[name]) if interpret else _RAW_FUNCTIONS[name]
            globals()[name] = triton.jit(fn, do_not_specialize=_NOT_SPECIALISED.get(name, ()))
        _JIT_STATE["interpret"] = interpret
        _JIT_STATE["tuners"] = {}  # autotuners wrap the decorated kernels: rebuilt on demand
        _PLANS.clear()
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
    def _visible(
        t_rows,
        t_ok,
        keys,
        MASK_B,
        stride_mt,
        stride_ms,
        S,
        T,
        IS_CAUSAL: tl.constexpr,
        HAS_MASK: tl.constexpr,
        KEYS_FIRST: tl.constexpr,
    ):
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
    def _packed_rows(
        t0, u0, T, M_NOISE, R: tl.constexpr, R_PAD: tl.constexpr, UNITS: tl.constexpr, BLOCK_T: tl.constexpr
    ):
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
    def _key_ranges(
        lo,
        span,
        t0,
        S,
        T,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IS_CAUSAL: tl.constexpr,
        HAS_MASK: tl.constexpr,
    ):
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
    def _fwd_inner(
        acc1,
        l1,
        m1,
        acc2,
        l2,
        m2,
        q1,
        q2,
        K1_B,
        K2_B,
        V_ROW,
        MASK_B,
        t_s,
        ok_s,
        t_n,
        ok_n,
        d_ok,
        c_ok,
        stride_ks,
        stride_vs,
        stride_mt,
        stride_ms,
        S,
        T,
        qk_scale,
        start,
        end,
        D_PAD: tl.constexpr,
        R_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MASKED: tl.constexpr,
        IS_CAUSAL: tl.constexpr,
        HAS_MASK: tl.constexpr,
        IN_DTYPE: tl.constexpr,
        OP_DTYPE: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        # One sweep over K/V blocks [start, end) for both maps: each block's K1, K2 and 2d-wide value loaded once.
        # MASKED=False only for blocks that every row sees in full.
        offs_d = tl.arange(0, D_PAD)
        for n0 in range(start, end, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            k_ok = keys < S
            k_mask = k_ok[:, None] & d_ok[None, :]
            k1 = tl.load(K1_B + keys[:, None] * stride_ks + offs_d[None, :], mask=k_mask, other=0.0).to(OP_DTYPE)
            k2 = tl.load(K2_B + keys[:, None] * stride_ks + offs_d[None, :], mask=k_mask, other=0.0).to(OP_DTYPE)
            v = tl.load(V_ROW[None, :] + keys[:, None] * stride_vs, mask=k_ok[:, None] & c_ok[None, :], other=0.0).to(
                OP_DTYPE
            )
            s1 = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC) * qk_scale
            s2 = tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) * qk_scale
            if MASKED:
                vis1 = _visible(t_s, ok_s, keys, MASK_B, stride_mt, stride_ms, S, T, IS_CAUSAL, HAS_MASK, False)
                if R_PAD == 1:  # both tiles hold the same positions: one visibility (one mask load)
                    vis2 = vis1
                else:
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
    def _diff_attn_fwd(
        Q,
        K,
        V,
        LAM,
        MASK,
        OUT,
        O2,
        LSE1,
        LSE2,
        stride_qb,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_ks,
        stride_vb,
        stride_vh,
        stride_vs,
        stride_mb,
        stride_mt,
        stride_ms,
        stride_os,
        stride_ob,
        stride_ot,
        stride_oh,
        stride_ps,
        stride_pb,
        stride_pt,
        stride_ph,
        stride_l1s,
        stride_l2s,
        T,
        S,
        G,
        N_SIG,
        M_NOISE,
        split_len,
        qk_scale,
        t_bucket,
        s_bucket,
        b_bucket,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        R: tl.constexpr,
        R_PAD: tl.constexpr,
        UNITS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IS_CAUSAL: tl.constexpr,
        HAS_MASK: tl.constexpr,
        SPLIT: tl.constexpr,
        SAVE_STATS: tl.constexpr,
        IN_DTYPE: tl.constexpr,
        OP_DTYPE: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
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
        q1 = tl.load(
            Q_B + t_s[:, None] * stride_qt + (group_q + head_s)[:, None] * stride_qh + offs_d[None, :],
            mask=ok_s[:, None] & d_ok[None, :],
            other=0.0,
        ).to(OP_DTYPE)
        q2 = tl.load(
            Q_B + t_n[:, None] * stride_qt + (group_q + N_SIG + unit_n)[:, None] * stride_qh + offs_d[None, :],
            mask=ok_n[:, None] & d_ok[None, :],
            other=0.0,
        ).to(OP_DTYPE)
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
            acc1,
            l1,
            m1,
            acc2,
            l2,
            m2,
            q1,
            q2,
            K1_B,
            K2_B,
            V_ROW,
            MASK_B,
            t_s,
            ok_s,
            t_n,
            ok_n,
            d_ok,
            c_ok,
            stride_ks,
            stride_vs,
            stride_mt,
            stride_ms,
            S,
            T,
            qk_scale,
            lo,
            full,
            D_PAD,
            R_PAD,
            BLOCK_N,
            False,
            IS_CAUSAL,
            HAS_MASK,
            IN_DTYPE,
            OP_DTYPE,
            DOT_PREC,
        )
        acc1, l1, m1, acc2, l2, m2 = _fwd_inner(
            acc1,
            l1,
            m1,
            acc2,
            l2,
            m2,
            q1,
            q2,
            K1_B,
            K2_B,
            V_ROW,
            MASK_B,
            t_s,
            ok_s,
            t_n,
            ok_n,
            d_ok,
            c_ok,
            stride_ks,
            stride_vs,
            stride_mt,
            stride_ms,
            S,
            T,
            qk_scale,
            full,
            hi,
            D_PAD,
            R_PAD,
            BLOCK_N,
            True,
            IS_CAUSAL,
            HAS_MASK,
            IN_DTYPE,
            OP_DTYPE,
            DOT_PREC,
        )

        # A row that saw no key has l = 0 and acc = 0: its outputs are 0.
        l1_div = tl.where(l1 == 0.0, 1.0, l1)
        l2_div = tl.where(l2 == 0.0, 1.0, l2)
        o1 = acc1 / l1_div[:, None]
        o2 = acc2 / l2_div[:, None]
        store_s = ok_s[:, None] & c_ok[None, :]
        store_n = ok_n[:, None] & c_ok[None, :]
        OUT_S = (
            OUT
            + pid_s * stride_os
            + b * stride_ob
            + t_s[:, None] * stride_ot
            + (g * N_SIG + head_s)[:, None] * stride_oh
            + out_cols[None, :]
        )
        O2_N = (
            O2
            + pid_s * stride_ps
            + b * stride_pb
            + t_n[:, None] * stride_pt
            + (g * M_NOISE + unit_n)[:, None] * stride_ph
            + out_cols[None, :]
        )
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
                o2_s = tl.reshape(
                    tl.broadcast_to(tl.reshape(o2, (1, ROWS_N, 2 * D_PAD)), (R_PAD, ROWS_N, 2 * D_PAD)),
                    (ROWS_S, 2 * D_PAD),
                )
            tl.store(OUT_S, (o1 - lam * o2_s).to(OUT.dtype.element_ty), mask=store_s)
            if SAVE_STATS:
                # The backward's row statistics: log-sum-exp, +inf for a row that sees no key (its P is 0 there).
                tl.store(O2_N, o2.to(O2.dtype.element_ty), mask=store_n)
                tl.store(LSE1_S, tl.where(l1 == 0.0, float("inf"), m1 + tl.math.log2(l1_div)), mask=ok_s)
                tl.store(LSE2_N, tl.where(l2 == 0.0, float("inf"), m2 + tl.math.log2(l2_div)), mask=ok_n)

    @_jit
    def _merge_splits(
        PO, PL, row, rows_total, b, t, B, T, NSPLIT, out_cols, c_ok, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr
    ):
        # Σ_s 2^lse_s · o_s / Σ_s 2^lse_s over the key splits of one row (0 for a row no split saw a key of).
        sp = tl.arange(0, SPLITS_PAD)
        sp_ok = sp < NSPLIT
        lse = tl.load(PL + sp * (B * rows_total * T) + (b * rows_total + row) * T + t, mask=sp_ok, other=float("-inf"))
        top = _max(lse, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.math.exp2(lse - top)
        den = _sum(w, 0)
        parts = tl.load(
            PO
            + ((sp * B + b) * T + t)[:, None] * (rows_total * 2 * HEAD_DIM)
            + row * (2 * HEAD_DIM)
            + out_cols[None, :],
            mask=sp_ok[:, None] & c_ok[None, :],
            other=0.0,
        )
        return _sum(w[:, None] * parts, 0) / tl.where(den == 0.0, 1.0, den)

    @_jit
    def _diff_attn_decode_combine(
        PO1,
        PO2,
        PL1,
        PL2,
        LAM,
        OUT,
        stride_ob,
        stride_ot,
        stride_oh,
        B,
        T,
        G,
        N_SIG,
        M_NOISE,
        NSPLIT,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        R: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
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
        tl.store(
            OUT + b * stride_ob + t * stride_ot + h * stride_oh + out_cols, out.to(OUT.dtype.element_ty), mask=c_ok
        )

    @_jit
    def _diff_attn_bwd_preprocess(
        OUT,
        O2,
        DO,
        LAM,
        DELTA1,
        DELTA2,
        stride_ob,
        stride_ot,
        stride_oh,
        stride_pb,
        stride_pt,
        stride_ph,
        stride_db,
        stride_dt,
        stride_dh,
        T,
        G,
        N_SIG,
        M_NOISE,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        R: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
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
        o2 = tl.load(
            O2 + b * stride_pb + t[:, None] * stride_pt + (g * M_NOISE + u) * stride_ph + out_cols[None, :],
            mask=ok,
            other=0.0,
        ).to(tl.float32)
        dsum = tl.full((BLOCK_T, 2 * D_PAD), 0.0, dtype=tl.float32)
        for s in tl.static_range(R):
            h = g * N_SIG + u * R + s
            do = tl.load(
                DO + b * stride_db + t[:, None] * stride_dt + h * stride_dh + out_cols[None, :], mask=ok, other=0.0
            ).to(tl.float32)
            o = tl.load(
                OUT + b * stride_ob + t[:, None] * stride_ot + h * stride_oh + out_cols[None, :], mask=ok, other=0.0
            ).to(tl.float32)
            tl.store(DELTA1 + (b * G * N_SIG + h) * T + t, _sum(do * (o + lam * o2), 1), mask=t_ok)
            dsum += do
        tl.store(DELTA2 + ((b * G + g) * M_NOISE + u) * T + t, _sum(dsum * o2, 1), mask=t_ok)

    @_jit
    def _bwd_kv_inner(
        dk1,
        dk2,
        dv,
        k1,
        k2,
        v,
        Q1_B,
        Q2_B,
        DO_B,
        L1_B,
        L2_B,
        D1_B,
        D2_B,
        MASK_B,
        lam,
        keys,
        stride_qt,
        stride_qh,
        stride_dt,
        stride_dh,
        stride_mt,
        stride_ms,
        T,
        S,
        qk_scale,
        start,
        end,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        R: tl.constexpr,
        R_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        MASKED: tl.constexpr,
        IS_CAUSAL: tl.constexpr,
        HAS_MASK: tl.constexpr,
        IN_DTYPE: tl.constexpr,
        OP_DTYPE: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        # Query blocks [start, end) of one noise row and its r signal rows against one K/V block, in transposed
        # tiles (keys × rows). Map 1 back-propagates dO, map 2 −λ·dO' (dO' summed over the r signal rows); dk2 is
        # accumulated without its factor −λ (applied once at the store).
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
            q1 = tl.load(
                Q1_B + t_s[:, None] * stride_qt + sig[:, None] * stride_qh + offs_d[None, :],
                mask=ok_s[:, None] & d_ok[None, :],
                other=0.0,
            ).to(OP_DTYPE)
            q2 = tl.load(
                Q2_B + t_n[:, None] * stride_qt + offs_d[None, :], mask=ok_n[:, None] & d_ok[None, :], other=0.0
            ).to(OP_DTYPE)
            do = tl.load(
                DO_B + t_s[:, None] * stride_dt + sig[:, None] * stride_dh + out_cols[None, :],
                mask=ok_s[:, None] & c_ok[None, :],
                other=0.0,
            )
            lse1 = tl.load(L1_B + sig * T + t_s, mask=ok_s, other=float("inf"))
            delta1 = tl.load(D1_B + sig * T + t_s, mask=ok_s, other=0.0)
            lse2 = tl.load(L2_B + t_n, mask=ok_n, other=float("inf"))
            delta2 = tl.load(D2_B + t_n, mask=ok_n, other=0.0)
            p1 = tl.math.exp2(tl.dot(k1, tl.trans(q1), input_precision=DOT_PREC) * qk_scale - lse1[None, :])
            p2 = tl.math.exp2(tl.dot(k2, tl.trans(q2), input_precision=DOT_PREC) * qk_scale - lse2[None, :])
            if R == 1:
                # One noise row per signal row (same positions, dO' = dO): the combined form. D = P1 − λ·P2 gives
                # dV = Dᵀ·dO in one product, and the 2d-wide V·dOᵀ serves both maps' dS.
                if MASKED:
                    vis = _visible(t_s, ok_s, keys, MASK_B, stride_mt, stride_ms, S, T, IS_CAUSAL, HAS_MASK, True)
                    p1 = tl.where(vis, p1, 0.0)
                    p2 = tl.where(vis, p2, 0.0)
                do = do.to(OP_DTYPE)
                dv = tl.dot((p1 - lam * p2).to(IN_DTYPE).to(OP_DTYPE), do, dv, input_precision=DOT_PREC)
                dp = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
                ds1 = p1 * (dp - delta1[None, :])
                ds2 = p2 * (dp - delta2[None, :])
            else:
                if MASKED:
                    p1 = tl.where(
                        _visible(t_s, ok_s, keys, MASK_B, stride_mt, stride_ms, S, T, IS_CAUSAL, HAS_MASK, True),
                        p1,
                        0.0,
                    )
                    p2 = tl.where(
                        _visible(t_n, ok_n, keys, MASK_B, stride_mt, stride_ms, S, T, IS_CAUSAL, HAS_MASK, True),
                        p2,
                        0.0,
                    )
                # dO' of the noise row: the sum over its r signal rows, rounded to the inputs' type
                dsum = _sum(tl.reshape(do.to(tl.float32), (R_PAD, BLOCK_T, 2 * D_PAD)), 0).to(IN_DTYPE).to(OP_DTYPE)
                do = do.to(OP_DTYPE)
                dv = tl.dot(p1.to(IN_DTYPE).to(OP_DTYPE), do, dv, input_precision=DOT_PREC)
                dv = tl.dot((p2 * -lam).to(IN_DTYPE).to(OP_DTYPE), dsum, dv, input_precision=DOT_PREC)
                ds1 = p1 * (tl.dot(v, tl.trans(do), input_precision=DOT_PREC) - delta1[None, :])
                ds2 = p2 * (tl.dot(v, tl.trans(dsum), input_precision=DOT_PREC) - delta2[None, :])
            dk1 = tl.dot(ds1.to(IN_DTYPE).to(OP_DTYPE), q1, dk1, input_precision=DOT_PREC)
            dk2 = tl.dot(ds2.to(IN_DTYPE).to(OP_DTYPE), q2, dk2, input_precision=DOT_PREC)
        return dk1, dk2, dv

    @_jit
    def _diff_attn_bwd_dkdv(
        Q,
        K,
        V,
        DO,
        LAM,
        MASK,
        LSE1,
        LSE2,
        DELTA1,
        DELTA2,
        DK,
        DV,
        stride_qb,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_ks,
        stride_vb,
        stride_vh,
        stride_vs,
        stride_db,
        stride_dt,
        stride_dh,
        stride_mb,
        stride_mt,
        stride_ms,
        stride_dkb,
        stride_dkh,
        stride_dks,
        stride_dvb,
        stride_dvh,
        stride_dvs,
        T,
        S,
        G,
        N_SIG,
        M_NOISE,
        qk_scale,
        sm_scale,
        t_bucket,
        s_bucket,
        b_bucket,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        R: tl.constexpr,
        R_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IS_CAUSAL: tl.constexpr,
        HAS_MASK: tl.constexpr,
        IN_DTYPE: tl.constexpr,
        OP_DTYPE: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
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
        v = tl.load(
            V + b * stride_vb + (2 * g + half)[None, :] * stride_vh + c_d[None, :] + keys[:, None] * stride_vs,
            mask=v_mask,
            other=0.0,
        ).to(OP_DTYPE)
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
                dk1,
                dk2,
                dv,
                k1,
                k2,
                v,
                Q1_B,
                Q2_B,
                DO_B,
                LSE1 + row1,
                LSE2 + row2,
                DELTA1 + row1,
                DELTA2 + row2,
                MASK_B,
                lam,
                keys,
                stride_qt,
                stride_qh,
                stride_dt,
                stride_dh,
                stride_mt,
                stride_ms,
                T,
                S,
                qk_scale,
                t_lo,
                t_full,
                HEAD_DIM,
                D_PAD,
                R,
                R_PAD,
                BLOCK_T,
                True,
                IS_CAUSAL,
                HAS_MASK,
                IN_DTYPE,
                OP_DTYPE,
                DOT_PREC,
            )
            dk1, dk2, dv = _bwd_kv_inner(
                dk1,
                dk2,
                dv,
                k1,
                k2,
                v,
                Q1_B,
                Q2_B,
                DO_B,
                LSE1 + row1,
                LSE2 + row2,
                DELTA1 + row1,
                DELTA2 + row2,
                MASK_B,
                lam,
                keys,
                stride_qt,
                stride_qh,
                stride_dt,
                stride_dh,
                stride_mt,
                stride_ms,
                T,
                S,
                qk_scale,
                t_full,
                t_end,
                HEAD_DIM,
                D_PAD,
                R,
                R_PAD,
                BLOCK_T,
                False,
                IS_CAUSAL,
                HAS_MASK,
                IN_DTYPE,
                OP_DTYPE,
                DOT_PREC,
            )

        DK1_B = DK + b * stride_dkb + (2 * g) * stride_dkh + keys[:, None] * stride_dks + offs_d[None, :]
        tl.store(DK1_B, (dk1 * sm_scale).to(DK.dtype.element_ty), mask=k_mask)
        tl.store(DK1_B + stride_dkh, (dk2 * (-lam * sm_scale)).to(DK.dtype.element_ty), mask=k_mask)
        tl.store(
            DV + b * stride_dvb + (2 * g + half)[None, :] * stride_dvh + c_d[None, :] + keys[:, None] * stride_dvs,
            dv.to(DV.dtype.element_ty),
            mask=v_mask,
        )

    @_jit
    def _bwd_q_inner(
        dq1,
        dq2,
        q1,
        q2,
        do,
        dsum,
        lse1,
        lse2,
        delta1,
        delta2,
        K1_B,
        K2_B,
        V_ROW,
        MASK_B,
        t_s,
        ok_s,
        t_n,
        ok_n,
        d_ok,
        c_ok,
        stride_ks,
        stride_vs,
        stride_mt,
        stride_ms,
        S,
        T,
        qk_scale,
        start,
        end,
        D_PAD: tl.constexpr,
        R_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MASKED: tl.constexpr,
        IS_CAUSAL: tl.constexpr,
        HAS_MASK: tl.constexpr,
        IN_DTYPE: tl.constexpr,
        OP_DTYPE: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        offs_d = tl.arange(0, D_PAD)
        for n0 in range(start, end, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            k_ok = keys < S
            k_mask = k_ok[:, None] & d_ok[None, :]
            k1 = tl.load(K1_B + keys[:, None] * stride_ks + offs_d[None, :], mask=k_mask, other=0.0).to(OP_DTYPE)
            k2 = tl.load(K2_B + keys[:, None] * stride_ks + offs_d[None, :], mask=k_mask, other=0.0).to(OP_DTYPE)
            v = tl.load(V_ROW[None, :] + keys[:, None] * stride_vs, mask=k_ok[:, None] & c_ok[None, :], other=0.0).to(
                OP_DTYPE
            )
            p1 = tl.math.exp2(tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC) * qk_scale - lse1[:, None])
            p2 = tl.math.exp2(tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) * qk_scale - lse2[:, None])
            if MASKED:
                vis1 = _visible(t_s, ok_s, keys, MASK_B, stride_mt, stride_ms, S, T, IS_CAUSAL, HAS_MASK, False)
                if R_PAD == 1:  # both tiles hold the same positions: one visibility
                    vis2 = vis1
                else:
                    vis2 = _visible(t_n, ok_n, keys, MASK_B, stride_mt, stride_ms, S, T, IS_CAUSAL, HAS_MASK, False)
                p1 = tl.where(vis1, p1, 0.0)
                p2 = tl.where(vis2, p2, 0.0)
            dp1 = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
            if R_PAD == 1:  # dO' = dO: the 2d-wide dO·Vᵀ serves both maps
                dp2 = dp1
            else:
                dp2 = tl.dot(dsum, tl.trans(v), input_precision=DOT_PREC)
            ds1 = p1 * (dp1 - delta1[:, None])
            dq1 = tl.dot(ds1.to(IN_DTYPE).to(OP_DTYPE), k1, dq1, input_precision=DOT_PREC)
            ds2 = p2 * (dp2 - delta2[:, None])
            dq2 = tl.dot(ds2.to(IN_DTYPE).to(OP_DTYPE), k2, dq2, input_precision=DOT_PREC)
        return dq1, dq2

    @_jit
    def _diff_attn_bwd_dq(
        Q,
        K,
        V,
        DO,
        LAM,
        MASK,
        LSE1,
        LSE2,
        DELTA1,
        DELTA2,
        DQ,
        stride_qb,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_ks,
        stride_vb,
        stride_vh,
        stride_vs,
        stride_db,
        stride_dt,
        stride_dh,
        stride_mb,
        stride_mt,
        stride_ms,
        stride_dqb,
        stride_dqt,
        stride_dqh,
        T,
        S,
        G,
        N_SIG,
        M_NOISE,
        qk_scale,
        sm_scale,
        t_bucket,
        s_bucket,
        b_bucket,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        R: tl.constexpr,
        R_PAD: tl.constexpr,
        UNITS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IS_CAUSAL: tl.constexpr,
        HAS_MASK: tl.constexpr,
        IN_DTYPE: tl.constexpr,
        OP_DTYPE: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
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
        do = tl.load(
            DO
            + b * stride_db
            + t_s[:, None] * stride_dt
            + (g * N_SIG + head_s)[:, None] * stride_dh
            + out_cols[None, :],
            mask=ok_s[:, None] & c_ok[None, :],
            other=0.0,
        )
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
        dq1, dq2 = _bwd_q_inner(
            dq1,
            dq2,
            q1,
            q2,
            do,
            dsum,
            lse1,
            lse2,
            delta1,
            delta2,
            K1_B,
            K2_B,
            V_ROW,
            MASK_B,
            t_s,
            ok_s,
            t_n,
            ok_n,
            d_ok,
            c_ok,
            stride_ks,
            stride_vs,
            stride_mt,
            stride_ms,
            S,
            T,
            qk_scale,
            0,
            full,
            D_PAD,
            R_PAD,
            BLOCK_N,
            False,
            IS_CAUSAL,
            HAS_MASK,
            IN_DTYPE,
            OP_DTYPE,
            DOT_PREC,
        )
        dq1, dq2 = _bwd_q_inner(
            dq1,
            dq2,
            q1,
            q2,
            do,
            dsum,
            lse1,
            lse2,
            delta1,
            delta2,
            K1_B,
            K2_B,
            V_ROW,
            MASK_B,
            t_s,
            ok_s,
            t_n,
            ok_n,
            d_ok,
            c_ok,
            stride_ks,
            stride_vs,
            stride_mt,
            stride_ms,
            S,
            T,
            qk_scale,
            full,
            hi,
            D_PAD,
            R_PAD,
            BLOCK_N,
            True,
            IS_CAUSAL,
            HAS_MASK,
            IN_DTYPE,
            OP_DTYPE,
            DOT_PREC,
        )
        lam = tl.load(LAM)
        tl.store(
            DQ
            + b * stride_dqb
            + t_s[:, None] * stride_dqt
            + (group_q + head_s)[:, None] * stride_dqh
            + offs_d[None, :],
            (dq1 * sm_scale).to(DQ.dtype.element_ty),
            mask=q_mask_s,
        )
        tl.store(
            DQ
            + b * stride_dqb
            + t_n[:, None] * stride_dqt
            + (group_q + N_SIG + unit_n)[:, None] * stride_dqh
            + offs_d[None, :],
            (dq2 * (-lam * sm_scale)).to(DQ.dtype.element_ty),
            mask=q_mask_n,
        )


# ----------------------------------------------------------------------------------------------------------------------
# Host side: validation, launches, autograd.
# ----------------------------------------------------------------------------------------------------------------------


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _head_pad(d: int) -> int:
    """The head dimension of the tiles: a power of two (tl.arange), at least 16 (tl.dot); the padding is masked."""
    return max(_MIN_DOT, _next_pow2(d))


def _bucket(x: int) -> int:
    """A length's autotuning bucket: the next power of two, at least 16."""
    return max(_MIN_DOT, _next_pow2(x))


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _validate(query, key, value, lam, scaling, pair_stride, noise_ratio, attention_mask, is_causal):
    """Check the inputs; return (B, T, S, G, n, m, d, the boolean mask as a (B, 1, T, S) view or None). Every check
    reads only shapes, strides, dtypes, devices and the scalars (what _validated keys its cache on)."""
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
            f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}"
        )
    b, t, hq, d = query.shape
    if key.shape != value.shape:
        raise ValueError(
            f"key and value must have the same shape (B, 2G, S, d), got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    kb, hkv, s, kd = key.shape
    if kb != b or kd != d:
        raise ValueError(
            f"key/value shape {tuple(key.shape)} does not match query shape {tuple(query.shape)}: "
            "expected (B, 2G, S, d) with the query's batch size B and head_dim d"
        )
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
        raise ValueError(
            f"query has {hq} heads; with {hkv} key/value heads ({g} KV groups), pair_stride={n} and "
            f"noise_ratio={noise_ratio} it must have {g} × ({n} + {m}) = {g * (n + m)}"
        )
    if t > s:
        raise ValueError(f"query length {t} exceeds the key length {s}: the queries are the last T of the S keys")
    if not isinstance(lam, torch.Tensor) or lam.dim() != 0 or not lam.is_floating_point():
        raise ValueError(
            f"lam must be a 0-dimensional floating-point tensor (the layer's λ), got "
            f"{getattr(lam, 'shape', type(lam).__name__)}"
        )
    if lam.device != query.device:
        raise ValueError(f"lam must be on the query's device {query.device}, got {lam.device}")
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or not math.isfinite(scaling):
        raise ValueError(f"scaling must be a finite float, got {scaling!r}")
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
    mask = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
            raise TypeError(
                "attention_mask must be a boolean tensor (True = visible) broadcastable to (B, 1, T, S), "
                f"got {getattr(attention_mask, 'dtype', type(attention_mask).__name__)}"
            )
        if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
            raise ValueError(
                f"attention_mask must have shape (B or 1, 1, T or 1, S), got {tuple(attention_mask.shape)}"
            )
        if attention_mask.device != query.device:
            raise ValueError(
                f"attention_mask must be on the query's device {query.device}, got {attention_mask.device}"
            )
        # transformers' sdpa path slices a longer mask to the keys the same way.
        mask = attention_mask[..., :s]
        try:
            mask = mask.expand(b, 1, t, s)
        except RuntimeError:
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)} does not broadcast to (B, 1, T, S) = "
                f"{(b, 1, t, s)}"
            ) from None
    return b, t, s, g, n, m, d, mask


_VALIDATED: dict = {}  # input signature -> (B, T, S, G, n, m, d): what _validate found, for inputs that passed it
_VALIDATED_MAX = 256  # signatures kept (oldest dropped first): a model has a few per layer shape


def _validated(query, key, value, lam, scaling, pair_stride, noise_ratio, attention_mask, is_causal):
    """_validate, run once per input signature (every shape, stride, dtype and device it reads, and the scalars): a
    signature that passed once passes again, so later calls skip the checks. Returns what _validate returns."""
    try:
        signature = (
            query.shape,
            query.stride(),
            query.dtype,
            query.device,
            key.shape,
            key.stride(),
            key.dtype,
            key.device,
            value.shape,
            value.stride(),
            value.dtype,
            value.device,
            lam.shape,
            lam.dtype,
            lam.device,
            scaling,
            pair_stride,
            noise_ratio,
            is_causal,
            type(scaling),
            type(pair_stride),
            type(noise_ratio),
            type(is_causal),
            None if attention_mask is None else (attention_mask.shape, attention_mask.dtype, attention_mask.device),
        )
        found = _VALIDATED.get(signature)
    except (AttributeError, TypeError):  # not tensors, or unhashable scalars: the checks say what is wrong
        return _validate(query, key, value, lam, scaling, pair_stride, noise_ratio, attention_mask, is_causal)
    if found is None:
        result = _validate(query, key, value, lam, scaling, pair_stride, noise_ratio, attention_mask, is_causal)
        if len(_VALIDATED) >= _VALIDATED_MAX:
            del _VALIDATED[next(iter(_VALIDATED))]
        _VALIDATED[signature] = result[:7]
        return result
    b, t, s = found[0], found[1], found[2]
    mask = None if attention_mask is None else attention_mask[..., :s].expand(b, 1, t, s)
    return (*found, mask)


def _on_device(device):
    """Triton launches on the current CUDA device: make it the tensors' one (a no-op on CPU, the interpreter, and
    where it already is)."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _mask_args(mask, fallback):
    if mask is None:
        return fallback, 0, 0, 0
    return mask, mask.stride(0), mask.stride(2), mask.stride(3)


def _dtype_flags(dtype) -> dict:
    """The kernels' dtype constexprs (see the note above the kernels)."""
    in_dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]
    upcast = _interpreting() and dtype == torch.bfloat16
    return dict(
        IN_DTYPE=in_dtype,
        OP_DTYPE=tl.float32 if upcast else in_dtype,
        DOT_PREC="ieee" if dtype == torch.float32 else "tf32",
    )


# ----------------------------------------------------------------------------------------------------------------------
# Picking a launch configuration: pruning, pinned choices, autotuning, and the per-shape plan cache
# ----------------------------------------------------------------------------------------------------------------------


class _Shape(NamedTuple):
    """What a launch's configuration may depend on."""

    b: int  # batch
    t: int  # query positions
    s: int  # keys
    g: int  # KV groups
    n: int  # signal rows per group
    r: int  # noise ratio
    d: int  # head dim
    dtype: torch.dtype
    causal: bool
    masked: bool
    device: torch.device


_KERNELS = {
    "forward": "_diff_attn_fwd",
    "decode": "_diff_attn_fwd",
    "dkdv": "_diff_attn_bwd_dkdv",
    "dq": "_diff_attn_bwd_dq",
}
# The autotuning key (kernel arguments; triton.autotune adds every tensor argument's dtype): head dim, GDA's ratio and
# noise rows, KV groups, causal, mask, the power-of-two buckets of the batch, query and key lengths, and for the
# forward whether it saves the backward's statistics.
_TUNE_KEYS = ("HEAD_DIM", "R", "M_NOISE", "G", "IS_CAUSAL", "HAS_MASK", "t_bucket", "s_bucket", "b_bucket")
_TUNE_KEYS_OF = {"forward": _TUNE_KEYS + ("SAVE_STATS",), "dkdv": _TUNE_KEYS, "dq": _TUNE_KEYS}
# Score entries (B·G·m·T·S) below which nothing is timed: timing means compiling every configuration (seconds each),
# which a problem this small (microseconds whatever its tiles) cannot win back.
_TUNE_MIN_WORK = 1 << 24
_ACC_LIMIT = 128  # fp32 accumulator values per thread a tile may hold (of its 255 registers; see _keep)
_PINNED: dict = {"rules": {}, "autotune": True}
_PLANS: dict = {}  # (kind, shape, extra) -> (config, grid): the launch plan of a shape once picked
_PLANS_MAX = 512
_SHARED_MEMORY: dict = {}


def _shared_memory(device) -> int:
    """Shared memory per block in bytes (what the GPU lets a kernel opt into). The interpreter, which exists to check
    the GPU's configurations, answers as an H100 does."""
    if device.type != "cuda" or _interpreting():
        return 227 * 1024
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SHARED_MEMORY:
        props = torch.cuda.get_device_properties(index)
        _SHARED_MEMORY[index] = getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024
    return _SHARED_MEMORY[index]


def _keep(kind: str, cfg: dict, shape: _Shape, smem: int, heuristics: bool = True) -> bool:
    """Whether configuration ``cfg`` of kernel ``kind`` suits a launch on a GPU with ``smem`` bytes of shared memory
    per block. Tile and memory rules: no tile larger than the problem needs (a query tile within the query
    length's bucket, a key tile within the keys', no more noise rows per program than a group has); the tiles held in
    shared memory within ``smem`` (an upper bound: what a program keeps plus num_stages copies of what a step loads).
    Heuristics (``heuristics=False`` skips them: tuning_sweep times what they drop too, to test them): the fp32
    accumulators a thread holds at most _ACC_LIMIT values (of its 255 registers; operands, score tiles and addresses
    need the rest); 8 warps only for tiles whose accumulators would take more than half that on 4 warps (Triton's
    tutorial drops 8-warp tiles under 128×128 on Hopper, a small tile spread over 8 warps giving each too little work;
    these tiles carry two maps and a 2d-wide value, so the measure is their state, not their area). float32 inputs
    count double (their operands are twice as wide and their products run without tensor cores). The decode launch is
    memory-bound: only the tile and memory rules apply to it."""
    d_pad, r_pad, m = _head_pad(shape.d), _next_pow2(shape.r), shape.n // shape.r
    elt = 4 if shape.dtype == torch.float32 else 2
    bn, stages = cfg["BLOCK_N"], cfg["num_stages"]
    if bn > _bucket(shape.s):
        return False
    # Shared memory, an upper bound (compiled sizes, sm_90, Triton 3.6 and 3.9, were 40-100% of it): the tiles a
    # program keeps for its whole run plus num_stages copies of what each loop step loads.
    kv_tiles = 4 * bn * d_pad * elt  # K1, K2 (keys × d) and V (keys × 2d)
    if kind == "decode":
        units = min(max(_next_pow2(m), _MIN_DOT), cfg["max_units"])
        acc = (r_pad + 1) * units * 2 * d_pad  # both maps' 2d-wide accumulators
        shared = (r_pad + 1) * units * d_pad * elt + kv_tiles  # its loads are not multi-buffered
    else:
        bt, units = cfg["BLOCK_T"], cfg.get("UNITS", 1)
        if bt > _bucket(shape.t) or (units > 1 and units > m):
            return False
        if kind == "dkdv":
            acc = 4 * bn * d_pad  # dK1, dK2 (keys × d) and dV (keys × 2d)
            step = ((r_pad + 1) + 2 * r_pad) * bt * d_pad * elt  # a step's query rows (d) and dO rows (2d)
            shared = kv_tiles + stages * step
        else:
            rows_n = units * bt
            rows = (r_pad + 1) * rows_n  # signal and noise rows of a tile
            acc = rows * (2 * d_pad if kind == "forward" else d_pad)
            resident = rows * d_pad * elt  # Q1, Q2
            if kind == "dq":  # dO of the signal rows and, for r > 1, the noise rows' summed dO'
                resident += (r_pad + (r_pad > 1)) * rows_n * 2 * d_pad * elt
            shared = resident + stages * kv_tiles
    acc *= elt // 2
    if heuristics and kind != "decode":
        if acc / (32 * cfg["num_warps"]) > _ACC_LIMIT:
            return False
        if cfg["num_warps"] > 4 and acc / (32 * 4) <= _ACC_LIMIT / 2:
            return False
    return shared <= smem


def _prune(kind: str, configs, shape: _Shape) -> list:
    """The configurations of ``configs`` that suit ``shape`` (_keep), in their order; never empty (the smallest stays
    where nothing suits); only the first where the problem is too small for timing to matter."""
    smem = _shared_memory(shape.device)
    kept = [c for c in configs if _keep(kind, c, shape, smem)]
    if not kept:
        kept = [min(configs, key=lambda c: (c.get("BLOCK_T", 1) * c["BLOCK_N"], c["num_warps"], c["num_stages"]))]
    if kind in _TUNED_KINDS and shape.b * shape.g * (shape.n // shape.r) * shape.t * shape.s < _TUNE_MIN_WORK:
        kept = kept[:1]
    return kept


def _pinned(kind: str, shape: _Shape):
    """The configuration set_configs pinned for this launch, or None."""
    for rule in _PINNED["rules"].get(kind, ()):
        when = rule["when"]
        if all(_FEATURES[name](shape) == value for name, value in when.items()):
            return rule["config"]
    return None


_FEATURES = {  # what a pinned rule's "when" may name, read off a launch
    "head_dim": lambda sh: sh.d,
    "dtype": lambda sh: str(sh.dtype).removeprefix("torch."),
    "noise_ratio": lambda sh: sh.r,
    "causal": lambda sh: sh.causal,
    "masked": lambda sh: sh.masked,
    "t_bucket": lambda sh: _bucket(sh.t),
    "s_bucket": lambda sh: _bucket(sh.s),
    "b_bucket": lambda sh: _next_pow2(sh.b),
}


def _pick(kind: str, shape: _Shape) -> tuple[dict, bool, bool]:
    """(configuration, whether to autotune it instead, whether the choice may be cached for this shape)."""
    override = _TUNING.get(kind)
    pinned = _pinned(kind, shape)
    default = pinned if pinned is not None else _prune(kind, LAUNCH_CONFIGS[kind], shape)[0]
    if override:
        return {**default, **override}, False, False
    if pinned is not None or kind not in _TUNED_KINDS or not _PINNED["autotune"] or _interpreting():
        return default, False, True
    if len(_prune(kind, LAUNCH_CONFIGS[kind], shape)) < 2:
        return default, False, True
    if shape.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return default, False, False  # timing would break the capture: the default now, tuned after it
    return default, True, True


def _prune_for_autotune(kind, configs, named_args, **kwargs):
    """triton.autotune's early_config_prune: the same rules (_prune) on the launch's own arguments."""
    q = named_args["Q"]
    shape = _Shape(
        named_args["b_bucket"],
        named_args["T"],
        named_args["S"],
        named_args["G"],
        named_args["N_SIG"],
        kwargs["R"],
        kwargs["HEAD_DIM"],
        q.dtype,
        kwargs["IS_CAUSAL"],
        kwargs["HAS_MASK"],
        q.device,
    )
    by_dict = {_config_key(_config_dict(c)): c for c in configs}
    return [by_dict[_config_key(c)] for c in _prune(kind, [_config_dict(c) for c in configs], shape)]


def _config_dict(config) -> dict:
    """A triton.Config as this module's configuration dicts."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def _config_key(cfg: dict) -> tuple:
    return tuple(sorted(cfg.items()))


def _autotuner(kind: str):
    """triton.autotune over LAUNCH_CONFIGS[kind] wrapping the kernel (made once per decoration of the kernels)."""
    tuners = _JIT_STATE["tuners"]
    if kind not in tuners:
        configs = [
            triton.Config(
                {k: v for k, v in c.items() if k not in ("num_warps", "num_stages")},
                num_warps=c["num_warps"],
                num_stages=c["num_stages"],
            )
            for c in LAUNCH_CONFIGS[kind]
        ]
        prune = {"early_config_prune": partial(_prune_for_autotune, kind)}
        tuners[kind] = triton.autotune(configs, key=list(_TUNE_KEYS_OF[kind]), prune_configs_by=prune)(
            _jitted()[_KERNELS[kind]]
        )
    return tuners[kind]


def _remember(key, plan):
    if len(_PLANS) >= _PLANS_MAX:
        del _PLANS[next(iter(_PLANS))]
    _PLANS[key] = plan


def _launch(kind: str, shape: _Shape, grid, args, fixed: dict, config=None, extra=()) -> dict:
    """Launch kernel ``kind`` on ``args`` (positional) and ``fixed`` (the constexprs no configuration sets), with
    ``config`` if given, else the shape's cached plan, else the picked configuration (autotuned first where _pick says
    so: triton.autotune times the pruned list on these very arguments, which every tuned kernel only writes, never
    accumulates into, so its repeated launches leave the outputs right). ``grid`` maps a configuration to the grid.
    Returns the configuration launched."""
    kernel = _jitted()[_KERNELS[kind]]
    if config is not None:
        kernel[grid(config)](*args, **fixed, **config)
        return config
    key = (kind, shape, _interpreting(), *extra)
    plan = None if _TUNING else _PLANS.get(key)
    if plan is None:
        config, tune, cacheable = _pick(kind, shape)
        if tune:
            tuner = _autotuner(kind)
            tuner[grid](*args, **fixed)
            config = _config_dict(tuner.best_config)
        else:
            kernel[grid(config)](*args, **fixed, **config)
        if cacheable and not _TUNING:
            _remember(key, (config, grid(config)))
        return config
    config, grid_now = plan
    kernel[grid_now](*args, **fixed, **config)
    return config


def _shape_of(query, key, n, r, mask, is_causal) -> _Shape:
    b, t, _, d = query.shape
    return _Shape(
        b, t, key.shape[2], key.shape[1] // 2, n, r, d, query.dtype, is_causal, mask is not None, query.device
    )


def _forward(query, key, value, lam, scaling, n, r, mask, is_causal, save_stats, config=None):
    """The one-pass forward. Returns (out, o2, lse1, lse2); the last three are None unless save_stats."""
    b, t, hq, d = query.shape
    s, g = key.shape[2], key.shape[1] // 2
    m = n // r
    d_pad, r_pad = _head_pad(d), _next_pow2(r)
    out = query.new_empty(b, t, g * n, 2 * d)
    if save_stats:
        o2 = query.new_empty(b, t, g * m, 2 * d)
        lse1 = torch.empty(b, g * n, t, device=query.device, dtype=torch.float32)
        lse2 = torch.empty(b, g * m, t, device=query.device, dtype=torch.float32)
    else:
        o2, lse1, lse2 = out, out, out  # never written
    mask_t, smb, smt, sms = _mask_args(mask, key)

    def grid(cfg):
        return triton.cdiv(t, cfg["BLOCK_T"]), b * g * triton.cdiv(m, cfg["UNITS"]), 1

    args = (
        query,
        key,
        value,
        lam,
        mask_t,
        out,
        o2,
        lse1,
        lse2,
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        smb,
        smt,
        sms,
        0,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        0,
        o2.stride(0),
        o2.stride(1),
        o2.stride(2),
        0,
        0,
        t,
        s,
        g,
        n,
        m,
        s,
        scaling * _LOG2E,
        _bucket(t),
        _bucket(s),
        _next_pow2(b),
    )
    fixed = dict(
        HEAD_DIM=d,
        D_PAD=d_pad,
        R=r,
        R_PAD=r_pad,
        IS_CAUSAL=is_causal,
        HAS_MASK=mask is not None,
        SPLIT=False,
        SAVE_STATS=save_stats,
        **_dtype_flags(query.dtype),
    )
    _launch("forward", _shape_of(query, key, n, r, mask, is_causal), grid, args, fixed, config, extra=(save_stats,))
    return out, (o2 if save_stats else None), (lse1 if save_stats else None), (lse2 if save_stats else None)


def _decode_plan(b, g, m, s, r_pad, cfg, device) -> dict:
    """Launch shape of the decode path under configuration ``cfg``: every noise row of a group (with its signal rows)
    in one program, so each cache byte is read once per group; keys split over programs when B × G programs would
    leave the GPU idle (unless ``cfg`` fixes ``splits``)."""
    units = min(max(_next_pow2(m), _MIN_DOT), cfg["max_units"])  # the noise tile has `units` rows: at least 16
    unit_blocks = -(-m // units)
    block_n = cfg["BLOCK_N"]
    if "splits" in cfg:
        splits = cfg["splits"]
    else:
        sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if torch.device(device).type == "cuda"
            else 132
        )
        programs = b * g * unit_blocks
        splits = max(1, min(-(-2 * sms // programs), -(-s // (cfg["min_split_blocks"] * block_n))))
    split_len = -(-(-(-s // splits)) // block_n) * block_n
    return {
        "config": cfg,
        "units": units,
        "unit_blocks": unit_blocks,
        "splits": -(-s // split_len),
        "split_len": split_len,
    }


def _decode(query, key, value, lam, scaling, n, r, mask, is_causal, config=None):
    """One query token per sequence, no autograd: a program per (batch, group, key split) reads the group's cache
    once for all its n + m query rows; a second kernel merges the splits."""
    k = _jitted()
    b, t, hq, d = query.shape
    s, g = key.shape[2], key.shape[1] // 2
    m = n // r
    d_pad, r_pad = _head_pad(d), _next_pow2(r)
    shape = _shape_of(query, key, n, r, mask, is_causal)
    if config is not None:
        plan = _decode_plan(b, g, m, s, r_pad, config, query.device)
    else:
        key_ = ("decode", shape, _interpreting())
        plan = None if _TUNING else _PLANS.get(key_)
        if plan is None:
            cfg, _, cacheable = _pick("decode", shape)
            plan = _decode_plan(b, g, m, s, r_pad, cfg, query.device)
            if cacheable and not _TUNING:
                _remember(key_, plan)
    cfg, splits = plan["config"], plan["splits"]
    out = query.new_empty(b, t, g * n, 2 * d)
    mask_t, smb, smt, sms = _mask_args(mask, key)
    common = dict(
        HEAD_DIM=d,
        D_PAD=d_pad,
        R=r,
        R_PAD=r_pad,
        UNITS=plan["units"],
        BLOCK_T=1,
        BLOCK_N=cfg["BLOCK_N"],
        IS_CAUSAL=is_causal,
        HAS_MASK=mask is not None,
        SAVE_STATS=False,
        **_dtype_flags(query.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    grid = (t, b * g * plan["unit_blocks"], splits)
    strides = (
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        smb,
        smt,
        sms,
    )
    buckets = (_bucket(t), _bucket(s), _next_pow2(b))
    if splits == 1:
        k["_diff_attn_fwd"][grid](
            query,
            key,
            value,
            lam,
            mask_t,
            out,
            out,
            out,
            out,
            *strides,
            0,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            0,
            0,
            0,
            0,
            0,
            0,
            t,
            s,
            g,
            n,
            m,
            s,
            scaling * _LOG2E,
            *buckets,
            SPLIT=False,
            **common,
        )
        return out
    f32 = dict(device=query.device, dtype=torch.float32)
    po1, po2 = torch.empty(splits, b, t, g * n, 2 * d, **f32), torch.empty(splits, b, t, g * m, 2 * d, **f32)
    pl1, pl2 = torch.empty(splits, b, g * n, t, **f32), torch.empty(splits, b, g * m, t, **f32)
    k["_diff_attn_fwd"][grid](
        query,
        key,
        value,
        lam,
        mask_t,
        po1,
        po2,
        pl1,
        pl2,
        *strides,
        po1.stride(0),
        po1.stride(1),
        po1.stride(2),
        po1.stride(3),
        po2.stride(0),
        po2.stride(1),
        po2.stride(2),
        po2.stride(3),
        pl1.stride(0),
        pl2.stride(0),
        t,
        s,
        g,
        n,
        m,
        plan["split_len"],
        scaling * _LOG2E,
        *buckets,
        SPLIT=True,
        **common,
    )
    k["_diff_attn_decode_combine"][(b * t, g * n)](
        po1,
        po2,
        pl1,
        pl2,
        lam,
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        b,
        t,
        g,
        n,
        m,
        splits,
        HEAD_DIM=d,
        D_PAD=d_pad,
        R=r,
        SPLITS_PAD=_next_pow2(splits),
        num_warps=4,
    )
    return out


class _Backward:
    """The backward's launches: the row reductions (δ1, δ2, dλ) on construction, then dkdv() and dq(), each with the
    shape's picked configuration or a given one (tuning_sweep times them one by one)."""

    def __init__(self, dout, query, key, value, lam, out, o2, lse1, lse2, scaling, n, r, mask, is_causal):
        b, t, hq, d = query.shape
        s, g = key.shape[2], key.shape[1] // 2
        m = n // r
        d_pad, r_pad = _head_pad(d), _next_pow2(r)
        dout = _last_contiguous(dout.to(query.dtype))
        mask_t, smb, smt, sms = _mask_args(mask, key)
        f32 = dict(device=query.device, dtype=torch.float32)
        delta1, delta2 = torch.empty(b, g * n, t, **f32), torch.empty(b, g * m, t, **f32)
        cfg = {**_PREPROCESS_CONFIG, **_TUNING.get("preprocess", {})}
        _jitted()["_diff_attn_bwd_preprocess"][(triton.cdiv(t, cfg["BLOCK_T"]), b * g * m)](
            out,
            o2,
            dout,
            lam,
            delta1,
            delta2,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            o2.stride(0),
            o2.stride(1),
            o2.stride(2),
            dout.stride(0),
            dout.stride(1),
            dout.stride(2),
            t,
            g,
            n,
            m,
            HEAD_DIM=d,
            D_PAD=d_pad,
            R=r,
            BLOCK_T=cfg["BLOCK_T"],
            num_warps=cfg["num_warps"],
        )
        self.dlam = -delta2.sum()  # dλ = Σ_h Σ_t dO_h · (−O2 of its noise row) = −Σ δ2
        self.shape = _shape_of(query, key, n, r, mask, is_causal)
        self.dims = (b, t, s, g, m)
        q_strides = (query.stride(0), query.stride(1), query.stride(2))
        kv_strides = (key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2))
        d_strides = (dout.stride(0), dout.stride(1), dout.stride(2))
        self.common = (query, key, value, dout, lam, mask_t, lse1, lse2, delta1, delta2)
        self.strides = (*q_strides, *kv_strides, *d_strides, smb, smt, sms)
        self.scalars = (scaling * _LOG2E, scaling, _bucket(t), _bucket(s), _next_pow2(b))
        self.fixed = dict(
            HEAD_DIM=d,
            D_PAD=d_pad,
            R=r,
            R_PAD=r_pad,
            IS_CAUSAL=is_causal,
            HAS_MASK=mask is not None,
            **_dtype_flags(query.dtype),
        )
        self.dkey, self.dvalue = key.new_empty(key.shape), value.new_empty(value.shape)  # contiguous, as the fakes
        self.dquery = query.new_empty(query.shape)

    def dkdv(self, config=None) -> dict:
        b, t, s, g, m = self.dims
        dk, dv = self.dkey, self.dvalue
        args = (
            *self.common,
            dk,
            dv,
            *self.strides,
            dk.stride(0),
            dk.stride(1),
            dk.stride(2),
            dv.stride(0),
            dv.stride(1),
            dv.stride(2),
            t,
            s,
            g,
            self.shape.n,
            m,
            *self.scalars,
        )
        return _launch(
            "dkdv", self.shape, lambda cfg: (triton.cdiv(s, cfg["BLOCK_N"]), b * g), args, self.fixed, config
        )

    def dq(self, config=None) -> dict:
        b, t, s, g, m = self.dims
        dq = self.dquery
        args = (
            *self.common,
            dq,
            *self.strides,
            dq.stride(0),
            dq.stride(1),
            dq.stride(2),
            t,
            s,
            g,
            self.shape.n,
            m,
            *self.scalars,
        )
        return _launch(
            "dq",
            self.shape,
            lambda cfg: (triton.cdiv(t, cfg["BLOCK_T"]), b * g * triton.cdiv(m, cfg["UNITS"])),
            args,
            self.fixed,
            config,
        )


def _backward(dout, query, key, value, lam, out, o2, lse1, lse2, scaling, n, r, mask, is_causal):
    launches = _Backward(dout, query, key, value, lam, out, o2, lse1, lse2, scaling, n, r, mask, is_causal)
    launches.dkdv()
    launches.dq()
    return launches.dquery, launches.dkey, launches.dvalue, launches.dlam


# ----------------------------------------------------------------------------------------------------------------------
# Pinning configurations, and the sweep that measures them on a GPU
# ----------------------------------------------------------------------------------------------------------------------

_KINDS = ("forward", "dkdv", "dq", "decode")  # the kernels with launch lists (what set_configs and the sweep name)


def _required(kind: str) -> tuple:
    return tuple(k for k in _CONFIG_KEYS[kind] if k != "splits")  # decode's "splits" is optional (a test hook)


def _checked_config(kind: str, config, where: str) -> dict:
    if not isinstance(config, dict):
        raise ValueError(f"{where} must be a dict of {', '.join(_required(kind))}, got {config!r}")
    unknown = sorted(set(config) - set(_CONFIG_KEYS[kind]))
    missing = [k for k in _required(kind) if k not in config]
    if unknown or missing:
        raise ValueError(
            f"{where}: {kind} configurations take {', '.join(_CONFIG_KEYS[kind])} (all but 'splits' "
            f"required); unknown {unknown}, missing {missing}"
        )
    for name, value in config.items():
        pow2 = name in ("BLOCK_T", "BLOCK_N", "UNITS", "num_warps")
        smallest = _MIN_DOT if name in ("BLOCK_T", "BLOCK_N") else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < smallest or (pow2 and value & (value - 1)):
            raise ValueError(
                f"{where}[{name!r}] must be an int >= {smallest}{' and a power of two' if pow2 else ''}, got {value!r}"
            )
    return dict(config)


def set_configs(configs=None, *, autotune: bool = True) -> None:
    """Pin the kernels' launch configurations (for instance what :func:`tuning_sweep` measured), so that those launches
    use them and are never autotuned.

    ``configs`` maps a kernel (``"forward"``, ``"dkdv"``, ``"dq"``, ``"decode"``) to one configuration dict (for every
    launch of it) or to a list of rules ``{"when": {...}, "config": {...}}``, tried in order, the first whose ``when``
    matches the launch winning (a rule without ``when`` matches every launch). ``when`` may name ``head_dim``,
    ``dtype`` (``"bfloat16"``...), ``noise_ratio``, ``causal``, ``masked``, ``t_bucket`` / ``s_bucket`` (the query and
    key lengths' next power of two, at least 16) and ``b_bucket`` (the batch's next power of two). A configuration
    names the entries of LAUNCH_CONFIGS[kernel]. ``tuning_sweep(...)["pinned"]`` is such a mapping. ``None`` (or
    ``{}``) unpins everything. ``autotune=False``: launches no rule matches take their kernel's default configuration
    (the first entry of LAUNCH_CONFIGS that suits them) instead of being autotuned.
    """
    rules = {}
    for kind, value in (configs or {}).items():
        if kind not in _KINDS:
            raise ValueError(f"set_configs: unknown kernel {kind!r}; kernels: {', '.join(_KINDS)}")
        entries = [{"config": value}] if isinstance(value, dict) else value
        if not isinstance(entries, (list, tuple)):
            raise ValueError(f"set_configs: {kind} must map to a configuration dict or a list of rules, got {value!r}")
        checked = []
        for i, rule in enumerate(entries):
            where = f"set_configs: {kind}[{i}]"
            if not isinstance(rule, dict) or "config" not in rule or set(rule) - {"when", "config"}:
                raise ValueError(
                    f"{where} must be {{'when': {{...}}, 'config': {{...}}}} ('when' optional), got {rule!r}"
                )
            when = rule.get("when") or {}
            unknown = sorted(set(when) - set(_FEATURES))
            if not isinstance(when, dict) or unknown:
                raise ValueError(f"{where}['when'] may name {', '.join(_FEATURES)}; got {when!r}")
            checked.append({"when": dict(when), "config": _checked_config(kind, rule["config"], f"{where}['config']")})
        rules[kind] = checked
    _PINNED["rules"] = rules
    _PINNED["autotune"] = bool(autotune)
    _PLANS.clear()


def load_configs(path, *, autotune: bool = False) -> dict:
    """Pin the configurations of a JSON file (set_configs): either such a mapping or a :func:`tuning_sweep` result
    (its ``"pinned"``). Returns the mapping pinned."""
    with open(path) as f:
        data = json.load(f)
    configs = data.get("pinned", data) if isinstance(data, dict) else data
    set_configs(configs, autotune=autotune)
    return configs


# The sweep's problems: Llama-3.2-1B's attention as DIFF V1 (32 query heads and 8 KV heads of width 64: 4 KV groups of
# 4 signal and 4 noise rows, K1/K2 and V0/V1 per group), causal; prefill, training (the backward) and decode.
SWEEP_SHAPES = (
    {"name": "prefill 1x8192", "kernels": ["forward"], "batch": 1, "queries": 8192, "keys": 8192},
    {"name": "prefill 8x2048", "kernels": ["forward"], "batch": 8, "queries": 2048, "keys": 2048},
    {"name": "train 8x2048", "kernels": ["dkdv", "dq"], "batch": 8, "queries": 2048, "keys": 2048},
    {"name": "decode b1 s4096", "kernels": ["decode"], "batch": 1, "queries": 1, "keys": 4096},
    {"name": "decode b32 s4096", "kernels": ["decode"], "batch": 32, "queries": 1, "keys": 4096},
)
_SWEEP_MODEL = {"groups": 4, "n": 4, "noise_ratio": 1, "head_dim": 64, "causal": True}
# Tiny problems for a smoke run of the sweep under the interpreter (TRITON_INTERPRET=1, device="cpu"): its logic, not
# its timings; the configurations whose tiles fit 24 tokens (seconds).
SWEEP_SMOKE_SHAPES = tuple(
    {
        "name": f"smoke {name}",
        "kernels": kernels,
        "batch": 1,
        "queries": t,
        "keys": 24,
        "groups": 1,
        "n": 2,
        "head_dim": 16,
    }
    for name, kernels, t in (("prefill", ["forward"], 24), ("train", ["dkdv", "dq"], 24), ("decode", ["decode"], 1))
)


def _time_ms(fn, rep_ms: float, device) -> float:
    """Median milliseconds of ``fn``: triton.testing.do_bench on a GPU (CUDA events, the L2 cache flushed before each
    run); under the interpreter, the wall-clock time of one run (only the sweep's logic is tested there)."""
    if device.type == "cuda":
        return float(triton.testing.do_bench(fn, warmup=max(1.0, rep_ms / 4), rep=rep_ms, return_mode="median"))
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _sweep_case(spec: dict, dtype, device):
    """The inputs of one sweep problem (seeded) and, per kernel, (launch(config), outputs()) closures."""
    p = {**_SWEEP_MODEL, **spec}
    b, t, s, g, n, r, d = p["batch"], p["queries"], p["keys"], p["groups"], p["n"], p["noise_ratio"], p["head_dim"]
    causal = p["causal"]
    gen = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(b, t, g * (n + n // r), d, generator=gen, device=device, dtype=dtype)
    key, value = (torch.randn(b, 2 * g, s, d, generator=gen, device=device, dtype=dtype) for _ in range(2))
    lam = torch.tensor(0.6, device=device)
    scaling = d**-0.5
    shape = _Shape(b, t, s, g, n, r, d, dtype, causal, False, device)
    state = {}

    def backward():
        if "bw" not in state:
            stats = _forward(
                query,
                key,
                value,
                lam,
                scaling,
                n,
                r,
                None,
                causal,
                True,
                config=_prune("forward", LAUNCH_CONFIGS["forward"], shape)[0],
            )
            dout = torch.randn(stats[0].shape, generator=gen, device=device, dtype=dtype)
            state["bw"] = _Backward(dout, query, key, value, lam, *stats, scaling, n, r, None, causal)
        return state["bw"]

    def forward(cfg):
        state["out"] = _forward(
            query, key, value, lam, scaling, n, r, None, causal, p.get("save_stats", False), config=cfg
        )[0]

    def decode(cfg):
        state["out"] = _decode(query, key, value, lam, scaling, n, r, None, causal, config=cfg)

    kernels = {
        "forward": (forward, lambda: [state["out"]]),
        "decode": (decode, lambda: [state["out"]]),
        "dkdv": (lambda cfg: backward().dkdv(cfg), lambda: [backward().dkey, backward().dvalue]),
        "dq": (lambda cfg: backward().dq(cfg), lambda: [backward().dquery]),
    }
    problem = {
        "batch": b,
        "queries": t,
        "keys": s,
        "groups": g,
        "n": n,
        "noise_ratio": r,
        "head_dim": d,
        "causal": causal,
    }
    return shape, problem, kernels


def _sweep_plan(shapes, dtype, device) -> list:
    """Per (problem, kernel): the configurations to time, each with whether _prune's heuristics would keep it. Every
    configuration that fits the problem and the device is timed, so the sweep also measures what the pruning drops."""
    smem = _shared_memory(device)
    plan = []
    for i, spec in enumerate(shapes):
        p = {**_SWEEP_MODEL, **spec}
        shape = _Shape(
            p["batch"],
            p["queries"],
            p["keys"],
            p["groups"],
            p["n"],
            p["noise_ratio"],
            p["head_dim"],
            dtype,
            p["causal"],
            False,
            device,
        )
        for kind in spec["kernels"]:
            if kind not in _KINDS:
                raise ValueError(
                    f"sweep problem {spec.get('name')!r}: unknown kernel {kind!r}; kernels: {', '.join(_KINDS)}"
                )
            configs = LAUNCH_CONFIGS[kind]
            timed = [c for c in configs if _keep(kind, c, shape, smem, heuristics=False)] or configs[-1:]
            plan.append((i, kind, shape, [(c, _keep(kind, c, shape, smem)) for c in timed]))
    return plan


def _sweep_warm(shapes, dtype, device, items) -> dict:
    """A warm-up worker (a separate process): launch each (problem index, kernel, configuration) of ``items`` once,
    which compiles it into Triton's on-disk cache, where the sweep's own first launch then finds it. Returns the
    seconds each took, or its error."""
    device = torch.device(device)
    done, cases = {}, {}
    with _on_device(device):
        for i, kind, cfg in items:
            if i not in cases:
                cases[i] = _sweep_case(shapes[i], dtype, device)[2]
            start = time.perf_counter()
            try:
                cases[i][kind][0](cfg)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                done[(i, kind, _config_key(cfg))] = round(time.perf_counter() - start, 2)
            except Exception as error:  # the sweep's own launch records it
                done[(i, kind, _config_key(cfg))] = f"{type(error).__name__}"
    return done


def _warm_in_workers(shapes, dtype, device, plan, workers: int, timeout_s: float) -> dict:
    """Compile the plan's configurations in ``workers`` processes at once (each imports this module under its own name,
    so Triton's cache keys match). One launch per distinct compiled variant: configurations a kernel shares between
    problems of the same head layout compile once. Any failure here only costs the parallelism."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures import wait as wait_futures

    seen, items = set(), []
    for i, kind, shape, configs in plan:
        for cfg, _ in configs:
            variant = (
                kind,
                _config_key(cfg),
                shape.r,
                shape.d,
                shape.causal,
                shape.masked,
                shapes[i].get("save_stats", False),
                shape.t == 1,
            )
            if variant not in seen:
                seen.add(variant)
                items.append((i, kind, cfg))
    workers = max(1, min(workers, len(items)))
    shares = [items[w::workers] for w in range(workers)]
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = [pool.submit(_sweep_warm, shapes, dtype, str(device), share) for share in shares]
        finished, _ = wait_futures(futures, timeout=timeout_s)
        done = {}
        for future in finished:
            if future.exception() is None:
                done.update(future.result())
        return done
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def tuning_sweep(
    shapes=SWEEP_SHAPES, dtype=torch.bfloat16, device="cuda", rep_ms: float = 20.0, budget_s: float = 85.0, workers=None
) -> dict:
    """Time every launch configuration of every kernel on the given problems, and say which is fastest.

    ``shapes``: problems, dicts with ``name``, ``kernels`` (among ``"forward"``, ``"dkdv"``, ``"dq"``, ``"decode"``),
    ``batch``, ``queries``, ``keys`` and optionally ``groups``, ``n``, ``noise_ratio``, ``head_dim``, ``causal``,
    ``save_stats`` (the forward with the backward's statistics). The default, SWEEP_SHAPES, is Llama-3.2-1B's attention
    as DIFF V1 (4 KV groups of 4 signal and 4 noise rows, d = 64, causal): the forward at prefill 1x8192 and 8x2048,
    both backward kernels at training 8x2048, decode at batch 1 and 32 over 4096 keys.

    For each problem and kernel, every configuration of LAUNCH_CONFIGS that fits the problem and the device is
    launched directly (no autotuning, no pinned choice): once (compiling it; ``first_call_s``), its outputs compared
    with the first configuration's (``max_rel_diff``, relative to the largest output; ``agrees`` within 2^-5 for 16-bit
    inputs, 1e-3 for float32), then timed by ``triton.testing.do_bench`` (CUDA events, the L2 cache flushed before each
    run, the median over about ``rep_ms`` ms of runs). Configurations that _prune's heuristics drop are timed too and
    marked ``pruned``, so the sweep also tests those rules. The backward kernels run on the statistics of one forward.
    A configuration that fails (to compile or to run) is recorded with its error, not raised; once ``budget_s``
    seconds have passed the rest are recorded as skipped.

    Cost: with the default lists, 26 distinct compilations (8 forward, 6 dkdv, 7 dq, 5 decode; the two prefill problems
    share theirs) and 40 timings. Compiling one took 3–54 s on the 2-core CPU machine these lists were checked on
    (spilling configurations are the slow ones to compile); on a GPU host's CPU perhaps 1–10 s, i.e. 60–120 s in
    series. So ``workers`` processes (default: half the CPU cores, at most 8; 0 = none) first compile them in parallel
    into Triton's on-disk cache (spawned processes importing this module: ~10 s to start), after which each first
    launch here is a cache load; timings add about 40 × (rep_ms + 10 ms). Estimate (not yet measured): 30–60 s on an
    H100/H200 with 8 workers; ``budget_s`` caps it either way.

    Returns a JSON-serialisable dict: ``device``, ``capability``, ``dtype``, ``triton``, ``torch``, ``rep_ms``,
    ``budget_s``, ``workers``, ``warm_s`` (the parallel compile phase), ``elapsed_s``; ``results``, one entry per
    (problem, kernel): ``kernel``, ``shape`` (the problem's name), ``problem`` (its sizes), ``when`` (the set_configs
    features of this launch), ``timings`` (per configuration: ``config``, ``pruned``, ``compile_s`` (in a worker, or
    null), ``first_call_s``, ``ms`` (median, or null), ``max_rel_diff``, ``agrees``, ``error`` (null, or the
    exception's first line), ``skipped`` (null, or why)), ``best`` (the fastest agreeing configuration, or null),
    ``best_ms``, ``default`` (the configuration the kernel uses untuned: the first _prune keeps), ``default_ms``; and
    ``pinned``: a set_configs mapping pinning each problem's best (a rule per problem, then the configuration fastest
    over all of a kernel's problems for every other launch). :func:`format_sweep` renders it as a text table.
    """
    if triton is None:
        raise RuntimeError("tuning_sweep needs triton (`pip install triton`); it is not installed")
    device = torch.device(device)
    if not is_available(device):
        raise ValueError(f"tuning_sweep needs a CUDA device (or TRITON_INTERPRET=1), got device={device}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of float32, bfloat16, float16, got {dtype}")
    start = time.perf_counter()
    shapes = [dict(spec) for spec in shapes]
    plan = _sweep_plan(shapes, dtype, device)
    if workers is None:
        workers = min(8, (os.cpu_count() or 2) // 2)
    compiled = {}
    if workers:
        try:
            compiled = _warm_in_workers(shapes, dtype, device, plan, workers, timeout_s=0.7 * budget_s)
        except Exception:  # no parallel compile (no fork/spawn, a pickling problem): compile in series below
            compiled = {}
    warm_s = round(time.perf_counter() - start, 1)
    tol = 1e-3 if dtype == torch.float32 else 2.0**-5
    results, cases = [], {}
    with _on_device(device):
        for i, kind, shape, configs in plan:
            if i not in cases:
                cases = {i: _sweep_case(shapes[i], dtype, device)}  # one problem's tensors alive at a time
            problem, kernels = cases[i][1], cases[i][2]
            launch, outputs = kernels[kind]
            timings, reference = [], None
            for cfg, kept in configs:
                warm = next((v for k, v in compiled.items() if k[1] == kind and k[2] == _config_key(cfg)), None)
                row = {
                    "config": dict(cfg),
                    "pruned": not kept,
                    "compile_s": warm if isinstance(warm, float) else None,
                    "first_call_s": None,
                    "ms": None,
                    "max_rel_diff": None,
                    "agrees": None,
                    "error": None,
                    "skipped": None,
                }
                timings.append(row)
                if time.perf_counter() - start > budget_s:
                    row["skipped"] = f"time budget ({budget_s:.0f} s) spent"
                    continue
                try:
                    first = time.perf_counter()
                    launch(cfg)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    row["first_call_s"] = round(time.perf_counter() - first, 3)
                    got = [x.detach().float().clone() for x in outputs()]
                    reference = got if reference is None else reference
                    scale = max(max(ref.abs().max().item() for ref in reference), 1e-30)
                    row["max_rel_diff"] = max((x - ref).abs().max().item() for x, ref in zip(got, reference)) / scale
                    row["agrees"] = bool(row["max_rel_diff"] <= tol)
                    row["ms"] = round(_time_ms(lambda: launch(cfg), rep_ms, device), 4)
                except Exception as error:  # a configuration that fails is a result, not the sweep's end
                    text = str(error).strip().splitlines()
                    row["error"] = f"{type(error).__name__}: {text[0][:300] if text else ''}"
            ok = [row for row in timings if row["ms"] is not None and row["agrees"]]
            best = min(ok, key=lambda row: row["ms"]) if ok else None
            default = _prune(kind, LAUNCH_CONFIGS[kind], shape)[0]
            default_row = next((row for row in timings if row["config"] == default), None)
            results.append(
                {
                    "kernel": kind,
                    "shape": shapes[i]["name"],
                    "problem": problem,
                    "when": {
                        name: _FEATURES[name](shape)
                        for name in ("head_dim", "dtype", "noise_ratio", "causal", "t_bucket", "s_bucket", "b_bucket")
                    },
                    "timings": timings,
                    "best": best["config"] if best else None,
                    "best_ms": best["ms"] if best else None,
                    "default": dict(default),
                    "default_ms": default_row["ms"] if default_row else None,
                }
            )
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "triton interpreter (CPU)",
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))) if device.type == "cuda" else None,
        "dtype": str(dtype).removeprefix("torch."),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "rep_ms": rep_ms,
        "budget_s": budget_s,
        "workers": workers,
        "warm_s": warm_s,
        "elapsed_s": round(time.perf_counter() - start, 1),
        "results": results,
        "pinned": _pinned_from(results),
    }


def _pinned_from(results) -> dict:
    """set_configs rules from a sweep's results: each problem's best, then the kernel's best over all its problems."""
    pinned = {}
    for kind in _KINDS:
        entries = [e for e in results if e["kernel"] == kind and e["best"] is not None]
        if not entries:
            continue
        rules = [{"when": e["when"], "config": e["best"]} for e in entries]
        totals = {}
        for config in {_config_key(e["best"]): e["best"] for e in entries}.values():
            times = [
                next((row["ms"] for row in e["timings"] if row["config"] == config and row["agrees"]), None)
                for e in entries
            ]
            if None not in times:
                totals[_config_key(config)] = (sum(times), config)
        overall = min(totals.values(), key=lambda x: x[0])[1] if totals else entries[0]["best"]
        pinned[kind] = rules + [{"config": overall}]
    return pinned


def _config_name(cfg) -> str:
    if cfg is None:
        return "-"
    short = {
        "BLOCK_T": "T",
        "BLOCK_N": "N",
        "UNITS": "U",
        "num_warps": "w",
        "num_stages": "s",
        "min_split_blocks": "split≥",
        "max_units": "units≤",
        "splits": "splits=",
    }
    return " ".join(f"{short.get(k, k)}{v}" for k, v in cfg.items())


def format_sweep(result: dict, every: bool = False) -> str:
    """A tuning_sweep result as a text table: per kernel and problem, the fastest configuration, its time, the
    default's, and how many configurations ran, failed or were skipped; ``every=True`` lists each configuration."""
    lines = [
        f"tuning sweep on {result['device']} (sm {result['capability']}), {result['dtype']}, triton "
        f"{result['triton']}, torch {result['torch']}: {result['elapsed_s']} s",
        f"{'kernel':8} {'problem':18} {'best configuration':34} {'best ms':>8} {'default ms':>10}  ran/failed/skipped",
    ]
    for e in result["results"]:
        ran = sum(row["ms"] is not None for row in e["timings"])
        failed = sum(row["error"] is not None or row["agrees"] is False for row in e["timings"])
        skipped = sum(row["skipped"] is not None for row in e["timings"])
        best = "-" if e["best_ms"] is None else f"{e['best_ms']:.4f}"
        default = "-" if e["default_ms"] is None else f"{e['default_ms']:.4f}"
        lines.append(
            f"{e['kernel']:8} {e['shape']:18} {_config_name(e['best']):34} {best:>8} {default:>10}  "
            f"{ran}/{failed}/{skipped}"
        )
        if every:
            for row in e["timings"]:
                what = f"{row['ms']:.4f} ms" if row["ms"] is not None else row["error"] or row["skipped"] or "-"
                flag = "" if row["agrees"] in (None, True) else f"  DISAGREES (max rel diff {row['max_rel_diff']:.3g})"
                lines.append(f"    {_config_name(row['config']):40} {what}{flag}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# PyTorch custom ops (torch.library.custom_op), so that torch.compile (fullgraph, inductor, CUDA graphs) keeps the
# kernels in its graph as opaque calls: the dispatcher runs the host code above on real tensors, the fake
# implementations give the outputs' shapes, dtypes and strides to the tracer, and the autograd registration ties the
# backward op to the forward one. Eager calls go through the same ops and the same kernels.
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
    return (
        query.new_empty(out),
        query.new_empty(o2),
        query.new_empty(lse1, dtype=torch.float32),
        query.new_empty(lse2, dtype=torch.float32),
    )


def _backward_impl(dout, query, key, value, lam, out, o2, lse1, lse2, mask, scaling, n, r, is_causal):
    query, key, value = _last_contiguous(query), _last_contiguous(key), _last_contiguous(value)
    out, o2 = _last_contiguous(out), _last_contiguous(o2)
    with _on_device(query.device):
        return _backward(
            dout,
            query,
            key,
            value,
            lam,
            out,
            o2,
            lse1.contiguous(),
            lse2.contiguous(),
            scaling,
            n,
            r,
            _mask_bits(mask),
            is_causal,
        )


def _backward_fake(dout, query, key, value, lam, out, o2, lse1, lse2, mask, scaling, n, r, is_causal):
    return (
        query.new_empty(query.shape),
        key.new_empty(key.shape),
        value.new_empty(value.shape),
        query.new_empty((), dtype=torch.float32),
    )


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
    raise RuntimeError(
        f"{_OP_NAMESPACE}::diff_attn_v1_backward is once_differentiable: the fused kernel's backward is "
        "not itself differentiable (no second-order gradients through differential_attention_triton)"
    )


def _define_ops():
    """Define the three ops, or find them where another copy of this file (a saved folder's remote code, imported
    beside the installed package) already defined them: an op name can be defined once per process."""
    namespace = getattr(torch.ops, _OP_NAMESPACE)
    if not all(hasattr(namespace, name) for name in _OP_SCHEMAS):
        _register_ops()
    return tuple(getattr(namespace, name).default for name in _OP_SCHEMAS)


def _register_ops():
    forward = torch.library.custom_op(
        f"{_OP_NAMESPACE}::diff_attn_v1_forward",
        _forward_impl,
        mutates_args=(),
        schema=_OP_SCHEMAS["diff_attn_v1_forward"],
    )
    backward = torch.library.custom_op(
        f"{_OP_NAMESPACE}::diff_attn_v1_backward",
        _backward_impl,
        mutates_args=(),
        schema=_OP_SCHEMAS["diff_attn_v1_backward"],
    )
    inference = torch.library.custom_op(
        f"{_OP_NAMESPACE}::diff_attn_v1_inference",
        _inference_impl,
        mutates_args=(),
        schema=_OP_SCHEMAS["diff_attn_v1_inference"],
    )
    forward.register_fake(_forward_fake)
    backward.register_fake(_backward_fake)
    inference.register_fake(_inference_fake)
    forward.register_autograd(_backward_formula, setup_context=_setup_context)
    backward.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


# torch.ops.difftransformer.diff_attn_v1_forward / _backward / _inference (OpOverloads).
_OP_FORWARD, _OP_BACKWARD, _OP_INFERENCE = _define_ops()


def differential_attention_triton(
    query, key, value, lam, scaling, pair_stride, noise_ratio=1, attention_mask=None, is_causal=True
):
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
    # Under torch.compile the checks are traced once per graph anyway (and a traced cache would only add guards).
    checks = _validate if torch.compiler.is_compiling() else _validated
    b, t, s, g, n, m, d, mask = checks(
        query, key, value, lam, scaling, pair_stride, noise_ratio, attention_mask, is_causal
    )
    if b == 0 or t == 0 or s == 0:
        return query.new_zeros(b, t, g * n, 2 * d)
    query, key, value = _last_contiguous(query), _last_contiguous(key), _last_contiguous(value)
    lam32 = lam.float()
    scaling = float(scaling)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value, lam)):
        return _OP_FORWARD(query, key, value, lam32, mask, scaling, n, noise_ratio, is_causal)[0]
    if _direct_call(query, key, value, lam32, mask):
        return _inference_impl(query, key, value, lam32, mask, scaling, n, noise_ratio, is_causal)
    return _OP_INFERENCE(query, key, value, lam32, mask, scaling, n, noise_ratio, is_causal)


def _direct_call(*tensors) -> bool:
    """Whether the inference op's implementation may be called directly, skipping the dispatcher: nothing is being
    compiled or traced (torch.compile, export), no dispatch mode is active (FakeTensorMode, FlopCounterMode, ...) and
    every input is a plain tensor (no subclass: a FakeTensor, a DTensor). The op and the direct call run the same
    function; the op adds only its dispatch."""
    if torch.compiler.is_compiling() or _current_dispatch_mode() is not None:
        return False
    return all(x is None or type(x) is torch.Tensor for x in tensors)


__all__ = [
    "LAUNCH_CONFIGS",
    "SWEEP_SHAPES",
    "SWEEP_SMOKE_SHAPES",
    "differential_attention_triton",
    "format_sweep",
    "is_available",
    "load_configs",
    "set_configs",
    "tuning_sweep",
]
