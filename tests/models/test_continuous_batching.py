"""transformers' continuous batching (`model.generate_batch`, paged KV cache) against regular `generate`.

Continuous batching packs the prompts of several requests into one sequence, writes keys and values into a paged
cache *inside the attention function* (`cache.update(...)` in transformers' `sdpa_attention_forward` and
`eager_paged_attention_forward`), and schedules prefill and decode of different requests in the same forward.
Greedy tokens must equal those of `generate` for every request.

The paged cache is laid out per token as `(num_key_value_heads, head_dim)` (read from the config). V2 passes
exactly that; V1's packed `(G, 2d)` key/value heads are the same bytes in another shape, so V1 updates the paged
cache on `(Hkv, d)` views itself and then runs its single kernel call.
"""

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

import difftransformer  # noqa: F401
from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM

# Small explicit sizes: without them continuous batching sizes its paged cache from the machine's free memory
# (on CPU: the RAM), which takes seconds to allocate. Pages of 8 tokens make the longest prompt span several pages.
CB_CONFIG = dict(num_blocks=16, page_size=8, max_batch_tokens=64)

PROMPTS = [[5, 17, 3, 99, 42, 7], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


def _model(diff_version: int, attn_implementation: str) -> DiffTransformerForCausalLM:
    torch.manual_seed(0)
    config = DiffTransformerConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4 if diff_version == 1 else 2,
        diff_version=diff_version,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
    )
    config._attn_implementation = attn_implementation
    return DiffTransformerForCausalLM(config).eval()


def _greedy(max_new_tokens: int = 6) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=2, pad_token_id=0)


def _check_generate_batch_matches_generate(diff_version: int, attn_implementation: str):
    model = _model(diff_version, attn_implementation)
    outputs = model.generate_batch(
        PROMPTS, generation_config=_greedy(), continuous_batching_config=ContinuousBatchingConfig(**CB_CONFIG)
    )
    assert len(outputs) == len(PROMPTS)
    by_prompt = {tuple(out.prompt_ids): out for out in outputs.values()}
    for prompt in PROMPTS:
        out = by_prompt[tuple(prompt)]
        assert out.error is None, out.error
        expected = model.generate(torch.tensor([prompt]), generation_config=_greedy())[0, len(prompt) :].tolist()
        assert out.generated_tokens == expected, (prompt, out.generated_tokens, expected)
    # generate_batch switches the attention implementation for its run and restores it afterwards.
    assert model.config._attn_implementation == attn_implementation


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])  # eager runs as transformers' "paged|eager"
def test_generate_batch_v2_matches_generate(attn_implementation):
    _check_generate_batch_matches_generate(2, attn_implementation)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_generate_batch_v1_matches_generate(attn_implementation):
    _check_generate_batch_matches_generate(1, attn_implementation)
