"""DIFF V2 as a native vLLM model: vLLM's own Llama layers plus the differential combine.

vLLM imports this module only when it builds a ``DiffTransformerForCausalLM`` folder; ``vllm_plugin.register`` (the
``vllm.general_plugins`` entry point of setup.py) tells it where the class is. Without the package installed, the same
folder still serves through vLLM's Transformers backend (``model_impl="transformers"`` with the folder's remote code).

The model is vLLM's ``LlamaForCausalLM`` with one layer changed, the attention (SPEC §2):

* the fused ``qkv_proj`` holds the ``2H`` query heads (``num_attention_heads`` of the config) and the ``G`` KV heads;
* vLLM's attention layer runs one standard call over them (query head ``j`` reads KV head ``⌊j/2n⌋``, vLLM's GQA rule),
  so the KV cache is exactly a Llama's with the same ``num_key_value_heads`` and ``head_dim``;
* ``λ = sigmoid(x W_λᵀ)`` per token and head, ``o_h = a_2h − λ_h · a_2h+1`` (``differential_combine``), and ``o_proj``
  maps the ``H·d`` combined features back.

Tensor parallelism shards ``qkv_proj``, ``lambda_proj`` (column-parallel) and ``o_proj`` (row-parallel) by heads: a rank
holding query heads ``[2h0, 2h1)`` holds ``λ`` and the output columns of heads ``[h0, h1)``, so pairs never split.

DIFF V1 is refused: its softmax maps multiply a ``2·head_dim``-wide value, which one vLLM attention call over the
config's KV heads cannot compute (see ``VLLM_V1_ERROR``).
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

from .modeling_difftransformer import VLLM_V1_ERROR, differential_combine


class DiffTransformerV2Attention(LlamaAttention):
    """vLLM's Llama attention over the ``2H`` query heads, then DIFF V2's combine (``num_heads`` is ``2H`` per rank)."""

    def __init__(self, config, hidden_size: int, num_heads: int, *args, quant_config=None, prefix: str = "", **kwargs):
        super().__init__(config, hidden_size, num_heads, *args, quant_config=quant_config, prefix=prefix, **kwargs)
        self.num_diff_heads = self.num_heads // 2  # per rank
        total_diff_heads = self.total_num_heads // 2
        # Llama's o_proj reads 2H·d features; DIFF V2's reads the H·d combined ones.
        self.o_proj = RowParallelLinear(
            input_size=total_diff_heads * self.head_dim,
            output_size=hidden_size,
            bias=kwargs.get("bias_o_proj", False),
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.lambda_proj = ColumnParallelLinear(
            input_size=hidden_size,
            output_size=total_diff_heads,
            bias=False,
            gather_output=False,
            quant_config=None,  # H outputs: too few to quantize, and λ feeds a subtraction of two maps
            prefix=f"{prefix}.lambda_proj",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        maps = self.attn(q, k, v).view(-1, self.num_heads, self.head_dim)  # (tokens, 2H, d): one output per map
        lam, _ = self.lambda_proj(hidden_states)  # (tokens, H)
        combined = differential_combine(maps, torch.sigmoid(lam)[..., None, None], 1, dim=1)  # (tokens, H, d)
        output, _ = self.o_proj(combined.reshape(-1, self.num_diff_heads * self.head_dim))
        return output


class DiffTransformerV2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None) -> None:
        super().__init__(vllm_config, prefix=prefix, config=config, attn_layer_type=DiffTransformerV2Attention)


class DiffTransformerForCausalLM(LlamaForCausalLM):
    """vLLM's Llama with DIFF V2 attention. Weight names are the checkpoint's (SPEC §3): vLLM's loader stacks
    ``q_proj, k_proj, v_proj`` into ``qkv_proj`` as for a Llama and loads ``lambda_proj`` by name."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config
        if getattr(config, "diff_version", None) != 2:
            raise ValueError(VLLM_V1_ERROR)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=DiffTransformerV2DecoderLayer)
