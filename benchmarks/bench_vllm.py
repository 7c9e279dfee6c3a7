"""vLLM throughput of the DIFF V2 and V1 upcycles against their source Llama, in the same vLLM, in one run.

    .venv-vllm/bin/python benchmarks/bench_vllm.py                       # SmolLM2-135M-Instruct, its V2 and V1 upcycles
    .venv-vllm/bin/python benchmarks/bench_vllm.py --models llama,diff_v2  # only some of them (llama always)
    .venv-vllm/bin/python benchmarks/bench_vllm.py --smoke               # tiny random Llama + upcycles, seconds of work

Every model is loaded once, each in its own ``vllm.LLM`` (engines in their own processes; an idle engine uses ~1% of a
core), float32, vLLM's defaults otherwise (prefix caching and chunked prefill on; ``--compile`` keeps torch.compile,
which costs minutes of start-up on CPU, so it is off unless asked). The Llama runs on vLLM's native Llama (or, with
``--llama-impl transformers``, its Transformers backend); the DIFF models on the package's native vLLM model
(difftransformer/vllm_model.py, registered by its vLLM plugin) or, with ``--diff-impl transformers``, V2 on vLLM's
Transformers backend (which refuses V1).

A measurement is one ``LLM.generate`` call of C requests (C = each ``--concurrency``): C distinct random prompts of
``--prompt-len`` tokens (drawn anew for every repetition, so the prefix cache never serves them) and ``--new-tokens``
greedy tokens each (EOS ignored). Each call is timed twice: its wall time, and its CPU time (user + system seconds of
the model's engine processes, vLLM's engine core and its worker, plus this process's: the work the call did, without
the time other processes held the cores; vLLM's CPU worker runs its model on one bound core, so on an otherwise idle
machine the two agree up to the pipeline's overlap). ``--clock`` picks which one the ratios and goals below use (both
are stored). Reported per model: output tokens/s = C·new_tokens / wall time of the call; per DIFF model: the time ratio
to the Llama (median over median; above 1: slower) and the paired ratio (median and quartiles of the per-round ratios:
a round in which the whole machine slows down cancels in its own ratio), for both clocks. Repetitions are interleaved
(every round runs every model, the order rotated by one each round) after one untimed warm-up call per model and
concurrency; medians and the spread (IQR / median, benchmarks/harness.py) are reported.

FLOP floors (``flop_floor``): a DIFF model's matmul FLOPs over the Llama's for one request's prompt and generated tokens
(``generation_flops`` in bench.py: projections, MLP, LM head and the attention of V1's math, ``(A1 − λA2)·V`` with one
``2d``-wide product per differential head, which costs what a Llama with the same ``Hq``, ``d`` costs). V1 also gets
``padded_flop_floor``: the same count for the padded single call the native model runs, whose ``Hq`` queries are
``2d`` wide (scores over the zero halves too) and each multiply the ``2d``-wide value: ``4·Hq·d`` extra FLOPs per
layer, token and visible key (:func:`padded_call_extra_flops`). Goals: V2 at most ``GOAL`` × the Llama's time; V1 at
most ``V1_GOAL_OVER_FLOOR`` × the time its (math) FLOP floor predicts, i.e. ``time_ratio / flop_floor`` ≤ 1.15.
The greedy outputs of V2 and Llama are compared too (that upcycle is exact, so they agree except where float32
rounding flips a near-tie; V1's upcycle is approximate).

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

# `python benchmarks/bench_vllm.py` (from the repository root) runs as `python -m benchmarks.bench_vllm`: the imports
# below need the root on sys.path, where `python -m` puts it.
if __name__ == "__main__" and not __package__:
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.bench_vllm", *sys.argv[1:]])

ROOT = Path(__file__).resolve().parent.parent

from benchmarks import harness  # noqa: E402
from benchmarks.bench import generation_flops  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GOAL = 1.10  # the V2 upcycle's goal: at most 1.10x the Llama's time (docs/serving.md)
V1_GOAL_OVER_FLOOR = 1.15  # V1's goal: at most 1.15x the time its FLOP floor predicts relative to the Llama
MODELS = ("llama", "diff_v2", "diff_v1")


def _example():
    spec = importlib.util.spec_from_file_location("serve_smollm2", ROOT / "examples" / "serve_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_random_models(workdir: Path) -> dict[str, Path]:
    """A tiny random Llama (head_dim 32, vLLM's CPU kernels need >= 32) and its V2 and V1 upcycles, for --smoke."""
    llama = workdir / "tiny-llama"
    if not (llama / "config.json").is_file():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=1024,
        )
        LlamaForCausalLM(config).save_pretrained(llama)
    folders = {"llama": llama}
    for version in (2, 1):
        folder = folders[f"diff_v{version}"] = workdir / f"tiny-diff-v{version}"
        if not (folder / "config.json").is_file():
            _example().upcycle(llama, folder, version)
    return folders


def engine_processes(llm) -> list:
    """The processes of an ``LLM``'s engine (vLLM's engine core; its workers are their children)."""
    import psutil

    manager = llm.llm_engine.engine_core.resources.engine_manager
    return [psutil.Process(p.pid) for p in manager.processes]


def cpu_seconds(processes) -> float:
    """User + system CPU seconds of ``processes``, their descendants and this process so far."""
    import psutil

    total = time.process_time()
    for proc in processes:
        for p in (proc, *proc.children(recursive=True)):
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
    return total


def padded_call_extra_flops(config, prompt_len: int, new_tokens: int) -> float:
    """The FLOPs V1's padded single call adds to ``generation_flops`` (V1's math) for one request: per layer, token and
    visible key, scores over ``2d`` instead of ``d`` (``2·Hq·d`` more) and ``Hq`` products ``A_c·[V1; V2]`` of width
    ``2d`` instead of ``H`` products ``(A1 − λA2)·V`` (``2·Hq·d`` more). Visible keys as in ``forward_flops``: the
    prompt's queries see ``(prompt_len + 1) / 2`` keys on average, generated token ``j`` sees ``prompt_len + j + 1``."""
    per_key = config.num_hidden_layers * 4 * config.num_attention_heads * config.head_dim
    visible = prompt_len * (prompt_len + 1) / 2 + sum(prompt_len + j + 1 for j in range(new_tokens - 1))
    return per_key * visible


def run(args) -> dict:
    import torch
    import vllm
    from vllm.inputs import TokensPrompt

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_vllm_"))
    with harness.trace_code():  # preparing the folders (the upcycles' conversion) is part of the code a result ran
        if args.smoke:
            folders = tiny_random_models(workdir)
        else:
            example = _example()
            folders = {
                "llama": example.prepare_llama(workdir),
                "diff_v2": example.prepare_v2(workdir),
                "diff_v1": example.prepare_v1(workdir),
            }
    folders = {name: folders[name] for name in args.models}
    common = dict(
        dtype="float32",
        max_model_len=args.prompt_len + args.new_tokens + 16,
        seed=0,
        enforce_eager=not args.compile,
        skip_tokenizer_init=True,
    )
    impls = {name: args.llama_impl if name == "llama" else args.diff_impl for name in folders}
    started = time.perf_counter()
    llms = {
        name: vllm.LLM(
            model=str(folder),
            model_impl=impls[name],
            trust_remote_code=impls[name] == "transformers" and name != "llama",
            **common,
        )
        for name, folder in folders.items()
    }
    startup_s = time.perf_counter() - started
    configs = {name: llm.llm_engine.model_config.hf_config for name, llm in llms.items()}
    base_flops = generation_flops(configs["llama"], args.prompt_len, args.new_tokens)
    floors = {}
    for name in llms:
        if name == "llama":
            continue
        flops = generation_flops(configs[name], args.prompt_len, args.new_tokens)
        floors[name] = {"flop_floor": flops / base_flops}
        if configs[name].diff_version == 1:
            extra = padded_call_extra_flops(configs[name], args.prompt_len, args.new_tokens)
            floors[name]["padded_flop_floor"] = (flops + extra) / base_flops
        print(
            f"FLOP floors of {name} over the Llama for {args.prompt_len}+{args.new_tokens} tokens: "
            + ", ".join(f"{k} {v:.3f}" for k, v in floors[name].items()),
            flush=True,
        )
    vocab = llms["llama"].llm_engine.model_config.get_vocab_size()
    params = vllm.SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)

    def prompts(seed: int, count: int):
        gen = torch.Generator().manual_seed(seed)
        return [
            TokensPrompt(prompt_token_ids=torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist())
            for _ in range(count)
        ]

    processes = {name: engine_processes(llm) for name, llm in llms.items()}

    def timed(name: str, batch) -> tuple[float, float, list[list[int]]]:
        c0, t0 = cpu_seconds(processes[name]), time.perf_counter()
        outs = llms[name].generate(batch, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - t0, cpu_seconds(processes[name]) - c0
        assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outs)
        return elapsed, cpu, [list(o.outputs[0].token_ids) for o in outs]

    names = list(llms)
    results = []
    seed = 1000
    for c in args.concurrency:
        batch = [prompts(seed, c)]  # the warm-up's; each round draws its own (new_round)
        seed += 1

        def new_round(rep: int, c: int = c, first: int = seed, batch: list = batch) -> None:
            batch[0] = prompts(first + rep, c)

        timings = harness.interleave(
            {name: lambda name=name, batch=batch: timed(name, batch[0]) for name in llms},
            args.reps,
            warmup=1,
            new_round=new_round,
            trace=False,
        )  # the engines run in other processes
        seed += args.reps
        times = {name: [elapsed for elapsed, _, _ in runs] for name, runs in timings.items()}
        cpu_times = {name: [cpu for _, cpu, _ in runs] for name, runs in timings.items()}
        same = total = 0
        if "diff_v2" in timings:
            for (_, _, llama_out), (_, _, v2_out) in zip(timings["llama"], timings["diff_v2"]):
                same += sum(a == b for a, b in zip(llama_out, v2_out, strict=True))
                total += c
        row = {"concurrency": c}
        if total:
            row["identical_outputs_v2"] = f"{same}/{total}"
        for name, ts in times.items():
            stats, cpu_stats = harness.summarize(ts), harness.summarize(cpu_times[name])
            row[name] = {
                "seconds": ts,
                "median_s": stats["median"],
                "spread": stats["spread"],
                "output_tokens_per_s": c * args.new_tokens / stats["median"],
                "cpu_seconds": cpu_times[name],
                "cpu_median_s": cpu_stats["median"],
                "cpu_spread": cpu_stats["spread"],
            }
        for name in floors:
            stats = row[name]
            stats["wall_time_ratio"] = stats["median_s"] / row["llama"]["median_s"]
            stats["wall_paired_ratio"], stats["wall_paired_quartiles"] = harness.paired(times[name], times["llama"])
            stats["cpu_time_ratio"] = stats["cpu_median_s"] / row["llama"]["cpu_median_s"]
            stats["cpu_paired_ratio"], stats["cpu_paired_quartiles"] = harness.paired(
                cpu_times[name], cpu_times["llama"]
            )
            for key in ("time_ratio", "paired_ratio", "paired_quartiles"):  # the ratios of the chosen clock
                stats[key] = stats[f"{args.clock}_{key}"]
            stats.update(floors[name])
            stats["over_flop_floor"] = stats["time_ratio"] / stats["flop_floor"]
            if configs[name].diff_version == 1:
                stats["goal"] = f"time_ratio / flop_floor <= {V1_GOAL_OVER_FLOOR}"
                stats["meets_goal"] = stats["over_flop_floor"] <= V1_GOAL_OVER_FLOOR
            else:
                stats["goal"] = f"time_ratio <= {GOAL}"
                stats["meets_goal"] = stats["time_ratio"] <= GOAL
        results.append(row)
        print(
            f"C={c:3d}  "
            + "  ".join(
                f"{n} {row[n]['output_tokens_per_s']:7.1f} tok/s (±{row[n]['spread'] * 100:.0f}%, "
                f"CPU ±{row[n]['cpu_spread'] * 100:.0f}%)"
                for n in names
            ),
            flush=True,
        )
        for name in floors:
            r = row[name]
            print(
                f"       {name}: wall time ratio {r['wall_time_ratio']:.3f}, CPU time ratio {r['cpu_time_ratio']:.3f}; "
                f"{args.clock}: {r['time_ratio']:.3f} (paired {r['paired_ratio']:.3f} "
                f"[{r['paired_quartiles'][0]:.3f}, {r['paired_quartiles'][1]:.3f}]), FLOP floor {r['flop_floor']:.3f}"
                + (f", padded-call floor {r['padded_flop_floor']:.3f}" if "padded_flop_floor" in r else "")
                + f", over floor {r['over_flop_floor']:.3f}, goal {'met' if r['meets_goal'] else 'MISSED'}",
                flush=True,
            )

    import transformers

    return {
        "benchmark": "bench_vllm",
        "goal_time_ratio_v2": GOAL,
        "goal_over_flop_floor_v1": V1_GOAL_OVER_FLOOR,
        "smoke": args.smoke,
        "models": {name: str(folder) for name, folder in folders.items()} | {"impl": impls},
        "configs": {
            name: {
                k: getattr(cfg, k, None)
                for k in (
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "num_hidden_layers",
                    "hidden_size",
                    "diff_version",
                )
            }
            for name, cfg in configs.items()
        },
        "settings": {
            "concurrency": args.concurrency,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "reps": args.reps,
            "compile": args.compile,
            "dtype": "float32",
            "clock": args.clock,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        },
        "startup_s_all": startup_s,
        "machine": harness.cpu_info()
        | {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "vllm": vllm.__version__,
            "transformers": transformers.__version__,
            "load_avg_start": os.getloadavg(),
        },
        "results": results,
    }


COLORS = {"llama": "tab:gray", "diff_v2": "tab:green", "diff_v1": "tab:blue"}


def format_table(report: dict) -> str:
    """Markdown: one row per concurrency; tokens/s ± spread per model, each DIFF model's time ratio (paired ratio and
    quartiles), its FLOP floors and, for V1, the ratio over its floor (``✗``: goal missed)."""
    rows = report["results"]
    names = [n for n in MODELS if n in rows[0]]
    diffs = [n for n in names if n != "llama"]
    clock = {"cpu": "CPU", "wall": "wall"}[report["settings"].get("clock", "wall")]
    head = ["requests"] + [f"{n} tok/s" for n in names]
    for n in diffs:
        head += [
            f"{n} {clock} time ratio (paired [quartiles])",
            f"{n} FLOP floor" + (" (padded call)" if n == "diff_v1" else ""),
        ]
        if n == "diff_v1":
            head.append("diff_v1 ratio / floor")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["concurrency"])] + [
            f"{r[n]['output_tokens_per_s']:.1f} ±{r[n]['spread'] * 100:.0f}%" for n in names
        ]
        for n in diffs:
            s = r[n]
            mark = "" if s["meets_goal"] or n == "diff_v1" else " ✗"
            cells.append(
                f"{s['time_ratio']:.2f}{mark} ({s['paired_ratio']:.2f} [{s['paired_quartiles'][0]:.2f}, "
                f"{s['paired_quartiles'][1]:.2f}])"
            )
            cells.append(
                f"{s['flop_floor']:.3f}" + (f" ({s['padded_flop_floor']:.3f})" if "padded_flop_floor" in s else "")
            )
            if n == "diff_v1":
                cells.append(f"{s['over_flop_floor']:.2f}" + ("" if s["meets_goal"] else " ✗"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_chart(report: dict, path: Path) -> bool:
    try:
        plt = harness.pyplot()
    except ImportError:
        return False
    rows = report["results"]
    names = [n for n in MODELS if n in rows[0]]
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    for j, name in enumerate(names):
        offsets = [x + (j - (len(names) - 1) / 2) * width for x in xs]
        ax.bar(offsets, [r[name]["output_tokens_per_s"] for r in rows], width, color=COLORS[name], label=name)
        if name != "llama":
            for x, r in zip(offsets, rows):
                ax.annotate(
                    f"×{r[name]['time_ratio']:.2f}",
                    (x, r[name]["output_tokens_per_s"]),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
    ax.set_xticks(list(xs), [f"{r['concurrency']} requests" for r in rows])
    ax.set_ylabel("output tokens/s (median)")
    settings = report["settings"]
    floors = "; ".join(
        f"{n} FLOP floor ×{rows[0][n]['flop_floor']:.3f}"
        + (f" (padded call ×{rows[0][n]['padded_flop_floor']:.3f})" if "padded_flop_floor" in rows[0][n] else "")
        for n in names
        if n != "llama"
    )
    ax.set_title(
        f"vLLM {report['machine']['vllm']} CPU, float32, {settings['prompt_len']}+{settings['new_tokens']} tokens, "
        f"{'compiled' if settings['compile'] else 'eager'}; ×: {settings.get('clock', 'wall')} time / "
        f"Llama's\n{floors}",
        fontsize=8,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    harness.save_figure(fig, path)
    return True


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workdir", type=Path, default=None, help="folder of the model folders (kept; default: a new temporary folder)"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32], help="requests per generate call")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=64, help="generated tokens per request")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per model and concurrency (medians)")
    p.add_argument("--compile", action="store_true", help="keep vLLM's torch.compile (default: enforce_eager)")
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="which time the ratios and goals use: the calls' CPU time (engine processes and this one; "
        "robust to other load on a shared machine) or wall time; both are stored",
    )
    p.add_argument(
        "--llama-impl",
        choices=("auto", "transformers"),
        default="auto",
        help="vLLM implementation of the Llama: auto = vLLM's native Llama, transformers = its Transformers backend",
    )
    p.add_argument(
        "--diff-impl",
        choices=("auto", "transformers"),
        default="auto",
        help="vLLM implementation of the DIFF models: auto = the package's native vLLM model (its vLLM plugin), "
        "transformers = vLLM's Transformers backend with the folder's remote code (V2 only)",
    )
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated, from {','.join(MODELS)}; llama (the baseline) is always included",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny random Llama and its upcycles, concurrency 2, 4 tokens, 1 repetition"
    )
    p.add_argument(
        "--name",
        default=None,
        help="result file name: benchmarks/results/vllm_<name>.json (default: smollm2, or smoke)",
    )
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where the JSON and PNG go (default: benchmarks/results; a temporary folder with --smoke)",
    )
    args = p.parse_args(argv)
    models = {m.strip() for m in args.models.split(",") if m.strip()} | {"llama"}
    if models - set(MODELS):
        p.error(f"--models: unknown {sorted(models - set(MODELS))}; allowed: {', '.join(MODELS)}")
    args.models = [m for m in MODELS if m in models]
    if args.diff_impl == "transformers" and "diff_v1" in args.models:
        p.error(
            "--diff-impl transformers: vLLM's Transformers backend refuses DIFF V1 (docs/serving.md); add --models "
            "llama,diff_v2"
        )
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
    # vLLM's engines run the model code in their own processes, which a trace does not see: the record is the package's
    # vLLM model and the package files it imports, whole, and the upcycling this script ran to prepare the folders.
    code = harness.module_record(harness.package_imports("difftransformer/vllm_model.py"))
    code["digests"] |= harness.code_record()["digests"]
    harness.write_json(path, report, "bench_vllm.py", argv, indent=2, code=code)
    print(f"wrote {path}")
    print(format_table(report))
    if write_chart(report, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":  # vLLM spawns its engine processes: nothing may start at import
    sys.exit(main())
