"""References for the converter's approximate Llama → V1 conversion (``--v1-init duplicate``), computed from the source
model itself (transformers' own Llama code), not from difftransformer's model.

The duplicated V1 model computes, by construction (difftransformer/convert/llama.py's docstring, docs/convert.md), the
source model with every head's attention output ``o`` (the input of ``o_proj``, per token) multiplied by

    f = sqrt(ρ² + e) / sqrt(rms(o)² + e),    e = subln_eps / (1 − λ)²,

``ρ`` the head's calibrated rms and ``λ = exp(λq1·λk1) − exp(λq2·λk2) + λinit`` its layer's λ: both maps of a head are
the source head's, so ``A1 − λA2 = (1 − λ)A``; the per-head norm divides by ``sqrt((1 − λ)² rms(o)² + eps)``; the
``(1 − λinit)`` factor and the ``o_proj`` scale ``sqrt(ρ² + e)/(1 − λinit)`` make the rest.
:func:`duplicate_v1_function` makes a source model compute exactly that, so a converted model can be compared with it to
rounding.
"""

import contextlib
import math

import torch


@torch.no_grad()
def mean_head_rms(source, input_ids: torch.Tensor) -> torch.Tensor:
    """``(layers, heads)``: the mean over the tokens of ``input_ids`` (no padding) of each head's per-token rms of its
    ``o_proj`` input, in the source's dtype: what the duplicate method's calibration is defined to compute."""
    heads = source.config.num_attention_heads
    seen = {}
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(lambda m, args, i=i: seen.setdefault(i, []).append(args[0]))
        for i, layer in enumerate(source.model.layers)
    ]
    try:
        source(input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    rms = [
        torch.cat(seen[i]).unflatten(-1, (heads, -1)).pow(2).mean(-1).sqrt().flatten(0, 1).mean(0) for i in sorted(seen)
    ]
    return torch.stack(rms)


def v1_lambdas(config, state_dict) -> list[float]:
    """λ of every layer of a V1 model, from its λ vectors and its λinit (``lambda_init``, else the paper's depth
    schedule ``0.8 − 0.6·exp(−0.3·l)``), in float64."""
    lambdas = []
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}.self_attn."
        q1, k1, q2, k2 = (
            state_dict[p + name].double() for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
        )
        init = config.lambda_init if config.lambda_init is not None else 0.8 - 0.6 * math.exp(-0.3 * layer)
        lambdas.append((torch.exp(q1 @ k1) - torch.exp(q2 @ k2)).item() + init)
    return lambdas


@contextlib.contextmanager
def duplicate_v1_function(source, v1_config, v1_state_dict, rho: torch.Tensor):
    """Within the block, the Llama-style ``source`` computes the function of its V1 duplicate conversion with output
    rms ``rho`` (``(layers, heads)``) and the V1 model's λ vectors and ``subln_eps`` (module docstring): forward
    pre-hooks scale each head's ``o_proj`` input, in the source's dtype."""
    heads, d = source.config.num_attention_heads, v1_config.head_dim
    lambdas = v1_lambdas(v1_config, v1_state_dict)

    def hook_for(layer):
        e = v1_config.subln_eps / (1 - lambdas[layer]) ** 2

        def hook(module, args):
            o = args[0].unflatten(-1, (heads, d))
            r = rho[layer].to(o.dtype)
            f = torch.sqrt(r**2 + e) / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + e).squeeze(-1)
            return ((o * f[..., None]).flatten(-2),)

        return hook

    handles = [
        layer.self_attn.o_proj.register_forward_pre_hook(hook_for(i)) for i, layer in enumerate(source.model.layers)
    ]
    try:
        yield source
    finally:
        for handle in handles:
            handle.remove()
