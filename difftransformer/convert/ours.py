"""``--from difftransformer``: our own format, every tensor copied (a re-save with another dtype or shard size, or the
start of ``--to diffllama``)."""

from __future__ import annotations

from ..configuration_difftransformer import DiffTransformerConfig
from ..modeling_difftransformer import DiffTransformerForCausalLM
from .engine import Plan, Step, copy_of, is_lambda_vector, meta_shapes, tied_lm_head_shapes


def plan_from_difftransformer(config) -> Plan:
    """Every tensor copied; λ vectors stay float32."""
    # A fresh config of our class: never mutate a caller's model config, and accept one loaded as remote code.
    config = DiffTransformerConfig.from_dict(config.to_dict())
    shapes = meta_shapes(DiffTransformerForCausalLM, config)
    steps = [Step(k, (k,), copy_of(k), keep_float32=is_lambda_vector(k)) for k in shapes]
    return Plan(dict(shapes), tied_lm_head_shapes(config, config.hidden_size), steps, config, shapes)
