"""Motif's layers (Motif Technologies' Motif-2 checkpoints, difftransformer/motif.py): the PolyNorm activation and the
gated MLP around it, what ``hidden_act="poly_norm"`` builds. A flat file imported relatively by the modeling file, so
that a saved Motif-layout folder carries it as remote code."""

import torch
from torch import nn
from transformers import initialization as init


class MotifPolyNorm(nn.Module):
    """Motif's PolyNorm activation (``hidden_act="poly_norm"``), over the last dimension:

        ``y = w0·N(x³) + w1·N(x²) + w2·N(x) + b``,  ``N(z) = z / sqrt(mean(z²) + eps)``

    with learnable ``weight`` (3,) (initialised to 1/3 each) and ``bias`` (1,) (0), computed in float32 (or the
    input's wider dtype) and cast back, eps 1e-6 (fixed, as in Motif's code). Reference: vLLM
    ``vllm/model_executor/layers/layernorm.py`` ``PolyNorm`` (the one Motif's models use).
    """

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.full((3,), 1.0 / 3.0))
        self.bias = nn.Parameter(torch.zeros(1))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf, w, b = x.to(dtype), self.weight.to(dtype), self.bias.to(dtype)

        def norm(z):
            return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + self.eps)

        return (w[0] * norm(xf.pow(3)) + w[1] * norm(xf.pow(2)) + w[2] * norm(xf) + b).to(x.dtype)

    @torch.no_grad()
    def init_own_weights(self):
        """What ``_init_weights`` gives it (transformers knows no PolyNorm): weights 1/3, bias 0."""
        init.constant_(self.weight, 1.0 / 3.0)
        init.zeros_(self.bias)

    def extra_repr(self):
        return f"eps={self.eps}"


class MotifPolyNormMLP(nn.Module):
    """Llama's gated MLP, ``down(act(gate(x)) ⊙ up(x))``, with PolyNorm as ``act`` (``hidden_act="poly_norm"``): an
    activation with weights of its own, saved as ``mlp.act_fn.weight`` and ``mlp.act_fn.bias`` (Motif's names).
    The decoder layer uses it for ``hidden_act="poly_norm"``, transformers' ``LlamaMLP`` otherwise."""

    def __init__(self, config):
        super().__init__()
        self.hidden_size, self.intermediate_size = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=config.mlp_bias)
        self.act_fn = MotifPolyNorm()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


__all__ = ["MotifPolyNorm", "MotifPolyNormMLP"]
