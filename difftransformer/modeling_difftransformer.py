"""PyTorch Differential Transformer: DIFF V1 (Ye et al., arXiv 2410.05258) and DIFF V2 (Ye, Dong, Sun, Wei, 2026).

Reference code: microsoft/unilm ``Diff-Transformer/multihead_flashdiff_2.py`` (V1) and
``Diff-Transformer-V2/`` (V2). Everything that is not differential attention is Llama's, imported from
transformers (RMSNorm, rotary embeddings with rope scaling, MLP, masks, caches, task heads).

Head layout of one layer (docs/model.md, "What it computes"), shown for V1 with H = 4 differential heads, G = 2 KV
groups (n = 2)::

    q_proj rows  (Hq = 2H = 8 heads of width d), group-major (g, c, r):
        | g0 c0 r0 | g0 c0 r1 | g0 c1 r0 | g0 c1 r1 | g1 c0 r0 | g1 c0 r1 | g1 c1 r0 | g1 c1 r1 |
    k_proj / v_proj rows (Hkv = 2G = 4 heads of width d), (g, c):
        |  K g0 c0  |  K g0 c1  |  K g1 c0  |  K g1 c1  |      (same for V)
    differential head h = g·n + r uses Q[g,c,r], K[g,c] for map c = 0, 1 and V = [V g0 | V g1] (2d wide).

With that order the standard GQA rule (query head i reads KV head i // n) already pairs every map with its
own key head, and the cache holds a Llama's tensors: ``(B, Hkv, S, d)``, exactly what transformers' caches (dynamic,
static, quantized, paged, and those built from the config) allocate. Each layer makes one attention call through this
file's ``ALL_ATTENTION_FUNCTIONS`` (an ``AttentionInterface`` of its own; section "Attention dispatch"), whose every
entry returns the heads the output projection reads. Under ``attn_implementation="sdpa"`` it runs the package's own
kernels on those tensors (kernels_difftransformer.py), chosen per device and workload (``DEFAULT_KERNELS`` there;
docs/model.md, "Kernels"): for V1 on CUDA two stock SDPA calls, one per softmax map, with the ``2d``-wide value
(``sdpa_two_calls_attention``); on CPU ``differential_sdpa_attention`` (``A1 − λ·A2`` per block of queries, and a
decode kernel for one token). The one-pass Triton kernel (difftransformer/kernels/triton/, loaded by name, never copied
into a saved folder) runs only where a user chooses it (``model.set_differential_kernel("triton")``).
Every other backend (eager, flex, flash, a user's AttentionInterface function) receives one standard call per layer
with equal q/k/v head sizes: K and V viewed per group as one ``2d``-wide head, ``[K1 | K2]`` and ``[V_g,0 | V_g,1]``
(a free view of the projections; a copy of a cache), and each query zero-padded to ``2d`` on the side of its own key
(``[Q1 | 0]``, ``[0 | Q2]``), so the call returns ``A_c·[V1;V2]`` for every map and the two maps of a head are
combined afterwards. That call does twice a Llama's attention arithmetic. The eager path materialises ``A1 − λ·A2``
whole and returns the differential maps.

V2 is standard GQA attention over all 2H query heads, adjacent query heads (2h, 2h+1) forming a pair over one
shared KV head; ``λ`` is computed per token and head by ``lambda_proj``.

Grouped differential attention (GDA, arXiv 2510.06949; ``num_noise_heads``) lets r signal maps share one noise map,
``O_h = (A_h − λ A_noise(h))·V``. The row order generalises the one above (r = 1 is exactly it), shown for V1 with
G = 2 groups, n = 4 signal heads and m = 1 noise head per group (r = 4)::

    q_proj rows, per KV group g: its n signal rows, then its m = n / r noise rows
        | g0 s0 | g0 s1 | g0 s2 | g0 s3 | g0 noise0 | g1 s0 | g1 s1 | g1 s2 | g1 s3 | g1 noise0 |
    signal head h = g·n + j subtracts noise row j // r of group g.

V2 orders the query heads of each noise map as ``[signal × r, noise]`` (r = 1: the adjacent pairs). Every kernel
handles r > 1; docs/model.md, "Grouped differential attention".

Deliberate deviations from Microsoft's reference code: rotate-half RoPE (transformers' convention) instead of
interleaved, group-major query rows (convert_scripts handle both), no attention dropout.
"""

import contextlib
import functools
import inspect
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
from transformers.dynamic_module_utils import custom_object_save
from transformers.generation import GenerationMixin
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import create_causal_mask, find_packed_sequence_indices
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import AttentionInterface, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)
from transformers.utils import can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .compat_difftransformer import (
    ATTENTION_FUNCTIONS_UPDATE_PAGED_CACHE,
    CACHE_NAME,
    MASK_CACHE_ARGUMENT,
    PackedGroupsPagedCache,
    accepts_old_cache_name,
    check_forward_arguments,
    mask_layer_index,
)
from .configuration_difftransformer import AUTO_MAP, DiffTransformerConfig  # noqa: F401 (AUTO_MAP: re-exported)
from .kernels_difftransformer import (
    ACCUMULATION_DTYPES,
    DEFAULT_KERNELS,
    FALLBACK_KERNEL,
    WORKLOADS,
    HeadRMSNorm,
    causal_block_attention,
    combine_maps,
    differential_decode_attention,
    differential_sdpa_attention,
    epilogue_runs,
    needs_grad,
    pack_value_groups,
    query_padding,
    rows_decode_attention,
    sdpa_decode_maps,
    sdpa_repeated_value_attention,
    sdpa_two_calls_attention,
    select_kernel,
    triton_kernels,
    triton_missing,
    uses_causal_block_attention,
)
from .motif_layers_difftransformer import MotifPolyNorm, MotifPolyNormMLP  # noqa: F401 (re-exported)

logger = logging.get_logger(__name__)

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch built without distributed support: nothing is ever sharded
    DTensor = Shard = None

try:  # transformers' registry of tensor-parallel plan styles (the `base_model_tp_plan` values)
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    from transformers.distributed.tensor_parallel import TensorParallelLayer
except ImportError:  # a transformers without the `transformers.distributed` package
    ALL_PARALLEL_STYLES = TensorParallelLayer = None

# The plan style of V1's replicated parameters that see only this rank's heads (configuration_difftransformer.py).
REPLICATED_GRAD_SUM_STYLE = "replicated_grad_sum"


class _SumGradientOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the incoming gradient over ``group``."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


if TensorParallelLayer is not None:

    class ReplicatedGradSumParallel(TensorParallelLayer):
        """Tensor-parallel style ``"replicated_grad_sum"``: a module's own parameters are replicated on every rank, but
        each rank's use of them covers only its heads (V1's λ vectors and per-head norm sit between a column-wise and a
        row-wise layer), so their gradient is summed over the tensor-parallel group.

        The sum happens in autograd, once per backward pass, on the gradient of this forward's use: while the forward
        runs with gradients enabled, the module sees each parameter through an identity whose backward all-reduces.
        (transformers' ``"replicated_with_grad_allreduce"`` all-reduces ``param.grad`` after accumulation instead, which
        sums the earlier micro-batches' already-summed gradients again under gradient accumulation.)"""

        def install_forward(self, module, mesh):
            original_forward = module.forward
            group = mesh.get_group()

            def tp_forward(*args, **kwargs):
                if not torch.is_grad_enabled():
                    return original_forward(*args, **kwargs)
                own = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
                module._parameters.update({n: _SumGradientOverGroup.apply(p, group) for n, p in own.items()})
                try:
                    return original_forward(*args, **kwargs)
                finally:
                    module._parameters.update(own)

            module.forward = tp_forward
            return module

    ALL_PARALLEL_STYLES.register(REPLICATED_GRAD_SUM_STYLE, ReplicatedGradSumParallel())


def lambda_init_fn(layer_idx: int) -> float:
    """λinit(l) = 0.8 − 0.6·exp(−0.3·l), 0-based layer index (paper §2.1; layer 0 → 0.2). The model passes
    ``l + lambda_init_layer_offset`` (Motif: −1)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def differential_combine(
    maps: torch.Tensor, lam: torch.Tensor, pair_stride: int, dim: int, noise_ratio: int = 1
) -> torch.Tensor:
    """The differential step of the paper, ``A1 − λ·A2``, for every differential head.

    ``maps`` holds one entry per softmax map along axis ``dim`` (2H entries: the maps themselves, shape
    ``(B, 2H, T, S)``, or their outputs ``A_c·V``, shape ``(B, T, 2H, w)``; the step is linear, so either works).
    The two maps of head ``h = g·n + r`` sit ``pair_stride`` entries apart inside a block of ``2·pair_stride``:
    V1 rows are ordered (g, c, r), so ``pair_stride = n``; V2 rows are (h, c), so ``pair_stride = 1``.
    ``lam`` must broadcast against one map entry (a scalar for V1; per token and head for V2).
    Returns the H differential entries in head order ``h = g·n + r`` along ``dim``.

    Grouped differential attention (``noise_ratio`` r > 1): each block holds ``pair_stride`` signal entries, then
    ``pair_stride / r`` noise entries; signal entry j of a block subtracts noise entry j // r (V1: a block is a KV
    group, ``pair_stride = n``; V2: a block is ``[signal × r, noise]``, ``pair_stride = r``). ``lam`` broadcasts against
    the ``pair_stride`` signal entries of a block, as the first map's entries above.
    """
    if noise_ratio == 1:
        first, second = maps.unflatten(dim, (-1, 2, pair_stride)).unbind(dim + 1)
        return torch.addcmul(first, lam, second, value=-1).flatten(dim, dim + 1)  # one kernel: first − λ·second
    blocks = maps.unflatten(dim, (-1, pair_stride + pair_stride // noise_ratio))
    first = blocks.narrow(dim + 1, 0, pair_stride)
    second = blocks.narrow(dim + 1, pair_stride, pair_stride // noise_ratio).repeat_interleave(noise_ratio, dim + 1)
    return torch.addcmul(first, lam, second, value=-1).flatten(dim, dim + 1)


def attention_logits(module: nn.Module, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """The logits ``Q_c K_cᵀ·s`` of every softmax map, ``(B, 2H, T, S)``, from the query ``(B, 2H, T, w)`` and key
    ``(B, G, S, w)`` that the module passes its kernels (query head ``i`` reads key head ``i // (2H/G)``)."""
    return torch.matmul(query, repeat_kv(key, module.num_key_value_groups).transpose(2, 3)) * scaling


def attention_from_logits(
    module: nn.Module,
    scores: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    diff_lambda: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention from its logits on: the additive mask, the softmax (in float32 at least, then ``dtype``, by
    default the logits'), and with ``diff_lambda`` the differential step and the product with the values. Returns what
    :func:`eager_attention_forward` returns."""
    dtype = dtype or scores.dtype
    if attention_mask is not None:
        scores = scores + attention_mask
    maps = F.softmax(scores, dim=-1, dtype=torch.promote_types(dtype, torch.float32)).to(dtype)  # (B, 2H, T, S)
    if diff_lambda is None:
        return torch.matmul(maps, repeat_kv(value, module.num_key_value_groups)).transpose(1, 2).contiguous(), maps
    r = getattr(module, "noise_ratio", 1)
    lam = (
        diff_lambda
        if diff_lambda.dim() == 0
        else diff_lambda.transpose(1, 2).unflatten(1, (-1, module.pair_stride))[..., None]
    )
    diff_maps = differential_combine(maps, lam, module.pair_stride, dim=1, noise_ratio=r)  # (B, H, T, S)
    values = repeat_kv(value, module.num_key_value_groups * r // (r + 1))  # (B, H, S, w): head h reads group h // n
    attn_output = torch.matmul(diff_maps, values).transpose(1, 2).contiguous()  # (B, T, H, w)
    return attn_output, diff_maps


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

    query ``(B, 2H, T, w)``, key/value ``(B, G, S, w)`` exactly as the module passes them to every kernel (V1: padded
    queries over packed groups, ``w = 2d``; V2: ``w = d``). With ``diff_lambda`` (what the module passes) this returns
    the *combined* output ``(B, T, H, w)`` together with the differential maps ``(B, H, T, S)`` it was computed from
    (what ``output_attentions`` shows: docs/model.md). Without it, it is plain eager attention: one output per softmax
    map, ``(B, T, 2H, w)``, and the softmax maps ``(B, 2H, T, S)`` (the layer's ``pair_outputs`` then pairs them).
    It is :func:`attention_logits` followed by :func:`attention_from_logits` (the low-bit analysis transforms the logits
    between the two: ``difftransformer.research.lowbit``).
    """
    scores = attention_logits(module, query, key, scaling)
    return attention_from_logits(module, scores, value, attention_mask, diff_lambda, dtype=query.dtype)


def packed_sequences(position_ids, attention_mask, batch_size: int) -> bool:
    """Whether the inputs are packed sequences, as transformers' masks detect them: position ids that restart within a
    row, and no attention mask (transformers' ``find_packed_sequence_indices``; not checked under ``torch.compile``)."""
    if (
        position_ids is None
        or attention_mask is not None
        or position_ids.shape[-1] < 2
        or torch.compiler.is_compiling()
    ):
        return False
    return find_packed_sequence_indices(position_ids.expand(batch_size, -1)) is not None


pack_groups = pack_value_groups  # V1's keys or values as one 2d-wide head per group, (B, 2G, S, d) → (B, G, S, 2d)


def triton_differential_attention(query, key, value, attention_mask, lam, scaling, pair_stride, noise_ratio=1):
    """V1's one-pass Triton kernel (difftransformer/kernels/triton/) with transformers' sdpa conventions: without a
    mask several queries are causal from the first key (a prompt, or a prefill into an empty static cache, where the
    keys past the prompt are never seen), while the kernel places the queries at the last positions of the keys."""
    t = query.shape[1]
    if attention_mask is None and 1 < t < key.shape[2]:
        key, value = key[:, :, :t], value[:, :, :t]
    return differential_attention_triton(query, key, value, lam, scaling, pair_stride, noise_ratio, attention_mask)


def differential_attention_triton(*args, **kwargs):
    """``difftransformer.kernels.triton.differential_attention_triton``, loaded where it is first called."""
    return triton_kernels().differential_attention_triton(*args, **kwargs)


def triton_installed() -> bool:
    return triton_kernels() is not None


def triton_runs_on(device) -> bool:
    """Whether V1's one-pass Triton kernel runs on ``device`` (CUDA, or any device under ``TRITON_INTERPRET=1``)."""
    kernels = triton_kernels()
    return kernels is not None and kernels.is_available(device)


def decode_kernel_attention(query, key, value, attention_mask, lam, scaling, pair_stride, noise_ratio=1):
    """V1's matmul decode kernel (:func:`differential_decode_attention`) with the other kernels' arguments."""
    return differential_decode_attention(query, key, value, lam, scaling, attention_mask, noise_ratio)


# ----------------------------------------------------------------------------------------------------------------
# Attention dispatch (docs/model.md, "Kernels")
# ----------------------------------------------------------------------------------------------------------------
#
# A layer makes one call, as Llama's does: `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`,
# where ALL_ATTENTION_FUNCTIONS is this file's own instance of transformers' AttentionInterface (below). Every entry
# takes the rotated queries (B, 2H, T, d) in q_proj row order, the cached keys and values (B, Hkv, S, d) and
# `diff_lambda` (V1: λ, a scalar; V2: λ's logits (B, T, H)), and returns (heads, maps, λ): the H heads the output
# projection reads, (B, T, H, w) (V1: after its per-head norm), the attention maps or None, and λ (V2: the sigmoid of
# the logits). "sdpa" is the package's choice of kernel per call (:func:`differential_sdpa_attention_forward`), "eager"
# materialises A1 − λ·A2 (:func:`eager_attention_forward`), and every other name is transformers' function of that
# name (flex, flash, paged, vLLM's, a user's), called once per layer as :func:`standard_attention_call` describes.

# Warned once where `output_attentions=True` meets a kernel of its own under "sdpa" (none returns attention maps), as
# transformers' sdpa function warns for its own call.
NO_MAPS_UNDER_SDPA = (
    "`output_attentions=True` under attn_implementation='sdpa': the differential attention kernels do not return "
    "attention maps, so `attentions` is empty. For the differential maps A1 - lambda*A2 (those the output is computed "
    'from), load the model with `attn_implementation="eager"` or call `model.set_attn_implementation("eager")`.'
)


def _computes_heads(function: Callable) -> bool:
    """Whether an attention function takes ``diff_lambda``: then it computes the differential heads itself."""
    try:
        return "diff_lambda" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a callable without a signature
        return False


def standard_attention_call(
    function: Callable,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    diff_lambda: torch.Tensor | None = None,
    cache: Cache | None = None,
    **kwargs,
):
    """One call of transformers' attention function ``function`` per layer, with equal q/k/v head sizes and the
    standard GQA rule: V1's keys and values viewed per group as one ``2d``-wide head (``[K1 | K2]``, ``[V_g,0 |
    V_g,1]``) and each query zero-padded to ``2d`` on the side of its own key (``[Q1 | 0]``, ``[0 | Q2]``); V2's 2H
    query heads as they are. A function with a ``diff_lambda`` parameter (this file's eager function, a user's
    differential function) gets λ and returns the H combined heads itself; any other returns one output per softmax
    map, ``(B, T, 2H, w)`` (or ``(B·T, 2H·w)``, as vLLM's function does), and the pairs are combined here."""
    lam = module.lambda_of(diff_lambda)
    batch, tokens, dtype = query.shape[0], query.shape[2], query.dtype
    if ATTENTION_FUNCTIONS_UPDATE_PAGED_CACHE and isinstance(cache, PagedAttentionCache):
        kwargs = {**kwargs, "cache": cache}  # up to 5.23 the attention function updates the paged cache
    if module.diff_version == 1:
        if isinstance(cache, PagedAttentionCache) and kwargs.get("block_table") is not None:
            raise NotImplementedError(
                "diff_version=1 with a block-table paged cache (flash paged attention) is not supported: that "
                "kernel reads keys of width head_dim, V1's padded call attends over 2*head_dim-wide groups. Use "
                "attn_implementation='sdpa' or 'eager' for continuous batching, or a diff_version=2 model."
            )
        query, key, value = module.single_call_inputs(query, key, value)
    if _computes_heads(function):
        kwargs["diff_lambda"] = lam
    attn_output, attn_weights = function(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    attn_output = attn_output.reshape(batch, tokens, -1, query.shape[-1])
    if "diff_lambda" not in kwargs:  # one output per softmax map: pair them
        attn_output = module.pair_outputs(attn_output, lam)
    module._ran(FALLBACK_KERNEL[module.diff_version])
    return module.normalize_heads(attn_output, dtype), attn_weights, lam


def _v1_kernel(kernel: Callable) -> Callable:
    """A kernel of kernels_difftransformer.py (query ``(B, T, 2H, d)`` as projected → combined heads) as an entry."""

    def entry(module, query, key, value, attention_mask, scaling, dropout=0.0, diff_lambda=None, cache=None, **kwargs):
        query = query.transpose(1, 2)  # (B, T, 2H, d), as projected: a view
        heads = kernel(query, key, value, attention_mask, diff_lambda, scaling, module.pair_stride, module.noise_ratio)
        return module.normalize_heads(heads, query.dtype), None, diff_lambda

    entry.__name__ = entry.__qualname__ = f"{kernel.__name__}_entry"
    return entry


def _v1_sdpa_two_calls(module, query, key, value, attention_mask, scaling, dropout=0.0, diff_lambda=None, **kwargs):
    """V1's two stock SDPA calls; one token without autograd: the two calls, then the combine, the per-head norm and
    the cast in one epilogue (``DiffTransformerHeadRMSNorm.combined``)."""
    query = query.transpose(1, 2)
    if query.shape[1] == 1 and not needs_grad(query, key, value, diff_lambda):
        maps = sdpa_decode_maps(query, key, value, attention_mask, scaling, module.pair_stride, module.noise_ratio)
        heads = module.subln.combined(
            *maps, diff_lambda, scale=1.0 - module.lambda_init, dtype=query.dtype, as_device=module.kernel_device
        )
        return heads, None, diff_lambda
    heads = sdpa_two_calls_attention(
        query, key, value, attention_mask, diff_lambda, scaling, module.pair_stride, module.noise_ratio
    )
    return module.normalize_heads(heads, query.dtype), None, diff_lambda


def _v2_rows_decode(module, query, key, value, attention_mask, scaling, dropout=0.0, diff_lambda=None, **kwargs):
    """V2's decode step: the 2n query heads of a KV head as the rows of one SDPA head, then the sigmoid and the
    combine (one Triton epilogue on CUDA)."""
    heads, lam = rows_decode_attention(
        query.transpose(1, 2),
        key,
        value,
        diff_lambda,
        scaling,
        attention_mask,
        module.noise_ratio,
        module.kernel_device,
    )
    return heads, None, lam


def _v2_causal_blocks(module, query, key, value, attention_mask, scaling, dropout=0.0, diff_lambda=None, **kwargs):
    """V2's float32 CPU prompts of 256+ tokens: causal blocks that skip hidden scores, then the pairs combine."""
    lam = module.lambda_of(diff_lambda)
    heads = causal_block_attention(query, key, value, scaling)  # (B, 2H, T, d)
    return module.pair_outputs(heads.transpose(1, 2), lam), None, lam


# The kernels a layer can run under attn_implementation="sdpa", by version (name → entry), and what each costs in
# attention arithmetic against a Llama with the same query heads. Every other attn_implementation, a paged cache and an
# additive float mask take the standard call (FALLBACK_KERNEL); DEFAULT_KERNELS (kernels_difftransformer.py) says
# which runs by default where.
V1_KERNELS: dict[str, Callable] = {
    "sdpa_two_calls": _v1_sdpa_two_calls,  # two stock SDPA calls, one per map, the 2d-wide value: 1.5x arithmetic
    "sdpa_repeated_value": _v1_kernel(sdpa_repeated_value_attention),  # one SDPA call, value repeated per key head
    "triton": _v1_kernel(triton_differential_attention),  # the one-pass Triton kernel: 1.5x
    "blocked": _v1_kernel(differential_sdpa_attention),  # CPU: A1 − λA2 per block of queries, 1x; one token: decode
    "decode_kernel": _v1_kernel(decode_kernel_attention),  # one token without autograd: maps combined, then V once
    "padded": functools.partial(standard_attention_call, sdpa_attention_forward),  # zero-padded queries: 2x
}
V2_KERNELS: dict[str, Callable] = {
    "standard": functools.partial(standard_attention_call, sdpa_attention_forward),  # the 2H query heads
    "rows_decode": _v2_rows_decode,  # one token: the 2n heads of a KV head as the rows of one SDPA head
    "causal_blocks": _v2_causal_blocks,  # CPU float32 prompts of 256+ tokens: causal blocks skip hidden scores
}
KERNELS = {1: V1_KERNELS, 2: V2_KERNELS}
# Kernels that serve only some calls; the others take the default choice.
_DECODE_ONLY = ("decode_kernel", "rows_decode")


def differential_sdpa_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The "sdpa" entry: the kernel :meth:`DiffTransformerAttention.kernel_for` picks for this call (the layer's
    ``kernel`` where ``model.set_differential_kernel`` set one, else :func:`select_kernel`'s default), run."""
    name = module.kernel_for(query.transpose(1, 2), key, value, attention_mask, kwargs)
    return KERNELS[module.diff_version][name](
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )


class DifferentialAttentionInterface(AttentionInterface):
    """transformers' attention functions as the differential layers call them (the contract above): "sdpa" and
    "eager" are this file's, any other name is transformers' function of that name through
    :func:`standard_attention_call`, so that every entry returns the same thing."""

    def __getitem__(self, key):
        if key in self._local_mapping:
            return self._local_mapping[key]
        return functools.partial(standard_attention_call, self._global_mapping[key])

    def get_interface(self, attn_implementation: str, default: Callable) -> Callable:
        """As transformers' (its checks and warnings included); the ``default`` it falls back to (an attention module
        used without a model, ``_attn_implementation`` None) is called as :func:`standard_attention_call` calls it."""
        function = super().get_interface(attn_implementation, default)
        return functools.partial(standard_attention_call, default) if function is default else function


ALL_ATTENTION_FUNCTIONS = DifferentialAttentionInterface()
ALL_ATTENTION_FUNCTIONS["sdpa"] = differential_sdpa_attention_forward
ALL_ATTENTION_FUNCTIONS["eager"] = functools.partial(standard_attention_call, eager_attention_forward)


def check_kernel_name(diff_version: int, name: str, noise_ratio: int = 1) -> None:
    """Raise a ValueError naming the allowed values where ``name`` is not a kernel of ``diff_version`` (or "auto"), or
    cannot run this model (the repeated-value call with grouped noise heads; Triton without triton installed)."""
    allowed = ("auto", *KERNELS[diff_version])
    if name not in allowed:
        raise ValueError(
            f"differential kernel {name!r} is not one of diff_version={diff_version}'s: {', '.join(allowed)}"
        )
    if name == "sdpa_repeated_value" and noise_ratio != 1:
        raise ValueError(
            f"differential kernel 'sdpa_repeated_value' needs one noise map per signal map (noise_ratio 1, this model "
            f"has {noise_ratio}); allowed here: {', '.join(n for n in allowed if n != name)}"
        )
    if name == "triton" and not triton_installed():
        raise ValueError(f"differential kernel 'triton' needs a CUDA device and its Triton kernels: {triton_missing()}")


def computed_from_parameters(owner: nn.Module, slot: str, params, compute: Callable[[], torch.Tensor], extra=None):
    """``compute()``, a tensor derived from ``params`` alone (V1's λ, the per-head norm's scaled weight). Inside
    :meth:`DiffTransformerPreTrainedModel.fixed_parameters` (every ``generate()`` call), where no parameter may change,
    it is computed once and kept on ``owner``, so that a decode step launches nothing for it; the kept entry is
    dropped when the block is left. Elsewhere (training, a plain forward) it is computed at every call: fused
    optimisers write parameters without moving their version counters, so no cheap test shows that a kept value is
    stale. Also computed every call where autograd records it, under ``torch.compile`` (one fused kernel there) and
    for parameters that are not plain tensors (DTensor, quantized). Within the block a kept entry is still checked
    against its parameters' storages, versions, dtypes and devices."""
    if (
        not owner.__dict__.get("_fixed_parameters", 0)
        or needs_grad(*params)
        or torch.compiler.is_compiling()
        or any(type(p.data) is not torch.Tensor for p in params)
    ):
        return compute()
    key = (extra, *((p.data_ptr(), p._version, p.dtype, p.device) for p in params))
    kept = owner.__dict__.get(slot)
    if kept is not None and kept[0] == key:
        return kept[2]
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, never an inference tensor
        value = compute()
    owner.__dict__[slot] = (key, [p.untyped_storage() for p in params], value)
    return value


class DiffTransformerHeadRMSNorm(nn.Module):
    """V1's per-head norm, ``scale · RMSNorm_2d(O_h) ⊙ w`` (paper §2.1, "GroupNorm" = RMSNorm per head in the
    reference code). ``scale`` is ``1 − λinit``. Computed in float32, or in the input's dtype where that is wider
    (float64 stays float64); under autograd through :class:`HeadRMSNorm`, which keeps the input in its own dtype for
    the backward. A module (not a bare weight read) so that hooks such as accelerate's offloading see it run."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, heads: torch.Tensor, scale: float, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``heads`` ``(..., 2d)``; the result in ``dtype`` (default: the heads' own; a kernel may hand over float32
        heads of a bfloat16 model). Without autograd: one ``rms_norm`` on float32 rows with the weight times ``scale``
        kept within ``generate()`` (:func:`computed_from_parameters`), plus the casts a narrower dtype needs."""
        dtype = dtype or heads.dtype
        if needs_grad(heads, self.weight):
            return HeadRMSNorm.apply(heads.to(dtype), self.weight, scale, self.eps)
        acc = ACCUMULATION_DTYPES.get(heads.dtype, heads.dtype)
        return F.rms_norm(heads.to(acc), (heads.shape[-1],), self.scaled_weight(scale, acc), self.eps).to(dtype)

    def scaled_weight(self, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """``scale · w`` in ``dtype``, kept within ``generate()`` (:func:`computed_from_parameters`)."""
        return computed_from_parameters(
            self, "_scaled_weight", (self.weight,), lambda: self.weight.to(dtype) * scale, extra=(scale, dtype)
        )

    def combined(self, first, second, lam, scale: float, dtype: torch.dtype, as_device: str | None = None):
        """The decode step's epilogue, ``scale · RMSNorm(O1 − λ·O2) ⊙ w`` for one token, from the two maps' outputs
        ``(B, G, n, 2d)`` and ``(B, G, m, 2d)`` (:func:`sdpa_decode_maps`), in float32, written in ``dtype`` as
        ``(B, 1, H, 2d)``: one Triton kernel where it runs (difftransformer/kernels/triton/epilogue.py), else one
        combine into float32 rows, one ``rms_norm`` and a cast (``as_device``: whose kernel choice runs)."""
        b, g, n, width = first.shape
        acc = ACCUMULATION_DTYPES.get(first.dtype, first.dtype)
        weight = self.scaled_weight(scale, acc)
        if epilogue_runs(first.device, as_device):
            return (
                triton_kernels().v1_combine_norm(first, second, lam, weight, self.eps, dtype).view(b, 1, g * n, width)
            )
        heads = combine_maps(first, second, lam, out=torch.empty(b, g, n, width, dtype=acc, device=first.device))
        return F.rms_norm(heads, (width,), weight, self.eps).to(dtype).view(b, 1, g * n, width)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class DiffTransformerLambdaProjection(nn.Module):
    """V2's λ gate before its sigmoid, ``x ↦ x W_λᵀ`` (``W_λ``: ``(H, E)``, no bias), saved as ``lambda_proj.weight``.

    Deliberately not an ``nn.Linear``: transformers' quantizers (bitsandbytes, torchao, optimum-quanto) convert
    ``nn.Linear`` layers, and the gate that weighs one softmax map against the other must keep its exact weights and
    dtype when the projections around it are quantized (docs/ecosystem.md). It costs what the linear layer cost."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = (
            in_features,
            out_features,
        )  # as nn.Linear's (tensor parallelism reads them)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}"


class DiffTransformerAttention(nn.Module):
    """What V1 and V2 share: the q/k/v/o projections, rotary embeddings, the KV cache, the choice of V1's/V2's own sdpa
    kernels and the combination of a standard kernel's per-map outputs. The subclasses add λ and call the kernel in
    their own ``forward`` (where transformers and vLLM look for that call).

    ``value_width`` is the width of one differential head's output: ``2d`` for V1 (its value ``[V1; V2]``), ``d`` for
    V2. Keys and values are cached as a Llama's, ``(B, Hkv, S, d)``; V1's standard kernels see them as packed groups
    ``[K1 | K2]``, ``[V_g,0 | V_g,1]`` (module docstring).
    """

    diff_version: int
    pair_stride: int  # distance between the two maps of a head in the kernel's query-head order (differential_combine)
    noise_ratio: int  # r: signal maps per noise map (1 unless grouped differential attention)

    def __init__(self, config: DiffTransformerConfig, layer_idx: int, value_width: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.value_width = value_width
        self.num_heads = config.num_diff_heads  # H, differential heads
        self.noise_ratio = config.noise_ratio
        # Query heads (one per softmax map) per KV head *as passed to the kernel*: 2n for both versions (n + n / r with
        # grouped differential attention).
        self.num_key_value_groups = config.num_attention_heads // config.num_kv_groups
        self.scaling = self.head_dim**-0.5  # 1/sqrt(d), not 1/sqrt(2d): each map is a d-wide dot product
        self.is_causal = True
        self.attention_dropout = 0.0

        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * value_width, hidden, bias=bias)

    def project(self, hidden_states, position_embeddings, cache, kwargs):
        """→ rotated queries ``(B, T, 2H, d)`` in q_proj row order, and the cached keys and values ``(B, Hkv, S, d)``
        (this step's, appended to ``cache``).

        A paged cache (continuous batching) is updated here from transformers 5.24 on, with the paged-attention
        ``kwargs`` it fills in place; before, the attention function updates it (:meth:`attention_kwargs`)."""
        input_shape = hidden_states.shape[:-1]
        query = self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim)  # (B, T, 2H, d)
        key = self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim)  # (B, T, Hkv, d)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=2)
        key = key.transpose(1, 2)  # (B, Hkv, T, d)
        value = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        if cache is not None and not (
            ATTENTION_FUNCTIONS_UPDATE_PAGED_CACHE and isinstance(cache, PagedAttentionCache)
        ):
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        return query, key, value

    @staticmethod
    def attention_kwargs(cache, kwargs) -> dict:
        """The kwargs for transformers' attention function: up to 5.23 a paged cache goes with them (the function
        updates it, as Llama's attention does on those releases)."""
        if ATTENTION_FUNCTIONS_UPDATE_PAGED_CACHE and isinstance(cache, PagedAttentionCache):
            return {**kwargs, "cache": cache}
        return kwargs

    def pair_outputs(self, attn_output: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        """One output per softmax map ``(B, T, 2H, w)`` → the H differential heads ``(B, T, H, w)``, ``A1·V − λ·A2·V``
        (:func:`differential_combine`; V2's λ ``(B, T, H)`` against the signal outputs of each block)."""
        lam = lam if lam.dim() == 0 else lam.unflatten(-1, (-1, self.pair_stride))[..., None]
        return differential_combine(attn_output, lam, self.pair_stride, dim=2, noise_ratio=self.noise_ratio)

    def lambda_of(self, diff_lambda: torch.Tensor) -> torch.Tensor:
        """λ from what the layer passes its attention function as ``diff_lambda``: V1's λ itself."""
        return diff_lambda

    def normalize_heads(self, heads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The combined heads as the output projection reads them (V2: as they are)."""
        return heads

    # The kernel this layer runs: "auto" (select_kernel's choice per call) or a name of KERNELS[diff_version] that the
    # user chose (model.set_differential_kernel); last_kernel: the kernel of the last call outside torch.compile.
    kernel: str = "auto"
    last_kernel: str | None = None
    # Whose default choice this layer takes: None (its tensors' device type) or a device type of DEFAULT_KERNELS
    # (model.set_differential_kernel(device_type=...)).
    kernel_device: str | None = None

    def kernel_for(self, query, key, value, attention_mask, kwargs) -> str:
        """The kernel of this call under ``"sdpa"``, a name of ``KERNELS[diff_version]`` (docs/model.md, "Kernels"):
        the one function that decides, for both versions. ``query`` ``(B, T, 2H, d)`` as projected; ``kwargs`` holds
        the call's ``diff_lambda`` and ``cache``.

        Transformers' attention function (``FALLBACK_KERNEL``) runs with an additive float mask (a user's 4-D mask)
        and with continuous batching (its paged cache). Otherwise the layer's ``kernel`` (set by
        ``model.set_differential_kernel``), else :func:`select_kernel`'s choice for the workload: decode (one token,
        no autograd), train (autograd) or prefill. A kernel that serves only some calls (the decode kernels; V2's
        causal blocks: float32 CPU prompts of 256+ tokens without a mask) leaves the others to the default choice."""
        version = self.diff_version
        if isinstance(kwargs.get("cache"), PagedAttentionCache) or (
            attention_mask is not None and attention_mask.dtype != torch.bool
        ):
            return self._ran(FALLBACK_KERNEL[version])
        grad = needs_grad(query, key, value, kwargs.get("diff_lambda"))
        workload = "train" if grad else "decode" if query.shape[1] == 1 else "prefill"
        default = select_kernel(version, self.kernel_device or query.device.type, workload, query.dtype)
        name = default if self.kernel == "auto" else self.kernel
        if not self._serves(name, workload, query, key, attention_mask, kwargs):
            name = (
                default
                if self._serves(default, workload, query, key, attention_mask, kwargs)
                else FALLBACK_KERNEL[version]
            )
        if name == "triton" and not triton_runs_on(query.device):
            raise ValueError(
                f"differential kernel 'triton' cannot run on {query.device} (it needs CUDA and the triton package, or "
                "TRITON_INTERPRET=1): call model.set_differential_kernel('auto') or another kernel."
            )
        if kwargs.get("output_attentions") and name != FALLBACK_KERNEL[version]:
            # transformers' sdpa function warns where it is called (the fallback); the own kernels do not call it
            logger.warning_once(NO_MAPS_UNDER_SDPA)
        return self._ran(name)

    def _serves(self, name, workload, query, key, attention_mask, kwargs) -> bool:
        if name in _DECODE_ONLY:
            return workload == "decode"
        if name == "causal_blocks":
            return kwargs.get("is_causal") is not False and uses_causal_block_attention(
                query.transpose(1, 2), key, attention_mask
            )
        return True

    def _ran(self, name: str) -> str:
        if not torch.compiler.is_compiling():
            self.last_kernel = name
        return name


# vLLM's Transformers backend gives each layer one call of its attention function, backed by an attention layer that
# the backend builds from the config: num_attention_heads query heads over a KV cache of num_key_value_heads heads, all
# head_dim wide. V1's single call needs num_key_value_heads / 2 cache heads of width 2·head_dim (the same bytes) and
# 2·head_dim-wide padded queries, which that layer would read as twice the tokens (silently wrong). The package's
# native vLLM model (difftransformer/vllm_model.py) builds that layer; so V1 refuses to be built on the backend.
VLLM_V1_ERROR = (
    "diff_version=1 is served by difftransformer's native vLLM model, not by vLLM's Transformers backend "
    '(model_impl="transformers"): the backend\'s attention layer has num_key_value_heads cache heads of width '
    "head_dim, and DIFF V1's single attention call needs num_key_value_heads/2 heads of width 2*head_dim (the same "
    "cache bytes), so its output would be silently wrong. Install difftransformer in vLLM's environment (its vLLM "
    "plugin registers the native model) and load the folder with vLLM's default model_impl: `vllm serve FOLDER` or "
    "`LLM(model=FOLDER)`."
)


class DiffTransformerV1Attention(DiffTransformerAttention):
    """DIFF V1 (paper §2.1): ``O_h = (softmax(Q1K1ᵀ/√d) − λ softmax(Q2K2ᵀ/√d))·[V1; V2]`` with one scalar λ per
    layer, then ``(1 − λinit)·RMSNorm_2d(O_h) ⊙ w``. Reference: microsoft/unilm
    ``Diff-Transformer/multihead_flashdiff_2.py``.

    Under ``"sdpa"`` V1 runs its own kernels (``V1_KERNELS``, chosen by :meth:`kernel_for`); every other backend
    receives one call with zero-padded queries ``[Q1 | 0]``, ``[0 | Q2]`` over the packed ``2d``-wide groups.
    """

    diff_version = 1

    def __init__(self, config: DiffTransformerConfig, layer_idx: int):
        if str(config._attn_implementation).startswith("vllm"):  # set by vLLM's Transformers backend before building
            raise ValueError(VLLM_V1_ERROR)
        super().__init__(config, layer_idx, value_width=2 * config.head_dim)
        d = self.head_dim
        self.pair_stride = self.num_heads // config.num_kv_groups  # n: q_proj rows are ordered (g, c, r)
        if config.lambda_init is not None:
            self.lambda_init = config.lambda_init
        else:
            self.lambda_init = lambda_init_fn(layer_idx + config.lambda_init_layer_offset)
        self.lambda_q1 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
        self.lambda_k1 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
        self.lambda_q2 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
        self.lambda_k2 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
        self.subln = DiffTransformerHeadRMSNorm(2 * d, eps=config.subln_eps)

    def lambda_full(self) -> torch.Tensor:
        """``λ = exp(λq1·λk1) − exp(λq2·λk2) + λinit``, a float32 scalar for this layer (float64 under ``.double()``).
        Computed once per ``generate()`` call (:func:`computed_from_parameters`): a decode step launches nothing for
        it."""
        params = (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2)
        return computed_from_parameters(self, "_lambda", params, lambda: self._lambda_from(*params))

    def _lambda_from(self, *params) -> torch.Tensor:
        dtype = torch.promote_types(params[0].dtype, torch.float32)
        q1, k1, q2, k2 = (p.to(dtype) for p in params)
        return torch.exp(torch.dot(q1, k1)) - torch.exp(torch.dot(q2, k2)) + self.lambda_init

    def normalize_heads(self, heads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``(1 − λinit)·RMSNorm_2d(O_h) ⊙ w``, in ``dtype``."""
        return self.subln(heads, scale=1.0 - self.lambda_init, dtype=dtype)

    def single_call_inputs(self, query, key, value):
        """What one standard attention call gets: the queries zero-padded, ``[Q1 | 0]`` and ``[0 | Q2]``
        ``(B, 2H, T, 2d)`` (map c sees only half c of the packed key), over the packed groups ``(B, G, S, 2d)``."""
        # Rows (g, j) → (g, j, c', d), a group's n signal rows first (c' = 0 carries them), then its noise rows.
        pad = query_padding(self.pair_stride, self.num_key_value_groups - self.pair_stride, query.dtype, query.device)
        query = query.transpose(1, 2)  # (B, T, 2H, d)
        padded = (query.unflatten(2, (-1, self.num_key_value_groups, 1)) * pad).reshape(
            *query.shape[:2], -1, 2 * self.head_dim
        )
        return padded.transpose(1, 2), pack_groups(key), pack_groups(value)

    @accepts_old_cache_name
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        if ATTENTION_FUNCTIONS_UPDATE_PAGED_CACHE and isinstance(cache, PagedAttentionCache):
            cache = PackedGroupsPagedCache(cache)  # up to 5.23 the attention function writes it: as packed groups
        query, key, value = self.project(hidden_states, position_embeddings, cache, kwargs)  # key/value (B, Hkv, S, d)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights, lam = attention_interface(
            self,
            query.transpose(1, 2),
            key,
            value,
            attention_mask,
            dropout=0.0,
            scaling=self.scaling,
            diff_lambda=self.lambda_full(),
            cache=cache,
            **kwargs,
        )  # (B, T, H, 2d), normalised per head
        attn_output = self.o_proj(attn_output.reshape(*hidden_states.shape[:-1], -1))
        return attn_output, attn_weights, lam


class DiffTransformerV2Attention(DiffTransformerAttention):
    """DIFF V2: standard attention over 2H query heads; adjacent heads ``2h, 2h+1`` share one KV head and combine as
    ``o_h = a_2h − sigmoid(x W_λᵀ)_h · a_2h+1`` (λ per token and head), no per-head norm. Reference: microsoft/unilm
    ``Diff-Transformer/Diff-Transformer-V2/``."""

    diff_version = 2

    def __init__(self, config: DiffTransformerConfig, layer_idx: int):
        super().__init__(config, layer_idx, value_width=config.head_dim)
        self.pair_stride = self.noise_ratio  # q_proj rows are ordered (h, c); blocks [signal × r, noise] when grouped
        self.lambda_proj = DiffTransformerLambdaProjection(config.hidden_size, self.num_heads)

    def lambda_of(self, diff_lambda: torch.Tensor) -> torch.Tensor:
        """λ from its logits, which the layer passes as ``diff_lambda``: ``sigmoid(x W_λᵀ)``."""
        return torch.sigmoid(diff_lambda)

    @accepts_old_cache_name
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        query, key, value = self.project(hidden_states, position_embeddings, cache, kwargs)  # key/value (B, G, S, d)
        # The kernel is looked up and called here, once: vLLM's Transformers backend finds a layer's attention by
        # reading its forward's source for that lookup and call (and the scale from `scaling=self.scaling`).
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights, lam = attention_interface(
            self,
            query.transpose(1, 2),
            key,
            value,
            attention_mask,
            dropout=0.0,
            scaling=self.scaling,
            diff_lambda=self.lambda_proj(hidden_states),  # (B, T, H): λ = sigmoid of these logits
            cache=cache,
            **kwargs,
        )  # (B, T, H, d)
        attn_output = self.o_proj(attn_output.reshape(*hidden_states.shape[:-1], -1))
        return attn_output, attn_weights, lam


DIFF_ATTENTION_CLASSES = {1: DiffTransformerV1Attention, 2: DiffTransformerV2Attention}


class DiffTransformerDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DiffTransformerConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = DIFF_ATTENTION_CLASSES[config.diff_version](config=config, layer_idx=layer_idx)
        if config.hidden_act == "poly_norm":  # Motif's checkpoints: an activation with weights of its own
            self.mlp = MotifPolyNormMLP(config)
        else:
            self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @accepts_old_cache_name
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
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
            cache=cache,
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


# V1's λ vectors: float32 in a float16/bfloat16 load (λ is computed in float32), declared as transformers'
# `_keep_in_fp32_modules_strict` by a V1 base model; transformers' FSDP2 then gives the module holding them (each
# attention module) a shard group of its own, since a group holds one dtype.
V1_FLOAT32_PARAMETERS = ("self_attn.lambda_q1", "self_attn.lambda_k1", "self_attn.lambda_q2", "self_attn.lambda_k2")

# V1's λ vectors and per-head norm, V2's λ projection: what only a differential checkpoint holds.
_DIFFERENTIAL_PARAM = re.compile(r"self_attn\.(lambda_[qk][12]|subln\.weight|lambda_proj\.weight)$")


class DiffTransformerPreTrainedModel(PreTrainedModel):
    config: DiffTransformerConfig
    config_class = DiffTransformerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DiffTransformerDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _supports_flex_attn = True
    # Every kernel call has equal q/k/v head sizes and the standard GQA mapping
    # (tests/models/test_modeling_difftransformer.py checks that contract through a custom AttentionInterface function).
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
        elif isinstance(module, DiffTransformerLambdaProjection):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif hasattr(module, "init_own_weights"):  # modules whose init transformers does not know (Motif's PolyNorm)
            module.init_own_weights()

    # Loading a checkpoint of another architecture is refused by the config's one read of it
    # (DiffTransformerConfig.get_config_dict); the two checks below run inside transformers' loading, before any weight
    # is read (tensor parallelism) and once the weights are (a checkpoint without differential tensors).

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """Before transformers shards the new model and loads weights into the shards: a tensor-parallel size must
        divide the KV groups (a shard holds whole groups, since both maps of a differential head read one group)."""
        tp_size = getattr(distributed_config, "tp_size", None) or 1
        groups = model.config.num_kv_groups
        if mesh_manager is not None and groups % tp_size:
            raise ValueError(
                f"tp_size={tp_size} must divide the number of KV groups ({groups} = "
                f"num_key_value_heads{' / 2' if model.config.diff_version == 1 else ''}): a tensor-parallel shard "
                "holds whole groups, since both maps of a differential head read the same group."
            )
        if mesh_manager is not None and tp_size > 1 and model.config.diff_version == 1 and ALL_PARALLEL_STYLES is None:
            logger.warning_once(
                "This transformers has no `transformers.distributed` package, where difftransformer registers the "
                f"'{REPLICATED_GRAD_SUM_STYLE}' tensor-parallel style: V1's λ vectors and per-head norm stay "
                "replicated without a summed gradient, so tensor-parallel training would update them from this rank's "
                "heads only. Inference is unaffected; for training use transformers >= 5.24."
            )
        return super().maybe_distribute_model(model, distributed_config, mesh_manager)

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        """As transformers' (its loading calls it with the load report), then: a checkpoint whose weights hold backbone
        tensors but none of the differential ones (V1's λ vectors and ``subln``, V2's ``lambda_proj``) is a
        non-differential checkpoint beside a difftransformer ``config.json``, and is refused. Tensors it merely lacks
        are initialised by ``_init_weights`` and named in the report, as transformers does."""
        super()._adjust_missing_and_unexpected_keys(loading_info)
        missing = set(loading_info.missing_keys)
        prefix = "" if self.base_model is self else self.base_model_prefix + "."
        backbone = [prefix + k for k, _ in self.base_model.named_parameters()]
        differential = [k for k in backbone if _DIFFERENTIAL_PARAM.search(k)]
        loaded = [k for k in backbone if k not in missing]
        if loaded and differential and all(k in missing for k in differential):
            raise ValueError(
                f"The checkpoint has {len(loaded)} backbone tensors but none of the differential-attention ones "
                f"({', '.join(differential[:3])}, ...): it is not a difftransformer checkpoint (a plain Llama's?). "
                "Convert the source model with `difftransformer-convert` (docs/convert.md) instead of loading its "
                "weights into this class."
            )

    # Set on classes made outside this file (below): the class of this file whose code their folders carry.
    _remote_code_class = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__module__ != __name__ and "_auto_class" not in vars(cls):
            # A class made elsewhere that did not choose its remote code (FSDP2's `fully_shard` makes
            # FSDPDiffTransformerForCausalLM in a torch module; a user's subclass): transformers would copy *its*
            # module into saved folders. It saves the code of the class of this file it derives from instead.
            cls._auto_class = None
            cls._remote_code_class = next(c for c in cls.__mro__ if c.__module__ == __name__)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """As transformers'; for classes made elsewhere (``_remote_code_class``) the folder also gets the code of this
        file, which transformers copies only for the class being saved. (The folder's ``auto_map`` names every Auto
        class: the config writes it, ``DiffTransformerConfig.to_dict``.)"""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        code_class = self._remote_code_class
        if code_class is not None and code_class._auto_class is not None and kwargs.get("is_main_process", True):
            custom_object_save(SimpleNamespace(__module__=__name__), save_directory)  # this file and its imports
        return result

    def set_differential_kernel(self, kernel: str = "auto", device_type: str | None = None) -> None:
        """Choose the attention kernel every layer runs under ``attn_implementation="sdpa"`` (docs/model.md,
        "Kernels"): ``"auto"`` (the default: :func:`select_kernel`'s measured choice per device and workload) or a
        name of ``KERNELS[diff_version]`` (V1: ``sdpa_two_calls``, ``sdpa_repeated_value``, ``triton``, ``blocked``,
        ``decode_kernel``, ``padded``; V2: ``standard``, ``rows_decode``, ``causal_blocks``). A kernel that serves only
        some calls leaves the others to the default; each layer's ``last_kernel`` names what its last call ran.
        ``device_type`` (``"cuda"`` or ``"cpu"``; None: the tensors' own) takes that device's default choice wherever
        the model runs: ``"cuda"`` on a CPU runs CUDA's kernels, its decode epilogues through Triton's interpreter
        (``TRITON_INTERPRET=1``), so that CUDA's path is testable without a GPU. Not saved with the model (a choice for
        this machine, like ``attn_implementation``)."""
        check_kernel_name(self.config.diff_version, kernel, self.config.noise_ratio)
        if device_type not in (None, "cuda", "cpu"):
            raise ValueError(f"device_type must be None, 'cuda' or 'cpu', got {device_type!r}")
        for module in self.modules():
            if isinstance(module, DiffTransformerAttention):
                module.kernel = kernel
                module.kernel_device = device_type

    def kernel_plan(self) -> dict[str, str]:
        """The kernel each workload (``prefill``, ``train``, ``decode``) runs by default on this model's device and
        dtype under ``"sdpa"`` (before the per-call conditions of :meth:`DiffTransformerAttention.kernel_for`), or the
        chosen one where :meth:`set_differential_kernel` set it."""
        attn = next(m for m in self.modules() if isinstance(m, DiffTransformerAttention))
        if attn.kernel != "auto":
            return dict.fromkeys(WORKLOADS, attn.kernel)
        device = attn.kernel_device or self.device.type
        return {w: select_kernel(self.config.diff_version, device, w, self.dtype) for w in WORKLOADS}

    @contextlib.contextmanager
    def fixed_parameters(self):
        """A block in which this model's parameters do not change (``generate()`` runs in one): V1's λ and its per-head
        norm's scaled weight are computed once and kept for every call inside (:func:`computed_from_parameters`), so a
        decode step launches nothing for them. For a hand-written decoding loop::

            with model.fixed_parameters(), torch.no_grad():
                for step in range(n):
                    out = model(next_ids, cache=cache, use_cache=True)

        Writing a parameter inside the block is not supported (the kept values may then be stale). Blocks nest."""
        owners = [m for m in self.modules() if isinstance(m, (DiffTransformerAttention, DiffTransformerHeadRMSNorm))]
        for module in owners:
            module.__dict__["_fixed_parameters"] = module.__dict__.get("_fixed_parameters", 0) + 1
        try:
            yield self
        finally:
            for module in owners:
                depth = module.__dict__.pop("_fixed_parameters", 1) - 1
                if depth:
                    module.__dict__["_fixed_parameters"] = depth
                else:
                    for slot in ("_lambda", "_scaled_weight"):
                        module.__dict__.pop(slot, None)

    def layer_lambdas(self) -> torch.Tensor:
        """V1: the current λ of every layer, float32 tensor of shape ``(num_hidden_layers,)``.

        V2's λ depends on the input: use ``model(..., output_lambdas=True).lambdas``.
        """
        if self.config.diff_version != 1:
            raise ValueError(
                "layer_lambdas() is defined for diff_version=1; for V2 call the model with output_lambdas=True."
            )
        with torch.no_grad():
            return torch.stack([m.lambda_full() for m in self.modules() if isinstance(m, DiffTransformerAttention)])


def gathers_sharded_lambdas(forward):
    """``forward`` of the base model, whose ``lambdas`` (``output_lambdas=True``) hold every differential head under
    tensor parallelism too: V2's ``λ = sigmoid(lambda_proj(x))`` comes from a column-sharded ``lambda_proj``, so each
    rank computes its own heads' ``(B, T, H / tp_size)``; they are gathered (differentiably) into ``(B, T, H)``. V1's
    λ, a scalar per layer, is the same on every rank."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return_dict = kwargs.pop("return_dict", None)
        return_dict = getattr(self.config, "return_dict", True) if return_dict is None else return_dict
        outputs = forward(self, *args, return_dict=True, **kwargs)
        lambdas = outputs.get("lambdas")
        if lambdas and self.config.diff_version == 2 and lambdas[0].shape[-1] != self.config.num_diff_heads:
            weight = self.layers[0].self_attn.lambda_proj.weight  # a DTensor sharded over the tensor-parallel mesh
            mesh = weight.device_mesh
            if mesh.ndim > 1:  # tensor parallelism within FSDP2: the ("fsdp", "tp") mesh
                mesh = mesh["tp"]
            outputs["lambdas"] = tuple(
                DTensor.from_local(lam, mesh, [Shard(-1)], run_check=False).full_tensor() for lam in lambdas
            )
        return outputs if return_dict else outputs.to_tuple()

    return wrapper


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
        if config.diff_version == 1:  # only V1 has λ vectors (the heads' post_init collects this from here)
            self._keep_in_fp32_modules_strict = list(V1_FLOAT32_PARAMETERS)
        self.post_init()
        if config.diff_version == 1:  # V1 has no lambda_proj (its λ vectors and subln are replicated under TP)
            self._tp_plan.pop("layers.*.self_attn.lambda_proj", None)
            if ALL_PARALLEL_STYLES is None:  # no registry for the gradient-summing style (maybe_distribute_model warns)
                self._tp_plan.pop("layers.*.self_attn", None)
                self._tp_plan.pop("layers.*.self_attn.subln", None)
            # FSDP2 shards one dtype per group: the attention's projections and per-head norm get groups of their own,
            # so that in a bfloat16 model the float32 λ vectors (_keep_in_fp32_modules_strict) are alone in the group
            # transformers gives the attention module (every module holding float32-kept parameters gets one).
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "subln"):
                self._fsdp_plan[f"layers.*.self_attn.{name}"] = "free_full_weight"
        else:  # V2 has no λ vectors and no per-head norm (its lambda_proj is sharded with its heads)
            self._tp_plan.pop("layers.*.self_attn", None)
            self._tp_plan.pop("layers.*.self_attn.subln", None)
        if config.hidden_act == "poly_norm":
            # Motif's PolyNorm normalises over all intermediate features: a column shard of gate_proj would normalise
            # over its own slice only. Tensor parallelism keeps such an MLP whole on every rank (same input, same
            # output, same gradients everywhere) and shards the attention only.
            for name in ("gate_proj", "up_proj", "down_proj"):
                self._tp_plan.pop(f"layers.*.mlp.{name}", None)

    @gathers_sharded_lambdas
    @accepts_old_cache_name
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> DiffTransformerModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        check_forward_arguments(self, kwargs, cache, position_ids, eager_attention_forward)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if packed_sequences(position_ids, attention_mask, inputs_embeds.shape[0]):
            # transformers builds the block-diagonal mask of packed sequences only without a cache (masking_utils)
            if cache is not None:
                raise ValueError(
                    f"{type(self).__name__}.forward got packed sequences (position_ids restarting within a row, no "
                    "attention_mask) together with a cache: transformers' masks keep packed sequences apart only "
                    "without one. Pass use_cache=False (packed sequences cannot be continued) or one sequence per row."
                )
            use_cache = False  # the default cache would turn the block mask off; nothing could continue it anyway
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        # Up to 5.23 a paged cache is the attention functions' business, not the mask's (as in Llama there).
        paged_legacy = ATTENTION_FUNCTIONS_UPDATE_PAGED_CACHE and isinstance(cache, PagedAttentionCache)
        # On a pipeline-parallel stage the mask is sized from the cache of the first layer the stage runs (the others'
        # stay empty); elsewhere transformers picks the layer.
        first_layer = mask_layer_index(self.layers)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{MASK_CACHE_ARGUMENT: None if paged_legacy else cache},
            **({"layer_idx": first_layer} if first_layer else {}),
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return DiffTransformerModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_NAME: cache})


class DiffTransformerForCausalLM(DiffTransformerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: DiffTransformerConfig):
        super().__init__(config)
        # Trainer shifts labels for label smoothing only for class names in transformers' causal-LM table: added when a
        # model is built (so remote-code loading gets it too), never replacing an entry, not at import.
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(config.model_type, type(self).__name__)
        self.model = DiffTransformerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def generate(self, *args, **kwargs):
        """:meth:`transformers.GenerationMixin.generate`, inside :meth:`fixed_parameters`: V1's λ and its per-head
        norm's weight are computed once per call, not once per step."""
        with self.fixed_parameters():
            return super().generate(*args, **kwargs)

    @accepts_old_cache_name
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
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
            cache=cache,
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
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            lambdas=outputs.lambdas,
        )


class DiffTransformerForSequenceClassification(GenericForSequenceClassification, DiffTransformerPreTrainedModel): ...


class DiffTransformerForQuestionAnswering(GenericForQuestionAnswering, DiffTransformerPreTrainedModel): ...


class DiffTransformerForTokenClassification(GenericForTokenClassification, DiffTransformerPreTrainedModel): ...


__all__ = [
    "ALL_ATTENTION_FUNCTIONS",
    "DEFAULT_KERNELS",
    "KERNELS",
    "select_kernel",
    "DiffTransformerPreTrainedModel",
    "DiffTransformerModel",
    "DiffTransformerForCausalLM",
    "DiffTransformerForSequenceClassification",
    "DiffTransformerForQuestionAnswering",
    "DiffTransformerForTokenClassification",
    "differential_combine",
    "eager_attention_forward",
    "lambda_init_fn",
    "pack_groups",
]
