"""A ``.gguf`` file as a conversion source (``--from llama --input model.gguf``).

The file is checked first (readable header, Llama-family architecture, every tensor inside the file), then read
through transformers' GGUF loader, which de-quantises every tensor to float32: ``AutoConfig`` /
``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(folder, gguf_file=name)``. The loaded Llama is then an
in-memory source like any other: the Llama plan, the key-by-key check, atomic writing and ``--verify`` (against
this very model) apply unchanged.
"""

from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.utils import logging as hf_logging

from .engine import ConversionError, one_line

# general.architecture values whose transformers model is Llama-style (llama.cpp writes Mistral 7B as "llama").
GGUF_ARCHITECTURES = ("llama", "qwen2")
# Token ids llama.cpp ends generation at (end of sequence, of turn, of message), when a file names them.
_END_OF_GENERATION_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_READ_ERRORS = (struct.error, ValueError, KeyError, IndexError, UnicodeDecodeError, OverflowError, MemoryError, OSError)


def is_gguf_path(path: Path) -> bool:
    """A file named ``*.gguf``, or any file that starts with the GGUF magic bytes."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


@dataclass
class GgufSource:
    path: Path
    model: torch.nn.Module  # the de-quantised float32 Llama-style model
    config: object  # its config without quantization_config
    tokenizer: object | None
    generation_config: GenerationConfig
    notes: list[str] = field(default_factory=list)


def read_gguf_header(path: Path) -> tuple[dict, str]:
    """``(metadata, architecture)`` of a GGUF file; a :class:`ConversionError` naming the file if it is damaged,
    truncated or not a Llama-family model. Reads only the header and tensor table (no tensor data)."""
    from transformers.integrations.gguf import GgufHeader, read_gguf_metadata

    if not path.is_file():
        raise ConversionError(f"--input {str(path)!r} is not a file.")
    size = path.stat().st_size
    try:
        metadata, _ = read_gguf_metadata(str(path))
        header = GgufHeader.from_file(str(path))
    except struct.error as err:
        raise ConversionError(
            f"{path} is not a readable GGUF file (truncated or damaged header, {size} bytes): {one_line(err)}."
        ) from None
    except _READ_ERRORS as err:
        raise ConversionError(f"{path} is not a readable GGUF file: {one_line(err)}") from None
    end = max((header.data_start + t.offset + t.nbytes for t in header.tensors), default=header.data_start)
    if end > size:
        last = max(header.tensors, key=lambda t: t.offset)
        raise ConversionError(
            f"{path} is truncated: its tensor table places tensor data up to byte {end} (last tensor {last.name!r}), "
            f"but the file has {size} bytes."
        )
    architecture = header.architecture
    if architecture not in GGUF_ARCHITECTURES:
        raise ConversionError(
            f"{path} holds a GGUF model of architecture {architecture!r} (general.architecture); --from llama converts "
            f"Llama-family GGUF files only: {list(GGUF_ARCHITECTURES)}."
        )
    return metadata, architecture


@contextlib.contextmanager
def _progress_bars(enabled: bool):
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def reading_each_file_once():
    """Within the block, transformers' GGUF loader parses each file's metadata once, not once per part it loads.

    ``AutoConfig``, ``AutoModelForCausalLM`` and ``AutoTokenizer`` each build a new ``gguf.GGUFReader`` of the file
    (``load_gguf_checkpoint``), and the reader builds every metadata field in Python: SmolLM2's 49152 tokens and 48900
    merges take about 10 s a time. The reader is read-only (a memory map of the file, mode "r"), so the first one built
    for a path serves the later loads of the block. ``gguf.GGUFReader`` is restored on leaving, errors included; a
    transformers release that builds its reader another way only loses the saving."""
    import gguf

    original = gguf.GGUFReader
    readers = {}

    def reader(path, *args, **kwargs):
        key = (str(Path(path).resolve()), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def gguf_generation_config(metadata: dict) -> GenerationConfig:
    """bos, pad and the end-of-generation ids the file names (eos, and eot/eom where present: llama.cpp stops at
    all)."""
    eos = []
    for key in _END_OF_GENERATION_KEYS:
        if key in metadata and metadata[key] not in eos:
            eos.append(int(metadata[key]))
    return GenerationConfig(
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=(eos[0] if len(eos) == 1 else eos) or None,
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
    )


def load_gguf(path: str | Path, progress: bool = True) -> GgufSource:
    """Check and load a Llama-family ``.gguf`` (de-quantised to float32), with its tokenizer and generation config."""
    path = Path(path)
    metadata, _ = read_gguf_header(path)
    folder, name = path.resolve().parent, path.name
    notes = []
    with _progress_bars(progress), reading_each_file_once():
        try:
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            if config.model_type not in ("llama", "mistral", "qwen2"):
                raise ConversionError(
                    f"{path}: transformers reads it as model_type {config.model_type!r}, not a Llama-style model."
                )
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32)
        except ConversionError:
            raise
        except (*_READ_ERRORS, TypeError, RuntimeError) as err:
            raise ConversionError(f"{path}: transformers' GGUF loader cannot read it: {one_line(err)}") from None
        tokenizer = None
        if "tokenizer.ggml.tokens" in metadata:
            try:
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            except (*_READ_ERRORS, TypeError, RuntimeError) as err:
                raise ConversionError(
                    f"{path}: its tokenizer cannot be read by transformers: {one_line(err)}"
                ) from None
        else:
            notes.append(f"{path} holds no tokenizer (no tokenizer.ggml.tokens): the output folder has none either.")
    model.eval()
    if tokenizer is not None and tokenizer.model_max_length > 1e29:  # transformers' "no limit known" placeholder
        tokenizer.model_max_length = model.config.max_position_embeddings  # the file's context_length
    clean = model.config.to_dict()
    clean.pop("quantization_config", None)
    clean = type(model.config).from_dict(clean)
    clean.dtype = torch.float32
    return GgufSource(path, plain_model(model, clean), clean, tokenizer, gguf_generation_config(metadata), notes)


def plain_model(model: torch.nn.Module, config) -> torch.nn.Module:
    """The same weights in a model of ``config`` that nothing takes for quantized. transformers' GGUF loader keeps
    ``quantization_config`` (and its quantizer) on the de-quantised float32 model: ``save_pretrained`` then fails,
    and the Trainer refuses to fine-tune it as a teacher's copy or a student."""
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is overwritten next: skip the random initialisation
        plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain.to(torch.float32).eval()
