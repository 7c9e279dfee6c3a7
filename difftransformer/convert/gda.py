"""Grouped differential attention (GDA) ↔ the same model written as a plain DIFF V1/V2 model (``--to duplicated``,
``--to gda``).

A GDA model (``num_noise_heads`` N < ``num_attention_heads`` / 2, so r = H / N signal heads share a noise head)
computes exactly the function of a plain model (r = 1) whose every signal head has its own copy of its noise head's
query rows: ``A_h − λ A_noise(h)`` is the same map either way. Written that way (``gda_to_duplicated``), a tool that
knows only plain V1/V2 models can run it, at the cost of r − 1 extra query rows per noise head. The way back
(``duplicated_to_gda``) keeps one copy of each noise head's rows and refuses a model whose copies differ (then it is
not a duplicated GDA model). Keys, values, ``o_proj``, λ and everything else are unchanged in both directions.

This module holds the plan transforms (``--to duplicated`` / ``--to gda``); :func:`~difftransformer.convert.api.
gda_to_duplicated` and :func:`~difftransformer.convert.api.duplicated_to_gda` apply them to a model in memory or a
folder.

Row orders (docs/model.md): V1 GDA has, per KV group g, its n signal rows then its m = n / r noise rows; V1 plain has
``(g, c, j)``: the group's n signal rows, then n noise rows, noise row j of the group pairing with signal j. V2 GDA has
``[signal × r, noise]`` per noise head; V2 plain has adjacent pairs ``(2h, 2h + 1)``.
"""

from __future__ import annotations

import re

import torch

from ..configuration_difftransformer import DiffTransformerConfig
from ..modeling_difftransformer import DiffTransformerForCausalLM
from .engine import ConversionError, Plan, Step, expand_heads, meta_shapes


def gda_query_heads(config: DiffTransformerConfig) -> torch.Tensor:
    """For every query head of the duplicated (r = 1) model, the query head of the GDA model ``config`` it copies."""
    r, groups = config.noise_ratio, config.num_kv_groups
    index = []
    if config.diff_version == 1:
        n, m = config.num_diff_heads // groups, config.noise_heads // groups
        for g in range(groups):
            base = g * (n + m)
            index += [base + j for j in range(n)] + [base + n + j // r for j in range(n)]
    else:
        for h in range(config.num_diff_heads):
            k, j = divmod(h, r)
            index += [k * (r + 1) + j, k * (r + 1) + r]
    return torch.tensor(index)


def duplicated_config(config: DiffTransformerConfig) -> DiffTransformerConfig:
    """The plain (r = 1) config of the duplicated form: ``num_attention_heads = 2H``, ``num_noise_heads`` unset."""
    fields = config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "auto_map"):
        fields.pop(key, None)
    fields.update(num_attention_heads=2 * config.num_diff_heads, num_noise_heads=None, head_dim=config.head_dim)
    return DiffTransformerConfig(**fields)


def grouped_config(config: DiffTransformerConfig, num_noise_heads: int) -> DiffTransformerConfig:
    """The GDA config of a plain model whose noise rows come in ``r = H / num_noise_heads`` copies."""
    if config.noise_ratio != 1:
        raise ConversionError(
            f"--to gda: the model is already grouped (num_noise_heads={config.num_noise_heads}, r = "
            f"{config.noise_ratio}); convert a plain model (r = 1) whose noise heads are duplicated."
        )
    heads = config.num_diff_heads
    if (
        isinstance(num_noise_heads, bool)
        or not isinstance(num_noise_heads, int)
        or num_noise_heads <= 0
        or heads % num_noise_heads
    ):
        allowed = [k for k in range(1, heads + 1) if heads % k == 0]
        raise ConversionError(
            f"--num-noise-heads must divide the {heads} differential heads; one of {allowed}, got {num_noise_heads!r}."
        )
    fields = config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "auto_map"):
        fields.pop(key, None)
    fields.update(
        num_attention_heads=heads + num_noise_heads, num_noise_heads=num_noise_heads, head_dim=config.head_dim
    )
    try:
        return DiffTransformerConfig(**fields)
    except ValueError as err:
        raise ConversionError(f"--num-noise-heads {num_noise_heads}: {' '.join(str(err).split())}") from None


# The query projection of every layer (the tensors GDA and its duplicated form differ in).
QUERY_PROJ = re.compile(r"\.self_attn\.q_proj\.(weight|bias)$")


def to_duplicated(plan: Plan) -> Plan:
    """Compose a plan producing a GDA model with the duplication of its noise query rows (exact)."""
    config = plan.config
    if config.noise_ratio == 1:
        raise ConversionError(
            "--to duplicated: the model is not grouped (num_noise_heads unset or num_attention_heads / 2, r = 1): it "
            "is already a plain DIFF model; use --to difftransformer."
        )
    new_config = duplicated_config(config)
    rows = expand_heads(gda_query_heads(config), config.head_dim)
    steps = []
    for step in plan.steps:
        if QUERY_PROJ.search(step.target):
            steps.append(
                Step(step.target, step.sources, lambda get, s=step: s.fn(get).index_select(0, rows), step.keep_float32)
            )
        else:
            steps.append(step)
    target_shapes = meta_shapes(DiffTransformerForCausalLM, new_config)
    notes = list(plan.notes) + [
        f"Written as a plain DIFF V{config.diff_version} model: each of the {config.noise_heads} noise heads' query "
        f"rows duplicated {config.noise_ratio} times (num_attention_heads {config.num_attention_heads} -> "
        f"{new_config.num_attention_heads}); same function."
    ]
    return Plan(
        plan.source_shapes, plan.optional_sources, steps, new_config, target_shapes, plan.exact, notes, dict(plan.info)
    )


def to_gda(plan: Plan, num_noise_heads: int) -> Plan:
    """Compose a plan producing a plain model with keeping one copy of each noise head's query rows. Every copy is
    compared with the kept one while the tensor is written; copies that differ stop the conversion (nothing is
    installed) with the layer and heads named."""
    config = plan.config
    new_config = grouped_config(config, num_noise_heads)
    d = config.head_dim
    source_heads = gda_query_heads(new_config)  # plain query head i copies GDA head source_heads[i]
    keep = torch.tensor([int((source_heads == k).nonzero()[0]) for k in range(new_config.num_attention_heads)])
    rows = expand_heads(keep, d)

    def deduplicate(get, step):
        tensor = step.fn(get)
        kept = tensor.index_select(0, rows)
        copies = kept.index_select(0, expand_heads(source_heads, d))
        if not torch.equal(copies, tensor):
            heads = sorted({int(i) // d for i in (copies != tensor).reshape(tensor.shape[0], -1).any(-1).nonzero()})
            raise ConversionError(
                f"--to gda --num-noise-heads {num_noise_heads}: in {step.target} the query heads {heads} differ from "
                "the copy of their noise head that is kept: the model is not a duplicated GDA model with r = "
                f"{new_config.noise_ratio} (its noise heads are not {new_config.noise_ratio} identical copies)."
            )
        return kept

    steps = [
        Step(s.target, s.sources, lambda get, s=s: deduplicate(get, s), s.keep_float32)
        if QUERY_PROJ.search(s.target)
        else s
        for s in plan.steps
    ]
    target_shapes = meta_shapes(DiffTransformerForCausalLM, new_config)
    notes = list(plan.notes) + [
        f"Written as grouped differential attention: num_noise_heads={num_noise_heads}, r = {new_config.noise_ratio} "
        f"(num_attention_heads {config.num_attention_heads} -> {new_config.num_attention_heads}); same function."
    ]
    return Plan(
        plan.source_shapes, plan.optional_sources, steps, new_config, target_shapes, plan.exact, notes, dict(plan.info)
    )


__all__ = ["duplicated_config", "gda_query_heads", "grouped_config", "to_duplicated", "to_gda"]
