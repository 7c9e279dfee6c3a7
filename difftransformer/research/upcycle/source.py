"""The teacher and the student: load a Llama-family source, convert it, load the converted student."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data import smollm2_gguf_path

SMOKE = "smoke"  # source name of smoke_source(): a tiny random Llama
SMOKE_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@dataclass
class Source:
    """The teacher: a Llama-family causal LM in float32, its tokenizer and generation config."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    generation_config: object | None = None
    load_seconds: float = 0.0


def load_source(source: str | os.PathLike | None = None, progress: bool = True) -> Source:
    """Load the teacher: a ``.gguf`` file (transformers' GGUF loader, de-quantised to float32, with the file's
    tokenizer, chat template and generation config), a model folder, ``None`` for SmolLM2-135M-Instruct
    (:func:`difftransformer.research.data.smollm2_gguf_path`), or ``"smoke"`` for :func:`smoke_source`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ...convert import load_gguf
    from ...convert.gguf_source import is_gguf_path

    if source == SMOKE:
        return smoke_source()
    start = time.time()
    path = smollm2_gguf_path() if source is None else Path(source)
    if is_gguf_path(path):
        loaded = load_gguf(path, progress=progress)
        model, tokenizer, generation_config = loaded.model, loaded.tokenizer, loaded.generation_config
        # The generation config the converter writes (the file's end-of-generation ids): used by both models.
        model.generation_config = generation_config
        if tokenizer is None:
            raise ValueError(f"{path} holds no tokenizer; upcycling needs one (the corpus is tokenized with it).")
    elif path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
        generation_config = model.generation_config
    else:
        raise FileNotFoundError(f"--source {str(path)!r} is neither a .gguf file nor a model folder.")
    model.eval().requires_grad_(False)
    return Source(model, tokenizer, str(path), generation_config, time.time() - start)


def smoke_source(seed: int = 0, vocab_size: int = 512) -> Source:
    """A tiny random Llama (2 layers, width 64, 4 query / 1 KV heads: an odd KV count, like SmolLM2's; weights
    N(0, 0.1)) with the embedded corpus's byte-level BPE tokenizer and a minimal chat template: exercises every step
    of the pipeline in seconds (``--smoke`` runs and the tests). Its answers are noise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..data import get_tokenizer

    tokenizer = get_tokenizer(vocab_size)
    tokenizer.chat_template = SMOKE_CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        initializer_range=0.1,  # peaked next-token distributions, so that a converted V1 starts measurably off
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    return Source(model, tokenizer, SMOKE, model.generation_config)


def convert_student(
    source: Source,
    diff_version: int,
    folder: str | os.PathLike,
    seed: int = 0,
    v1_init: str = "auto",
    v1_subln_eps: float | None = None,
    progress: bool = False,
):
    """Convert the teacher (in memory) into a DIFF ``diff_version`` folder with the converter
    (:func:`difftransformer.convert.convert`; V1: ``v1_init``, by default the converter's choice for the head layout,
    with its default calibration, and ``v1_subln_eps``, by default the source's ``rms_norm_eps``; a large value such
    as 1 gives the V1 layout with its per-head norm made nearly inert; ``progress``: the converter's progress bars).
    Returns the :class:`~difftransformer.convert.ConversionResult`."""
    from ...convert import convert

    v1 = diff_version == 1
    return convert(
        "llama",
        source.model,
        folder,
        diff_version=diff_version,
        tokenizer=source.tokenizer,
        seed=seed,
        progress=progress,
        v1_init=v1_init if v1 else "auto",
        v1_subln_eps=v1_subln_eps if v1 else None,
    )


def load_student(folder: str | os.PathLike):
    """A converted (or trained) difftransformer folder as a float32 causal LM."""
    from transformers import AutoModelForCausalLM

    from ... import DiffTransformerForCausalLM  # noqa: F401  (registers the Auto classes)

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
