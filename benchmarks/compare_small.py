"""Small-scale comparison: DIFF V1, DIFF V2 and a parameter-matched Llama, trained identically on CPU.

The Differential Transformer paper (Ye et al., arXiv 2410.05258) trains 3B-parameter models on 1T tokens and
reports lower language-modelling loss, better key-information retrieval and less "attention noise" for
differential attention. This script runs the same comparison at toy scale on the embedded corpus
(:mod:`difftransformer.research.data`, Python standard-library sources, byte-level BPE) mixed with the synthetic
retrieval tasks of :mod:`difftransformer.research.probes`, so that the claims can be checked end to end on one CPU:

1. three models with the same width, depth, query/key-value heads and head width (``--hidden-size`` ...):
   ``v1`` (DIFF V1: H = heads/2 differential heads of width 2d; parameter-matched with the Llama by construction,
   plus 4·d λ and 2·d subln weights per layer), ``v2`` (DIFF V2: o_proj is H·d wide, so the MLP is widened to
   match the Llama's parameter count, see :func:`build_configs`) and ``llama`` (transformers' LlamaForCausalLM);
2. the same data in the same order, the same optimiser, schedule and seeds for every model (``--seed``);
3. validation loss curves on the held-out corpus split and answer-only loss on held-out retrieval examples;
4. after training: probe accuracy (needle-in-a-haystack, multi-query associative recall, in-context learning with
   shuffled demonstrations; multiple choice by candidate log-likelihood), and attention-to-answer / attention-noise
   shares of the needle prompts (:func:`difftransformer.research.analysis.lens_on_examples`; differential maps for
   V1/V2, softmax maps for the Llama; positive-mass shares, see :mod:`difftransformer.research.analysis`).

Writes ``results.json``, ``results.md`` (tables, the exact command), ``loss_curves.png``, ``shares.png`` and one
accuracy heatmap per model and probe into ``--out`` (runs: docs/reports/2026-11-23-small-comparison.md). Presets
(``--size``): ``default`` (about 17 min of training per model with one thread, about an hour for all three), ``reduced``
(~5–8 min per model with one thread on a busy machine) and ``smoke`` (seconds; used by the tests). Every
flag overrides its preset value.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shlex
import sys
import time

import torch

# `python benchmarks/compare_small.py` (from the repository root) runs as `python -m benchmarks.compare_small`: the
# imports below need the root on sys.path, where `python -m` puts it.
if __name__ == "__main__" and not __package__:
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.compare_small", *sys.argv[1:]])

from benchmarks import harness  # noqa: E402
from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM  # noqa: E402
from difftransformer.research import analysis, data, probes

MODELS = ("v1", "v2", "llama")

# Shared by all three models in a run. `steps` x `batch_size` x `seq_len` is the token budget.
SIZES = {
    "default": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=688,
        seq_len=256,
        batch_size=16,
        steps=600,
        warmup=60,
        eval_every=50,
        eval_blocks=64,
        probe_samples=8,
        lens_examples=10,
        lr=2e-3,
        retrieval_fraction=0.5,
    ),
    "reduced": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        seq_len=128,
        batch_size=16,
        steps=700,
        warmup=70,
        eval_every=100,
        eval_blocks=32,
        probe_samples=6,
        lens_examples=10,
        lr=3e-3,
        retrieval_fraction=0.5,
    ),
    "smoke": dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        seq_len=96,
        batch_size=4,
        steps=4,
        warmup=1,
        eval_every=2,
        eval_blocks=4,
        probe_samples=1,
        lens_examples=2,
        lr=2e-3,
        retrieval_fraction=0.25,
    ),
}


# ----------------------------------------------------------------------------------------------- models


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def build_configs(
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    intermediate_size: int,
    seq_len: int,
    tokenizer=None,
) -> dict:
    """Configs of the three models, parameter-matched.

    V1 with the Llama's ``Hq, Hkv, d`` has the same projections (docs/model.md, "Configuration": DIFF with H heads vs a
    Transformer with 2H), plus λ and subln. V2's ``o_proj`` reads ``H·d = Hq·d/2`` features, ``E·Hq·d/2`` fewer weights
    than the Llama's, and ``lambda_proj`` adds ``E·Hq/2``; the MLP is widened by the nearest whole number of units
    (3·E weights each) so that the totals match to within one unit.
    """
    from transformers import LlamaConfig

    special = {}
    if tokenizer is not None:
        special = dict(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max(2 * seq_len, 512),
        tie_word_embeddings=False,
        **special,
    )
    heads = num_attention_heads // 2
    v2_extra = round(heads * (head_dim - 1) / 3)  # (E·H·d − E·H) / (3·E)
    return {
        "v1": DiffTransformerConfig(diff_version=1, intermediate_size=intermediate_size, **common),
        "v2": DiffTransformerConfig(diff_version=2, intermediate_size=intermediate_size + v2_extra, **common),
        "llama": LlamaConfig(intermediate_size=intermediate_size, **common),
    }


def build_model(name: str, config, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)  # same init stream for every model
    model = DiffTransformerForCausalLM(config) if name in ("v1", "v2") else LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return model


# ----------------------------------------------------------------------------------------------- data


def retrieval_examples(tokenizer, seq_len: int, count: int, seed: int, split: str) -> list[probes.ProbeExample | str]:
    """About ``count`` synthetic retrieval sequences that fit in ``seq_len`` tokens: half needle-in-a-haystack
    prompts (filler from the corpus ``split``), a quarter full MQAR sequences, a quarter ICL episodes.

    NIAH and ICL items are :class:`~difftransformer.research.probes.ProbeExample` (prompt + answer); MQAR items are
    whole strings (every query answered). Lengths vary over the allowed range; depths cover [0, 1] in steps of 0.1.
    """
    depths = [i / 10 for i in range(11)]
    lengths = sorted({max(48, int(seq_len * f)) - 8 for f in (0.4, 0.6, 0.8, 1.0)})
    niah_n = max(1, count // 2)
    per_cell = max(1, math.ceil(niah_n / (len(lengths) * len(depths))))
    niah = probes.needle_in_haystack(
        tokenizer, lengths, depths, num_needles=4, samples=per_cell, seed=seed, filler_split=split
    )
    random.Random(seed).shuffle(niah)
    max_pairs = max(4, (seq_len - 5 * 12) // 9)
    pair_counts = sorted({max(4, max_pairs // 2), max_pairs})
    mqar_n = max(1, count // 4)
    mqar = probes.mqar_sequences(
        probes.associative_recall(
            tokenizer,
            pair_counts,
            samples=max(1, math.ceil(mqar_n / len(pair_counts))),
            seed=seed,
            num_candidates=min(8, min(pair_counts)),
        )
    )
    max_demos = max(4, (seq_len - 24) // 16)
    icl_n = max(1, count - len(niah[:niah_n]) - len(mqar[:mqar_n]))
    demo_counts = sorted({4, max_demos // 2 if max_demos >= 8 else 4, max_demos})
    icl = probes.icl_shuffled(
        tokenizer, demo_counts, num_orders=2, samples=max(1, math.ceil(icl_n / (2 * len(demo_counts)))), seed=seed
    )
    random.Random(seed + 1).shuffle(icl)
    return niah[:niah_n] + mqar[:mqar_n] + icl[:icl_n]


def encode_rows(tokenizer, items, seq_len: int, answer_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows ``(N, seq_len)`` and labels for retrieval items, right-padded (labels −100 on padding).

    ``<s> prompt answer </s>``; with ``answer_only`` only the answer tokens carry labels (retrieval loss). Items
    longer than ``seq_len`` are dropped (the generators size them to fit; tokenisation varies slightly).
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows, labels = [], []
    for item in items:
        if isinstance(item, str):
            ids, lab_from = tokenizer(item)["input_ids"] + [tokenizer.eos_token_id], 0
        else:
            prompt = tokenizer(item.prompt)["input_ids"]
            ids = prompt + tokenizer(item.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            lab_from = len(prompt) if answer_only else 0
        if len(ids) > seq_len:
            continue
        lab = [-100] * lab_from + ids[lab_from:]
        if answer_only:
            lab[-1] = -100  # the answer only, not the end-of-sequence token
        rows.append(ids + [pad] * (seq_len - len(ids)))
        labels.append(lab + [-100] * (seq_len - len(ids)))
    if not rows:
        raise ValueError(f"no retrieval item fits in seq_len={seq_len} tokens; raise --seq-len.")
    return torch.tensor(rows), torch.tensor(labels)


def make_training_data(
    tokenizer,
    seq_len: int,
    batch_size: int,
    steps: int,
    retrieval_fraction: float,
    seed: int,
    eval_blocks: int,
    max_corpus_chars: int | None = None,
) -> dict:
    """Everything the three models are trained and validated on, identical for all of them.

    Returns ``train_batches``: a list of ``steps`` ``(input_ids, labels)`` batches (``round(batch_size ·
    retrieval_fraction)`` retrieval rows, the rest corpus blocks), ``val_corpus`` (held-out corpus blocks) and
    ``val_retrieval`` (held-out retrieval rows, answer-only labels, validation-split filler, another seed).
    """
    if not 0.0 <= retrieval_fraction <= 1.0:
        raise ValueError(f"`retrieval_fraction` must be in [0, 1], got {retrieval_fraction}.")
    n_ret = round(batch_size * retrieval_fraction)
    n_corpus = batch_size - n_ret
    blocks = data.build_blocks(tokenizer, data.corpus_texts("train", max_corpus_chars), seq_len)
    val_blocks = data.build_blocks(tokenizer, data.corpus_texts("validation"), seq_len, eval_blocks)
    ret_ids, ret_labels = (None, None)
    if n_ret:
        items = retrieval_examples(tokenizer, seq_len, n_ret * steps, seed, "train")
        ret_ids, ret_labels = encode_rows(tokenizer, items, seq_len)
    val_items = retrieval_examples(tokenizer, seq_len, max(8, eval_blocks), seed + 10_000, "validation")
    val_ret = encode_rows(tokenizer, [x for x in val_items if not isinstance(x, str)], seq_len, answer_only=True)
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        parts_ids, parts_lab = [], []
        if n_corpus:
            idx = torch.randint(len(blocks), (n_corpus,), generator=gen)
            parts_ids.append(blocks[idx])
            parts_lab.append(blocks[idx])
        if n_ret:
            idx = torch.randint(len(ret_ids), (n_ret,), generator=gen)
            parts_ids.append(ret_ids[idx])
            parts_lab.append(ret_labels[idx])
        batches.append((torch.cat(parts_ids), torch.cat(parts_lab)))
    return {
        "train_batches": batches,
        "val_corpus": val_blocks,
        "val_retrieval": val_ret,
        "corpus_blocks": len(blocks),
        "retrieval_rows": 0 if ret_ids is None else len(ret_ids),
    }


# ----------------------------------------------------------------------------------------------- train / eval


@torch.no_grad()
def mean_loss(model, ids: torch.Tensor, labels: torch.Tensor, batch_size: int) -> float:
    """Token-weighted mean cross-entropy of ``labels`` (−100 ignored)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(ids), batch_size):
        x, y = ids[i : i + batch_size], labels[i : i + batch_size]
        logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
        target = y[:, 1:]
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum"
        ).item()
        count += int((target != -100).sum())
    model.train()
    return total / max(count, 1)


def train_model(
    model,
    batches,
    val_corpus,
    val_retrieval,
    lr: float,
    warmup: int,
    eval_every: int,
    batch_size: int,
    weight_decay: float = 0.1,
    progress: bool = True,
) -> dict:
    """AdamW (β = 0.9, 0.95, as the paper), cosine schedule with linear warm-up, gradient clipping at 1.0.

    Returns the curves: training loss per step, validation losses at step 0, every ``eval_every`` steps and at
    the end, and the wall time.
    """
    from transformers import get_cosine_schedule_with_warmup

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, warmup, len(batches))
    curves = {"train_step": [], "train_loss": [], "eval_step": [], "val_loss": [], "val_retrieval_loss": []}

    def evaluate_now(step):
        curves["eval_step"].append(step)
        curves["val_loss"].append(mean_loss(model, val_corpus, val_corpus, batch_size))
        curves["val_retrieval_loss"].append(mean_loss(model, *val_retrieval, batch_size))

    model.train()
    start = time.time()
    evaluate_now(0)
    iterator = enumerate(batches, 1)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, total=len(batches), desc=type(model).__name__, leave=False)
    for step, (ids, labels) in iterator:
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        curves["train_step"].append(step)
        curves["train_loss"].append(loss.item())
        if step % eval_every == 0 or step == len(batches):
            if curves["eval_step"][-1] != step:
                evaluate_now(step)
    curves["train_seconds"] = time.time() - start
    model.eval()
    return curves


def probe_sets(tokenizer, seq_len: int, samples: int, seed: int) -> dict[str, list[probes.ProbeExample]]:
    """Held-out probe examples (validation filler, seed ``seed``), sized to the trained context ``seq_len``."""
    max_pairs = max(4, (seq_len - 5 * 12) // 9)
    max_demos = max(4, (seq_len - 24) // 16)
    return {
        "niah": probes.needle_in_haystack(
            tokenizer, (seq_len // 2, seq_len - 8), num_needles=4, samples=samples, seed=seed
        ),
        "mqar": probes.associative_recall(
            tokenizer,
            sorted({max(4, max_pairs // 2), max_pairs}),
            samples=samples,
            seed=seed,
            num_candidates=min(8, max(4, max_pairs // 2)),
        ),
        "icl": probes.icl_shuffled(tokenizer, sorted({4, max_demos}), num_orders=4, samples=samples, seed=seed),
    }


def evaluate_model(model, tokenizer, probe_examples: dict, lens_examples: int, out_dir: str, name: str) -> dict:
    """Probe accuracy tables (and heatmap PNGs) and the lens' attention shares on needle prompts."""
    result = {"probes": {}}
    for probe, examples in probe_examples.items():
        records = probes.evaluate(model, tokenizer, examples)
        table = probes.accuracy_table(records)
        probes.plot_accuracy_heatmap(
            table, os.path.join(out_dir, f"probe_{probe}_{name}.png"), f"{name} {probe}: accuracy {table.overall:.2f}"
        )
        entry = {
            "accuracy": table.overall,
            "table": table.to_json(),
            "markdown": probes.format_table(table),
            "chance": sum(1 / len(e.candidates) for e in examples) / len(examples),
        }
        if probe == "icl":
            orders = probes.order_accuracies(records)
            entry["order_accuracy"] = orders
            entry["order_spread"] = max(orders.values()) - min(orders.values())
        result["probes"][probe] = entry
    # Lens on the longest needle prompts, one per depth and sample, at most `lens_examples`.
    niah = probe_examples["niah"]
    longest = max(e.context_length for e in niah)
    chosen = [e for e in niah if e.context_length == longest][:lens_examples]
    lensed = analysis.lens_on_examples(model, tokenizer, chosen)
    shares = lensed.shares
    kind = "diff" if "diff" in shares else "softmax"
    result["lens"] = {
        "kind": kind,
        "examples": len(chosen),
        "per_layer": {k: s.mean(1).tolist() for k, s in shares.items()},  # (L, 3): answer, noise, other
        "answer_mean": float(shares[kind][..., 0].mean()),
        "noise_mean": float(shares[kind][..., 1].mean()),
        "answer_best_head": float(shares[kind][..., 0].max()),
        "noise_of_best_head": float(shares[kind][..., 1].flatten()[shares[kind][..., 0].flatten().argmax()]),
    }
    # One heatmap: the first of those prompts, last layer, every head (answer span outlined).
    enc = tokenizer(chosen[0].prompt, return_offsets_mapping=True)
    answer = analysis.char_span_to_tokens(enc["offset_mapping"], *chosen[0].evidence_span)
    question = analysis.char_span_to_tokens(enc["offset_mapping"], chosen[0].question_start, len(chosen[0].prompt))[0]
    report = analysis.lens(
        model, torch.tensor(enc["input_ids"]), answer, (0, question), tokenizer=tokenizer, model_name=name
    )
    num_layers, num_heads = report.shares[kind].shape[:2]
    analysis.plot_heatmaps(
        report,
        os.path.join(out_dir, f"heatmap_{name}.png"),
        layers=[num_layers - 1],
        heads=list(range(min(num_heads, 4))),
        last_rows=24,
    )
    if lensed.lambdas is not None:  # V1: λ per layer; V2: mean over heads of the per-token mean / std of λ
        lam = lensed.lambdas
        result["lambdas"] = (
            lam.tolist()
            if lam.dim() == 1
            else {"mean": lam[..., 0].mean(1).tolist(), "std": lam[..., 1].mean(1).tolist()}
        )
    return result


# ----------------------------------------------------------------------------------------------- report


def plot_curves(results: dict, path: str) -> str:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for name, r in results.items():
        c = r["curves"]
        w = max(1, len(c["train_loss"]) // 25)  # moving average for readability
        smooth = [
            sum(c["train_loss"][max(0, i - w + 1) : i + 1]) / len(c["train_loss"][max(0, i - w + 1) : i + 1])
            for i in range(len(c["train_loss"]))
        ]
        axes[0].plot(c["train_step"], smooth, label=name)
        axes[1].plot(c["eval_step"], c["val_loss"], marker="o", label=name)
        axes[2].plot(c["eval_step"], c["val_retrieval_loss"], marker="o", label=name)
    for ax, title in zip(
        axes,
        ("training loss (moving average)", "validation loss (held-out corpus)", "retrieval answer loss (held-out)"),
    ):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    harness.save_figure(fig, path)
    return path


def plot_lens(results: dict, path: str) -> str:
    plt = harness.pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, r in results.items():
        for kind, per_layer in r["eval"]["lens"]["per_layer"].items():
            style = "-" if kind in ("diff", "softmax") else ":"
            for ax, i in zip(axes, (0, 1)):
                ax.plot(range(len(per_layer)), [x[i] for x in per_layer], style, marker="o", label=f"{name} {kind}")
    for ax, title in zip(axes, ("attention to answer", "attention noise")):
        ax.set_title(f"{title}: needle prompts, last token, mean over heads", fontsize=9)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    harness.save_figure(fig, path)
    return path


LABELS = {"v1": "DIFF V1", "v2": "DIFF V2", "llama": "Llama"}
SUMMARY_COLUMNS = [
    "model",
    "params",
    "train s",
    "val loss (corpus)",
    "retrieval answer loss",
    "NIAH acc",
    "MQAR acc",
    "ICL acc (order spread)",
    "attn to answer",
    "attn noise",
    "best head: answer / noise",
]


def summary_table(runs: list[dict]) -> list[str]:
    """The summary table of one or more runs' ``results`` (a seed column when there are several); the lowest
    validation loss of each run in bold."""
    seeds = len(runs) > 1
    lines = [
        "| " + ("seed | " if seeds else "") + " | ".join(SUMMARY_COLUMNS) + " |",
        "|" + "---|" * (len(SUMMARY_COLUMNS) + seeds),
    ]
    for run in runs:
        results, seed = run["results"], run["meta"]["args"]["seed"]
        best = min(r["curves"]["val_loss"][-1] for r in results.values())
        for name, r in results.items():
            p, lens, val = r["eval"]["probes"], r["eval"]["lens"], r["curves"]["val_loss"][-1]
            val_text = f"**{val:.3f}**" if val == best and len(results) > 1 else f"{val:.3f}"
            lines.append(
                ("| " + f"{seed} " if seeds else "") + f"| {LABELS.get(name, name)} | {r['params']:,} "
                f"| {r['curves']['train_seconds']:.0f} | {val_text} | {r['curves']['val_retrieval_loss'][-1]:.3f} | "
                f"{p['niah']['accuracy']:.2f} | {p['mqar']['accuracy']:.2f} | {p['icl']['accuracy']:.2f} "
                f"({p['icl']['order_spread']:.2f}) | {lens['answer_mean']:.3f} | {lens['noise_mean']:.3f} | "
                f"{lens['answer_best_head']:.3f} / {lens['noise_of_best_head']:.3f} |"
            )
    return lines


def markdown_report(results: dict, meta: dict) -> str:
    lines = [
        "## Small-scale comparison: DIFF V1 vs DIFF V2 vs Llama",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Setting: {meta['setting']}",
        "",
        *summary_table([{"results": results, "meta": meta}]),
    ]
    chance = {k: v["chance"] for k, v in next(iter(results.values()))["eval"]["probes"].items()}
    lines += ["", "Chance accuracy: " + ", ".join(f"{k} {v:.2f}" for k, v in chance.items()) + "."]
    for name, r in results.items():
        lines += ["", f"### {name}", ""]
        for probe, entry in r["eval"]["probes"].items():
            lines += [entry["markdown"], ""]
        lam = r["eval"].get("lambdas")
        if isinstance(lam, list):
            lines += ["λ per layer: " + ", ".join(f"{x:.3f}" for x in lam), ""]
        elif lam:
            lines += [
                "λ per layer (per-token mean ± std, averaged over heads, needle prompts): "
                + ", ".join(f"{m:.3f} ± {s:.3f}" for m, s in zip(lam["mean"], lam["std"])),
                "",
            ]
        lines += [
            "validation loss by step: "
            + ", ".join(f"{s}: {v:.3f}" for s, v in zip(r["curves"]["eval_step"], r["curves"]["val_loss"]))
        ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train DIFF V1, DIFF V2 and a parameter-matched Llama with identical data, steps and seeds on the "
        "embedded corpus plus synthetic retrieval, on CPU; report validation loss curves, probe accuracy and "
        "attention-noise shares with plots. Flags left unset take the --size preset's value.",
    )
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="default",
        help="Preset: default (~17 min of training per model, 1 thread), reduced (~5-8 min/model, 1 thread), smoke "
        "(seconds, for tests). Default: default.",
    )
    p.add_argument(
        "--models", default=",".join(MODELS), help=f"Comma-separated subset of {MODELS}. Default: all three."
    )
    p.add_argument("--out", default=None, help="Output folder. Default: benchmarks/results/compare_small_<size>.")
    p.add_argument("--hidden-size", type=int, help="Model width E.")
    p.add_argument("--num-hidden-layers", type=int, help="Number of layers.")
    p.add_argument(
        "--num-attention-heads",
        type=int,
        help="Query heads Hq of width head_dim (the Llama's heads; V1/V2 have Hq/2 differential heads).",
    )
    p.add_argument("--num-key-value-heads", type=int, help="Key/value heads Hkv (even, for V1).")
    p.add_argument("--head-dim", type=int, help="Width d of one query/key head.")
    p.add_argument(
        "--intermediate-size", type=int, help="MLP width of the Llama and V1 (V2's is widened to match parameters)."
    )
    p.add_argument("--seq-len", type=int, help="Training sequence length in tokens (probes are sized to it).")
    p.add_argument("--batch-size", type=int, help="Sequences per step.")
    p.add_argument("--steps", type=int, help="Optimiser steps.")
    p.add_argument("--warmup", type=int, help="Linear warm-up steps of the cosine schedule.")
    p.add_argument("--lr", type=float, help="Peak learning rate (AdamW, betas 0.9/0.95, weight decay 0.1).")
    p.add_argument("--eval-every", type=int, help="Validate every N steps.")
    p.add_argument(
        "--eval-blocks", type=int, help="Held-out corpus blocks (and about as many retrieval rows) per validation."
    )
    p.add_argument(
        "--retrieval-fraction",
        type=float,
        help="Share of each batch that is synthetic retrieval rows (NIAH, MQAR, ICL).",
    )
    p.add_argument("--probe-samples", type=int, help="Probe samples per (length, depth) cell.")
    p.add_argument("--lens-examples", type=int, help="Needle prompts the lens averages over.")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=4096,
        help="Tokenizer vocabulary (difftransformer.research.data.get_tokenizer). Default 4096.",
    )
    p.add_argument(
        "--max-corpus-chars",
        type=int,
        default=None,
        help="Cap on training corpus characters (default: the whole train split; smoke: 300000).",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="Seed of data order, retrieval sets and every model's init. Default 0."
    )
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (the machine is shared). Default 1.")
    p.add_argument(
        "--save-models",
        default=None,
        help="Folder to save the trained models (and tokenizer) into, one subfolder per model. Default: not saved.",
    )
    p.add_argument("--no-progress", action="store_true", help="No tqdm progress bars.")
    return p


def resolve_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for key, value in SIZES[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = f"benchmarks/results/compare_small_{args.size}"
    if args.size == "smoke" and args.max_corpus_chars is None:
        args.max_corpus_chars = 300_000
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad or not args.models:
        raise SystemExit(f"--models must be a comma-separated subset of {MODELS}, got {bad or args.models}.")
    for key in (
        "steps",
        "batch_size",
        "seq_len",
        "eval_every",
        "eval_blocks",
        "probe_samples",
        "lens_examples",
        "threads",
    ):
        if getattr(args, key) <= 0:
            raise SystemExit(f"--{key.replace('_', '-')} must be a positive integer, got {getattr(args, key)}.")
    return args


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    tokenizer = data.get_tokenizer(args.vocab_size)
    configs = build_configs(
        len(tokenizer),
        args.hidden_size,
        args.num_hidden_layers,
        args.num_attention_heads,
        args.num_key_value_heads,
        args.head_dim,
        args.intermediate_size,
        args.seq_len,
        tokenizer,
    )
    t0 = time.time()
    train = make_training_data(
        tokenizer,
        args.seq_len,
        args.batch_size,
        args.steps,
        args.retrieval_fraction,
        args.seed,
        args.eval_blocks,
        args.max_corpus_chars,
    )
    probe_examples = probe_sets(tokenizer, args.seq_len, args.probe_samples, args.seed + 20_000)
    data_seconds = time.time() - t0
    results = {}
    for name in args.models:
        with harness.trace_code():  # what the result ran: the model, its training and its evaluation
            model = build_model(name, configs[name], args.seed)
            curves = train_model(
                model,
                train["train_batches"],
                train["val_corpus"],
                train["val_retrieval"],
                args.lr,
                args.warmup,
                args.eval_every,
                args.batch_size,
                progress=not args.no_progress,
            )
            t1 = time.time()
            evaluation = evaluate_model(model, tokenizer, probe_examples, args.lens_examples, args.out, name)
        results[name] = {
            "params": _count(model),
            "curves": curves,
            "eval": evaluation,
            "eval_seconds": time.time() - t1,
        }
        if args.save_models:  # e.g. to run the lens CLI on the trained models afterwards
            model.save_pretrained(os.path.join(args.save_models, name))
            tokenizer.save_pretrained(os.path.join(args.save_models, name))
        print(
            f"{name}: {_count(model):,} params, {curves['train_seconds']:.0f}s, val loss {curves['val_loss'][-1]:.3f}, "
            f"NIAH {evaluation['probes']['niah']['accuracy']:.2f}, MQAR "
            f"{evaluation['probes']['mqar']['accuracy']:.2f}, "
            f"ICL {evaluation['probes']['icl']['accuracy']:.2f}, answer/noise {evaluation['lens']['answer_mean']:.3f}/"
            f"{evaluation['lens']['noise_mean']:.3f}",
            flush=True,
        )
    tokens = args.steps * args.batch_size * args.seq_len
    meta = {
        "command": "python benchmarks/compare_small.py " + " ".join(shlex.quote(a) for a in args.argv),
        "setting": (
            f"{args.steps} steps x {args.batch_size} x {args.seq_len} tokens = {tokens / 1e6:.2f}M training tokens "
            f"({args.retrieval_fraction:.0%} synthetic retrieval rows), width {args.hidden_size}, "
            f"{args.num_hidden_layers} layers, {args.num_attention_heads} query / {args.num_key_value_heads} KV heads "
            f"of width {args.head_dim}, vocab {len(tokenizer)}, seed {args.seed}, torch threads {args.threads}; data "
            f"preparation {data_seconds:.0f}s"
        ),
        "args": {k: v for k, v in vars(args).items() if k != "argv"},
        "corpus_blocks": train["corpus_blocks"],
        "retrieval_rows": train["retrieval_rows"],
    }
    plot_curves(results, os.path.join(args.out, "loss_curves.png"))
    plot_lens(results, os.path.join(args.out, "shares.png"))
    harness.write_json(
        os.path.join(args.out, "results.json"), {"meta": meta, "results": results}, "compare_small.py", args.argv
    )
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write(markdown_report(results, meta))
    return {"meta": meta, "results": results}


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = resolve_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    main()
