#!/usr/bin/env python
"""Train a small Differential Transformer on the Python standard library's sources, on CPU, in a few minutes.

    python examples/train.py                       # DIFF V1, 300 steps: ~3-5 minutes on 2 idle CPU cores
    python examples/train.py --diff-version 2      # DIFF V2
    python examples/train.py --smoke               # a few seconds: tiny model, few steps (what the tests run)

What it does (transformers ``Trainer`` throughout, so every step is the one users know):

1. builds the corpus and byte-level BPE tokenizer of :mod:`difftransformer.research.data` (no download; the tokenizer is
   trained once, in about a second, and cached);
2. trains a DiffTransformer language model with a tqdm progress bar, evaluating the validation loss (held-out
   stdlib *files*) every ``--eval-steps`` and saving a checkpoint every ``--save-steps``;
3. reports the final validation loss and perplexity, saves model + tokenizer + model card to
   ``OUTPUT_DIR/model`` (loadable with ``pipeline("text-generation", model=...)``, Hub-ready), generates a sample
   (``OUTPUT_DIR/sample.txt``), and plots the loss curves (``OUTPUT_DIR/loss_curve.png``).

Every ``--telemetry-every`` steps, :class:`difftransformer.research.telemetry.DiffAttentionTelemetryCallback` probes two
held-out blocks (λ, map separation, negative share, first-token weight and the largest attention logit of each map, per
layer; gradient-norm spikes): the terminal gets one summary line per probe, ``--report-to`` (TensorBoard, W&B, ...) and
``OUTPUT_DIR/checkpoint-*/trainer_state.json`` every per-layer value, ``OUTPUT_DIR/telemetry.png`` the plot.

Interrupted (Ctrl-C, SIGTERM)? The current step finishes, a checkpoint is saved, and the script exits; running the
same command again resumes from the latest checkpoint in ``OUTPUT_DIR`` (optimizer, schedule, RNG and data order
included). ``--fresh`` starts over instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no fork warnings from the dataloader

# Model and data settings that must match a checkpoint to resume from it (optimisation settings such as
# --max-steps or --learning-rate may change: e.g. resume with a larger --max-steps to train longer).
RUN_KEYS = (
    "diff_version",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "block_size",
    "train_max_chars",
)

SMOKE = dict(
    vocab_size=512,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    block_size=32,
    batch_size=4,
    max_steps=6,
    warmup_steps=1,
    eval_steps=3,
    save_steps=3,
    logging_steps=1,
    eval_blocks=8,
    train_max_chars=60_000,
    validation_max_chars=20_000,
    sample_tokens=16,
    telemetry_every=3,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a small Differential Transformer (arXiv 2410.05258) on the Python stdlib sources, on CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--output-dir",
        default="runs/difftransformer-stdlib",
        help="folder for checkpoints, the final model (OUTPUT_DIR/model), sample, plot and metrics",
    )
    p.add_argument(
        "--diff-version",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: the paper's DIFF V1 (scalar λ per layer, per-head RMSNorm); 2: DIFF V2 (per-token λ)",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--vocab-size", type=int, default=4096, help="BPE vocabulary size of the tokenizer trained on the corpus"
    )
    g.add_argument("--hidden-size", type=int, default=256, help="model width")
    g.add_argument("--num-layers", type=int, default=4, help="decoder layers")
    g.add_argument(
        "--num-heads",
        type=int,
        default=8,
        help="query heads of width head_dim = hidden/num_heads, two per differential head (must be even)",
    )
    g.add_argument(
        "--num-kv-heads",
        type=int,
        default=4,
        help="key/value heads (V1: even; V1 and V2: must divide the differential heads into equal groups)",
    )
    g.add_argument("--intermediate-size", type=int, default=688, help="SwiGLU MLP width")
    g = p.add_argument_group("data and optimisation")
    g.add_argument("--block-size", type=int, default=256, help="tokens per training sequence")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step (per device)")
    g.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    g.add_argument("--max-steps", type=int, default=300, help="optimizer steps (sets the length of the LR schedule)")
    g.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="optional wall-clock budget: stop (with a checkpoint) after this many minutes of training",
    )
    g.add_argument("--learning-rate", type=float, default=1e-3, help="peak AdamW learning rate (cosine decay)")
    g.add_argument("--warmup-steps", type=int, default=30, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    g.add_argument("--train-max-chars", type=int, default=None, help="cap on training-corpus characters (default: all)")
    g.add_argument("--validation-max-chars", type=int, default=None, help="cap on validation-corpus characters")
    g.add_argument("--eval-blocks", type=int, default=64, help="validation sequences used for each evaluation")
    g.add_argument("--bf16", action="store_true", help="bfloat16 autocast (fast on CPUs with AVX512-BF16/AMX)")
    g.add_argument("--seed", type=int, default=0, help="seed for initialisation, data order and sampling")
    g = p.add_argument_group("run control")
    g.add_argument("--eval-steps", type=int, default=100, help="evaluate the validation loss every N steps")
    g.add_argument("--save-steps", type=int, default=100, help="save a resumable checkpoint every N steps")
    g.add_argument("--logging-steps", type=int, default=10, help="log the training loss every N steps")
    g.add_argument(
        "--telemetry-every",
        type=int,
        default=50,
        help="differential-attention telemetry on two held-out blocks every N steps (one summary line in "
        "the terminal; every per-layer value to --report-to and trainer_state.json); 0: off",
    )
    g.add_argument(
        "--report-to",
        default="none",
        help="transformers' report_to: where the logs go besides trainer_state.json (none, tensorboard, "
        "wandb, all, or a comma-separated list)",
    )
    g.add_argument("--fresh", action="store_true", help="ignore existing checkpoints in OUTPUT_DIR and start over")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--use-cpu", action="store_true", help="train on CPU even if an accelerator is available")
    g.add_argument(
        "--tokenizer-cache",
        default=None,
        help="folder caching the trained tokenizer (default: $DIFFTRANSFORMER_CACHE or ~/.cache/difftransformer)",
    )
    g = p.add_argument_group("sample")
    g.add_argument("--prompt", default="def ", help="prompt for the generated sample")
    g.add_argument("--sample-tokens", type=int, default=64, help="new tokens to sample after training")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model and data, a few steps: checks the whole pipeline in seconds "
        f"(overrides: {', '.join(f'{k}={v}' for k, v in SMOKE.items())})",
    )
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        # Smoke settings replace the defaults but not what the user typed explicitly.
        typed = argv if argv is not None else sys.argv[1:]
        explicit = {
            a.dest
            for a in parser._actions
            if any(t == opt or t.startswith(opt + "=") for t in typed for opt in a.option_strings)
        }
        for key, value in SMOKE.items():
            if key not in explicit:
                setattr(args, key, value)
    for name in (
        "max_steps",
        "batch_size",
        "grad_accum",
        "block_size",
        "eval_steps",
        "save_steps",
        "logging_steps",
        "eval_blocks",
        "sample_tokens",
    ):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.telemetry_every < 0:
        parser.error(f"--telemetry-every must be a positive integer or 0 (off), got {args.telemetry_every}")
    return args


def plot_loss_curve(log_history: list[dict], path: str | os.PathLike, title: str = "") -> Path:
    """PNG of training loss and validation loss against optimizer step, from ``trainer.state.log_history``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e and "step" in e]
    valid = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e and "step" in e]
    if not train and not valid:
        raise ValueError("`log_history` holds no 'loss' or 'eval_loss' entries to plot.")
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue", linewidth=1.2)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation loss", color="tab:orange")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def _check_resume_compatible(output_dir: Path, run_config: dict) -> None:
    saved_path = output_dir / "run_args.json"
    if not saved_path.is_file():
        return
    saved = json.loads(saved_path.read_text())
    diff = {k: (saved.get(k), run_config[k]) for k in RUN_KEYS if saved.get(k) != run_config[k]}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise SystemExit(
            f"{output_dir} holds checkpoints of a different run ({detail}). Rerun with the same settings to resume, "
            "pass --fresh to start over there, or choose another --output-dir."
        )


def run(args: argparse.Namespace, callbacks=()) -> dict:
    """The whole job; returns the metrics it also writes to ``OUTPUT_DIR/metrics.json``.

    ``metrics["interrupted"]`` is true when a signal stopped training (a checkpoint was saved; no final model was
    written). ``--max-minutes`` instead ends the run normally, with a checkpoint, evaluation and the final model.
    """
    import shutil

    import torch
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    import difftransformer
    from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
    from difftransformer.hub import save_for_hub
    from difftransformer.research.data import get_tokenizer, lm_datasets
    from difftransformer.research.upcycle import StopControl

    if args.threads:
        torch.set_num_threads(args.threads)
    output_dir = Path(args.output_dir)
    if args.fresh and output_dir.exists():
        shutil.rmtree(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    run_config = {k: getattr(args, k) for k in RUN_KEYS}
    last_checkpoint = get_last_checkpoint(str(output_dir)) if output_dir.is_dir() else None
    if last_checkpoint:
        _check_resume_compatible(output_dir, run_config)
    (output_dir / "run_args.json").write_text(json.dumps(vars(args), indent=2))

    print(f"difftransformer {difftransformer.__version__}: corpus = Python {sys.version.split()[0]} stdlib sources")
    tokenizer = get_tokenizer(args.vocab_size, cache_dir=args.tokenizer_cache)
    train_set, valid_set = lm_datasets(
        tokenizer,
        args.block_size,
        train_max_chars=args.train_max_chars,
        validation_max_chars=args.validation_max_chars,
        max_validation_blocks=args.eval_blocks,
    )
    print(f"train: {len(train_set)} blocks x {args.block_size} tokens; validation: {len(valid_set)} blocks")

    config = DiffTransformerConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=max(args.block_size, 2048),
        diff_version=args.diff_version,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)
    model = DiffTransformerForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: DIFF V{args.diff_version}, {n_params / 1e6:.2f}M parameters")

    training_args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        adam_beta2=0.95,
        optim="adamw_torch",
        bf16=args.bf16,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=2,
        logging_steps=args.logging_steps,
        report_to=[r.strip() for r in args.report_to.split(",")] if "," in args.report_to else args.report_to,
        seed=args.seed,
        use_cpu=args.use_cpu or (args.bf16 and not torch.cuda.is_available()),  # transformers: CPU bf16 needs use_cpu
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
        disable_tqdm=False,  # the progress bar
    )
    stop = StopControl(args.max_minutes)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=valid_set,
        processing_class=tokenizer,
        callbacks=[stop, *callbacks],
    )
    if args.telemetry_every:
        from difftransformer.research.telemetry import DiffAttentionTelemetryCallback

        DiffAttentionTelemetryCallback(valid_set.blocks[:2, :128], every=args.telemetry_every).attach(trainer)
    if last_checkpoint:
        print(f"resuming from {last_checkpoint}")
    stop.install()
    try:
        train_output = trainer.train(resume_from_checkpoint=last_checkpoint)
    finally:
        stop.uninstall()
    # A signal stops without a final model (resume later); the time budget ends the run normally.
    interrupted = stop.signal_received is not None
    metrics = {
        "diff_version": args.diff_version,
        "parameters": n_params,
        "global_step": trainer.state.global_step,
        "max_steps": args.max_steps,
        "interrupted": interrupted,
        "stopped_early": trainer.state.global_step < args.max_steps,
        "train_loss": train_output.training_loss,
        "train_runtime_s": train_output.metrics.get("train_runtime"),
        "tokens_seen": trainer.state.global_step * args.batch_size * args.grad_accum * args.block_size,
    }
    plot_loss_curve(
        trainer.state.log_history,
        output_dir / "loss_curve.png",
        title=f"DiffTransformer V{args.diff_version} on the Python stdlib",
    )
    if args.telemetry_every:
        from difftransformer.research.telemetry import plot_telemetry

        plot_telemetry(
            trainer.state.log_history,
            output_dir / "telemetry.png",
            title=f"DiffTransformer V{args.diff_version}: differential-attention telemetry",
        )
    if interrupted:
        print(
            f"stopped at step {trainer.state.global_step}/{args.max_steps} ({stop.signal_received}); checkpoint saved "
            f"in {output_dir}. Run the same command again to resume."
        )
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        return metrics

    eval_metrics = trainer.evaluate()
    metrics["validation_loss"] = eval_metrics["eval_loss"]
    metrics["validation_perplexity"] = math.exp(min(eval_metrics["eval_loss"], 50.0))
    print(f"validation loss {metrics['validation_loss']:.4f} (perplexity {metrics['validation_perplexity']:.1f})")

    model_dir = output_dir / "model"
    save_for_hub(
        trainer.model,
        model_dir,
        tokenizer=tokenizer,
        training_note=(
            f"Trained with `examples/train.py` for {trainer.state.global_step} steps on the Python "
            f"{sys.version.split()[0]} standard library sources (validation loss {metrics['validation_loss']:.3f})."
        ),
    )
    print(f"model, tokenizer and model card saved to {model_dir}")

    model = trainer.model.eval()
    inputs = tokenizer(args.prompt, return_tensors="pt").to(model.device)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        generated = model.generate(
            **inputs,
            max_new_tokens=args.sample_tokens,
            do_sample=True,
            top_k=40,
            temperature=0.8,
            pad_token_id=tokenizer.pad_token_id,
        )
    sample = tokenizer.decode(generated[0], skip_special_tokens=True)
    (output_dir / "sample.txt").write_text(sample, encoding="utf-8")
    metrics["sample"] = sample
    print("sample:\n" + "-" * 40 + f"\n{sample}\n" + "-" * 40)
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"loss curve: {output_dir / 'loss_curve.png'}")
    return metrics


def main(argv=None) -> int:
    metrics = run(parse_args(argv))
    return 130 if metrics["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
