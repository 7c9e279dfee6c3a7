"""What differs between the transformers releases the model supports (5.19 up to, not including, 6).

Kept out of the modeling file so that it reads top-down like transformers' Llama; shipped beside it (a relative
import), so saved folders' remote code carries it.

transformers 5.24 renamed the cache argument of every model, decoder-layer and attention forward, and the cache field
of the model outputs, from ``past_key_values`` to ``cache``; the old name stays a deprecated alias until 5.40. Before
5.24, ``cache`` named only continuous batching's paged cache, which the attention functions updated themselves; from
5.24 the attention module updates every cache, the paged one included. The model reads whichever the installed release
uses, as that release's Llama does, and refuses what it would not read: a cache under another name, or a decoding step
whose cache is missing (:func:`check_forward_arguments`).
"""

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable

import torch
import transformers
from packaging import version
from transformers.cache_utils import Cache
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging
from transformers.utils.generic import TransformersKwargs

try:  # transformers' pipeline parallelism (DistributedConfig(pp_size=...)) puts these where a stage owns no layer
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer
except ImportError:  # releases without it have no pipeline stages
    PipelineIdentityLayer = None

logger = logging.get_logger(__name__)

TRANSFORMERS_VERSION = transformers.__version__
# The name of the cache argument and output field in the installed release (what generate() passes and reads back,
# and what code that calls a transformers model with a cache must use).
CACHE_RENAMED = "cache" in {field.name for field in dataclasses.fields(BaseModelOutputWithPast)}
CACHE_NAME = "cache" if CACHE_RENAMED else "past_key_values"
# Where transformers announced the removal of the old name (`deprecate_kwarg("past_key_values", "5.40.0", ...)`).
OLD_CACHE_NAME_REMOVED_IN = "5.40.0"
# Settled here, once: whether the old name is transformers' deprecated alias (5.24 up to 5.40) or refused (5.40 on).
OLD_CACHE_NAME_REFUSED = CACHE_RENAMED and version.parse(TRANSFORMERS_VERSION) >= version.parse(
    OLD_CACHE_NAME_REMOVED_IN
)
# Up to 5.23 the attention functions (sdpa, flash, paged|eager) update a paged cache passed to them as `cache=`.
ATTENTION_FUNCTIONS_UPDATE_PAGED_CACHE = "cache" in inspect.signature(sdpa_attention_forward).parameters
MASK_CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def accepts_old_cache_name(forward: Callable) -> Callable:
    """Let ``forward(..., cache=...)`` also take the cache as ``past_key_values=``.

    Up to transformers 5.23 ``past_key_values`` is the current name (generate() passes it), so it is renamed silently;
    from 5.24 it is transformers' deprecated alias: renamed with a ``FutureWarning`` until 5.40, refused from then on,
    as transformers' own models do. Passing both names is an error."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        if "past_key_values" in kwargs:
            old = kwargs.pop("past_key_values")
            if old is not None and kwargs.get("cache") is not None:
                raise ValueError(
                    f"{type(self).__name__}.forward got both `cache` and `past_key_values`: pass the cache once, as "
                    f"`{CACHE_NAME}` (transformers {TRANSFORMERS_VERSION})."
                )
            if OLD_CACHE_NAME_REFUSED:
                raise TypeError(
                    f"{type(self).__name__}.forward got `past_key_values`, which transformers {TRANSFORMERS_VERSION} "
                    "no longer accepts (renamed in 5.24, removed in 5.40): pass the cache as `cache=`."
                )
            if CACHE_RENAMED and old is not None and not torch.compiler.is_compiling():
                warnings.warn(
                    f"`past_key_values` is deprecated and will be removed in transformers {OLD_CACHE_NAME_REMOVED_IN} "
                    f"for `{type(self).__name__}.forward`. Use `cache` instead.",
                    FutureWarning,
                    stacklevel=2,
                )
            if old is not None or "cache" not in kwargs:
                kwargs["cache"] = old
        return forward(self, *args, **kwargs)

    return wrapper


# Keyword arguments a forward passes on, beyond its named inputs: transformers' shared model kwargs (output flags,
# packed-sequence lengths, `num_items_in_batch`), continuous batching's paged-attention arguments and the causal-LM
# loss's own arguments. The attention function in use adds its named parameters (`check_forward_arguments`).
PASSED_ON_KWARGS = frozenset(TransformersKwargs.__annotations__) | frozenset(
    name
    for name in inspect.signature(ForCausalLMLoss).parameters
    if name not in ("logits", "labels", "vocab_size", "kwargs")
)
try:
    from transformers.generation.continuous_batching.input_outputs import PagedAttentionArgs

    PASSED_ON_KWARGS |= frozenset(PagedAttentionArgs.__annotations__) - {"cache"}
except ImportError:  # only a name list: releases without it pass none of these
    pass
_ATTENTION_FUNCTION_KWARGS: dict[str, frozenset] = {}
_WARNED_UNKNOWN: set[str] = set()


def attention_function_kwargs(attn_implementation: str | None, default: Callable) -> frozenset:
    """Named parameters of the attention function registered under ``attn_implementation`` (``default`` where none
    is), beyond module, query, key, value and mask: what that backend reads from the kwargs a forward passes on."""
    name = str(attn_implementation)
    if name not in _ATTENTION_FUNCTION_KWARGS:
        function = ALL_ATTENTION_FUNCTIONS.get(name, default)
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):
            parameters = ()
        _ATTENTION_FUNCTION_KWARGS[name] = frozenset(
            p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        ) - {"module", "query", "key", "value", "attention_mask"}
    return _ATTENTION_FUNCTION_KWARGS[name]


def check_forward_arguments(model, kwargs: dict, cache, position_ids, default_attention: Callable) -> None:
    """Never silently wrong about the cache; tolerant of other keywords.

    * a cache passed under a name this release does not read raises (the next rename of transformers' cache argument
      fails here instead of decoding every step without its past);
    * any other keyword argument that is neither an input of the model nor one its layers or attention backend reads
      warns once per name (saved folders carry this code frozen: the next harmless keyword transformers adds must not
      break them);
    * a decoding step without its past raises: positions that start after 0 while no cache holds the earlier tokens
      (the signature of a cache lost on the way). The cache counts as empty only when every layer is (under pipeline
      parallelism a stage fills only the layers it owns). The check reads the positions' values only where that is
      free: for positions on the CPU. For positions on an accelerator it is skipped, since reading them would make the
      host wait for the device in every forward (each training step that passes positions); the first check, on the
      cache's name, runs everywhere. Also skipped under ``torch.compile`` and for compileable (static) caches, whose
      length lives on the device; and for continuous batching's paged cache and vLLM's Transformers backend, whose
      attention functions keep the cache.
    """
    attn = model.config._attn_implementation
    recordable = {f"output_{key}" for key in getattr(model, "_can_record_outputs", None) or {}}
    known = PASSED_ON_KWARGS | recordable | attention_function_kwargs(attn, default_attention)
    for name, value in kwargs.items():
        if name in known:
            continue
        if name == "kwargs" and isinstance(value, dict):
            # transformers' pipeline-parallel forward binds the caller's `**kwargs` as one argument named `kwargs`
            # (inspect.BoundArguments) and passes that dict on: its contents reach no layer. `return_dict` is moot
            # there (that forward builds its own output); anything else is lost and is warned about by name.
            lost = sorted(set(value) - {"return_dict"})
            if lost and "kwargs" not in _WARNED_UNKNOWN and not torch.compiler.is_compiling():
                _WARNED_UNKNOWN.add("kwargs")
                logger.warning(
                    f"{type(model).__name__}.forward got the keyword arguments {lost} wrapped in one argument named "
                    "'kwargs' (transformers' pipeline-parallel forward does this): they are ignored. (Warned once.)"
                )
            continue
        if isinstance(value, Cache):
            raise TypeError(
                f"{type(model).__name__}.forward got a {type(value).__name__} as `{name}`, a name it does not read: "
                f"with transformers {TRANSFORMERS_VERSION} the cache is passed as `{CACHE_NAME}`. Decoding with "
                "the cache ignored would be silently wrong; if transformers renamed its cache argument again, "
                "difftransformer must follow it."
            )
        if name not in _WARNED_UNKNOWN and not torch.compiler.is_compiling():
            _WARNED_UNKNOWN.add(name)
            logger.warning(
                f"{type(model).__name__}.forward ignores the keyword argument {name!r} (transformers "
                f"{TRANSFORMERS_VERSION}, attn_implementation={attn!r}): it is neither an input of the model nor an "
                "argument of its attention backend. (Warned once per name.)"
            )
    if position_ids is None or isinstance(cache, PagedAttentionCache) or str(attn).startswith("vllm"):
        return  # continuous batching and vLLM hand the attention function their own cache
    if torch.compiler.is_compiling() or position_ids.device.type != "cpu":
        return  # reading an accelerator tensor's value would make the host wait for the device in every forward
    if cache is None or (not getattr(cache, "is_compileable", False) and cache_is_empty(cache)):
        start = int(position_ids.min())
        if start > 0:
            raise ValueError(
                f"{type(model).__name__}.forward got position_ids starting at {start} but "
                f"{'no cache' if cache is None else 'an empty cache'} (`{CACHE_NAME}`, transformers "
                f"{TRANSFORMERS_VERSION}): a decoding step needs the cache that holds the {start} earlier tokens, or "
                "the whole sequence from position 0. Was the cache passed under another name?"
            )


def cache_is_empty(cache: Cache) -> bool:
    """Whether no layer of ``cache`` holds a token yet. Not ``cache.get_seq_length()``, which reads layer 0 only: a
    pipeline-parallel stage fills only the layers it owns, and the last stage never owns layer 0. Reads shapes only
    (no device synchronisation)."""
    layers = getattr(cache, "layers", None)
    if layers is None:  # a cache class of its own, without per-layer storage
        return cache.get_seq_length() == 0
    return all(layer.get_seq_length() == 0 for layer in layers if hasattr(layer, "get_seq_length"))


def mask_layer_index(layers) -> int:
    """The index of the first decoder layer this process runs: the layer whose cache sizes the attention mask
    (``create_causal_mask(..., layer_idx=...)``). 0 except on a pipeline-parallel stage, where the layers other stages
    own are ``PipelineIdentityLayer`` placeholders whose cache stays empty; sizing the mask from one of them gives a
    decoding step a mask as long as its query, which drops the padding of a batch of prompts."""
    if PipelineIdentityLayer is None:
        return 0
    for i, layer in enumerate(layers):  # a plain loop: torch.compile of older torch cannot trace next() with a default
        if not isinstance(layer, PipelineIdentityLayer):
            return i
    return 0


class PackedGroupsPagedCache(PagedAttentionCache):
    """V1's view of transformers' paged cache on releases up to 5.23, where the attention function updates it.

    V1's padded call hands that function its keys and values as packed ``(1, G, T, 2d)`` groups (``[K1 | K2]``,
    ``[V_g,0 | V_g,1]``), while the paged cache is laid out per token as ``(num_key_value_heads, head_dim)``: the same
    bytes. ``update`` converts the views both ways (no copy). From 5.24 on the attention module updates the cache with
    the standard layout itself and this class is not used.
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
        return groups(key), groups(value)


__all__ = [
    "ATTENTION_FUNCTIONS_UPDATE_PAGED_CACHE",
    "CACHE_NAME",
    "CACHE_RENAMED",
    "MASK_CACHE_ARGUMENT",
    "OLD_CACHE_NAME_REFUSED",
    "OLD_CACHE_NAME_REMOVED_IN",
    "PASSED_ON_KWARGS",
    "TRANSFORMERS_VERSION",
    "PackedGroupsPagedCache",
    "accepts_old_cache_name",
    "attention_function_kwargs",
    "cache_is_empty",
    "check_forward_arguments",
    "mask_layer_index",
]
