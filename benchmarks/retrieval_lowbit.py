"""Does differential attention help? Retrieval with distractors and low-bit attention, DIFF V1 / V2 vs a Llama, seeds.

The Differential Transformer paper (Ye et al., arXiv 2410.05258) reports its largest effects on multi-needle retrieval
(§3.3: more accurate retrieval, more attention to the answer, less to the noise) and on low-bit attention (§3.7:
accuracy kept with quantised attention logits, smaller activation outliers). This script tests both at toy scale on
synthetic tasks that a parameter-matched Llama learns (:mod:`difftransformer.research.retrieval_tasks`: multi-needle
retrieval whose distractor needles share the queried key's prefix, and multi-query associative recall), for DIFF V1,
DIFF V2 and the Llama at matched parameters (``compare_small.build_configs``), trained on the same data in the same
order from the same initialisation stream, over several paired seeds:

1. accuracy (argmax over the whole vocabulary equals the answer) and answer loss on held-out sequences, over context
   lengths (beyond the trained length too), needle counts and needle depths; MQAR over pair counts;
2. the attention lens (:func:`difftransformer.research.analysis.lens_on_spans`) on held-out needle prompts: share of
   attention on the queried needle (answer), on the rest of the context (noise) and on the distractor needles;
3. low-bit attention (:mod:`difftransformer.research.lowbit`): accuracy and loss with the attention logits, or q and k,
   quantised to 8, 6 and 4 bits (symmetric, per tensor and per head), and the top activations of attention logits
   and hidden states per layer.

Outputs in ``--out``: ``results.json`` (every run, the per-seed / mean / paired-difference summary, provenance),
``results.md`` (that summary as a table), ``curves.png``, ``accuracy_vs_length.png``, ``accuracy_vs_bits.png`` and
``attention_shares.png``.

Resumable: each (seed, model) result is written into ``results.json`` as soon as it is done, and a rerun with the same
setting skips what is there (``--resume``, the default). Presets: ``default`` (single-threaded CPU, at most two
CPU-hours for three models x three seeds), ``gpu`` (larger model and data, ten seeds), ``lr_grid`` (the
learning-rate grid: 20,000 steps, seeds 5 to 8, stopping once both tasks hold 90%; scripts/retrieval_lr_grid.sh),
``lowbit_budget`` (low-bit attention at a fixed budget: 10,000 steps, no early stop, seeds 17 to 24, 8/6/5/4 bits) and
``smoke`` (seconds; the tests run it). Every flag overrides its preset's value. Run from the repository root:
``python -m benchmarks.retrieval_lowbit``.

The docs' tables and the report's summary are rendered from the results files (``doc_table_*``, ``doc_summary``,
``headline``; scripts/doc_tables.py), every difference with an exact test (:mod:`benchmarks.exact_tests`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import statistics
import sys
import time

# `python benchmarks/retrieval_lowbit.py` (from the repository root) runs as
# `python -m benchmarks.retrieval_lowbit`: the imports below need the root on sys.path, where `python -m` puts it.
if __name__ == "__main__" and not __package__:
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.retrieval_lowbit", *sys.argv[1:]])

import torch  # noqa: E402

from benchmarks import exact_tests, harness  # noqa: E402
from benchmarks.compare_small import build_configs, build_model  # noqa: E402
from difftransformer.research import retrieval_tasks as rt  # noqa: E402

SCRIPT = "retrieval_lowbit.py"
MODELS = ("llama", "v1", "v2")
LABELS = {"v1": "DIFF V1", "v2": "DIFF V2", "llama": "Llama"}

_DEFAULT = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=192,
    train_length=64,
    batch_size=32,
    steps=10000,
    warmup=200,
    lr=1e-3,
    schedule="constant",
    needle_fraction=0.45,
    copy_fraction=0.25,
    train_needles="1,2,4,6",
    train_queries=8,
    train_pairs="2,4,6,8,12",
    eval_lengths="48,64,80,96,128,256",
    eval_needles="2,4,6,8",
    eval_depths="0,0.25,0.5,0.75,1",
    eval_samples=8,
    eval_pairs="4,8,12,16,24,32,48",
    mqar_samples=16,
    lowbit_samples=6,
    lowbit_bits="8,6,4",
    lens_examples=20,
    eval_every=500,
    seeds="0,1,2",
    threads=1,
    device="cpu",
)
PRESETS = {
    # Frozen after calibrating the Llama alone (docs/reports/2026-11-27-retrieval-lowbit.md, "Calibration"): at this
    # size and budget a Llama's validation accuracy on both tasks jumps from chance to ~1 between 4,000 and 5,000 steps.
    "default": _DEFAULT,
    # The same recipe, wider, twice the context and steps, ten seeds (not run here: no GPU was available).
    "gpu": _DEFAULT
    | dict(
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=384,
        train_length=128,
        batch_size=64,
        steps=20000,
        train_needles="1,2,4,6,8,12",
        train_pairs="2,4,8,12,16,24",
        eval_lengths="64,128,160,192,256,512",
        eval_needles="2,4,8,12,16",
        eval_samples=16,
        eval_pairs="8,16,24,32,48",
        mqar_samples=32,
        lowbit_samples=12,
        lens_examples=25,
        seeds="0,1,2,3,4,5,6,7,8,9",
        threads=4,
        device="cuda",
    ),
    # The learning-rate grid: the default recipe at 20,000 steps on seeds never used for calibration (nor by the
    # default's runs, 0-4), one --lr per call; a run stops once both tasks' validation accuracy has been at 90% or more
    # at three validations in a row (1,000 steps at eval_every 500). scripts/retrieval_lr_grid.sh runs the grid.
    "lr_grid": _DEFAULT | dict(steps=20000, seeds="5,6,7,8", stop_held=3),
    # Low-bit attention at a fixed budget (docs/reports/2026-12-02-retrieval-bracket-and-fixed-budget.md): the default
    # recipe on seeds no other run used, every run trained for its whole 10,000 steps (no early stop), the attention
    # logits also at 5 bits; one --lr per model (its best rate).
    "lowbit_budget": _DEFAULT | dict(seeds="17,18,19,20,21,22,23,24", lowbit_bits="8,6,5,4"),
    "smoke": dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        train_length=48,
        batch_size=4,
        steps=3,
        warmup=1,
        lr=1e-3,
        schedule="constant",
        needle_fraction=0.4,
        copy_fraction=0.2,
        train_needles="1,2,4",
        train_queries=2,
        train_pairs="4,8",
        eval_lengths="48,64",
        eval_needles="2,4",
        eval_depths="0,1",
        eval_samples=1,
        eval_pairs="4,8",
        mqar_samples=1,
        lowbit_samples=1,
        lowbit_bits="4",
        lens_examples=2,
        eval_every=2,
        seeds="0,1",
        threads=1,
        device="cpu",
    ),
}
# The preset values that define a run's setting (a result is reused by --resume only under the same setting).
# Keys that join the setting only where set (so that the settings of results run before they existed keep their ids).
OPTIONAL_SETTING_KEYS = ("stop_held",)
SETTING_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "train_length",
    "batch_size",
    "steps",
    "warmup",
    "lr",
    "schedule",
    "needle_fraction",
    "copy_fraction",
    "train_needles",
    "train_queries",
    "train_pairs",
    "eval_lengths",
    "eval_needles",
    "eval_depths",
    "eval_samples",
    "eval_pairs",
    "mqar_samples",
    "lowbit_samples",
    "lowbit_bits",
    "lens_examples",
    "eval_every",
    "analysis",
)
TARGETS = ("logits", "qk")
GRANULARITIES = ("tensor", "head")


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


# ----------------------------------------------------------------------------------------------- data


def make_data(args, seed: int) -> dict:
    """Training batches (the same list, in the same order, for every model of a seed), a validation set at the
    trained length (for the curves), and the held-out evaluation sets; validation and evaluation use other seeds."""
    vocab = rt.TaskVocab()
    count = args.steps * args.batch_size
    train = rt.training_examples(
        vocab,
        count,
        seed,
        args.train_length,
        _ints(args.train_needles),
        _ints(args.train_pairs),
        args.needle_fraction,
        args.train_queries,
        copy_fraction=args.copy_fraction,
    )
    batches = [rt.encode(train[i : i + args.batch_size]) for i in range(0, count, args.batch_size)]
    val_seed, eval_seed = seed + 10_000, seed + 20_000
    depths = _floats(args.eval_depths)
    val = rt.needle_grid(vocab, [args.train_length], _ints(args.train_needles)[-2:], depths, 2, val_seed, num_queries=4)
    val += rt.mqar_grid(
        vocab, [n for n in _ints(args.train_pairs) if rt.mqar_length(n) <= args.train_length][-2:], 4, val_seed
    )
    if args.copy_fraction > 0:  # the induction data: its accuracy shows when induction heads form
        val += [rt.repeated_copy(vocab, 24, rt.seeded_rng(val_seed, "copy", i)) for i in range(8)]
    lengths, needles = _ints(args.eval_lengths), _ints(args.eval_needles)
    evals = {
        "needle": rt.needle_grid(vocab, lengths, needles, depths, args.eval_samples, eval_seed),
        "mqar": rt.mqar_grid(vocab, _ints(args.eval_pairs), args.mqar_samples, eval_seed),
        # Low-bit attention and activation statistics: at the trained length, where every model is in distribution.
        "lowbit_needle": rt.needle_grid(
            vocab, [args.train_length], needles, depths, args.lowbit_samples, eval_seed + 1
        ),
        "lowbit_mqar": rt.mqar_grid(
            vocab,
            [n for n in _ints(args.train_pairs) if rt.mqar_length(n) <= args.train_length][-2:],
            2 * args.lowbit_samples,
            eval_seed + 1,
        ),
        # Lens prompts: cut right after the first query's key (the last token predicts the answer).
        "lens": rt.needle_grid(
            vocab,
            [args.train_length],
            needles,
            depths,
            max(1, math.ceil(args.lens_examples / (len(needles) * len(depths)))),
            eval_seed + 2,
        )[: args.lens_examples],
    }
    return {"vocab": vocab, "batches": batches, "val": val, "evals": evals}


# ----------------------------------------------------------------------------------------------- training


def summarize_scores(examples, scores) -> dict:
    """Mean accuracy (whole-vocabulary argmax), multiple-choice accuracy and answer loss over every query."""
    correct = [c for s in scores for c in s["correct"]]
    choice = [c for s in scores for c in s["choice_correct"]]
    loss = [x for s in scores for x in s["loss"]]
    return {
        "accuracy": sum(correct) / len(correct),
        "choice_accuracy": sum(choice) / len(choice),
        "loss": sum(loss) / len(loss),
        "n": len(correct),
    }


STOP_TASKS, STOP_LEVEL = ("needle", "mqar"), 0.9


def train(
    model,
    batches,
    val,
    lr: float,
    warmup: int,
    eval_every: int,
    device: str,
    progress: bool = False,
    schedule: str = "cosine",
    stop_held: int = 0,
) -> dict:
    """AdamW (betas 0.9/0.95, weight decay 0.1, as the paper), linear warm-up then a cosine decay to zero or a
    constant rate (``schedule``), gradient clipping at 1.0 (compare_small's recipe); loss on the answer tokens only.
    ``stop_held`` > 0: stop once the validation accuracy of every task in ``STOP_TASKS`` has been ``STOP_LEVEL`` or
    more at that many validations in a row (``curves["stopped_at"]``: the step; None where the run went to the end).
    Returns the curves and the times."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    if schedule == "cosine":
        sched = get_cosine_schedule_with_warmup(opt, warmup, len(batches))
    else:
        sched = get_constant_schedule_with_warmup(opt, warmup)
    curves = {
        "step": [],
        "train_loss": [],
        "eval_step": [],
        "val_loss": [],
        "val_accuracy": [],
        "val_accuracy_by_task": {},
        "stopped_at": None,
    }

    def evaluate_now(step):
        model.eval()
        scores = rt.score(model, val)
        model.train()
        s = summarize_scores(val, scores)
        by_task = grouped(val, scores, lambda e: e.task)
        curves["eval_step"].append(step)
        curves["val_loss"].append(s["loss"])
        curves["val_accuracy"].append(s["accuracy"])
        for task, v in by_task.items():
            curves["val_accuracy_by_task"].setdefault(task, []).append(v["accuracy"])
        if progress:
            print(
                f"  step {step}: val loss {s['loss']:.3f} acc {s['accuracy']:.3f} ("
                + ", ".join(f"{t} {v['accuracy']:.2f}" for t, v in by_task.items())
                + ")",
                flush=True,
            )

    cpu0, wall0 = time.process_time(), time.time()
    model.train()
    with harness.trace_code():  # the code record (harness.code_record): a validation pass and the first step
        evaluate_now(0)
    window = []
    for step, (ids, labels) in enumerate(batches, 1):
        with harness.trace_code() if step == 1 else contextlib.nullcontext():
            loss = model(input_ids=ids.to(device), labels=labels.to(device), use_cache=False).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        window.append(loss.item())
        if step % 10 == 0 or step == len(batches):  # the mean of every 10 steps keeps the JSON small
            curves["step"].append(step)
            curves["train_loss"].append(sum(window) / len(window))
            window = []
        if step % eval_every == 0 or step == len(batches):
            evaluate_now(step)
            if stop_held and _held(curves, stop_held):
                if window:
                    curves["step"].append(step)
                    curves["train_loss"].append(sum(window) / len(window))
                curves["stopped_at"] = step
                break
    curves["train_cpu_s"] = time.process_time() - cpu0
    curves["train_wall_s"] = time.time() - wall0
    model.eval()
    return curves


def _held(curves: dict, n: int) -> bool:
    """Whether every task of ``STOP_TASKS`` was at ``STOP_LEVEL`` or more at the last ``n`` validations."""
    by_task = curves["val_accuracy_by_task"]
    return all(len(by_task.get(t, [])) >= n and min(by_task[t][-n:]) >= STOP_LEVEL for t in STOP_TASKS)


# ----------------------------------------------------------------------------------------------- evaluation


def grouped(examples, scores, key) -> dict:
    groups: dict = {}
    for ex, s in zip(examples, scores):
        groups.setdefault(key(ex), ([], []))
        groups[key(ex)][0].append(ex)
        groups[key(ex)][1].append(s)
    return {str(k): summarize_scores(*v) for k, v in sorted(groups.items())}


def evaluate_retrieval(model, evals) -> dict:
    needle = evals["needle"]
    ns = rt.score(model, needle)
    ms = rt.score(model, evals["mqar"])
    return {
        "needle": {
            "overall": summarize_scores(needle, ns),
            "by_length": grouped(needle, ns, lambda e: e.context_length),
            "by_needles": grouped(needle, ns, lambda e: e.count),
            "by_depth": grouped(needle, ns, lambda e: e.depth),
            "cells": {
                f"{L}/{n}": v
                for (L, n), v in (
                    (tuple(map(int, k.split("/"))), v)
                    for k, v in grouped(needle, ns, lambda e: f"{e.context_length}/{e.count}").items()
                )
            },
        },
        "mqar": {
            "overall": summarize_scores(evals["mqar"], ms),
            "by_pairs": grouped(evals["mqar"], ms, lambda e: e.count),
        },
    }


def evaluate_lowbit(model, evals, bits_list) -> dict:
    """Accuracy and loss on the low-bit sets with every quantisation (and none), and the activation statistics."""
    from difftransformer.research import lowbit

    sets = {"needle": evals["lowbit_needle"], "mqar": evals["lowbit_mqar"]}
    out = {}

    def run(tag):
        out[tag] = {name: summarize_scores(ex, rt.score(model, ex)) for name, ex in sets.items()}

    with lowbit.low_bit_attention(model, target=None):
        run("none")
    for target in TARGETS:
        for granularity in GRANULARITIES:
            for bits in bits_list:
                with lowbit.low_bit_attention(model, target=target, bits=bits, granularity=granularity):
                    run(f"{target}/{granularity}/{bits}")
    ids = torch.tensor([ex.input_ids for ex in sets["needle"]])
    stats = lowbit.activation_statistics(model, ids.to(next(model.parameters()).device))
    return {"accuracy": out, "activations": stats}


def evaluate_lens(model, examples) -> dict:
    """Answer / noise / distractor shares of the attention of the first query's last key token (positive mass of the
    differential maps for V1/V2, softmax maps for the Llama), mean over heads and prompts, per layer."""
    from difftransformer.research import analysis

    items = []
    for ex in examples:
        pos, _ = ex.targets[0]
        length = pos + 1
        distractor = torch.zeros(length, dtype=torch.bool)
        for a, b in ex.distractors[0]:
            distractor[a:b] = True
        items.append(
            analysis.SpanExample(
                torch.tensor(ex.input_ids[:length]), ex.evidence[0], (0, ex.question_start), {"distractors": distractor}
            )
        )
    lensed = analysis.lens_on_spans(model, items)
    kind = "diff" if "diff" in lensed.shares else "softmax"
    shares = lensed.shares[kind]  # (L, heads, 3)
    distractors = lensed.region_shares["distractors"][kind]  # (L, heads)
    best = shares[..., 0].flatten().argmax()
    result = {
        "kind": kind,
        "examples": lensed.examples,
        "per_layer": {k: s.mean(1).tolist() for k, s in lensed.shares.items()},
        "distractor_per_layer": distractors.mean(1).tolist(),
        "answer_mean": float(shares[..., 0].mean()),
        "noise_mean": float(shares[..., 1].mean()),
        "distractor_mean": float(distractors.mean()),
        "answer_best_head": float(shares[..., 0].flatten()[best]),
        "noise_of_best_head": float(shares[..., 1].flatten()[best]),
        "distractor_of_best_head": float(distractors.flatten()[best]),
    }
    if lensed.lambdas is not None:
        lam = lensed.lambdas
        result["lambdas"] = (
            lam.tolist()
            if lam.dim() == 1
            else {"mean": lam[..., 0].mean(1).tolist(), "std": lam[..., 1].mean(1).tolist()}
        )
    return result


# ----------------------------------------------------------------------------------------------- aggregation


def paired_summary(runs: dict, metric) -> dict:
    """Per model: the metric per seed, mean and sample std; for V1/V2 the per-seed difference to the Llama of the same
    seed, its mean, sample std and range (seeds where both ran)."""
    out = {}
    for name in MODELS:
        per_seed = {seed: metric(r) for (m, seed), r in runs.items() if m == name}
        if not per_seed:
            continue
        values = list(per_seed.values())
        entry = {
            "per_seed": {str(k): v for k, v in sorted(per_seed.items())},
            "mean": statistics.mean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        }
        if name != "llama":
            diffs = {s: v - metric(runs[("llama", s)]) for s, v in per_seed.items() if ("llama", s) in runs}
            if diffs:
                d = list(diffs.values())
                entry["diff_vs_llama"] = {
                    "per_seed": {str(k): v for k, v in sorted(diffs.items())},
                    "mean": statistics.mean(d),
                    "std": statistics.stdev(d) if len(d) > 1 else 0.0,
                    "min": min(d),
                    "max": max(d),
                }
        out[name] = entry
    return out


def steps_to(curves: dict, task: str, level: float) -> int:
    """The first validation step at which ``task``'s validation accuracy reached ``level``; the last step plus one
    validation interval where it never did (a censored value: read it as "more than the run's steps")."""
    steps, accs = curves["eval_step"], curves["val_accuracy_by_task"].get(task, [])
    hit = next((s for s, a in zip(steps, accs) if a >= level), None)
    return hit if hit is not None else steps[-1] + (steps[-1] - steps[-2] if len(steps) > 1 else 1)


def summaries(runs: dict) -> dict:
    if not runs:
        return {}
    first = next(iter(runs.values()))
    metrics = {
        "needle_accuracy": lambda r: r["eval"]["needle"]["overall"]["accuracy"],
        "mqar_accuracy": lambda r: r["eval"]["mqar"]["overall"]["accuracy"],
        "needle_loss": lambda r: r["eval"]["needle"]["overall"]["loss"],
    }
    for task in ("needle", "mqar"):  # when retrieval "clicks": a censored value (steps + eval_every) where it never did
        metrics[f"steps_to_90pct_val_{task}"] = lambda r, t=task: steps_to(r["curves"], t, 0.9)
    for L in first["eval"]["needle"]["by_length"]:
        metrics[f"needle_accuracy@{L}"] = lambda r, L=L: r["eval"]["needle"]["by_length"][L]["accuracy"]
    for n in first["eval"]["needle"]["by_needles"]:
        metrics[f"needle_accuracy@{n}needles"] = lambda r, n=n: r["eval"]["needle"]["by_needles"][n]["accuracy"]
    for n in first["eval"]["mqar"]["by_pairs"]:
        metrics[f"mqar_accuracy@{n}pairs"] = lambda r, n=n: r["eval"]["mqar"]["by_pairs"][n]["accuracy"]
    if "lowbit" in first:
        for tag in first["lowbit"]["accuracy"]:
            for task in ("needle", "mqar"):
                metrics[f"lowbit {tag} {task}_accuracy"] = lambda r, t=tag, k=task: r["lowbit"]["accuracy"][t][k][
                    "accuracy"
                ]
                metrics[f"lowbit {tag} {task}_loss"] = lambda r, t=tag, k=task: r["lowbit"]["accuracy"][t][k]["loss"]
        metrics["max_attention_logit"] = lambda r: max(x["max"] for x in r["lowbit"]["activations"]["logits"])
        metrics["max_hidden_state"] = lambda r: max(x["max"] for x in r["lowbit"]["activations"]["hidden"])
        metrics["logit_kurtosis_max"] = lambda r: max(x["kurtosis"] for x in r["lowbit"]["activations"]["logits"])
        metrics["hidden_kurtosis_max"] = lambda r: max(x["kurtosis"] for x in r["lowbit"]["activations"]["hidden"])
    if "lens" in first:
        for key in ("answer_mean", "noise_mean", "distractor_mean", "answer_best_head", "noise_of_best_head"):
            metrics[f"lens {key}"] = lambda r, k=key: r["lens"][k]
    return {name: paired_summary(runs, fn) for name, fn in metrics.items()}


# ----------------------------------------------------------------------------------------------- plots


def _mean_by_seed(runs, model, path):
    rows = [r for (m, _), r in runs.items() if m == model]
    if not rows:
        return None
    keys = list(path(rows[0]).keys())
    return keys, [[path(r)[k] for r in rows] for k in keys]


def plot_accuracy_vs_length(runs, args, path) -> str:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for model in MODELS:
        for ax, key in zip(axes, ("by_length", "by_needles")):
            got = _mean_by_seed(runs, model, lambda r: r["eval"]["needle"][key])
            if got:
                xs, vals = got
                ys = [statistics.mean(v["accuracy"] for v in vs) for vs in vals]
                ax.plot([int(x) for x in xs], ys, marker="o", label=LABELS[model])
                for x, vs in zip(xs, vals):
                    ax.scatter([int(x)] * len(vs), [v["accuracy"] for v in vs], s=8, alpha=0.4)
        got = _mean_by_seed(runs, model, lambda r: r["eval"]["mqar"]["by_pairs"])
        if got:
            xs, vals = got
            axes[2].plot(
                [int(x) for x in xs],
                [statistics.mean(v["accuracy"] for v in vs) for vs in vals],
                marker="o",
                label=LABELS[model],
            )
            for x, vs in zip(xs, vals):
                axes[2].scatter([int(x)] * len(vs), [v["accuracy"] for v in vs], s=8, alpha=0.4)
    titles = (
        f"multi-needle accuracy vs context length (trained <= {args.train_length})",
        "multi-needle accuracy vs needle count",
        f"MQAR accuracy vs pairs (trained <= {max(_ints(args.train_pairs))})",
    )
    for ax, title, xlabel in zip(axes, titles, ("tokens", "needles", "pairs")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].axvline(args.train_length, color="gray", linestyle=":")
    fig.tight_layout()
    harness.save_figure(fig, path)
    return path


def plot_accuracy_vs_bits(runs, args, path) -> str:
    plt = harness.pyplot()
    bits = _ints(args.lowbit_bits)
    fig, axes = plt.subplots(2, 4, figsize=(17, 7), squeeze=False)
    for col, (target, gran) in enumerate((t, g) for t in TARGETS for g in GRANULARITIES):
        for row, task in enumerate(("needle", "mqar")):
            ax = axes[row][col]
            for model in MODELS:
                rows = [r for (m, _), r in runs.items() if m == model and "lowbit" in r]
                if not rows:
                    continue
                xs = [32] + bits
                tags = ["none"] + [f"{target}/{gran}/{b}" for b in bits]
                ys = [statistics.mean(r["lowbit"]["accuracy"][t][task]["accuracy"] for r in rows) for t in tags]
                ax.plot(range(len(xs)), ys, marker="o", label=LABELS[model])
                ax.set_xticks(range(len(xs)), ["fp32"] + [str(b) for b in bits])
            ax.set_title(f"{task}: {target} quantised per {gran}", fontsize=9)
            ax.set_xlabel("bits")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    harness.save_figure(fig, path)
    return path


def plot_lens(runs, path) -> str:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for model in MODELS:
        rows = [r for (m, _), r in runs.items() if m == model and "lens" in r]
        if not rows:
            continue
        kind = rows[0]["lens"]["kind"]
        per_layer = [r["lens"]["per_layer"][kind] for r in rows]
        layers = range(len(per_layer[0]))
        for ax, idx in zip(axes[:2], (0, 1)):
            ax.plot(
                layers,
                [statistics.mean(p[layer][idx] for p in per_layer) for layer in layers],
                marker="o",
                label=f"{LABELS[model]} ({kind})",
            )
        axes[2].plot(
            layers,
            [statistics.mean(r["lens"]["distractor_per_layer"][layer] for r in rows) for layer in layers],
            marker="o",
            label=f"{LABELS[model]} ({kind})",
        )
    for ax, title in zip(
        axes,
        (
            "attention to the queried needle",
            "attention noise (rest of the context)",
            "attention to distractor needles (same prefix)",
        ),
    ):
        ax.set_title(f"{title}; mean over heads, prompts, seeds", fontsize=9)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    harness.save_figure(fig, path)
    return path


def plot_curves(runs, path) -> str:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for (model, seed), r in sorted(runs.items()):
        c = r["curves"]
        style = {"llama": "-", "v1": "--", "v2": ":"}[model]
        axes[0].plot(c["step"], c["train_loss"], style, label=f"{LABELS[model]} s{seed}", alpha=0.8)
        axes[1].plot(c["eval_step"], c["val_accuracy"], style, marker=".", label=f"{LABELS[model]} s{seed}", alpha=0.8)
    axes[0].set_title("training answer loss (mean of 10 steps)", fontsize=9)
    axes[1].set_title("validation accuracy at the trained length", fontsize=9)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6, ncol=3)
    fig.tight_layout()
    harness.save_figure(fig, path)
    return path


# ----------------------------------------------------------------------------------------------- tables


def _fmt_entry(entry: dict, digits: int = 3) -> list[str]:
    """Cells: the per-seed values, mean ± sample std, and (V1/V2) the paired difference to the Llama."""
    seeds = " / ".join(f"{v:.{digits}f}" for v in entry["per_seed"].values())
    cells = [seeds, f"{entry['mean']:.{digits}f} ± {entry['std']:.{digits}f}"]
    d = entry.get("diff_vs_llama")
    cells.append(
        ""
        if d is None
        else f"{d['mean']:+.{digits}f} ± {d['std']:.{digits}f} [{d['min']:+.{digits}f}, {d['max']:+.{digits}f}]"
    )
    return cells


def markdown_tables(report: dict, metrics: list[str] | None = None) -> str:
    """results.md: one row per (metric, model): per-seed values (seed order), mean ± sample std over seeds, and the
    paired difference to the Llama of the same seed (mean ± sample std [min, max])."""
    summary = report["summary"]
    if not summary:
        return "(no finished runs)\n"
    first = next(iter(summary.values()))
    seeds = ", ".join(next(iter(first.values()))["per_seed"])
    lines = [
        f"Seeds {seeds}; setting `{report['meta']['setting_id']}`; command `{report['provenance']['command']}`.",
        "",
        "| metric | model | per seed | mean ± std | paired diff vs Llama: mean ± std [min, max] |",
        "|---|---|---|---|---|",
    ]
    for metric in metrics or list(summary):
        for model, entry in summary[metric].items():
            lines.append(f"| {metric} | {LABELS[model]} | " + " | ".join(_fmt_entry(entry)) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- docs

# The report's tables, its summary and the README's row (scripts/doc_tables.py renders them from results.json: a block
# `<!-- table: benchmarks.retrieval_lowbit:doc_table_retrieval benchmarks/results/retrieval_lowbit/results.json -->`).
# Each difference they state carries an exact test (benchmarks/exact_tests.py): at five seeds, or three runs against
# three, an approximation would misstate it.

LEARNED = 0.9  # a run learned a task where its held-out accuracy on it reaches this


def combined(datas: list[dict]) -> dict:
    """One report of the runs of several results files of the same setting (e.g. seeds run in parallel processes,
    each ``--out`` its own folder); the table lists every file, so each keeps its own provenance."""
    ids = {d["meta"]["setting_id"] for d in datas}
    if len(ids) != 1:
        raise ValueError(f"results of different settings cannot be combined: setting ids {sorted(ids)}")
    seen = [(r["model"], r["seed"]) for d in datas for r in d["runs"]]
    if len(seen) != len(set(seen)):
        raise ValueError("the files share a (model, seed) run: each run must come from one file")
    return {"meta": datas[0]["meta"], "runs": [r for d in datas for r in d["runs"]]}


def _seeds_of(report: dict, model: str, fn) -> dict:
    return {r["seed"]: fn(r) for r in report["runs"] if r["model"] == model}


def _mean_std(values) -> str:
    values = list(values)
    if not values:
        return "–"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    digits = 0 if all(isinstance(v, int) for v in values) else 2  # step counts
    return f"{statistics.mean(values):.{digits}f} ± {std:.{digits}f}"


def _paired(report: dict, model: str, fn) -> str:
    """``model``'s value minus the Llama's of the same seed: mean ± sample std [min, max] over the seeds."""
    mine, llama = _seeds_of(report, model, fn), _seeds_of(report, "llama", fn)
    diffs = [mine[s] - llama[s] for s in sorted(mine) if s in llama]
    if not diffs:
        return "–"
    digits = 0 if all(isinstance(v, int) for v in diffs) else 2
    return f"{_mean_std(diffs)} [{min(diffs):+.{digits}f}, {max(diffs):+.{digits}f}]"


def _unpaired(report: dict, model: str, fn) -> str:
    """``model``'s runs against the Llama's, unpaired: the difference of their means and the exact rank-sum test (the
    comparison a filter that leaves few paired seeds still allows)."""
    mine, llama = list(_seeds_of(report, model, fn).values()), list(_seeds_of(report, "llama", fn).values())
    if not mine or not llama:
        return "–"
    digits = 0 if all(isinstance(v, int) for v in mine + llama) else 2
    p = exact_tests.rank_sum(mine, llama)
    return (
        f"{statistics.mean(mine) - statistics.mean(llama):+.{digits}f}, p = {exact_tests.format_p(p)} ({len(mine)} vs "
        f"{len(llama)})"
    )


def _mean_over(groups: dict, keys) -> float:
    return statistics.mean(groups[k]["accuracy"] for k in keys)


def _queries(groups: dict, keys) -> int:
    return sum(groups[k]["n"] for k in keys)


def _length_groups(report: dict) -> dict:
    """The held-out needle lengths and MQAR pair counts by region: trained (up to the training length), up to 1.5
    times it, beyond that; MQAR pair counts whose sequence fits in the training length and the others."""
    train_length = report["meta"]["setting"]["train_length"]
    first = report["runs"][0]["eval"]
    lengths = list(first["needle"]["by_length"])
    pairs = list(first["mqar"]["by_pairs"])
    return {
        "inside": [k for k in lengths if int(k) <= train_length],
        "beyond": [k for k in lengths if int(k) > train_length],
        "near": [k for k in lengths if train_length < int(k) <= 1.5 * train_length],
        "far": [k for k in lengths if int(k) > 1.5 * train_length],
        "pairs_in": [k for k in pairs if rt.mqar_length(int(k)) <= train_length],
        "pairs_out": [k for k in pairs if rt.mqar_length(int(k)) > train_length],
    }


def retrieval_metrics(report: dict) -> dict:
    """The report's retrieval rows: label → function of one run. Trained lengths are those up to the training length
    (MQAR: pair counts whose sequence fits in it, 16 pairs at the default preset, more than training's 12); the
    others are beyond training."""
    g = _length_groups(report)
    groups = {  # rows over an empty set of lengths or pair counts are left out
        f"needle accuracy, trained lengths ({', '.join(g['inside'])} tokens)": ("needle", "by_length", g["inside"]),
        f"needle accuracy, longer contexts ({', '.join(g['beyond'])} tokens)": ("needle", "by_length", g["beyond"]),
        f"MQAR accuracy, within the training length ({', '.join(g['pairs_in'])} pairs)": (
            "mqar",
            "by_pairs",
            g["pairs_in"],
        ),
        f"MQAR accuracy, longer ({', '.join(g['pairs_out'])} pairs)": ("mqar", "by_pairs", g["pairs_out"]),
    }
    return {
        **{
            label: (lambda r, t=task, grp=group, k=keys: _mean_over(r["eval"][t][grp], k))
            for label, (task, group, keys) in groups.items()
            if keys
        },
        "needle answer loss (nats, all lengths)": lambda r: r["eval"]["needle"]["overall"]["loss"],
        "steps to 90% validation accuracy, needle (censored at the run's end)": lambda r: steps_to(
            r["curves"], "needle", 0.9
        ),
        "steps to 90% validation accuracy, MQAR": lambda r: steps_to(r["curves"], "mqar", 0.9),
    }


def _metric(report: dict, prefix: str):
    metrics = retrieval_metrics(report)
    return metrics[next(k for k in metrics if k.startswith(prefix))]


def learned(report: dict, task: str):
    """Whether a run learned ``task`` (needle: held-out accuracy at the trained lengths; MQAR: within the training
    length) to :data:`LEARNED` or more."""
    metric = _metric(report, "needle accuracy, trained" if task == "needle" else "MQAR accuracy, within")
    return lambda r: metric(r) >= LEARNED


def _learned_lowbit(task: str):
    """Whether a run's unquantized accuracy on the low-bit set of ``task`` reaches :data:`LEARNED` (the low-bit
    tables' filter: a model at chance has nothing to lose to quantization)."""
    return lambda r: r["lowbit"]["accuracy"]["none"][task]["accuracy"] >= LEARNED


def _model_table(
    report: dict, rows: dict, value_fmt=_mean_std, counted: bool = False, unpaired: bool = False
) -> list[str]:
    """One row per quantity: per model mean ± std over its runs, and the paired difference to the Llama. ``counted``:
    each cell names its number of runs (paired cells: the seeds where both models have one). ``unpaired``: also each
    model's runs against the Llama's, unpaired (:func:`_unpaired`)."""
    models = [m for m in MODELS if any(r["model"] == m for r in report["runs"])]
    head = (
        ["quantity"] + [LABELS[m] for m in models] + [f"{LABELS[m]} − Llama (paired)" for m in models if m != "llama"]
    )
    if unpaired:
        head += [f"{LABELS[m]} − Llama, unpaired runs (rank test)" for m in models if m != "llama"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def count(text, n):
        return f"{text} ({n})" if counted and text != "–" else text

    for label, fn in rows.items():
        cells = [count(value_fmt(v := _seeds_of(report, m, fn).values()), len(v)) for m in models]
        llama = set(_seeds_of(report, "llama", fn))
        cells += [
            count(_paired(report, m, fn), len(set(_seeds_of(report, m, fn)) & llama)) for m in models if m != "llama"
        ]
        if unpaired:
            cells += [_unpaired(report, m, fn) for m in models if m != "llama"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _learned_only(report: dict, opts: dict) -> tuple[dict, str]:
    """``opts["learned"]``: the report with only the runs whose needle accuracy at the trained lengths reaches it
    (the attention of a model that never retrieves says nothing about how retrieval attends), and the note saying so."""
    if "learned" not in opts:
        return report, ""
    level = float(opts["learned"])
    needle = _metric(report, "needle accuracy, trained")
    kept = [r for r in report["runs"] if needle(r) >= level]
    return report | {"runs": kept}, (
        f" Only the runs that learned needle retrieval (accuracy at the trained lengths {level:g} or more; in "
        "parentheses: runs, or seeds where both models did); unpaired: each model's runs against the Llama's, "
        "difference of the means and the exact rank-sum test."
    )


def _seeds_line(report: dict) -> str:
    seeds = sorted({r["seed"] for r in report["runs"]})
    params = {LABELS[r["model"]]: r["params"] for r in report["runs"] if r["seed"] == seeds[0]}
    return (
        f"Mean ± sample std over seeds {', '.join(map(str, seeds))}; paired: the model's value minus the Llama's of "
        "the same seed, mean ± std [min, max]. Parameters: " + ", ".join(f"{k} {v:,}" for k, v in params.items()) + "."
    )


def _noise_line(report: dict) -> str:
    """How many queries one run's accuracy rests on, per set, and the binomial noise that gives at accuracy 0.5."""
    g, first = _length_groups(report), report["runs"][0]["eval"]
    sets = {
        "needle, trained lengths": _queries(first["needle"]["by_length"], g["inside"]),
        "needle, longer": _queries(first["needle"]["by_length"], g["beyond"]),
        "MQAR, within": _queries(first["mqar"]["by_pairs"], g["pairs_in"]),
        "MQAR, longer": _queries(first["mqar"]["by_pairs"], g["pairs_out"]),
    }
    return (
        "Binomial noise of one run's accuracy, √(p(1−p)/n), at most (p = 0.5): "
        + ", ".join(f"{k} ±{exact_tests.binomial_noise(0.5, n):.3f} (n = {n})" for k, n in sets.items() if n)
        + "."
    )


def doc_table_retrieval(datas: list[dict], opts: dict) -> list[str]:
    """Retrieval accuracy per model (held-out sets), its paired difference to the Llama, and when it was learned."""
    report = combined(datas)
    return _model_table(report, retrieval_metrics(report)) + ["", _seeds_line(report) + " " + _noise_line(report)]


def doc_table_per_seed(datas: list[dict], opts: dict) -> list[str]:
    """Per seed and model: retrieval accuracy at the trained lengths (± the binomial noise of its queries) and when
    validation accuracy reached 90%."""
    report = combined(datas)
    g = _length_groups(report)
    needle = _metric(report, "needle accuracy, trained")
    mqar = _metric(report, "MQAR accuracy, within")
    steps = report["meta"]["setting"]["steps"]
    lines = [
        "| seed | model | needle accuracy, trained lengths | MQAR accuracy, within the training length | "
        "steps to 90% validation accuracy: needle / MQAR |",
        "|---|---|---|---|---|",
    ]
    for r in sorted(report["runs"], key=lambda r: (r["seed"], MODELS.index(r["model"]))):
        reached = [steps_to(r["curves"], t, 0.9) for t in ("needle", "mqar")]
        shown = " / ".join(str(n) if n <= steps else "not reached" for n in reached)
        cells = []
        for value, n in (
            (needle(r), _queries(r["eval"]["needle"]["by_length"], g["inside"])),
            (mqar(r), _queries(r["eval"]["mqar"]["by_pairs"], g["pairs_in"])),
        ):
            cells.append(f"{value:.2f} ± {exact_tests.binomial_noise(value, n):.2f}")
        lines.append(f"| {r['seed']} | {LABELS[r['model']]} | {cells[0]} | {cells[1]} | {shown} |")
    return lines + ["", "± the binomial noise of the run's accuracy, √(p(1−p)/n) over its n held-out queries."]


def doc_table_lowbit(datas: list[dict], opts: dict) -> list[str]:
    """Accuracy at the trained length with the attention logits or q and k quantized (``opts["task"]``: needle or
    mqar), per model, and the paired difference of the accuracy lost to quantization against the Llama's loss.
    Accuracy cells give the binomial noise of one run's accuracy at their mean. ``opts["learned"]`` (e.g. ``0.9``):
    only runs whose unquantized accuracy on that set reaches it (a model that never learned the task has nothing to
    lose); each cell then names its number of runs, a paired cell the seeds where both models learned, and unpaired
    columns compare each model's learned runs with the Llama's (exact rank-sum test)."""
    report, task = combined(datas), opts.get("task", "needle")
    measure = opts.get("measure", "accuracy")  # or "loss": the answer loss (nats), and the loss added
    if measure not in ("accuracy", "loss"):
        raise ValueError(f"measure={measure!r}: allowed values are 'accuracy' and 'loss'")
    tags = list(report["runs"][0]["lowbit"]["accuracy"])

    def value(tag):
        return lambda r: r["lowbit"]["accuracy"][tag][task][measure]

    level = float(opts["learned"]) if "learned" in opts else None
    if level is not None:
        report = report | {
            "runs": [r for r in report["runs"] if r["lowbit"]["accuracy"]["none"][task]["accuracy"] >= level]
        }
    models = [m for m in MODELS if any(r["model"] == m for r in report["runs"])]
    change = "accuracy lost" if measure == "accuracy" else "loss added"
    others = [m for m in models if m != "llama"]
    head = (
        ["quantized", *[LABELS[m] for m in models]]
        + [f"{LABELS[m]} − Llama: {change} (paired)" for m in others]
        + ([f"{LABELS[m]} − Llama: {change}, unpaired runs (rank test)" for m in others] if level is not None else [])
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    queries = report["runs"][0]["lowbit"]["accuracy"]["none"][task]["n"] if report["runs"] else 0

    def cell(values) -> str:
        values = list(values)
        text = _mean_std(values)
        if text == "–":
            return text
        notes = [str(len(values))] if level is not None else []
        if measure == "accuracy":
            notes.append(f"±{exact_tests.binomial_noise(statistics.mean(values), queries):.2f}")
        return f"{text} ({'; '.join(notes)})"

    def counted(text, n):
        return text if level is None or text == "–" else f"{text} ({n})"

    sign = 1 if measure == "accuracy" else -1  # accuracy lost: before − after; loss added: after − before
    for tag in tags:
        cells = [cell(_seeds_of(report, m, value(tag)).values()) for m in models]
        if tag == "none":
            cells += ["–" for _ in others] * (2 if level is not None else 1)
        else:
            lost = lambda r, t=tag: sign * (value("none")(r) - value(t)(r))  # noqa: E731
            both = {m: len(set(_seeds_of(report, m, lost)) & set(_seeds_of(report, "llama", lost))) for m in models}
            cells += [counted(_paired(report, m, lost), both[m]) for m in others]
            if level is not None:
                cells += [_unpaired(report, m, lost) for m in others]
        label = "nothing" if tag == "none" else tag.replace("/", ", ").replace("qk", "q and k") + " bits"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    note = (
        f" Accuracy lost: unquantized minus quantized accuracy of the same model; ± in a cell's parentheses: the "
        f"binomial noise of one run's accuracy at the cell's mean (n = {queries} queries per run; a difference of "
        "two accuracies has at most the sum of their noises)."
        if measure == "accuracy"
        else " Answer loss in nats; loss added: quantized minus unquantized loss of the same model."
    )
    if level is not None:
        note += (
            f" Only runs whose unquantized accuracy reaches {level:g} (in parentheses: runs, or seeds where both "
            "models did); unpaired: each model's runs against the Llama's, difference of the means and the exact "
            "rank-sum test."
        )
    return lines + ["", _seeds_line(combined(datas)) + note]


def _logits(r) -> list[dict]:
    return r["lowbit"]["activations"]["logits"]


def max_over_median(r) -> float:
    """The largest over layers of (largest attention-logit magnitude / median magnitude): how coarse an absmax grid is
    for a typical logit (the grid step is max / qmax)."""
    return max(x["max"] / x["median"] for x in _logits(r))


def top100_share(r) -> float:
    """The smallest over layers of (100th largest magnitude / largest): near 1 means no few extreme logits."""
    return min(x["top100"] / x["max"] for x in _logits(r))


def doc_table_outliers(datas: list[dict], opts: dict) -> list[str]:
    """Top activations: the largest attention logit and hidden-state magnitude over layers, the logits' max / median
    and 100th largest / largest, and their kurtosis."""
    everyone = combined(datas)
    report, note = _learned_only(everyone, opts)
    acts = lambda kind, key: lambda r: max(x[key] for x in r["lowbit"]["activations"][kind])  # noqa: E731
    rows = {
        "largest attention logit (magnitude)": acts("logits", "max"),
        "attention logits: 10th largest": acts("logits", "top10"),
        "attention logits: largest / median magnitude (largest over layers)": max_over_median,
        "attention logits: 100th largest / largest (smallest over layers)": top100_share,
        "attention logits: kurtosis (largest over layers)": acts("logits", "kurtosis"),
        "largest hidden-state magnitude": acts("hidden", "max"),
        "hidden states: kurtosis (largest over layers)": acts("hidden", "kurtosis"),
    }
    return _model_table(report, rows, counted=bool(note), unpaired=bool(note)) + ["", _seeds_line(everyone) + note]


def doc_table_lens(datas: list[dict], opts: dict) -> list[str]:
    """Attention of the last key token of the first query, on the queried needle (answer), the other needles
    (distractors) and the rest (noise): mean over layers, heads and prompts, and the head with the largest answer
    share."""
    everyone = combined(datas)
    report, note = _learned_only(everyone, opts)
    rows = {
        "answer share (mean over heads)": lambda r: r["lens"]["answer_mean"],
        "distractor-needle share (mean over heads)": lambda r: r["lens"]["distractor_mean"],
        "noise share (mean over heads)": lambda r: r["lens"]["noise_mean"],
        "answer share of the best head": lambda r: r["lens"]["answer_best_head"],
        "noise share of that head": lambda r: r["lens"]["noise_of_best_head"],
    }
    return _model_table(report, rows, counted=bool(note), unpaired=bool(note)) + [
        "",
        _seeds_line(everyone) + " DIFF models: the differential map's positive mass; the Llama: its softmax "
        "map." + note,
    ]


def _span(values, digits: int = 2) -> str:
    """``min–max (n)`` of a model's runs (one value: itself)."""
    values = sorted(values)
    if not values:
        return "–"
    low, high = f"{values[0]:.{digits}f}", f"{values[-1]:.{digits}f}"
    return f"{low if low == high else f'{low}–{high}'} ({len(values)})"


def _steps_span(values: list[int], budget: int) -> str:
    """``min–max (k of n runs; the others not within the budget)`` of steps to 90%."""
    reached = sorted(v for v in values if v <= budget)
    text = (f"{reached[0]:,}" if len(set(reached)) == 1 else f"{reached[0]:,}–{reached[-1]:,}") if reached else "never"
    rest = len(values) - len(reached)
    return f"{text} ({len(reached)} of {len(values)} runs" + (f"; {rest} not within {budget:,})" if rest else ")")


def _choice_over(groups: dict, keys) -> float:
    return statistics.mean(groups[k]["choice_accuracy"] for k in keys)


def learned_rows(report: dict) -> dict[str, tuple[str, str, object, object]]:
    """The comparisons of the runs that learned each task, and of the steps to 90% of every run: key → (label, kind
    "accuracy" or "steps", the run filter, the value of a run)."""
    g = _length_groups(report)
    needle_runs, mqar_runs = learned(report, "needle"), learned(report, "mqar")
    every = lambda r: True  # noqa: E731
    chance = statistics.mean(1 / n for n in _ints(report["meta"]["setting"]["eval_needles"]))
    by_length = lambda fn, keys: lambda r: fn(r["eval"]["needle"]["by_length"], keys)  # noqa: E731
    by_pairs = lambda keys: lambda r: _mean_over(r["eval"]["mqar"]["by_pairs"], keys)  # noqa: E731
    rows = {
        "trained": (
            f"needle accuracy, trained lengths ({', '.join(g['inside'])} tokens): runs that learned needle retrieval",
            "accuracy",
            needle_runs,
            by_length(_mean_over, g["inside"]),
        )
    }
    if g["near"]:
        rows["near"] = (
            f"needle accuracy, up to 1.5 × the trained length ({', '.join(g['near'])} tokens): the same runs",
            "accuracy",
            needle_runs,
            by_length(_mean_over, g["near"]),
        )
    if g["far"]:
        far = ", ".join(g["far"])
        rows["far"] = (
            f"needle accuracy, beyond 1.5 × ({far} tokens): the same runs",
            "accuracy",
            needle_runs,
            by_length(_mean_over, g["far"]),
        )
        rows["far_choice"] = (
            f"needle multiple-choice accuracy among the needles' values, beyond 1.5 × ({far} tokens; "
            f"chance, 1 / needles averaged over the needle counts: {chance:.2f}): the same runs",
            "accuracy",
            needle_runs,
            by_length(_choice_over, g["far"]),
        )
    rows["mqar_in"] = (
        f"MQAR accuracy, within the training length ({', '.join(g['pairs_in'])} pairs): runs that learned MQAR",
        "accuracy",
        mqar_runs,
        by_pairs(g["pairs_in"]),
    )
    if g["pairs_out"]:
        rows["mqar_out"] = (
            f"MQAR accuracy, longer ({', '.join(g['pairs_out'])} pairs): the same runs",
            "accuracy",
            mqar_runs,
            by_pairs(g["pairs_out"]),
        )
    for task, name in (("needle", "needle"), ("mqar", "MQAR")):
        rows[f"steps_{task}"] = (
            f"steps to 90% validation accuracy, {name}: every run (one that never got there ranks above every one "
            "that did)",
            "steps",
            every,
            lambda r, t=task: steps_to(r["curves"], t, 0.9),
        )
    return rows


def doc_table_learned(datas: list[dict], opts: dict) -> list[str]:
    """The runs that learned each task, unpaired: per model the range of its runs (their number), and each DIFF
    model's runs against the Llama's (exact rank-sum test); the steps to 90% of every run likewise."""
    report = combined(datas)
    budget = report["meta"]["setting"]["steps"]
    models = [m for m in MODELS if any(r["model"] == m for r in report["runs"])]
    others = [m for m in models if m != "llama"]
    lines = [
        "| quantity | "
        + " | ".join(LABELS[m] for m in models)
        + " | "
        + " | ".join(f"{LABELS[m]} vs Llama (rank test)" for m in others)
        + " |",
        "|---|" + "---|" * (len(models) + len(others)),
    ]
    for label, kind, keep, value in learned_rows(report).values():
        per = {m: [value(r) for r in report["runs"] if r["model"] == m and keep(r)] for m in models}
        cells = [_steps_span(per[m], budget) if kind == "steps" else _span(per[m]) for m in models]
        cells += [
            f"p = {exact_tests.format_p(exact_tests.rank_sum(per[m], per['llama']))}"
            if per[m] and per["llama"]
            else "–"
            for m in others
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines + [
        "",
        f"Ranges over runs (in parentheses: how many); learned: held-out accuracy {LEARNED:g} or more "
        "on the task. The rank-sum test is exact (every split of the pooled runs enumerated, midranks for "
        f"ties), two-sided; a run that never reached 90% within the {budget:,} steps ranks above every run "
        "that did (the same budget for all, so that is its true order). " + _noise_line(report),
    ]


def outlier_rows(report: dict) -> list[dict]:
    """Per run: whether it learned each task's low-bit set, its largest logit, max / median and top-100 share, and
    what 4-bit logits (per tensor) cost it on each task (accuracy lost, loss added)."""
    rows = []
    for r in sorted(report["runs"], key=lambda r: (MODELS.index(r["model"]), r["seed"])):
        acc = r["lowbit"]["accuracy"]
        row = {
            "model": r["model"],
            "seed": r["seed"],
            "max": max(x["max"] for x in _logits(r)),
            "ratio": max_over_median(r),
            "top100": top100_share(r),
        }
        for task in ("needle", "mqar"):
            row[f"{task}_learned"] = _learned_lowbit(task)(r)
            row[f"{task}_lost"] = acc["none"][task]["accuracy"] - acc["logits/tensor/4"][task]["accuracy"]
            row[f"{task}_added"] = acc["logits/tensor/4"][task]["loss"] - acc["none"][task]["loss"]
        rows.append(row)
    return rows


def outlier_correlations(report: dict) -> dict:
    """Per task, over the runs that learned its low-bit set: Spearman's ρ (exact p) of the 4-bit loss added with
    max / median and with the largest logit."""
    out = {}
    for task in ("needle", "mqar"):
        rows = [x for x in outlier_rows(report) if x[f"{task}_learned"]]
        added = [x[f"{task}_added"] for x in rows]
        out[task] = {"n": len(rows)}
        for key in ("ratio", "max"):
            try:
                out[task][key] = exact_tests.spearman([x[key] for x in rows], added)
            except ValueError:  # fewer than three runs, or no spread: no rank correlation
                out[task][key] = None
    return out


def _rho(c: dict, key: str) -> str:
    """``ρ = 0.80 (p = 0.0025)``, or why there is none."""
    if c[key] is None:
        return "ρ: too few runs"
    return f"ρ = {c[key][0]:.2f} ({_p(c[key][1])})"


def doc_table_outlier_runs(datas: list[dict], opts: dict) -> list[str]:
    """Per run: the attention-logit statistics beside what 4-bit logits (per tensor) cost it, and the rank
    correlation of the two over the runs that learned each task."""
    report = combined(datas)
    lines = [
        "| model | seed | learned (low-bit sets): needle / MQAR | largest logit | largest / median | "
        "100th largest / largest | needle: accuracy lost / loss added | MQAR: accuracy lost / loss added |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for x in outlier_rows(report):
        yes = lambda b: "yes" if b else "no"  # noqa: E731
        lines.append(
            f"| {LABELS[x['model']]} | {x['seed']} | {yes(x['needle_learned'])} / {yes(x['mqar_learned'])} | "
            f"{x['max']:.1f} | {x['ratio']:.1f} | {x['top100']:.2f} | "
            f"{x['needle_lost']:+.2f} / {x['needle_added']:+.2f} | "
            f"{x['mqar_lost']:+.2f} / {x['mqar_added']:+.2f} |"
        )
    corr = outlier_correlations(report)
    said = "; ".join(
        f"{name} ({c['n']} runs): max / median {_rho(c, 'ratio')}, largest logit {_rho(c, 'max')}"
        for name, c in (("needle", corr["needle"]), ("MQAR", corr["mqar"]))
    )
    return lines + [
        "",
        "Largest / median: over layers, the largest of (largest logit magnitude / median magnitude); "
        "100th largest / largest: the smallest over layers. Attention logits on the needle low-bit set; "
        "cost of 4-bit logits (one scale per tensor) on each task's low-bit set. Spearman's rank "
        "correlation with the loss added, over the runs that learned that task (exact permutation p): " + said + ".",
    ]


def doc_calibration_reuse(datas: list[dict], opts: dict) -> list[str]:
    """Whether the last calibration run (``datas[0]``, the Llama alone) is one of the reported runs (``datas[1:]``,
    combined): the same seed's Llama with the same training losses at every logged step."""
    calibration, report = datas[0], combined(datas[1:])
    (run,) = calibration["runs"]
    name = os.path.basename(opts["files"][0]) if "files" in opts else "the calibration run"
    final = {r["seed"]: r for r in report["runs"] if r["model"] == run["model"]}
    if run["seed"] not in final:
        return [f"`{name}`: seed {run['seed']} is not among the reported runs."]
    mine, theirs = run["curves"]["train_loss"], final[run["seed"]]["curves"]["train_loss"]
    same = sum(a == b for a, b in zip(mine, theirs))
    steps = run["curves"]["step"]
    verdict = "is that run" if same == len(mine) <= len(theirs) else "is not that run"
    model, seed, seeds = LABELS[run["model"]], run["seed"], len({r["seed"] for r in report["runs"]})
    return [
        f"`{name}` ({model}, seed {seed}, {calibration['meta']['setting']['steps']:,} steps) and the reported "
        f"{model} of seed {seed}: {same:,} of {len(mine):,} logged training losses (the mean of every 10 steps, to "
        f"step {steps[-1]:,}) are equal to the bit. The calibration run {verdict}; the setting was frozen after "
        f"it, so seed {seed} is both the seed the setting was chosen on and one of the {seeds} test seeds."
    ]


def summary_facts(report: dict) -> dict:
    """The numbers of the report's summary (:func:`doc_summary`), from the runs: learned counts and their tests, steps
    to 90% and their tests, accuracy of the runs that learned, the cost of 4-bit logits, and the outlier statistics."""
    seeds = sorted({r["seed"] for r in report["runs"]})
    budget = report["meta"]["setting"]["steps"]
    facts: dict = {"seeds": len(seeds), "budget": budget, "lr": report["meta"]["setting"]["lr"]}
    for task in ("needle", "mqar"):
        did = {m: _seeds_of(report, m, learned(report, task)) for m in MODELS}
        facts[f"learned_{task}"] = {m: sum(v.values()) for m, v in did.items()}
        for m in ("v1", "v2"):
            only_m = sum(did[m][s] and not did["llama"][s] for s in seeds)
            only_llama = sum(did["llama"][s] and not did[m][s] for s in seeds)
            k, j = facts[f"learned_{task}"][m], facts[f"learned_{task}"]["llama"]
            facts[f"learned_{task}_{m}"] = {
                "fisher": exact_tests.fisher_exact(k, len(seeds) - k, j, len(seeds) - j),
                "only": only_m,
                "only_llama": only_llama,
                "mcnemar": exact_tests.mcnemar(only_m, only_llama),
            }
        reach = lambda r, t=task: steps_to(r["curves"], t, 0.9)  # noqa: E731
        steps = {m: _seeds_of(report, m, reach) for m in MODELS}
        facts[f"steps_{task}"] = {m: sorted(v.values()) for m, v in steps.items()}
        for m in ("v1", "v2"):
            first = [steps[m][s] - steps["llama"][s] for s in seeds]
            facts[f"steps_{task}_{m}"] = {
                "sign": exact_tests.sign_test([-d for d in first]),
                "rank": exact_tests.rank_sum(list(steps[m].values()), list(steps["llama"].values())),
            }
    needle = learned(report, "needle")
    both = [
        s for s in seeds if all(needle(r) for r in report["runs"] if r["seed"] == s and r["model"] in ("llama", "v1"))
    ]
    facts["v1_llama_both_needle"] = [
        (
            s,
            steps_to(_run(report, "v1", s)["curves"], "needle", 0.9),
            steps_to(_run(report, "llama", s)["curves"], "needle", 0.9),
        )
        for s in both
    ]
    facts["learned_rows"] = {}
    for key, (label, kind, keep, value) in learned_rows(report).items():
        if kind != "accuracy":
            continue
        per = {m: [value(r) for r in report["runs"] if r["model"] == m and keep(r)] for m in MODELS}
        facts["learned_rows"][key] = {
            "values": per,
            **{f"p_{m}": exact_tests.rank_sum(per[m], per["llama"]) for m in ("v1", "v2") if per[m] and per["llama"]},
        }
    facts["chance"] = statistics.mean(1 / n for n in _ints(report["meta"]["setting"]["eval_needles"]))
    rows = outlier_rows(report)
    for task in ("needle", "mqar"):
        kept = [x for x in rows if x[f"{task}_learned"]]
        for key in ("lost", "added"):
            per = {m: [x[f"{task}_{key}"] for x in kept if x["model"] == m] for m in MODELS}
            facts[f"lowbit_{task}_{key}"] = {
                "values": per,
                **{
                    f"p_{m}": exact_tests.rank_sum(per[m], per["llama"])
                    for m in ("v1", "v2")
                    if per[m] and per["llama"]
                },
            }
    milder = [
        (r, tag, task)
        for r in report["runs"]
        for tag in r["lowbit"]["accuracy"]
        if tag.endswith(("/8", "/6"))
        for task in ("needle", "mqar")
        if _learned_lowbit(task)(r)
    ]
    facts["lost_8_6_max"] = max(
        (
            r["lowbit"]["accuracy"]["none"][task]["accuracy"] - r["lowbit"]["accuracy"][tag][task]["accuracy"]
            for r, tag, task in milder
        ),
        default=None,
    )
    learned_needle = {(x["model"], x["seed"]) for x in rows if needle(_run(report, x["model"], x["seed"]))}
    facts["outliers"] = {
        "max": {m: {x["seed"]: x["max"] for x in rows if x["model"] == m} for m in MODELS},
        "ratio_learned": {
            m: [x["ratio"] for x in rows if x["model"] == m and (m, x["seed"]) in learned_needle] for m in MODELS
        },
        "top100_min": min(x["top100"] for x in rows),
        "learned_needle": learned_needle,
        "correlations": outlier_correlations(report),
    }
    return facts


def _run(report: dict, model: str, seed: int) -> dict:
    return next(r for r in report["runs"] if r["model"] == model and r["seed"] == seed)


def _p(p: float | None) -> str:
    return "p: too few runs" if p is None else f"p = {exact_tests.format_p(p)}"


def _each(per: dict, digits: int = 2) -> str:
    return ", ".join(f"{LABELS[m]} {_span(per[m], digits)}" for m in MODELS if per.get(m))


def _versus(per: dict, model: str) -> str:
    """How ``model``'s runs sit against the Llama's: below or above every one of them, or among them."""
    mine, llama = per[model], per["llama"]
    if not mine or not llama:
        return "not comparable"
    if max(mine) < min(llama):
        return "below the Llama's in every run against every run"
    if min(mine) > max(llama):
        return "above the Llama's in every run against every run"
    return "overlapping the Llama's"


def _significance(*ps: float) -> str:
    return "not significant" if min(ps) >= 0.05 else "significant at 0.05"


def doc_summary(datas: list[dict], opts: dict) -> list[str]:
    """The report's outcome, as bullets whose every number and every comparison word is computed here from the results
    files (tests check the committed report against it): learned counts, steps to 90%, accuracy once learned, the
    cost of 4-bit logits and the outlier statistics, each difference with its exact test."""
    report = combined(datas)
    f = summary_facts(report)
    n, budget = f["seeds"], f["budget"]
    v2, v1 = f["learned_needle_v2"], f["learned_needle_v1"]
    counts = lambda c: ", ".join(f"{LABELS[m]} {c[m]}/{n}" for m in MODELS)  # noqa: E731
    lines = [
        f"- **Learned within the budget** ({budget:,} steps; held-out accuracy {LEARNED:g} or more): needle retrieval "
        f"in {counts(f['learned_needle'])} seeds, MQAR in {counts(f['learned_mqar'])}. Needle retrieval, V2 against "
        f"the Llama: Fisher's exact test {_p(v2['fisher'])}; McNemar's exact test on the seeds where only one of the "
        f"two learned (V2 only: {v2['only']}, Llama only: {v2['only_llama']}) {_p(v2['mcnemar'])}. V1 against the "
        f"Llama: Fisher {_p(v1['fisher'])}; V1 only: {v1['only']}, Llama only: {v1['only_llama']} (McNemar "
        f"{_p(v1['mcnemar'])}). V2 against the Llama: {_significance(v2['fisher'], v2['mcnemar'])}; V1 against the "
        f'Llama: {_significance(v1["fisher"], v1["mcnemar"])}. Under a fixed budget, "learned" is censored speed, '
        "not a second finding.",
    ]
    steps, s2, sm, s2m = f["steps_needle"], f["steps_needle_v2"], f["steps_mqar"], f["steps_mqar_v2"]
    faster, slower, p_sign = s2["sign"]
    pairs = f["v1_llama_both_needle"]
    both = "; ".join(f"seed {s}: V1 {a:,} steps, Llama {b:,}" for s, a, b in pairs)
    lines.append(
        "- **Steps to 90% validation accuracy**, needle retrieval: "
        + "; ".join(f"{LABELS[m]} {_steps_span(steps[m], budget)}" for m in MODELS)
        + f". V2 got there before the Llama "
        f"of the same seed in {faster} of {faster + slower} seeds (sign test {_p(p_sign)}); V2's runs against the "
        "Llama's, unpaired, a run that never got there ranked above every run that did: exact rank-sum test "
        f"{_p(s2['rank'])}. MQAR: "
        + "; ".join(f"{LABELS[m]} {_steps_span(sm[m], budget)}" for m in MODELS)
        + f" (V2 against the Llama {_p(s2m['rank'])}). All at one learning rate ({f['lr']:g}), chosen by calibrating "
        "the Llama alone. V1 against the Llama in the seeds where both learned needle retrieval: "
        + (both or "none")
        + f" ({len(pairs)} seed{'' if len(pairs) == 1 else 's'}: too few for a test)."
    )
    rows = f["learned_rows"]
    trained = rows["trained"]
    said = [
        f"needle retrieval at the trained lengths {_each(trained['values'])} (V1 {_p(trained.get('p_v1'))}, V2 "
        f"{_p(trained.get('p_v2'))})"
    ]
    if "mqar_out" in rows:
        beyond = rows["mqar_out"]
        said.append(
            f"MQAR beyond the trained pair counts: {_each(beyond['values'])}; V1's "
            f"{_versus(beyond['values'], 'v1')} ({_p(beyond.get('p_v1'))}), V2's "
            f"{_versus(beyond['values'], 'v2')} ({_p(beyond.get('p_v2'))})"
        )
    if "near" in rows:
        said.append(f"needle retrieval up to 1.5 times the trained length: {_each(rows['near']['values'])}")
    if "far" in rows:
        said.append(
            f"beyond it, accuracy (the argmax over the whole vocabulary) {_each(rows['far']['values'])}, and "
            f"the multiple-choice accuracy among the needles' values {_each(rows['far_choice']['values'])}, "
            f"against a chance level of {f['chance']:.2f} (1 / needles, averaged over the needle counts)"
        )
    lines.append(
        "- **Accuracy once learned** (the runs that learned the task, unpaired, exact rank-sum tests against "
        "the Llama): " + "; ".join(said) + "."
    )
    acc_n, add_n, acc_m = f["lowbit_needle_lost"], f["lowbit_needle_added"], f["lowbit_mqar_lost"]
    floor = _min_rank_p(acc_n)
    lines.append(
        "- **4-bit attention logits** (one scale per tensor; the runs whose unquantized accuracy on the task's low-bit "
        f"set reaches {LEARNED:g}): needle accuracy lost {_each(acc_n['values']) or 'no run'}; answer loss added "
        f"(nats) {_each(add_n['values']) or 'no run'}. V1's losses are {_versus(acc_n['values'], 'v1')} in accuracy "
        f"({_p(acc_n.get('p_v1'))}) and {_versus(add_n['values'], 'v1')} in loss ({_p(add_n.get('p_v1'))}"
        + (
            f"; with {len(acc_n['values']['v1'])} runs against {len(acc_n['values']['llama'])} no exact rank test can "
            f"go below p = {exact_tests.format_p(floor)}"
            if floor is not None
            else ""
        )
        + f"); V2's {_versus(acc_n['values'], 'v2')} (accuracy {_p(acc_n.get('p_v2'))}, loss "
        f"{_p(add_n.get('p_v2'))}). MQAR accuracy lost {_each(acc_m['values']) or 'no run'}: V2's "
        f"{_versus(acc_m['values'], 'v2')} ({_p(acc_m.get('p_v2'))}), V1's {_versus(acc_m['values'], 'v1')} "
        f"({_p(acc_m.get('p_v1'))})."
        + (
            f" At 8 and 6 bits (logits or q and k, per tensor or per head) no run loses more than "
            f"{f['lost_8_6_max']:.2f} of its accuracy on a task it learned."
            if f["lost_8_6_max"] is not None
            else ""
        )
    )
    o = f["outliers"]
    never = sorted(
        ((v, s) for s, v in o["max"]["llama"].items() if ("llama", s) not in o["learned_needle"]), reverse=True
    )
    kept = {m: [v for s, v in o["max"][m].items() if (m, s) in o["learned_needle"]] for m in MODELS}
    c = o["correlations"]
    lines.append(
        "- **Outliers.** Largest attention logit (magnitude) in the runs that learned needle retrieval: "
        f"{_each(kept, 1) or 'no run'}; the Llama's in the seeds where it did not: "
        + (", ".join(f"{v:.1f} (seed {s})" for v, s in never) or "none")
        + ". In every run and layer the 100th "
        f"largest logit magnitude is at least {math.floor(o['top100_min'] * 100) / 100:.2f} of the largest (rounded "
        "down): no few extreme values. The ratio "
        "of the largest to the median magnitude (the largest over layers), which sets how coarse an absmax grid is for "
        f"a typical logit, in the runs that learned needle retrieval: {_each(o['ratio_learned'], 1) or 'no run'}. "
        "Against the 4-bit loss added, over the runs that learned each task (Spearman, exact permutation test): "
        f"max / median on MQAR {_rho(c['mqar'], 'ratio')} ({c['mqar']['n']} runs), on needle retrieval "
        f"{_rho(c['needle'], 'ratio')} ({c['needle']['n']} runs); the largest logit alone on MQAR "
        f"{_rho(c['mqar'], 'max')}, on needle retrieval {_rho(c['needle'], 'max')}."
    )
    return lines


def _min_rank_p(entry: dict) -> float | None:
    """The smallest two-sided p-value the exact rank-sum test can give for V1's runs against the Llama's."""
    a, b = len(entry["values"]["v1"]), len(entry["values"]["llama"])
    return exact_tests.rank_sum(list(range(a)), list(range(a, a + b))) if a and b else None


def doc_table_calibration(datas: list[dict], opts: dict) -> list[str]:
    """The calibration runs (the Llama alone, one seed each), in the order they ran: the setting each tried and the
    Llama's held-out accuracy (each on the task definitions of its moment: compare neighbours, not distant rows)."""
    lines = [
        "| run | width × layers | training length | steps | learning rate, schedule | needle / MQAR / copy share "
        "of training rows | Llama needle accuracy | Llama MQAR accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path, data in sorted(zip(opts["files"], datas), key=lambda x: x[1]["provenance"]["utc"]):
        st, sm = data["meta"]["setting"], data["summary"]
        copy = st.get("copy_fraction") or 0
        mqar = round(max(0.0, 1 - st["needle_fraction"] - copy), 3)
        lines.append(
            f"| {os.path.basename(path).removesuffix('.json')} | {st['hidden_size']} × {st['num_hidden_layers']} | "
            f"{st['train_length']} | {st['steps']:,} | {st['lr']:g}, {st.get('schedule') or 'cosine'} | "
            f"{st['needle_fraction']:g} / {mqar:g} / {copy:g} | "
            f"{sm['needle_accuracy']['llama']['mean']:.2f} | {sm['mqar_accuracy']['llama']['mean']:.2f} |"
        )
    return lines


# ----------------------------------------------------------------------------------------------- the learning-rate grid


def grid_runs(datas: list[dict]) -> dict:
    """The runs of the learning-rate grid's files (one per learning rate and seed, each the usual results file):
    ``{(model, lr, seed): run}`` with each run's ``budget`` (its setting's steps). A run found twice is an error."""
    runs: dict = {}
    for data in datas:
        setting = data["meta"]["setting"]
        for r in data["runs"]:
            key = (r["model"], float(setting["lr"]), r["seed"])
            if key in runs:
                raise ValueError(
                    f"the grid's files hold the {r['model']} run of seed {r['seed']} at learning rate "
                    f"{setting['lr']:g} twice: each run must come from one file"
                )
            runs[key] = r | {"budget": setting["steps"]}
    return runs


def _median_steps(values: list[int], budget: int) -> float:
    """The median of steps to 90%, a run that never got there counting as more than ``budget`` (infinity: a median
    that involves such a run is itself "not reached")."""
    return statistics.median(v if v <= budget else math.inf for v in values)


def grid_cells(datas: list[dict]) -> dict:
    """Per (model, learning rate): runs, how many learned both tasks and each (validation accuracy reached 90% within
    the budget), the steps to 90% per task and on both (the later of the two; censored: above the budget) and their
    medians; and each model's best learning rate (most runs that learned both; ties: the lower median steps on both,
    then the lower rate)."""
    cells: dict = {}
    for (model, lr, seed), r in sorted(grid_runs(datas).items()):
        budget = r["budget"]
        steps = {t: steps_to(r["curves"], t, STOP_LEVEL) for t in STOP_TASKS}
        steps["both"] = max(steps.values())
        cell = cells.setdefault(
            (model, lr),
            {"seeds": [], "budget": budget, "steps": {k: [] for k in steps}, "learned": {k: 0 for k in steps}},
        )
        if budget != cell["budget"]:
            raise ValueError(
                f"{model} at learning rate {lr:g}: runs with different budgets ({cell['budget']} and "
                f"{budget} steps) cannot share a median"
            )
        cell["seeds"].append(seed)
        for k, v in steps.items():
            cell["steps"][k].append(v)
            cell["learned"][k] += v <= budget
    for cell in cells.values():
        cell["median"] = {k: _median_steps(v, cell["budget"]) for k, v in cell["steps"].items()}
    best = {}
    for model in MODELS:
        mine = [(lr, c) for (m, lr), c in cells.items() if m == model]
        if mine:
            best[model] = min(mine, key=lambda x: (-x[1]["learned"]["both"], x[1]["median"]["both"], x[0]))[0]
    return {"cells": cells, "best": best}


def _median_text(value: float, budget: int) -> str:
    return f"> {budget:,}" if math.isinf(value) else f"{value:,.0f}"


def doc_table_lr_grid(datas: list[dict], opts: dict) -> list[str]:
    """scripts/doc_tables.py's renderer of the learning-rate grid (the ``lr_grid`` preset's files, one per
    learning rate and seed): per model and learning rate, the runs, the share that learned (both tasks, each task),
    the median steps to 90%, each model's best rate marked; then V1 and V2 against the Llama, each at its best rate
    (Fisher's exact test on learning both tasks, the exact rank-sum test on the steps to 90% on both)."""
    grid = grid_cells(datas)
    cells, best = grid["cells"], grid["best"]
    lines = [
        "| model | learning rate | runs (seeds) | learned both tasks | learned needle | learned MQAR | median "
        "steps to 90%: needle / MQAR / both |",
        "|---|---|---|---|---|---|---|",
    ]
    for (model, lr), c in sorted(cells.items(), key=lambda x: (MODELS.index(x[0][0]), x[0][1])):
        n = len(c["seeds"])
        mark = "" if best.get(model) != lr else " **(best)**" if c["learned"]["both"] else " **(best: none learned)**"
        medians = " / ".join(_median_text(c["median"][k], c["budget"]) for k in ("needle", "mqar", "both"))
        lines.append(
            f"| {LABELS[model]} | {lr:g}{mark} | {n} ({', '.join(map(str, sorted(c['seeds'])))}) | "
            f"{c['learned']['both']}/{n} | {c['learned']['needle']}/{n} | {c['learned']['mqar']}/{n} | {medians} |"
        )
    tests = []
    if "llama" in best:
        base = cells[("llama", best["llama"])]
        j, m = base["learned"]["both"], len(base["seeds"])
        at_best = {x: cells[(x, best[x])] for x in ("v1", "v2") if x in best}
        ps = {
            "fisher": {
                x: exact_tests.fisher_exact(c["learned"]["both"], len(c["seeds"]) - c["learned"]["both"], j, m - j)
                for x, c in at_best.items()
            },
            "rank": {x: exact_tests.rank_sum(c["steps"]["both"], base["steps"]["both"]) for x, c in at_best.items()},
        }
        # Holm's adjustment per test, over the DIFF models compared with the same Llama runs (where there are two).
        held = {test: dict(zip(p, exact_tests.holm(list(p.values())))) for test, p in ps.items()}
        # And over every test of the table at once (each test, each DIFF model): the most conservative reading.
        flat = [(test, x) for test, p in ps.items() for x in p]
        every = dict(zip(flat, exact_tests.holm([ps[test][x] for test, x in flat])))

        def p_text(test: str, x: str) -> str:
            return _p(ps[test][x]) + (f", Holm-adjusted {_p(held[test][x])}" if len(at_best) > 1 else "")

        for x, c in at_best.items():
            tests.append(
                f"{LABELS[x]} at {best[x]:g} against the Llama at {best['llama']:g}: learned both tasks "
                f"{c['learned']['both']}/{len(c['seeds'])} against {j}/{m} "
                f"(Fisher's exact test {p_text('fisher', x)}); "
                f"steps to 90% on both, median {_median_text(c['median']['both'], c['budget'])} against "
                f"{_median_text(base['median']['both'], base['budget'])} (exact rank-sum test {p_text('rank', x)})."
            )
        if len(flat) > 2:
            names = {"fisher": "Fisher", "rank": "rank-sum"}
            tests.append(
                f"Holm-adjusted over all {len(flat)} of these tests at once: "
                + "; ".join(f"{LABELS[x]} {', '.join(f'{names[t]} {_p(every[(t, x)])}' for t in ps)}" for x in at_best)
                + "."
            )
    budgets = ", ".join(f"{b:,}" for b in sorted({c["budget"] for c in cells.values()}))
    note = (
        f"Learned: validation accuracy reached 90% on the task within the run's budget ({budgets} steps; a run "
        "stops early once both tasks have held 90% for three validations). Steps to 90%: the first validation at "
        "90% or more; on both tasks, the later of the two. A median over runs counts a run that never got there "
        'as more than the budget, so a median that involves one reads "> budget". Best learning rate of a '
        "model: the most runs that learned both tasks; ties go to the lower median steps on both, then to the "
        "lower rate (where no run of the model learned both, the lowest rate, marked so). The tests compare each DIFF "
        "model at its best rate with the Llama at its own (unpaired; in "
        "the rank test a run that never got there ranks above every run that did); Holm-adjusted: for the two DIFF "
        "models compared with the same Llama runs (Holm's method, per test)."
    )
    return lines + ["", note] + (["", *tests] if tests else [])


def _steps_both(r: dict) -> int:
    """Steps to 90% validation accuracy on both tasks: the later of the two (censored where either never got there)."""
    return max(steps_to(r["curves"], t, STOP_LEVEL) for t in STOP_TASKS)


def _largest_logit(r: dict) -> float:
    return max(x["max"] for x in _logits(r))


def _lost_4bit(task: str):
    """Accuracy a run loses on ``task``'s low-bit set with its attention logits at 4 bits, one scale per tensor."""
    return lambda r: (
        r["lowbit"]["accuracy"]["none"][task]["accuracy"] - r["lowbit"]["accuracy"]["logits/tensor/4"][task]["accuracy"]
    )


def _added_4bit(task: str):
    return lambda r: (
        r["lowbit"]["accuracy"]["logits/tensor/4"][task]["loss"] - r["lowbit"]["accuracy"]["none"][task]["loss"]
    )


def _spearman_rho(x: list[float], y: list[float]) -> float:
    """Spearman's ρ (Pearson's correlation of the midranks), for any n (its exact p: exact_tests.spearman, n <= 14)."""
    rx, ry = exact_tests.midranks(x), exact_tests.midranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def grid_findings(grid_datas: list[dict], first_datas: list[dict]) -> dict:
    """The tests the learning-rate grid's table does not make, for :func:`doc_grid_findings` (every one exploratory):
    per rate, each DIFF model against the Llama at the same rate (steps to 90% on both tasks, exact rank-sum; how many
    seeds had V2 first at every rate); the Llama's best rate against its others (Fisher); learning both tasks over
    all rates, stratified by rate (exact conditional test); with the first study's runs (``first_datas``, one rate):
    the pooled comparison at that rate, every run censored at the smaller budget; the largest attention logit and
    max / median, V1 against the Llama of the same seed and rate over both studies (sign test over seeds, each seed's
    mean difference: runs of one seed at several rates share data and initialisation); over the grid's runs that
    learned each task's low-bit set, the accuracy 4-bit logits cost, each DIFF model against the Llama (rank-sum), and
    the rank correlation of the loss they add with the largest logit and with max / median (Spearman's ρ; Kendall's τ
    with its exact p)."""
    grid = grid_cells(grid_datas)
    cells, best = grid["cells"], grid["best"]
    runs = grid_runs(grid_datas)
    rates = sorted({lr for _, lr in cells})
    out: dict = {"rates": rates, "per_rate": {}, "best": best}
    for lr in rates:
        base = cells[("llama", lr)]
        entry = {"llama_learned": dict(base["learned"]), "n": len(base["seeds"])}
        for x in ("v1", "v2"):
            if (x, lr) not in cells:
                continue
            mine, theirs = cells[(x, lr)]["steps"]["both"], base["steps"]["both"]
            reached = [v for v in theirs if v <= base["budget"]]
            entry[x] = {
                "p": exact_tests.rank_sum(mine, theirs),
                "all_first": max(mine) < min(theirs),
                "llama_reached_first": bool(reached) and max(reached) < min(mine),
                "steps": sorted(mine),
                "llama_steps": sorted(theirs),
                "median": cells[(x, lr)]["median"]["both"],
                "llama_median": base["median"]["both"],
            }
        out["per_rate"][lr] = entry
    seeds = sorted({s for (_, _, s) in runs})
    out["seeds"] = seeds
    out["v2_first_every_rate"] = sum(
        all(
            ("v2", lr, s) in runs
            and ("llama", lr, s) in runs
            and _steps_both(runs[("v2", lr, s)]) < _steps_both(runs[("llama", lr, s)])
            for lr in rates
        )
        for s in seeds
    )
    lb = cells[("llama", best["llama"])]
    out["llama_best_vs"] = {
        lr: (
            cells[("llama", lr)]["learned"]["both"],
            exact_tests.fisher_exact(
                lb["learned"]["both"],
                len(lb["seeds"]) - lb["learned"]["both"],
                cells[("llama", lr)]["learned"]["both"],
                len(cells[("llama", lr)]["seeds"]) - cells[("llama", lr)]["learned"]["both"],
            ),
        )
        for lr in rates
        if lr != best["llama"]
    }
    out["stratified"] = {}
    for x in ("v1", "v2"):
        tables = []
        for lr in rates:
            if (x, lr) in cells:
                a, b = cells[(x, lr)], cells[("llama", lr)]
                tables.append(
                    (
                        a["learned"]["both"],
                        len(a["seeds"]) - a["learned"]["both"],
                        b["learned"]["both"],
                        len(b["seeds"]) - b["learned"]["both"],
                    )
                )
        out["stratified"][x] = {
            "learned": sum(t[0] for t in tables),
            "runs": sum(t[0] + t[1] for t in tables),
            "llama_learned": sum(t[2] for t in tables),
            "llama_runs": sum(t[2] + t[3] for t in tables),
            "p": exact_tests.stratified_fisher(tables),
        }
    first = combined(first_datas) if first_datas else {"runs": [], "meta": {"setting": {}}}
    first_lr = first["meta"]["setting"].get("lr")
    if first_lr is not None and float(first_lr) in rates:
        lr, cap = float(first_lr), min(first["meta"]["setting"]["steps"], cells[("llama", float(first_lr))]["budget"])

        def pooled(model: str) -> list[int]:
            mine = [r for r in first["runs"] if r["model"] == model]
            mine += [r for (m, rate, _), r in runs.items() if m == model and rate == lr]
            return [min(_steps_both(r), cap + 1) for r in mine]  # above the smaller budget: censored there

        llama = pooled("llama")
        seeds_pooled = sorted({r["seed"] for r in first["runs"]} | {s for (m, rate, s) in runs if rate == lr})
        out["pooled"] = {"lr": lr, "cap": cap, "seeds": seeds_pooled, "llama": llama}
        for x in ("v1", "v2"):
            mine = pooled(x)
            out["pooled"][x] = {
                "steps": mine,
                "p": exact_tests.rank_sum(mine, llama),
                "all_first": max(mine) < min(llama),
            }
    # V1 against the Llama of the same seed and rate: the largest attention logit and max / median.
    pairs = []  # (seed, V1 run, Llama run)
    by = {(r["model"], r["seed"]): r for r in first["runs"]}
    pairs += [(s, by[("v1", s)], by[("llama", s)]) for (m, s) in by if m == "v1" and ("llama", s) in by]
    pairs += [
        (s, r, runs[("llama", lr, s)]) for (m, lr, s), r in runs.items() if m == "v1" and ("llama", lr, s) in runs
    ]
    out["outliers"] = {}
    for key, fn in (("max", _largest_logit), ("ratio", max_over_median)):
        diffs = [fn(a) - fn(b) for _, a, b in pairs]
        per_seed: dict = {}
        for (s, _, _), d in zip(pairs, diffs):
            per_seed.setdefault(s, []).append(d)
        pos, neg, p = exact_tests.sign_test([statistics.mean(v) for v in per_seed.values()])
        out["outliers"][key] = {
            "runs": len(pairs),
            "below": sum(d < 0 for d in diffs),
            "seeds": len(per_seed),
            "seeds_below": neg,
            "seeds_above": pos,
            "p": p,
            "v1_max": max(fn(a) for _, a, _ in pairs) if pairs else None,
            "llama_min": min(fn(b) for _, _, b in pairs) if pairs else None,
        }
    # The largest max / median of any run: the grid's, and the first study's runs that learned needle retrieval.
    out["ratio_top"] = {
        "grid": {m: max(max_over_median(r) for (mm, _, _), r in runs.items() if mm == m) for m in MODELS},
        "first": {
            m: max(
                (max_over_median(r) for r in first["runs"] if r["model"] == m and learned(first, "needle")(r)),
                default=None,
            )
            for m in MODELS
        }
        if first["runs"]
        else {},
    }
    # The first study's attention on the answer, averaged over heads, in the runs that learned needle retrieval.
    out["answer_share"] = {}
    if first["runs"]:
        share = {
            m: [r["lens"]["answer_mean"] for r in first["runs"] if r["model"] == m and learned(first, "needle")(r)]
            for m in MODELS
        }
        if share["v2"] and share["llama"]:
            out["answer_share"] = {
                "v2": share["v2"],
                "llama": share["llama"],
                "all_below": max(share["v2"]) < min(share["llama"]),
                "p": exact_tests.rank_sum(share["v2"], share["llama"]),
            }
    # The grid's runs that learned each task's low-bit set (the first study's low-bit tables' filter).
    out["lowbit"] = {}
    for task in ("mqar", "needle"):
        learned_runs = [(m, r) for (m, _, _), r in sorted(runs.items()) if _learned_lowbit(task)(r)]
        lost = {m: [_lost_4bit(task)(r) for mm, r in learned_runs if mm == m] for m in MODELS}
        entry = {
            "n": {m: len(v) for m, v in lost.items()},
            "mean": {m: statistics.mean(v) for m, v in lost.items() if v},
        }
        for x in ("v1", "v2"):
            if lost[x] and lost["llama"]:
                entry[x] = exact_tests.rank_sum(lost[x], lost["llama"])
        added = [_added_4bit(task)(r) for _, r in learned_runs]
        for key, fn in (("max", _largest_logit), ("ratio", max_over_median)):
            values = [fn(r) for _, r in learned_runs]
            try:
                tau, p = exact_tests.kendall(values, added)
                entry[key] = {"rho": _spearman_rho(values, added), "tau": tau, "p": p}
            except ValueError:  # fewer than two runs, or a tie: no exact Kendall test here
                entry[key] = None
        entry["runs"] = len(learned_runs)
        out["lowbit"][task] = entry
    return out


def doc_grid_findings(datas: list[dict], opts: dict) -> list[str]:
    """scripts/doc_tables.py's renderer of :func:`grid_findings`: the learning-rate grid's files (``lr_grid``
    preset) and, optionally, the first study's (any other preset, combined), as a list of exploratory comparisons,
    each with its runs and exact test."""
    grid_datas = [d for d in datas if d["meta"].get("preset") == "lr_grid"]
    first_datas = [d for d in datas if d["meta"].get("preset") != "lr_grid"]
    f = grid_findings(grid_datas, first_datas)
    budget = max(c["budget"] for c in grid_cells(grid_datas)["cells"].values())
    lines = []

    def steps(values: list[int], cap: int) -> str:
        return ", ".join(f"{v:,}" if v <= cap else f"> {cap:,}" for v in values)

    v2 = [
        f"{lr:g}: {'every V2 run before every Llama run' if e['v2']['all_first'] else 'overlapping'}, "
        f"p = {exact_tests.format_p(e['v2']['p'])}"
        for lr, e in f["per_rate"].items()
        if "v2" in e
    ]
    n = next(iter(f["per_rate"].values()))["n"]
    lines.append(
        f"- **V2 against the Llama at the same rate** (steps to 90% on both tasks, {n} runs against {n}, exact "
        f"rank-sum test): " + "; ".join(v2) + f". The rates share seeds ({', '.join(map(str, f['seeds']))}), so the "
        f"independent unit is the seed: V2 got there before the Llama of the same seed at every rate in "
        f"{f['v2_first_every_rate']} of {len(f['seeds'])} seeds. The Llama learned MQAR in "
        + ", ".join(f"{e['llama_learned']['mqar']}" for e in f["per_rate"].values())
        + f" of {n} runs and both tasks in "
        + ", ".join(f"{e['llama_learned']['both']}" for e in f["per_rate"].values())
        + " ("
        + ", ".join(f"{lr:g}" for lr in f["rates"])
        + ")."
    )
    v1 = []
    for lr, e in f["per_rate"].items():
        if "v1" not in e:
            continue
        how = (
            "every V1 run before every Llama run"
            if e["v1"]["all_first"]
            else "every Llama run that got there before every V1 run"
            if e["v1"]["llama_reached_first"]
            else "overlapping"
        )
        v1.append(
            f"{lr:g}: V1 {steps(e['v1']['steps'], budget)} against {steps(e['v1']['llama_steps'], budget)} "
            f"({how}, p = {exact_tests.format_p(e['v1']['p'])})"
        )
    lines.append("- **V1 against the Llama at the same rate** (the same test): " + "; ".join(v1) + ".")
    lines.append(
        f"- **The Llama's best rate, {f['best']['llama']:g}, against its other rates** (learned both tasks, "
        "Fisher's exact test): "
        + "; ".join(f"{k}/{n} at {lr:g}, p = {exact_tests.format_p(p)}" for lr, (k, p) in f["llama_best_vs"].items())
        + "."
    )
    strat = "; ".join(
        f"{LABELS[x]} {e['learned']}/{e['runs']} against the Llama's {e['llama_learned']}/{e['llama_runs']}, "
        f"p = {exact_tests.format_p(e['p'])}"
        for x, e in f["stratified"].items()
    )
    lines.append(
        "- **Learning both tasks at all, over every rate** (exact conditional test stratified by rate: each rate's "
        f"2 × 2 table with its margins fixed): {strat}."
    )
    if "pooled" in f:
        pool = f["pooled"]
        lines.append(
            f"- **Pooled at {pool['lr']:g}** (the first study's rate; seeds {pool['seeds'][0]} to {pool['seeds'][-1]}, "
            f"the first study's and the grid's runs, every run censored at {pool['cap']:,} steps, the smaller budget): "
            f"steps to 90% on both tasks, V2 {steps(sorted(pool['v2']['steps']), pool['cap'])} against the Llama's "
            f"{steps(sorted(pool['llama']), pool['cap'])} ("
            f"{'every V2 run before every Llama run, ' if pool['v2']['all_first'] else ''}exact rank-sum test "
            f"p = {exact_tests.format_p(pool['v2']['p'])}, {len(pool['v2']['steps'])} vs {len(pool['llama'])}); "
            f"V1 {steps(sorted(pool['v1']['steps']), pool['cap'])} (p = {exact_tests.format_p(pool['v1']['p'])})."
        )
    o = f["outliers"]
    if o["max"]["runs"]:
        lines.append(
            f"- **Largest attention logit, V1 against the Llama of the same seed and rate** (both studies, "
            f"{o['max']['runs']} pairs of runs over {o['max']['seeds']} seeds): V1's is below the Llama's in "
            f"{o['max']['below']} of {o['max']['runs']} (V1's largest {o['max']['v1_max']:.1f}, the Llama's smallest "
            f"{o['max']['llama_min']:.1f}); sign test over the seeds' mean differences {o['max']['seeds_below']} of "
            f"{o['max']['seeds']} below, p = {exact_tests.format_p(o['max']['p'])}. Max / median: V1's below in "
            f"{o['ratio']['below']} of {o['ratio']['runs']}; over seeds {o['ratio']['seeds_below']} of "
            f"{o['ratio']['seeds']} below, p = {exact_tests.format_p(o['ratio']['p'])}."
        )
    for task, name in (("mqar", "MQAR"), ("needle", "needle retrieval")):
        e = f["lowbit"][task]
        vs = "; ".join(
            f"{LABELS[x]} {e['mean'][x]:.2f} ({e['n'][x]} runs, p = {exact_tests.format_p(e[x])})"
            for x in ("v1", "v2")
            if x in e
        )
        corr = "; ".join(
            f"{label} ρ = {e[key]['rho']:.2f}, Kendall's τ = {e[key]['tau']:.2f} "
            f"(exact p = {exact_tests.format_p(e[key]['p'])})"
            if e[key]
            else f"{label}: no exact test (too few runs or a tie)"
            for key, label in (("max", "largest logit"), ("ratio", "max / median"))
        )
        if "llama" in e["mean"]:
            lines.append(
                f"- **4-bit logits, {name}, the grid's runs** (those whose unquantized accuracy on the task's low-bit "
                f"set reaches {LEARNED:g}): accuracy lost, mean, the Llama {e['mean']['llama']:.2f} ({e['n']['llama']} "
                f"runs), against it (exact rank-sum test) {vs}. Against the loss added, over all {e['runs']} runs: "
                f"{corr}."
            )
    top = f["ratio_top"]
    lines.append(
        "- **Max / median of the attention logits** (the largest over layers), the largest of any run: the grid's "
        + ", ".join(f"{LABELS[m]} {v:.1f}" for m, v in top["grid"].items())
        + (
            "; the first study's runs that learned needle retrieval "
            + ", ".join(f"{LABELS[m]} {v:.1f}" for m, v in top["first"].items() if v is not None)
            if top.get("first")
            else ""
        )
        + "."
    )
    a = f["answer_share"]
    if a:
        lines.append(
            "- **Attention on the answer, averaged over heads** (the first study's runs that learned needle "
            f"retrieval; in parentheses: runs): V2 {_span(a['v2'])} against the Llama's {_span(a['llama'])}, "
            + ("every V2 run below every Llama run, " if a["all_below"] else "")
            + f"exact rank-sum test p = {exact_tests.format_p(a['p'])}."
        )
    lines += [
        "",
        "Exploratory: none of these tests was fixed before the grid ran. Each grid run stops once both tasks have held "
        "90% for three validations, so its low-bit and logit statistics are measured at a different step for each run "
        "(sooner for the faster models); the first study's runs are measured at the end of their 10,000 steps.",
    ]
    return lines


def readme_rows(report: dict) -> list[tuple[str, dict[str, str]]]:
    """The README's rows (scripts/doc_tables.py, ``readme``): in how many seeds each model learned needle retrieval,
    and what 4-bit attention logits cost the runs that learned each task (needle retrieval and MQAR: accuracy lost,
    mean). The tests of these differences are in the report (:func:`doc_summary`)."""
    f = summary_facts(report)
    n = f["seeds"]
    columns = {"llama": "llama", "v1": "v1", "v2": "v2"}
    rows = [
        (
            f"Retrieval with distractors, trained from scratch ({n} paired seeds, one learning rate): seeds whose "
            "model learned needle retrieval",
            {c: f"{f['learned_needle'][m]}/{n}" for c, m in columns.items()},
        )
    ]
    for task, name in (("needle", "needle"), ("mqar", "MQAR")):
        per = f[f"lowbit_{task}_lost"]["values"]
        rows.append(
            (
                f"… {name} accuracy lost to 4-bit attention logits (mean over the runs that learned it)",
                {c: f"{statistics.mean(per[m]):.2f}" for c, m in columns.items() if per[m]},
            )
        )
    return rows


def readme_rows_lr_grid(datas: list[dict]) -> list[tuple[str, dict[str, str]]]:
    """The README's row of the learning-rate grid (the ``lr_grid`` preset's files): at each model's best rate by the
    grid's rule (:func:`grid_cells`), how many runs reached 90% on both tasks within the budget and the steps each of
    them took (no median: a median over runs that partly never got there reads as a typical value); the label gives
    V2's exact rank-sum test against the Llama, each at its best rate. The other tests are in the report
    (:func:`doc_table_lr_grid`)."""
    grid = grid_cells(datas)
    cells, best = grid["cells"], grid["best"]
    rates = ", ".join(f"{lr:g}" for lr in sorted({lr for _, lr in cells}))
    seeds = sorted({len(c["seeds"]) for c in cells.values()})
    n_text = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]}"
    budgets = sorted({c["budget"] for c in cells.values()})
    at_best = {m: cells[(m, lr)] for m, lr in best.items()}

    def reached(m: str, c: dict) -> str:
        steps = sorted(v for v in c["steps"]["both"] if v <= c["budget"])
        return f"{len(steps)}/{len(c['seeds'])} at {best[m]:g}" + (
            ": " + ", ".join(f"{v:,}" for v in steps) if steps else ""
        )

    test = ""
    if "v2" in at_best and "llama" in at_best:
        v2, llama = at_best["v2"]["steps"]["both"], at_best["llama"]["steps"]["both"]
        p = exact_tests.format_p(exact_tests.rank_sum(v2, llama))
        test = f"; DIFF V2 against the Llama: exact rank-sum test p = {p} ({len(v2)} vs {len(llama)} runs)"
    return [
        (
            f"Retrieval, learning-rate grid ({n_text} new seeds at each of {rates}), each model at the grid rule's "
            f"best rate: runs that reached 90% validation accuracy on both tasks within {budgets[-1]:,} steps, and the "
            f"steps each took{test}",
            {m: reached(m, c) for m, c in at_best.items()},
        )
    ]


def readme_rows_files(datas: list[dict]) -> list[tuple[str, dict[str, str]]]:
    """The README's rows of one entry's files (scripts/doc_tables.py): the learning-rate grid's
    (:func:`readme_rows_lr_grid`), or one study run in parallel processes (:func:`combined`, :func:`readme_rows`)."""
    if all(d["meta"].get("preset") == "lr_grid" for d in datas):
        return readme_rows_lr_grid(datas)
    return readme_rows(combined(datas) if len(datas) > 1 else datas[0])


# ----------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train DIFF V1, DIFF V2 and a parameter-matched Llama on synthetic multi-needle retrieval "
        "(distractors sharing the key's prefix) and MQAR, paired seeds; evaluate accuracy over context lengths and "
        "needle counts, the attention lens, and low-bit attention (logits or q/k quantised to 8/6/4 bits). Resumable. "
        "Flags left unset take the --preset value."
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="default (1 CPU thread, <= 2 CPU-hours for 3 models x 3 seeds), gpu (larger, 5 seeds), smoke (seconds).",
    )
    p.add_argument("--models", default=",".join(MODELS), help=f"Comma-separated subset of {MODELS}. Default: all.")
    p.add_argument("--seeds", help="Comma-separated seeds (data, order and initialisation; paired across models).")
    p.add_argument(
        "--out", help="Output folder. Default: benchmarks/results/retrieval_lowbit (smoke: .../retrieval_lowbit_smoke)."
    )
    for name, kind, text in (
        ("hidden-size", int, "Model width E."),
        ("num-hidden-layers", int, "Layers."),
        (
            "num-attention-heads",
            int,
            "Query heads of width head_dim (the Llama's; V1/V2 have half as many differential heads).",
        ),
        ("num-key-value-heads", int, "Key/value heads (even, for V1)."),
        ("head-dim", int, "Width d of one query/key head."),
        ("intermediate-size", int, "MLP width of the Llama and V1 (V2's is widened to match parameters)."),
        ("train-length", int, "Longest training sequence in tokens (needle sequences are 32..this long)."),
        ("batch-size", int, "Sequences per step."),
        ("steps", int, "Optimiser steps."),
        ("warmup", int, "Linear warm-up steps."),
        ("lr", float, "Peak learning rate (AdamW)."),
        ("schedule", str, "After the warm-up: cosine (decay to zero at the last step) or constant."),
        ("needle-fraction", float, "Share of training sequences that are multi-needle."),
        (
            "copy-fraction",
            float,
            "Share of training sequences that are a random sequence repeated (induction data); the rest are MQAR.",
        ),
        ("train-needles", str, "Needle counts of training sequences, comma-separated."),
        (
            "train-queries",
            int,
            "Queries per training needle sequence (at most its needle count; each answer is a target).",
        ),
        ("train-pairs", str, "MQAR pair counts of training sequences (those that fit in --train-length)."),
        (
            "eval-lengths",
            str,
            "Held-out needle context lengths in tokens (longer than --train-length tests extrapolation).",
        ),
        ("eval-needles", str, "Held-out needle counts."),
        ("eval-depths", str, "Depths of the queried needle (0..1)."),
        ("eval-samples", int, "Held-out needle sequences per (length, count, depth) cell."),
        ("eval-pairs", str, "Held-out MQAR pair counts."),
        ("mqar-samples", int, "Held-out MQAR sequences per pair count."),
        (
            "lowbit-samples",
            int,
            "Low-bit needle sequences per (needle count, depth) cell, at the trained length (MQAR: twice as many per "
            "pair count, the two largest trained counts that fit).",
        ),
        ("lowbit-bits", str, "Bit widths of the low-bit evaluation."),
        ("lens-examples", int, "Needle prompts the attention lens averages over."),
        ("eval-every", int, "Validate every N steps (curves)."),
        ("threads", int, "torch.set_num_threads."),
        (
            "stop-held",
            int,
            "Stop a run once needle and MQAR validation accuracy have been 0.9 or more at this many "
            "validations in a row (0: train every step).",
        ),
        ("device", str, "torch device (cpu, cuda)."),
    ):
        p.add_argument(f"--{name}", type=kind, help=text)
    p.add_argument(
        "--no-analysis",
        dest="analysis",
        action="store_false",
        help="Accuracy only: no low-bit evaluation, activation statistics or lens (calibration runs).",
    )
    p.add_argument(
        "--no-resume",
        dest="resume",
        action="store_false",
        help="Retrain every (seed, model) even if results.json holds it under the same setting.",
    )
    p.add_argument(
        "--no-plots",
        dest="plots",
        action="store_false",
        help="Write results.json and results.md only (grids of many folders).",
    )
    p.add_argument("--progress", action="store_true", help="Print the validation curve while training.")
    p.add_argument(
        "--plot-with",
        nargs="+",
        default=[],
        metavar="RESULTS_JSON",
        help="Other results files of the same setting (seeds run in parallel with another --out): the plots "
        "show their runs too (results.json keeps this folder's own runs).",
    )
    return p


def resolve_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for key in OPTIONAL_SETTING_KEYS:
        if getattr(args, key, None) is None:
            setattr(args, key, 0)
    if args.out is None:
        args.out = "benchmarks/results/retrieval_lowbit" + ("_smoke" if args.preset == "smoke" else "")
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.model_list if m not in MODELS]
    if bad or not args.model_list:
        raise SystemExit(f"--models must be a comma-separated subset of {MODELS}, got {args.models!r}.")
    args.seed_list = _ints(args.seeds)
    for key in (
        "steps",
        "batch_size",
        "train_length",
        "train_queries",
        "eval_every",
        "eval_samples",
        "mqar_samples",
        "lowbit_samples",
        "lens_examples",
        "threads",
    ):
        if getattr(args, key) <= 0:
            raise SystemExit(f"--{key.replace('_', '-')} must be a positive integer, got {getattr(args, key)}.")
    if args.stop_held < 0:
        raise SystemExit(f"--stop-held must be 0 (train every step) or a positive integer, got {args.stop_held}.")
    if args.schedule not in ("cosine", "constant"):
        raise SystemExit(f"--schedule must be cosine or constant, got {args.schedule!r}.")
    if any(b < 2 or b > 16 for b in _ints(args.lowbit_bits)):
        raise SystemExit(f"--lowbit-bits must be integers in [2, 16], got {args.lowbit_bits!r}.")
    return args


def setting_of(args) -> dict:
    return {k: getattr(args, k) for k in SETTING_KEYS} | {
        k: getattr(args, k) for k in OPTIONAL_SETTING_KEYS if getattr(args, k)
    }


def setting_id(setting: dict) -> str:
    return hashlib.sha256(json.dumps(setting, sort_keys=True).encode()).hexdigest()[:12]


def load_runs(path: str, sid: str) -> tuple[dict, dict | None]:
    """The finished (model, seed) results of ``path`` under setting ``sid`` (others are dropped) and the provenance of
    the run that wrote them (None where none are kept)."""
    if not os.path.exists(path):
        return {}, None
    with open(path) as f:
        saved = json.load(f)
    if saved.get("meta", {}).get("setting_id") != sid or not saved.get("runs"):
        return {}, None
    return {(r["model"], r["seed"]): r for r in saved["runs"]}, saved.get("provenance")


def save(path: str, runs: dict, meta: dict, argv, earlier: dict | None = None) -> dict:
    """Write ``results.json`` atomically (a killed run leaves the previous file whole). ``earlier``: the provenance of
    the run whose results a ``--resume`` kept (recorded as ``resumed_from``)."""
    report = {
        "meta": meta,
        "summary": summaries(runs),
        "runs": [runs[k] for k in sorted(runs, key=lambda k: (k[1], MODELS.index(k[0])))],
    }
    prov = harness.provenance(SCRIPT, argv)
    if earlier is not None:
        prov["resumed_from"] = earlier
    report["provenance"] = prov
    tmp = path + ".tmp"
    written = harness.write_json(tmp, report, SCRIPT, argv)
    os.replace(tmp, path)
    return written


def run(args, argv) -> dict:
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    results_path = os.path.join(args.out, "results.json")
    setting = setting_of(args)
    sid = setting_id(setting)
    runs, earlier = load_runs(results_path, sid) if args.resume else ({}, None)
    vocab_size = rt.TaskVocab().size
    configs = build_configs(
        vocab_size,
        args.hidden_size,
        args.num_hidden_layers,
        args.num_attention_heads,
        args.num_key_value_heads,
        args.head_dim,
        args.intermediate_size,
        max(_ints(args.eval_lengths)),
    )
    meta = {
        "setting": setting,
        "setting_id": sid,
        "vocab_size": vocab_size,
        "preset": args.preset,
        "machine": harness.machine_info(args.threads),
        "tokens_per_run": args.steps * args.batch_size * args.train_length,
    }
    trained = []
    for seed in args.seed_list:
        todo = [m for m in args.model_list if (m, seed) not in runs]
        if not todo:
            continue
        data = make_data(args, seed)
        for name in todo:
            cpu0, wall0 = time.process_time(), time.time()
            with harness.trace_code():
                model = build_model(name, configs[name], seed).to(args.device)
            curves = train(
                model,
                data["batches"],
                data["val"],
                args.lr,
                args.warmup,
                args.eval_every,
                args.device,
                args.progress,
                args.schedule,
                args.stop_held,
            )
            with harness.trace_code():  # evaluation is short beside training: traced whole
                result = {
                    "model": name,
                    "seed": seed,
                    "params": sum(p.numel() for p in model.parameters()),
                    "curves": curves,
                    "eval": evaluate_retrieval(model, data["evals"]),
                }
                if args.analysis:
                    result["lowbit"] = evaluate_lowbit(model, data["evals"], _ints(args.lowbit_bits))
                    result["lens"] = evaluate_lens(model, data["evals"]["lens"])
            result["cpu_s"], result["wall_s"] = time.process_time() - cpu0, time.time() - wall0
            runs[(name, seed)] = result
            trained.append((name, seed))
            save(results_path, runs, meta, argv, earlier)
            ev = result["eval"]
            by_length = ", ".join(f"{k}: {v['accuracy']:.2f}" for k, v in ev["needle"]["by_length"].items())
            print(
                f"seed {seed} {name}: {result['params']:,} params, train {curves['train_cpu_s']:.0f} cpu-s, total "
                f"{result['cpu_s']:.0f} cpu-s / {result['wall_s']:.0f} s; needle acc "
                f"{ev['needle']['overall']['accuracy']:.3f} (by length {by_length}); MQAR acc "
                f"{ev['mqar']['overall']['accuracy']:.3f}",
                flush=True,
            )
            del model
    if trained or earlier is None:
        report = save(results_path, runs, meta, argv, earlier)
    else:  # nothing new: the file and its provenance stay as the runs that made them wrote them
        with open(results_path) as f:
            report = json.load(f)
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write(markdown_tables(report))
    plots = ["curves.png", "accuracy_vs_length.png"] + (
        ["accuracy_vs_bits.png", "attention_shares.png"] if args.analysis else []
    )
    if args.plot_with:
        others = []
        for path in args.plot_with:
            with open(path) as f:
                others.append(json.load(f))
        joined = combined([report, *others])  # the same setting, no run twice (else a named error)
        runs = {(r["model"], r["seed"]): r for r in joined["runs"]}
    if (
        args.plots
        and runs
        and (trained or args.plot_with or not all(os.path.exists(os.path.join(args.out, p)) for p in plots))
    ):
        plot_curves(runs, os.path.join(args.out, "curves.png"))
        plot_accuracy_vs_length(runs, args, os.path.join(args.out, "accuracy_vs_length.png"))
        if args.analysis:
            plot_accuracy_vs_bits(runs, args, os.path.join(args.out, "accuracy_vs_bits.png"))
            plot_lens(runs, os.path.join(args.out, "attention_shares.png"))
    return report


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run(resolve_args(argv), argv)


if __name__ == "__main__":
    main()
