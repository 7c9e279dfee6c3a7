"""End-to-end CPU benchmark: DiffTransformer V1 and V2 against same-config Llama and DiffLlama.

Builds four causal LMs with identical shapes and random weights — ``llama`` (transformers' ``LlamaForCausalLM``),
``diffllama`` (transformers' ``DiffLlamaForCausalLM``), ``ours_v1`` and ``ours_v2`` (``DiffTransformerForCausalLM``
with ``diff_version`` 1 / 2; V2 keeps Llama's query-head count, so it is not an upcycle: docs/model.md,
"Configuration") — all with ``attn_implementation="sdpa"`` (for ours V1 that is the modeling file's own CPU kernel) —
and optionally ``ours_v1_padded`` (ours V1 through one zero-padded SDPA call per layer, what every attention function
other than ``"sdpa"`` receives: ``benchmarks/padded_sdpa.py``), and measures in one process, models interleaved (order
rotated every repetition), after warm-up:

* prefill tokens/s: one forward with a fresh ``DynamicCache`` and ``logits_to_keep=1``, exactly what ``generate``
  runs for a prompt (default shapes 1×512, 1×2048, 8×256);
* decode tokens/s: greedy ``generate`` of ``--new-tokens`` after a ``--prompt-len`` prompt (EOS disabled), batch 1
  and 8, with a dynamic cache, a static cache, and a static cache with ``torch.compile`` (on CPU ``generate`` only
  compiles with a ``CompileConfig`` whose ``_compile_all_devices`` is set). Only the decode steps are timed: a
  logits processor stamps the clock when the first token is chosen, i.e. after the prefill;
* training step time: forward + backward + ``AdamW.step`` on ``--train-shape`` (4×512) with labels, with and without
  gradient checkpointing (bf16 rows train bf16 weights directly);
* peak memory: growth of peak RSS (``VmHWM`` after resetting it through ``/proc/self/clear_refs``) over the resident
  model (+ optimizer state for training) while running one prefill, one decode ``generate`` and one training step;
  each measurement in its own process, forked from a server that imported torch but never computed, with glibc
  told to return freed tensors to the system (``MALLOC_MMAP_THRESHOLD_``) so RSS follows live tensors.

Reports medians, spread (IQR / median) and ratios to Llama (time ratios: above 1 is slower), checks the targets
(``TARGETS``; docs/performance.md), prints a Markdown table and writes JSON (with its provenance: commit, command,
machine, versions) and a PNG chart; timing, statistics and provenance come from benchmarks/harness.py. ``--smoke``
runs tiny sizes once (CI). Timings on a shared machine are noisy: rerun when the spread is wide, and compare ratios from
the same run only.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
from tqdm.auto import tqdm

# `python benchmarks/bench.py` (from the repository root) runs as `python -m benchmarks.bench`: the imports below need
# the root on sys.path, where `python -m` puts it.
if __name__ == "__main__" and not __package__:
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.bench", *sys.argv[1:]])

from benchmarks import harness  # noqa: E402
from benchmarks.harness import quartiles, run_interleaved, set_clock, summarize  # noqa: E402,F401  (re-exported)

MODELS = ("llama", "diffllama", "ours_v1", "ours_v2")
# Not run by default: ours V1 through one zero-padded SDPA call per layer (benchmarks/padded_sdpa.py);
# and the upcycles of the Llama shape (docs/convert.md): V2 (every query head duplicated, exact) and V1 with the
# "duplicate" init (query and KV heads doubled), as `difftransformer-convert --from llama` makes them.
UPCYCLES = ("upcycle_v2", "upcycle_v1")
EXTRA_MODELS = ("ours_v1_padded", *UPCYCLES)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GROUPS = ("prefill", "decode", "decode_static", "decode_compiled", "train", "train_ckpt", "memory")
MEMORY_WORKLOADS = ("prefill", "decode", "train")
# Targets: ratio to same-config Llama (medians, same run) per metric family, for V1 and V2 (docs/performance.md).
TARGETS = {
    "prefill": {"ours_v1": {512: 1.10, 2048: 1.25, None: 1.10}, "ours_v2": {None: 1.03}},
    "decode": {"ours_v1": {None: 1.05}, "ours_v2": {None: 1.03}},
    "train": {"ours_v1": {None: 1.08}, "ours_v2": {None: 1.03}},
    "memory": {"ours_v1": {None: 1.05}, "ours_v2": {None: 1.03}},
}
# Upcycles are judged against their source (the Llama row): V2 decode reads 7% more weights at SmolLM2's shape, so
# 1.08 is its decode target; prefill and training may cost at most 5% more than the FLOP floor of the shape.
UPCYCLE_DECODE_TARGET = {"upcycle_v2": 1.08}
UPCYCLE_FLOP_SLACK = 1.05
# Llama's own MLP ratio (LlamaConfig defaults: 11008 / 4096).
LLAMA_MLP_RATIO = 11008 / 4096


@dataclass
class Shape:
    """Model shape shared by all four models (defaults: the Llama-style shape of docs/performance.md)."""

    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    vocab_size: int = 32000
    intermediate_size: int | None = None  # None: Llama's ratio, rounded
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.intermediate_size is None:
            self.intermediate_size = round(self.hidden_size * LLAMA_MLP_RATIO)


@dataclass
class Plan:
    """What to measure: workloads, repetitions and sizes."""

    prefill_shapes: list[tuple[int, int]] = field(default_factory=lambda: [(1, 512), (1, 2048), (8, 256)])
    decode_batches: list[int] = field(default_factory=lambda: [1, 8])
    prompt_len: int = 128
    new_tokens: int = 128
    train_shape: tuple[int, int] = (4, 512)
    memory_prefill: tuple[int, int] = (1, 2048)
    memory_decode_batch: int = 8
    reps: int = 7
    warmup: int = 1
    threads: int = 2
    clock: str = "wall"


# SmolLM2-135M-Instruct (the real model the package upcycles, docs/upcycling.md): `--preset smollm2`.
SMOLLM2 = Shape(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    intermediate_size=1536,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
SMOLLM2_PLAN = Plan(
    prefill_shapes=[(1, 128), (1, 512), (8, 128)],
    decode_batches=[1, 8],
    prompt_len=128,
    new_tokens=64,
    train_shape=(4, 256),
)


def smoke_plan_and_shape() -> tuple[Plan, Shape]:
    """Tiny sizes, one repetition: every code path runs in seconds (``--smoke``)."""
    shape = Shape(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=128,
    )
    plan = Plan(
        prefill_shapes=[(1, 32), (2, 16)],
        decode_batches=[1, 2],
        prompt_len=8,
        new_tokens=4,
        train_shape=(2, 32),
        memory_prefill=(1, 32),
        memory_decode_batch=2,
        reps=1,
        warmup=1,
    )
    return plan, shape


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------


def build_config(kind: str, shape: Shape, attn_implementation: str = "sdpa"):
    """The config of model ``kind`` (one of MODELS) with ``shape``; EOS/BOS disabled so decode runs full length."""
    from transformers import DiffLlamaConfig, LlamaConfig

    from difftransformer import DiffTransformerConfig

    fields = asdict(shape) | {"bos_token_id": None, "eos_token_id": None, "pad_token_id": 0}
    if kind == "llama":
        cfg = LlamaConfig(**fields)
    elif kind == "diffllama":
        cfg = DiffLlamaConfig(**fields)
    elif kind in ("ours_v1", "ours_v2"):
        cfg = DiffTransformerConfig(**fields, diff_version=int(kind[-1]))
    elif kind == "upcycle_v2":
        cfg = DiffTransformerConfig(**fields | {"num_attention_heads": 2 * shape.num_attention_heads}, diff_version=2)
    elif kind == "upcycle_v1":
        cfg = DiffTransformerConfig(
            **fields
            | {
                "num_attention_heads": 2 * shape.num_attention_heads,
                "num_key_value_heads": 2 * shape.num_key_value_heads,
            },
            diff_version=1,
        )
    elif kind == "ours_v1_padded":
        from benchmarks.padded_sdpa import PADDED_SDPA  # registers transformers' sdpa function under this name

        cfg = DiffTransformerConfig(**fields, diff_version=1)
        attn_implementation = PADDED_SDPA
    else:
        raise ValueError(f"model kind must be one of {MODELS + EXTRA_MODELS}, got {kind!r}")
    cfg._attn_implementation = attn_implementation
    return cfg


def build_model(
    kind: str, shape: Shape, dtype: torch.dtype = torch.float32, seed: int = 0, attn_implementation: str = "sdpa"
) -> torch.nn.Module:
    """A randomly initialised ``*ForCausalLM`` of ``kind`` in ``dtype``, eval mode, greedy generation config.

    ``ours_v1_padded`` ignores ``attn_implementation``: it is ours V1 through one padded SDPA call per layer."""
    from transformers import DiffLlamaForCausalLM, LlamaForCausalLM

    from difftransformer import DiffTransformerForCausalLM

    cls = {"llama": LlamaForCausalLM, "diffllama": DiffLlamaForCausalLM}.get(kind, DiffTransformerForCausalLM)
    torch.manual_seed(seed)
    model = cls(build_config(kind, shape, attn_implementation)).to(dtype).eval()
    gen = model.generation_config
    gen.eos_token_id, gen.bos_token_id, gen.pad_token_id = None, None, 0
    gen.do_sample, gen.temperature, gen.top_p, gen.top_k = False, None, None, None
    return model


def _ids(batch: int, seq: int, vocab: int, seed: int = 1, device: torch.device | str = "cpu") -> torch.Tensor:
    """Random token ids, the same on every device (drawn on the CPU, then moved to ``device``: the model's)."""
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(device)


# ----------------------------------------------------------------------------------------------------------------
# Workloads: each builder returns a callable that runs once and returns the seconds of its measured part.
# ----------------------------------------------------------------------------------------------------------------


def prefill_workload(model, batch: int, seq: int) -> Callable[[], float]:
    """One prompt forward as ``generate`` runs it: fresh DynamicCache, logits for the last position only."""
    from transformers import DynamicCache

    from difftransformer.modeling_difftransformer import CACHE_NAME  # the cache keyword of this transformers

    ids = _ids(batch, seq, model.config.vocab_size, device=model.device)

    def run() -> float:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            start = harness.now()
            model(ids, **{CACHE_NAME: cache}, use_cache=True, logits_to_keep=1)
            return harness.now() - start

    return run


class _StepClock:
    """Logits processor that stamps the time each generation step chooses a token (it changes nothing); ``on_first``
    is called once, when the prompt's forward has chosen the first token (before its stamp)."""

    def __init__(self, on_first: Callable[[], object] | None = None):
        self.stamps: list[float] = []
        self.on_first = on_first

    def __call__(self, input_ids, scores):
        if not self.stamps and self.on_first is not None:
            self.on_first()
        self.stamps.append(harness.now())
        return scores


def decode_workload(
    model,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    cache: str = "dynamic",
    compiled: bool = False,
    on_first_token: Callable[[], object] | None = None,
    compile_options: dict | None = None,
) -> Callable[[], float]:
    """Greedy ``generate``; returns the seconds of the ``new_tokens − 1`` decode steps (prefill excluded).

    ``cache``: ``"dynamic"`` or ``"static"``; ``compiled`` (static only) passes a ``CompileConfig`` with
    ``_compile_all_devices = True`` so that ``generate`` compiles the decode step on CPU too; ``compile_options``
    overrides its fields (e.g. ``{"backend": "eager", "mode": None}``: Dynamo without Inductor, what the GPU check's
    CPU smoke run uses to reach the compiled path in seconds). ``on_first_token`` is called where the timed part
    begins.
    """
    from transformers import CompileConfig, LogitsProcessorList

    if compiled and cache != "static":
        raise ValueError("compiled decode needs cache='static' (generate only compiles with a static cache)")
    ids = _ids(batch, prompt_len, model.config.vocab_size, device=model.device)
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    if compiled:
        compile_config = CompileConfig(**{"fullgraph": False} | (compile_options or {}))
        compile_config._compile_all_devices = True
        kwargs["compile_config"] = compile_config
    else:
        kwargs["disable_compile"] = True

    def run() -> float:
        clock = _StepClock(on_first_token)
        with torch.no_grad():
            out = model.generate(ids, logits_processor=LogitsProcessorList([clock]), **kwargs)
        end = harness.now()
        if out.shape[1] != prompt_len + new_tokens:
            raise RuntimeError(f"generate stopped early: {out.shape[1] - prompt_len} of {new_tokens} tokens")
        return end - clock.stamps[0]

    return run


def train_workload(model, batch: int, seq: int, checkpointing: bool = False, lr: float = 1e-5) -> Callable[[], float]:
    """One optimisation step: forward with labels, backward, ``AdamW.step``, ``zero_grad``. Leaves eval mode set."""
    ids = _ids(batch, seq, model.config.vocab_size, device=model.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def run() -> float:
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        try:
            start = harness.now()
            loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return harness.now() - start
        finally:
            if checkpointing:
                model.activation_checkpointing_disable()
            model.eval()

    run.optimizer = optimizer
    return run


def group_items(group: str, plan: Plan) -> list[dict]:
    """The measurements of a group: name, workload arguments, and what one run produces (tokens or a step)."""
    if group == "prefill":
        return [
            {"item": f"prefill {b}x{t}", "family": "prefill", "length": t, "tokens": b * t, "args": (b, t)}
            for b, t in plan.prefill_shapes
        ]
    if group.startswith("decode"):
        cache = "dynamic" if group == "decode" else "static"
        label = {"decode": "dynamic", "decode_static": "static", "decode_compiled": "static+compile"}[group]
        return [
            {
                "item": f"decode b{b} {label}",
                "family": "decode",
                "length": None,
                "tokens": b * (plan.new_tokens - 1),
                "args": (b, cache, group == "decode_compiled"),
            }
            for b in plan.decode_batches
        ]
    if group.startswith("train"):
        b, t = plan.train_shape
        suffix = " ckpt" if group == "train_ckpt" else ""
        return [
            {
                "item": f"train {b}x{t}{suffix}",
                "family": "train",
                "length": None,
                "tokens": None,
                "args": (b, t, group == "train_ckpt"),
            }
        ]
    raise ValueError(f"group must be one of {GROUPS}, got {group!r}")


def _workload(group: str, model, args: tuple, plan: Plan) -> Callable[[], float]:
    if group == "prefill":
        return prefill_workload(model, *args)
    if group.startswith("decode"):
        batch, cache, compiled = args
        return decode_workload(model, batch, plan.prompt_len, plan.new_tokens, cache, compiled)
    return train_workload(model, *args)


def forward_flops(config, seq: int, logits_tokens: int, past: int = 0) -> float:
    """Matmul FLOPs (2 per multiply-add) of one causal forward over ``seq`` tokens of a Llama, V1 or V2 config, with
    the LM head applied to ``logits_tokens`` positions; attention counts the ``past + (seq + 1) / 2`` keys a query
    sees on average (``past`` cached tokens before them). Training costs about 3× the forward for every model alike,
    so its ratio is the forward's."""
    e, layers, inter, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    version = getattr(config, "diff_version", None)
    heads, width = (hq // 2, 2 * d) if version == 1 else ((hq // 2, d) if version == 2 else (hq, d))
    per_token = (
        2 * e * (hq + 2 * hkv) * d + 2 * heads * width * e + 6 * e * inter + (2 * e * heads if version == 2 else 0)
    )
    visible = past + (seq + 1) / 2
    attention = 2 * hq * d * visible + 2 * (heads * width if version == 1 else hq * d) * visible  # scores + A·V
    return layers * seq * (per_token + attention) + 2 * e * vocab * logits_tokens


def generation_flops(config, prompt_len: int, new_tokens: int) -> float:
    """Matmul FLOPs of generating ``new_tokens`` greedy tokens after a ``prompt_len``-token prompt with a KV cache:
    the prompt's forward (logits of its last token, the first new token) and one one-token step per further token."""
    steps = sum(forward_flops(config, 1, 1, past=prompt_len + j) for j in range(new_tokens - 1))
    return forward_flops(config, prompt_len, 1) + steps


def _flop_floor(spec: dict, models: dict[str, torch.nn.Module], kind: str) -> float | None:
    """FLOPs of ``kind`` over Llama's for a prefill (logits of the last token) or training item."""
    if spec["family"] not in ("prefill", "train") or "llama" not in models:
        return None
    seq = spec["args"][1]
    logits = 1 if spec["family"] == "prefill" else seq
    return forward_flops(models[kind].config, seq, logits) / forward_flops(models["llama"].config, seq, logits)


def time_group(group: str, models: dict[str, torch.nn.Module], plan: Plan, progress=None) -> list[dict]:
    """All items of ``group`` for every model, interleaved; one result dict per item."""
    results = []
    for spec in group_items(group, plan):
        runs = {kind: _workload(group, model, spec["args"], plan) for kind, model in models.items()}
        stats = run_interleaved(runs, plan.reps, plan.warmup, progress)
        del runs
        gc.collect()
        for kind in UPCYCLES:
            if kind in stats:
                stats[kind]["flop_floor"] = _flop_floor(spec, models, kind)
        results.append(with_ratios(spec, stats, unit="s"))
    return results


def with_ratios(spec: dict, stats: dict[str, dict], unit: str) -> dict:
    """Attach ratios to Llama (time or bytes ratio: > 1 means slower / more) and tokens/s where it applies.

    Timed rows also get the paired ratio: the median of each round's time over Llama's in the same round, and the
    quartiles of those per-round ratios. Rounds interleave the models, so a slowdown of the whole machine during one
    round cancels in its ratio where it inflates the medians' spreads."""
    base = stats.get("llama", {}).get("median")
    base_samples = stats.get("llama", {}).get("samples")
    for row in stats.values():
        # No ratio against a zero (memory growth below a page) or failed baseline.
        row["ratio"] = row["median"] / base if base and base == base and base > 0 else None
        if spec.get("tokens"):
            row["tokens_per_s"] = spec["tokens"] / row["median"]
        samples = row.get("samples")
        if (
            unit == "s"
            and row["ratio"] is not None
            and samples
            and base_samples
            and len(samples) == len(base_samples) >= 4
        ):
            row["paired_ratio"], row["paired_quartiles"] = harness.paired(samples, base_samples)
    return {k: v for k, v in spec.items() if k != "args"} | {"unit": unit, "models": stats}


# ----------------------------------------------------------------------------------------------------------------
# Peak memory, one process per measurement
# ----------------------------------------------------------------------------------------------------------------


def _proc_status_kb(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_worker(kind: str, workload: str, dtype_name: str, shape: Shape, plan: Plan) -> dict:
    """Peak-RSS growth (MiB) of one workload of one model, run in a fresh process (see module docstring).

    A warm-up run first (thread pools, kernel caches; for training: the optimizer state, which then counts as
    resident), then the peak is reset and the measured run's peak growth over the resident set is returned.
    """
    torch.set_num_threads(plan.threads)
    set_clock(plan.clock)
    model = build_model(kind, shape, DTYPES[dtype_name])
    if workload == "prefill":
        run = prefill_workload(model, *plan.memory_prefill)
    elif workload == "decode":
        run = decode_workload(model, plan.memory_decode_batch, plan.prompt_len, plan.new_tokens)
    elif workload == "train":
        run = train_workload(model, *plan.train_shape)
    else:
        raise ValueError(f"memory workload must be one of {MEMORY_WORKLOADS}, got {workload!r}")
    with harness.trace_code():  # the warm-up: what this workload runs (the parent process traces nothing here)
        run()
    gc.collect()
    exact = reset_peak_rss()
    base_kb = _proc_status_kb("VmRSS")
    start_peak_kb = _proc_status_kb("VmHWM")
    run()
    peak_kb = _proc_status_kb("VmHWM")
    # Without clear_refs the peak includes the warm-up; growth is then measured against the pre-warm-up peak.
    return {
        "growth_mib": (peak_kb - (base_kb if exact else start_peak_kb)) / 1024,
        "resident_mib": base_kb / 1024,
        "peak_mib": peak_kb / 1024,
        "exact_reset": exact,
        "executed": {path: sorted(lines) for path, lines in harness.EXECUTED.items()},
    }


def _memory_child(queue, *args):
    try:
        queue.put(memory_worker(*args))
    except Exception as exc:  # reported in the table instead of killing the whole benchmark
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def measure_memory(models: list[str], dtype_name: str, shape: Shape, plan: Plan, progress=None) -> list[dict]:
    """Peak-RSS growth per workload and model, each in its own forked process, repeated ``plan.reps`` times
    (at most 3: memory is nearly deterministic) with the model order rotated."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # inherited by the fork server and its children
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "131072")
    ctx = mp.get_context("forkserver")
    # The server imports these (and the main module) once, then forks a clean child per measurement.
    ctx.set_forkserver_preload(["torch", "transformers", "difftransformer"])
    reps = max(1, min(plan.reps, 3))
    results = []
    for workload in MEMORY_WORKLOADS:

        def child(kind: str, workload: str = workload) -> dict:
            queue = ctx.Queue()
            proc = ctx.Process(target=_memory_child, args=(queue, kind, workload, dtype_name, shape, plan))
            proc.start()
            out = queue.get()
            proc.join()
            for path, lines in out.pop("executed", {}).items():  # the child's trace: this run's code record
                harness.EXECUTED.setdefault(path, set()).update(lines)
            return out

        # No warm-up here: each child process warms up before it measures.
        measured = harness.interleave(
            {kind: lambda kind=kind: child(kind) for kind in models}, reps, warmup=0, progress=progress, trace=False
        )
        errors = {kind: out["error"] for kind, runs in measured.items() for out in runs if "error" in out}
        samples = {kind: [out for out in runs if "error" not in out] for kind, runs in measured.items()}
        stats = {}
        for kind, outs in samples.items():
            if outs:
                stats[kind] = summarize([o["growth_mib"] for o in outs]) | {
                    "resident_mib": outs[-1]["resident_mib"],
                    "exact_reset": outs[-1]["exact_reset"],
                }
            else:
                stats[kind] = {"median": float("nan"), "spread": 0.0, "samples": [], "error": errors.get(kind)}
        label = {
            "prefill": "prefill {}x{}".format(*plan.memory_prefill),
            "decode": f"decode b{plan.memory_decode_batch}",
            "train": "train {}x{}".format(*plan.train_shape),
        }[workload]
        results.append(
            with_ratios({"item": f"peak MiB {label}", "family": "memory", "length": None}, stats, unit="MiB")
        )
    return results


# ----------------------------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------------------------


def target_for(family: str, kind: str, length: int | None) -> float | None:
    """The ratio target for ``kind`` on a metric of ``family`` (prefill targets depend on the length)."""
    per_len = TARGETS.get(family, {}).get("ours_v1" if kind == "ours_v1_padded" else kind)
    if per_len is None:
        return None
    return per_len.get(length, per_len.get(None))


TARGETED = ("ours_v1", "ours_v2", "ours_v1_padded", *UPCYCLES)


def _upcycle_target(result: dict, kind: str) -> float | None:
    row = result["models"].get(kind) or {}
    if result["family"] in ("prefill", "train") and row.get("flop_floor"):
        return row["flop_floor"] * UPCYCLE_FLOP_SLACK
    return UPCYCLE_DECODE_TARGET.get(kind) if result["family"] == "decode" else None


def model_target(result: dict, kind: str) -> float | None:
    """The ratio target of model ``kind`` on one result row (None where it has none)."""
    if kind in UPCYCLES:
        return _upcycle_target(result, kind)
    return target_for(result["family"], kind, result.get("length")) if kind in TARGETED else None


def check_targets(result: dict) -> dict:
    """Per model: ratio ≤ target; plus ``beats_diffllama`` per V1 model (faster, or not more memory, than DiffLlama)."""
    out = {}
    dl = result["models"].get("diffllama")
    for kind in TARGETED:
        row = result["models"].get(kind)
        target = model_target(result, kind)
        if row and target is not None and row.get("ratio") is not None:
            out[kind] = {"target": target, "met": row["ratio"] <= target}
            if "paired_quartiles" in row:  # settled: the per-round ratios' middle half lies on one side of the target
                q1, q3 = row["paired_quartiles"]
                out[kind] |= {"paired_met": row["paired_ratio"] <= target, "settled": q3 <= target or q1 > target}
        if (
            kind not in ("ours_v2", *UPCYCLES)
            and row
            and dl
            and row.get("ratio") is not None
            and dl.get("ratio") is not None
        ):
            # Time: strictly faster. Memory: not more, within 1% (peak RSS moves by a few pages between processes).
            beats = row["median"] <= dl["median"] * 1.01 if result["unit"] == "MiB" else row["median"] < dl["median"]
            out.setdefault("beats_diffllama", {})[kind] = beats
    return out


def _value(result: dict, row: dict) -> str:
    if row.get("error") or row.get("median") != row.get("median"):
        return "error"
    if "tokens_per_s" in row:
        return f"{row['tokens_per_s']:.0f} tok/s"
    if result["unit"] == "MiB":
        return f"{row['median']:.0f} MiB"
    return f"{row['median']:.3f} s"


def format_table(report: dict, paired: bool | None = None) -> str:
    """Markdown table per dtype: Llama's absolute value, every model's ratio to Llama (± spread), targets.

    ``paired`` (default: with ``--preset smollm2``, whose upcycle rows have targets close to their ratios) adds the
    paired ratio and its quartiles to each cell, and marks a target the quartiles straddle as unsettled."""
    lines = []
    models = report["models"]
    if paired is None:
        paired = any(m in models for m in UPCYCLES)
    others = [m for m in models if m != "llama"]
    for dtype_name, results in report["results"].items():
        lines.append(
            f"\n**{dtype_name}** — ratios are time (or memory) relative to Llama, medians; spread = IQR/median"
            + ("; paired = median [quartiles] of the per-round time ratios" if paired else "")
            + "\n"
        )
        targeted = [k for k in TARGETED if k in models]
        v1s = [k for k in targeted if k != "ours_v2"]
        head = (
            "| metric | llama | "
            + " | ".join(f"{m} ×" for m in others)
            + " | "
            + " | ".join(f"{k} target" for k in targeted)
            + "".join(f" | {k} < DiffLlama" for k in v1s if "diffllama" in models)
            + " |"
        )
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for res in results:
            rows = res["models"]
            cells = [
                res["item"],
                _value(res, rows["llama"]) + f" ±{rows['llama']['spread'] * 100:.0f}%" if "llama" in rows else "–",
            ]
            for m in others:
                r = rows.get(m)
                cells.append(
                    "–"
                    if r is None or r.get("ratio") is None or r.get("ratio") != r.get("ratio")
                    else f"{r['ratio']:.2f} ±{r['spread'] * 100:.0f}%"
                    + (
                        f"; paired {r['paired_ratio']:.2f} [{r['paired_quartiles'][0]:.2f}–"
                        f"{r['paired_quartiles'][1]:.2f}]"
                        if "paired_ratio" in r and paired
                        else ""
                    )
                    + (f" (FLOP floor {r['flop_floor']:.2f})" if r.get("flop_floor") else "")
                )
            checks = check_targets(res)
            for kind in targeted:
                c = checks.get(kind)
                cells.append(
                    "–"
                    if c is None
                    else f"≤ {c['target']:.2f} {'✓' if c['met'] else '✗'}"
                    + ("" if c.get("settled", True) or not paired else " (unsettled)")
                )
            if "diffllama" in models:
                for kind in v1s:
                    beats = checks.get("beats_diffllama", {}).get(kind)
                    cells.append("–" if beats is None else ("✓" if beats else "✗"))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart_figure(report: dict):
    """Per dtype, horizontal bars of every model's ratio to Llama per metric; each model's own target as a black tick
    across its bar, the paired ratio with its quartiles as a dot and whisker. Returns the matplotlib figure."""
    plt = harness.pyplot()
    dtypes = list(report["results"])
    others = [m for m in report["models"] if m != "llama"]
    n_items = max(len(r) for r in report["results"].values())
    fig, axes = plt.subplots(
        1, len(dtypes), figsize=(8.5 * len(dtypes), 0.32 * n_items * max(1, len(others)) + 1.5), squeeze=False
    )
    colors = {
        "diffllama": "tab:gray",
        "ours_v1": "tab:blue",
        "ours_v2": "tab:green",
        "ours_v1_padded": "tab:cyan",
        "upcycle_v2": "tab:green",
        "upcycle_v1": "tab:blue",
    }
    height = 0.8 / max(1, len(others))
    for ax, dtype_name in zip(axes[0], dtypes):
        results = report["results"][dtype_name]
        for i, res in enumerate(results):
            for j, m in enumerate(others):
                r = res["models"].get(m, {})
                ratio = r.get("ratio")
                if ratio is None or ratio != ratio:
                    continue
                y = i + (j - (len(others) - 1) / 2) * height
                ax.barh(y, ratio, height, color=colors.get(m, None), label=m if i == 0 else None)
                if r.get("paired_quartiles"):
                    q1, q3 = r["paired_quartiles"]
                    ax.errorbar(
                        r["paired_ratio"],
                        y,
                        xerr=[[r["paired_ratio"] - q1], [q3 - r["paired_ratio"]]],
                        fmt="o",
                        color="dimgray",
                        ms=3,
                        capsize=2,
                        lw=1,
                    )
                target = model_target(res, m)
                if target is not None:
                    ax.plot([target, target], [y - height / 2, y + height / 2], color="black", lw=2)
        ax.axvline(1.0, color="red", lw=1, ls="--")
        ax.set_yticks(range(len(results)), [r["item"] for r in results])
        ax.invert_yaxis()
        ax.set_xlabel(
            "time (memory) / same-config Llama (dashed); lower is better\n"
            "black tick: the model's target; dot and whisker: paired ratio [quartiles]"
        )
        ax.set_title(f"{dtype_name}, {report['machine']['threads']} threads, {report['machine']['cpu'][:40]}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # beside the axes: covers no bar
    fig.tight_layout()
    return fig


def write_chart(report: dict, path: str) -> None:
    """PNG of :func:`chart_figure`."""
    harness.save_figure(chart_figure(report), path)


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------


def _pairs(text: str, flag: str) -> list[tuple[int, int]]:
    pairs = []
    for item in (i for i in text.split(",") if i):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"{flag}: expected comma-separated BATCHxLENGTH pairs such as 1x512,8x256; got {text!r}")
        pairs.append((int(parts[0]), int(parts[1])))
    return pairs


def parse_choices(text: str, allowed, flag: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    bad = [v for v in values if v not in allowed]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad}; allowed values: {', '.join(allowed)}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--only",
        default=",".join(GROUPS),
        help=f"comma-separated measurement groups to run (default: all of {', '.join(GROUPS)})",
    )
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated models (default: {', '.join(MODELS)}; "
        f"also {', '.join(EXTRA_MODELS)}: ours V1 through one padded SDPA call, and the Llama's upcycles); ratios "
        "need llama",
    )
    p.add_argument(
        "--dtype", default=None, help="comma-separated dtypes: fp32, bf16 (default: both; fp32 with --smoke)"
    )
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed repetitions per model and item; medians reported (default 7; memory uses at most 3)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed runs per model and item before timing (default 1; the compiled-decode warm-up compiles)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default 2; 1 with --smoke, where "
        "speed is not the point and a loaded CI machine makes 2-thread regions crawl)",
    )
    p.add_argument("--hidden-size", type=int, default=None, help="model width (default 512)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8)")
    p.add_argument(
        "--heads", type=int, default=None, help="query heads of width head_dim, as Llama counts them (default 8)"
    )
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default 4)")
    p.add_argument("--head-dim", type=int, default=None, help="query/key head width (default 64)")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary size (default 32000)")
    p.add_argument(
        "--intermediate-size", type=int, default=None, help="MLP width (default: hidden × 11008/4096, Llama's ratio)"
    )
    p.add_argument("--prefill-shapes", default=None, help="prefill BATCHxLENGTH list (default 1x512,1x2048,8x256)")
    p.add_argument("--decode-batches", default=None, help="decode batch sizes (default 1,8)")
    p.add_argument("--prompt-len", type=int, default=None, help="decode prompt length (default 128)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per decode run (default 128)")
    p.add_argument("--train-shape", default=None, help="training BATCHxLENGTH (default 4x512)")
    p.add_argument(
        "--clock",
        default="wall",
        choices=("cpu", "cuda", "wall"),
        help="wall: elapsed time (default); cpu: "
        "process CPU time — with --threads 1 it leaves out time other processes hold the core (shared machines); "
        "cuda: elapsed time after torch.cuda.synchronize() (benchmarks/gpu_check.py's clock)",
    )
    p.add_argument(
        "--preset",
        choices=("smollm2",),
        default=None,
        help="smollm2: SmolLM2-135M's shape (30 layers, "
        "hidden 576, 9 query / 3 KV heads, tied 49152-token vocabulary) against its upcycles (--models "
        "llama,upcycle_v2,upcycle_v1), prefill 1x128,1x512,8x128, decode b1/b8 of 64 tokens after 128, "
        "training 4x256; size flags still override",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, one repetition, no compiled decode: checks that "
        "every path runs (CI); sizes flags still override",
    )
    p.add_argument("--json", default="benchmarks/results/bench.json", help="JSON output path ('' to skip)")
    p.add_argument("--png", default="benchmarks/results/bench.png", help="PNG chart path ('' to skip)")
    return p.parse_args(argv)


def plan_and_shape(args: argparse.Namespace) -> tuple[Plan, Shape]:
    plan, shape = smoke_plan_and_shape() if args.smoke else (Plan(), Shape())
    if args.preset == "smollm2" and not args.smoke:
        plan, shape = replace(SMOLLM2_PLAN), replace(SMOLLM2)
    shape_over = {
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "intermediate_size": args.intermediate_size,
    }
    shape_over = {k: v for k, v in shape_over.items() if v is not None}
    if "hidden_size" in shape_over and "intermediate_size" not in shape_over:
        shape_over["intermediate_size"] = None  # recompute from the ratio
    shape = replace(shape, **shape_over)
    plan_over = {
        "reps": args.reps,
        "warmup": args.warmup,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "clock": args.clock,
    }
    if args.prefill_shapes:
        plan_over["prefill_shapes"] = _pairs(args.prefill_shapes, "--prefill-shapes")
    if args.decode_batches:
        plan_over["decode_batches"] = [int(b) for b in args.decode_batches.split(",")]
    if args.train_shape:
        plan_over["train_shape"] = _pairs(args.train_shape, "--train-shape")[0]
    plan = replace(plan, **{k: v for k, v in plan_over.items() if v is not None})
    if plan.new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2: decode time is measured from the first generated token")
    max_len = max([t for _, t in plan.prefill_shapes] + [plan.prompt_len + plan.new_tokens, plan.train_shape[1]])
    shape.max_position_embeddings = max(shape.max_position_embeddings, max_len)
    return plan, shape


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    groups = parse_choices(args.only, GROUPS, "--only")
    if args.preset == "smollm2" and args.models == ",".join(MODELS):
        args.models = "llama,upcycle_v2,upcycle_v1"
    models = parse_choices(args.models, MODELS + EXTRA_MODELS, "--models")
    dtypes = parse_choices(args.dtype or ("fp32" if args.smoke else "fp32,bf16"), DTYPES, "--dtype")
    if args.smoke and args.only == ",".join(GROUPS):
        groups = [g for g in groups if g != "decode_compiled"]  # compiling takes ~15 s per model: not in CI smoke
    plan, shape = plan_and_shape(args)
    torch.set_num_threads(plan.threads)
    set_clock(plan.clock)
    if plan.clock == "cpu" and plan.threads != 1:
        raise SystemExit("--clock cpu sums the CPU time of all threads (OpenMP spin-waits included): use --threads 1")

    timed = [g for g in groups if g != "memory"]
    total = 0
    for g in timed:
        total += len(group_items(g, plan)) * len(models) * plan.reps
    if "memory" in groups:
        total += len(MEMORY_WORKLOADS) * len(models) * max(1, min(plan.reps, 3))
    report = {
        "machine": harness.machine_info(plan.threads),
        "shape": asdict(shape),
        "plan": asdict(plan),
        "models": models,
        "groups": groups,
        "results": {},
    }
    with tqdm(total=total * len(dtypes), desc="bench", file=sys.stderr) as bar:
        for dtype_name in dtypes:
            results = []
            if timed:
                built = {}
                with harness.trace_code():  # building the models is part of the code a result ran
                    for kind in models:  # a loop, not a comprehension: main itself is not traced
                        built[kind] = build_model(kind, shape, DTYPES[dtype_name])
                for g in timed:
                    bar.set_postfix_str(f"{dtype_name} {g}")
                    results += time_group(g, built, plan, bar)
                del built
                gc.collect()
            if "memory" in groups:
                bar.set_postfix_str(f"{dtype_name} memory")
                results += measure_memory(models, dtype_name, shape, plan, bar)
            report["results"][dtype_name] = results
    report["machine"]["load_avg_end"] = os.getloadavg()
    table = format_table(report)
    print(table)
    print(f"\nmachine: {report['machine']}")
    report = report | {"table": table, "provenance": harness.provenance("bench.py", argv)}
    if args.json:
        harness.write_json(args.json, report, "bench.py", argv)
    if args.png:
        write_chart(report, args.png)
    return report


# The names benchmarks/gpu_check.py still uses (until it calls the public ones above).
_items, _with_ratios = group_items, with_ratios

if __name__ == "__main__":
    main()
