"""Grouped differential attention (GDA) against the same model written in duplicated form, in transformers.

A GDA model (``num_noise_heads``: r signal heads share one noise head) and its duplicated form
(``difftransformer.convert.gda_to_duplicated``: a plain r = 1 model whose every signal head has its own copy of its
noise head's query rows) compute the same function; the GDA model computes each noise map once instead of r times.
This script times both, for V1 and V2, on the same random weights, ``attn_implementation="sdpa"`` (V1: the blocked CPU
kernel for prompts and training, the packed decode kernel; V2: one SDPA call, the pair decode kernel):

* prefill: one prompt forward with a fresh ``DynamicCache`` and ``logits_to_keep=1`` (as ``generate`` runs it);
* decode: greedy ``generate`` with a dynamic cache, only the decode steps timed;
* train: forward + backward + ``AdamW.step``.

The workloads are benchmarks/bench.py's. All four models run interleaved, the order rotated every round, after a
warm-up; the report has per model the median and spread, and per version the ratio of the medians (GDA / duplicated:
below 1 is faster) and the median and quartiles of the per-round ratios (a round in which the whole machine slows
down cancels in its own ratio). Default shape: Motif-2-12.7B's head topology scaled down (10 query heads = 2 groups of
4 signal + 1 noise, r = 4, head_dim 64; V1: 4 KV heads, 2 groups; V2: 2 KV heads).

    python benchmarks/bench_gda.py --json benchmarks/results/gda_t1cpu.json
    python benchmarks/bench_gda.py --smoke

``--vllm`` (in the vLLM venv) times the same four models served by the package's native vLLM model instead: each is
saved to a folder and loaded in its own ``vllm.LLM`` (float32, eager, vLLM's defaults otherwise: prefix caching and
chunked prefill on); a measurement is one ``LLM.generate`` call of C requests (C = each ``--concurrency``) of
``--prompt-len`` random tokens (drawn anew each round, so the prefix cache never serves them) and ``--new-tokens``
greedy tokens, timed by the CPU time of the engine's processes (benchmarks/bench_vllm.py's clock), the rounds
interleaved and rotated as above. The greedy outputs of each GDA model and its duplicated form are compared too.

    .venv-vllm/bin/python benchmarks/bench_gda.py --vllm --json benchmarks/results/gda_vllm_cpu_fp32.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# `python benchmarks/bench_gda.py` (from the repository root) runs as `python -m benchmarks.bench_gda`: the imports
# below need the root on sys.path, where `python -m` puts it.
if __name__ == "__main__" and not __package__:
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.bench_gda", *sys.argv[1:]])

from benchmarks import harness  # noqa: E402
from benchmarks.bench import decode_workload, prefill_workload, train_workload  # noqa: E402

VERSIONS = (1, 2)
FORMS = ("gda", "duplicated")


def vllm_code_record() -> dict:
    """The code record of a ``--vllm`` run: the package's vLLM model and the package files it imports, whole (vLLM's
    engine runs them in processes a trace does not see), and this script's GDA models (traced)."""
    record = harness.module_record(harness.package_imports("difftransformer/vllm_model.py"))
    record["digests"] |= harness.code_record()["digests"]
    return record


@dataclass
class Shape:
    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1376
    num_hidden_layers: int = 4
    num_attention_heads: int = 10
    num_noise_heads: int = 2
    head_dim: int = 64
    kv_heads_v1: int = 4
    kv_heads_v2: int = 2


@dataclass
class Plan:
    prefill: tuple = ((1, 1024), (4, 256))
    decode_batches: tuple = (1, 8)
    prompt_len: int = 256
    new_tokens: int = 33
    train: tuple = ((2, 512),)
    reps: int = 9
    warmup: int = 1
    threads: int = 1
    clock: str = "cpu"


def build_models(shape: Shape, seed: int = 0) -> dict[str, torch.nn.Module]:
    """``v{1,2}_gda`` (random weights) and ``v{1,2}_duplicated`` (the same model written in duplicated form)."""
    from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
    from difftransformer.convert import gda_to_duplicated

    models = {}
    for version in VERSIONS:
        config = DiffTransformerConfig(
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_hidden_layers,
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.kv_heads_v1 if version == 1 else shape.kv_heads_v2,
            num_noise_heads=shape.num_noise_heads,
            head_dim=shape.head_dim,
            diff_version=version,
            max_position_embeddings=4096,
            pad_token_id=0,
            eos_token_id=None,
            bos_token_id=None,
        )
        torch.manual_seed(seed)
        gda = DiffTransformerForCausalLM(config).eval()
        gda.set_attn_implementation("sdpa")
        gda.generation_config.eos_token_id = None
        models[f"v{version}_gda"] = gda
        models[f"v{version}_duplicated"] = gda_to_duplicated(gda).eval()
    return models


def workloads(plan: Plan) -> list[tuple[str, dict, callable]]:
    items = [
        (
            f"prefill {b}x{t}",
            {"kind": "prefill", "batch": b, "tokens": t},
            lambda m, b=b, t=t: prefill_workload(m, b, t),
        )
        for b, t in plan.prefill
    ]
    items += [
        (
            f"decode b{b}",
            {"kind": "decode", "batch": b, "prompt_len": plan.prompt_len, "new_tokens": plan.new_tokens},
            lambda m, b=b: decode_workload(m, b, plan.prompt_len, plan.new_tokens),
        )
        for b in plan.decode_batches
    ]
    items += [
        (f"train {b}x{t}", {"kind": "train", "batch": b, "tokens": t}, lambda m, b=b, t=t: train_workload(m, b, t))
        for b, t in plan.train
    ]
    return items


def run(shape: Shape, plan: Plan, progress: bool = True) -> dict:
    torch.set_num_threads(plan.threads)
    harness.set_clock(plan.clock)
    with harness.trace_code():  # building the models is part of the code a result ran
        models = build_models(shape)
    rows = []
    for name, spec, make in workloads(plan):
        runs = {key: make(model) for key, model in models.items()}
        stats = harness.run_interleaved(runs, plan.reps, plan.warmup)
        for model in models.values():
            model.eval()  # train_workload leaves eval mode set; the next workload's models start alike
        for version in VERSIONS:
            gda, dup = stats[f"v{version}_gda"], stats[f"v{version}_duplicated"]
            ratio, quartiles = harness.paired(gda["samples"], dup["samples"])
            rows.append(
                {
                    "workload": name,
                    **spec,
                    "diff_version": version,
                    "gda": gda,
                    "duplicated": dup,
                    "ratio": gda["median"] / dup["median"],
                    "paired": [ratio, quartiles],
                }
            )
            if progress:
                print(
                    f"{name:>16} V{version}: GDA {gda['median'] * 1e3:9.2f} ms, duplicated {dup['median'] * 1e3:9.2f} "
                    f"ms, ratio {rows[-1]['ratio']:.3f}, paired {ratio:.3f} [{quartiles[0]:.3f}-{quartiles[1]:.3f}]",
                    flush=True,
                )
    return {"machine": harness.machine_info(plan.threads), "shape": asdict(shape), "plan": asdict(plan), "rows": rows}


def run_vllm(
    shape: Shape,
    concurrency=(8, 32),
    prompt_len: int = 128,
    new_tokens: int = 64,
    reps: int = 5,
    workdir: str | None = None,
    progress: bool = True,
) -> dict:
    """The four models on the package's native vLLM model (see the module docstring)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine: four engines share the machine
    import vllm
    from vllm.inputs import TokensPrompt

    from benchmarks.bench_vllm import cpu_seconds, engine_processes

    root = Path(workdir or tempfile.mkdtemp(prefix="bench_gda_vllm_"))
    folders = {}
    with harness.trace_code():
        models = build_models(shape)
    for name, model in models.items():
        folders[name] = root / name
        model.save_pretrained(folders[name])
    common = dict(
        dtype="float32",
        max_model_len=prompt_len + new_tokens + 16,
        seed=0,
        enforce_eager=True,
        skip_tokenizer_init=True,
    )
    llms = {name: vllm.LLM(model=str(folder), **common) for name, folder in folders.items()}
    processes = {name: engine_processes(llm) for name, llm in llms.items()}
    params = vllm.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)

    def prompts(seed: int, count: int):
        gen = torch.Generator().manual_seed(seed)
        return [
            TokensPrompt(prompt_token_ids=torch.randint(0, shape.vocab_size, (prompt_len,), generator=gen).tolist())
            for _ in range(count)
        ]

    def timed(name: str, batch) -> tuple[float, list[list[int]]]:
        before = cpu_seconds(processes[name])
        outs = llms[name].generate(batch, params, use_tqdm=False)
        return cpu_seconds(processes[name]) - before, [list(o.outputs[0].token_ids) for o in outs]

    rows, seed = [], 1000
    for c in concurrency:
        batch = [prompts(seed, c)]  # the warm-up's; each round draws its own (new_round)
        seed += 1

        def new_round(rep: int, c: int = c, first: int = seed, batch: list = batch) -> None:
            batch[0] = prompts(first + rep, c)

        timings = harness.interleave(
            {name: lambda name=name, batch=batch: timed(name, batch[0]) for name in llms},
            reps,
            warmup=1,
            new_round=new_round,
            trace=False,
        )  # vLLM's engine runs in other processes
        seed += reps
        samples = {name: [seconds for seconds, _ in runs] for name, runs in timings.items()}
        same = {
            version: sum(
                a == b
                for (_, x), (_, y) in zip(timings[f"v{version}_gda"], timings[f"v{version}_duplicated"])
                for a, b in zip(x, y)
            )
            for version in VERSIONS
        }
        for version in VERSIONS:
            gda, dup = (harness.summarize(samples[f"v{version}_{form}"]) for form in FORMS)
            ratio, quartiles = harness.paired(samples[f"v{version}_gda"], samples[f"v{version}_duplicated"])
            rows.append(
                {
                    "workload": f"vLLM {c} x ({prompt_len} + {new_tokens})",
                    "kind": "serve",
                    "concurrency": c,
                    "diff_version": version,
                    "gda": gda,
                    "duplicated": dup,
                    "ratio": gda["median"] / dup["median"],
                    "paired": [ratio, quartiles],
                    "identical_outputs": f"{same[version]}/{c * reps}",
                }
            )
            if progress:
                print(
                    f"C={c:3d} V{version}: GDA {gda['median']:.2f} CPU s, duplicated {dup['median']:.2f} CPU s, ratio "
                    f"{rows[-1]['ratio']:.3f}, paired {ratio:.3f} [{quartiles[0]:.3f}-{quartiles[1]:.3f}], identical "
                    f"outputs {rows[-1]['identical_outputs']}",
                    flush=True,
                )
    import transformers

    return {
        "machine": harness.machine_info(1) | {"vllm": vllm.__version__, "transformers": transformers.__version__},
        "shape": asdict(shape),
        "vllm": {
            "concurrency": list(concurrency),
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "reps": reps,
            "clock": "cpu",
            "dtype": "float32",
            "enforce_eager": True,
        },
        "rows": rows,
    }


def format_table(report: dict) -> str:
    """Markdown, one row per workload and version: transformers runs in ms, ``--vllm`` runs in CPU seconds with the
    count of identical greedy outputs."""
    vllm = "vllm" in report
    scale, unit = (1.0, "CPU s") if vllm else (1e3, "ms")
    head = [
        ("requests" if vllm else "workload"),
        "version",
        f"GDA ({unit})",
        f"duplicated ({unit})",
        "GDA / duplicated",
        "paired [quartiles]",
    ] + (["identical outputs"] if vllm else [])
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|---:|---|" + ("---:|" if vllm else "")]
    for row in report["rows"]:
        p, (q1, q3) = row["paired"][0], row["paired"][1]
        cells = [row["workload"], f"V{row['diff_version']}"]
        cells += [f"{row[form]['median'] * scale:.2f} ±{row[form]['spread']:.0%}" for form in FORMS]
        cells += [f"{row['ratio']:.3f}", f"{p:.3f} [{q1:.3f}-{q3:.3f}]"] + ([row["identical_outputs"]] if vllm else [])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--reps", type=int, default=Plan.reps, help="timed rounds per workload (all four models each round)")
    p.add_argument("--warmup", type=int, default=Plan.warmup, help="untimed runs of every model before the rounds")
    p.add_argument("--threads", type=int, default=Plan.threads, help="torch.set_num_threads")
    p.add_argument(
        "--clock",
        default=Plan.clock,
        choices=("cpu", "wall"),
        help="cpu: process CPU time (with one thread it "
        "leaves out the time other processes hold the core: shared machines); wall: elapsed time",
    )
    p.add_argument("--json", default=None, help="write the report (with its provenance) to this file")
    p.add_argument("--smoke", action="store_true", help="tiny shape and workloads, one round (a test runs it)")
    p.add_argument(
        "--vllm",
        action="store_true",
        help="serve the four models with the package's native vLLM model "
        "(run in the vLLM venv) and time LLM.generate calls instead",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32], help="--vllm: requests per generate call")
    p.add_argument("--prompt-len", type=int, default=128, help="--vllm: prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=64, help="--vllm: generated tokens per request")
    p.add_argument("--workdir", default=None, help="--vllm: where the model folders go (default: a temporary folder)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu sums the CPU time of all threads (OpenMP spin-waits included): use --threads 1")
    shape, plan = Shape(), Plan(reps=args.reps, warmup=args.warmup, threads=args.threads, clock=args.clock)
    if args.smoke:
        shape = Shape(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16)
        plan = Plan(
            prefill=((1, 16),),
            decode_batches=(2,),
            prompt_len=8,
            new_tokens=4,
            train=((2, 8),),
            reps=1,
            warmup=0,
            threads=1,
            clock=args.clock,
        )
    if args.vllm:
        if args.smoke:
            shape = Shape(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=32)
            report = run_vllm(
                shape, concurrency=(2,), prompt_len=8, new_tokens=4, reps=1, workdir=args.workdir, progress=False
            )
        else:
            report = run_vllm(shape, tuple(args.concurrency), args.prompt_len, args.new_tokens, args.reps, args.workdir)
    else:
        report = run(shape, plan, progress=not args.smoke)
    print(format_table(report))
    if args.json:
        if args.vllm:  # the engines ran the package's vLLM model in their own processes: its modules are the record
            report["provenance"] = harness.provenance("bench_gda.py", argv, code=vllm_code_record())
        report = harness.write_json(args.json, report, "bench_gda.py", argv)
    return report


if __name__ == "__main__":
    main()
