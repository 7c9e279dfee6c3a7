"""The shared conversion engine: reading checkpoints, plans, index maps, checking, writing.

Every source format (one module each beside this one) turns its config into a :class:`Plan`; this module checks the
plan against the source checkpoint key by key and shape by shape, then writes the result atomically.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, PreTrainedConfig
from transformers.dynamic_module_utils import custom_object_save

from ..configuration_difftransformer import DiffTransformerConfig
from ..modeling_difftransformer import AUTO_MAP, DiffTransformerForCausalLM

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Files copied unchanged from the input folder when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
GENERATION_CONFIG_FILE = "generation_config.json"
# One shard is held in memory while it is written (safetensors writes whole files), so the shard size bounds the
# conversion's memory: 5GB (huggingface_hub's default) rather than save_pretrained's 50GB.
DEFAULT_MAX_SHARD_SIZE = "5GB"

# Old Llama checkpoints store the (deterministic, recomputed) rotary buffer; transformers ignores it on load.
DROPPABLE_BUFFER = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


logger = logging.getLogger("difftransformer.convert")


class ConversionError(ValueError):
    """A checkpoint cannot be converted as asked; the message names the offending file, field, key or option."""


def one_line(err: BaseException) -> str:
    """An exception's message on one line (some libraries' messages span several)."""
    return " ".join(str(err).split()) or type(err).__name__


# ----------------------------------------------------------------------------------------------------------------
# Reading checkpoints: shapes first (metadata only), tensors one at a time.
# ----------------------------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class Checkpoint:
    """Lazy read access to a state dict: ``shapes`` and ``dtypes`` without loading, ``get(key)`` per tensor."""

    def __init__(self, shapes: dict[str, tuple], dtypes: dict[str, torch.dtype], loader: Callable[[str], torch.Tensor]):
        self.shapes, self.dtypes, self._loader = shapes, dtypes, loader
        self._stack = contextlib.ExitStack()

    def get(self, key: str) -> torch.Tensor:
        return self._loader(key)

    def close(self):
        self._stack.close()

    def on_close(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` when this checkpoint is closed (e.g. close the checkpoint a renamed view reads)."""
        self._stack.callback(callback)

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor]) -> Checkpoint:
        sd = dict(state_dict)
        return cls({k: tuple(v.shape) for k, v in sd.items()}, {k: v.dtype for k, v in sd.items()}, sd.__getitem__)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike, allow_pickle: bool = False) -> Checkpoint:
        """Open ``model.safetensors``, a sharded safetensors index, or (only with ``allow_pickle``)
        ``pytorch_model.bin``."""
        folder = Path(folder)
        files = _weight_files(folder, allow_pickle)
        if files[0].suffix == ".safetensors":
            return cls._from_safetensors(files)
        return cls._from_pickle(files)

    @classmethod
    def _from_safetensors(cls, files: list[Path]) -> Checkpoint:
        ckpt = cls({}, {}, None)
        handles, where = {}, {}
        try:
            for file in files:
                try:
                    handle = ckpt._stack.enter_context(safe_open(file, framework="pt"))
                except (SafetensorError, OSError) as err:
                    raise ConversionError(
                        f"{file} is not a readable safetensors file (truncated or damaged): {one_line(err)}."
                    ) from None
                handles[file] = handle
                for key in handle.keys():
                    if key in where:
                        raise ConversionError(f"Tensor {key!r} is stored twice, in {where[key].name} and {file.name}.")
                    where[key] = file
                    sl = handle.get_slice(key)
                    ckpt.shapes[key] = tuple(sl.get_shape())
                    ckpt.dtypes[key] = _SAFETENSORS_DTYPES.get(sl.get_dtype(), None)
        except BaseException:
            ckpt.close()
            raise
        ckpt._loader = lambda key: handles[where[key]].get_tensor(key)
        return ckpt

    @classmethod
    def _from_pickle(cls, files: list[Path]) -> Checkpoint:
        merged = {}
        for file in files:
            # mmap: the tensors stay on disk until used; weights_only: refuse arbitrary objects even with the flag.
            try:
                sd = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError) as err:
                raise ConversionError(
                    f"{file} is not a readable PyTorch checkpoint (truncated or damaged): {one_line(err)}."
                ) from None
            if not isinstance(sd, Mapping):
                raise ConversionError(f"{file} does not hold a state dict (found {type(sd).__name__}).")
            merged.update(sd)
        return cls.from_state_dict(merged)


def read_json_file(path: Path, what: str = "") -> object:
    """A JSON file's content, or a :class:`ConversionError` naming the file, the place and what is wrong."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConversionError(
            f"{path} is not valid JSON{what}: {err.msg} at line {err.lineno} column {err.colno}."
        ) from None
    except UnicodeDecodeError as err:
        raise ConversionError(f"{path} is not UTF-8 text{what}: {one_line(err)}.") from None


def _weight_files(folder: Path, allow_pickle: bool) -> list[Path]:
    if not folder.is_dir():
        raise ConversionError(f"--input {str(folder)!r} is not a folder.")
    for index_name, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index, single_file = folder / index_name, folder / single
        if index.is_file():
            weight_map = read_json_file(index)
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ConversionError(f"{index} has no 'weight_map' object mapping tensor names to shard file names.")
            files = [folder / s for s in sorted(set(weight_map.values()))]
        elif single_file.is_file():
            files = [single_file]
        else:
            continue
        if single.endswith(".bin") and not allow_pickle:
            raise ConversionError(
                f"{folder} holds only pickled weights ({files[0].name}). Unpickling can run code; if you trust the "
                "file, pass --allow-pickle (allow_pickle=True). Tensors are then read with "
                "torch.load(weights_only=True)."
            )
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConversionError(f"{index_name} in {folder} names shard files that are missing: {missing}.")
        return files
    raise ConversionError(
        f"No weights found in {folder}: expected model.safetensors, model.safetensors.index.json, "
        "or (with --allow-pickle) pytorch_model.bin / pytorch_model.bin.index.json."
    )


# ----------------------------------------------------------------------------------------------------------------
# Index maps (the row order of docs/model.md, the conversions of docs/convert.md). Each returns, for every row (head) of
# the result, the source row (head) it comes from.
# ----------------------------------------------------------------------------------------------------------------


def interleaved_to_rotate_half(d: int) -> torch.Tensor:
    """``P_d``: within one head, new row ``i`` ← old ``2i`` and new row ``i + d/2`` ← old ``2i + 1`` (``i < d/2``).

    GPT-J-style (interleaved) RoPE rotates feature pairs ``(2i, 2i+1)`` by frequency ``i``; transformers' rotate-half
    rotates ``(i, i + d/2)`` by the same frequency, so permuting q and k rows alike turns one into the other and leaves
    every dot product unchanged.
    """
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def v1_query_heads_from(layout: str, num_groups: int, n: int) -> torch.Tensor:
    """V1 query half-heads in our group-major order ``(g, c, r)``: the index each one has in ``layout``.

    ``layout``: ``"diffllama"`` orders query heads ``(c, g, r)``; ``"microsoft"`` orders them ``(g, r, c)``
    (head ``h = g·n + r``, its two maps adjacent); ``"ours"`` is the identity.
    """
    index = []
    for g in range(num_groups):
        for c in range(2):
            for r in range(n):
                index.append(
                    {
                        "diffllama": (c * num_groups + g) * n + r,
                        "microsoft": (g * n + r) * 2 + c,
                        "ours": (2 * g + c) * n + r,
                    }[layout]
                )
    return torch.tensor(index)


def v1_kv_heads_from(layout: str, num_groups: int) -> torch.Tensor:
    """V1 key/value heads in our order ``(g, c)``: their index in ``layout`` (DiffLlama: ``(c, g)``; Microsoft:
    ours)."""
    return torch.tensor(
        [c * num_groups + g if layout == "diffllama" else 2 * g + c for g in range(num_groups) for c in range(2)]
    )


def expand_heads(head_index: torch.Tensor, d: int, within: torch.Tensor | None = None) -> torch.Tensor:
    """Row indices for a head permutation (and an optional within-head permutation such as ``P_d``)."""
    within = torch.arange(d) if within is None else within
    return (head_index[:, None] * d + within[None, :]).reshape(-1)


def invert(index: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(index)
    out[index] = torch.arange(index.numel())
    return out


# ----------------------------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------------------------

Getter = Callable[[str], torch.Tensor]


@dataclass
class Step:
    """One tensor of the result: ``fn(get)`` computes it from source tensors fetched with ``get(key)``."""

    target: str
    sources: tuple[str, ...]
    fn: Callable[[Getter], torch.Tensor]
    keep_float32: bool = False  # V1 λ vectors stay float32 (docs/model.md) whatever --dtype says


@dataclass
class Plan:
    """Everything a conversion will do, decided before any tensor is read."""

    source_shapes: dict[str, tuple]  # every key the source must hold, with its shape
    optional_sources: dict[str, tuple]  # keys it may hold, accounted for and dropped (tied lm_head)
    steps: list[Step]
    config: PreTrainedConfig  # of the result
    target_shapes: dict[str, tuple]
    exact: bool = True
    notes: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)  # facts about how the plan was made (e.g. {"v1_init": "duplicate"})


def copy_of(key: str) -> Callable[[Getter], torch.Tensor]:
    """A step function that takes the source tensor ``key`` as it is."""
    return lambda get: get(key)


def rows_of(key: str, rows: torch.Tensor) -> Callable[[Getter], torch.Tensor]:
    """A step function that takes the rows ``rows`` (an index map) of the source tensor ``key``."""
    return lambda get: get(key).index_select(0, rows)


def meta_shapes(model_cls, config) -> dict[str, tuple]:
    """The state-dict keys and shapes a model class has for ``config``, without allocating weights."""
    with torch.device("meta"):
        model = model_cls(config) if model_cls is not AutoModelForCausalLM else AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def is_lambda_vector(key: str) -> bool:
    """Whether ``key`` is one of V1's λ vectors (``lambda_q1`` ... ``lambda_k2``), which stay float32."""
    return re.search(r"\.lambda_[qk][12]$", key) is not None


def attention_prefix(layer: int) -> str:
    """The state-dict prefix of layer ``layer``'s attention module."""
    return f"model.layers.{layer}.self_attn."


def common_steps(target_shapes: dict[str, tuple]) -> list[Step]:
    """Everything outside attention keeps its Llama name and value."""
    return [Step(k, (k,), copy_of(k)) for k in target_shapes if ".self_attn." not in k]


def tied_lm_head_shapes(config, hidden: int) -> dict[str, tuple]:
    """The optional source tensors of a tied model: an ``lm_head.weight`` a checkpoint may hold and the result drops."""
    return {"lm_head.weight": (config.vocab_size, hidden)} if config.tie_word_embeddings else {}


def shared_fields(src) -> dict:
    """Fields with the same meaning in Llama-style configs and ours."""
    fields = {}
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "hidden_act",
        "max_position_embeddings",
        "initializer_range",
        "rms_norm_eps",
        "use_cache",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
        "rope_parameters",
    ):
        if hasattr(src, name):
            fields[name] = getattr(src, name)
    if getattr(src, "dtype", None) is not None:
        fields["dtype"] = src.dtype
    return fields


# ----------------------------------------------------------------------------------------------------------------
# Checking and writing
# ----------------------------------------------------------------------------------------------------------------


def _listing(keys: Iterable[str], limit: int = 12) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def check_source(plan: Plan, ckpt: Checkpoint, source_name: str) -> None:
    """Every key and shape of the source must be accounted for; raise naming every offender."""
    expected = {**plan.optional_sources, **plan.source_shapes}
    missing = set(plan.source_shapes) - set(ckpt.shapes)
    unknown = set(ckpt.shapes) - set(expected)
    misshaped = {
        k: (ckpt.shapes[k], expected[k])
        for k in set(ckpt.shapes) & set(expected)
        if tuple(ckpt.shapes[k]) != tuple(expected[k])
    }
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unknown:
        problems.append(f"unknown tensors: {_listing(unknown)}")
    if misshaped:
        problems.append(
            "mis-shaped tensors: "
            + _listing(f"{k} {tuple(got)} (expected {tuple(want)})" for k, (got, want) in misshaped.items())
        )
    non_float = [
        k
        for k in plan.source_shapes
        if k in ckpt.dtypes and ckpt.dtypes[k] is not None and not ckpt.dtypes[k].is_floating_point
    ]
    if non_float:
        problems.append(f"non-floating tensors: {_listing(non_float)}")
    if problems:
        raise ConversionError(
            f"The checkpoint does not match a --from {source_name} model with this config; "
            + "; ".join(problems)
            + ". Check --from, the config (head counts, sizes) and, for Microsoft sources, --key-map."
        )
    # Invariants of the plan itself (a bug here, not in the checkpoint); real checks, not asserts that -O removes.
    unused = set(plan.source_shapes) - {s for step in plan.steps for s in step.sources}
    if unused:
        raise ConversionError(f"internal: the conversion plan never reads {_listing(unused)}")
    if set(plan.target_shapes) != {s.target for s in plan.steps}:
        raise ConversionError("internal: the conversion plan and the target model's keys differ")


def resolve_dtype(dtype, plan: Plan, ckpt: Checkpoint) -> torch.dtype:
    """The dtype ``--dtype`` names; for ``auto`` the config's, else the dtype holding most of the weights."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        cfg_dtype = getattr(plan.config, "dtype", None)
        if isinstance(cfg_dtype, str):
            cfg_dtype = getattr(torch, cfg_dtype, None)
        if isinstance(cfg_dtype, torch.dtype) and cfg_dtype.is_floating_point:
            return cfg_dtype
        # No dtype in the config (Microsoft sources): the dtype that holds most of the weights. λ vectors are float32
        # in every format and never decide it.
        counts: dict[torch.dtype, int] = {}
        for key, t in ckpt.dtypes.items():
            if t is not None and t.is_floating_point and not is_lambda_vector(key):
                counts[t] = counts.get(t, 0) + math.prod(ckpt.shapes[key])
        return max(counts, key=counts.get) if counts else torch.float32
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r}; allowed: auto, {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def prepare_output(output: Path, inputs: list[Path], overwrite: bool) -> None:
    """Refuse an output that is or holds an input, is not a folder, or is not empty without ``overwrite``."""
    out = output.resolve()
    for inp in inputs:
        inp = inp.resolve()
        if out == inp or out in inp.parents:
            raise ConversionError(
                f"--output {str(output)!r} would overwrite the input {str(inp)!r}; choose another folder."
            )
        if inp.is_dir() and inp in out.parents:
            raise ConversionError(
                f"--output {str(output)!r} lies inside the input folder {str(inp)!r}: a conversion never writes into "
                "its input; choose a folder outside it."
            )
    if out.exists():
        if not out.is_dir():
            raise ConversionError(f"--output {str(output)!r} exists and is not a folder.")
        if any(out.iterdir()) and not overwrite:
            raise ConversionError(
                f"--output {str(output)!r} is not empty; pass --overwrite (overwrite=True) to replace it."
            )


def _default_permissions(folder: Path) -> None:
    """``mkdtemp`` makes a private (0700) folder: give the result the permissions a folder and files created the
    ordinary way get under the current umask, as ``save_pretrained``'s output has."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


# ----------------------------------------------------------------------------------------------------------------
# Interruptions: the folders a write makes beside --output, and the signals that may stop it
# ----------------------------------------------------------------------------------------------------------------

_HOST = re.sub(r"[^A-Za-z0-9.]+", "_", socket.gethostname()) or "host"
# A work folder's name: work_folder_prefix's prefix, then the 8 random characters tempfile.mkdtemp appends.
_WORK_FOLDER = r"\.{name}\.(?:converting|old)-(?P<host>[A-Za-z0-9._]+)-(?P<pid>[0-9]+)-[a-z0-9_]{{8}}"


def work_folder_prefix(output: Path, kind: str) -> str:
    """The name prefix of the hidden folders a write makes beside ``output`` (``kind``: ``converting``, the result
    being written, or ``old``, the previous output set aside while the result is swapped in). The host and process id
    in the name tell a later run which folders are left from a run that no longer exists
    (:func:`remove_stale_work_folders`)."""
    return f".{output.name}.{kind}-{_HOST}-{os.getpid()}-"


def _process_exists(pid: int) -> bool:
    if pid == os.getpid():
        return True  # this process: perhaps another thread's write
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists, under another user
        return True
    return True


def remove_stale_work_folders(output: Path) -> list[Path]:
    """Remove the hidden folders beside ``output`` that a write on this machine left when its process was killed
    outright (SIGKILL, an out-of-memory kill, a power loss), logging each; those of a process still running, or of
    another machine, are kept. Returns the folders removed."""
    if os.name != "posix" or not output.parent.is_dir():  # os.kill(pid, 0) tests for a process only on POSIX
        return []
    pattern = re.compile(_WORK_FOLDER.format(name=re.escape(output.name)))
    removed = []
    for entry in sorted(output.parent.iterdir()):
        match = pattern.fullmatch(entry.name)
        if match is None or match["host"] != _HOST or not entry.is_dir() or entry.is_symlink():
            continue
        if _process_exists(int(match["pid"])):
            continue
        try:
            shutil.rmtree(entry)
        except OSError as err:
            logger.warning("Could not remove %s, left by an earlier conversion: %s.", entry, one_line(err))
            continue
        logger.warning(
            "Removed %s, left by an earlier conversion to %s whose process (%s) no longer runs.",
            entry,
            output,
            match["pid"],
        )
        removed.append(entry)
    return removed


class Terminated(BaseException):
    """Raised in the main thread, while a conversion writes, by a signal whose default action ends the process
    without any cleanup (:func:`cleanup_on_termination`)."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def cleanup_on_termination():
    """While the body runs in the main thread, SIGTERM (when left at its default action, which ends the process at
    once) raises :class:`Terminated` instead, so that the body's cleanup runs as it does for Ctrl-C's
    KeyboardInterrupt; then the previous disposition is restored and the signal raised again, so that the process
    still ends by it. A handler the program installed itself, or an ignored SIGTERM, is left as it is; so is
    everything outside the main thread, where Python cannot handle signals."""
    installed = _in_main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if installed:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except Terminated as err:
        if not installed:
            raise
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        installed = False
        sys.stdout.flush()
        sys.stderr.flush()
        signal.raise_signal(err.signum)  # the default action: the process ends here
        raise
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def deferred_signals():
    """SIGINT and SIGTERM received while the body runs (in the main thread) take effect once it has finished: each is
    then raised again under the handler that was in place before. For the steps that must not stop halfway: swapping
    the result in, removing a folder."""
    if not _in_main_thread():
        yield
        return
    pending, previous = [], {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if handler in (signal.SIG_IGN, None):  # ignored, or a handler not installed from Python: left alone
            continue
        previous[signum] = handler
        signal.signal(signum, lambda received, frame: pending.append(received))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)


def remove_folder(folder: Path) -> None:
    """Remove ``folder`` (if it exists) whole: a signal received meanwhile takes effect after it is gone; a folder
    that cannot be removed is named in a warning."""
    with deferred_signals():
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            pass
        except OSError as err:
            logger.warning("Could not remove the temporary folder %s: %s; remove it by hand.", folder, one_line(err))


def install_folder(tmp: Path, output: Path) -> None:
    """Move the finished temporary folder into place; an existing output is replaced only now. The swap and the
    removal of the previous output run to their end: a signal received meanwhile takes effect after them."""
    _default_permissions(tmp)
    with deferred_signals():
        backup = None
        if output.exists():
            backup = Path(tempfile.mkdtemp(prefix=work_folder_prefix(output, "old"), dir=output.parent))
            backup.rmdir()
            os.replace(output, backup)
        try:
            os.replace(tmp, output)
        except BaseException:
            if backup is not None:
                os.replace(backup, output)
            raise
        if backup is not None:
            remove_folder(backup)


def target_dtypes(plan: Plan, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype each tensor of the result is written in: ``dtype``, except V1's λ vectors (``keep_float32``), which
    stay float32 (or ``dtype`` where it is wider)."""
    wide = torch.float32 if dtype.itemsize < 4 else dtype
    return {s.target: wide if s.keep_float32 else dtype for s in plan.steps}


def shard_layout(plan: Plan, dtype: torch.dtype, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE):
    """The result's safetensors files and their tensors (``huggingface_hub``'s split), from shapes alone (meta
    tensors), exactly as ``save_pretrained`` would place them."""
    out_dtype = target_dtypes(plan, dtype)
    metas = {k: torch.empty(plan.target_shapes[k], dtype=out_dtype[k], device="meta") for k in plan.target_shapes}
    pattern = "model{suffix}.safetensors"
    return split_torch_state_dict_into_shards(metas, filename_pattern=pattern, max_shard_size=max_shard_size)


def write_plan(
    plan: Plan,
    ckpt: Checkpoint,
    folder: Path,
    dtype: torch.dtype,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = True,
) -> None:
    """Compute and write every tensor of ``plan`` into ``folder`` as (sharded) safetensors, one shard in memory."""
    steps = {s.target: s for s in plan.steps}
    out_dtype = target_dtypes(plan, dtype)
    split = shard_layout(plan, dtype, max_shard_size)
    with tqdm(total=len(steps), desc="Converting tensors", unit="tensor", disable=not progress) as bar:
        for filename, names in split.filename_to_tensors.items():
            shard = {}
            for name in names:
                tensor = steps[name].fn(ckpt.get)
                if tuple(tensor.shape) != tuple(plan.target_shapes[name]):
                    raise ConversionError(
                        f"internal: {name} computed with shape {tuple(tensor.shape)}, expected "
                        f"{plan.target_shapes[name]}."
                    )
                shard[name] = tensor.to(device="cpu", dtype=out_dtype[name]).contiguous()
                bar.update()
            save_file(shard, str(folder / filename), metadata={"format": "pt"})
            del shard
    if split.is_sharded:
        total = sum(math.prod(s) for s in plan.target_shapes.values())
        index = {"metadata": {"total_parameters": total, **split.metadata}, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_config(config: PreTrainedConfig, folder: Path, dtype: torch.dtype) -> None:
    """Save the result's config (and, for our format, the source files and ``auto_map`` of remote code)."""
    config.dtype = dtype
    if isinstance(config, DiffTransformerConfig):
        config.architectures = ["DiffTransformerForCausalLM"]
        # As DiffTransformerForCausalLM.save_pretrained: both source files beside the weights, every Auto class in
        # auto_map, so the folder loads with trust_remote_code where the package is absent.
        with torch.device("meta"):
            model = DiffTransformerForCausalLM(config)
        custom_object_save(model, folder)
        config.auto_map = {
            "AutoConfig": f"configuration_difftransformer.{DiffTransformerConfig.__name__}",
            **{auto: f"modeling_difftransformer.{cls}" for auto, cls in AUTO_MAP.items()},
        }
    else:
        config.architectures = ["DiffLlamaForCausalLM"]
    config.save_pretrained(folder)


def copy_side_files(inputs: list[Path], folder: Path, generation_config=None, tokenizer=None) -> list[str]:
    """Tokenizer files and generation_config.json: copied from input folders, else saved from the objects given."""
    copied = []
    for inp in inputs:
        if not inp.is_dir():
            continue
        for name in (*TOKENIZER_FILES, GENERATION_CONFIG_FILE):
            if (inp / name).is_file() and not (folder / name).exists():
                shutil.copyfile(inp / name, folder / name)
                copied.append(name)
    if tokenizer is not None and not any((folder / name).exists() for name in TOKENIZER_FILES):
        before = set(os.listdir(folder))
        tokenizer.save_pretrained(folder)
        copied += sorted(set(os.listdir(folder)) - before)
    if generation_config is not None and not (folder / GENERATION_CONFIG_FILE).exists():
        generation_config.save_pretrained(folder)
        copied.append(GENERATION_CONFIG_FILE)
    return copied


def verify_prompt(vocab_size: int, length: int = 16) -> torch.Tensor:
    """The fixed prompt of ``--verify``: a deterministic spread of token ids (no tokenizer needed)."""
    return (torch.arange(length) * 7919 + 3).remainder(vocab_size)[None, :]
