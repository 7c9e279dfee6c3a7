"""Where a training step's (or a decode's) time goes: per-operator CPU time, Llama against its upcycles.

``bench.py`` times whole steps; this script splits them with ``torch.profiler``. Each model (built as ``bench.py``
builds it, random weights) runs one warm-up step, then ``--reps`` rounds profile one step of every model, the order
rotated each round. ``--workload decode`` profiles instead the decode steps of ``bench.py``'s eager decode row
(greedy ``generate`` with a dynamic cache, ``--decode-batch`` sequences, the plan's prompt and new tokens; the
profiler starts when the prompt's forward has chosen the first token). An operator's time is its *self* CPU time
(time inside it, not inside the operators it calls), and the median over rounds is reported. Operators fall into
three groups:

* ``matmul``: ``aten::mm``, ``bmm``, ``addmm``, ``baddbmm`` (projections, MLP, LM head, and their gradients);
* ``attention``: the attention kernels (every operator whose name contains ``scaled_dot_product`` or ``flex``) and the
  autograd functions of kernels_difftransformer.py (their own Python time);
* ``other``: everything else (norms, rotary embeddings, the loss, the optimizer, copies, the differential combine);

and ``outside`` is the step's time in no operator (Python between the calls). V1's blocked kernel
(kernels_difftransformer.py) is written in torch operations: its matmuls count as ``matmul`` (``bmm``) and its
softmax arithmetic as ``other``, so for V1 the ``attention`` row holds only that kernel's own Python time.

The table gives each group's seconds and ratio to Llama beside the step's matmul-FLOP floor (``bench.forward_flops``),
then the operators whose time grows most. The profiler adds a few microseconds per operator, so the step times here
are somewhat above ``bench.py``'s; ratios of the large groups are what this script is for.

    python benchmarks/profile_train.py --preset smollm2 --reps 3 --json benchmarks/results/profile_train_smollm2_t1.json
    python benchmarks/profile_train.py --preset smollm2 --workload decode --models llama,upcycle_v2 --reps 7 --top 14 \
        --json benchmarks/results/profile_decode_smollm2_t1.json
    python benchmarks/profile_train.py --smoke --json ''   # tiny sizes, one round: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict, replace
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import bench, harness  # noqa: E402

GROUPS = ("matmul", "attention", "other")
MATMUL_OPS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm"}
ATTENTION_FUNCTIONS = ("CausalBlockAttention", "BlockedDifferentialAttention")


def op_group(name: str) -> str:
    """The group (one of GROUPS) of a profiler event's name."""
    if name in MATMUL_OPS:
        return "matmul"
    if "scaled_dot_product" in name or "flex" in name or name.startswith(ATTENTION_FUNCTIONS):
        return "attention"
    return "other"


_NO_PROFILER = SimpleNamespace(start=lambda: None, stop=lambda: None)  # what a warm-up run starts and stops


def profile_step(run) -> tuple[float, dict[str, float]]:
    """One step of ``run`` (from :func:`workload`) under the profiler → (step seconds, self seconds per op)."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    seconds = run(prof)
    ops = defaultdict(float)
    for event in prof.key_averages():
        ops[event.key] += event.self_cpu_time_total / 1e6
    return seconds, dict(ops)


def workload(name: str, model, batch: int, seq: int, plan: bench.Plan):
    """``run(profiler)``: one training step of ``batch × seq`` (``"train"``), or the decode steps of ``bench.py``'s
    eager decode row for ``batch`` sequences (``"decode"``), with ``profiler`` on while the step is timed; returns
    its seconds."""
    if name == "train":
        step = bench.train_workload(model, batch, seq)

        def run(prof):
            prof.start()
            seconds = step()
            prof.stop()
            return seconds
        return run

    def run(prof):
        seconds = bench.decode_workload(model, batch, plan.prompt_len, plan.new_tokens, on_first_token=prof.start)()
        prof.stop()
        return seconds
    return run


def flop_floor(name: str, config, base, seq: int, plan: bench.Plan) -> float:
    """The matmul-FLOP ratio of ``config``'s step to ``base``'s: the training forward, or the decode steps."""
    if name == "train":
        return bench.forward_flops(config, seq, seq) / bench.forward_flops(base, seq, seq)
    steps = [plan.prompt_len + j for j in range(plan.new_tokens - 1)]
    return (sum(bench.forward_flops(config, 1, 1, past=p) for p in steps)
            / sum(bench.forward_flops(base, 1, 1, past=p) for p in steps))


def profile_models(models: list[str], shape: bench.Shape, batch: int, seq: int, reps: int, name: str = "train",
                   plan: bench.Plan | None = None) -> dict:
    """``reps`` profiled rounds over ``models`` (order rotated) → per model: step times and per-op medians."""
    plan = plan or bench.Plan()
    configs, runs = {}, {}
    for kind in models:
        model = bench.build_model(kind, shape)
        configs[kind], runs[kind] = model.config, workload(name, model, batch, seq, plan)
        runs[kind](_NO_PROFILER)  # warm-up: first-call allocations, optimizer state
    samples = {kind: {"step": [], "ops": []} for kind in models}
    with tqdm(total=reps * len(models), desc="profile", file=sys.stderr) as bar:
        for r in range(reps):
            for kind in models[r % len(models):] + models[:r % len(models)]:
                step, ops = profile_step(runs[kind])
                samples[kind]["step"].append(step)
                samples[kind]["ops"].append(ops)
                bar.update()
    out = {}
    for kind, s in samples.items():
        names = set().union(*s["ops"])
        ops = {n: statistics.median(o.get(n, 0.0) for o in s["ops"]) for n in names}
        groups = {g: statistics.median(sum(v for n, v in o.items() if op_group(n) == g) for o in s["ops"])
                  for g in GROUPS}
        groups["outside"] = statistics.median(t - sum(o.values()) for t, o in zip(s["step"], s["ops"]))
        floor = flop_floor(name, configs[kind], configs[models[0]], seq, plan)
        out[kind] = {"step_s": s["step"], "step_median_s": statistics.median(s["step"]), "groups_s": groups,
                     "ops_s": dict(sorted(ops.items(), key=lambda kv: -kv[1])), "flop_floor": floor}
    return out


def format_table(result: dict, top: int) -> str:
    """Markdown: step and group seconds with ratios to the first model, then the ``top`` operators whose time grows most
    over the first model's in any other model."""
    models = list(result["models"])
    base = result["models"][models[0]]
    head = f"| | {models[0]} s | " + " | ".join(f"{m} s (×)" for m in models[1:]) + " |"
    lines = [head, "|" + "---|" * (len(models) + 1)]

    def cells(get):
        b = get(base)
        return f"{b:.3f} | " + " | ".join(f"{get(result['models'][m]):.3f} ({get(result['models'][m]) / b:.2f})"
                                         if b else f"{get(result['models'][m]):.3f}" for m in models[1:])

    lines.append("| step (median) | " + cells(lambda r: r["step_median_s"]) + " |")
    for g in (*GROUPS, "outside"):
        lines.append(f"| {g} | " + cells(lambda r, g=g: r["groups_s"][g]) + " |")
    lines.append("| matmul-FLOP floor of the step | 1 | "
                 + " | ".join(f"{result['models'][m]['flop_floor']:.2f}" for m in models[1:]) + " |")
    ops = {m: result["models"][m]["ops_s"] for m in models}
    growth = {n: max(ops[m].get(n, 0.0) - ops[models[0]].get(n, 0.0) for m in models[1:]) for n in set().union(*ops.values())}
    lines += ["", "| operator (group) | " + " | ".join(f"{m} s" for m in models) + " |", "|" + "---|" * (len(models) + 1)]
    for n in sorted(growth, key=lambda n: -growth[n])[:top]:
        lines.append(f"| `{n}` ({op_group(n)}) | " + " | ".join(f"{ops[m].get(n, 0.0):.3f}" for m in models) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=("smollm2",), default=None, help="smollm2: SmolLM2-135M's shape, models "
                   "llama,upcycle_v2,upcycle_v1, training 4x256 (default: bench.py's default shape and models)")
    p.add_argument("--models", default=None, help=f"comma-separated, the first is the baseline (allowed: "
                   f"{', '.join(bench.MODELS + bench.EXTRA_MODELS)})")
    p.add_argument("--workload", choices=("train", "decode"), default="train", help="what one profiled step is: a "
                   "training step (default), or the decode steps of bench.py's eager decode row")
    p.add_argument("--train-shape", default=None, help="BATCHxLENGTH (default: the preset's, else bench.py's)")
    p.add_argument("--decode-batch", type=int, default=1, help="sequences decoded together (--workload decode; default 1)")
    p.add_argument("--reps", type=int, default=3, help="profiled rounds; medians reported (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--top", type=int, default=12, help="operators listed, by their largest growth over the baseline (default 12)")
    p.add_argument("--smoke", action="store_true", help="bench.py's tiny smoke shape, one round (CI)")
    p.add_argument("--json", default="benchmarks/results/profile_train.json", help="JSON output path ('' to skip)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.reps < 1:
        raise SystemExit(f"--reps must be at least 1, got {args.reps}")
    if args.smoke:
        plan, shape = bench.smoke_plan_and_shape()
        args.reps = 1
    elif args.preset == "smollm2":
        plan, shape = replace(bench.SMOLLM2_PLAN), replace(bench.SMOLLM2)
    else:
        plan, shape = bench.Plan(), bench.Shape()
    default_models = "llama,upcycle_v2,upcycle_v1" if args.preset == "smollm2" else ",".join(bench.MODELS)
    models = bench._choices(args.models or default_models, bench.MODELS + bench.EXTRA_MODELS, "--models")
    batch, seq = bench._pairs(args.train_shape, "--train-shape")[0] if args.train_shape else plan.train_shape
    if args.workload == "decode":
        if args.decode_batch < 1:
            raise SystemExit(f"--decode-batch must be at least 1, got {args.decode_batch}")
        batch, seq = args.decode_batch, plan.prompt_len + plan.new_tokens
    shape.max_position_embeddings = max(shape.max_position_embeddings, seq)
    torch.set_num_threads(args.threads)
    result = {"machine": harness.machine_info(args.threads), "shape": asdict(shape), "workload": args.workload,
              "train_shape": [batch, seq] if args.workload == "train" else None,
              "decode": {"batch": batch, "prompt_len": plan.prompt_len, "new_tokens": plan.new_tokens}
              if args.workload == "decode" else None,
              "reps": args.reps, "models": profile_models(models, shape, batch, seq, args.reps, args.workload, plan)}
    result |= {"table": format_table(result, args.top), "provenance": harness.provenance("profile_train.py", argv)}
    print(result["table"])
    if args.json:
        harness.write_json(args.json, result, "profile_train.py", argv)
    return result


if __name__ == "__main__":
    main()
