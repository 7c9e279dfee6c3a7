"""V1's previous sdpa path, kept as a baseline for the benchmarks: one zero-padded SDPA call per layer.

Under ``attn_implementation="sdpa"`` the modeling file runs V1 through its own blocked/packed kernel
(``differential_sdpa_attention``). Every OTHER attention implementation name still receives the zero-padded queries
``[Q1|0]``, ``[0|Q2]`` ``(B, 2H, T, 2d)`` and the packed key/value, and the module combines the 2H outputs. So
transformers' own ``sdpa_attention_forward`` (with sdpa's mask builder) registered under another name reproduces
exactly the single-padded-SDPA-call V1 that ``"sdpa"`` ran before the kernel moved into the modeling file.

Importing this module registers it as :data:`PADDED_SDPA`; set ``config._attn_implementation = PADDED_SDPA`` (or
``model.set_attn_implementation(PADDED_SDPA)``) to use it.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PADDED_SDPA = "difftransformer_padded_sdpa"


def register(name: str = PADDED_SDPA) -> str:
    """Register transformers' sdpa function and sdpa mask builder under ``name``; returns ``name``."""
    AttentionInterface.register(name, sdpa_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


register()

__all__ = ["PADDED_SDPA", "register"]
