"""The decode step's differential epilogues as one Triton kernel each (docs/model.md, "Kernels").

A decode step on a GPU is bound by the host: every kernel launch costs about as much time as a Llama layer's
arithmetic for one token. After its stock SDPA calls, a differential layer combines the maps' outputs, and these
kernels do that combine in one launch where PyTorch needs three or four:

* :func:`v1_combine_norm`: DIFF V1's ``(1 − λinit)·RMSNorm_2d(O1 − λ·O2) ⊙ w`` for one token, from the two SDPA calls'
  outputs (``O1`` per signal row, ``O2`` per noise row, both ``2d`` wide), computed in float32 and written in the
  model's dtype, contiguous (the o_proj input): PyTorch's combine, casts and ``rms_norm`` in one launch.
* :func:`v2_sigmoid_combine`: DIFF V2's ``o_h = a_2h − sigmoid(z_h)·a_2h+1`` from the SDPA output, whose rows are the
  query heads of each KV head, and the λ logits ``z = x W_λᵀ``; it also writes ``λ = sigmoid(z)`` (the layer's
  ``output_lambdas``): sigmoid and combine in one launch.

They run without autograd, for one query token, where Triton runs (CUDA, or its CPU interpreter under
``TRITON_INTERPRET=1``, which the tests use) and nothing is compiling (under ``torch.compile`` inductor fuses the same
PyTorch operations itself). Grouped noise heads (r signal maps per noise map) are handled: signal row ``j`` of a block
reads noise row ``j // r``.
"""

import torch

from .attention import _interpreting, is_available
from .attention import triton as _triton

if _triton is not None:
    import triton.language as tl
else:  # pragma: no cover - exercised only where triton is absent
    tl = None

_KERNELS: dict = {}


def _row_sum_compiled(x):
    return tl.sum(x, 0)


_row_sum = None  # set by _jitted()


def _row_sum_interpreted(x):
    """``tl.sum(x, 0)`` under Triton's interpreter: ``tl.sum`` is itself a jit function, decorated when triton is
    imported, and runs under the interpreter only if ``TRITON_INTERPRET`` was set before that import (in a test
    process torch usually imports triton first); ``tl.reduce`` with Triton's own combine function works either way."""
    return tl.reduce(x, 0, tl.standard._sum_combine)


def _jitted() -> dict:
    """The kernels, decorated with ``triton.jit`` on first use and again when ``TRITON_INTERPRET`` changes (so that
    setting it after import still takes effect, as in attention.py). The kernels reduce through the
    module-level ``_row_sum``: ``tl.sum`` compiled, :func:`_row_sum_interpreted` under the interpreter. They use no
    other jit function of ``triton.language`` (the sigmoid is written out)."""
    interpret = _interpreting()
    if _KERNELS.get("interpret") is interpret:
        return _KERNELS
    _KERNELS.clear()
    globals()["_row_sum"] = _row_sum_interpreted if interpret else _triton.jit(_row_sum_compiled)

    def v1_combine_norm_kernel(
        o1,
        o2,
        w,
        lam,
        out,
        s1_b,
        s1_g,
        s1_r,
        s2_b,
        s2_g,
        s2_r,
        groups,
        rows,
        eps,
        R: tl.constexpr,
        WIDTH: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # one program per (sequence, group, signal row); the row's noise row is row // R of the group
        pid = tl.program_id(0)
        j = pid % rows
        g = (pid // rows) % groups
        b = pid // (rows * groups)
        cols = tl.arange(0, BLOCK)
        keep = cols < WIDTH
        first = tl.load(o1 + b * s1_b + g * s1_g + j * s1_r + cols, mask=keep, other=0.0).to(tl.float32)
        second = tl.load(o2 + b * s2_b + g * s2_g + (j // R) * s2_r + cols, mask=keep, other=0.0).to(tl.float32)
        diff = first - tl.load(lam).to(tl.float32) * second
        rstd = 1.0 / tl.sqrt(_row_sum(diff * diff) / WIDTH + eps)
        weight = tl.load(w + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(out + pid * WIDTH + cols, (diff * rstd * weight).to(out.dtype.element_ty), mask=keep)

    def v2_sigmoid_combine_kernel(
        a, z, out, lam, s_b, s_g, s_r, sz_b, groups, blocks, R: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr
    ):
        # one program per (sequence, head h = (g·blocks + k)·R + i): rows k·(R + 1) + i and k·(R + 1) + R of group g
        pid = tl.program_id(0)
        heads = groups * blocks * R
        h = pid % heads
        b = pid // heads
        i = h % R
        k = (h // R) % blocks
        g = h // (R * blocks)
        cols = tl.arange(0, BLOCK)
        keep = cols < WIDTH
        base = a + b * s_b + g * s_g + k * (R + 1) * s_r
        signal = tl.load(base + i * s_r + cols, mask=keep, other=0.0).to(tl.float32)
        noise = tl.load(base + R * s_r + cols, mask=keep, other=0.0).to(tl.float32)
        gate = 1.0 / (1.0 + tl.exp(-tl.load(z + b * sz_b + h).to(tl.float32)))  # sigmoid
        tl.store(lam + pid, gate.to(lam.dtype.element_ty))
        tl.store(out + pid * WIDTH + cols, (signal - gate * noise).to(out.dtype.element_ty), mask=keep)

    _KERNELS.update(
        v1=_triton.jit(v1_combine_norm_kernel), v2=_triton.jit(v2_sigmoid_combine_kernel), interpret=interpret
    )
    return _KERNELS


def runs(device: torch.device, as_device: str | None = None) -> bool:
    """Whether the epilogues run for tensors on ``device``: where the kernel choice is CUDA's (``as_device``, by
    default ``device``'s type; a model set to CUDA's choice on a CPU, ``set_differential_kernel(device_type="cuda")``,
    runs them through Triton's interpreter), Triton runs on ``device``, and nothing is being compiled."""
    if torch.compiler.is_compiling() or (as_device or torch.device(device).type) != "cuda":
        return False
    return is_available(device)


def _block(width: int) -> int:
    return 1 << max(4, (width - 1).bit_length())


def v1_combine_norm(o1, o2, lam, weight, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``RMSNorm(O1 − λ·O2) ⊙ weight`` per row, in float32, written in ``dtype``. ``o1`` ``(B, G, n, w)`` (the signal
    rows of one token, any strides with a contiguous last axis), ``o2`` ``(B, G, m, w)`` with ``n = m·r``, ``lam`` a
    0-dim tensor, ``weight`` ``(w,)`` (the per-head norm's weight times its scale). Returns ``(B, G·n, w)``,
    contiguous."""
    b, g, n, width = o1.shape
    out = torch.empty(b, g * n, width, dtype=dtype, device=o1.device)
    _jitted()["v1"][(b * g * n,)](
        o1,
        o2,
        weight,
        lam,
        out,
        o1.stride(0),
        o1.stride(1),
        o1.stride(2),
        o2.stride(0),
        o2.stride(1),
        o2.stride(2),
        g,
        n,
        eps,
        R=n // o2.shape[2],
        WIDTH=width,
        BLOCK=_block(width),
    )
    return out


def v2_sigmoid_combine(attended, logits, noise_ratio: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``o_h = a_signal(h) − sigmoid(z_h)·a_noise(h)`` for one token: ``attended`` ``(B, G, rows, d)`` (an SDPA call's
    output whose rows are the query heads of each KV head, blocks ``[signal × r, noise]``), ``logits`` ``(B, 1, H)``
    (``x W_λᵀ``). Returns the heads ``(B, 1, H, d)`` (contiguous, the input's dtype) and ``λ = sigmoid(z)``
    ``(B, 1, H)`` (the logits' dtype)."""
    b, g, rows, d = attended.shape
    r = noise_ratio
    heads = g * rows // (r + 1) * r
    out = torch.empty(b, 1, heads, d, dtype=attended.dtype, device=attended.device)
    lam = torch.empty(b, 1, heads, dtype=logits.dtype, device=logits.device)
    _jitted()["v2"][(b * heads,)](
        attended,
        logits,
        out,
        lam,
        attended.stride(0),
        attended.stride(1),
        attended.stride(2),
        logits.stride(0),
        g,
        rows // (r + 1),
        R=r,
        WIDTH=d,
        BLOCK=_block(d),
    )
    return out, lam


__all__ = ["runs", "v1_combine_norm", "v2_sigmoid_combine"]
