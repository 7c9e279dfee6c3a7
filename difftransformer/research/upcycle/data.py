"""Training and held-out text for upcycling, tokenized with the *source's* tokenizer.

Training: the embedded corpus's train split (:mod:`difftransformer.research.data`), documents separated by the token the
source was pre-trained with between documents and packed into full blocks. Held out: the corpus's validation split
and ``pydoc_data.topics`` (English prose of the Python docs, a stdlib subpackage outside the corpus)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

HELDOUT_TEXTS = {
    "validation": "embedded corpus, validation split (Python stdlib modules never trained on)",
    "pydoc_topics": "pydoc_data.topics (English prose of the Python docs, outside the corpus)",
}


def document_separator_id(tokenizer) -> int:
    """The token that separates documents: ``<|endoftext|>`` where the vocabulary has it (SmolLM2 and GPT-2-style
    tokenizers are pre-trained with it; their ``eos_token`` is often a chat end-of-turn instead), else eos."""
    vocab = tokenizer.get_vocab()
    if "<|endoftext|>" in vocab:
        return vocab["<|endoftext|>"]
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has neither <|endoftext|> nor an eos_token to separate documents.")
    return tokenizer.eos_token_id


def pack_documents(
    tokenizer, texts: Sequence[str], block_size: int, max_blocks: int | None = None, separator_id: int | None = None
) -> torch.Tensor:
    """``(N, block_size)`` int64 blocks: the texts tokenized without special tokens, each followed by the document
    separator, concatenated in order and cut into consecutive full blocks (no padding: every position is a label).
    ``max_blocks`` stops tokenizing once that many blocks are filled."""
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"`block_size` must be an integer >= 2, got {block_size!r}.")
    if max_blocks is not None and (not isinstance(max_blocks, int) or max_blocks <= 0):
        raise ValueError(f"`max_blocks` must be None or a positive integer, got {max_blocks!r}.")
    sep = document_separator_id(tokenizer) if separator_id is None else separator_id
    ids: list[int] = []
    needed = None if max_blocks is None else max_blocks * block_size
    for text in texts:
        # verbose=False: a whole document may be longer than the tokenizer's model_max_length; it is cut into blocks
        # here, never fed whole, so transformers' "Token indices sequence length is longer than the specified
        # maximum" warning would only mislead.
        ids.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        ids.append(sep)
        if needed is not None and len(ids) >= needed:
            break
    count = len(ids) // block_size if max_blocks is None else min(len(ids) // block_size, max_blocks)
    if count == 0:
        raise ValueError(f"the texts hold {len(ids)} tokens, fewer than one block of {block_size}.")
    return torch.tensor(ids[: count * block_size], dtype=torch.long).view(count, block_size)


def heldout_texts() -> dict[str, str]:
    """The two held-out texts (:data:`HELDOUT_TEXTS`): the corpus's validation files joined by newlines, and the
    ``pydoc_data.topics`` documents in sorted key order joined by blank lines. Neither is ever trained on."""
    from pydoc_data.topics import topics

    from ..data import corpus_texts

    return {
        "validation": "\n".join(corpus_texts("validation")),
        "pydoc_topics": "\n\n".join(topics[key] for key in sorted(topics)),
    }


def heldout_blocks(tokenizer, blocks: int, length: int) -> dict[str, torch.Tensor]:
    """The first ``blocks × length`` tokens of each held-out text, as ``(blocks, length)`` tensors."""
    out = {}
    for name, text in heldout_texts().items():
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # only its first blocks are kept
        if len(ids) < blocks * length:
            raise ValueError(
                f"held-out text {name!r} has {len(ids)} tokens, fewer than {blocks}×{length}; lower --eval-blocks."
            )
        out[name] = torch.tensor(ids[: blocks * length]).view(blocks, length)
    return out


def training_blocks(
    tokenizer, block_size: int, max_blocks: int | None = None, max_chars: int | None = None
) -> torch.Tensor:
    """Blocks of the corpus's train split through ``tokenizer`` (see :func:`pack_documents`)."""
    from ..data import corpus_texts

    return pack_documents(tokenizer, corpus_texts("train", max_chars), block_size, max_blocks)
