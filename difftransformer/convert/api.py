"""The entry points: :func:`convert` (the composition of :func:`plan_conversion`, which reads and checks everything and
decides what will be written, and :func:`write_conversion`, which writes a :class:`ConversionPlan` atomically),
:func:`build_plan` (the tensor plan of a source config), :func:`verify_conversion`, and GDA ↔ duplicated for models in
memory or folders (:func:`gda_to_duplicated`, :func:`duplicated_to_gda`)."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig

from ..configuration_difftransformer import DiffTransformerConfig
from ..modeling_difftransformer import DiffTransformerForCausalLM
from ..motif import MotifConfig, MotifForCausalLM
from .diffllama import plan_from_diffllama, to_diffllama
from .engine import (
    DEFAULT_MAX_SHARD_SIZE,
    GENERATION_CONFIG_FILE,
    TOKENIZER_FILES,
    Checkpoint,
    ConversionError,
    Plan,
    Step,
    Terminated,
    check_source,
    cleanup_on_termination,
    copy_side_files,
    deferred_signals,
    expand_heads,
    install_folder,
    one_line,
    prepare_output,
    read_json_file,
    remove_folder,
    remove_stale_work_folders,
    resolve_dtype,
    shard_layout,
    target_dtypes,
    verify_prompt,
    work_folder_prefix,
    write_config,
    write_plan,
)
from .gda import QUERY_PROJ, duplicated_config, gda_query_heads, to_duplicated, to_gda
from .gguf_source import is_gguf_path, load_gguf
from .llama import (
    LLAMA_STYLE_MODEL_TYPES,
    V1_CALIBRATIONS,
    V1_INITS,
    calibrate_v1_output_scales,
    calibration_input_ids,
    check_source_fields,
    describe_output_rms,
    plan_from_llama,
)
from .microsoft import load_key_map, microsoft_subln_affine, plan_from_microsoft, rename_checkpoint
from .motif import check_motif_fields, plan_from_motif
from .ours import plan_from_difftransformer

logger = logging.getLogger("difftransformer.convert")

SOURCES = ("diffllama", "microsoft-v1", "microsoft-v2", "llama", "motif", "difftransformer")
# duplicated: a grouped (GDA) result written as a plain model; gda: a plain result with duplicated noise heads written
# as GDA (num_noise_heads). Both exact (convert/gda.py).
TARGETS = ("difftransformer", "diffllama", "duplicated", "gda")


@dataclass
class ConversionResult:
    output: Path
    config: PreTrainedConfig
    exact: bool
    notes: list[str]
    copied_files: list[str]
    max_logit_diff: float | None = None
    info: dict = field(default_factory=dict)  # e.g. v1_init, v1_output_rms (ρ), v1_output_scales, calibration


def _read_config_json(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder} has no config.json; every source folder needs one (see docs/convert.md).")
    config = read_json_file(path)
    if not isinstance(config, dict):
        raise ConversionError(f"{path} must hold a JSON object, found {type(config).__name__}.")
    return config


@contextlib.contextmanager
def _config_errors(where: str):
    """A config that transformers or our config class rejects (wrong field type, impossible combination) becomes a
    one-line :class:`ConversionError` naming where the config came from."""
    try:
        yield
    except ConversionError:
        raise
    except (StrictDataclassError, TypeError, ValueError, KeyError) as err:
        raise ConversionError(f"{where}: {one_line(err)}") from None


_EXPECTED_MODEL_TYPE = {
    "diffllama": ("diffllama",),
    "difftransformer": ("difftransformer",),
    "llama": LLAMA_STYLE_MODEL_TYPES,
    "motif": ("Motif",),
}


def _check_model_type(source: str, found: str | None) -> None:
    expected = _EXPECTED_MODEL_TYPE[source]
    if found not in expected:
        hint = {"diffllama": "diffllama", "difftransformer": "difftransformer", "Motif": "motif"}.get(
            found, "llama" if found in LLAMA_STYLE_MODEL_TYPES else None
        )
        raise ConversionError(
            f"--from {source} expects config.json model_type in {list(expected)}, found {found!r}"
            + (f"; did you mean --from {hint}?" if hint else ".")
        )


def build_plan(
    source: str,
    target: str,
    config,
    diff_version: int | None = None,
    microsoft_module: str | None = None,
    subln_affine: bool = True,
    seed: int = 0,
    v1_init: str = "auto",
    v1_output_rms: torch.Tensor | None = None,
    v1_subln_eps: float | None = None,
    num_noise_heads: int | None = None,
    query_rows_in_source_order: bool = True,
) -> Plan:
    """The conversion plan for a source config (a transformers config, or a dict for Microsoft sources).
    ``num_noise_heads``: for ``target="gda"``. ``query_rows_in_source_order``: Motif only, False for a loaded
    ``MotifForCausalLM`` (its rows were reordered at load)."""
    if source not in SOURCES:
        raise ConversionError(f"--from {source!r}; allowed: {list(SOURCES)}.")
    if target not in TARGETS:
        raise ConversionError(f"--to {target!r}; allowed: {list(TARGETS)}.")
    implied = {"diffllama": 1, "microsoft-v1": 1, "microsoft-v2": 2, "motif": 1}.get(source)
    if source == "difftransformer":
        implied = config.diff_version
    if source == "llama":
        if diff_version is None:
            raise ConversionError(
                "--from llama needs --diff-version 1 (approximate, needs training) or 2 (exact upcycling)."
            )
    elif diff_version is not None and diff_version != implied:
        raise ConversionError(
            f"--diff-version {diff_version} conflicts with --from {source}, which gives DIFF V{implied}."
        )
    if source == "diffllama" and target == "diffllama":
        raise ConversionError("--from diffllama --to diffllama: nothing to convert; use --to difftransformer.")
    if (target == "gda") != (num_noise_heads is not None):
        raise ConversionError(
            "--num-noise-heads goes with --to gda, and --to gda needs it (the noise heads the result keeps)."
        )
    if source == "difftransformer":
        plan = plan_from_difftransformer(config)
    elif source == "diffllama":
        plan = plan_from_diffllama(config)
    elif source == "llama":
        plan = plan_from_llama(config, diff_version, seed, v1_init, v1_output_rms, v1_subln_eps)
    elif source == "motif":
        plan = plan_from_motif(config, query_rows_in_source_order)
    else:
        plan = plan_from_microsoft(config, 1 if source == "microsoft-v1" else 2, microsoft_module, subln_affine)
    if target == "diffllama":
        if plan.config.noise_ratio != 1 and plan.config.diff_version == 1:
            raise ConversionError(
                f"--to diffllama: DiffLlama has one noise map per head; this model is grouped (num_noise_heads="
                f"{plan.config.num_noise_heads}). Convert with --to duplicated first, then --to diffllama."
            )
        return to_diffllama(plan)
    if target == "duplicated":
        return to_duplicated(plan)
    if target == "gda":
        return to_gda(plan, num_noise_heads)
    return plan


def _check_v1_options(source: str, diff_version, v1_init, v1_calibration, v1_subln_eps=None) -> None:
    if v1_subln_eps is not None:
        if (
            isinstance(v1_subln_eps, bool)
            or not isinstance(v1_subln_eps, (int, float))
            or not 0 < v1_subln_eps < float("inf")
        ):
            raise ConversionError(f"--v1-subln-eps must be a positive finite number; got {v1_subln_eps!r}.")
        if not (source == "llama" and diff_version == 1):
            raise ConversionError("--v1-subln-eps applies to --from llama --diff-version 1 only.")
    if v1_init not in V1_INITS:
        raise ConversionError(f"--v1-init {v1_init!r}; allowed: {list(V1_INITS)}.")
    if not isinstance(v1_calibration, torch.Tensor) and v1_calibration not in V1_CALIBRATIONS:
        raise ConversionError(
            f"--v1-calibration {v1_calibration!r}; allowed: {list(V1_CALIBRATIONS)} (or, in Python, a tensor of token "
            "ids)."
        )
    if source == "llama" and diff_version == 1:
        return
    if v1_init != "auto":
        raise ConversionError(f"--v1-init {v1_init} applies to --from llama --diff-version 1 only.")
    if isinstance(v1_calibration, torch.Tensor) or v1_calibration != "auto":
        raise ConversionError("--v1-calibration applies to --from llama --diff-version 1 --v1-init duplicate only.")


def _source_tokenizer(in_folder: Path | None, required: bool):
    """The tokenizer saved in the input folder, if there is one that loads."""
    if in_folder is None or not any((in_folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(in_folder)
    except Exception as err:  # a broken tokenizer only matters if the corpus calibration needs it
        if required:
            raise ConversionError(
                f"--v1-calibration corpus: the tokenizer in {in_folder} does not load: {one_line(err)}"
            ) from None
        logger.warning(
            "The tokenizer in %s does not load (%s); calibrating on random token ids.", in_folder, one_line(err)
        )
        return None


def _calibrate(v1_calibration, model, in_folder: Path | None, tokenizer, src_config, seed: int):
    """``(ρ or None, description)`` for the duplicate method."""
    if isinstance(v1_calibration, torch.Tensor):
        ids, how = v1_calibration.long(), f"{tuple(v1_calibration.shape)} token ids given by the caller"
    elif v1_calibration == "none":
        return None, "o_proj scales not calibrated (--v1-calibration none): ρ = 1 for every head."
    else:
        if v1_calibration != "random" and tokenizer is None:
            tokenizer = _source_tokenizer(in_folder, required=v1_calibration == "corpus")
        if v1_calibration == "corpus" and tokenizer is None:
            raise ConversionError(
                "--v1-calibration corpus needs the source's tokenizer (files beside the weights, or tokenizer=...); "
                "none was found."
            )
        ids, how = calibration_input_ids(
            src_config.vocab_size,
            getattr(src_config, "max_position_embeddings", None),
            None if v1_calibration == "random" else tokenizer,
            seed,
        )
    reference = model
    if reference is None:
        reference = AutoModelForCausalLM.from_pretrained(in_folder, dtype="auto")
    rho = calibrate_v1_output_scales(reference, ids)
    return rho, f"o_proj scales calibrated on {how}; {describe_output_rms(rho)}."


# ----------------------------------------------------------------------------------------------------------------
# Planning and writing
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MicrosoftSource:
    """How a Microsoft state dict is read (``--from microsoft-v1`` / ``microsoft-v2``; ignored for other sources
    except ``key_map``, which they refuse)."""

    key_map: str | os.PathLike | Mapping | None = None  # JSON file or dict of key prefixes (:func:`load_key_map`)
    config: Mapping | None = None  # the config dict for a state dict, or fields overriding the folder's config.json
    module: str | None = None  # which Microsoft V1 module produced the weights (needed under GQA)


@dataclass(frozen=True, eq=False)
class V1Upcycling:
    """How ``--from llama --diff-version 1`` makes its differential heads (each field refused for other
    conversions when not left at its default, except ``seed``)."""

    init: str = "auto"  # "pair", "duplicate" or "auto" (pair when possible)
    calibration: str | torch.Tensor = "auto"  # duplicate only: "auto", "corpus", "random", "none" or token ids
    subln_eps: float | None = None  # eps of V1's per-head RMSNorm; default the source's rms_norm_eps
    seed: int = 0  # seed of the λ initialisation (and of random calibration ids)


@dataclass(frozen=True)
class _Input:
    """What ``input`` is, found without reading it."""

    path: Path | None  # a folder or a .gguf file
    folder: Path | None
    gguf: bool
    model: object | None  # a transformers model in memory

    @property
    def paths(self) -> list[Path]:
        return [self.path] if self.path is not None else []


def _read_input(source: str, input, diff_version, v1: V1Upcycling) -> _Input:
    """The checks that need no reading, in the order the messages are best read."""
    path = Path(input) if isinstance(input, (str, os.PathLike)) else None
    model = input if hasattr(input, "state_dict") and hasattr(input, "config") else None
    if path is None and model is None and not isinstance(input, Mapping):
        raise ConversionError(
            "input must be a folder, a .gguf file, a transformers model or (Microsoft sources) a "
            f"state dict; got {type(input).__name__}."
        )
    if source not in SOURCES:
        raise ConversionError(f"--from {source!r}; allowed: {list(SOURCES)}.")
    gguf = path is not None and is_gguf_path(path)
    folder = path if path is not None and not gguf else None
    if folder is not None and not folder.is_dir():
        raise ConversionError(f"--input {str(folder)!r} is not a folder (nor a .gguf file).")
    if gguf and source != "llama":
        raise ConversionError(
            f"--input {str(path)!r} is a GGUF file: GGUF files convert with --from llama (Llama-family models), not "
            f"--from {source}."
        )
    _check_v1_options(source, diff_version, v1.init, v1.calibration, v1.subln_eps)
    return _Input(path, folder, gguf, model)


# The config class of each source read from a folder: the format's own class, so that no Auto registration (Motif's
# "Motif" is opt-in, docs/models.md) is needed; Llama-style and DiffLlama folders are transformers' own model types.
_CONFIG_CLASSES = {"motif": MotifConfig, "difftransformer": DiffTransformerConfig}


def _source_config(source: str, src: _Input, model, gguf_config, microsoft: MicrosoftSource):
    """The source config (a transformers config, or a dict for Microsoft sources) and where it came from."""
    where = "the source config"
    if src.folder is not None or src.gguf:
        where = str(src.folder / "config.json") if src.folder is not None else str(src.path)
    if source.startswith("microsoft"):
        if model is not None:
            raise ConversionError(
                "Microsoft sources are state dicts: pass a folder or a state dict with source_config."
            )
        config = dict(_read_config_json(src.folder)) if src.folder is not None else {}
        config.update(microsoft.config or {})
        return config, where
    if model is not None:
        config = gguf_config if src.gguf else model.config
        _check_model_type(source, config.model_type)
        return config, where
    if src.folder is None:
        raise ConversionError(f"--from {source} takes a folder or a transformers model, not a bare state dict.")
    raw = _read_config_json(src.folder)
    _check_model_type(source, raw.get("model_type"))
    with _config_errors(where):
        if source in ("llama", "diffllama"):  # Llama-style fields, checked before transformers' class divides by them
            check_source_fields(SimpleNamespace(**raw))
        elif source == "motif":
            check_motif_fields(raw)
        return _CONFIG_CLASSES.get(source, AutoConfig).from_pretrained(src.folder), where


@dataclass(eq=False)
class ConversionPlan:
    """A conversion decided and checked, nothing written yet (:func:`plan_conversion`; :func:`write_conversion`
    writes it).

    ``tensors`` lists every tensor of the result (its shape, the source tensors it is computed from and how) and the
    result's ``config``; every key and shape of the source is accounted for. ``dtype`` is the result's (V1's λ
    vectors stay float32: :meth:`tensor_dtypes`), :meth:`side_files` the tokenizer and generation files copied from the
    input folder (``tokenizer`` and ``generation_config``, when given or loaded, are saved where the folder has none).
    ``notes`` say what is approximate or changed. The plan holds the source checkpoint open, memory-mapped (tensors
    are read only while writing): use it as a context manager, or :meth:`close` it."""

    source: str
    target: str
    tensors: Plan
    dtype: torch.dtype
    notes: list[str]
    inputs: tuple[Path, ...]  # resolved: what an output must neither be nor hold nor lie inside
    side_folder: Path | None
    generation_config: object | None
    tokenizer: object | None
    reference: object | None  # the source as --verify runs it: a folder, a model in memory, a state dict
    checkpoint: Checkpoint | None = field(default=None, repr=False)

    @property
    def config(self) -> PreTrainedConfig:
        return self.tensors.config

    @property
    def exact(self) -> bool:
        return self.tensors.exact

    @property
    def info(self) -> dict:
        return self.tensors.info

    def tensor_dtypes(self) -> dict[str, torch.dtype]:
        """Every tensor of the result with the dtype it is written in."""
        return target_dtypes(self.tensors, self.dtype)

    def weight_files(self, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> dict[str, list[str]]:
        """The safetensors files :func:`write_conversion` writes with ``max_shard_size``, each with its tensors (an
        index file ``model.safetensors.index.json`` besides, when there are several)."""
        return shard_layout(self.tensors, self.dtype, max_shard_size).filename_to_tensors

    def side_files(self) -> list[str]:
        """Tokenizer and generation files copied unchanged from the input folder."""
        if self.side_folder is None:
            return []
        return [n for n in (*TOKENIZER_FILES, GENERATION_CONFIG_FILE) if (self.side_folder / n).is_file()]

    @property
    def closed(self) -> bool:
        return self.checkpoint is None

    def close(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.close()
            self.checkpoint = None

    def __enter__(self) -> ConversionPlan:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plan_conversion(
    source: str,
    input,
    target: str = "difftransformer",
    *,
    diff_version: int | None = None,
    dtype: str | torch.dtype | None = "auto",
    allow_pickle: bool = False,
    microsoft: MicrosoftSource | None = None,
    v1: V1Upcycling | None = None,
    tokenizer=None,
    num_noise_heads: int | None = None,
    progress: bool = True,
) -> ConversionPlan:
    """Read and check everything a conversion needs, and decide what it will write; write nothing.

    The source's config and key list are read (tensors stay on disk, memory-mapped, except what a GGUF load or the
    V1 calibration computes), the plan is checked against every key and shape, and the result's dtype, config and
    notes are fixed. Every error a conversion can meet in its input or options is raised here, as a
    :class:`ConversionError` naming the file, field, key or option. Arguments as :func:`convert`'s, with the Microsoft
    options grouped in ``microsoft`` and the Llama → V1 ones in ``v1``. The plan holds the source open: close it
    (``with plan_conversion(...) as plan:``)."""
    microsoft = microsoft if microsoft is not None else MicrosoftSource()
    v1 = v1 if v1 is not None else V1Upcycling()
    src = _read_input(source, input, diff_version, v1)
    model, notes, gguf_config = src.model, [], None
    generation_config = getattr(model, "generation_config", None) if model is not None else None
    if src.gguf:
        loaded = load_gguf(src.path, progress=progress)
        model, generation_config, gguf_config = loaded.model, loaded.generation_config, loaded.config
        notes = list(loaded.notes)
        tokenizer = tokenizer if tokenizer is not None else loaded.tokenizer
    src_config, config_where = _source_config(source, src, model, gguf_config, microsoft)

    if src.folder is not None:
        ckpt = Checkpoint.from_folder(src.folder, allow_pickle=allow_pickle)
    else:
        ckpt = Checkpoint.from_state_dict(model.state_dict() if model is not None else input)
    try:
        subln_affine = True
        if source.startswith("microsoft"):
            ckpt = rename_checkpoint(ckpt, load_key_map(microsoft.key_map))
            subln_affine = microsoft_subln_affine(ckpt)
        elif microsoft.key_map is not None:
            raise ConversionError("--key-map applies to Microsoft sources only.")
        plan_args = (source, target, src_config, diff_version, microsoft.module, subln_affine, v1.seed)
        layout = dict(num_noise_heads=num_noise_heads, query_rows_in_source_order=model is None or src.gguf)
        with _config_errors(config_where):
            plan = build_plan(*plan_args, v1_init=v1.init, v1_subln_eps=v1.subln_eps, **layout)
        check_source(plan, ckpt, source)
        out_dtype = resolve_dtype(dtype, plan, ckpt)
        method = plan.info.get("v1_init")
        if method == "pair" and not (isinstance(v1.calibration, str) and v1.calibration == "auto"):
            raise ConversionError(
                "--v1-calibration applies to --v1-init duplicate only; this conversion pairs heads (--v1-init pair)."
            )
        if method == "duplicate":
            rho, how = _calibrate(v1.calibration, model, src.folder, tokenizer, src_config, v1.seed)
            if rho is not None:
                plan = build_plan(*plan_args, v1_init=v1.init, v1_output_rms=rho, v1_subln_eps=v1.subln_eps, **layout)
                check_source(plan, ckpt, source)
            plan.notes.append(how)
            plan.info["calibration"] = how
    except BaseException:
        ckpt.close()
        raise
    notes += plan.notes
    for note in notes:
        logger.warning(note)
    return ConversionPlan(
        source,
        target,
        plan,
        out_dtype,
        notes,
        tuple(p.resolve() for p in src.paths),
        src.folder,
        generation_config,
        tokenizer,
        reference=model if src.gguf else input,
        checkpoint=ckpt,
    )


def write_conversion(
    plan: ConversionPlan,
    output: str | os.PathLike,
    *,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = True,
) -> ConversionResult:
    """Write a :class:`ConversionPlan` to the folder ``output``, atomically.

    Refused before anything is written when ``output`` is an input, holds one or lies inside one, or is a non-empty
    folder without ``overwrite``. The result is written into a temporary folder beside ``output``, one safetensors
    shard of at most ``max_shard_size`` at a time, and renamed into place only once complete (with ``overwrite``, the
    previous folder is replaced only then): a failure at any point, or an interruption before the result is complete,
    leaves no output folder, or the previous one untouched, and no temporary folder. A plan can be written more than
    once.

    Interruptions (in the main thread): Ctrl-C's KeyboardInterrupt, and SIGTERM while it has its default action (it is
    then raised again once the temporary folder is removed, so the process still ends by it), clean up before they
    take effect; from the swap on (the result complete), they take effect once the swap and the removal of the
    previous folder have finished, so ``output`` then holds the result and nothing is left beside it. The hidden
    folders beside ``output`` carry the host and process id: folders left by a process killed outright (SIGKILL) are
    removed here, with a warning naming each."""
    output = Path(output)
    if plan.closed:
        raise ConversionError(
            "write_conversion: this plan is closed (its source checkpoint was released); plan the conversion again."
        )
    prepare_output(output, list(plan.inputs), overwrite)
    output.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_work_folders(output)
    with cleanup_on_termination():
        tmp, installed = None, False
        try:
            with deferred_signals():  # no folder made without its name being known to the cleanup below
                tmp = Path(tempfile.mkdtemp(prefix=work_folder_prefix(output, "converting"), dir=output.parent))
            write_plan(plan.tensors, plan.checkpoint, tmp, plan.dtype, max_shard_size, progress)
            write_config(plan.config, tmp, plan.dtype)
            folders = [plan.side_folder] if plan.side_folder is not None else []
            copied = copy_side_files(folders, tmp, plan.generation_config, plan.tokenizer)
            with deferred_signals():
                install_folder(tmp, output)
                installed = True
        except BaseException as err:
            if tmp is not None and not installed:
                remove_folder(tmp)
            if isinstance(err, (KeyboardInterrupt, Terminated)):
                logger.warning(
                    "Conversion %s: %s.",
                    "interrupted" if isinstance(err, KeyboardInterrupt) else str(err),
                    f"{output} was complete and in place before it stopped"
                    if installed
                    else f"the unfinished result was removed, {output} is as it was before",
                )
            raise
    return ConversionResult(output, plan.config, plan.exact, list(plan.notes), copied, info=dict(plan.info))


def convert(
    source: str,
    input,
    output: str | os.PathLike,
    target: str = "difftransformer",
    *,
    diff_version: int | None = None,
    dtype: str | torch.dtype | None = "auto",
    verify: bool = False,
    overwrite: bool = False,
    allow_pickle: bool = False,
    key_map: str | os.PathLike | Mapping | None = None,
    source_config: Mapping | None = None,
    microsoft_module: str | None = None,
    seed: int = 0,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = True,
    v1_init: str = "auto",
    v1_calibration: str | torch.Tensor = "auto",
    v1_subln_eps: float | None = None,
    tokenizer=None,
    num_noise_heads: int | None = None,
) -> ConversionResult:
    """Convert a checkpoint (docs/convert.md): :func:`plan_conversion`, then :func:`write_conversion`, then (with
    ``verify``) :func:`verify_conversion`. The output is checked first, before anything is read.

    Args:
        source: one of ``SOURCES``. target: one of ``TARGETS``.
        input: a folder (safetensors, sharded or not; ``pytorch_model.bin`` only with ``allow_pickle``), a ``.gguf``
            file (``source="llama"``: read through transformers' GGUF loader, de-quantised to float32), an in-memory
            ``PreTrainedModel``, or (Microsoft sources) a state dict together with ``source_config``.
        output: the folder to create. Refused if it is or contains the input, or is non-empty without ``overwrite``.
        diff_version: required for ``source="llama"`` (2: exact, 1: approximate upcycling).
        dtype: ``"auto"`` (the source's; float32 for a GGUF), ``"float32"``, ``"float16"``, ``"bfloat16"`` or a
            ``torch.dtype``.
        verify: run source and result on a fixed prompt and record ``max_logit_diff`` (loads both models; a GGUF
            source is compared as loaded).
        key_map, source_config, microsoft_module: Microsoft sources (:class:`MicrosoftSource`): a JSON file or dict
            of key prefixes (:func:`load_key_map`); the config dict when ``input`` is a state dict (else read from
            ``input/config.json``, which it may override); which Microsoft V1 module produced the weights (needed
            under GQA).
        seed, v1_init, v1_calibration, v1_subln_eps: Llama → V1 only (:class:`V1Upcycling`). ``seed``: of the λ
            initialisation (and of random calibration ids). ``v1_init``: ``"pair"`` (docs/convert.md, even
            ``num_key_value_heads``), ``"duplicate"`` (any layout, doubles query and KV heads, see
            :mod:`difftransformer.convert.llama`) or ``"auto"`` (pair when possible). ``v1_calibration``, duplicate
            only: ``"auto"`` (the embedded corpus through the source's tokenizer, else random ids), ``"corpus"``,
            ``"random"``, ``"none"`` (ρ = 1), or a ``(batch, length)`` tensor of token ids; calibration runs the
            source model (a folder source is loaded for it). ``v1_subln_eps``: eps of V1's per-head RMSNorm
            (``subln_eps``); default the source's ``rms_norm_eps``. With ``duplicate``, a large value (e.g. 1) makes
            the norm near-linear at the start, so the converted model nearly equals the source (docs/convert.md);
            export to DiffLlama is then not exact.
        max_shard_size: largest shard (bytes or "5GB"); larger results are sharded with an index. Peak memory is
            about one shard plus the source tensors it reads (memory-mapped).
        tokenizer: for an in-memory model: saved beside the result and used for the corpus calibration.
        num_noise_heads: ``target="gda"`` only: the noise heads of the grouped result (its query heads are
            ``H + num_noise_heads``); the source's noise query rows must come in ``H / num_noise_heads`` identical
            copies.
    """
    microsoft = MicrosoftSource(key_map=key_map, config=source_config, module=microsoft_module)
    v1 = V1Upcycling(init=v1_init, calibration=v1_calibration, subln_eps=v1_subln_eps, seed=seed)
    # Refused before anything is read: a GGUF load or a V1 calibration can take minutes.
    prepare_output(Path(output), _read_input(source, input, diff_version, v1).paths, overwrite)
    with plan_conversion(
        source,
        input,
        target,
        diff_version=diff_version,
        dtype=dtype,
        allow_pickle=allow_pickle,
        microsoft=microsoft,
        v1=v1,
        tokenizer=tokenizer,
        num_noise_heads=num_noise_heads,
        progress=progress,
    ) as plan:
        result = write_conversion(plan, output, overwrite=overwrite, max_shard_size=max_shard_size, progress=progress)
    if verify:
        result.max_logit_diff = verify_conversion(source, plan.reference, output)
    return result


# ----------------------------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------------------------

# The model class of each of our formats, so that loading a folder needs no Auto registration (Motif's is opt-in).
_MODEL_CLASSES = {"Motif": MotifForCausalLM, "difftransformer": DiffTransformerForCausalLM}


def _load_float32(folder: str | os.PathLike):
    model_type = _read_config_json(Path(folder)).get("model_type")
    return _MODEL_CLASSES.get(model_type, AutoModelForCausalLM).from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def verify_conversion(source: str, input, output: str | os.PathLike) -> float | None:
    """Run the source model and the converted one on :func:`verify_prompt` in float32; return the max |Δ logit|.

    ``input`` is a source folder or a model in memory (for a GGUF source: the model as transformers loaded it).
    Microsoft sources have no runnable model in transformers; for them only the result is run (finite logits).
    """
    result = _load_float32(output)
    ids = verify_prompt(result.config.vocab_size)
    new_logits = result(ids).logits
    if not torch.isfinite(new_logits).all():
        raise ConversionError(f"--verify: the converted model in {output} produces non-finite logits.")
    if source.startswith("microsoft"):
        print(
            "verify: Microsoft modules have no transformers implementation to compare with; the result loads and its "
            "logits are finite."
        )
        return None
    reference = _load_float32(input) if isinstance(input, (str, os.PathLike)) else input
    was_training = reference.training
    reference.eval()
    ref_logits = reference(ids.to(reference.device)).logits.float().cpu()
    reference.train(was_training)
    diff = (ref_logits - new_logits).abs().max().item()
    print(f"verify: max |logit difference| between source and result on a {ids.shape[1]}-token prompt: {diff:.3e}")
    return diff


# ----------------------------------------------------------------------------------------------------------------
# GDA <-> duplicated, for a model in memory or a folder
# ----------------------------------------------------------------------------------------------------------------


def _model_like(model, config: DiffTransformerConfig, state: dict) -> DiffTransformerForCausalLM:
    """A new model of ``config`` holding ``state``, every tensor in the dtype and on the device it has in ``state``
    (V1's λ vectors stay float32 in a bf16 model), with ``model``'s generation config, attention implementation and
    mode."""
    result = DiffTransformerForCausalLM(config)
    for name, param in result.named_parameters():
        param.data = param.data.to(dtype=state[name].dtype, device=state[name].device)
    result.load_state_dict(state, strict=True)
    result.generation_config = model.generation_config
    result.set_attn_implementation(model.config._attn_implementation)
    return result.to(model.device).train(model.training)


def gda_to_duplicated(model_or_folder, output: str | os.PathLike | None = None, **convert_kwargs):
    """A GDA model written as a plain (r = 1) DIFF model, with every noise head's query rows duplicated (exact).

    ``model_or_folder``: a ``DiffTransformerForCausalLM`` in memory (returns the new model, or writes it to ``output``
    when given) or a folder (``output`` required; :func:`~difftransformer.convert.convert` with ``target="duplicated"``,
    which takes ``convert_kwargs``)."""
    if isinstance(model_or_folder, (str, os.PathLike)) or output is not None:
        if output is None:
            raise ConversionError("gda_to_duplicated(folder) needs output=: the folder to write.")
        return convert("difftransformer", model_or_folder, output, target="duplicated", **convert_kwargs)
    config = model_or_folder.config
    to_duplicated(Plan({}, {}, [], config, {}))  # the same checks as the folder path
    rows = expand_heads(gda_query_heads(config), config.head_dim)
    state = {
        k: v.index_select(0, rows.to(v.device)) if QUERY_PROJ.search(k) else v
        for k, v in model_or_folder.state_dict().items()
    }
    return _model_like(model_or_folder, duplicated_config(config), state)


def duplicated_to_gda(model_or_folder, num_noise_heads: int, output: str | os.PathLike | None = None, **convert_kwargs):
    """The inverse of :func:`gda_to_duplicated`: a plain model whose noise query rows come in ``r`` identical copies per
    noise head, written with ``num_noise_heads`` noise heads (refused, naming the heads, when the copies differ)."""
    if isinstance(model_or_folder, (str, os.PathLike)) or output is not None:
        if output is None:
            raise ConversionError("duplicated_to_gda(folder) needs output=: the folder to write.")
        return convert(
            "difftransformer", model_or_folder, output, target="gda", num_noise_heads=num_noise_heads, **convert_kwargs
        )
    plan = to_gda(
        Plan(
            {},
            {},
            [Step(k, (k,), lambda get, k=k: get(k)) for k in model_or_folder.state_dict()],
            model_or_folder.config,
            {},
        ),
        num_noise_heads,
    )
    state = model_or_folder.state_dict()
    return _model_like(
        model_or_folder, plan.config, {s.target: s.fn(state.__getitem__) for s in plan.steps}
    )  # checks every copy
