"""vLLM throughput of a DIFF V2 upcycle against its source Llama, in the same vLLM.

    .venv-vllm/bin/python benchmarks/bench_vllm.py                       # SmolLM2-135M-Instruct and its V2 upcycle
    .venv-vllm/bin/python benchmarks/bench_vllm.py --smoke               # tiny random Llama + upcycle, seconds of work

Both models are loaded once, each in its own ``vllm.LLM`` (engines in their own processes; an idle engine uses ~1% of a
core), float32, vLLM's defaults otherwise (prefix caching and chunked prefill on; ``--compile`` keeps torch.compile,
which costs minutes of start-up on CPU, so it is off unless asked). Each model runs on vLLM's native implementation
(``auto``: vLLM's Llama, and for the V2 the package's vLLM plugin model, difftransformer/vllm_model.py) or on vLLM's
Transformers backend (``transformers``): ``--llama-impl`` and ``--diff-impl`` choose.

A measurement is one ``LLM.generate`` call of C requests (C = each ``--concurrency``): C distinct random prompts of
``--prompt-len`` tokens (drawn anew for every repetition, so the prefix cache never serves them) and ``--new-tokens``
greedy tokens each (EOS ignored). Reported: output tokens/s = C·new_tokens / wall time of the call, and the ratio of
the V2's time to the Llama's (above 1: V2 slower; the goal is at most 1.10). Repetitions are interleaved (the order of
the two models alternates), after one untimed warm-up call per model and concurrency; medians and the spread
(IQR / median, benchmarks/harness.py; the files written before the harness took quartiles by the "inclusive" method)
are reported, with the V2's FLOP floor: its matmul FLOPs over the Llama's for one request's prompt and
generated tokens (``generation_flops`` in bench.py), the ratio an engine that is bound by arithmetic cannot beat. The
greedy outputs of the two models are compared too (the upcycle is exact, so they agree except where float32 rounding
flips a near-tie).

Writes ``benchmarks/results/vllm_<name>.json`` (``--smoke``: into a temporary folder) and, where matplotlib is
installed, a PNG beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: `benchmarks.*` needs the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from benchmarks.bench import generation_flops  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GOAL = 1.10  # the V2 upcycle's goal: at most 1.10x the Llama's time (docs/serving.md)


def _example():
    spec = importlib.util.spec_from_file_location("serve_smollm2", ROOT / "examples" / "serve_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_random_pair(workdir: Path) -> tuple[Path, Path]:
    """A tiny random Llama (head_dim 32, vLLM's CPU kernels need >= 32) and its V2 upcycle, for --smoke."""
    llama, v2 = workdir / "tiny-llama", workdir / "tiny-diff-v2"
    if not (llama / "config.json").is_file():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
        LlamaForCausalLM(config).save_pretrained(llama)
    if not (v2 / "config.json").is_file():
        _example().upcycle_v2(llama, v2)
    return llama, v2


def run(args) -> dict:
    import torch
    import vllm
    from vllm.inputs import TokensPrompt

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_vllm_"))
    if args.smoke:
        llama, v2 = tiny_random_pair(workdir)
    else:
        example = _example()
        llama, v2 = example.prepare_llama(workdir), example.prepare_v2(workdir)
    common = dict(dtype="float32", max_model_len=args.prompt_len + args.new_tokens + 16, seed=0,
                  enforce_eager=not args.compile, skip_tokenizer_init=True)
    started = time.perf_counter()
    llms = {
        "llama": vllm.LLM(model=str(llama), model_impl=args.llama_impl, **common),
        "diff_v2": vllm.LLM(model=str(v2), model_impl=args.diff_impl, trust_remote_code=args.diff_impl == "transformers",
                            **common),
    }
    startup_s = time.perf_counter() - started
    configs = {name: llm.llm_engine.model_config.hf_config for name, llm in llms.items()}
    flop_floor = (generation_flops(configs["diff_v2"], args.prompt_len, args.new_tokens)
                  / generation_flops(configs["llama"], args.prompt_len, args.new_tokens))
    print(f"FLOP floor of the V2 (its matmul FLOPs over the Llama's for {args.prompt_len}+{args.new_tokens} tokens): "
          f"{flop_floor:.3f}", flush=True)
    vocab = llms["llama"].llm_engine.model_config.get_vocab_size()
    params = vllm.SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)

    def prompts(seed: int, count: int):
        gen = torch.Generator().manual_seed(seed)
        return [TokensPrompt(prompt_token_ids=torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist())
                for _ in range(count)]

    def timed(name: str, batch) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = llms[name].generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outs)
        return elapsed, [list(o.outputs[0].token_ids) for o in outs]

    results = []
    seed = 1000
    for c in args.concurrency:
        for name in llms:  # warm-up
            timed(name, prompts(seed, c))
        seed += 1
        times = {name: [] for name in llms}
        same = total = 0
        for rep in range(args.reps):
            batch = prompts(seed, c)
            seed += 1
            order = list(llms) if rep % 2 == 0 else list(reversed(llms))
            outputs = {}
            for name in order:
                elapsed, outputs[name] = timed(name, batch)
                times[name].append(elapsed)
            same += sum(a == b for a, b in zip(outputs["llama"], outputs["diff_v2"], strict=True))
            total += c
        row = {"concurrency": c, "identical_outputs": f"{same}/{total}"}
        for name, ts in times.items():
            stats = harness.summarize(ts)
            row[name] = {"seconds": ts, "median_s": stats["median"], "spread": stats["spread"],
                         "output_tokens_per_s": c * args.new_tokens / stats["median"]}
        row["time_ratio"] = row["diff_v2"]["median_s"] / row["llama"]["median_s"]
        row["flop_floor"] = flop_floor
        row["meets_goal"] = row["time_ratio"] <= GOAL
        results.append(row)
        print(f"C={c:3d}  llama {row['llama']['output_tokens_per_s']:8.1f} tok/s  diff_v2 "
              f"{row['diff_v2']['output_tokens_per_s']:8.1f} tok/s  time ratio {row['time_ratio']:.3f}  "
              f"(spread {row['llama']['spread']:.2f} / {row['diff_v2']['spread']:.2f}, identical {row['identical_outputs']})",
              flush=True)

    import transformers

    return {
        "benchmark": "bench_vllm", "goal_time_ratio": GOAL, "smoke": args.smoke,
        "models": {"llama": str(llama), "diff_v2": str(v2), "llama_impl": args.llama_impl,
                   "diff_impl": args.diff_impl},
        "settings": {"concurrency": args.concurrency, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "reps": args.reps, "compile": args.compile, "dtype": "float32",
                     "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                     "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")},
        "startup_s_both": startup_s,
        "machine": harness.cpu_info() | {"python": platform.python_version(), "torch": torch.__version__,
                                         "vllm": vllm.__version__, "transformers": transformers.__version__,
                                         "load_avg_start": os.getloadavg()},
        "results": results,
    }


def write_chart(report: dict, path: Path) -> bool:
    try:
        plt = harness.pyplot()
    except ImportError:
        return False
    rows = report["results"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    xs = range(len(rows))
    for j, (name, color) in enumerate((("llama", "tab:gray"), ("diff_v2", "tab:green"))):
        ax.bar([x + (j - 0.5) * 0.38 for x in xs], [r[name]["output_tokens_per_s"] for r in rows], 0.38, color=color, label=name)
    for x, r in zip(xs, rows):
        ax.annotate(f"×{r['time_ratio']:.2f}", (x, max(r["llama"]["output_tokens_per_s"], r["diff_v2"]["output_tokens_per_s"])),
                    ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(xs), [f"{r['concurrency']} requests" for r in rows])
    ax.set_ylabel("output tokens/s (median)")
    impl = {"auto": "native", "transformers": "Transformers backend"}
    models = report["models"]  # files written before --diff-impl existed ran the V2 on the Transformers backend
    ax.set_title(f"vLLM {report['machine']['vllm']} CPU, float32, {report['settings']['prompt_len']}+"
                 f"{report['settings']['new_tokens']} tokens, {'compiled' if report['settings']['compile'] else 'eager'}; "
                 f"×: V2 time / Llama time\nLlama: {impl[models['llama_impl']]}, "
                 f"V2: {impl[models.get('diff_impl', 'transformers')]}"
                 + (f"; V2's FLOP floor ×{rows[0]['flop_floor']:.3f}" if "flop_floor" in rows[0] else ""), fontsize=9)
    ax.legend()
    fig.tight_layout()
    harness.save_figure(fig, path)
    return True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=None, help="folder of the model folders (kept; default: a new temporary folder)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32], help="requests per generate call")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=64, help="generated tokens per request")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per model and concurrency (medians)")
    p.add_argument("--compile", action="store_true", help="keep vLLM's torch.compile (default: enforce_eager)")
    p.add_argument("--llama-impl", choices=("auto", "transformers"), default="auto",
                   help="vLLM implementation of the Llama: auto = vLLM's native Llama, transformers = its Transformers backend")
    p.add_argument("--diff-impl", choices=("auto", "transformers"), default="auto",
                   help="vLLM implementation of the V2: auto = the package's native vLLM model (its vLLM plugin), "
                   "transformers = vLLM's Transformers backend with the folder's remote code")
    p.add_argument("--smoke", action="store_true", help="tiny random Llama and its upcycle, concurrency 2, 4 tokens, 1 repetition")
    p.add_argument("--name", default=None, help="result file name: benchmarks/results/vllm_<name>.json (default: smollm2, or smoke)")
    p.add_argument("--out-dir", type=Path, default=None, help="where the JSON and PNG go (default: benchmarks/results; "
                   "a temporary folder with --smoke)")
    args = p.parse_args(argv)
    if args.smoke:
        args.concurrency, args.prompt_len, args.new_tokens, args.reps = [2], 16, 4, 1
    if min(args.concurrency) < 1 or args.prompt_len < 1 or args.new_tokens < 1 or args.reps < 1:
        p.error("--concurrency, --prompt-len, --new-tokens and --reps must be positive")
    args.name = args.name or ("smoke" if args.smoke else "smollm2")
    args.out_dir = args.out_dir or (Path(tempfile.mkdtemp(prefix="bench_vllm_out_")) if args.smoke else RESULTS)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    report = run(args)
    path = args.out_dir / f"vllm_{args.name}.json"
    harness.write_json(path, report, "bench_vllm.py", argv, indent=2)
    print(f"wrote {path}")
    if write_chart(report, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":  # vLLM spawns its engine processes: nothing may start at import
    sys.exit(main())
