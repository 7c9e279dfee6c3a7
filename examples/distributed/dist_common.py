"""Shared pieces of the distributed examples: a tiny model and a deterministic synthetic corpus.

Everything here is seeded so that every process (and a single-process reference run) builds the same weights and
sees the same samples; the examples then differ only in how the engine splits the work.
"""

import torch

import difftransformer  # noqa: F401  (registers the model type with the Auto classes)
from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM


def tiny_config(diff_version: int = 1, **overrides) -> DiffTransformerConfig:
    """2 layers, width 64, 8 query heads of width 8 (4 differential heads); V1: 4 KV heads = 2 groups, V2: 2 groups."""
    kwargs = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4 if diff_version == 1 else 2,
        diff_version=diff_version,
    )
    return DiffTransformerConfig(**{**kwargs, **overrides})


def tiny_model(diff_version: int = 1, seed: int = 0, **overrides) -> DiffTransformerForCausalLM:
    """A random tiny model; the same seed gives the same weights in every process."""
    torch.manual_seed(seed)
    return DiffTransformerForCausalLM(tiny_config(diff_version, **overrides))


def synthetic_token_ids(num_samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """``(num_samples, seq_len)`` token ids with a learnable rule: every token is the previous one plus a
    per-sequence step, modulo the vocabulary. No download, identical on every machine."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (num_samples, 1), generator=gen)
    step = torch.randint(1, 8, (num_samples, 1), generator=gen)
    return (start + step * torch.arange(seq_len)) % vocab_size


def synthetic_dataset(num_samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """`synthetic_token_ids` as a list of ``{"input_ids", "labels"}`` examples, ready for `Trainer`."""
    return [
        {"input_ids": row, "labels": row.clone()} for row in synthetic_token_ids(num_samples, seq_len, vocab_size, seed)
    ]
