"""Proposed DIFF V1 kernel selection for the sdpa path (issue 5): the measured prototype of PROPOSED_KERNEL.md.

The differential output of SPEC §1 (Ye et al., arXiv 2410.05258, Eq. 1), for head ``h = g·n + r``::

    O_h = (softmax(Q1 K1ᵀ/√d + M) − λ·softmax(Q2 K2ᵀ/√d + M)) · [V_g,0 | V_g,1]

is computed by one of three strategies, chosen per call (evidence: ``benchmarks/attention_micro.py``, see
``docs/performance.md``):

* **decode** (one query token, no autograd): the 2n padded queries of a KV group become the rows of ONE query head
  (transformers' ``pack_gqa`` idea), so one fast SDPA call reads each byte of the packed cache once; the two maps of
  a pair are combined on the (B, G, 2n, 2d) output. No T×S map, no copy of the cache.
* **everything else** (prefill, training, decode under autograd): ``A1 − λA2`` materialised per block of ``BLOCK``
  query rows against only the keys the block can see, then ONE matmul with the 2d-wide value
  (:class:`BlockedDifferentialAttention`). This does Llama's attention arithmetic — the zero-padded SDPA call does
  twice as much (2d-wide dot products with half zeros, and 2H outputs of width 2d) — at the price of writing each
  block's maps to memory. Its backward recomputes a block's maps from the saved row log-sum-exps (as flash
  attention does), so training keeps no ``T×S`` map.

Additive float masks (not produced by transformers' sdpa mask builder), continuous batching (its paged cache is
written inside transformers' sdpa function) and V2 go to transformers' sdpa.

Importing this module registers the function with transformers' ``AttentionInterface`` (and sdpa's mask builder)
under ``"difftransformer_fast"``, so ``DiffTransformerForCausalLM(config)`` with
``config._attn_implementation = "difftransformer_fast"`` (or ``attn_implementation=`` in ``from_pretrained``) runs
it with no change to the modeling file: that file hands every kernel zero-padded queries ``[Q1|0]``, ``[0|Q2]``, and
:func:`differential_attention_forward` recovers ``Q1``, ``Q2`` as views.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "difftransformer_fast"
# Query rows per materialised block: at most BLOCK, and few enough that the n heads of a group × rows × keys stay
# ≤ BLOCK_SCORES (1 MiB of float32 scores per map and KV group), which bounds a block's memory and keeps it near the
# L2 cache. Measured (docs/performance.md): 128 rows best at 512 keys; at 2048 keys 64 rows with n = 2 and 128 with
# n = 1 (the matmuls want ≥ 128 rows); 256 was slower everywhere.
BLOCK = 128
BLOCK_SCORES = 1 << 18


def decode_attention(query, key, value, lam, scaling, attention_mask=None):
    """One query token. ``query``: ``(B, G, 2, n, w)``, the rows ``(c, r)`` of each KV group, either unpadded
    (``w = d``) or already padded (``w = 2d``, ``[Q1|0]`` and ``[0|Q2]``); ``key``, ``value``: packed ``(B, G, S, 2d)``.

    Returns ``(B, G, n, 2d)``. The padded rows of a group form one ``2n``-row query head, so the SDPA call needs no
    GQA expansion and no causal mask (one token sees the whole cache; a padding or static-cache mask ``(B, 1, 1, S)``
    broadcasts over the rows). The padding is one broadcast multiply: at decode sizes every op costs about as much
    as its arithmetic, so fewest ops wins.
    """
    b, g, _, n, width = query.shape
    d = key.shape[-1] // 2
    if width == d:
        pad = torch.eye(2, dtype=query.dtype, device=query.device).view(2, 1, 2, 1)  # (c, r, c', d)
        query = query.unsqueeze(-2) * pad  # (B, G, 2, n, 2, d)
    out = F.scaled_dot_product_attention(query.reshape(b, g, 2 * n, 2 * d), key, value, attn_mask=attention_mask, scale=scaling)
    out = out.view(b, g, 2, n, 2 * d)
    return out[:, :, 0] - lam * out[:, :, 1]


def _blocks(t: int, s: int, block: int | None, attention_mask: torch.Tensor | None, device: torch.device, n: int = 1):
    """Query blocks ``[t0, t1)``, the number of keys they can see, and an additive float32 mask for their scores.

    Without a mask, transformers means plain causal attention (what SDPA's ``is_causal`` does): square attention, or
    a prefill into an empty static cache, whose ``t`` queries are then the *first* ``t`` of ``s`` positions (SDPA's
    top-left alignment; transformers' sdpa path crops the keys to ``t``). With a boolean mask (True = visible) the
    mask decides; the queries are then taken to be the last ``t`` positions, which only bounds the keys read: a
    causal model never shows a query the keys after its own position, so a block reads ``t1 + s − t`` keys at most.
    The mask is ``(Tb, Sv)`` or ``(B|1, 1, 1, Tb, Sv)`` (over the scores' ``(B, G, n, Tb, Sv)``), 0 or −inf: adding it
    is cheaper than ``masked_fill``, and ``exp`` is fast on −inf (far slower on large finite negatives).
    """
    offset = 0 if attention_mask is None else s - t
    block = block or max(16, min(BLOCK, BLOCK_SCORES // (n * s)))
    for t0 in range(0, t, block):
        t1 = min(t, t0 + block)
        visible = min(s, t1 + offset)
        if attention_mask is not None:
            hide = attention_mask[:, :, None, t0:t1, :visible].logical_not()
        elif visible > t0 + 1:  # the block reaches the diagonal
            hide = torch.arange(visible, device=device) > torch.arange(t0, t1, device=device)[:, None]
        else:
            yield t0, t1, visible, None
            continue
        yield t0, t1, visible, torch.zeros(hide.shape, device=device).masked_fill_(hide, float("-inf"))


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Softmax and gradient sums run in float32 (float64 stays float64, for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _block_scores(q, k, mask, scaling):
    """Scores ``q kᵀ·scaling`` of one block and map, in float32, plus the block's additive mask.

    ``q`` ``(B, G, n, Tb, d)`` (the n heads of a group become rows of one matmul), ``k`` ``(B, G, Sv, d)`` (a view of
    the packed cache).
    """
    b, g, n, tb, d = q.shape
    scores = torch.matmul((q * scaling).reshape(b, g, n * tb, d), k.transpose(-1, -2)).view(b, g, n, tb, -1)
    acc = _acc(q.dtype)
    if mask is None:
        return scores.to(acc)
    return scores.add_(mask) if scores.dtype == acc else torch.add(scores, mask.to(acc))  # bf16 + f32 → f32


def _softmax_stats(scores):
    """In-place softmax of ``scores`` and the row statistics that recompute it: ``(max, log Σ exp(s − max))``.

    Cheaper than ``torch.softmax`` + ``torch.logsumexp`` (which reads the scores twice more). A fully hidden row
    (all −inf: a padding query) gets probabilities 0, hence output 0, as SDPA gives; its statistics stay finite.
    """
    top = scores.amax(-1, keepdim=True).clamp_(min=torch.finfo(scores.dtype).min)
    total = scores.sub_(top).exp_().sum(-1, keepdim=True).clamp_(min=torch.finfo(scores.dtype).tiny)
    return scores.div_(total), torch.stack((top, total.log_()))


def _blocked_forward(q1, q2, key, value, lam, scaling, attention_mask, block, stats=None):
    """The forward loop; fills ``stats`` ``(2 maps, 2, B, G, n, T, 1)`` for backward when given. Returns
    ``(B, T, G, n, 2d)``: the module's ``(B, T, H, 2d)`` layout, so no copy follows (nor is kept for backward)."""
    b, g, n, t, d = q1.shape
    k1, k2 = key[..., :d], key[..., d:]  # (B, G, S, d) views of the packed cache: no copy
    out = value.new_empty(b, t, g, n, 2 * d)
    for t0, t1, visible, mask in _blocks(t, key.shape[2], block, attention_mask, q1.device, n):
        p1, st1 = _softmax_stats(_block_scores(q1[:, :, :, t0:t1], k1[:, :, :visible], mask, scaling))
        p2, st2 = _softmax_stats(_block_scores(q2[:, :, :, t0:t1], k2[:, :, :visible], mask, scaling))
        if stats is not None:
            stats[0, ..., t0:t1, :], stats[1, ..., t0:t1, :] = st1, st2
        diff = p1.addcmul_(p2, lam, value=-1).to(value.dtype)  # A1 − λA2, in place: (B, G, n, Tb, Sv)
        rows = n * (t1 - t0)
        res = torch.matmul(diff.view(b, g, rows, visible), value[:, :, :visible])  # (B, G, n·Tb, 2d)
        out[:, t0:t1] = res.view(b, g, n, t1 - t0, 2 * d).permute(0, 3, 1, 2, 4)
    return out


class BlockedDifferentialAttention(torch.autograd.Function):
    """``O = (A1 − λA2)·V`` block by block, with a recomputing backward (flash-attention style).

    Forward keeps only each row's softmax statistics per map (``O(T)``), not the ``T×S`` maps; backward recomputes a block's
    maps from it. Arithmetic per direction equals a same-config Llama's: two d-wide score products and one 2d-wide
    value product forward; score recompute, ``dO·Vᵀ``, ``dV``, ``dQ`` and ``dK`` backward. Gradients flow to
    ``q1, q2`` ``(B, G, n, T, d)``, the packed ``key``/``value`` ``(B, G, S, 2d)`` and the float32 scalar ``lam``.
    Output ``(B, T, G, n, 2d)``.
    """

    @staticmethod
    def forward(ctx, q1, q2, key, value, lam, scaling, attention_mask, block):
        b, g, n, t, d = q1.shape
        stats = torch.empty(2, 2, b, g, n, t, 1, dtype=_acc(q1.dtype), device=q1.device)
        out = _blocked_forward(q1, q2, key, value, lam, scaling, attention_mask, block, stats)
        ctx.save_for_backward(q1, q2, key, value, lam, stats, attention_mask)
        ctx.scaling, ctx.block = scaling, block
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q1, q2, key, value, lam, stats, attention_mask = ctx.saved_tensors
        scaling = ctx.scaling
        b, g, n, t, d = q1.shape
        k1, k2 = key[..., :d], key[..., d:]
        dq1 = torch.empty(q1.shape, dtype=q1.dtype, device=q1.device)
        dq2 = torch.empty(q2.shape, dtype=q2.dtype, device=q2.device)
        acc = _acc(key.dtype)  # key/value gradients are sums over blocks: float32, bf16-safe
        dkey = torch.zeros(key.shape, dtype=acc, device=key.device)
        dvalue = torch.zeros(value.shape, dtype=acc, device=value.device)
        dlam = torch.zeros((), dtype=_acc(lam.dtype), device=lam.device)
        # dS1 = P1 ∘ (dD − rowsum(dD ∘ P1)) and dS2 = −λ·P2 ∘ (dD − rowsum(dD ∘ P2)), with dD = dO·Vᵀ the gradient of
        # D = A1 − λA2. The factors −λ and the 1/√d of the scores are applied to the small (rows × d) products.
        factors = (scaling, -lam * scaling)
        for t0, t1, visible, mask in _blocks(t, key.shape[2], ctx.block, attention_mask, q1.device, n):
            rows = n * (t1 - t0)
            qb = (q1[:, :, :, t0:t1], q2[:, :, :, t0:t1])
            kb = (k1[:, :, :visible], k2[:, :, :visible])
            # P recomputed from the saved row statistics; hidden scores are −inf, so their P is exactly 0
            p = [_block_scores(qb[c], kb[c], mask, scaling).sub_(stats[c, 0, ..., t0:t1, :]).sub_(stats[c, 1, ..., t0:t1, :]).exp_()
                 for c in (0, 1)]
            grad_b = grad_out[:, t0:t1].permute(0, 2, 3, 1, 4).reshape(b, g, rows, 2 * d)
            diff = torch.addcmul(p[0], p[1], lam, value=-1).to(value.dtype).view(b, g, rows, visible)
            dvalue[:, :, :visible] += torch.matmul(diff.transpose(-1, -2), grad_b)  # sums the n heads of a group
            ddiff = torch.matmul(grad_b, value[:, :, :visible].transpose(-1, -2)).to(acc).view_as(p[0])
            r1, r2 = (torch.einsum("...s,...s->...", ddiff, p[c]).unsqueeze(-1) for c in (0, 1))
            dlam -= r2.sum()
            ds = (torch.sub(ddiff, r1).mul_(p[0]), ddiff.sub_(r2).mul_(p[1]))  # dS1 and dS2 / (−λ), unscaled
            for c, dq, dk in ((0, dq1, dkey[..., :d]), (1, dq2, dkey[..., d:])):
                dsc = ds[c].to(q1.dtype).view(b, g, rows, visible)
                dq[:, :, :, t0:t1] = (torch.matmul(dsc, kb[c]) * factors[c]).view(b, g, n, t1 - t0, d)
                dk[:, :, :visible] += torch.matmul(dsc.transpose(-1, -2), qb[c].reshape(b, g, rows, d)) * factors[c]
        return dq1, dq2, dkey.to(key.dtype), dvalue.to(value.dtype), dlam, None, None, None


def blocked_attention(q1, q2, key, value, lam, scaling, attention_mask=None, block=None):
    """``(B, G, n, T, d)`` queries, packed ``(B, G, S, 2d)`` cache → ``(B, T, G, n, 2d)``; see
    :class:`BlockedDifferentialAttention` (with autograd) and :func:`_blocks` (masking; ``block=None``: rows per block
    chosen from the key length)."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q1, q2, key, value, lam)):
        return BlockedDifferentialAttention.apply(q1, q2, key, value, lam, scaling, attention_mask, block)
    return _blocked_forward(q1, q2, key, value, lam, scaling, attention_mask, block)


def differential_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                   diff_lambda=None, **kwargs):
    """AttentionInterface function: the modeling file's kernel contract (padded V1 queries, packed V1 cache).

    ``query`` ``(B, 2H, T, 2d)`` rows ``(g, c, r)`` zero-padded ``[Q1|0]`` / ``[0|Q2]``; ``key``, ``value``
    ``(B, G, S, 2d)``. Returns ``(B, T, H, 2d)`` already combined (the module then skips its own combine), or, for V2
    and for additive float masks, transformers' sdpa output ``(B, T, 2H, w)`` for the module to combine.
    """
    standard = attention_mask is not None and attention_mask.dtype != torch.bool
    if module.diff_version != 1 or standard or kwargs.get("cache") is not None:  # a paged cache is written by sdpa
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    b, _, t, width = query.shape
    d, n, g = width // 2, module.pair_stride, key.shape[1]
    halves = query.view(b, g, 2, n, t, width)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value, diff_lambda))
    if t == 1 and not grad:  # the module's padded queries serve as they are
        out = decode_attention(halves[:, :, :, :, 0], key, value, diff_lambda, scaling, attention_mask)
        return out.reshape(b, 1, g * n, width), None
    q1, q2 = halves[:, :, 0, :, :, :d], halves[:, :, 1, :, :, d:]  # (B, G, n, T, d) views: the padding is skipped
    out = blocked_attention(q1, q2, key, value, diff_lambda, scaling, attention_mask)  # (B, T, G, n, 2d)
    return out.view(b, t, g * n, width), None


def register(name: str = NAME) -> str:
    """Register :func:`differential_attention_forward` (and sdpa's boolean mask builder) under ``name``."""
    AttentionInterface.register(name, differential_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


register()

__all__ = ["BLOCK", "NAME", "blocked_attention", "decode_attention", "differential_attention_forward", "register"]
