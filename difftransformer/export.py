"""Exporting a DiffTransformer (V1 or V2) for runtimes outside PyTorch's eager mode (docs/ecosystem.md, "Tools").

* :func:`export_for_decoding`: ``torch.export`` through transformers' ``TorchExportableModuleForDecoderOnlyLM`` (what
  ExecuTorch's LLM runner and optimum-executorch lower): one program that takes ``(input_ids, cache_position)`` and
  holds a ``StaticCache`` of ``max_cache_len`` positions as buffers.
* :func:`greedy_decode`: greedy decoding with ONE instance of such a program, stepped token by token with
  ``cache_position`` (prompt included). transformers' own ``TorchExportableModuleWithStaticCache.generate`` creates a
  new module from the program at every step, which starts from an empty cache: its tokens are not the model's.
* :func:`export_onnx`: the logits of a prompt (no cache) as an ONNX graph through torch's dynamo exporter
  (``torch.onnx.export(..., dynamo=True)``), batch and sequence length dynamic; run it with onnxruntime.

V1 under ``attn_implementation="sdpa"`` runs its own attention kernel, whose block schedule follows the sequence
length: ``torch.export`` would fix the length it traced. :func:`export_onnx` therefore traces V1 with the eager
attention (the same function; the one-token steps of :func:`export_for_decoding` are unaffected).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch


@contextlib.contextmanager
def _attention(model, implementation: str | None):
    previous = model.config._attn_implementation
    if implementation is not None and implementation != previous:
        model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        if implementation is not None and implementation != previous:
            model.set_attn_implementation(previous)


def export_for_decoding(model, max_cache_len: int, batch_size: int = 1) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model`` (a difftransformer causal LM, eval mode) with a static cache of
    ``max_cache_len`` positions, through ``transformers.integrations.executorch.TorchExportableModuleForDecoderOnlyLM``.
    The program's inputs: ``input_ids`` ``(batch_size, 1)`` and ``cache_position`` ``(1,)``; its output: the logits."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    if model.training:
        raise ValueError("export_for_decoding exports inference: call model.eval() first.")
    generation, config = model.generation_config, model.config
    previous = generation.cache_implementation, config.use_cache
    # What the wrapper expects of a model it exports: a static cache, and caching on (a folder saved after training
    # with gradient checkpointing has use_cache=False in its config).
    generation.cache_implementation, config.use_cache = "static", True
    try:
        wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=batch_size, max_cache_len=max_cache_len)
        ids = torch.zeros(batch_size, 1, dtype=torch.long, device=model.device)
        return wrapper.export(input_ids=ids, cache_position=torch.tensor([0], device=model.device))
    finally:
        generation.cache_implementation, config.use_cache = previous


@torch.no_grad()
def greedy_decode(
    program: torch.export.ExportedProgram,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """Greedy continuation of ``prompt_ids`` ``(batch, T)`` by an exported program of :func:`export_for_decoding`:
    one module instance, fed the prompt and then each chosen token at its ``cache_position``. Returns the new tokens
    ``(batch, ≤ max_new_tokens)`` (stopping early once every row has produced ``eos_token_id``)."""
    module = program.module()
    if prompt_ids.dim() != 2 or prompt_ids.shape[1] == 0:
        raise ValueError(
            f"`prompt_ids` must be (batch, tokens) with at least one token, got {tuple(prompt_ids.shape)}."
        )
    logits = None
    for position in range(prompt_ids.shape[1]):
        logits = module(input_ids=prompt_ids[:, position : position + 1], cache_position=torch.tensor([position]))
    new, done = [], torch.zeros(prompt_ids.shape[0], dtype=torch.bool)
    position = prompt_ids.shape[1]
    for _ in range(max_new_tokens):
        token = logits[:, -1].argmax(-1)
        new.append(token)
        if eos_token_id is not None:
            done |= token == eos_token_id
            if done.all():
                break
        logits = module(input_ids=token[:, None], cache_position=torch.tensor([position]))
        position += 1
    return torch.stack(new, dim=1)


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def export_onnx(model, path: str | os.PathLike, example_ids: torch.Tensor | None = None) -> Path:
    """Write ``model``'s logits ``(batch, seq, vocab)`` for ``input_ids`` ``(batch, seq)`` (no cache, no padding) to
    the ONNX file ``path`` with torch's dynamo exporter; batch and sequence length are dynamic. V1 is traced with
    the eager attention (module docstring). Returns the path."""
    if model.training:
        raise ValueError("export_onnx exports inference: call model.eval() first.")
    if example_ids is None:
        example_ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _attention(model, "eager" if model.config.diff_version == 1 else None), torch.no_grad():
        torch.onnx.export(
            _Logits(model),
            (example_ids.to(model.device),),
            str(path),
            dynamo=True,
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_shapes={"input_ids": {0: "batch", 1: "sequence"}},
            verbose=False,
        )
    return path


__all__ = ["export_for_decoding", "export_onnx", "greedy_decode"]
