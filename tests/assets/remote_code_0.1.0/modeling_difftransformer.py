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
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.configuration_utils import PreTrainedConfig
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
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
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
from .kernels_difftransformer import (
    blocked_differential_attention,
    causal_block_attention,
    differential_sdpa_attention,
    packed_decode_attention,
    pair_decode_attention,
    uses_causal_block_attention,
)


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
    return torch.addcmul(first, lam, second, value=-1).flatten(dim, dim + 1)  # one kernel: first − λ·second


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
    maps = F.softmax(scores, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32)).to(query.dtype)  # (B, 2H, T, S)
    lam = diff_lambda if diff_lambda.dim() == 0 else diff_lambda.transpose(1, 2)[:, :, None, :, None]
    diff_maps = differential_combine(maps, lam, module.pair_stride, dim=1)  # (B, H, T, S)
    values = repeat_kv(value, module.num_key_value_groups // 2)  # (B, H, S, w): head h reads group h // n
    attn_output = torch.matmul(diff_maps, values).transpose(1, 2).contiguous()  # (B, T, H, w)
    return attn_output, diff_maps


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


# Devices on which V1 prefill and training under "sdpa" run the blocked kernel (measured on CPUs only); elsewhere they
# keep the padded call. Tests empty it to run the non-CPU dispatch on a CPU.
BLOCKED_KERNEL_DEVICES = ("cpu",)


class DiffTransformerHeadRMSNorm(nn.Module):
    """V1's per-head norm, ``scale · RMSNorm_2d(O_h) ⊙ w`` (paper §2.1, "GroupNorm" = RMSNorm per head in the
    reference code). ``scale`` is ``1 − λinit``. Computed in float32, or in the input's dtype where that is wider
    (float64 stays float64). A module (not a bare weight read) so that hooks such as accelerate's offloading see it run."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, heads: torch.Tensor, scale: float) -> torch.Tensor:
        dtype = torch.promote_types(heads.dtype, torch.float32)
        weight = self.weight.to(dtype) * scale
        return F.rms_norm(heads.to(dtype), (heads.shape[-1],), weight, self.eps).to(heads.dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class DiffTransformerAttention(nn.Module):
    """What V1 and V2 share: the q/k/v/o projections, rotary embeddings, the KV cache, the choice of V1's/V2's own sdpa
    kernels and the combination of a standard kernel's per-map outputs. The subclasses add λ and call the kernel in
    their own ``forward`` (where transformers and vLLM look for that call).

    ``value_width`` is the width of one differential head's output: ``2d`` for V1 (its value ``[V1; V2]``), ``d`` for V2.
    Keys and values are passed to every kernel (and cached) as ``Hkv·d / value_width`` heads of that width: V1's packed
    groups ``[K1 | K2]``, ``[V_g,0 | V_g,1]`` are a free view of the projections (module docstring).
    """

    diff_version: int
    pair_stride: int  # distance between the two maps of a head in the kernel's query-head order (differential_combine)

    def __init__(self, config: DiffTransformerConfig, layer_idx: int, value_width: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.value_width = value_width
        self.num_heads = config.num_diff_heads  # H, differential heads
        # Query heads (one per softmax map) per KV head *as passed to the kernel*: 2n for both versions.
        self.num_key_value_groups = 2 * (self.num_heads // config.num_kv_groups)
        self.scaling = self.head_dim**-0.5  # 1/sqrt(d), not 1/sqrt(2d): each map is a d-wide dot product
        self.is_causal = True
        self.attention_dropout = 0.0

        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * value_width, hidden, bias=bias)

    def project(self, hidden_states, position_embeddings, past_key_values):
        """→ rotated queries ``(B, T, 2H, d)`` in q_proj row order, and the cached keys and values
        ``(B, Hkv·d / value_width, S, value_width)`` (this step's, appended to ``past_key_values``)."""
        input_shape = hidden_states.shape[:-1]
        query = self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim)  # (B, T, 2H, d)
        key = self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim)  # (B, T, Hkv, d)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=2)
        key = key.view(*input_shape, -1, self.value_width).transpose(1, 2)
        value = self.v_proj(hidden_states).view(*input_shape, -1, self.value_width).transpose(1, 2)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        return query, key, value

    def combine(self, attn_output, query, lam):
        """A kernel's output → the H differential heads ``(B, T, H, w)``, for ``query`` ``(B, T, 2H, w)`` as passed.

        Standard kernels return one output ``A_c·V`` per softmax map, ``(B, T, 2H, w)`` — or ``(B·T, 2H·w)`` where an
        engine flattens the tokens (vLLM's attention function) — and the pairs are combined here; eager returns the
        combined heads already."""
        attn_output = attn_output.reshape(*query.shape[:2], -1, query.shape[-1])
        if attn_output.shape[2] == query.shape[2]:
            lam_out = lam if lam.dim() == 0 else lam[..., None, None]  # V2's λ (B, T, H) against (B, T, H, 2, 1, w)
            attn_output = differential_combine(attn_output, lam_out, self.pair_stride, dim=2)
        return attn_output

    def uses_own_sdpa_kernel(self, query, attention_mask, kwargs) -> bool:
        """Whether this call runs a kernel of kernels_difftransformer.py instead of transformers' sdpa function:
        under ``"sdpa"`` only, and never with an additive float mask (a user's 4-D mask) or continuous batching (its
        kernel writes the cache). Subclasses narrow it further."""
        if self.config._attn_implementation != "sdpa" or kwargs.get("cache") is not None:
            return False
        return attention_mask is None or attention_mask.dtype == torch.bool

    @staticmethod
    def is_decode_step(query, *tensors) -> bool:
        """One new token per sequence and no autograd through the attention inputs."""
        return query.shape[1] == 1 and not (torch.is_grad_enabled() and any(x.requires_grad for x in (query, *tensors)))


# vLLM's Transformers backend gives each layer one call of its attention function, backed by an attention layer of
# num_attention_heads query heads over a KV cache of num_key_value_heads heads, all head_dim wide (query head i reads KV
# head i // (Hq / Hkv)). Each query head then yields A_c·V of its own KV head only, while V1 needs A_c·[V_g,0; V_g,1]:
# the cross terms would take a second call or 2·head_dim-wide cache heads, and V1's padded 2·head_dim queries would be
# read as twice the tokens (silently wrong). So V1 refuses to be built there.
VLLM_V1_ERROR = (
    "diff_version=1 cannot be served by vLLM (neither by difftransformer's native vLLM model nor by vLLM's "
    "Transformers backend): vLLM gives each layer one attention call over a "
    "KV cache of num_key_value_heads heads of width head_dim, and DIFF V1 multiplies each softmax map by the "
    "2*head_dim-wide value [V1; V2] of its group, which that call cannot compute (its output would be silently wrong). "
    "Serve a diff_version=2 model instead: upcycle the source Llama with `difftransformer-convert --from llama "
    "--diff-version 2 --input LLAMA --output V2_FOLDER` (exact), or run this V1 model with transformers (generate())."
)


class DiffTransformerV1Attention(DiffTransformerAttention):
    """DIFF V1 (paper §2.1): ``O_h = (softmax(Q1K1ᵀ/√d) − λ softmax(Q2K2ᵀ/√d))·[V1; V2]`` with one scalar λ per
    layer, then ``(1 − λinit)·RMSNorm_2d(O_h) ⊙ w``. Reference: microsoft/unilm ``Diff-Transformer/multihead_flashdiff_2.py``.

    Every kernel but V1's own receives one call with zero-padded queries ``[Q1 | 0]``, ``[0 | Q2]`` over the packed
    ``2d``-wide groups; under ``"sdpa"`` on CPU (and for decoding everywhere) :func:`differential_sdpa_attention` runs.
    """

    diff_version = 1

    def __init__(self, config: DiffTransformerConfig, layer_idx: int):
        if str(config._attn_implementation).startswith("vllm"):  # set by vLLM's Transformers backend before building
            raise ValueError(VLLM_V1_ERROR)
        super().__init__(config, layer_idx, value_width=2 * config.head_dim)
        d = self.head_dim
        self.pair_stride = self.num_key_value_groups // 2  # n: q_proj rows are ordered (g, c, r)
        self.lambda_init = config.lambda_init if config.lambda_init is not None else lambda_init_fn(layer_idx)
        self.lambda_q1 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
        self.lambda_k1 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
        self.lambda_q2 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
        self.lambda_k2 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
        self.subln = DiffTransformerHeadRMSNorm(2 * d, eps=config.subln_eps)

    def lambda_full(self) -> torch.Tensor:
        """``λ = exp(λq1·λk1) − exp(λq2·λk2) + λinit``, a float32 scalar for this layer (float64 under ``.double()``)."""
        dtype = torch.promote_types(self.lambda_q1.dtype, torch.float32)
        q1, k1, q2, k2 = (p.to(dtype) for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2))
        return torch.exp(torch.dot(q1, k1)) - torch.exp(torch.dot(q2, k2)) + self.lambda_init

    def uses_own_sdpa_kernel(self, query, attention_mask, kwargs) -> bool:
        """Off the CPU only decoding takes V1's kernel: there, prefill and training keep the padded call, which CUDA's
        flash / memory-efficient SDPA kernels run without writing any map (the blocked kernel is a CPU kernel,
        docs/performance.md)."""
        if not super().uses_own_sdpa_kernel(query, attention_mask, kwargs):
            return False
        return query.device.type in BLOCKED_KERNEL_DEVICES or self.is_decode_step(query)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        query, key, value = self.project(hidden_states, position_embeddings, past_key_values)  # key/value (B, G, S, 2d)
        lam = self.lambda_full()
        if isinstance(kwargs.get("cache"), PagedAttentionCache):
            kwargs["cache"] = PackedGroupsPagedCache(kwargs["cache"])  # continuous batching: the kernel writes the cache
        if self.uses_own_sdpa_kernel(query, attention_mask, kwargs):
            attn_output = differential_sdpa_attention(query, key, value, attention_mask, lam, self.scaling, self.pair_stride)
            attn_weights = None
        else:
            # [Q1 | 0] and [0 | Q2]: map c only sees half c of the packed key. Rows (g, c, r) → (g, c, r, c', d).
            pad = torch.eye(2, dtype=query.dtype, device=query.device).view(2, 1, 2, 1)
            padded = (query.unflatten(2, (-1, 2, self.pair_stride, 1)) * pad).reshape(*query.shape[:2], -1, 2 * self.head_dim)
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
            attn_output, attn_weights = attention_interface(
                self,
                padded.transpose(1, 2),
                key,
                value,
                attention_mask,
                dropout=0.0,
                scaling=self.scaling,
                diff_lambda=lam,
                **kwargs,
            )
            attn_output = self.combine(attn_output, padded, lam)
        attn_output = self.subln(attn_output, scale=1.0 - self.lambda_init)  # (1 − λinit)·RMSNorm_2d(O_h)⊙w
        attn_output = self.o_proj(attn_output.reshape(*hidden_states.shape[:-1], -1))
        return attn_output, attn_weights, lam


class DiffTransformerV2Attention(DiffTransformerAttention):
    """DIFF V2: standard attention over 2H query heads; adjacent heads ``2h, 2h+1`` share one KV head and combine as
    ``o_h = a_2h − sigmoid(x W_λᵀ)_h · a_2h+1`` (λ per token and head), no per-head norm. Reference: microsoft/unilm
    ``Diff-Transformer/Diff-Transformer-V2/``."""

    diff_version = 2
    pair_stride = 1  # q_proj rows are ordered (h, c)

    def __init__(self, config: DiffTransformerConfig, layer_idx: int):
        super().__init__(config, layer_idx, value_width=config.head_dim)
        self.lambda_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)

    def own_sdpa_kernel(self, query, key, value, attention_mask, lam, kwargs) -> torch.Tensor | None:
        """The combined heads ``(B, T, H, d)`` from one of V2's own kernels under ``"sdpa"``, or None where
        transformers' attention function runs: a decode step runs the 2n query heads of a KV head as the rows of one
        SDPA head (the cache is read once, :func:`pair_decode_attention`); a float32 prompt of 256+ tokens runs causal
        attention in query blocks, which skips most hidden scores (:func:`causal_block_attention`)."""
        if not self.uses_own_sdpa_kernel(query, attention_mask, kwargs):
            return None
        if self.is_decode_step(query, key, value, lam):
            return pair_decode_attention(query, key, value, lam, self.scaling, attention_mask)
        heads = query.transpose(1, 2)  # (B, 2H, T, d)
        if kwargs.get("is_causal") is not False and uses_causal_block_attention(heads, key, attention_mask):
            return self.combine(causal_block_attention(heads, key, value, self.scaling).transpose(1, 2), query, lam)
        return None

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        query, key, value = self.project(hidden_states, position_embeddings, past_key_values)  # key/value (B, G, S, d)
        lam = torch.sigmoid(self.lambda_proj(hidden_states))  # (B, T, H)
        attn_output, attn_weights = self.own_sdpa_kernel(query, key, value, attention_mask, lam, kwargs), None
        if attn_output is None:
            # The kernel is looked up and called here, once: vLLM's Transformers backend finds a layer's attention by
            # reading its forward's source for that lookup and call (and the scale from `scaling=self.scaling`).
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
            attn_output = self.combine(attn_output, query, lam)
        attn_output = self.o_proj(attn_output.reshape(*hidden_states.shape[:-1], -1))
        return attn_output, attn_weights, lam


DIFF_ATTENTION_CLASSES = {1: DiffTransformerV1Attention, 2: DiffTransformerV2Attention}


class DiffTransformerDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DiffTransformerConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = DIFF_ATTENTION_CLASSES[config.diff_version](config=config, layer_idx=layer_idx)
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


# V1's λ vectors and per-head norm, V2's λ projection: what only a differential checkpoint holds.
_DIFFERENTIAL_PARAM = re.compile(r"self_attn\.(lambda_[qk][12]|subln\.weight|lambda_proj\.weight)$")
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "gguf_file", "proxies")


def _source_model_type(path, kwargs) -> str | None:
    """``model_type`` of the config that ``from_pretrained(path, **kwargs)`` would read, or None where it cannot be
    read (transformers then raises its own error)."""
    try:
        config_dict, _ = PreTrainedConfig.get_config_dict(path, **{k: kwargs[k] for k in _HUB_KWARGS if k in kwargs})
    except (OSError, ValueError):
        return None
    return config_dict.get("model_type")


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
        if isinstance(module, DiffTransformerV1Attention):
            for param in (module.lambda_q1, module.lambda_k1, module.lambda_q2, module.lambda_k2):
                init.normal_(param, mean=0.0, std=self.config.lambda_std)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """As transformers': tensors the checkpoint lacks are initialised by ``_init_weights`` and named in the load
        report (``output_loading_info=True``). Only the one mistake that would silently change the function is
        refused, with a pointer to the converter: a checkpoint of another architecture.

        * The folder's ``config.json`` (or GGUF metadata) names another ``model_type``, e.g. a Llama folder loaded as
          a DiffTransformer: V1 has a Llama's shapes, so its weights would load into differently-wired heads.
        * The weights hold backbone tensors but none of the differential ones (V1's λ vectors and ``subln``, V2's
          ``lambda_proj``): a non-differential checkpoint beside a difftransformer ``config.json``.
        """
        path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if path is not None and not isinstance(kwargs.get("config"), PreTrainedConfig):
            found = _source_model_type(path, kwargs)
            if found not in (None, cls.config_class.model_type):
                raise ValueError(
                    f"{path} holds a {found!r} checkpoint, not a {cls.config_class.model_type!r} one. Convert it first, "
                    f"e.g. `difftransformer-convert --from llama --diff-version 2 --input {path} --output OUT` (exact for "
                    "Llama-family models; see docs/convert.md for every source format)."
                )
        output_loading_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        missing = set(info["missing_keys"])
        backbone = [k for k, _ in model.base_model.named_parameters()]
        prefix = "" if model.base_model is model else model.base_model_prefix + "."
        loaded = [k for k in backbone if prefix + k not in missing]
        differential = [k for k in backbone if _DIFFERENTIAL_PARAM.search(k)]
        if loaded and all(prefix + k in missing for k in differential):
            raise ValueError(
                f"The checkpoint of {path} has {len(loaded)} backbone tensors but none of the differential-attention ones "
                f"({', '.join(differential[:3])}, ...): it is not a difftransformer checkpoint (a plain Llama's?). "
                "Convert the source model with `difftransformer-convert` (docs/convert.md) instead of loading its "
                "weights into this class."
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
        # Only compute necessary logits (transformers >= 5.20 has this as `slice_logits_to_keep`)
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden_states = outputs.last_hidden_state[:, slice_indices, :]
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
