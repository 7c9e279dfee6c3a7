"""Checkpoint conversions into (and out of) the ``difftransformer`` format (SPEC §6).

Sources (``--from``) and what each becomes (``--to difftransformer`` unless noted):

==================  ===============================================================================  ============
source              what it is                                                                        result
==================  ===============================================================================  ============
``diffllama``       transformers' ``DiffLlamaForCausalLM`` folder (``model_type: diffllama``)         V1, exact
``microsoft-v1``    a full-model state dict whose attention modules are Microsoft's                   V1, exact
                    ``MultiheadDiffAttn`` / ``MultiheadFlashDiff1`` / ``MultiheadFlashDiff2``
                    (microsoft/unilm ``Diff-Transformer/``), Llama names elsewhere
``microsoft-v2``    the same with ``MultiheadFlashDiffV2`` (``Diff-Transformer/Diff-Transformer-V2/``) V2, exact
``llama``           any Llama / Mistral / Qwen2 causal LM folder                                      V2 exact, V1
                                                                                                      approximate
``difftransformer`` our own format: re-save (dtype, sharding) or ``--to diffllama``                  (V1 only to
                                                                                                      DiffLlama)
==================  ===============================================================================  ============

Every source can also be written as a DiffLlama folder (``--to diffllama``) when the result is V1.

How a conversion runs (the guarantees of issue 3):

1. The source config is read and turned into ours (``rope_parameters``, tied embeddings, ``rms_norm_eps``,
   dtype, biases are carried over).
2. A *plan* lists, for every tensor of the result, the source tensors it is computed from and how (SPEC §6 index
   maps). Before anything is written the plan is checked against the source's key list and shapes: unknown,
   missing and mis-shaped tensors stop the conversion with an error naming them.
3. The result is written into a temporary folder beside the output, one safetensors shard at a time, each tensor
   computed from tensors read lazily (memory-mapped) from the source, so the model is never held twice in memory;
   sharding and the index follow ``huggingface_hub.split_torch_state_dict_into_shards`` as in ``save_pretrained``.
   The folder is renamed into place only at the end, so an interrupted run leaves no half-written model.

Microsoft full-model state dicts: Microsoft released modules, not models, so the rest of the model is named as in
Llama (``model.embed_tokens.weight``, ``model.layers.{l}.input_layernorm.weight``, ...), the attention module at
``model.layers.{l}.self_attn.`` with Microsoft's own parameter names (``q_proj``, ``k_proj``, ``v_proj``,
``out_proj`` (V1) / ``o_proj`` (V2), ``lambda_q1`` ..., ``subln.weight``, ``lambda_proj``). A JSON key map (see
:func:`load_key_map`) renames other layouts into that one. The head counts follow Microsoft's convention: its
``num_heads`` is our ``H`` (half the query heads), its ``num_kv_heads`` our ``G``; its ``depth`` is our 0-based
layer index.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, DiffLlamaConfig, DiffLlamaForCausalLM, PreTrainedConfig
from transformers.dynamic_module_utils import custom_object_save

from .configuration_difftransformer import DiffTransformerConfig
from .modeling_difftransformer import _AUTO_MAP, DiffTransformerForCausalLM

logger = logging.getLogger(__name__)

SOURCES = ("diffllama", "microsoft-v1", "microsoft-v2", "llama", "difftransformer")
TARGETS = ("difftransformer", "diffllama")
LLAMA_STYLE_MODEL_TYPES = ("llama", "mistral", "qwen2")
MICROSOFT_V1_MODULES = ("MultiheadDiffAttn", "MultiheadFlashDiff1", "MultiheadFlashDiff2")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Files copied unchanged from the input folder when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
GENERATION_CONFIG_FILE = "generation_config.json"
# One shard is held in memory while it is written (safetensors writes whole files), so the shard size bounds the
# conversion's memory: 5GB (huggingface_hub's default) rather than save_pretrained's 50GB.
DEFAULT_MAX_SHARD_SIZE = "5GB"

# Old Llama checkpoints store the (deterministic, recomputed) rotary buffer; transformers ignores it on load.
_DROPPABLE_BUFFER = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class ConversionError(ValueError):
    """A checkpoint cannot be converted as asked; the message names the offending field, key or option."""


# ----------------------------------------------------------------------------------------------------------------
# Reading checkpoints: shapes first (metadata only), tensors one at a time.
# ----------------------------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class Checkpoint:
    """Lazy read access to a state dict: ``shapes`` and ``dtypes`` without loading, ``get(key)`` per tensor."""

    def __init__(self, shapes: dict[str, tuple], dtypes: dict[str, torch.dtype], loader: Callable[[str], torch.Tensor]):
        self.shapes, self.dtypes, self._loader = shapes, dtypes, loader
        self._stack = contextlib.ExitStack()

    def get(self, key: str) -> torch.Tensor:
        return self._loader(key)

    def close(self):
        self._stack.close()

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor]) -> Checkpoint:
        sd = dict(state_dict)
        return cls({k: tuple(v.shape) for k, v in sd.items()}, {k: v.dtype for k, v in sd.items()}, sd.__getitem__)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike, allow_pickle: bool = False) -> Checkpoint:
        """Open ``model.safetensors``, a sharded safetensors index, or (only with ``allow_pickle``) ``pytorch_model.bin``."""
        folder = Path(folder)
        files = _weight_files(folder, allow_pickle)
        if files[0].suffix == ".safetensors":
            return cls._from_safetensors(files)
        return cls._from_pickle(files)

    @classmethod
    def _from_safetensors(cls, files: list[Path]) -> Checkpoint:
        ckpt = cls({}, {}, None)
        handles, where = {}, {}
        for file in files:
            handle = ckpt._stack.enter_context(safe_open(file, framework="pt"))
            handles[file] = handle
            for key in handle.keys():
                if key in where:
                    raise ConversionError(f"Tensor {key!r} is stored twice, in {where[key].name} and {file.name}.")
                where[key] = file
                sl = handle.get_slice(key)
                ckpt.shapes[key] = tuple(sl.get_shape())
                ckpt.dtypes[key] = _SAFETENSORS_DTYPES.get(sl.get_dtype(), None)
        ckpt._loader = lambda key: handles[where[key]].get_tensor(key)
        return ckpt

    @classmethod
    def _from_pickle(cls, files: list[Path]) -> Checkpoint:
        merged = {}
        for file in files:
            # mmap: the tensors stay on disk until used; weights_only: refuse arbitrary objects even with the flag.
            sd = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            if not isinstance(sd, Mapping):
                raise ConversionError(f"{file} does not hold a state dict (found {type(sd).__name__}).")
            merged.update(sd)
        return cls.from_state_dict(merged)


def _weight_files(folder: Path, allow_pickle: bool) -> list[Path]:
    if not folder.is_dir():
        raise ConversionError(f"--input {str(folder)!r} is not a folder.")
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"), ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index, single_file = folder / index_name, folder / single
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [folder / s for s in shards]
        elif single_file.is_file():
            files = [single_file]
        else:
            continue
        if single.endswith(".bin") and not allow_pickle:
            raise ConversionError(
                f"{folder} holds only pickled weights ({files[0].name}). Unpickling can run code; if you trust the file, "
                "pass --allow-pickle (allow_pickle=True). Tensors are then read with torch.load(weights_only=True)."
            )
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConversionError(f"{index_name} in {folder} names shard files that are missing: {missing}.")
        return files
    raise ConversionError(
        f"No weights found in {folder}: expected model.safetensors, model.safetensors.index.json, "
        "or (with --allow-pickle) pytorch_model.bin / pytorch_model.bin.index.json."
    )


# ----------------------------------------------------------------------------------------------------------------
# Index maps (SPEC §3, §6). Each returns, for every row (head) of the result, the source row (head) it comes from.
# ----------------------------------------------------------------------------------------------------------------


def interleaved_to_rotate_half(d: int) -> torch.Tensor:
    """``P_d``: within one head, new row ``i`` ← old ``2i`` and new row ``i + d/2`` ← old ``2i + 1`` (``i < d/2``).

    GPT-J-style (interleaved) RoPE rotates feature pairs ``(2i, 2i+1)`` by frequency ``i``; transformers' rotate-half
    rotates ``(i, i + d/2)`` by the same frequency, so permuting q and k rows alike turns one into the other and leaves
    every dot product unchanged.
    """
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def v1_query_heads_from(layout: str, num_groups: int, n: int) -> torch.Tensor:
    """V1 query half-heads in our group-major order ``(g, c, r)``: the index each one has in ``layout``.

    ``layout``: ``"diffllama"`` orders query heads ``(c, g, r)``; ``"microsoft"`` orders them ``(g, r, c)``
    (head ``h = g·n + r``, its two maps adjacent); ``"ours"`` is the identity.
    """
    index = []
    for g in range(num_groups):
        for c in range(2):
            for r in range(n):
                index.append({"diffllama": (c * num_groups + g) * n + r, "microsoft": (g * n + r) * 2 + c, "ours": (2 * g + c) * n + r}[layout])
    return torch.tensor(index)


def v1_kv_heads_from(layout: str, num_groups: int) -> torch.Tensor:
    """V1 key/value heads in our order ``(g, c)``: their index in ``layout`` (DiffLlama: ``(c, g)``; Microsoft: ours)."""
    return torch.tensor([c * num_groups + g if layout == "diffllama" else 2 * g + c for g in range(num_groups) for c in range(2)])


def expand_heads(head_index: torch.Tensor, d: int, within: torch.Tensor | None = None) -> torch.Tensor:
    """Row indices for a head permutation (and an optional within-head permutation such as ``P_d``)."""
    within = torch.arange(d) if within is None else within
    return (head_index[:, None] * d + within[None, :]).reshape(-1)


def invert(index: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(index)
    out[index] = torch.arange(index.numel())
    return out


# ----------------------------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------------------------

Getter = Callable[[str], torch.Tensor]


@dataclass
class Step:
    """One tensor of the result: ``fn(get)`` computes it from source tensors fetched with ``get(key)``."""

    target: str
    sources: tuple[str, ...]
    fn: Callable[[Getter], torch.Tensor]
    keep_float32: bool = False  # V1 λ vectors stay float32 (SPEC §3) whatever --dtype says


@dataclass
class Plan:
    """Everything a conversion will do, decided before any tensor is read."""

    source_shapes: dict[str, tuple]  # every key the source must hold, with its shape
    optional_sources: dict[str, tuple]  # keys it may hold, accounted for and dropped (tied lm_head)
    steps: list[Step]
    config: PreTrainedConfig  # of the result
    target_shapes: dict[str, tuple]
    exact: bool = True
    notes: list[str] = field(default_factory=list)


def _copy(key: str) -> Callable[[Getter], torch.Tensor]:
    return lambda get: get(key)


def _rows(key: str, rows: torch.Tensor) -> Callable[[Getter], torch.Tensor]:
    return lambda get: get(key).index_select(0, rows)


def _meta_shapes(model_cls, config) -> dict[str, tuple]:
    """The state-dict keys and shapes a model class has for ``config``, without allocating weights."""
    with torch.device("meta"):
        model = model_cls(config) if model_cls is not AutoModelForCausalLM else AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def _is_lambda_vector(key: str) -> bool:
    return re.search(r"\.lambda_[qk][12]$", key) is not None


def _layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}.self_attn."


def _common_steps(target_shapes: dict[str, tuple]) -> list[Step]:
    """Everything outside attention keeps its Llama name and value."""
    return [Step(k, (k,), _copy(k)) for k in target_shapes if ".self_attn." not in k]


def _tied_optional(config, hidden: int) -> dict[str, tuple]:
    return {"lm_head.weight": (config.vocab_size, hidden)} if config.tie_word_embeddings else {}


# -- difftransformer (ours) --------------------------------------------------------------------------------------


def plan_from_difftransformer(config) -> Plan:
    """Our own format: every tensor copied (a re-save with another dtype or shard size, or the start of --to diffllama)."""
    # A fresh config of our class: never mutate a caller's model config, and accept one loaded as remote code.
    config = DiffTransformerConfig.from_dict(config.to_dict())
    shapes = _meta_shapes(DiffTransformerForCausalLM, config)
    steps = [Step(k, (k,), _copy(k), keep_float32=_is_lambda_vector(k)) for k in shapes]
    return Plan(dict(shapes), _tied_optional(config, config.hidden_size), steps, config, shapes)


# -- transformers DiffLlama -------------------------------------------------------------------------------------


def config_from_diffllama(src: DiffLlamaConfig) -> DiffTransformerConfig:
    """DiffLlama config → V1 config. Its per-head norm has no weight and uses ``rms_norm_eps`` (SPEC §6)."""
    if src.attention_dropout not in (None, 0, 0.0):
        raise ConversionError(f"DiffLlama attention_dropout={src.attention_dropout}: the Differential Transformer defines none; expected 0.")
    return DiffTransformerConfig(
        **_shared_fields(src),
        num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_key_value_heads,
        head_dim=src.head_dim,
        attention_bias=src.attention_bias,
        mlp_bias=False,
        diff_version=1,
        lambda_std=src.lambda_std_dev if src.lambda_std_dev is not None else 0.1,
        subln_eps=src.rms_norm_eps,
    )


def plan_from_diffllama(src: DiffLlamaConfig) -> Plan:
    config = config_from_diffllama(src)
    source_shapes = _meta_shapes(DiffLlamaForCausalLM, src)
    target_shapes = _meta_shapes(DiffTransformerForCausalLM, config)
    d, G = config.head_dim, config.num_kv_groups
    n = config.num_diff_heads // G
    q_rows = expand_heads(v1_query_heads_from("diffllama", G, n), d)
    kv_rows = expand_heads(v1_kv_heads_from("diffllama", G), d)
    steps = _common_steps(target_shapes)
    for layer in range(config.num_hidden_layers):
        p = _layer_prefix(layer)
        for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            for kind in ("weight", "bias") if config.attention_bias else ("weight",):
                steps.append(Step(f"{p}{proj}.{kind}", (f"{p}{proj}.{kind}",), _rows(f"{p}{proj}.{kind}", rows)))
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            steps.append(Step(f"{p}o_proj.{kind}", (f"{p}o_proj.{kind}",), _copy(f"{p}o_proj.{kind}")))
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            steps.append(Step(p + name, (p + name,), _copy(p + name), keep_float32=True))
        steps.append(Step(p + "subln.weight", (), lambda get: torch.ones(2 * d)))
    return Plan(source_shapes, _tied_optional(config, config.hidden_size), steps, config, target_shapes)


# -- Llama / Mistral / Qwen2 upcycling ----------------------------------------------------------------------------


def _shared_fields(src) -> dict:
    """Fields with the same meaning in Llama-style configs and ours."""
    fields = {}
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "hidden_act",
        "max_position_embeddings",
        "initializer_range",
        "rms_norm_eps",
        "use_cache",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
        "rope_parameters",
    ):
        if hasattr(src, name):
            fields[name] = getattr(src, name)
    if getattr(src, "dtype", None) is not None:
        fields["dtype"] = src.dtype
    return fields


def _llama_notes(src) -> list[str]:
    notes = []
    layer_types = getattr(src, "layer_types", None) or []
    sliding = getattr(src, "sliding_window", None)
    uses_window = sliding is not None and (
        src.model_type == "mistral" or "sliding_attention" in layer_types or getattr(src, "use_sliding_window", False)
    )
    if uses_window and sliding < src.max_position_embeddings:
        notes.append(
            f"The source uses sliding-window attention (sliding_window={sliding}); difftransformer attends to the whole "
            f"context, so outputs match only for sequences of at most {sliding} tokens."
        )
    return notes


def config_from_llama(src, diff_version: int, source_shapes: dict[str, tuple] | None = None) -> DiffTransformerConfig:
    """Llama-style config → ours. V2 doubles the query heads (SPEC §6); V1 keeps every count."""
    if src.model_type not in LLAMA_STYLE_MODEL_TYPES:
        raise ConversionError(
            f"--from llama expects a Llama-style causal LM; config.json has model_type {src.model_type!r}, "
            f"supported: {list(LLAMA_STYLE_MODEL_TYPES)}."
        )
    if diff_version not in (1, 2):
        raise ConversionError(f"--diff-version must be 1 or 2 for --from llama, got {diff_version!r}.")
    hq, hkv = src.num_attention_heads, src.num_key_value_heads or src.num_attention_heads
    head_dim = getattr(src, "head_dim", None) or src.hidden_size // hq
    if getattr(src, "attention_dropout", 0.0) not in (None, 0, 0.0):
        raise ConversionError(f"attention_dropout={src.attention_dropout}: difftransformer defines no attention dropout; set it to 0.")
    if diff_version == 1 and hkv % 2:
        raise ConversionError(
            f"Llama → V1 upcycling needs an even num_key_value_heads (each V1 KV group holds two key and two value "
            f"heads); the source has {hkv}. Use --diff-version 2, which is exact for every head count."
        )
    # Qwen2 has q/k/v biases but no o_proj bias; our attention_bias covers all four, o_proj's is then zero.
    has_bias = any(k.endswith("self_attn.q_proj.bias") for k in source_shapes) if source_shapes else bool(getattr(src, "attention_bias", False))
    return DiffTransformerConfig(
        **_shared_fields(src),
        num_attention_heads=2 * hq if diff_version == 2 else hq,
        num_key_value_heads=hkv,
        head_dim=head_dim,
        attention_bias=has_bias,
        mlp_bias=bool(getattr(src, "mlp_bias", False)),
        diff_version=diff_version,
        # V1: the per-head norm gets the model's eps, so that the result can also be exported to DiffLlama.
        subln_eps=src.rms_norm_eps,
    )


def plan_from_llama(src, diff_version: int, seed: int = 0) -> Plan:
    """Llama → V2 (exact) or V1 (approximate), SPEC §6."""
    source_shapes = {k: v for k, v in _meta_shapes(AutoModelForCausalLM, src).items()}
    config = config_from_llama(src, diff_version, source_shapes)
    target_shapes = _meta_shapes(DiffTransformerForCausalLM, config)
    d, E = config.head_dim, config.hidden_size
    steps = _common_steps(target_shapes)
    src_bias = config.attention_bias
    src_o_bias = any(k.endswith("self_attn.o_proj.bias") for k in source_shapes)
    for layer in range(config.num_hidden_layers):
        p = _layer_prefix(layer)
        kinds = ("weight", "bias") if src_bias else ("weight",)
        if diff_version == 2:
            # Query head j → heads 2j, 2j+1; λ = sigmoid(0) = 0.5, so o_h = a_j − 0.5·a_j and o_proj doubles.
            q_rows = expand_heads(torch.arange(src.num_attention_heads).repeat_interleave(2), d)
            for kind in kinds:
                steps.append(Step(f"{p}q_proj.{kind}", (f"{p}q_proj.{kind}",), _rows(f"{p}q_proj.{kind}", q_rows)))
            steps.append(Step(f"{p}o_proj.weight", (f"{p}o_proj.weight",), lambda get, k=f"{p}o_proj.weight": get(k) * 2))
            steps.append(Step(p + "lambda_proj.weight", (), lambda get: torch.zeros(config.num_diff_heads, E)))
        else:
            # Source query head i = (2g + c)·n + r becomes map c of head h = g·n + r (same key and value head);
            # its o_proj column block moves to half c of head h. Not function-preserving (SPEC §6).
            G = config.num_kv_groups
            n = config.num_diff_heads // G
            cols = expand_heads(_v1_output_blocks(G, n), d)
            for kind in kinds:
                steps.append(Step(f"{p}q_proj.{kind}", (f"{p}q_proj.{kind}",), _copy(f"{p}q_proj.{kind}")))
            steps.append(Step(f"{p}o_proj.weight", (f"{p}o_proj.weight",), lambda get, k=f"{p}o_proj.weight", c=cols: get(k).index_select(1, c)))
            gen = torch.Generator().manual_seed(seed * 100_003 + layer)
            lambdas = {name: torch.randn(d, generator=gen) * config.lambda_std for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")}
            for name, value in lambdas.items():
                steps.append(Step(p + name, (), lambda get, v=value: v, keep_float32=True))
            steps.append(Step(p + "subln.weight", (), lambda get: torch.ones(2 * d)))
        for proj in ("k_proj", "v_proj"):
            for kind in kinds:
                steps.append(Step(f"{p}{proj}.{kind}", (f"{p}{proj}.{kind}",), _copy(f"{p}{proj}.{kind}")))
        if src_bias:
            if src_o_bias:
                steps.append(Step(f"{p}o_proj.bias", (f"{p}o_proj.bias",), _copy(f"{p}o_proj.bias")))
            else:
                steps.append(Step(f"{p}o_proj.bias", (), lambda get: torch.zeros(E)))
    optional = _tied_optional(config, E)
    for key in list(source_shapes):
        if _DROPPABLE_BUFFER.search(key):
            optional[key] = source_shapes.pop(key)
    plan = Plan(source_shapes, optional, steps, config, target_shapes, exact=diff_version == 2, notes=_llama_notes(src))
    if diff_version == 1:
        plan.notes.append(
            "Llama → V1 upcycling is approximate (SPEC §6): the result computes a different function and needs "
            "continued training before use."
        )
    return plan


def _v1_output_blocks(num_groups: int, n: int) -> torch.Tensor:
    """Our o_proj column blocks are ordered (h, c) with h = g·n + r; the query heads feeding them are (g, c, r).

    Returns, for every output block in (h, c) order, the position of its query head in (g, c, r) order."""
    return torch.tensor([(2 * g + c) * n + r for g in range(num_groups) for r in range(n) for c in range(2)])


# -- Microsoft reference modules -----------------------------------------------------------------------------------

# Config keys a Microsoft source config.json may hold (Llama names plus Microsoft's head counts).
MICROSOFT_CONFIG_FIELDS = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "subln_eps",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "dtype",
    "torch_dtype",
    "attention_module",
}
_IGNORED_CONFIG_KEYS = {"model_type", "architectures", "transformers_version", "_name_or_path"}


def config_from_microsoft(cfg: Mapping, version: int) -> tuple[DiffTransformerConfig, dict]:
    """Microsoft-convention config dict → ours. Returns (config, info) with info = {H, G, n, module}."""
    unknown = sorted(set(cfg) - MICROSOFT_CONFIG_FIELDS - _IGNORED_CONFIG_KEYS)
    if unknown:
        raise ConversionError(f"Unknown field(s) {unknown} in the Microsoft source config; allowed: {sorted(MICROSOFT_CONFIG_FIELDS)}.")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_heads"):
        if name not in cfg:
            raise ConversionError(
                f"The Microsoft source config lacks {name!r}. Required: vocab_size, hidden_size, intermediate_size, "
                "num_hidden_layers, num_heads (Microsoft's num_heads = differential heads, half a baseline "
                "Transformer's); optional num_kv_heads (null = MHA), head_dim, rms_norm_eps, rope_theta, ..."
            )
    E, H = cfg["hidden_size"], cfg["num_heads"]
    G = cfg.get("num_kv_heads") or H
    if H % G:
        raise ConversionError(f"num_heads ({H}) must be a multiple of num_kv_heads ({G}).")
    if version == 1:
        # MultiheadDiffAttn / MultiheadFlashDiff*: head_dim = embed_dim // num_heads // 2, fixed by the module.
        if E % (2 * H):
            raise ConversionError(f"hidden_size ({E}) must be divisible by 2 * num_heads ({2 * H}) for Microsoft's V1 modules.")
        d = E // H // 2
        if cfg.get("head_dim") not in (None, d):
            raise ConversionError(f"head_dim={cfg['head_dim']}: Microsoft's V1 modules fix head_dim = hidden_size // num_heads // 2 = {d}.")
        module = cfg.get("attention_module")
        if module is not None and module not in MICROSOFT_V1_MODULES:
            raise ConversionError(f"attention_module={module!r}; allowed: {list(MICROSOFT_V1_MODULES)}.")
    else:
        d = cfg.get("head_dim") or E // H
        module = cfg.get("attention_module", "MultiheadFlashDiffV2")
        if module != "MultiheadFlashDiffV2":
            raise ConversionError(f"attention_module={module!r}; --from microsoft-v2 expects 'MultiheadFlashDiffV2'.")
    kwargs = {k: cfg[k] for k in cfg if k in MICROSOFT_CONFIG_FIELDS - {"num_heads", "num_kv_heads", "attention_module", "torch_dtype", "head_dim"}}
    if "torch_dtype" in cfg and "dtype" not in cfg:
        kwargs["dtype"] = cfg["torch_dtype"]
    if version == 2:
        kwargs.pop("subln_eps", None)
    config = DiffTransformerConfig(
        **kwargs,
        num_attention_heads=2 * H,
        num_key_value_heads=2 * G if version == 1 else G,
        head_dim=d,
        diff_version=version,
    )
    return config, {"H": H, "G": G, "n": H // G, "module": module}


def plan_from_microsoft(cfg: Mapping, version: int, attention_module: str | None = None, subln_affine: bool = True) -> Plan:
    """Microsoft V1/V2 full-model state dict (Llama names, Microsoft attention modules) → ours (SPEC §6)."""
    cfg = dict(cfg)
    if attention_module is not None:
        cfg["attention_module"] = attention_module
    config, info = config_from_microsoft(cfg, version)
    G, n, module = info["G"], info["n"], info["module"]
    if version == 1 and n > 1:
        if module is None:
            raise ConversionError(
                f"This V1 checkpoint uses GQA (num_heads / num_kv_heads = {n}), where Microsoft's files differ: say which "
                f"module produced it with --microsoft-module (or 'attention_module' in its config.json), one of "
                f"{list(MICROSOFT_V1_MODULES)}."
            )
        if module == "MultiheadDiffAttn":
            raise ConversionError(
                "Checkpoints from Microsoft's naive MultiheadDiffAttn (multihead_diffattn.py) with GQA "
                f"(num_heads / num_kv_heads = {n} > 1) are not DIFF V1: that file repeats key heads over adjacent query "
                "heads, so both softmax maps of a differential head read the same key head instead of K1 and K2 "
                "(SPEC §6). They cannot be represented here; only n = 1 (MHA) checkpoints from that file convert."
            )
    target_shapes = _meta_shapes(DiffTransformerForCausalLM, config)
    d, E = config.head_dim, config.hidden_size
    rope_rows = interleaved_to_rotate_half(d)
    # V1 query rows (g, r, c) → (g, c, r); V2 rows already pair adjacent heads. k and v keep their order. Every q
    # and k head also goes from interleaved to rotate-half RoPE.
    if version == 1:
        q_rows, out_name = expand_heads(v1_query_heads_from("microsoft", G, n), d, rope_rows), "out_proj"
    else:
        q_rows, out_name = expand_heads(torch.arange(config.num_attention_heads), d, rope_rows), "o_proj"
    k_rows = expand_heads(torch.arange(config.num_key_value_heads), d, rope_rows)
    source_shapes = {k: v for k, v in target_shapes.items() if ".self_attn." not in k}
    steps = _common_steps(target_shapes)
    for layer in range(config.num_hidden_layers):
        p = _layer_prefix(layer)
        q_shape, kv_shape = target_shapes[p + "q_proj.weight"], target_shapes[p + "k_proj.weight"]
        source_shapes.update({p + "q_proj.weight": q_shape, p + "k_proj.weight": kv_shape, p + "v_proj.weight": kv_shape})
        source_shapes[f"{p}{out_name}.weight"] = target_shapes[p + "o_proj.weight"]
        steps += [
            Step(p + "q_proj.weight", (p + "q_proj.weight",), _rows(p + "q_proj.weight", q_rows)),
            Step(p + "k_proj.weight", (p + "k_proj.weight",), _rows(p + "k_proj.weight", k_rows)),
            Step(p + "v_proj.weight", (p + "v_proj.weight",), _copy(p + "v_proj.weight")),
            Step(p + "o_proj.weight", (f"{p}{out_name}.weight",), _copy(f"{p}{out_name}.weight")),
        ]
        if version == 1:
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                source_shapes[p + name] = (d,)
                steps.append(Step(p + name, (p + name,), _copy(p + name), keep_float32=True))
            if subln_affine:
                source_shapes[p + "subln.weight"] = (2 * d,)
                steps.append(Step(p + "subln.weight", (p + "subln.weight",), _copy(p + "subln.weight")))
            else:  # early versions of the file used a weightless RMSNorm: weight = ones
                steps.append(Step(p + "subln.weight", (), lambda get: torch.ones(2 * d)))
        else:
            source_shapes[p + "lambda_proj.weight"] = (config.num_diff_heads, E)
            steps.append(Step(p + "lambda_proj.weight", (p + "lambda_proj.weight",), _copy(p + "lambda_proj.weight")))
    return Plan(source_shapes, _tied_optional(config, E), steps, config, target_shapes)


# -- key maps (Microsoft full models) ------------------------------------------------------------------------------


def load_key_map(key_map: str | os.PathLike | Mapping | None) -> list[tuple[re.Pattern, str]]:
    """Parse a key map: a JSON object ``{source_prefix: our_prefix}`` (a file path or a dict).

    Prefixes may contain ``{l}`` for a layer index. The longest matching source prefix wins; keys matching none keep
    their names. Example (fairseq/torchscale-style names)::

        {"decoder.embed_tokens.": "model.embed_tokens.",
         "decoder.layers.{l}.self_attn.": "model.layers.{l}.self_attn.",
         "decoder.layers.{l}.self_attn_layer_norm.": "model.layers.{l}.input_layernorm.",
         "decoder.layer_norm.": "model.norm.",
         "decoder.output_projection.": "lm_head."}
    """
    if key_map is None:
        return []
    if not isinstance(key_map, Mapping):
        path = Path(key_map)
        try:
            key_map = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConversionError(f"--key-map {str(path)!r} is not a readable JSON file: {err}") from err
    if not isinstance(key_map, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in key_map.items()):
        raise ConversionError('--key-map must be a JSON object of string prefixes, e.g. {"decoder.layers.{l}.": "model.layers.{l}."}.')
    rules = []
    for src, dst in sorted(key_map.items(), key=lambda kv: -len(kv[0])):
        if src.count("{l}") > 1 or dst.count("{l}") > src.count("{l}"):
            raise ConversionError(f"--key-map rule {src!r} → {dst!r}: '{{l}}' may appear at most once, and in the target only if in the source.")
        pattern = re.compile("^" + re.escape(src).replace(re.escape("{l}"), r"(?P<l>\d+)"))
        rules.append((pattern, dst))
    return rules


def rename_checkpoint(ckpt: Checkpoint, rules: list[tuple[re.Pattern, str]]) -> Checkpoint:
    if not rules:
        return ckpt
    mapping = {}
    for key in ckpt.shapes:
        new = key
        for pattern, dst in rules:
            m = pattern.match(key)
            if m:
                new = dst.replace("{l}", m.groupdict().get("l") or "") + key[m.end() :]
                break
        if new in mapping:
            raise ConversionError(f"--key-map maps both {mapping[new]!r} and {key!r} to {new!r}.")
        mapping[new] = key
    renamed = Checkpoint({k: ckpt.shapes[v] for k, v in mapping.items()}, {k: ckpt.dtypes[v] for k, v in mapping.items()}, lambda k: ckpt.get(mapping[k]))
    renamed._stack.callback(ckpt.close)
    return renamed


# -- ours → DiffLlama -----------------------------------------------------------------------------------------------


def diffllama_config_from(config: DiffTransformerConfig) -> DiffLlamaConfig:
    """Our V1 config → DiffLlama's, refusing what DiffLlama cannot represent exactly."""
    if config.diff_version != 1:
        raise ConversionError(f"--to diffllama: DiffLlama implements DIFF V1 only; this model has diff_version={config.diff_version}.")
    if config.lambda_init is not None:
        raise ConversionError(f"--to diffllama: DiffLlama always uses the depth schedule for λinit; this model sets lambda_init={config.lambda_init}.")
    if config.mlp_bias:
        raise ConversionError("--to diffllama: DiffLlama's MLP has no bias; this model has mlp_bias=True.")
    if not math.isclose(config.subln_eps, config.rms_norm_eps, rel_tol=0, abs_tol=0):
        raise ConversionError(
            f"--to diffllama: DiffLlama's per-head norm uses rms_norm_eps ({config.rms_norm_eps}), this model's uses "
            f"subln_eps ({config.subln_eps}); folding subln into o_proj is exact only when they are equal (SPEC §6)."
        )
    fields = _shared_fields(config)
    return DiffLlamaConfig(
        **fields,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        attention_bias=config.attention_bias,
        attention_dropout=0.0,
        lambda_std_dev=config.lambda_std,
    )


def to_diffllama(plan: Plan) -> Plan:
    """Compose a plan producing our V1 format with the map ours → DiffLlama (inverse row order, subln folded)."""
    config = plan.config
    dl_config = diffllama_config_from(config)
    target_shapes = _meta_shapes(DiffLlamaForCausalLM, dl_config)
    ours = {s.target: s for s in plan.steps}
    d, G = config.head_dim, config.num_kv_groups
    n = config.num_diff_heads // G
    q_rows = invert(expand_heads(v1_query_heads_from("diffllama", G, n), d))
    kv_rows = invert(expand_heads(v1_kv_heads_from("diffllama", G), d))
    steps = []
    for key in target_shapes:
        src = ours[key]
        if re.search(r"\.self_attn\.q_proj\.", key):
            steps.append(Step(key, src.sources, lambda get, s=src: s.fn(get).index_select(0, q_rows)))
        elif re.search(r"\.self_attn\.[kv]_proj\.", key):
            steps.append(Step(key, src.sources, lambda get, s=src: s.fn(get).index_select(0, kv_rows)))
        elif key.endswith("self_attn.o_proj.weight"):
            # DiffLlama's norm has no weight: Wo[:, 2hd + j] *= w[j] for every head h (SPEC §6).
            norm = ours[key.replace("o_proj.weight", "subln.weight")]

            def fold(get, s=src, w=norm):
                weight = s.fn(get)
                return (weight.float() * w.fn(get).float().repeat(config.num_diff_heads)).to(weight.dtype)

            steps.append(Step(key, src.sources + norm.sources, fold))
        else:
            steps.append(Step(key, src.sources, src.fn))
    return Plan(plan.source_shapes, plan.optional_sources, steps, dl_config, target_shapes, plan.exact, list(plan.notes))


# ----------------------------------------------------------------------------------------------------------------
# Checking and writing
# ----------------------------------------------------------------------------------------------------------------


def _listing(keys: Iterable[str], limit: int = 12) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def check_source(plan: Plan, ckpt: Checkpoint, source_name: str) -> None:
    """Every key and shape of the source must be accounted for; raise naming every offender."""
    expected = {**plan.optional_sources, **plan.source_shapes}
    missing = set(plan.source_shapes) - set(ckpt.shapes)
    unknown = set(ckpt.shapes) - set(expected)
    misshaped = {k: (ckpt.shapes[k], expected[k]) for k in set(ckpt.shapes) & set(expected) if tuple(ckpt.shapes[k]) != tuple(expected[k])}
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unknown:
        problems.append(f"unknown tensors: {_listing(unknown)}")
    if misshaped:
        problems.append("mis-shaped tensors: " + _listing(f"{k} {tuple(got)} (expected {tuple(want)})" for k, (got, want) in misshaped.items()))
    non_float = [k for k in plan.source_shapes if k in ckpt.dtypes and ckpt.dtypes[k] is not None and not ckpt.dtypes[k].is_floating_point]
    if non_float:
        problems.append(f"non-floating tensors: {_listing(non_float)}")
    if problems:
        raise ConversionError(
            f"The checkpoint does not match a --from {source_name} model with this config; "
            + "; ".join(problems)
            + ". Check --from, the config (head counts, sizes) and, for Microsoft sources, --key-map."
        )
    # Invariants of the plan itself (a bug here, not in the checkpoint); real checks, not asserts that -O removes.
    unused = set(plan.source_shapes) - {s for step in plan.steps for s in step.sources}
    if unused:
        raise ConversionError(f"internal: the conversion plan never reads {_listing(unused)}")
    if set(plan.target_shapes) != {s.target for s in plan.steps}:
        raise ConversionError("internal: the conversion plan and the target model's keys differ")


def _resolve_dtype(dtype, plan: Plan, ckpt: Checkpoint) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        cfg_dtype = getattr(plan.config, "dtype", None)
        if isinstance(cfg_dtype, str):
            cfg_dtype = getattr(torch, cfg_dtype, None)
        if isinstance(cfg_dtype, torch.dtype) and cfg_dtype.is_floating_point:
            return cfg_dtype
        # No dtype in the config (Microsoft sources): the dtype that holds most of the weights. λ vectors are float32
        # in every format and never decide it.
        counts: dict[torch.dtype, int] = {}
        for key, t in ckpt.dtypes.items():
            if t is not None and t.is_floating_point and not _is_lambda_vector(key):
                counts[t] = counts.get(t, 0) + math.prod(ckpt.shapes[key])
        return max(counts, key=counts.get) if counts else torch.float32
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r}; allowed: auto, {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def _prepare_output(output: Path, inputs: list[Path], overwrite: bool) -> None:
    out = output.resolve()
    for inp in inputs:
        inp = inp.resolve()
        if out == inp or out in inp.parents:
            raise ConversionError(f"--output {str(output)!r} would overwrite the input {str(inp)!r}; choose another folder.")
        if inp.is_dir() and inp in out.parents:
            raise ConversionError(
                f"--output {str(output)!r} lies inside the input folder {str(inp)!r}: a conversion never writes into its "
                "input; choose a folder outside it."
            )
    if out.exists():
        if not out.is_dir():
            raise ConversionError(f"--output {str(output)!r} exists and is not a folder.")
        if any(out.iterdir()) and not overwrite:
            raise ConversionError(f"--output {str(output)!r} is not empty; pass --overwrite (overwrite=True) to replace it.")


def _install(tmp: Path, output: Path) -> None:
    """Move the finished temporary folder into place; an existing output is replaced only now."""
    backup = None
    if output.exists():
        backup = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
        backup.rmdir()
        os.replace(output, backup)
    try:
        os.replace(tmp, output)
    except BaseException:
        if backup is not None:
            os.replace(backup, output)
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def write_plan(
    plan: Plan,
    ckpt: Checkpoint,
    folder: Path,
    dtype: torch.dtype,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = True,
) -> None:
    """Compute and write every tensor of ``plan`` into ``folder`` as (sharded) safetensors, one shard in memory."""
    steps = {s.target: s for s in plan.steps}
    wide = torch.float32 if dtype.itemsize < 4 else dtype
    out_dtype = {k: wide if step.keep_float32 else dtype for k, step in steps.items()}
    # Shard boundaries from shapes alone (meta tensors), exactly as save_pretrained would place them.
    metas = {k: torch.empty(plan.target_shapes[k], dtype=out_dtype[k], device="meta") for k in plan.target_shapes}
    split = split_torch_state_dict_into_shards(metas, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    with tqdm(total=len(steps), desc="Converting tensors", unit="tensor", disable=not progress) as bar:
        for filename, names in split.filename_to_tensors.items():
            shard = {}
            for name in names:
                tensor = steps[name].fn(ckpt.get)
                if tuple(tensor.shape) != tuple(plan.target_shapes[name]):
                    raise ConversionError(f"internal: {name} computed with shape {tuple(tensor.shape)}, expected {plan.target_shapes[name]}.")
                shard[name] = tensor.to(device="cpu", dtype=out_dtype[name]).contiguous()
                bar.update()
            save_file(shard, str(folder / filename), metadata={"format": "pt"})
            del shard
    if split.is_sharded:
        total = sum(math.prod(s) for s in plan.target_shapes.values())
        index = {"metadata": {"total_parameters": total, **split.metadata}, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_config(config: PreTrainedConfig, folder: Path, dtype: torch.dtype) -> None:
    config.dtype = dtype
    if isinstance(config, DiffTransformerConfig):
        config.architectures = ["DiffTransformerForCausalLM"]
        # As DiffTransformerForCausalLM.save_pretrained: both source files beside the weights, every Auto class in
        # auto_map, so the folder loads with trust_remote_code where the package is absent.
        with torch.device("meta"):
            model = DiffTransformerForCausalLM(config)
        custom_object_save(model, folder)
        config.auto_map = {
            "AutoConfig": f"configuration_difftransformer.{DiffTransformerConfig.__name__}",
            **{auto: f"modeling_difftransformer.{cls}" for auto, cls in _AUTO_MAP.items()},
        }
    else:
        config.architectures = ["DiffLlamaForCausalLM"]
    config.save_pretrained(folder)


def _copy_side_files(inputs: list[Path], folder: Path, generation_config=None) -> list[str]:
    copied = []
    for inp in inputs:
        for name in (*TOKENIZER_FILES, GENERATION_CONFIG_FILE):
            if (inp / name).is_file() and not (folder / name).exists():
                shutil.copyfile(inp / name, folder / name)
                copied.append(name)
    if generation_config is not None and not (folder / GENERATION_CONFIG_FILE).exists():
        generation_config.save_pretrained(folder)
        copied.append(GENERATION_CONFIG_FILE)
    return copied


# ----------------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ConversionResult:
    output: Path
    config: PreTrainedConfig
    exact: bool
    notes: list[str]
    copied_files: list[str]
    max_logit_diff: float | None = None


def _read_config_json(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder} has no config.json; every source folder needs one (see docs/convert.md).")
    return json.loads(path.read_text())


_EXPECTED_MODEL_TYPE = {"diffllama": ("diffllama",), "difftransformer": ("difftransformer",), "llama": LLAMA_STYLE_MODEL_TYPES}


def _check_model_type(source: str, found: str | None) -> None:
    expected = _EXPECTED_MODEL_TYPE[source]
    if found not in expected:
        hint = {"diffllama": "diffllama", "difftransformer": "difftransformer"}.get(found, "llama" if found in LLAMA_STYLE_MODEL_TYPES else None)
        raise ConversionError(
            f"--from {source} expects config.json model_type in {list(expected)}, found {found!r}"
            + (f"; did you mean --from {hint}?" if hint else ".")
        )


def build_plan(
    source: str,
    target: str,
    config,
    diff_version: int | None = None,
    microsoft_module: str | None = None,
    subln_affine: bool = True,
    seed: int = 0,
) -> Plan:
    """The conversion plan for a source config (a transformers config, or a dict for Microsoft sources)."""
    if source not in SOURCES:
        raise ConversionError(f"--from {source!r}; allowed: {list(SOURCES)}.")
    if target not in TARGETS:
        raise ConversionError(f"--to {target!r}; allowed: {list(TARGETS)}.")
    implied = {"diffllama": 1, "microsoft-v1": 1, "microsoft-v2": 2}.get(source)
    if source == "difftransformer":
        implied = config.diff_version
    if source == "llama":
        if diff_version is None:
            raise ConversionError("--from llama needs --diff-version 1 (approximate, needs training) or 2 (exact upcycling).")
    elif diff_version is not None and diff_version != implied:
        raise ConversionError(f"--diff-version {diff_version} conflicts with --from {source}, which gives DIFF V{implied}.")
    if source == "diffllama" and target == "diffllama":
        raise ConversionError("--from diffllama --to diffllama: nothing to convert; use --to difftransformer.")
    if source == "difftransformer":
        plan = plan_from_difftransformer(config)
    elif source == "diffllama":
        plan = plan_from_diffllama(config)
    elif source == "llama":
        plan = plan_from_llama(config, diff_version, seed)
    else:
        plan = plan_from_microsoft(config, 1 if source == "microsoft-v1" else 2, microsoft_module, subln_affine)
    return to_diffllama(plan) if target == "diffllama" else plan


def convert(
    source: str,
    input,
    output: str | os.PathLike,
    target: str = "difftransformer",
    *,
    diff_version: int | None = None,
    dtype: str | torch.dtype | None = "auto",
    verify: bool = False,
    overwrite: bool = False,
    allow_pickle: bool = False,
    key_map: str | os.PathLike | Mapping | None = None,
    source_config: Mapping | None = None,
    microsoft_module: str | None = None,
    seed: int = 0,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = True,
) -> ConversionResult:
    """Convert a checkpoint (SPEC §6). See the module docstring and docs/convert.md.

    Args:
        source: one of ``SOURCES``. target: ``"difftransformer"`` or ``"diffllama"``.
        input: a folder (safetensors, sharded or not; ``pytorch_model.bin`` only with ``allow_pickle``), an
            in-memory ``PreTrainedModel``, or (Microsoft sources) a state dict together with ``source_config``.
        output: the folder to create. Refused if it is or contains the input, or is non-empty without ``overwrite``.
        diff_version: required for ``source="llama"`` (2: exact, 1: approximate upcycling).
        dtype: ``"auto"`` (the source's), ``"float32"``, ``"float16"``, ``"bfloat16"`` or a ``torch.dtype``.
        verify: run source and result on a fixed prompt and record ``max_logit_diff`` (loads both models).
        key_map: Microsoft sources: JSON file or dict of key prefixes, see :func:`load_key_map`.
        source_config: Microsoft sources: the config dict when ``input`` is a state dict (else read from
            ``input/config.json``); a folder's config.json may be overridden by it.
        microsoft_module: which Microsoft V1 module produced the weights (needed under GQA).
        seed: seed of the λ initialisation for Llama → V1 upcycling.
        max_shard_size: largest shard (bytes or "5GB"); larger results are sharded with an index. Peak memory is
            about one shard plus the source tensors it reads (memory-mapped).
    """
    output = Path(output)
    in_folder = Path(input) if isinstance(input, (str, os.PathLike)) else None
    model = input if hasattr(input, "state_dict") and hasattr(input, "config") else None
    if in_folder is None and model is None and not isinstance(input, Mapping):
        raise ConversionError(f"input must be a folder, a transformers model or (Microsoft sources) a state dict; got {type(input).__name__}.")
    if in_folder is not None and not in_folder.is_dir():
        raise ConversionError(f"--input {str(in_folder)!r} is not a folder.")
    _prepare_output(output, [in_folder] if in_folder is not None else [], overwrite)

    # Source config.
    if source.startswith("microsoft"):
        if model is not None:
            raise ConversionError("Microsoft sources are state dicts: pass a folder or a state dict with source_config.")
        cfg = dict(_read_config_json(in_folder)) if in_folder is not None else {}
        cfg.update(source_config or {})
        src_config = cfg
    elif source in SOURCES:
        if model is not None:
            src_config = model.config
            _check_model_type(source, src_config.model_type)
        elif in_folder is not None:
            _check_model_type(source, _read_config_json(in_folder).get("model_type"))
            src_config = AutoConfig.from_pretrained(in_folder)
        else:
            raise ConversionError(f"--from {source} takes a folder or a transformers model, not a bare state dict.")
    else:
        raise ConversionError(f"--from {source!r}; allowed: {list(SOURCES)}.")

    # Checkpoint, plan, checks: all before anything is written.
    if in_folder is not None:
        ckpt = Checkpoint.from_folder(in_folder, allow_pickle=allow_pickle)
    else:
        ckpt = Checkpoint.from_state_dict(model.state_dict() if model is not None else input)
    try:
        subln_affine = True
        if source.startswith("microsoft"):
            ckpt = rename_checkpoint(ckpt, load_key_map(key_map))
            subln_affine = _microsoft_subln_affine(ckpt)
        elif key_map is not None:
            raise ConversionError("--key-map applies to Microsoft sources only.")
        plan = build_plan(source, target, src_config, diff_version, microsoft_module, subln_affine, seed)
        check_source(plan, ckpt, source)
        out_dtype = _resolve_dtype(dtype, plan, ckpt)
        for note in plan.notes:
            logger.warning(note)

        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.converting-", dir=output.parent))
        try:
            write_plan(plan, ckpt, tmp, out_dtype, max_shard_size, progress)
            _write_config(plan.config, tmp, out_dtype)
            copied = _copy_side_files(
                [in_folder] if in_folder is not None else [], tmp, getattr(model, "generation_config", None) if model is not None else None
            )
            _install(tmp, output)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        ckpt.close()

    result = ConversionResult(output, plan.config, plan.exact, plan.notes, copied)
    if verify:
        result.max_logit_diff = verify_conversion(source, input, output)
    return result


def _microsoft_subln_affine(ckpt: Checkpoint) -> bool:
    """True when the V1 modules carry ``subln.weight`` (current files); False when none do (the early weightless
    norm). A checkpoint where only some layers have it is left to ``check_source``, which names the missing ones."""
    return any(k.endswith(".subln.weight") for k in ckpt.shapes) or not any(k.endswith(".lambda_q1") for k in ckpt.shapes)


# ----------------------------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------------------------


def verify_prompt(vocab_size: int, length: int = 16) -> torch.Tensor:
    """The fixed prompt of ``--verify``: a deterministic spread of token ids (no tokenizer needed)."""
    return (torch.arange(length) * 7919 + 3).remainder(vocab_size)[None, :]


@torch.no_grad()
def verify_conversion(source: str, input, output: str | os.PathLike) -> float | None:
    """Run the source model and the converted one on :func:`verify_prompt` in float32; return the max |Δ logit|.

    Microsoft sources have no runnable model in transformers; for them only the result is run (finite logits).
    """
    result = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32).eval()
    ids = verify_prompt(result.config.vocab_size)
    new_logits = result(ids).logits
    if not torch.isfinite(new_logits).all():
        raise ConversionError(f"--verify: the converted model in {output} produces non-finite logits.")
    if source.startswith("microsoft"):
        print("verify: Microsoft modules have no transformers implementation to compare with; the result loads and its logits are finite.")
        return None
    if isinstance(input, (str, os.PathLike)):
        reference = AutoModelForCausalLM.from_pretrained(input, dtype=torch.float32).eval()
    else:
        reference = input
    was_training = reference.training
    reference.eval()
    ref_logits = reference(ids.to(reference.device)).logits.float().cpu()
    reference.train(was_training)
    diff = (ref_logits - new_logits).abs().max().item()
    print(f"verify: max |logit difference| between source and result on a {ids.shape[1]}-token prompt: {diff:.3e}")
    return diff


__all__ = [
    "SOURCES",
    "TARGETS",
    "Checkpoint",
    "ConversionError",
    "ConversionResult",
    "Plan",
    "Step",
    "build_plan",
    "check_source",
    "config_from_diffllama",
    "config_from_llama",
    "config_from_microsoft",
    "convert",
    "diffllama_config_from",
    "interleaved_to_rotate_half",
    "load_key_map",
    "verify_conversion",
    "verify_prompt",
]
