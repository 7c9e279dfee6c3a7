"""Motif-2.6B / Motif-2-12.7B (``model_type "Motif"``) → ours: ``--from motif``.

Motif's key names are ours (``mlp.act_fn.{weight,bias}`` is PolyNorm's, ``hidden_act="poly_norm"``); its config counts
half-heads as ours does. The conversion writes every tensor unchanged except ``q_proj`` (rows reordered from Motif's
``[signal × r, noise]`` per noise head into ours, per KV group, when a KV group holds several noise heads; the
identity for both released models) and sets the options that express Motif's forward (:mod:`difftransformer.motif`):
``num_noise_heads``, ``lambda_init_layer_offset = -1``, ``subln_eps = attn_rms_norm_eps``. Rotary ``inv_freq``
buffers a checkpoint may hold are dropped (recomputed from ``rope_theta``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..configuration_difftransformer import DiffTransformerConfig
from ..modeling_difftransformer import DiffTransformerForCausalLM
from ..motif import motif_query_rows
from .engine import Plan, Step, copy_of, is_lambda_vector, meta_shapes, rows_of, shared_fields, tied_lm_head_shapes

# Fields of a Motif config.json that hold counts and epsilons, checked before any config class divides by them.
_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_POSITIVE_INT_FIELDS = ("num_key_value_heads", "num_noise_heads", "head_dim", "max_position_embeddings")


def check_motif_fields(raw: Mapping) -> None:
    """The counts and epsilons of a raw Motif ``config.json``: a ``ValueError`` naming the field (the caller adds the
    file) before transformers' or our config class divides by a zero head count."""
    for name in _POSITIVE_INT_FIELDS + _OPTIONAL_POSITIVE_INT_FIELDS:
        value = raw.get(name)
        if value is None and name in _OPTIONAL_POSITIVE_INT_FIELDS:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    for name in ("rms_norm_eps", "attn_rms_norm_eps"):
        value = raw.get(name, 1e-5)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"`{name}` must be a positive number (a norm's epsilon), got {value!r}.")


def config_from_motif(src) -> DiffTransformerConfig:
    """A :class:`~difftransformer.motif.MotifConfig` → our config (``model_type "difftransformer"``), same function."""
    return DiffTransformerConfig(
        **shared_fields(src),
        num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_key_value_heads,
        head_dim=src.head_dim,
        num_noise_heads=src.num_noise_heads,
        attention_bias=src.attention_bias,
        mlp_bias=src.mlp_bias,
        diff_version=1,
        lambda_init=src.lambda_init,
        lambda_std=src.lambda_std,
        subln_eps=src.subln_eps,
        lambda_init_layer_offset=src.lambda_init_layer_offset,
    )


def plan_from_motif(src, query_rows_in_motif_order: bool = True) -> Plan:
    """Every tensor copied, ``q_proj`` rows reordered into ours. ``query_rows_in_motif_order=False`` for a
    ``MotifForCausalLM`` in memory, whose rows were already reordered when it was loaded."""
    config = config_from_motif(src)
    shapes = meta_shapes(DiffTransformerForCausalLM, config)
    rows = motif_query_rows(config) if query_rows_in_motif_order else None
    steps = []
    for key in shapes:
        if rows is not None and key.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            steps.append(Step(key, (key,), rows_of(key, rows)))
        else:
            steps.append(Step(key, (key,), copy_of(key), keep_float32=is_lambda_vector(key)))
    optional = tied_lm_head_shapes(config, config.hidden_size)
    half = config.head_dim // 2
    optional["model.rotary_emb.inv_freq"] = (half,)
    for layer in range(config.num_hidden_layers):
        optional[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = (half,)
    return Plan(dict(shapes), optional, steps, config, shapes)
