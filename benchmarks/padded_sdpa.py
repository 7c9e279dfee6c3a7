"""V1 through one zero-padded SDPA call per layer: the baseline bench.py's ``ours_v1_padded`` measures V1's own kernel
against.

Under ``attn_implementation="sdpa"`` the modeling file runs V1 through its own CPU kernel. Every other attention
implementation name receives V1's zero-padded queries and the module combines the outputs, so transformers' own
``sdpa_attention_forward`` (with sdpa's mask builder) registered under another name is exactly that single padded
call.

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
