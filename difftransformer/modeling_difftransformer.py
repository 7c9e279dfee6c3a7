"""PyTorch Differential Transformer: DIFF V1 (Ye et al., arXiv 2410.05258) and DIFF V2 (Ye, Dong, Sun, Wei, 2026).

Reference code: microsoft/unilm ``Diff-Transformer/multihead_flashdiff_2.py`` (V1) and
``Diff-Transformer-V2/`` (V2). Everything that is not differential attention is Llama's, imported from
transformers (RMSNorm, rotary embeddings with rope scaling, MLP, masks, caches, task heads).

Head layout of one layer (SPEC §3), shown for V1 with H = 4 differential heads, G = 2 KV groups (n = 2)::

    q_proj rows  (Hq = 2H = 8 heads of width d), group-major (g, c, r):
        | g0 c0 r0 | g0 c0 r1 | g0 c1 r0 | g0 c1 r1 | g1 c0 r0 | g1 c0 r1 | g1 c1 r0 | g1 c1 r1 |
    k_proj / v_proj rows (Hkv = 2G = 4 heads of width d), (g, c):
        |  K g0 c0  |  K g0 c1  |  K g1 c0  |  K g1 c1  |      (same for V)
    differential head h = g·n + r uses Q[g,c,r], K[g,c] for map c = 0, 1 and V = [V g0 | V g1] (2d wide).

With that order the standard GQA rule (query head i reads KV head i // n) already pairs every map with its
own key head, and the cache holds a Llama's bytes. This implementation views K and V per group as one packed
``2d``-wide head, ``[K1 | K2]`` and ``[V_g,0 | V_g,1]`` (a free view of the projections), and zero-pads each
query to ``2d`` on the side of its own key (``[Q1 | 0]``, ``[0 | Q2]``): one standard attention call per layer
with equal q/k/v head sizes (what fast SDPA, flash and flex kernels need) then returns ``A_c·[V1;V2]`` for every
map, and the two maps of a head are combined afterwards. That call does twice a Llama's attention arithmetic, so
under ``attn_implementation="sdpa"`` V1 runs its own kernel instead (``differential_sdpa_attention``: one packed
SDPA call per group when decoding, ``A1 − λ·A2`` materialised block by block otherwise, with a recomputing
backward). The eager path materialises ``A1 − λ·A2`` whole and returns the differential maps.

V2 is standard GQA attention over all 2H query heads, adjacent query heads (2h, 2h+1) forming a pair over one
shared KV head; ``λ`` is computed per token and head by ``lambda_proj``.

Deliberate deviations from Microsoft's reference code: rotate-half RoPE (transformers' convention) instead of
interleaved, group-major query rows (convert_scripts handle both), no attention dropout.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.dynamic_module_utils import custom_object_save
from transformers.generation import GenerationMixin
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)
from transformers.utils import can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_difftransformer import DiffTransformerConfig


def lambda_init_fn(layer_idx: int) -> float:
    """λinit(l) = 0.8 − 0.6·exp(−0.3·l), 0-based layer index (paper §2.1; layer 0 → 0.2)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def differential_combine(maps: torch.Tensor, lam: torch.Tensor, pair_stride: int, dim: int) -> torch.Tensor:
    """The differential step of the paper, ``A1 − λ·A2``, for every differential head.

    ``maps`` holds one entry per softmax map along axis ``dim`` (2H entries: the maps themselves, shape
    ``(B, 2H, T, S)``, or their outputs ``A_c·V``, shape ``(B, T, 2H, w)``; the step is linear, so either works).
    The two maps of head ``h = g·n + r`` sit ``pair_stride`` entries apart inside a block of ``2·pair_stride``:
    V1 rows are ordered (g, c, r), so ``pair_stride = n``; V2 rows are (h, c), so ``pair_stride = 1``.
    ``lam`` must broadcast against one map entry (a scalar for V1; per token and head for V2).
    Returns the H differential entries in head order ``h = g·n + r`` along ``dim``.
    """
    first, second = maps.unflatten(dim, (-1, 2, pair_stride)).unbind(dim + 1)
    return (first - lam * second).flatten(dim, dim + 1)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    diff_lambda: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialised differential attention: ``O_h = (softmax(Q1K1ᵀ·s + M) − λ·softmax(Q2K2ᵀ·s + M))·V``.

    query ``(B, 2H, T, w)``, key/value ``(B, G, S, w)`` exactly as the module passes them to every kernel.
    Unlike standard kernels this returns the *combined* output ``(B, T, H, w)`` together with the differential
    maps ``(B, H, T, S)`` it was computed from (SPEC §7: what ``output_attentions`` shows).
    """
    keys = repeat_kv(key, module.num_key_value_groups)  # (B, 2H, S, w)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    maps = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # (B, 2H, T, S)
    lam = diff_lambda if diff_lambda.dim() == 0 else diff_lambda.transpose(1, 2)[:, :, None, :, None]
    diff_maps = differential_combine(maps, lam, module.pair_stride, dim=1)  # (B, H, T, S)
    values = repeat_kv(value, module.num_key_value_groups // 2)  # (B, H, S, w): head h reads group h // n
    attn_output = torch.matmul(diff_maps, values).transpose(1, 2).contiguous()  # (B, T, H, w)
    return attn_output, diff_maps


# ---------------------------------------------------------------------------------------------------------------------
# V1 with attn_implementation="sdpa": a kernel that does a Llama's attention arithmetic
# ---------------------------------------------------------------------------------------------------------------------
# One zero-padded SDPA call (what every other backend receives) computes 2H maps over 2d-wide dot products, half of
# them zeros, and 2H outputs 2d wide: twice a Llama's attention arithmetic, because SDPA cannot combine two maps before
# multiplying by the value. For V1 under "sdpa" the module instead calls `differential_sdpa_attention`:
#   * one query token without autograd (decode): the 2n padded query rows of a KV group become the rows of ONE query
#     head, so one fast SDPA call reads every byte of the packed cache once (transformers' `pack_gqa` idea);
#   * otherwise: `A1 − λ·A2` is materialised per block of query rows against only the keys the block can see, then
#     multiplied once by the 2d-wide value (`BlockedDifferentialAttention`); its backward recomputes each block's maps
#     from two float32 numbers per row and map, as flash attention does, so training keeps no T×S map.
# benchmarks/attention_micro.py measures both against every alternative (docs/performance.md).

# At most this many query rows per block, and few enough that a block's scores (n heads × rows × keys) stay within
# _BLOCK_SCORES float32 elements (1 MiB) per map and KV group, near the L2 cache.
_BLOCK_ROWS = 128
_BLOCK_SCORES = 1 << 18


def packed_decode_attention(query, key, value, lam, scaling, attention_mask=None):
    """V1 attention of one query token. ``query`` ``(B, G, 2, n, d)`` (rows ``(c, r)`` of each KV group), ``key`` and
    ``value`` the packed cache ``(B, G, S, 2d)``, ``lam`` the layer's λ. Returns ``(B, G, n, 2d)``.

    The queries are zero-padded to ``[Q1|0]``, ``[0|Q2]`` (one broadcast multiply) and the group's 2n rows form one
    query head: one SDPA call, no GQA expansion, no causal mask (one token sees the whole cache; a padding or
    static-cache mask ``(B, 1, 1, S)`` broadcasts over the rows).
    """
    b, g, _, n, d = query.shape
    pad = torch.eye(2, dtype=query.dtype, device=query.device).view(2, 1, 2, 1)  # (c, r, c', d)
    rows = (query.unsqueeze(-2) * pad).reshape(b, g, 2 * n, 2 * d)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=attention_mask, scale=scaling).view(b, g, 2, n, 2 * d)
    return out[:, :, 0] - lam * out[:, :, 1]


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


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # softmax and sums in float32 (float64 stays float64)


def _block_scores(q, k, mask, scaling):
    """Float32 scores of one block and map: ``q`` ``(B, G, n, Tb, d)`` (the n heads of a group are rows of one matmul),
    ``k`` ``(B, G, Sv, d)`` (a view of the packed cache), plus the block's additive mask."""
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


def _blocked_forward(q1, q2, key, value, lam, scaling, attention_mask, block, stats=None):
    """``(A1 − λA2)·V`` block by block → ``(B, T, G, n, 2d)`` (the module's head layout: no copy follows). Fills
    ``stats`` ``(2 maps, 2, B, G, n, T, 1)`` for the backward when given."""
    b, g, n, t, d = q1.shape
    k1, k2 = key[..., :d], key[..., d:]  # views of the packed cache
    out = value.new_empty(b, t, g, n, 2 * d)
    for t0, t1, visible, mask in _query_blocks(t, key.shape[2], attention_mask, q1.device, n, block):
        p1, st1 = _softmax_with_stats(_block_scores(q1[:, :, :, t0:t1], k1[:, :, :visible], mask, scaling))
        p2, st2 = _softmax_with_stats(_block_scores(q2[:, :, :, t0:t1], k2[:, :, :visible], mask, scaling))
        if stats is not None:
            stats[0, ..., t0:t1, :], stats[1, ..., t0:t1, :] = st1, st2
        diff = p1.addcmul_(p2, lam, value=-1).to(value.dtype)  # A1 − λ·A2: (B, G, n, Tb, Sv)
        res = torch.matmul(diff.view(b, g, n * (t1 - t0), visible), value[:, :, :visible])
        out[:, t0:t1] = res.view(b, g, n, t1 - t0, 2 * d).permute(0, 3, 1, 2, 4)
    return out


class BlockedDifferentialAttention(torch.autograd.Function):
    """``O = (A1 − λA2)·V`` block by block, with a backward that recomputes each block's maps (flash-attention style).

    Inputs: ``q1``, ``q2`` ``(B, G, n, T, d)``, the packed ``key``/``value`` ``(B, G, S, 2d)``, the scalar ``lam``;
    output ``(B, T, G, n, 2d)``. Saved for backward: the inputs and ``O(T)`` row statistics, never a ``T×S`` map.
    """

    @staticmethod
    def forward(ctx, q1, q2, key, value, lam, scaling, attention_mask, block):
        b, g, n, t, _ = q1.shape
        stats = torch.empty(2, 2, b, g, n, t, 1, dtype=_accumulation_dtype(q1.dtype), device=q1.device)
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
        dq1, dq2 = torch.empty_like(q1, memory_format=torch.contiguous_format), torch.empty_like(q2, memory_format=torch.contiguous_format)
        acc = _accumulation_dtype(key.dtype)  # key/value gradients sum over blocks: float32 even for bf16
        dkey = torch.zeros(key.shape, dtype=acc, device=key.device)
        dvalue = torch.zeros(value.shape, dtype=acc, device=value.device)
        dlam = torch.zeros((), dtype=_accumulation_dtype(lam.dtype), device=lam.device)
        # With D = A1 − λA2 and dD = dO·Vᵀ: dS1 = P1 ∘ (dD − rowsum(dD ∘ P1)), dS2 = −λ·P2 ∘ (dD − rowsum(dD ∘ P2)),
        # dλ = −Σ dD ∘ P2. The factors −λ and 1/√d are applied to the small (rows × d) products.
        factors = (scaling, -lam * scaling)
        for t0, t1, visible, mask in _query_blocks(t, key.shape[2], attention_mask, q1.device, n, ctx.block):
            rows = n * (t1 - t0)
            qb = (q1[:, :, :, t0:t1], q2[:, :, :, t0:t1])
            kb = (k1[:, :, :visible], k2[:, :, :visible])
            p = [_block_scores(qb[c], kb[c], mask, scaling).sub_(stats[c, 0, ..., t0:t1, :]).sub_(stats[c, 1, ..., t0:t1, :]).exp_()
                 for c in (0, 1)]  # hidden scores are −inf: their P is exactly 0
            grad_b = grad_out[:, t0:t1].permute(0, 2, 3, 1, 4).reshape(b, g, rows, 2 * d)
            diff = torch.addcmul(p[0], p[1], lam, value=-1).to(value.dtype).view(b, g, rows, visible)
            dvalue[:, :, :visible] += torch.matmul(diff.transpose(-1, -2), grad_b)  # sums the group's n heads
            ddiff = torch.matmul(grad_b, value[:, :, :visible].transpose(-1, -2)).to(acc).view_as(p[0])
            r1, r2 = (torch.einsum("...s,...s->...", ddiff, p[c]).unsqueeze(-1) for c in (0, 1))
            dlam -= r2.sum()
            ds = (torch.sub(ddiff, r1).mul_(p[0]), ddiff.sub_(r2).mul_(p[1]))
            for c, dq, dk in ((0, dq1, dkey[..., :d]), (1, dq2, dkey[..., d:])):
                dsc = ds[c].to(q1.dtype).view(b, g, rows, visible)
                dq[:, :, :, t0:t1] = (torch.matmul(dsc, kb[c]) * factors[c]).view(b, g, n, t1 - t0, d)
                dk[:, :, :visible] += torch.matmul(dsc.transpose(-1, -2), qb[c].reshape(b, g, rows, d)) * factors[c]
        return dq1, dq2, dkey.to(key.dtype), dvalue.to(value.dtype), dlam.to(lam.dtype), None, None, None


def blocked_differential_attention(q1, q2, key, value, lam, scaling, attention_mask=None, block=None):
    """``(B, G, n, T, d)`` queries of both maps over the packed ``(B, G, S, 2d)`` cache → ``(B, T, G, n, 2d)``.
    ``attention_mask``: None (transformers' sdpa convention) or boolean, broadcastable to ``(B, 1, T, S)``;
    ``block``: query rows per block (None: chosen from the key length)."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q1, q2, key, value, lam)):
        return BlockedDifferentialAttention.apply(q1, q2, key, value, lam, scaling, attention_mask, block)
    return _blocked_forward(q1, q2, key, value, lam, scaling, attention_mask, block)


def differential_sdpa_attention(query, key, value, attention_mask, lam, scaling, pair_stride):
    """V1's kernel under ``attn_implementation="sdpa"``: ``query`` ``(B, T, 2H, d)`` in the q_proj row order
    ``(g, c, r)`` (unpadded), packed ``key``/``value`` ``(B, G, S, 2d)``, a boolean or no mask. Returns the combined
    differential heads ``(B, T, H, 2d)``, equal to the padded-query path and to the eager formula."""
    b, t, _, d = query.shape
    g, n = key.shape[1], pair_stride
    if t == 1 and not (torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value, lam))):
        out = packed_decode_attention(query.view(b, g, 2, n, d), key, value, lam, scaling, attention_mask)
        return out.view(b, 1, g * n, 2 * d)
    heads = query.view(b, t, g, 2, n, d).permute(0, 2, 3, 4, 1, 5)  # (B, G, 2, n, T, d): a view
    out = blocked_differential_attention(heads[:, :, 0], heads[:, :, 1], key, value, lam, scaling, attention_mask)
    return out.view(b, t, g * n, 2 * d)


class PackedGroupsPagedCache(PagedAttentionCache):
    """V1's view of transformers' paged cache (continuous batching), handed to the kernel in place of the cache.

    Continuous batching writes keys and values inside the attention function, into a cache laid out per token as
    ``(num_key_value_heads, head_dim)``: byte for byte the packed ``(G, 2d)`` groups V1 gives its kernel
    (``[K1 | K2]`` per group, SPEC §4). ``update`` converts the views both ways — no copy — so every kernel that
    supports the paged cache (sdpa, ``paged|eager``) runs V1 with its single call. The flash block-table path writes
    the cache inside the flash kernel with the config's head size and is refused.
    """

    def __init__(self, cache: PagedAttentionCache):  # a view: deliberately no second cache (no super().__init__)
        self._cache = cache

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def update(self, key_states, value_states, layer_idx, kwargs):
        def heads(x):  # (1, G, T, 2d) -> (1, Hkv, T, d)
            return x.transpose(1, 2).unflatten(-1, (2, -1)).flatten(2, 3).transpose(1, 2)

        def groups(x):  # (1, Hkv, S, d) -> (1, G, S, 2d)
            return x.transpose(1, 2).unflatten(2, (-1, 2)).flatten(3, 4).transpose(1, 2)

        key, value = self._cache.update(heads(key_states), heads(value_states), layer_idx, kwargs)
        if kwargs.get("block_table") is not None:
            raise NotImplementedError(
                "diff_version=1 with a block-table paged cache (flash paged attention) is not supported: that kernel "
                "writes keys of width head_dim, V1 attends over packed 2*head_dim groups. Use attn_implementation="
                "'sdpa' or 'eager' for continuous batching, or a diff_version=2 model."
            )
        return groups(key), groups(value)


class DiffTransformerHeadRMSNorm(nn.Module):
    """V1's per-head norm, ``scale · RMSNorm_2d(O_h) ⊙ w``, computed in float32 (paper §2.1, "GroupNorm" = RMSNorm
    per head in the reference code). ``scale`` is ``1 − λinit``. A module (not a bare weight read) so that hooks
    such as accelerate's offloading see it run."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, heads: torch.Tensor, scale: float) -> torch.Tensor:
        weight = self.weight.float() * scale
        return F.rms_norm(heads.float(), (heads.shape[-1],), weight, self.eps).to(heads.dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class DiffTransformerAttention(nn.Module):
    """Differential attention (V1 or V2, ``config.diff_version``); see the module docstring for the layout."""

    def __init__(self, config: DiffTransformerConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.diff_version = config.diff_version
        self.head_dim = d = config.head_dim
        self.num_heads = config.num_attention_heads // 2  # H, differential heads
        n = self.num_heads // config.num_kv_groups  # differential heads per KV group
        # Query heads (one per softmax map) per KV head *as passed to the kernel*: V1 passes packed groups.
        self.num_key_value_groups = 2 * n
        self.pair_stride = n if self.diff_version == 1 else 1
        self.scaling = d**-0.5  # 1/sqrt(d), not 1/sqrt(2d): each map is a d-wide dot product
        self.is_causal = True
        self.attention_dropout = 0.0

        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * d, bias=bias)
        if self.diff_version == 1:
            self.o_proj = nn.Linear(self.num_heads * 2 * d, config.hidden_size, bias=bias)
            self.lambda_init = config.lambda_init if config.lambda_init is not None else lambda_init_fn(layer_idx)
            self.lambda_q1 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
            self.lambda_k1 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
            self.lambda_q2 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
            self.lambda_k2 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
            self.subln = DiffTransformerHeadRMSNorm(2 * d, eps=config.subln_eps)
        else:
            self.o_proj = nn.Linear(self.num_heads * d, config.hidden_size, bias=bias)
            self.lambda_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)

    def lambda_full(self) -> torch.Tensor:
        """V1: ``λ = exp(λq1·λk1) − exp(λq2·λk2) + λinit``, a float32 scalar for this layer."""
        q1, k1, q2, k2 = (p.float() for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2))
        return torch.exp(torch.dot(q1, k1)) - torch.exp(torch.dot(q2, k2)) + self.lambda_init

    def _uses_differential_sdpa(self, query: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
        """V1 under ``"sdpa"`` runs :func:`differential_sdpa_attention` unless the call needs transformers' own sdpa
        function: an additive float mask (a user's 4-D mask) or continuous batching (its kernel writes the cache).

        Off the CPU only decoding (one token, no autograd) takes it: there, prefill and training keep the padded
        call, which CUDA's flash / memory-efficient SDPA kernels run without writing any map (the blocked kernel was
        measured on CPUs only, docs/performance.md)."""
        if self.config._attn_implementation != "sdpa" or kwargs.get("cache") is not None:
            return False
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            return False
        return query.device.type == "cpu" or (query.shape[1] == 1 and not torch.is_grad_enabled())

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        input_shape = hidden_states.shape[:-1]
        d = self.head_dim
        query = self.q_proj(hidden_states).view(*input_shape, -1, d)  # (B, T, 2H, d)
        key = self.k_proj(hidden_states).view(*input_shape, -1, d)  # (B, T, Hkv, d)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=2)

        if self.diff_version == 1:
            lam = self.lambda_full()
            width = 2 * d
            key = key.view(*input_shape, -1, width)  # (B, T, G, 2d) = [K1 | K2] per group
        else:
            lam = torch.sigmoid(self.lambda_proj(hidden_states))  # (B, T, H)
            width = d
        value = self.v_proj(hidden_states).view(*input_shape, -1, width)  # V1: (B, T, G, 2d) = [V_g,0 | V_g,1]
        key, value = key.transpose(1, 2), value.transpose(1, 2)

        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        if self.diff_version == 1 and isinstance(kwargs.get("cache"), PagedAttentionCache):
            kwargs["cache"] = PackedGroupsPagedCache(kwargs["cache"])  # continuous batching: kernel writes the cache

        if self.diff_version == 1 and self._uses_differential_sdpa(query, attention_mask, kwargs):
            attn_output = differential_sdpa_attention(query, key, value, attention_mask, lam, self.scaling, self.pair_stride)
            attn_weights = None
        else:
            if self.diff_version == 1:
                # [Q1 | 0] and [0 | Q2]: map c only sees half c of the packed key. Rows (g, c, r) → (g, c, r, c', d).
                pad = torch.eye(2, dtype=query.dtype, device=query.device).view(2, 1, 2, 1)
                query = (query.unflatten(2, (-1, 2, self.pair_stride, 1)) * pad).reshape(*input_shape, -1, width)
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
            attn_output, attn_weights = attention_interface(
                self,
                query.transpose(1, 2),
                key,
                value,
                attention_mask,
                dropout=0.0,
                scaling=self.scaling,
                diff_lambda=lam,
                **kwargs,
            )
            if attn_output.shape[2] == query.shape[2]:  # a standard kernel: one output A_c·V per softmax map
                attn_output = differential_combine(attn_output, lam if lam.dim() == 0 else lam[..., None, None], self.pair_stride, dim=2)

        if self.diff_version == 1:
            attn_output = self.subln(attn_output, scale=1.0 - self.lambda_init)  # (1 − λinit)·RMSNorm_2d(O_h)⊙w
        attn_output = self.o_proj(attn_output.reshape(*input_shape, -1))
        return attn_output, attn_weights, lam


class DiffTransformerDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DiffTransformerConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = DiffTransformerAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


@dataclass
class DiffTransformerModelOutputWithPast(BaseModelOutputWithPast):
    """``BaseModelOutputWithPast`` plus ``lambdas`` (with ``output_lambdas=True``): one tensor per layer, a float32
    scalar λ (V1) or λ per token and head, shape ``(B, T, H)`` (V2)."""

    lambdas: tuple[torch.Tensor, ...] | None = None


@dataclass
class DiffTransformerCausalLMOutputWithPast(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus ``lambdas`` (see [`DiffTransformerModelOutputWithPast`])."""

    lambdas: tuple[torch.Tensor, ...] | None = None


class DiffTransformerPreTrainedModel(PreTrainedModel):
    config: DiffTransformerConfig
    config_class = DiffTransformerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DiffTransformerDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flex_attn = True
    # Every kernel call has equal q/k/v head sizes and the standard GQA mapping (tests/test_modeling_difftransformer.py
    # checks that contract through a custom AttentionInterface function).
    _supports_flash_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "hidden_states": DiffTransformerDecoderLayer,
        "attentions": OutputRecorder(DiffTransformerAttention, index=1),
        "lambdas": OutputRecorder(DiffTransformerAttention, index=2),
    }

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)  # Linear/Embedding: N(0, initializer_range); RMSNorms (incl. subln): ones
        if isinstance(module, DiffTransformerAttention) and module.diff_version == 1:
            for param in (module.lambda_q1, module.lambda_k1, module.lambda_q2, module.lambda_k2):
                init.normal_(param, mean=0.0, std=self.config.lambda_std)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """As transformers', but a checkpoint that lacks a tensor of the backbone fails loudly.

        transformers only reports missing keys and initialises them randomly; for a differential model a missing λ,
        ``subln`` or projection silently changes the function. Only a task head that the checkpoint cannot have
        (e.g. ``score`` of a sequence classifier built from a causal LM) may be initialised fresh. Mis-shaped tensors
        already raise in transformers, whose load report names them.
        """
        output_loading_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        prefix = model.base_model_prefix + "."
        is_base = model.base_model is model
        missing = sorted(k for k in info["missing_keys"] if is_base or k.startswith(prefix))
        if missing:
            raise ValueError(
                f"The checkpoint lacks {len(missing)} tensor(s) of the {cls.__name__} backbone: "
                f"{', '.join(missing[:12])}{' ...' if len(missing) > 12 else ''}. Refusing to initialise them randomly: "
                "check that the checkpoint matches its config.json, or convert it with convert_scripts/convert.py."
            )
        tp_size = model.tp_size or 1
        if model.config.num_kv_groups % tp_size:
            raise ValueError(
                f"tp_size={tp_size} must divide the number of KV groups ({model.config.num_kv_groups} = "
                f"num_key_value_heads{' / 2' if model.config.diff_version == 1 else ''}): a tensor-parallel shard holds "
                "whole groups, since both maps of a differential head read the same group."
            )
        return (model, info) if output_loading_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """As transformers', but the folder's ``auto_map`` names every Auto class (SPEC §7b).

        transformers records only the class being saved (plus ``AutoConfig``); with all of them, the folder
        loads as remote code through ``AutoModel``, ``AutoModelForCausalLM`` and the other heads. Wrappers that
        subclass the model dynamically (FSDP2's ``fully_shard`` makes ``FSDPDiffTransformerForCausalLM`` in a torch
        module) would make transformers copy *their* module and record their class: the code of the model class
        itself is saved instead.
        """
        if self._auto_class is None:  # neither `import difftransformer` nor remote-code loading asked for code
            return super().save_pretrained(save_directory, *args, **kwargs)
        code_class = next(c for c in type(self).__mro__ if c.__module__ == DiffTransformerPreTrainedModel.__module__)
        module = code_class.__module__.rsplit(".", 1)[-1]
        auto_map = {auto: f"{module}.{name}" for auto, name in _AUTO_MAP.items()}
        self.config.auto_map = {**auto_map, **(getattr(self.config, "auto_map", None) or {})}
        if code_class is type(self):
            return super().save_pretrained(save_directory, *args, **kwargs)
        wrapper = type(self)
        wrapper._auto_class = None  # on the wrapper class only: keeps transformers from saving the wrapper's code
        try:
            result = super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            del wrapper._auto_class
        if kwargs.get("is_main_process", True):
            custom_object_save(SimpleNamespace(__module__=code_class.__module__), save_directory)  # copies the files
        return result

    def layer_lambdas(self) -> torch.Tensor:
        """V1: the current λ of every layer, float32 tensor of shape ``(num_hidden_layers,)``.

        V2's λ depends on the input: use ``model(..., output_lambdas=True).lambdas``.
        """
        if self.config.diff_version != 1:
            raise ValueError("layer_lambdas() is defined for diff_version=1; for V2 call the model with output_lambdas=True.")
        with torch.no_grad():
            return torch.stack([m.lambda_full() for m in self.modules() if isinstance(m, DiffTransformerAttention)])


class DiffTransformerModel(DiffTransformerPreTrainedModel):
    def __init__(self, config: DiffTransformerConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [DiffTransformerDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()
        if config.diff_version == 1:  # V1 has no lambda_proj (its λ vectors and subln are replicated under TP)
            self._tp_plan.pop("layers.*.self_attn.lambda_proj", None)

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> DiffTransformerModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return DiffTransformerModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)


class DiffTransformerForCausalLM(DiffTransformerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: DiffTransformerConfig):
        super().__init__(config)
        self.model = DiffTransformerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> DiffTransformerCausalLMOutputWithPast:
        outputs: DiffTransformerModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return DiffTransformerCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            lambdas=outputs.lambdas,
        )


class DiffTransformerForSequenceClassification(GenericForSequenceClassification, DiffTransformerPreTrainedModel): ...


class DiffTransformerForQuestionAnswering(GenericForQuestionAnswering, DiffTransformerPreTrainedModel): ...


class DiffTransformerForTokenClassification(GenericForTokenClassification, DiffTransformerPreTrainedModel): ...


# Trainer shifts labels for label smoothing only for class names in this table (transformers/trainer.py); registered
# here, not in the package, so that it also holds for remote-code loading.
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("difftransformer", "DiffTransformerForCausalLM")

_AUTO_MAP = {
    "AutoModel": "DiffTransformerModel",
    "AutoModelForCausalLM": "DiffTransformerForCausalLM",
    "AutoModelForSequenceClassification": "DiffTransformerForSequenceClassification",
    "AutoModelForTokenClassification": "DiffTransformerForTokenClassification",
    "AutoModelForQuestionAnswering": "DiffTransformerForQuestionAnswering",
}

__all__ = [
    "DiffTransformerPreTrainedModel",
    "DiffTransformerModel",
    "DiffTransformerForCausalLM",
    "DiffTransformerForSequenceClassification",
    "DiffTransformerForQuestionAnswering",
    "DiffTransformerForTokenClassification",
    "blocked_differential_attention",
    "differential_combine",
    "differential_sdpa_attention",
    "eager_attention_forward",
    "packed_decode_attention",
    "lambda_init_fn",
]
