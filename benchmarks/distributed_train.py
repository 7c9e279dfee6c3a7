"""Training under the distributed engines on CPU ranks: per-rank memory and step time, DIFF V1 / V2 against a Llama.

For each engine (one process, DDP, FSDP2 through transformers' ``DistributedConfig(fsdp_size=N)``, DeepSpeed ZeRO-3
with partitioned initialisation) one ``torchrun`` launch trains the three parameter-matched models of
:func:`benchmarks.compare_small.build_configs` (the Llama, DIFF V1 with the Llama's heads, DIFF V2) on the same
synthetic batches, each wrapped by the engine, and measures on every rank:

* **memory**, counted from the tensors (deterministic, unlike a process's resident size): the bytes of the parameters
  the rank holds (its FSDP2 shards or ZeRO-3 partitions, else whole tensors), of its gradients after a backward, and of
  its optimizer state (AdamW's two moments; ZeRO-3 also keeps a float32 master copy of its partition, counted there);
* **step time**: forward, backward and optimizer step, ``--steps`` timed steps per round after ``--warmup``, in
  ``--rounds`` rounds whose model order rotates (harness.interleave's rule), so that the machine's load hits every model
  alike; the DIFF models' times are reported as ratios to the Llama's of the same round (harness.paired).

Results: ``--out`` (JSON with provenance); ``doc_table`` renders the report's tables from it (scripts/doc_tables.py).

    python -m benchmarks.distributed_train                     # every engine, 2 ranks
    python -m benchmarks.distributed_train --engines ddp,fsdp2 --nproc 2 --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

if __name__ == "__main__" and not __package__:
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.distributed_train", *sys.argv[1:]])

from benchmarks import harness  # noqa: E402

SCRIPT = "distributed_train.py"
ENGINES = ("single", "ddp", "fsdp2", "zero3")
MODELS = ("llama", "v1", "v2")
LABELS = {"llama": "Llama", "v1": "DIFF V1", "v2": "DIFF V2"}
ENGINE_LABELS = {
    "single": "one process",
    "ddp": "DDP",
    "fsdp2": "FSDP2 (DistributedConfig)",
    "zero3": "DeepSpeed ZeRO-3",
}
SHAPES = {
    # train.py's default shape (examples/train.py), small enough for two CPU ranks.
    "default": dict(
        vocab_size=4096,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=704,
        seq_len=128,
        batch=8,
    ),
    "smoke": dict(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        seq_len=16,
        batch=4,
    ),
}


# ----------------------------------------------------------------------------------------------- worker (one rank)


def _local(t):
    """The part of a parameter or gradient this rank stores: a DTensor's local shard, a ZeRO-3 partition."""
    if hasattr(t, "ds_tensor"):
        return t.ds_tensor
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _optimizer_bytes(optimizer) -> int:
    state = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO optimizer wraps the torch one
    total = sum(
        _bytes(_local(v) for v in s.values() if hasattr(v, "element_size") and v.dim() > 0)
        for s in state.state.values()
    )
    # ZeRO-3's float32 master copy of this rank's partition (kept even when the model trains in float32).
    total += _bytes(getattr(optimizer, "fp32_partitioned_groups_flat", []))
    return total


def _grad_bytes(model, optimizer) -> int | None:
    """The gradients this rank holds between steps; None under ZeRO-3, which reduces and partitions them during the
    backward and frees them in its step (they are not held between steps, so there is nothing to count there)."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        return None
    return _bytes(_local(p.grad) if p.grad is not None else None for p in model.parameters())


def _wrap(engine: str, folder: str, world: int, lr: float, micro_batch: int, keep: list):
    """(model, step function) of the engine for the saved model ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM

    import difftransformer  # noqa: F401  (the Auto classes load the saved DIFF folders)

    if engine == "zero3":
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        ds_config = {
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3},
            "zero_allow_untested_optimizer": True,
            "wall_clock_breakdown": False,
        }
        keep.append(HfDeepSpeedConfig(ds_config))  # from_pretrained builds inside deepspeed.zero.Init while it lives
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        ds_engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

        def step(ids):
            loss = ds_engine(input_ids=ids, labels=ids).loss
            ds_engine.backward(loss)
            ds_engine.step()
            return loss

        return ds_engine.module, optimizer, step
    if engine == "fsdp2":
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=world)
        )
        wrapped = model
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        wrapped = torch.nn.parallel.DistributedDataParallel(model) if engine == "ddp" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def step(ids):
        loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss

    return model, optimizer, step


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized() and args.engine != "fsdp2":
        dist.init_process_group("gloo")
    shape = SHAPES[args.shape]
    micro = shape["batch"] // world
    gen = torch.Generator().manual_seed(0)
    batches = torch.randint(
        0, shape["vocab_size"], (args.warmup + args.steps, shape["batch"], shape["seq_len"]), generator=gen
    )
    keep: list = []
    runs, memory = {}, {}
    for name in args.models.split(","):
        model, optimizer, step = _wrap(args.engine, os.path.join(args.folders, name), world, 1e-3, micro, keep)
        model.train()
        memory[name] = {"parameters": _bytes(_local(p) for p in model.parameters())}
        runs[name] = (model, optimizer, step)
    if dist.is_initialized():
        rank = dist.get_rank()

    def timed(name):
        model, optimizer, step = runs[name]

        def one_round() -> float:
            samples = []
            for i in range(args.warmup + args.steps):
                ids = batches[i, rank * micro : (rank + 1) * micro]
                if dist.is_initialized():
                    dist.barrier()
                t0 = time.perf_counter()
                step(ids)
                samples.append(time.perf_counter() - t0)
            return statistics.median(samples[args.warmup :])

        return one_round

    names = list(runs)
    times = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            times[n].append(timed(n)())
    for n, (model, optimizer, _) in runs.items():
        memory[n]["gradients"] = _grad_bytes(model, optimizer)
        memory[n]["optimizer"] = _optimizer_bytes(optimizer)
    out = {"rank": rank, "world": world, "memory": memory, "step_s": times}
    with open(f"{args.result}.rank{rank}.json", "w") as f:
        json.dump(out, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- driver


def build_folders(shape: dict, root: str) -> dict:
    from benchmarks.compare_small import build_configs, build_model

    sizes = {k: v for k, v in shape.items() if k not in ("batch",)}
    configs = build_configs(**sizes)
    params = {}
    for name, config in configs.items():
        model = build_model(name, config, seed=0)
        model.save_pretrained(os.path.join(root, name))
        params[name] = sum(p.numel() for p in model.parameters())
    return params


def launch(engine: str, nproc: int, folders: str, result: str, args: argparse.Namespace) -> list[dict]:
    cmd = ["-m", "benchmarks.distributed_train", "--worker", "--engine", engine]
    cmd += ["--folders", folders, "--result", result, "--shape", args.shape, "--models", args.models]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds)]
    if engine != "single":  # torchrun's own -m: run the module on every rank
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd]
    cmd = [sys.executable, *cmd]
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=harness.ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        raise RuntimeError(f"{engine}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    ranks = 1 if engine == "single" else nproc
    return [json.load(open(f"{result}.rank{r}.json")) for r in range(ranks)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {ENGINES}")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}")
    p.add_argument("--nproc", type=int, default=2, help="ranks of every engine but 'single'")
    p.add_argument("--shape", choices=sorted(SHAPES), default="default")
    p.add_argument("--smoke", action="store_true", help="the smoke shape, 1 round of 2 steps (seconds; tests)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per launch")
    p.add_argument("--out", default="benchmarks/results/distributed_train_cpu.json")
    # the worker's own arguments (one rank, under torchrun)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--folders", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    if args.smoke:
        args.shape, args.rounds, args.steps, args.warmup = "smoke", 1, 2, 1
    engines = args.engines.split(",")
    for field, chosen, allowed in (("--engines", engines, ENGINES), ("--models", args.models.split(","), MODELS)):
        bad = [x for x in chosen if x not in allowed]
        if bad or not chosen:
            raise SystemExit(f"{field} must be a comma-separated subset of {allowed}, got {bad or chosen}")
    if "llama" not in args.models.split(","):
        raise SystemExit("--models must include llama: the step times are reported as ratios to the Llama's")
    shape = SHAPES[args.shape]
    if shape["batch"] % args.nproc:
        raise SystemExit(f"--nproc={args.nproc} must divide the batch of {shape['batch']} sequences")
    report = {
        "meta": {
            "shape": shape,
            "nproc": args.nproc,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "machine": harness.machine_info(threads=1),
            "load_avg_start": list(os.getloadavg()),
        },
        "engines": {},
    }
    with tempfile.TemporaryDirectory() as root:
        report["meta"]["parameters"] = build_folders(shape, os.path.join(root, "models"))
        for engine in engines:
            ranks = launch(engine, args.nproc, os.path.join(root, "models"), os.path.join(root, engine), args)
            report["engines"][engine] = {"ranks": ranks, "summary": summarize(ranks)}
            print(json.dumps({engine: report["engines"][engine]["summary"]}), flush=True)
    report["meta"]["load_avg_end"] = list(os.getloadavg())
    harness.write_json(args.out, report, SCRIPT, argv)
    return report


def summarize(ranks: list[dict]) -> dict:
    """Per model: the largest rank's memory (bytes), the median step time of rank 0 and, for the DIFF models, the
    median and quartiles of their per-round ratio to the Llama's step time (every rank times the same steps)."""
    out = {}
    times = ranks[0]["step_s"]
    for name in ranks[0]["memory"]:
        mem = {
            k: None if ranks[0]["memory"][name][k] is None else max(r["memory"][name][k] for r in ranks)
            for k in ranks[0]["memory"][name]
        }
        entry = {"memory": mem, "step_s": statistics.median(times[name])}
        if name != "llama" and "llama" in times:
            ratio, quart = harness.paired(times[name], times["llama"])
            entry["ratio_to_llama"] = {"median": ratio, "quartiles": quart}
        out[name] = entry
    return out


def _kib(value: int | None) -> str:
    return "—" if value is None else f"{value / 1024:,.0f}"


def doc_table(datas: list[dict], opts: dict) -> list[str]:
    """scripts/doc_tables.py's renderer: per engine and model, the largest rank's parameter, gradient and optimizer
    KiB, the same as a share of one process's, and the step time's ratio to the Llama's under the same engine
    (median of the per-round ratios, with their quartiles)."""
    (data,) = datas
    meta, engines = data["meta"], data["engines"]
    single = engines.get("single", {}).get("summary")
    lines = [
        "| engine | model | parameters KiB | gradients KiB | optimizer KiB | all three × one process's | step time × "
        "Llama's (quartiles) |",
        "|---|---|---|---|---|---|---|",
    ]
    for engine in ENGINES:
        if engine not in engines:
            continue
        for name, entry in engines[engine]["summary"].items():
            mem = entry["memory"]
            total = sum(v for v in mem.values() if v is not None)
            share = "—"
            if single and name in single:
                base = single[name]["memory"]
                # like with like: leave out what this engine does not hold between steps (ZeRO-3's gradients)
                base_total = sum(v for k, v in base.items() if mem.get(k) is not None)
                share = f"{total / base_total:.2f}"
            ratio = entry.get("ratio_to_llama")
            time_text = (
                "1 (the reference)"
                if ratio is None
                else (f"{ratio['median']:.2f} ({ratio['quartiles'][0]:.2f}-{ratio['quartiles'][1]:.2f})")
            )
            lines.append(
                f"| {ENGINE_LABELS[engine]} | {LABELS[name]} | {_kib(mem['parameters'])} | {_kib(mem['gradients'])} "
                f"| {_kib(mem['optimizer'])} | {share} | {time_text} |"
            )
    shape = meta["shape"]
    note = (
        f"{meta['nproc']} ranks (one process for the first rows), one thread each; shape: {shape['num_hidden_layers']} "
        f"layers, width {shape['hidden_size']}, {shape['num_attention_heads']} query heads of "
        f"{shape['head_dim']}, {shape['num_key_value_heads']} KV heads, vocabulary {shape['vocab_size']:,}, "
        f"{shape['batch']} sequences of {shape['seq_len']} tokens per step (global), float32, AdamW; "
        f"{meta['rounds']} rounds of {meta['steps']} timed steps after {meta['warmup']} warm-up steps. Memory: the "
        "largest rank's, counted from the tensors it holds between steps (— : none held; ZeRO-3 frees its gradient "
        "partitions in its step); its optimizer column includes ZeRO-3's float32 master partition. Load average "
        f"{meta['load_avg_start'][0]:.1f} at the start and {meta['load_avg_end'][0]:.1f} at the end (2 cores)."
    )
    return lines + ["", note]


if __name__ == "__main__":
    main()
