"""Proposed DIFF V1 kernel selection for the sdpa path (issue 5): the measured prototype of PROPOSED_KERNEL.md.

The differential output of SPEC §1 (Ye et al., arXiv 2410.05258, Eq. 1), for head ``h = g·n + r``::

    O_h = (softmax(Q1 K1ᵀ/√d + M) − λ·softmax(Q2 K2ᵀ/√d + M)) · [V_g,0 | V_g,1]

is computed by one of three strategies, chosen per call (evidence: ``benchmarks/attention_micro.py``, see
``docs/performance.md``):

* **decode** (one query token, no autograd): the 2n padded queries of a KV group become the rows of ONE query head
  (transformers' ``pack_gqa`` idea), so one fast SDPA call reads each byte of the packed cache once; the two maps of
  a pair are combined on the (B, G, 2n, 2d) output. No T×S map, no copy of the cache.
* **prefill** (no autograd): ``A1 − λA2`` materialised per block of ``BLOCK`` query rows against only the keys the
  block can see, then ONE matmul with the 2d-wide value. This does Llama's attention arithmetic (the zero-padded
  SDPA call does twice as much: 2d-wide dot products with half zeros, and 2H outputs of width 2d) at the price of
  writing each block's maps to memory.
* **autograd** (training): the current design, one SDPA call on zero-padded queries over the packed cache: fast
  forward and backward kernels that keep no T×S map for backward (a materialising strategy would store every
  block's maps, far beyond the issue's memory target).

Importing this module registers the function with transformers' ``AttentionInterface`` (and sdpa's mask builder)
under ``"difftransformer_fast"``, so ``DiffTransformerForCausalLM(config)`` with
``config._attn_implementation = "difftransformer_fast"`` (or ``attn_implementation=`` in ``from_pretrained``) runs
it with no change to the modeling file: that file hands every kernel zero-padded queries ``[Q1|0]``, ``[0|Q2]``, and
:func:`differential_attention_forward` recovers ``Q1``, ``Q2`` as views. V2 models are passed to transformers' sdpa.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "difftransformer_fast"
# Query rows per materialised block: 64–128 keep a block's maps near the L2 cache; 128 measured best or near-best
# in fp32 and bf16 at 512 and 2048 tokens (docs/performance.md), 256 was slower at 2048.
BLOCK = 128


def decode_attention(q1, q2, key, value, lam, scaling, attention_mask=None):
    """One query token. ``q1``, ``q2``: ``(B, G, n, d)``; ``key``, ``value``: packed ``(B, G, S, 2d)``.

    Returns ``(B, G, n, 2d)``. The padded rows ``[Q1|0]``, ``[0|Q2]`` of a group form one ``2n``-row query head, so
    the SDPA call needs no GQA expansion and no causal mask (one token sees the whole cache; a padding or static-cache
    mask ``(B, 1, 1, S)`` broadcasts over the rows).
    """
    b, g, n, d = q1.shape
    query = q1.new_zeros(b, g, 2, n, 2 * d)
    query[:, :, 0, :, :d] = q1
    query[:, :, 1, :, d:] = q2
    out = F.scaled_dot_product_attention(query.view(b, g, 2 * n, 2 * d), key, value, attn_mask=attention_mask, scale=scaling)
    out = out.view(b, g, 2, n, 2 * d)
    return out[:, :, 0] - lam * out[:, :, 1]


def blocked_attention(q1, q2, key, value, lam, scaling, attention_mask=None, block=BLOCK):
    """Prefill without autograd. ``q1``, ``q2``: ``(B, G, n, T, d)``; ``key``, ``value``: packed ``(B, G, S, 2d)``.

    Returns ``(B, T, G, n, 2d)``. The queries are the last ``T`` of ``S`` positions when no mask is given (causal,
    aligned bottom-right, as transformers passes ``None`` only for square or one-token attention); with a mask
    (boolean, True = visible, or additive float), it decides. Either way a causal model never shows a query the keys
    after its own position, so a block reads only the first ``t1 + S − T`` keys. Hidden scores are set to the
    dtype's minimum rather than −inf, so a fully hidden (padding) row stays finite, as in transformers' eager path.
    """
    b, g, n, t, d = q1.shape
    s = key.shape[2]
    offset = s - t
    q1, q2 = q1 * scaling, q2 * scaling
    k1, k2 = key[..., :d], key[..., d:]  # (B, G, S, d) views of the packed cache: no copy
    hide = None
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        hide = attention_mask.logical_not()[:, :, None]  # (B|1, 1, 1, T, S) over (B, G, n, T, S)
    out = value.new_empty(b, t, g, n, 2 * d)
    for t0 in range(0, t, block):
        t1 = min(t, t0 + block)
        visible = min(s, t1 + offset)
        rows = n * (t1 - t0)
        s1 = torch.matmul(q1[:, :, :, t0:t1].reshape(b, g, rows, d), k1[:, :, :visible].transpose(-1, -2))
        s2 = torch.matmul(q2[:, :, :, t0:t1].reshape(b, g, rows, d), k2[:, :, :visible].transpose(-1, -2))
        s1, s2 = s1.view(b, g, n, t1 - t0, visible), s2.view(b, g, n, t1 - t0, visible)
        if attention_mask is None:
            if visible > t0 + offset + 1:  # the block reaches the diagonal
                causal = torch.arange(visible, device=key.device) > torch.arange(t0, t1, device=key.device)[:, None] + offset
                s1.masked_fill_(causal, torch.finfo(s1.dtype).min)
                s2.masked_fill_(causal, torch.finfo(s2.dtype).min)
        elif hide is not None:
            h = hide[..., t0:t1, :visible]
            s1.masked_fill_(h, torch.finfo(s1.dtype).min)
            s2.masked_fill_(h, torch.finfo(s2.dtype).min)
        else:
            m = attention_mask[:, :, None, t0:t1, :visible]
            s1.add_(m)
            s2.add_(m)
        p1 = torch.softmax(s1, -1, dtype=torch.float32)
        p2 = torch.softmax(s2, -1, dtype=torch.float32)
        diff = p1.sub_(p2.mul_(lam)).to(value.dtype).view(b, g, rows, visible)  # A1 − λA2, in place
        res = torch.matmul(diff, value[:, :, :visible])  # (B, G, n·Tb, 2d): the one 2d-wide multiplication
        out[:, t0:t1] = res.view(b, g, n, t1 - t0, 2 * d).permute(0, 3, 1, 2, 4)
    return out


def differential_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                   diff_lambda=None, **kwargs):
    """AttentionInterface function: the modeling file's kernel contract (padded V1 queries, packed V1 cache).

    ``query`` ``(B, 2H, T, 2d)`` rows ``(g, c, r)`` zero-padded ``[Q1|0]`` / ``[0|Q2]``; ``key``, ``value``
    ``(B, G, S, 2d)``. Returns ``(B, T, H, 2d)`` already combined (the module then skips its own combine), or, for the
    autograd path and for V2, transformers' sdpa output ``(B, T, 2H, w)`` for the module to combine.
    """
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, diff_lambda))
    if module.diff_version != 1 or grad:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    b, _, t, width = query.shape
    d, n, g = width // 2, module.pair_stride, key.shape[1]
    halves = query.view(b, g, 2, n, t, width)
    q1, q2 = halves[:, :, 0, :, :, :d], halves[:, :, 1, :, :, d:]  # (B, G, n, T, d) views: the padding is skipped
    if t == 1:
        out = decode_attention(q1[:, :, :, 0], q2[:, :, :, 0], key, value, diff_lambda, scaling, attention_mask)
        return out.reshape(b, 1, g * n, width), None
    out = blocked_attention(q1, q2, key, value, diff_lambda, scaling, attention_mask)
    return out.view(b, t, g * n, width), None


def register(name: str = NAME) -> str:
    """Register :func:`differential_attention_forward` (and sdpa's boolean mask builder) under ``name``."""
    AttentionInterface.register(name, differential_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


register()

__all__ = ["BLOCK", "NAME", "blocked_attention", "decode_attention", "differential_attention_forward", "register"]
