"""Does differential attention help? Retrieval with distractors and low-bit attention, DIFF V1 / V2 vs a Llama, seeds.

The Differential Transformer paper (Ye et al., arXiv 2410.05258) reports its largest effects on multi-needle retrieval
(§3.3: more accurate retrieval, more attention to the answer, less to the noise) and on low-bit attention (§3.7:
accuracy kept with quantised attention logits, smaller activation outliers). This script tests both at toy scale on
synthetic tasks that a parameter-matched Llama learns (:mod:`difftransformer.retrieval_tasks`: multi-needle retrieval
whose distractor needles share the queried key's prefix, and multi-query associative recall), for DIFF V1, DIFF V2 and
the Llama at matched parameters (``compare_small.build_configs``), trained on the same data in the same order from the
same initialisation stream, over several paired seeds:

1. accuracy (argmax over the whole vocabulary equals the answer) and answer loss on held-out sequences, over context
   lengths (beyond the trained length too), needle counts and needle depths; MQAR over pair counts;
2. the attention lens (:func:`difftransformer.analysis.lens_on_spans`) on held-out needle prompts: share of attention
   on the queried needle (answer), on the rest of the context (noise) and on the distractor needles;
3. low-bit attention (:mod:`difftransformer.lowbit`): accuracy and loss with the attention logits, or q and k,
   quantised to 8, 6 and 4 bits (symmetric, per tensor and per head), and the top activations of attention logits
   and hidden states per layer.

Outputs in ``--out``: ``results.json`` (every run, the per-seed / mean / paired-difference summary, provenance),
``results.md`` (that summary as a table), ``curves.png``, ``accuracy_vs_length.png``, ``accuracy_vs_bits.png`` and
``attention_shares.png``.

Resumable: each (seed, model) result is written into ``results.json`` as soon as it is done, and a rerun with the same
setting skips what is there (``--resume``, the default). Presets: ``default`` (single-threaded CPU, at most two
CPU-hours for three models x three seeds), ``gpu`` (larger model and data, five seeds) and ``smoke`` (seconds; the
tests run it). Every flag overrides its preset's value.
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

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script: `benchmarks.*` needs the repository root
    sys.path.insert(0, _ROOT)

from benchmarks import harness  # noqa: E402
from benchmarks.compare_small import build_configs, build_model  # noqa: E402
from difftransformer import retrieval_tasks as rt  # noqa: E402

SCRIPT = "retrieval_lowbit.py"
MODELS = ("llama", "v1", "v2")
LABELS = {"v1": "DIFF V1", "v2": "DIFF V2", "llama": "Llama"}

_DEFAULT = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=192, train_length=64, batch_size=32, steps=10000, warmup=200, lr=1e-3, schedule="constant",
    needle_fraction=0.45, copy_fraction=0.25, train_needles="1,2,4,6", train_queries=8, train_pairs="2,4,6,8,12",
    eval_lengths="48,64,80,96,128,256", eval_needles="2,4,6,8", eval_depths="0,0.25,0.5,0.75,1", eval_samples=8,
    eval_pairs="4,8,12,16,24,32,48", mqar_samples=16, lowbit_samples=6, lowbit_bits="8,6,4", lens_examples=20,
    eval_every=500, seeds="0,1,2", threads=1, device="cpu")
PRESETS = {
    # Frozen after calibrating the Llama alone (docs/reports/2026-11-27-retrieval-lowbit.md, "Calibration"): at this size
    # and budget a Llama's validation accuracy on both tasks jumps from chance to ~1 between 4,000 and 5,000 steps.
    "default": _DEFAULT,
    # The same recipe, wider, twice the context and steps, ten seeds (not run here: no GPU was available).
    "gpu": _DEFAULT | dict(
        hidden_size=128, num_attention_heads=8, num_key_value_heads=4, intermediate_size=384, train_length=128,
        batch_size=64, steps=20000, train_needles="1,2,4,6,8,12", train_pairs="2,4,8,12,16,24",
        eval_lengths="64,128,160,192,256,512", eval_needles="2,4,8,12,16", eval_samples=16, eval_pairs="8,16,24,32,48",
        mqar_samples=32, lowbit_samples=12, lens_examples=25, seeds="0,1,2,3,4,5,6,7,8,9", threads=4, device="cuda"),
    # Issue 42's learning-rate grid: the default recipe at 20,000 steps on seeds never used for calibration (nor by the
    # default's runs, 0-4), one --lr per call; a run stops once both tasks' validation accuracy has been at 90% or more at
    # three validations in a row (1,000 steps at eval_every 500). scripts/retrieval_lr_grid.sh runs the grid.
    "lr_grid": _DEFAULT | dict(steps=20000, seeds="5,6,7,8", stop_held=3),
    "smoke": dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, train_length=48, batch_size=4, steps=3, warmup=1, lr=1e-3, schedule="constant",
        needle_fraction=0.4, copy_fraction=0.2, train_needles="1,2,4", train_queries=2, train_pairs="4,8",
        eval_lengths="48,64", eval_needles="2,4", eval_depths="0,1", eval_samples=1,
        eval_pairs="4,8", mqar_samples=1, lowbit_samples=1, lowbit_bits="4", lens_examples=2,
        eval_every=2, seeds="0,1", threads=1, device="cpu"),
}
# The preset values that define a run's setting (a result is reused by --resume only under the same setting).
# Keys that join the setting only where set (so that the settings of results run before they existed keep their ids).
OPTIONAL_SETTING_KEYS = ("stop_held",)
SETTING_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "train_length", "batch_size", "steps", "warmup", "lr", "schedule", "needle_fraction",
                "copy_fraction",
                "train_needles", "train_queries", "train_pairs", "eval_lengths", "eval_needles", "eval_depths", "eval_samples",
                "eval_pairs", "mqar_samples", "lowbit_samples", "lowbit_bits", "lens_examples", "eval_every",
                "analysis")
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
    train = rt.training_examples(vocab, count, seed, args.train_length, _ints(args.train_needles),
                                 _ints(args.train_pairs), args.needle_fraction, args.train_queries,
                                 copy_fraction=args.copy_fraction)
    batches = [rt.encode(train[i : i + args.batch_size]) for i in range(0, count, args.batch_size)]
    val_seed, eval_seed = seed + 10_000, seed + 20_000
    depths = _floats(args.eval_depths)
    val = rt.needle_grid(vocab, [args.train_length], _ints(args.train_needles)[-2:], depths, 2, val_seed, num_queries=4)
    val += rt.mqar_grid(vocab, [n for n in _ints(args.train_pairs) if rt.mqar_length(n) <= args.train_length][-2:], 4, val_seed)
    if args.copy_fraction > 0:  # the induction data: its accuracy shows when induction heads form
        val += [rt.repeated_copy(vocab, 24, rt.seeded_rng(val_seed, "copy", i)) for i in range(8)]
    lengths, needles = _ints(args.eval_lengths), _ints(args.eval_needles)
    evals = {
        "needle": rt.needle_grid(vocab, lengths, needles, depths, args.eval_samples, eval_seed),
        "mqar": rt.mqar_grid(vocab, _ints(args.eval_pairs), args.mqar_samples, eval_seed),
        # Low-bit attention and activation statistics: at the trained length, where every model is in distribution.
        "lowbit_needle": rt.needle_grid(vocab, [args.train_length], needles, depths, args.lowbit_samples,
                                        eval_seed + 1),
        "lowbit_mqar": rt.mqar_grid(vocab, [n for n in _ints(args.train_pairs) if rt.mqar_length(n) <= args.train_length][-2:],
                                    2 * args.lowbit_samples, eval_seed + 1),
        # Lens prompts: cut right after the first query's key (the last token predicts the answer).
        "lens": rt.needle_grid(vocab, [args.train_length], needles, depths,
                               max(1, math.ceil(args.lens_examples / (len(needles) * len(depths)))), eval_seed + 2)[: args.lens_examples],
    }
    return {"vocab": vocab, "batches": batches, "val": val, "evals": evals}


# ----------------------------------------------------------------------------------------------- training


def summarize_scores(examples, scores) -> dict:
    """Mean accuracy (whole-vocabulary argmax), multiple-choice accuracy and answer loss over every query."""
    correct = [c for s in scores for c in s["correct"]]
    choice = [c for s in scores for c in s["choice_correct"]]
    loss = [x for s in scores for x in s["loss"]]
    return {"accuracy": sum(correct) / len(correct), "choice_accuracy": sum(choice) / len(choice),
            "loss": sum(loss) / len(loss), "n": len(correct)}


STOP_TASKS, STOP_LEVEL = ("needle", "mqar"), 0.9


def train(model, batches, val, lr: float, warmup: int, eval_every: int, device: str, progress: bool = False,
          schedule: str = "cosine", stop_held: int = 0) -> dict:
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
    curves = {"step": [], "train_loss": [], "eval_step": [], "val_loss": [], "val_accuracy": [], "val_accuracy_by_task": {},
              "stopped_at": None}

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
            print(f"  step {step}: val loss {s['loss']:.3f} acc {s['accuracy']:.3f} ("
                  + ", ".join(f"{t} {v['accuracy']:.2f}" for t, v in by_task.items()) + ")", flush=True)

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
        "needle": {"overall": summarize_scores(needle, ns),
                   "by_length": grouped(needle, ns, lambda e: e.context_length),
                   "by_needles": grouped(needle, ns, lambda e: e.count),
                   "by_depth": grouped(needle, ns, lambda e: e.depth),
                   "cells": {f"{L}/{n}": v for (L, n), v in
                             ((tuple(map(int, k.split("/"))), v) for k, v in
                              grouped(needle, ns, lambda e: f"{e.context_length}/{e.count}").items())}},
        "mqar": {"overall": summarize_scores(evals["mqar"], ms),
                 "by_pairs": grouped(evals["mqar"], ms, lambda e: e.count)},
    }


def evaluate_lowbit(model, evals, bits_list) -> dict:
    """Accuracy and loss on the low-bit sets with every quantisation (and none), and the activation statistics."""
    from difftransformer import lowbit

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
    from difftransformer import analysis

    items = []
    for ex in examples:
        pos, _ = ex.targets[0]
        length = pos + 1
        distractor = torch.zeros(length, dtype=torch.bool)
        for a, b in ex.distractors[0]:
            distractor[a:b] = True
        items.append(analysis.SpanExample(torch.tensor(ex.input_ids[:length]), ex.evidence[0], (0, ex.question_start),
                                          {"distractors": distractor}))
    lensed = analysis.lens_on_spans(model, items)
    kind = "diff" if "diff" in lensed.shares else "softmax"
    shares = lensed.shares[kind]  # (L, heads, 3)
    distractors = lensed.region_shares["distractors"][kind]  # (L, heads)
    best = shares[..., 0].flatten().argmax()
    result = {"kind": kind, "examples": lensed.examples,
              "per_layer": {k: s.mean(1).tolist() for k, s in lensed.shares.items()},
              "distractor_per_layer": distractors.mean(1).tolist(),
              "answer_mean": float(shares[..., 0].mean()), "noise_mean": float(shares[..., 1].mean()),
              "distractor_mean": float(distractors.mean()),
              "answer_best_head": float(shares[..., 0].flatten()[best]),
              "noise_of_best_head": float(shares[..., 1].flatten()[best]),
              "distractor_of_best_head": float(distractors.flatten()[best])}
    if lensed.lambdas is not None:
        lam = lensed.lambdas
        result["lambdas"] = lam.tolist() if lam.dim() == 1 else {"mean": lam[..., 0].mean(1).tolist(),
                                                                   "std": lam[..., 1].mean(1).tolist()}
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
        entry = {"per_seed": {str(k): v for k, v in sorted(per_seed.items())}, "mean": statistics.mean(values),
                 "std": statistics.stdev(values) if len(values) > 1 else 0.0}
        if name != "llama":
            diffs = {s: v - metric(runs[("llama", s)]) for s, v in per_seed.items() if ("llama", s) in runs}
            if diffs:
                d = list(diffs.values())
                entry["diff_vs_llama"] = {"per_seed": {str(k): v for k, v in sorted(diffs.items())},
                                          "mean": statistics.mean(d), "std": statistics.stdev(d) if len(d) > 1 else 0.0,
                                          "min": min(d), "max": max(d)}
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
                metrics[f"lowbit {tag} {task}_accuracy"] = lambda r, t=tag, k=task: r["lowbit"]["accuracy"][t][k]["accuracy"]
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
            axes[2].plot([int(x) for x in xs], [statistics.mean(v["accuracy"] for v in vs) for vs in vals],
                         marker="o", label=LABELS[model])
            for x, vs in zip(xs, vals):
                axes[2].scatter([int(x)] * len(vs), [v["accuracy"] for v in vs], s=8, alpha=0.4)
    titles = (f"multi-needle accuracy vs context length (trained <= {args.train_length})",
              "multi-needle accuracy vs needle count", f"MQAR accuracy vs pairs (trained <= {max(_ints(args.train_pairs))})")
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
            ax.plot(layers, [statistics.mean(p[layer][idx] for p in per_layer) for layer in layers], marker="o",
                    label=f"{LABELS[model]} ({kind})")
        axes[2].plot(layers, [statistics.mean(r["lens"]["distractor_per_layer"][layer] for r in rows) for layer in layers],
                     marker="o", label=f"{LABELS[model]} ({kind})")
    for ax, title in zip(axes, ("attention to the queried needle", "attention noise (rest of the context)",
                                "attention to distractor needles (same prefix)")):
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
    cells.append("" if d is None else f"{d['mean']:+.{digits}f} ± {d['std']:.{digits}f} [{d['min']:+.{digits}f}, {d['max']:+.{digits}f}]")
    return cells


def markdown_tables(report: dict, metrics: list[str] | None = None) -> str:
    """results.md: one row per (metric, model): per-seed values (seed order), mean ± sample std over seeds, and the
    paired difference to the Llama of the same seed (mean ± sample std [min, max])."""
    summary = report["summary"]
    if not summary:
        return "(no finished runs)\n"
    first = next(iter(summary.values()))
    seeds = ", ".join(next(iter(first.values()))["per_seed"])
    lines = [f"Seeds {seeds}; setting `{report['meta']['setting_id']}`; command `{report['provenance']['command']}`.", "",
             "| metric | model | per seed | mean ± std | paired diff vs Llama: mean ± std [min, max] |",
             "|---|---|---|---|---|"]
    for metric in metrics or list(summary):
        for model, entry in summary[metric].items():
            lines.append(f"| {metric} | {LABELS[model]} | " + " | ".join(_fmt_entry(entry)) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- docs

# The report's tables and the README's row (scripts/doc_tables.py renders them from results.json: a table block
# `<!-- table: benchmarks.retrieval_lowbit:doc_table_retrieval benchmarks/results/retrieval_lowbit/results.json -->`).


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


def _mean_over(groups: dict, keys) -> float:
    return statistics.mean(groups[k]["accuracy"] for k in keys)


def retrieval_metrics(report: dict) -> dict:
    """The report's retrieval rows: label → function of one run. Trained lengths are those up to the training length
    (MQAR: pair counts whose sequence fits in it, 16 pairs at the default preset, more than training's 12); the
    others are beyond training."""
    train_length = report["meta"]["setting"]["train_length"]
    first = report["runs"][0]["eval"]
    inside = [k for k in first["needle"]["by_length"] if int(k) <= train_length]
    beyond = [k for k in first["needle"]["by_length"] if int(k) > train_length]
    pairs_in = [k for k in first["mqar"]["by_pairs"] if rt.mqar_length(int(k)) <= train_length]
    pairs_out = [k for k in first["mqar"]["by_pairs"] if rt.mqar_length(int(k)) > train_length]
    groups = {  # rows over an empty set of lengths or pair counts are left out
        f"needle accuracy, trained lengths ({', '.join(inside)} tokens)": ("needle", "by_length", inside),
        f"needle accuracy, longer contexts ({', '.join(beyond)} tokens)": ("needle", "by_length", beyond),
        f"MQAR accuracy, within the training length ({', '.join(pairs_in)} pairs)": ("mqar", "by_pairs", pairs_in),
        f"MQAR accuracy, longer ({', '.join(pairs_out)} pairs)": ("mqar", "by_pairs", pairs_out),
    }
    return {
        **{label: (lambda r, t=task, g=group, k=keys: _mean_over(r["eval"][t][g], k))
           for label, (task, group, keys) in groups.items() if keys},
        "needle answer loss (nats, all lengths)": lambda r: r["eval"]["needle"]["overall"]["loss"],
        "steps to 90% validation accuracy, needle (censored at the run's end)":
            lambda r: steps_to(r["curves"], "needle", 0.9),
        "steps to 90% validation accuracy, MQAR": lambda r: steps_to(r["curves"], "mqar", 0.9),
    }


def _model_table(report: dict, rows: dict, value_fmt=_mean_std, counted: bool = False) -> list[str]:
    """One row per quantity: per model mean ± std over its runs, and the paired difference to the Llama. ``counted``:
    each cell names its number of runs (paired cells: the seeds where both models have one)."""
    models = [m for m in MODELS if any(r["model"] == m for r in report["runs"])]
    head = ["quantity"] + [LABELS[m] for m in models] + [f"{LABELS[m]} − Llama (paired)" for m in models if m != "llama"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def count(text, n):
        return f"{text} ({n})" if counted and text != "–" else text

    for label, fn in rows.items():
        cells = [count(value_fmt(v := _seeds_of(report, m, fn).values()), len(v)) for m in models]
        llama = set(_seeds_of(report, "llama", fn))
        cells += [count(_paired(report, m, fn), len(set(_seeds_of(report, m, fn)) & llama))
                  for m in models if m != "llama"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _learned_only(report: dict, opts: dict) -> tuple[dict, str]:
    """``opts["learned"]``: the report with only the runs whose needle accuracy at the trained lengths reaches it
    (the attention of a model that never retrieves says nothing about how retrieval attends), and the note saying so."""
    if "learned" not in opts:
        return report, ""
    level = float(opts["learned"])
    metrics = retrieval_metrics(report)
    needle = metrics[next(k for k in metrics if k.startswith("needle accuracy, trained"))]
    kept = [r for r in report["runs"] if needle(r) >= level]
    return report | {"runs": kept}, (f" Only the runs that learned needle retrieval (accuracy at the trained lengths "
                                      f"{level:g} or more; in parentheses: runs, or seeds where both models did).")


def _seeds_line(report: dict) -> str:
    seeds = sorted({r["seed"] for r in report["runs"]})
    params = {LABELS[r["model"]]: r["params"] for r in report["runs"] if r["seed"] == seeds[0]}
    return (f"Mean ± sample std over seeds {', '.join(map(str, seeds))}; paired: the model's value minus the Llama's of "
            "the same seed, mean ± std [min, max]. Parameters: " + ", ".join(f"{k} {v:,}" for k, v in params.items())
            + ".")


def doc_table_retrieval(datas: list[dict], opts: dict) -> list[str]:
    """Retrieval accuracy per model (held-out sets), its paired difference to the Llama, and when it was learned."""
    report = combined(datas)
    return _model_table(report, retrieval_metrics(report)) + ["", _seeds_line(report)]


def doc_table_per_seed(datas: list[dict], opts: dict) -> list[str]:
    """Per seed and model: retrieval accuracy at the trained lengths and when validation accuracy reached 90%."""
    report = combined(datas)
    metrics = retrieval_metrics(report)
    needle = next(k for k in metrics if k.startswith("needle accuracy, trained"))
    mqar = next(k for k in metrics if k.startswith("MQAR accuracy, within"))
    steps = report["meta"]["setting"]["steps"]
    lines = ["| seed | model | needle accuracy, trained lengths | MQAR accuracy, within the training length | "
             "steps to 90% validation accuracy: needle / MQAR |", "|---|---|---|---|---|"]
    for r in sorted(report["runs"], key=lambda r: (r["seed"], MODELS.index(r["model"]))):
        reached = [steps_to(r["curves"], t, 0.9) for t in ("needle", "mqar")]
        shown = " / ".join(str(n) if n <= steps else "not reached" for n in reached)
        lines.append(f"| {r['seed']} | {LABELS[r['model']]} | {metrics[needle](r):.2f} | {metrics[mqar](r):.2f} | "
                     f"{shown} |")
    return lines


def doc_table_lowbit(datas: list[dict], opts: dict) -> list[str]:
    """Accuracy at the trained length with the attention logits or q and k quantized (``opts["task"]``: needle or
    mqar), per model, and the paired difference of the accuracy lost to quantization against the Llama's loss.
    ``opts["learned"]`` (e.g. ``0.9``): only runs whose unquantized accuracy on that set reaches it (a model that
    never learned the task has nothing to lose); each cell then names its number of runs, and a paired cell the seeds
    where both models learned."""
    report, task = combined(datas), opts.get("task", "needle")
    measure = opts.get("measure", "accuracy")  # or "loss": the answer loss (nats), and the loss added
    if measure not in ("accuracy", "loss"):
        raise ValueError(f"measure={measure!r}: allowed values are 'accuracy' and 'loss'")
    tags = list(report["runs"][0]["lowbit"]["accuracy"])

    def acc(tag):
        return lambda r: r["lowbit"]["accuracy"][tag][task]["accuracy"]

    def value(tag):
        return lambda r: r["lowbit"]["accuracy"][tag][task][measure]

    level = float(opts["learned"]) if "learned" in opts else None
    if level is not None:
        report = report | {"runs": [r for r in report["runs"] if acc("none")(r) >= level]}
    models = [m for m in MODELS if any(r["model"] == m for r in report["runs"])]
    change = "accuracy lost" if measure == "accuracy" else "loss added"
    head = (["quantized", *[LABELS[m] for m in models]]
            + [f"{LABELS[m]} − Llama: {change} (paired)" for m in models if m != "llama"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def counted(text, n):
        return text if level is None or text == "–" else f"{text} ({n})"

    sign = 1 if measure == "accuracy" else -1  # accuracy lost: before − after; loss added: after − before
    for tag in tags:
        cells = [counted(_mean_std(v := _seeds_of(report, m, value(tag)).values()), len(v)) for m in models]
        if tag == "none":
            cells += ["–" for m in models if m != "llama"]
        else:
            lost = lambda r, t=tag: sign * (value("none")(r) - value(t)(r))  # noqa: E731
            both = {m: len(set(_seeds_of(report, m, lost)) & set(_seeds_of(report, "llama", lost))) for m in models}
            cells += [counted(_paired(report, m, lost), both[m]) for m in models if m != "llama"]
        label = "nothing" if tag == "none" else tag.replace("/", ", ").replace("qk", "q and k") + " bits"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    note = (" Accuracy lost: unquantized minus quantized accuracy of the same model." if measure == "accuracy" else
            " Answer loss in nats; loss added: quantized minus unquantized loss of the same model.")
    if level is not None:
        note += (f" Only runs whose unquantized accuracy reaches {level:g} (in parentheses: runs, or seeds where both "
                 "models did).")
    return lines + ["", _seeds_line(combined(datas)) + note]


def doc_table_outliers(datas: list[dict], opts: dict) -> list[str]:
    """Top activations: the largest attention logit and hidden-state magnitude over layers, and their kurtosis."""
    everyone = combined(datas)
    report, note = _learned_only(everyone, opts)
    acts = lambda kind, key: lambda r: max(x[key] for x in r["lowbit"]["activations"][kind])  # noqa: E731
    rows = {"largest attention logit (magnitude)": acts("logits", "max"),
            "attention logits: 10th largest": acts("logits", "top10"),
            "attention logits: kurtosis (largest over layers)": acts("logits", "kurtosis"),
            "largest hidden-state magnitude": acts("hidden", "max"),
            "hidden states: kurtosis (largest over layers)": acts("hidden", "kurtosis")}
    return _model_table(report, rows, counted=bool(note)) + ["", _seeds_line(everyone) + note]


def doc_table_lens(datas: list[dict], opts: dict) -> list[str]:
    """Attention of the last key token of the first query, on the queried needle (answer), the other needles
    (distractors) and the rest (noise): mean over layers, heads and prompts, and the head with the largest answer share."""
    everyone = combined(datas)
    report, note = _learned_only(everyone, opts)
    rows = {"answer share (mean over heads)": lambda r: r["lens"]["answer_mean"],
            "distractor-needle share (mean over heads)": lambda r: r["lens"]["distractor_mean"],
            "noise share (mean over heads)": lambda r: r["lens"]["noise_mean"],
            "answer share of the best head": lambda r: r["lens"]["answer_best_head"],
            "noise share of that head": lambda r: r["lens"]["noise_of_best_head"]}
    return _model_table(report, rows, counted=bool(note)) + ["", _seeds_line(everyone) + " DIFF models: the differential "
                                                            "map's positive mass; the Llama: its softmax map." + note]


def doc_table_calibration(datas: list[dict], opts: dict) -> list[str]:
    """The calibration runs (the Llama alone, one seed each), in the order they ran: the setting each tried and the
    Llama's held-out accuracy (each on the task definitions of its moment: compare neighbours, not distant rows)."""
    lines = ["| run | width × layers | training length | steps | learning rate, schedule | needle / MQAR / copy share "
             "of training rows | Llama needle accuracy | Llama MQAR accuracy |", "|---|---|---|---|---|---|---|---|"]
    for path, data in sorted(zip(opts["files"], datas), key=lambda x: x[1]["provenance"]["utc"]):
        st, sm = data["meta"]["setting"], data["summary"]
        copy = st.get("copy_fraction") or 0
        mqar = round(max(0.0, 1 - st["needle_fraction"] - copy), 3)
        lines.append(f"| {os.path.basename(path).removesuffix('.json')} | {st['hidden_size']} × {st['num_hidden_layers']} | "
                     f"{st['train_length']} | {st['steps']:,} | {st['lr']:g}, {st.get('schedule') or 'cosine'} | "
                     f"{st['needle_fraction']:g} / {mqar:g} / {copy:g} | "
                     f"{sm['needle_accuracy']['llama']['mean']:.2f} | {sm['mqar_accuracy']['llama']['mean']:.2f} |")
    return lines


def headline(report: dict) -> tuple[str, str]:
    """The README's results row (scripts/doc_tables.py finds it by this script's name): in how many seeds each model
    learned needle retrieval, in how many it got there before the Llama of the same seed, and what 4-bit logits cost
    the runs that learned MQAR."""
    metrics = retrieval_metrics(report)
    needle = metrics[next(k for k in metrics if k.startswith("needle accuracy, trained"))]
    seeds = sorted({r["seed"] for r in report["runs"]})
    params = report["runs"][0]["params"]
    learned = ", ".join(f"{LABELS[m]} {sum(v >= 0.9 for v in _seeds_of(report, m, needle).values())}/{len(seeds)}"
                        for m in MODELS)
    reach = lambda r: steps_to(r["curves"], "needle", 0.9)  # noqa: E731  (censored: past the end where never)
    llama = _seeds_of(report, "llama", reach)
    sooner = ", ".join(f"{LABELS[m]} {sum(v < llama[s] for s, v in _seeds_of(report, m, reach).items() if s in llama)}"
                       f"/{len(seeds)}" for m in MODELS if m != "llama")

    def acc(tag):
        return lambda r: r["lowbit"]["accuracy"][tag]["mqar"]["accuracy"]

    lost = []
    for m in MODELS:
        values = [acc("none")(r) - acc("logits/tensor/4")(r) for r in report["runs"]
                  if r["model"] == m and acc("none")(r) >= 0.9]
        lost.append(f"{LABELS[m]} {statistics.mean(values):.2f}" if values else f"{LABELS[m]} –")
    return (f"Retrieval with distractors and low-bit attention, trained from scratch ({round(params / 1000)}k "
            f"parameters, {len(seeds)} paired seeds, CPU)",
            f"needle retrieval learned (accuracy ≥ 0.9 at trained lengths) in {learned} seeds, sooner than the Llama "
            f"in {sooner}; MQAR accuracy lost with 4-bit attention logits (runs that learned it): {', '.join(lost)}")


# ----------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train DIFF V1, DIFF V2 and a parameter-matched Llama on synthetic multi-needle retrieval (distractors "
        "sharing the key's prefix) and MQAR, paired seeds; evaluate accuracy over context lengths and needle counts, "
        "the attention lens, and low-bit attention (logits or q/k quantised to 8/6/4 bits). Resumable. Flags left unset "
        "take the --preset value.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default",
                   help="default (1 CPU thread, <= 2 CPU-hours for 3 models x 3 seeds), gpu (larger, 5 seeds), smoke (seconds).")
    p.add_argument("--models", default=",".join(MODELS), help=f"Comma-separated subset of {MODELS}. Default: all.")
    p.add_argument("--seeds", help="Comma-separated seeds (data, order and initialisation; paired across models).")
    p.add_argument("--out", help="Output folder. Default: benchmarks/results/retrieval_lowbit (smoke: .../retrieval_lowbit_smoke).")
    for name, kind, text in (
        ("hidden-size", int, "Model width E."), ("num-hidden-layers", int, "Layers."),
        ("num-attention-heads", int, "Query heads of width head_dim (the Llama's; V1/V2 have half as many differential heads)."),
        ("num-key-value-heads", int, "Key/value heads (even, for V1)."), ("head-dim", int, "Width d of one query/key head."),
        ("intermediate-size", int, "MLP width of the Llama and V1 (V2's is widened to match parameters)."),
        ("train-length", int, "Longest training sequence in tokens (needle sequences are 32..this long)."),
        ("batch-size", int, "Sequences per step."), ("steps", int, "Optimiser steps."),
        ("warmup", int, "Linear warm-up steps."), ("lr", float, "Peak learning rate (AdamW)."),
        ("schedule", str, "After the warm-up: cosine (decay to zero at the last step) or constant."),
        ("needle-fraction", float, "Share of training sequences that are multi-needle."),
        ("copy-fraction", float, "Share of training sequences that are a random sequence repeated (induction data); the rest are MQAR."),
        ("train-needles", str, "Needle counts of training sequences, comma-separated."),
        ("train-queries", int, "Queries per training needle sequence (at most its needle count; each answer is a target)."),
        ("train-pairs", str, "MQAR pair counts of training sequences (those that fit in --train-length)."),
        ("eval-lengths", str, "Held-out needle context lengths in tokens (longer than --train-length tests extrapolation)."),
        ("eval-needles", str, "Held-out needle counts."), ("eval-depths", str, "Depths of the queried needle (0..1)."),
        ("eval-samples", int, "Held-out needle sequences per (length, count, depth) cell."),
        ("eval-pairs", str, "Held-out MQAR pair counts."), ("mqar-samples", int, "Held-out MQAR sequences per pair count."),
        ("lowbit-samples", int, "Low-bit needle sequences per (needle count, depth) cell, at the trained length (MQAR: twice as many per pair count, the two largest trained counts that fit)."),
        ("lowbit-bits", str, "Bit widths of the low-bit evaluation."),
        ("lens-examples", int, "Needle prompts the attention lens averages over."),
        ("eval-every", int, "Validate every N steps (curves)."), ("threads", int, "torch.set_num_threads."),
        ("stop-held", int, "Stop a run once needle and MQAR validation accuracy have been 0.9 or more at this many "
                           "validations in a row (0: train every step)."),
        ("device", str, "torch device (cpu, cuda)."),
    ):
        p.add_argument(f"--{name}", type=kind, help=text)
    p.add_argument("--no-analysis", dest="analysis", action="store_false",
                   help="Accuracy only: no low-bit evaluation, activation statistics or lens (calibration runs).")
    p.add_argument("--no-resume", dest="resume", action="store_false",
                   help="Retrain every (seed, model) even if results.json holds it under the same setting.")
    p.add_argument("--no-plots", dest="plots", action="store_false",
                   help="Write results.json and results.md only (grids of many folders).")
    p.add_argument("--progress", action="store_true", help="Print the validation curve while training.")
    p.add_argument("--plot-with", nargs="+", default=[], metavar="RESULTS_JSON",
                   help="Other results files of the same setting (seeds run in parallel with another --out): the plots "
                        "show their runs too (results.json keeps this folder's own runs).")
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
    for key in ("steps", "batch_size", "train_length", "train_queries", "eval_every", "eval_samples", "mqar_samples", "lowbit_samples",
                "lens_examples", "threads"):
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
    return {k: getattr(args, k) for k in SETTING_KEYS} | {k: getattr(args, k) for k in OPTIONAL_SETTING_KEYS
                                                          if getattr(args, k)}


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
    report = {"meta": meta, "summary": summaries(runs),
              "runs": [runs[k] for k in sorted(runs, key=lambda k: (k[1], MODELS.index(k[0])))]}
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
    configs = build_configs(vocab_size, args.hidden_size, args.num_hidden_layers, args.num_attention_heads,
                            args.num_key_value_heads, args.head_dim, args.intermediate_size,
                            max(_ints(args.eval_lengths)))
    meta = {"setting": setting, "setting_id": sid, "vocab_size": vocab_size, "preset": args.preset,
            "machine": harness.machine_info(args.threads),
            "tokens_per_run": args.steps * args.batch_size * args.train_length}
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
            curves = train(model, data["batches"], data["val"], args.lr, args.warmup, args.eval_every, args.device,
                           args.progress, args.schedule, args.stop_held)
            with harness.trace_code():  # evaluation is short beside training: traced whole
                result = {"model": name, "seed": seed, "params": sum(p.numel() for p in model.parameters()),
                          "curves": curves, "eval": evaluate_retrieval(model, data["evals"])}
                if args.analysis:
                    result["lowbit"] = evaluate_lowbit(model, data["evals"], _ints(args.lowbit_bits))
                    result["lens"] = evaluate_lens(model, data["evals"]["lens"])
            result["cpu_s"], result["wall_s"] = time.process_time() - cpu0, time.time() - wall0
            runs[(name, seed)] = result
            trained.append((name, seed))
            save(results_path, runs, meta, argv, earlier)
            ev = result["eval"]
            by_length = ", ".join(f"{k}: {v['accuracy']:.2f}" for k, v in ev["needle"]["by_length"].items())
            print(f"seed {seed} {name}: {result['params']:,} params, train {curves['train_cpu_s']:.0f} cpu-s, total "
                  f"{result['cpu_s']:.0f} cpu-s / {result['wall_s']:.0f} s; needle acc {ev['needle']['overall']['accuracy']:.3f} "
                  f"(by length {by_length}); "
                  f"MQAR acc {ev['mqar']['overall']['accuracy']:.3f}", flush=True)
            del model
    if trained or earlier is None:
        report = save(results_path, runs, meta, argv, earlier)
    else:  # nothing new: the file and its provenance stay as the runs that made them wrote them
        with open(results_path) as f:
            report = json.load(f)
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write(markdown_tables(report))
    plots = ["curves.png", "accuracy_vs_length.png"] + (["accuracy_vs_bits.png", "attention_shares.png"] if args.analysis else [])
    if args.plot_with:
        others = []
        for path in args.plot_with:
            with open(path) as f:
                others.append(json.load(f))
        joined = combined([report, *others])  # the same setting, no run twice (else a named error)
        runs = {(r["model"], r["seed"]): r for r in joined["runs"]}
    if args.plots and runs and (trained or args.plot_with or not all(os.path.exists(os.path.join(args.out, p)) for p in plots)):
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
