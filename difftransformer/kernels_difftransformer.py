"""The package's own kernels of differential attention, run under ``attn_implementation="sdpa"``: the CPU kernels,
and the stock-SDPA kernels that CUDA runs by default.

Keys and values arrive in the standard layout ``(B, Hkv, S, d)``, as the KV cache holds them for every version: V1's
group ``g`` owns key heads ``2g`` (``K1``) and ``2g + 1`` (``K2``) and value heads ``2g``, ``2g + 1`` (``V_g,0``,
``V_g,1``; docs/model.md). One zero-padded SDPA call (what every other backend receives, see
modeling_difftransformer.py) computes V1's 2H maps over 2d-wide dot products, half of them zeros, and 2H outputs 2d
wide: twice a Llama's attention arithmetic, because SDPA cannot combine two maps before multiplying by the value.
Under "sdpa" on a CPU, V1 instead runs :func:`differential_sdpa_attention`:

* one query token without autograd (decode): :func:`differential_decode_attention` multiplies each map's query rows
  with its key head, combines the two softmax maps (one row of ``S`` numbers per map and head) and multiplies the
  result with both value halves: every byte of the cache is read once, and no map is longer than one row;
* otherwise: ``A1 − λ·A2`` is materialised per block of query rows against only the keys the block can see, then
  multiplied by the two value halves (:class:`BlockedDifferentialAttention`); its backward recomputes each block's maps
  from two float32 numbers per row and map, as flash attention does, so training keeps no T×S map.

Grouped differential attention (``num_noise_heads``, docs/model.md) runs through the same kernels: a KV group's
noise rows are fewer than its signal rows (``m = n / r``), each noise map is computed once and subtracted from its r
signal maps (in the blocked kernel's backward, the r signal gradients of a noise map are summed before its softmax
backward).

V2 is standard attention over 2H query heads; under "sdpa" its decode step takes :func:`pair_decode_attention` on
every device (one SDPA call reads the cache once for the 2n query heads of a KV head, then the pair combine), and on a
CPU a float32 prompt of at least ``CAUSAL_BLOCK_MIN_LENGTH`` tokens (prefill, training) takes
:func:`causal_block_attention`, which lets torch's CPU flash kernel skip hidden causal scores that one call computes
(all of them up to 512 keys).

On CUDA, V1 runs :func:`sdpa_two_calls_attention` by default: two stock SDPA calls, one per softmax map, with the
``2d``-wide value (section "V1 through stock SDPA" below, beside the one-call :func:`sdpa_repeated_value_attention`).
The one-pass Triton kernel (difftransformer/kernels/triton/, the optional extra ``difftransformer[triton]``) runs only
where a user chooses it; :func:`triton_kernels` loads it by its absolute name where it is chosen or used, so that no
saved folder carries it. Which kernel runs for which device and workload: :data:`DEFAULT_KERNELS`, at the end of
this file (docs/model.md, "Kernels"). This file is
imported relatively by the modeling file, so ``save_pretrained`` copies it into every saved folder (Hub remote code).
"""

import importlib
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# The Triton kernels live in the package (difftransformer/kernels/triton/), not beside this file: they are loaded by
# their absolute name through importlib, so that transformers neither copies them into a saved folder (it copies every
# module imported relatively) nor requires them where it checks a remote-code folder's imports. Loaded once, on first
# use: {"module": the package or None, "reason": why it is None}.
_TRITON_KERNELS: dict = {}
TRITON_KERNELS_MODULE = "difftransformer.kernels.triton"


def triton_kernels():
    """The Triton kernels (the package ``difftransformer.kernels.triton``: V1's one-pass kernel, the decode
    epilogues), or None where they cannot run: triton is not installed, or the difftransformer package is absent (a
    remote-code folder loaded without it). :func:`triton_missing` says which."""
    if "module" not in _TRITON_KERNELS:
        try:
            module = importlib.import_module(TRITON_KERNELS_MODULE)
        except ImportError as error:
            module, reason = (
                None,
                (
                    f"the Triton kernels are not importable ({TRITON_KERNELS_MODULE}: {error}); they come with the "
                    "difftransformer package: pip install 'difftransformer[triton]'"
                ),
            )
        else:
            reason = None
            if module.triton is None:
                module, reason = None, "the triton package is not installed: pip install 'difftransformer[triton]'"
        _TRITON_KERNELS.update(module=module, reason=reason)
    return _TRITON_KERNELS["module"]


def triton_missing():
    """Why :func:`triton_kernels` is None (a sentence naming what to install), else None."""
    triton_kernels()
    return _TRITON_KERNELS["reason"]


def epilogue_runs(device: torch.device, as_device: str | None = None) -> bool:
    """Whether the decode epilogues' Triton kernels run for tensors on ``device`` under the kernel choice of
    ``as_device`` (by default ``device``'s type): CUDA's choice, where Triton runs, never while compiling (inductor
    fuses the same PyTorch operations itself)."""
    if torch.compiler.is_compiling():
        return False
    kernels = triton_kernels()
    return kernels is not None and kernels.epilogue_runs(device, as_device)


# At most this many query rows per block, and few enough that a block's scores (n heads × rows × keys) stay within
# _BLOCK_SCORES float32 elements (1 MiB) per map and KV group, near the L2 cache.
_BLOCK_ROWS = 128
_BLOCK_SCORES = 1 << 18


def gqa_decode_attention(query, key, value, scaling, attention_mask=None):
    """Attention of one query token per sequence with the query heads of each KV head run as the rows of ONE head.

    ``query`` ``(B, 1, Hq, w)``, the layout a projection gives one token, with the standard GQA order (query head ``i``
    reads KV head ``i // (Hq / G)``, so the heads of a KV group are contiguous and become its rows without a
    transpose), ``key``/``value`` ``(B, G, S, w)``. One SDPA call of ``G`` heads with ``Hq / G`` query rows each: no
    GQA expansion of the cache (``repeat_kv`` copies it; transformers' ``pack_gqa`` idea), no causal mask (one token
    sees the whole cache; a padding or static-cache mask ``(B, 1, 1, S)`` broadcasts over the rows). Returns the
    per-head outputs ``(B, 1, Hq, w)`` (the layout standard kernels return), contiguous: CUDA's SDPA kernels return
    ``(B, G, rows, w)`` with the rows outermost in memory, which no view can regroup, so it is reshaped (a copy there).
    """
    b, _, hq, w = query.shape
    g = key.shape[1]
    out = F.scaled_dot_product_attention(
        query.reshape(b, g, hq // g, w), key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(b, 1, hq, w)


def pair_decode_attention(query, key, value, lam, scaling, attention_mask=None, noise_ratio=1):
    """V2 attention of one query token, combined: ``o_h = a_2h − λ_h·a_2h+1`` (docs/model.md).

    ``query`` ``(B, 1, 2H, d)`` as projected (adjacent heads pair and share a KV head), ``key``/``value``
    ``(B, G, S, d)``, ``lam`` ``(B, 1, H)``. One SDPA call of ``G`` heads whose query rows are the 2n query heads of
    each KV head (the cache is read once, as :func:`gqa_decode_attention`), then one ``addcmul`` that reads the pairs
    in the SDPA output's own layout and writes the H differential heads ``(B, 1, H, d)`` contiguous (no reshape copy).
    With ``noise_ratio`` r > 1 (grouped differential attention) the query heads come in blocks ``[signal × r, noise]``
    and ``o_h = a_h − λ_h·a_noise(h)``: the block's one noise output is subtracted from its r signal outputs.
    """
    b, _, hq, d = query.shape
    g = key.shape[1]
    out = F.scaled_dot_product_attention(
        query.view(b, g, hq // g, d), key, value, attn_mask=attention_mask, scale=scaling
    )  # (B, G, rows, d), any layout
    r = noise_ratio
    blocks = out.unflatten(2, (-1, r + 1))  # (B, G, N, [signal × r, noise], d)
    heads = torch.empty(b, g, blocks.shape[2], r, d, dtype=out.dtype, device=out.device)
    torch.addcmul(blocks[:, :, :, :r], lam.view(b, g, -1, r, 1), blocks[:, :, :, r:], value=-1, out=heads)
    return heads.view(b, 1, hq // (r + 1) * r, d)


def rows_decode_attention(query, key, value, logits, scaling, attention_mask=None, noise_ratio=1, as_device=None):
    """V2's decode step from the λ logits ``z = x W_λᵀ`` ``(B, 1, H)``: :func:`pair_decode_attention` with
    ``λ = sigmoid(z)``. Returns the heads ``(B, 1, H, d)`` and λ ``(B, 1, H)``. Where Triton runs and nothing compiles,
    the sigmoid and the pair combine are one kernel (difftransformer/kernels/triton/epilogue.py) after the SDPA call
    (``as_device``: whose kernel choice runs, :func:`epilogue_runs`)."""
    if not epilogue_runs(query.device, as_device):
        lam = torch.sigmoid(logits)
        return pair_decode_attention(query, key, value, lam, scaling, attention_mask, noise_ratio), lam
    b, _, hq, d = query.shape
    g = key.shape[1]
    attended = F.scaled_dot_product_attention(
        query.view(b, g, hq // g, d), key, value, attn_mask=attention_mask, scale=scaling
    )  # (B, G, rows, d)
    return triton_kernels().v2_sigmoid_combine(attended, logits, noise_ratio)


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will record an operation on ``tensors``: grad mode is on and one of them requires grad (a
    kernel then takes its autograd.Function; without, its plain forward)."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


class HeadRMSNorm(torch.autograd.Function):
    """``scale · RMSNorm(x) ⊙ w`` over the last axis, computed in float32 (or the input's wider dtype), saving for the
    backward only ``x`` in its own dtype and one float32 ``rsqrt`` per row. ``F.rms_norm`` on the float32 copy would
    save that copy: twice the bytes of a bfloat16 ``x``, per layer, where ``x`` (the attention's output) is kept by
    the attention kernel anyway. The backward recomputes the normalised rows."""

    @staticmethod
    def forward(ctx, x, weight, scale: float, eps: float):
        acc = _accumulation_dtype(x.dtype)
        xf = x.to(acc)
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
        out = (xf * rstd * (weight.to(acc) * scale)).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd
        g = grad.to(rstd.dtype)
        dweight = (g * xhat).reshape(-1, x.shape[-1]).sum(0).mul_(ctx.scale) if ctx.needs_input_grad[1] else None
        gw = g * (weight.to(rstd.dtype) * ctx.scale)
        dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        return dx.to(x.dtype), None if dweight is None else dweight.to(weight.dtype), None, None


def query_padding(signal_rows: int, noise_rows: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The 0/1 pattern that zero-pads V1 queries to ``2d``, shape ``(signal_rows + noise_rows, 2, 1)``: a KV group's
    signal rows (its first map) become ``[Q | 0]``, its noise rows ``[0 | Q]``. Multiply a ``(..., rows, 1, d)`` view of
    the group's query rows by it and flatten the last two axes."""
    eye = torch.eye(2, dtype=dtype, device=device)
    return torch.cat([eye[:1].expand(signal_rows, 2), eye[1:].expand(noise_rows, 2)]).view(-1, 2, 1)


def differential_decode_attention(query, key, value, lam, scaling, attention_mask=None, noise_ratio=1):
    """V1 attention of one query token per sequence: ``query`` ``(B, 1, Hq, d)`` in q_proj row order (per KV group its
    n signal rows, then its ``m = n / noise_ratio`` noise rows; signal row j subtracts noise row j // r), ``key`` and
    ``value`` the cache ``(B, Hkv, S, d)`` (group g: heads 2g, 2g + 1), ``lam`` the layer's λ, ``attention_mask`` None
    or boolean ``(B, 1, 1, S)`` (True = visible). Returns the combined heads ``(B, 1, H, 2d)``.

    Each map's rows meet only their own key head (one batched matmul over the group's two key heads, views of the
    cache), the two softmax rows are combined in float32, and the combined row meets both value halves (one broadcast
    matmul): every cache byte is read once, no copy of the cache is made, and no zero is multiplied. One token always
    sees itself, so no row is fully hidden (a plain softmax suffices)."""
    b, _, hq, d = query.shape
    g = key.shape[1] // 2
    rows = hq // g
    m = rows // (noise_ratio + 1)
    n = rows - m
    acc = _accumulation_dtype(query.dtype)
    q = query.reshape(b, g, rows, d) * scaling
    keys, values = key.unflatten(1, (g, 2)), value.unflatten(1, (g, 2))  # (B, G, 2, S, d): views
    if m == n:  # both maps in one matmul over (group, map): (B, G, 2, n, d) @ (B, G, 2, d, S)
        scores = torch.matmul(q.view(b, g, 2, n, d), keys.transpose(-1, -2)).to(acc)
    else:  # grouped noise heads: the maps have n and m rows
        scores = [
            torch.matmul(part, keys[:, :, c].transpose(-1, -2)).to(acc)
            for c, part in ((0, q[:, :, :n]), (1, q[:, :, n:]))
        ]
    if attention_mask is not None:
        hide = torch.zeros(attention_mask.shape, dtype=acc, device=query.device).masked_fill_(
            attention_mask.logical_not(), float("-inf")
        )
        hide = hide.reshape(b, 1, 1, -1)
        scores = scores + hide.unsqueeze(2) if m == n else [x + hide for x in scores]
    if m == n:
        maps = torch.softmax(scores, -1)
        diff = torch.addcmul(maps[:, :, 0], lam, maps[:, :, 1], value=-1)  # (B, G, n, S)
    else:
        first, second = (torch.softmax(x, -1) for x in scores)
        diff = first.view(b, g, m, noise_ratio, -1).addcmul_(second.unsqueeze(3), lam, value=-1).view(b, g, n, -1)
    out = torch.matmul(diff.unsqueeze(2).to(value.dtype), values)  # (B, G, 2, n, d): both value halves
    return out.permute(0, 1, 3, 2, 4).reshape(b, 1, g * n, 2 * d)


def _query_blocks(t: int, s: int, attention_mask: torch.Tensor | None, device: torch.device, n: int, block: int | None):
    """Blocks ``[t0, t1)`` of query rows, how many keys each can see, and its additive float32 mask (or None).

    Without a mask, transformers' sdpa convention applies: one query sees every key; ``t > 1`` queries are causal and
    top-left aligned (square attention, or a prefill into an empty static cache). With a boolean mask (True = visible)
    the mask decides and the queries are taken to be the last ``t`` of ``s`` positions, which only bounds the keys a
    block reads (a causal model never lets a query see keys after its own position). Masks are 0 / −inf: adding them
    is cheaper than ``masked_fill``, and ``exp(−inf)`` is fast where large finite negatives are slow.
    """
    if attention_mask is None and t == 1:
        yield 0, 1, s, None
        return
    offset = 0 if attention_mask is None else s - t
    block = block or max(16, min(_BLOCK_ROWS, _BLOCK_SCORES // (n * s)))
    for t0 in range(0, t, block):
        t1 = min(t, t0 + block)
        visible = min(s, t1 + offset)
        if attention_mask is not None:
            hide = attention_mask[:, :, None, t0:t1, :visible].logical_not()  # over scores (B, G, n, Tb, Sv)
        elif visible > t0 + 1:  # the block reaches the diagonal
            hide = torch.arange(visible, device=device) > torch.arange(t0, t1, device=device)[:, None]
        else:
            yield t0, t1, visible, None
            continue
        yield t0, t1, visible, torch.zeros(hide.shape, device=device).masked_fill_(hide, float("-inf"))


# Softmax, norms and sums in float32 (float64 stays float64). A dict: torch.promote_types is a dispatcher call.
ACCUMULATION_DTYPES = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float32: torch.float32,
    torch.float64: torch.float64,
}


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return ACCUMULATION_DTYPES.get(dtype) or torch.promote_types(dtype, torch.float32)


def _block_scores(q, k, mask, scaling):
    """Float32 scores of one block and map: ``q`` ``(B, G, n, Tb, d)`` (the n heads of a group are rows of one matmul),
    ``k`` ``(B, G, Sv, d)`` (a view of the cache: every other key head), plus the block's additive mask."""
    b, g, n, tb, d = q.shape
    scores = torch.matmul((q * scaling).reshape(b, g, n * tb, d), k.transpose(-1, -2)).view(b, g, n, tb, -1)
    acc = _accumulation_dtype(q.dtype)
    if mask is None:
        return scores.to(acc)
    return scores.add_(mask) if scores.dtype == acc else torch.add(scores, mask.to(acc))


def _softmax_with_stats(scores):
    """In-place softmax plus the row statistics that recompute it, ``(max, log Σ exp(s − max))``. A fully hidden row
    (a padding query) gets probabilities 0, hence output 0 as SDPA gives, with finite statistics."""
    top = scores.amax(-1, keepdim=True).clamp_(min=torch.finfo(scores.dtype).min)
    total = scores.sub_(top).exp_().sum(-1, keepdim=True).clamp_(min=torch.finfo(scores.dtype).tiny)
    return scores.div_(total), torch.stack((top, total.log_()))


def _halves(x):
    """The two heads of every group of a ``(B, 2G, S, d)`` key or value tensor: ``(x[:, 0::2], x[:, 1::2])``, views."""
    return x[:, 0::2], x[:, 1::2]


def _blocked_forward(q1, q2, key, value, lam, scaling, attention_mask, block, stats=None):
    """``(A1 − λA2)·V`` block by block → ``(B, T, G, n, 2d)`` (the module's head layout: no copy follows). ``q2`` has
    ``m = n / r`` heads per group (r = 1 unless grouped): signal head j subtracts noise head j // r. Fills ``stats``
    ``(stats1 (2, B, G, n, T, 1), stats2 (2, B, G, m, T, 1))`` for the backward when given."""
    b, g, n, t, d = q1.shape
    m = q2.shape[2]
    k1, k2 = _halves(key)
    out = value.new_empty(b, t, g, n, 2 * d)
    for t0, t1, visible, mask in _query_blocks(t, key.shape[2], attention_mask, q1.device, n, block):
        p1, st1 = _softmax_with_stats(_block_scores(q1[:, :, :, t0:t1], k1[:, :, :visible], mask, scaling))
        p2, st2 = _softmax_with_stats(_block_scores(q2[:, :, :, t0:t1], k2[:, :, :visible], mask, scaling))
        if stats is not None:
            stats[0][..., t0:t1, :], stats[1][..., t0:t1, :] = st1, st2
        # A1 − λ·A2: (B, G, n, Tb, Sv); a noise map is shared by the r signal maps of its block of rows
        diff = (
            p1.view(b, g, m, n // m, t1 - t0, visible)
            .addcmul_(p2.unsqueeze(3), lam, value=-1)
            .view_as(p1)
            .to(value.dtype)
        )
        for c, half in enumerate(_halves(value)):  # the value [V_g,0 | V_g,1]: one matmul per half
            res = torch.matmul(diff.view(b, g, n * (t1 - t0), visible), half[:, :, :visible])
            out[:, t0:t1, :, :, c * d : (c + 1) * d] = res.view(b, g, n, t1 - t0, d).permute(0, 3, 1, 2, 4)
    return out


class BlockedDifferentialAttention(torch.autograd.Function):
    """``O = (A1 − λA2)·V`` block by block, with a backward that recomputes each block's maps (flash-attention style).

    Inputs: ``q1`` ``(B, G, n, T, d)``, ``q2`` ``(B, G, m, T, d)`` (``m = n``, or ``n / r`` noise heads for grouped
    differential attention), ``key``/``value`` ``(B, 2G, S, d)`` (group g: heads 2g, 2g + 1), the scalar ``lam``; output
    ``(B, T, G, n, 2d)``. Saved for backward: the inputs and ``O(T)`` row statistics, never a ``T×S`` map.
    """

    @staticmethod
    def forward(ctx, q1, q2, key, value, lam, scaling, attention_mask, block):
        b, g, n, t, _ = q1.shape
        acc = _accumulation_dtype(q1.dtype)
        stats = tuple(torch.empty(2, b, g, heads, t, 1, dtype=acc, device=q1.device) for heads in (n, q2.shape[2]))
        out = _blocked_forward(q1, q2, key, value, lam, scaling, attention_mask, block, stats)
        ctx.save_for_backward(q1, q2, key, value, lam, *stats, attention_mask)
        ctx.scaling, ctx.block = scaling, block
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q1, q2, key, value, lam, stats1, stats2, attention_mask = ctx.saved_tensors
        stats = (stats1, stats2)
        scaling = ctx.scaling
        b, g, n, t, d = q1.shape
        m = q2.shape[2]
        k1, k2 = _halves(key)
        v_halves = _halves(value)
        dq1, dq2 = (
            torch.empty_like(q1, memory_format=torch.contiguous_format),
            torch.empty_like(q2, memory_format=torch.contiguous_format),
        )
        acc = _accumulation_dtype(key.dtype)  # key/value gradients sum over blocks: float32 even for bf16
        dkey = torch.zeros(key.shape, dtype=acc, device=key.device)
        dvalue = torch.zeros(value.shape, dtype=acc, device=value.device)
        dlam = torch.zeros((), dtype=_accumulation_dtype(lam.dtype), device=lam.device)
        # With D = A1 − λA2 and dD = dO·Vᵀ: dS1 = P1 ∘ (dD − rowsum(dD ∘ P1)), dS2 = −λ·P2 ∘ (dD2 − rowsum(dD2 ∘ P2)),
        # dλ = −Σ dD2 ∘ P2, where dD2 = dD (r = 1) or the sum of dD over the r signal maps that share a noise map.
        # The factors −λ and 1/√d are applied to the small (rows × d) products.
        factors = (scaling, -lam * scaling)
        heads = (n, m)
        for t0, t1, visible, mask in _query_blocks(t, key.shape[2], attention_mask, q1.device, n, ctx.block):
            tb = t1 - t0
            qb = (q1[:, :, :, t0:t1], q2[:, :, :, t0:t1])
            kb = (k1[:, :, :visible], k2[:, :, :visible])
            p = [
                _block_scores(qb[c], kb[c], mask, scaling)
                .sub_(stats[c][0, ..., t0:t1, :])
                .sub_(stats[c][1, ..., t0:t1, :])
                .exp_()
                for c in (0, 1)
            ]  # hidden scores are −inf: their P is exactly 0
            grad_b = grad_out[:, t0:t1].permute(0, 2, 3, 1, 4).reshape(b, g, n * tb, 2 * d)
            diff = p[0].view(b, g, m, n // m, tb, visible).addcmul(p[1].unsqueeze(3), lam, value=-1)
            diff = diff.to(value.dtype).view(b, g, n * tb, visible)
            ddiff = None
            for c, (half, dhalf) in enumerate(zip(v_halves, _halves(dvalue))):
                grad_c = grad_b[..., c * d : (c + 1) * d]
                dhalf[:, :, :visible] += torch.matmul(diff.transpose(-1, -2), grad_c)  # sums the group's n heads
                part = torch.matmul(grad_c, half[:, :, :visible].transpose(-1, -2))
                ddiff = part if ddiff is None else ddiff.add_(part)
            ddiff = ddiff.to(acc).view_as(p[0])
            ddiff2 = ddiff if m == n else ddiff.view(b, g, m, n // m, tb, visible).sum(3)
            r1, r2 = (torch.einsum("...s,...s->...", dd, p[c]).unsqueeze(-1) for c, dd in ((0, ddiff), (1, ddiff2)))
            dlam -= r2.sum()
            ds = (torch.sub(ddiff, r1).mul_(p[0]), ddiff2.sub_(r2).mul_(p[1]))
            for c, dq, dk in ((0, dq1, dkey[:, 0::2]), (1, dq2, dkey[:, 1::2])):
                rows = heads[c] * tb
                dsc = ds[c].to(q1.dtype).view(b, g, rows, visible)
                dq[:, :, :, t0:t1] = (torch.matmul(dsc, kb[c]) * factors[c]).view(b, g, heads[c], tb, d)
                dk[:, :, :visible] += torch.matmul(dsc.transpose(-1, -2), qb[c].reshape(b, g, rows, d)) * factors[c]
        return dq1, dq2, dkey.to(key.dtype), dvalue.to(value.dtype), dlam.to(lam.dtype), None, None, None


def blocked_differential_attention(q1, q2, key, value, lam, scaling, attention_mask=None, block=None):
    """``(B, G, n, T, d)`` queries of both maps over the ``(B, 2G, S, d)`` cache → ``(B, T, G, n, 2d)``; ``q2``
    may have ``n / r`` heads per group (grouped differential attention: signal head j subtracts noise head j // r).
    ``attention_mask``: None (transformers' sdpa convention) or boolean, broadcastable to ``(B, 1, T, S)``;
    ``block``: query rows per block (None: chosen from the key length)."""
    if needs_grad(q1, q2, key, value, lam):
        return BlockedDifferentialAttention.apply(q1, q2, key, value, lam, scaling, attention_mask, block)
    return _blocked_forward(q1, q2, key, value, lam, scaling, attention_mask, block)


# torch's CPU flash-attention kernel (the one behind SDPA for float32) and its backward, called directly for their
# log-sum-exp output. They are private operators: this file also ships as Hub remote code and may meet any torch, so
# each is used only if its schema is the one this code calls (argument names and number of results, as in torch
# 2.13); otherwise V2 stays on transformers' public sdpa path, and one log line says why.
_PRIVATE_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu": (
        ("query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"),
        2,
    ),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal", "attn_mask", "scale"),
        3,
    ),
}


def private_op(name: str, ops=torch.ops.aten):
    """The private aten operator ``name`` if it exists with the schema in ``_PRIVATE_OPS``, else None (logged once)."""
    expected_args, expected_results = _PRIVATE_OPS[name]
    op = getattr(ops, name, None)
    try:
        schema = op.default._schema if op is not None else None
    except (AttributeError, RuntimeError):
        schema = None
    found = None if schema is None else (tuple(a.name for a in schema.arguments), len(schema.returns))
    if found == (expected_args, expected_results):
        return op
    logger.warning(
        "difftransformer: torch %s %s aten.%s%s; V2 prompts use transformers' sdpa attention instead of the causal "
        "block kernel (same results, slower on CPU).",
        torch.__version__,
        "has no" if op is None else "has a changed",
        name,
        ""
        if found is None
        else f" (arguments {found[0]}, {found[1]} results; expected {expected_args}, {expected_results})",
    )
    return None


_FLASH_CPU = private_op("_scaled_dot_product_flash_attention_for_cpu")
_FLASH_CPU_BACKWARD = private_op("_scaled_dot_product_flash_attention_for_cpu_backward")


def _flash_cpu_reads_grouped_keys() -> bool:
    """Whether torch's CPU flash kernels (forward and backward) take fewer key/value heads than query heads (GQA:
    query head ``i`` reads key head ``i // (Hq/G)``), as V2's causal blocks call them. torch 2.7.1's do not: they read
    past the key heads without an error (values that are not finite, or a corrupted heap). Support came with
    pytorch/pytorch#157893 ("[CPU] Support GQA for flash attention"), taken here as torch 2.9 (2.8 is untested and
    treated as 2.7): releases before 2.9 are never called with grouped keys.
    From 2.9 on it is settled once, at import, on tiny tensors against the same call with the keys repeated per query
    head."""
    if (
        _FLASH_CPU is None
        or _FLASH_CPU_BACKWARD is None
        or torch.torch_version.TorchVersion(torch.__version__) < (2, 9)
    ):
        return False
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 4, 8, generator=g) for heads in (2, 1, 1))
    k2, v2 = k.expand(1, 2, 4, 8).contiguous(), v.expand(1, 2, 4, 8).contiguous()
    try:
        out, lse = _FLASH_CPU(q, k, v, 0.0, True, scale=0.5)
        ref, ref_lse = _FLASH_CPU(q, k2, v2, 0.0, True, scale=0.5)
        grad = torch.randn(out.shape, generator=g)
        dq, dk, dv = _FLASH_CPU_BACKWARD(grad, q, k, v, out, lse, 0.0, True, scale=0.5)
        rq, rk, rv = _FLASH_CPU_BACKWARD(grad, q, k2, v2, ref, ref_lse, 0.0, True, scale=0.5)
    except RuntimeError:
        return False
    return (
        dk.shape == k.shape
        and torch.allclose(out, ref, atol=1e-5)
        and torch.allclose(dq, rq, atol=1e-5)
        and torch.allclose(dk, rk.sum(1, keepdim=True), atol=1e-5)
        and torch.allclose(dv, rv.sum(1, keepdim=True), atol=1e-5)
    )


# V2's causal blocks run only where the CPU flash kernels read grouped keys (not on torch 2.7: transformers' sdpa call
# there, the same result, slower).
FLASH_CPU_READS_GROUPED_KEYS = _flash_cpu_reads_grouped_keys()
# Query rows per block of :func:`causal_block_attention`, and the shortest prompt it is used for: the fastest of the
# block sizes the V2 prompt-attention runs compared, and the shortest length at which it saved time there at batch 1,
# 2 and 4 in every run (docs/reports/2026-11-25-attention-kernels.md; at 128 tokens it cost up to 18% at batch 1).
# Smaller blocks skip more of the diagonal squares' hidden scores, for one more pair of kernel calls each.
_CAUSAL_BLOCK = 32
CAUSAL_BLOCK_MIN_LENGTH = 256


def _causal_blocks(t: int, block: int):
    """``(t0, t1)`` query blocks; block ``[t0, t1)`` sees the keys ``[0, t0)`` in full and ``[t0, t1)`` causally."""
    return [(t0, min(t, t0 + block)) for t0 in range(0, t, block)]


def _causal_block_forward(query, key, value, scaling, block):
    """→ ``out`` ``(B, Hq, T, d)`` and ``lse`` ``(B, Hq, T)`` (float32; float64 for float64 inputs): per block, one
    causal flash call on the diagonal square and one unmasked call on the keys before it, merged by log-sum-exp."""
    b, h, t, d = query.shape
    out = query.new_empty(b, t, h, d).transpose(1, 2)  # the (B, T, Hq, d) memory the caller transposes back to
    lse = torch.empty(query.shape[:3], dtype=_accumulation_dtype(query.dtype), device=query.device)
    for t0, t1 in _causal_blocks(query.shape[2], block):
        q = query[:, :, t0:t1]
        o_diag, l_diag = _FLASH_CPU(q, key[:, :, t0:t1], value[:, :, t0:t1], 0.0, True, scale=scaling)
        if t0 == 0:
            out[:, :, t0:t1], lse[:, :, t0:t1] = o_diag, l_diag
            continue
        o_past, l_past = _FLASH_CPU(q, key[:, :, :t0], value[:, :, :t0], 0.0, False, scale=scaling)
        total = torch.logaddexp(l_past, l_diag)
        w_past, w_diag = (l_past - total).exp_().unsqueeze(-1), (l_diag - total).exp_().unsqueeze(-1)
        out[:, :, t0:t1] = torch.mul(o_past, w_past).addcmul_(o_diag, w_diag)
        lse[:, :, t0:t1] = total
    return out, lse


class CausalBlockAttention(torch.autograd.Function):
    """Causal attention of a square prompt in blocks of query rows, flash-attention style on both passes.

    torch's CPU flash kernel splits the keys into 512-wide blocks and skips only whole blocks above the diagonal, so at
    up to 512 keys a causal call computes the full ``T×T`` scores. Here each block of ``_CAUSAL_BLOCK`` query rows takes
    one causal call on its diagonal square and one unmasked call on the keys before it, merged exactly by their
    log-sum-exps: about half the score arithmetic is skipped. The backward calls the kernel's own backward per part
    with the merged output and log-sum-exp (what the flash backward needs: ``P = exp(S − lse)`` and
    ``rowsum(dO ∘ O)`` of the whole row); the key and value gradients of the parts add up.
    ``query`` ``(B, Hq, T, d)``, ``key``/``value`` ``(B, G, T, d)`` (GQA: query head ``i`` reads KV head ``i //
    (Hq/G)``).
    """

    @staticmethod
    def forward(ctx, query, key, value, scaling, block):
        out, lse = _causal_block_forward(query, key, value, scaling, block)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scaling, ctx.block = scaling, block
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq = torch.empty_like(query, memory_format=torch.contiguous_format)
        dk, dv = torch.zeros_like(key), torch.zeros_like(value)
        for t0, t1 in _causal_blocks(query.shape[2], ctx.block):
            rows = (grad_out[:, :, t0:t1], query[:, :, t0:t1])
            saved = (out[:, :, t0:t1], lse[:, :, t0:t1].contiguous())
            parts = [(slice(t0, t1), True)] + ([(slice(0, t0), False)] if t0 else [])
            for i, (keys, causal) in enumerate(parts):
                g_q, g_k, g_v = _FLASH_CPU_BACKWARD(
                    *rows, key[:, :, keys], value[:, :, keys], *saved, 0.0, causal, scale=ctx.scaling
                )
                if i == 0:
                    dq[:, :, t0:t1] = g_q
                else:
                    dq[:, :, t0:t1] += g_q
                dk[:, :, keys] += g_k
                dv[:, :, keys] += g_v
        return dq, dk, dv, None, None


def causal_block_attention(query, key, value, scaling, block=None):
    """Causal attention of a square prompt (:class:`CausalBlockAttention`): ``query`` ``(B, Hq, T, d)``,
    ``key``/``value`` ``(B, G, T, d)`` → ``(B, Hq, T, d)``, equal to SDPA with ``is_causal=True``; ``block``: query
    rows per block (None: ``_CAUSAL_BLOCK``)."""
    block = block or _CAUSAL_BLOCK
    if needs_grad(query, key, value):
        return CausalBlockAttention.apply(query, key, value, scaling, block)
    return _causal_block_forward(query, key, value, scaling, block)[0]


def uses_causal_block_attention(query, key, attention_mask) -> bool:
    """Whether :func:`causal_block_attention` runs for this V2 call: a CPU float32 square prompt of at least
    ``CAUSAL_BLOCK_MIN_LENGTH`` tokens with no mask (transformers' sdpa convention for an unpadded causal prompt), on a
    torch whose CPU flash kernels read grouped keys (:data:`FLASH_CPU_READS_GROUPED_KEYS`).
    docs/reports/2026-11-25-attention-kernels.md reports both paths' times."""
    return (
        _FLASH_CPU is not None
        and _FLASH_CPU_BACKWARD is not None
        and FLASH_CPU_READS_GROUPED_KEYS
        and attention_mask is None
        and query.device.type == "cpu"
        and query.dtype == torch.float32
        and query.shape[2] == key.shape[2]
        and query.shape[2] >= CAUSAL_BLOCK_MIN_LENGTH
    )


def differential_sdpa_attention(query, key, value, attention_mask, lam, scaling, pair_stride, noise_ratio=1):
    """V1's CPU kernel under ``attn_implementation="sdpa"``: ``query`` ``(B, T, Hq, d)`` in the q_proj row order (per
    KV group its ``n = pair_stride`` signal rows, then its ``n / noise_ratio`` noise rows; ``(g, c, r)`` when r = 1),
    unpadded; ``key``/``value`` ``(B, Hkv, S, d)`` as cached (group g: heads 2g, 2g + 1); a boolean or no mask.
    Returns the combined differential heads ``(B, T, H, 2d)``, equal to the padded-query path and to the eager
    formula."""
    b, t, _, d = query.shape
    g, n = key.shape[1] // 2, pair_stride
    if t == 1 and not needs_grad(query, key, value, lam):
        return differential_decode_attention(query, key, value, lam, scaling, attention_mask, noise_ratio)
    heads = query.view(b, t, g, -1, d).permute(0, 2, 3, 1, 4)  # (B, G, n + m, T, d): a view
    out = blocked_differential_attention(heads[:, :, :n], heads[:, :, n:], key, value, lam, scaling, attention_mask)
    return out.view(b, t, g * n, 2 * d)


# ----------------------------------------------------------------------------------------------------------------
# V1 through stock SDPA (what CUDA runs by default: docs/model.md, "Kernels")
# ----------------------------------------------------------------------------------------------------------------


def pack_value_groups(value: torch.Tensor) -> torch.Tensor:
    """V1's value per KV group as one ``2d``-wide head, ``(B, 2G, S, d)`` → ``(B, G, S, 2d)`` with group g holding
    ``[V_g,0 | V_g,1]``: a view where the tensor is laid out per token (a projection), one copy where it is laid out
    per head (dynamic and static caches)."""
    b, hkv, s, d = value.shape
    return value.transpose(1, 2).reshape(b, s, hkv // 2, 2 * d).transpose(1, 2)


def _map_rows(query: torch.Tensor, n: int, r: int):
    """V1's query rows ``(B, T, Hq, d)`` (per KV group its n signal rows, then its n / r noise rows) as the two maps'
    queries ``(B, G, rows, T, d)``: views."""
    b, t, hq, d = query.shape
    heads = query.view(b, t, -1, n + n // r, d).permute(0, 2, 3, 1, 4)  # (B, G, n + m, T, d)
    return heads[:, :, :n], heads[:, :, n:]


def _sdpa_mask(attention_mask: torch.Tensor | None, t: int) -> dict:
    """transformers' sdpa conventions: no mask means causal from the first key for several queries (a prompt, or a
    prefill into an empty static cache) and every key for one; a boolean mask (True = visible) decides alone."""
    if attention_mask is None:
        return {"is_causal": t > 1}
    return {"attn_mask": attention_mask}


def combine_maps(first, second, lam, out=None):
    """``first − λ·second`` for V1's maps: ``first`` ``(B, G, n, ..., w)``, ``second`` ``(B, G, m, ..., w)`` with
    ``m = n / r`` (signal row j of a group subtracts noise row j // r). One kernel; into ``out`` where given (a buffer
    of ``first``'s shape, e.g. another dtype or layout)."""
    b, g, n = first.shape[:3]
    m = second.shape[2]
    if m != n:  # grouped noise heads: (B, G, m, r, ...) against (B, G, m, 1, ...)
        first = first.unflatten(2, (m, n // m))
        second = second.unsqueeze(3)
        out = None if out is None else out.unflatten(2, (m, n // m))
        result = torch.addcmul(first, lam, second, value=-1, out=out)
        return result.flatten(2, 3)
    return torch.addcmul(first, lam, second, value=-1, out=out)


def sdpa_two_calls_attention(query, key, value, attention_mask, lam, scaling, pair_stride, noise_ratio=1):
    """V1 attention as two stock SDPA calls, one per softmax map, each map's query rows over its own key heads (views
    of the cache: every other key head) with the ``2d``-wide value ``[V_g,0 | V_g,1]`` and ``enable_gqa``; then
    ``A1·V − λ·A2·V``. Exact, and 1.5× a Llama's attention arithmetic (the value is twice as wide). On CUDA SDPA picks
    cuDNN or memory-efficient attention for the unequal widths (flash refuses them); on a CPU the math kernel, which
    materialises the maps (the CPU runs :func:`differential_sdpa_attention` by default).

    ``query`` ``(B, T, Hq, d)`` in q_proj row order, ``key``/``value`` ``(B, Hkv, S, d)`` as cached, a boolean or no
    mask. Returns ``(B, T, H, 2d)``. One query token without autograd runs each group's rows as the rows of one SDPA
    head (no query copy, no causal mask: one token sees every key) and writes the combined heads directly in the
    output's layout, in float32 where the inputs are narrower (the per-head norm that follows computes in float32):
    two SDPA calls, one copy of the value cache into groups, one combine.
    """
    b, t, _, d = query.shape
    n, r = pair_stride, noise_ratio
    q1, q2 = _map_rows(query, n, r)  # (B, G, n | m, T, d)
    g = q1.shape[1]
    if t == 1 and not needs_grad(query, key, value, lam):  # packs the value itself: one copy of the cache
        o1, o2 = sdpa_decode_maps(query, key, value, attention_mask, scaling, pair_stride, noise_ratio)
        out = torch.empty(b, g, n, 2 * d, dtype=_accumulation_dtype(query.dtype), device=query.device)
        return combine_maps(o1, o2, lam, out=out).view(b, 1, g * n, 2 * d)
    k1, k2 = key[:, 0::2], key[:, 1::2]  # (B, G, S, d): views
    packed = pack_value_groups(value)  # (B, G, S, 2d)
    mask = _sdpa_mask(attention_mask, t)
    o1, o2 = (
        F.scaled_dot_product_attention(q.flatten(1, 2), k, packed, scale=scaling, enable_gqa=True, **mask).unflatten(
            1, (g, -1)
        )
        for q, k in ((q1, k1), (q2, k2))
    )  # (B, G, n | m, T, 2d)
    return combine_maps(o1, o2, lam).permute(0, 3, 1, 2, 4).reshape(b, t, g * n, 2 * d)


def sdpa_decode_maps(query, key, value, attention_mask, scaling, pair_stride, noise_ratio=1):
    """The two maps' outputs of one query token, ``A1·[V_g,0 | V_g,1]`` ``(B, G, n, 2d)`` and ``A2·[…]``
    ``(B, G, m, 2d)``, by two SDPA calls in which a group's rows are the query rows of one head (no query copy, no
    causal mask: one token sees every key; a ``(B, 1, 1, S)`` mask broadcasts over the rows). The decode step combines
    them with the per-head norm in one epilogue (``DiffTransformerHeadRMSNorm.combined``)."""
    q1, q2 = _map_rows(query, pair_stride, noise_ratio)  # (B, G, n | m, 1, d)
    packed = pack_value_groups(value)
    return tuple(
        F.scaled_dot_product_attention(q[..., 0, :], k, packed, attn_mask=attention_mask, scale=scaling)
        for q, k in ((q1, key[:, 0::2]), (q2, key[:, 1::2]))
    )


def sdpa_repeated_value_attention(query, key, value, attention_mask, lam, scaling, pair_stride, noise_ratio=1):
    """V1 attention as ONE stock SDPA call over all ``2H`` query rows: query row ``i = (2g + c)·n + j`` reads key head
    ``2g + c`` (the standard GQA rule, ``enable_gqa``), and the value is repeated per key head, ``(B, 2G, S, 2d)``
    with heads ``2g`` and ``2g + 1`` both ``[V_g,0 | V_g,1]`` (one copy of the value); then the pairs combine. Exact,
    1.5× a Llama's attention arithmetic, twice the value bytes. Needs one noise map per signal map (``noise_ratio``
    1: the GQA rule needs as many query rows per key head for both maps). Same arguments and result as
    :func:`sdpa_two_calls_attention`."""
    if noise_ratio != 1:
        raise ValueError(
            f"the 'sdpa_repeated_value' kernel needs one noise map per signal map (noise_ratio 1, got {noise_ratio}): "
            "choose 'sdpa_two_calls' for grouped differential attention."
        )
    b, t, hq, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    n, g = pair_stride, hkv // 2
    # (B, G, 1, 2, S, d) expanded over the map c, then each head's two halves side by side: one copy
    repeated = (
        value.unflatten(1, (g, 1, 2)).expand(b, g, 2, 2, s, d).permute(0, 1, 2, 4, 3, 5).reshape(b, hkv, s, 2 * d)
    )
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key, repeated, scale=scaling, enable_gqa=True, **_sdpa_mask(attention_mask, t)
    )  # (B, 2H, T, 2d), rows (g, c, j)
    first, second = out.unflatten(1, (g, 2, n)).unbind(2)
    return torch.addcmul(first, lam, second, value=-1).permute(0, 3, 1, 2, 4).reshape(b, t, g * n, 2 * d)


# ----------------------------------------------------------------------------------------------------------------
# Which kernel runs where (docs/model.md, "Kernels")
# ----------------------------------------------------------------------------------------------------------------

WORKLOADS = ("prefill", "train", "decode")
# transformers' attention function with one standard call per layer (V1: zero-padded queries over packed groups).
FALLBACK_KERNEL = {1: "padded", 2: "standard"}
# The default kernel under attn_implementation="sdpa", by version and device type ("other": any device not listed) and
# workload. Set by measurement: CUDA's V1 row by docs/reports/2026-11-28-gpu-check.md (its attention table), the CPU
# rows by docs/reports/2026-11-26-cpu-speed.md; "other" is not measured (the padded call, which SDPA's flash and
# memory-efficient kernels run without writing a map, and the decode kernel for one token).
DEFAULT_KERNELS: dict[tuple[int, str], dict[str, str]] = {
    (1, "cuda"): {"prefill": "sdpa_two_calls", "train": "sdpa_two_calls", "decode": "sdpa_two_calls"},
    (1, "cpu"): {"prefill": "blocked", "train": "blocked", "decode": "decode_kernel"},
    (1, "other"): {"prefill": "padded", "train": "padded", "decode": "decode_kernel"},
    (2, "cpu"): {"prefill": "causal_blocks", "train": "causal_blocks", "decode": "rows_decode"},
    (2, "other"): {"prefill": "standard", "train": "standard", "decode": "rows_decode"},
}


def select_kernel(diff_version: int, device_type: str, workload: str, dtype: torch.dtype | None = None) -> str:
    """The kernel a ``diff_version`` layer runs by default under ``attn_implementation="sdpa"`` for ``workload``
    (``"prefill"``: several query tokens without autograd, ``"train"``: with autograd, ``"decode"``: one token without
    autograd) on ``device_type``: an entry of :data:`DEFAULT_KERNELS`. V2's causal blocks need float32 (other dtypes:
    the standard call). ``model.set_differential_kernel`` overrides it (docs/model.md, "Kernels")."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    table = DEFAULT_KERNELS.get((diff_version, device_type)) or DEFAULT_KERNELS[(diff_version, "other")]
    name = table[workload]
    if name == "causal_blocks" and dtype not in (None, torch.float32):
        return FALLBACK_KERNEL[diff_version]
    return name


__all__ = [
    "DEFAULT_KERNELS",
    "FALLBACK_KERNEL",
    "WORKLOADS",
    "select_kernel",
    "BlockedDifferentialAttention",
    "HeadRMSNorm",
    "CausalBlockAttention",
    "causal_block_attention",
    "blocked_differential_attention",
    "differential_sdpa_attention",
    "gqa_decode_attention",
    "differential_decode_attention",
    "pair_decode_attention",
    "needs_grad",
    "ACCUMULATION_DTYPES",
    "combine_maps",
    "pack_value_groups",
    "rows_decode_attention",
    "sdpa_decode_maps",
    "sdpa_repeated_value_attention",
    "sdpa_two_calls_attention",
    "query_padding",
    "uses_causal_block_attention",
]
