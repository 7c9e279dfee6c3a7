"""Microsoft's reference modules → ours (docs/convert.md): ``--from microsoft-v1`` and ``--from microsoft-v2``.

Microsoft released attention modules, not models: a full-model state dict uses Llama names outside attention and
Microsoft's own names inside it (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (V1) / ``o_proj`` (V2),
``lambda_*``, ``subln.weight``, ``lambda_proj``). A JSON key map (:func:`load_key_map`) renames other layouts into
that one. Head counts follow Microsoft's convention: its ``num_heads`` is our ``H``, its ``num_kv_heads`` our ``G``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from ..configuration_difftransformer import DiffTransformerConfig
from ..modeling_difftransformer import DiffTransformerForCausalLM
from .engine import (
    Checkpoint,
    ConversionError,
    Plan,
    Step,
    attention_prefix,
    common_steps,
    copy_of,
    expand_heads,
    interleaved_to_rotate_half,
    meta_shapes,
    rows_of,
    tied_lm_head_shapes,
    v1_query_heads_from,
)

MICROSOFT_V1_MODULES = ("MultiheadDiffAttn", "MultiheadFlashDiff1", "MultiheadFlashDiff2")

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
        raise ConversionError(
            f"Unknown field(s) {unknown} in the Microsoft source config; allowed: {sorted(MICROSOFT_CONFIG_FIELDS)}."
        )
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_heads"):
        if name not in cfg:
            raise ConversionError(
                f"The Microsoft source config lacks {name!r}. Required: vocab_size, hidden_size, intermediate_size, "
                "num_hidden_layers, num_heads (Microsoft's num_heads = differential heads, half a baseline "
                "Transformer's); optional num_kv_heads (null = MHA), head_dim, rms_norm_eps, rope_theta, ..."
            )
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
    ):
        value = cfg.get(name)
        if value is None and name in ("num_kv_heads", "head_dim"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")  # the caller names the file
    E, H = cfg["hidden_size"], cfg["num_heads"]
    G = cfg.get("num_kv_heads") or H
    if H % G:
        raise ConversionError(f"num_heads ({H}) must be a multiple of num_kv_heads ({G}).")
    if version == 1:
        # MultiheadDiffAttn / MultiheadFlashDiff*: head_dim = embed_dim // num_heads // 2, fixed by the module.
        if E % (2 * H):
            raise ConversionError(
                f"hidden_size ({E}) must be divisible by 2 * num_heads ({2 * H}) for Microsoft's V1 modules."
            )
        d = E // H // 2
        if cfg.get("head_dim") not in (None, d):
            raise ConversionError(
                f"head_dim={cfg['head_dim']}: Microsoft's V1 modules fix head_dim = hidden_size // num_heads // 2 = "
                f"{d}."
            )
        module = cfg.get("attention_module")
        if module is not None and module not in MICROSOFT_V1_MODULES:
            raise ConversionError(f"attention_module={module!r}; allowed: {list(MICROSOFT_V1_MODULES)}.")
    else:
        d = cfg.get("head_dim") or E // H
        module = cfg.get("attention_module", "MultiheadFlashDiffV2")
        if module != "MultiheadFlashDiffV2":
            raise ConversionError(f"attention_module={module!r}; --from microsoft-v2 expects 'MultiheadFlashDiffV2'.")
    kwargs = {
        k: cfg[k]
        for k in cfg
        if k in MICROSOFT_CONFIG_FIELDS - {"num_heads", "num_kv_heads", "attention_module", "torch_dtype", "head_dim"}
    }
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


def plan_from_microsoft(
    cfg: Mapping, version: int, attention_module: str | None = None, subln_affine: bool = True
) -> Plan:
    """Microsoft V1/V2 full-model state dict (Llama names, Microsoft attention modules) → ours (docs/convert.md)."""
    cfg = dict(cfg)
    if attention_module is not None:
        cfg["attention_module"] = attention_module
    config, info = config_from_microsoft(cfg, version)
    G, n, module = info["G"], info["n"], info["module"]
    if version == 1 and n > 1:
        if module is None:
            raise ConversionError(
                f"This V1 checkpoint uses GQA (num_heads / num_kv_heads = {n}), where Microsoft's files differ: say "
                "which module produced it with --microsoft-module (or 'attention_module' in its config.json), one of "
                f"{list(MICROSOFT_V1_MODULES)}."
            )
        if module == "MultiheadDiffAttn":
            raise ConversionError(
                "Checkpoints from Microsoft's naive MultiheadDiffAttn (multihead_diffattn.py) with GQA (num_heads / "
                f"num_kv_heads = {n} > 1) are not DIFF V1: that file repeats key heads over adjacent query heads, so "
                "both softmax maps of a differential head read the same key head instead of K1 and K2 "
                "(docs/convert.md). They cannot be represented here; only n = 1 (MHA) checkpoints from that file "
                "convert."
            )
    target_shapes = meta_shapes(DiffTransformerForCausalLM, config)
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
    steps = common_steps(target_shapes)
    for layer in range(config.num_hidden_layers):
        p = attention_prefix(layer)
        q_shape, kv_shape = target_shapes[p + "q_proj.weight"], target_shapes[p + "k_proj.weight"]
        source_shapes.update(
            {p + "q_proj.weight": q_shape, p + "k_proj.weight": kv_shape, p + "v_proj.weight": kv_shape}
        )
        source_shapes[f"{p}{out_name}.weight"] = target_shapes[p + "o_proj.weight"]
        steps += [
            Step(p + "q_proj.weight", (p + "q_proj.weight",), rows_of(p + "q_proj.weight", q_rows)),
            Step(p + "k_proj.weight", (p + "k_proj.weight",), rows_of(p + "k_proj.weight", k_rows)),
            Step(p + "v_proj.weight", (p + "v_proj.weight",), copy_of(p + "v_proj.weight")),
            Step(p + "o_proj.weight", (f"{p}{out_name}.weight",), copy_of(f"{p}{out_name}.weight")),
        ]
        if version == 1:
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                source_shapes[p + name] = (d,)
                steps.append(Step(p + name, (p + name,), copy_of(p + name), keep_float32=True))
            if subln_affine:
                source_shapes[p + "subln.weight"] = (2 * d,)
                steps.append(Step(p + "subln.weight", (p + "subln.weight",), copy_of(p + "subln.weight")))
            else:  # early versions of the file used a weightless RMSNorm: weight = ones
                steps.append(Step(p + "subln.weight", (), lambda get: torch.ones(2 * d)))
        else:
            source_shapes[p + "lambda_proj.weight"] = (config.num_diff_heads, E)
            steps.append(Step(p + "lambda_proj.weight", (p + "lambda_proj.weight",), copy_of(p + "lambda_proj.weight")))
    return Plan(source_shapes, tied_lm_head_shapes(config, E), steps, config, target_shapes)


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
    if not isinstance(key_map, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in key_map.items()
    ):
        raise ConversionError(
            '--key-map must be a JSON object of string prefixes, e.g. {"decoder.layers.{l}.": "model.layers.{l}."}.'
        )
    rules = []
    for src, dst in sorted(key_map.items(), key=lambda kv: -len(kv[0])):
        if src.count("{l}") > 1 or dst.count("{l}") > src.count("{l}"):
            raise ConversionError(
                f"--key-map rule {src!r} → {dst!r}: '{{l}}' may appear at most once, and in the target only if in the "
                "source."
            )
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
    renamed = Checkpoint(
        {k: ckpt.shapes[v] for k, v in mapping.items()},
        {k: ckpt.dtypes[v] for k, v in mapping.items()},
        lambda k: ckpt.get(mapping[k]),
    )
    renamed.on_close(ckpt.close)
    return renamed


def microsoft_subln_affine(ckpt: Checkpoint) -> bool:
    """True when the V1 modules carry ``subln.weight`` (current files); False when none do (the early weightless
    norm). A checkpoint where only some layers have it is left to ``check_source``, which names the missing ones."""
    return any(k.endswith(".subln.weight") for k in ckpt.shapes) or not any(
        k.endswith(".lambda_q1") for k in ckpt.shapes
    )
