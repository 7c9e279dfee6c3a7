"""transformers' DiffLlama ↔ DIFF V1 (docs/convert.md): ``--from diffllama`` and ``--to diffllama``.

DiffLlama orders query rows ``(c, g, r)`` and key/value rows ``(c, g)``; ours are ``(g, c, r)`` / ``(g, c)``. Its
per-head norm has no weight and uses ``rms_norm_eps``: ``subln.weight`` = ones, ``subln_eps`` = its eps. The way back
applies the inverse permutation and folds ``subln.weight`` into ``o_proj`` columns.
"""

from __future__ import annotations

import math
import re

import torch
from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

from ..configuration_difftransformer import DiffTransformerConfig
from ..modeling_difftransformer import DiffTransformerForCausalLM
from .engine import (
    ConversionError,
    Plan,
    Step,
    attention_prefix,
    common_steps,
    copy_of,
    expand_heads,
    invert,
    meta_shapes,
    rows_of,
    shared_fields,
    tied_lm_head_shapes,
    v1_kv_heads_from,
    v1_query_heads_from,
)


def config_from_diffllama(src: DiffLlamaConfig) -> DiffTransformerConfig:
    """DiffLlama config → V1 config. Its per-head norm has no weight and uses ``rms_norm_eps`` (docs/convert.md)."""
    if src.attention_dropout not in (None, 0, 0.0):
        raise ConversionError(
            f"DiffLlama attention_dropout={src.attention_dropout}: the Differential Transformer defines none; expected "
            "0."
        )
    return DiffTransformerConfig(
        **shared_fields(src),
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
    source_shapes = meta_shapes(DiffLlamaForCausalLM, src)
    target_shapes = meta_shapes(DiffTransformerForCausalLM, config)
    d, G = config.head_dim, config.num_kv_groups
    n = config.num_diff_heads // G
    q_rows = expand_heads(v1_query_heads_from("diffllama", G, n), d)
    kv_rows = expand_heads(v1_kv_heads_from("diffllama", G), d)
    steps = common_steps(target_shapes)
    for layer in range(config.num_hidden_layers):
        p = attention_prefix(layer)
        for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            for kind in ("weight", "bias") if config.attention_bias else ("weight",):
                steps.append(Step(f"{p}{proj}.{kind}", (f"{p}{proj}.{kind}",), rows_of(f"{p}{proj}.{kind}", rows)))
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            steps.append(Step(f"{p}o_proj.{kind}", (f"{p}o_proj.{kind}",), copy_of(f"{p}o_proj.{kind}")))
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            steps.append(Step(p + name, (p + name,), copy_of(p + name), keep_float32=True))
        steps.append(Step(p + "subln.weight", (), lambda get: torch.ones(2 * d)))
    return Plan(source_shapes, tied_lm_head_shapes(config, config.hidden_size), steps, config, target_shapes)


def diffllama_config_from(config: DiffTransformerConfig) -> DiffLlamaConfig:
    """Our V1 config → DiffLlama's, refusing what DiffLlama cannot represent exactly."""
    if config.diff_version != 1:
        raise ConversionError(
            f"--to diffllama: DiffLlama implements DIFF V1 only; this model has diff_version={config.diff_version}."
        )
    if config.lambda_init is not None:
        raise ConversionError(
            "--to diffllama: DiffLlama always uses the depth schedule for λinit; this model sets "
            f"lambda_init={config.lambda_init}."
        )
    if config.lambda_init_layer_offset:
        raise ConversionError(
            f"--to diffllama: DiffLlama's λinit schedule reads the layer index itself; this model sets "
            f"lambda_init_layer_offset={config.lambda_init_layer_offset} (Motif's schedule)."
        )
    if config.hidden_act == "poly_norm":
        raise ConversionError(
            "--to diffllama: DiffLlama's MLP takes transformers' activations; this model has hidden_act='poly_norm'."
        )
    if config.mlp_bias:
        raise ConversionError("--to diffllama: DiffLlama's MLP has no bias; this model has mlp_bias=True.")
    if not math.isclose(config.subln_eps, config.rms_norm_eps, rel_tol=0, abs_tol=0):
        raise ConversionError(
            f"--to diffllama: DiffLlama's per-head norm uses rms_norm_eps ({config.rms_norm_eps}), this model's uses "
            f"subln_eps ({config.subln_eps}); folding subln into o_proj is exact only when they are equal "
            "(docs/convert.md)."
        )
    fields = shared_fields(config)
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
    target_shapes = meta_shapes(DiffLlamaForCausalLM, dl_config)
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
            # DiffLlama's norm has no weight: Wo[:, 2hd + j] *= w[j] for every head h (docs/convert.md).
            norm = ours[key.replace("o_proj.weight", "subln.weight")]

            def fold(get, s=src, w=norm):
                weight = s.fn(get)
                return (weight.float() * w.fn(get).float().repeat(config.num_diff_heads)).to(weight.dtype)

            steps.append(Step(key, src.sources + norm.sources, fold))
        else:
            steps.append(Step(key, src.sources, src.fn))
    return Plan(
        plan.source_shapes,
        plan.optional_sources,
        steps,
        dl_config,
        target_shapes,
        plan.exact,
        list(plan.notes),
        dict(plan.info),
    )
