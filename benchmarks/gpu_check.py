"""One prepared GPU check: speed at the sizes users run, V1's candidate kernels, the Triton tuning sweep and every
attention backend's correctness, in one run that fits one short GPU slot.

GPU time is rare and short (a slot of about 15 minutes, start-up included), so everything worth knowing from one CUDA
GPU is gathered by one command, ``bash scripts/gpu_check.sh`` (which runs ``python -m benchmarks.gpu_check --out DIR``
with the repository root on ``PYTHONPATH``). It survives its own failures and writes one JSON report
(``gpu_check.json``, rewritten after every row and check, so a run cut short keeps what it measured) and a text summary
(``gpu_check.txt``). ``--smoke`` runs the same code on tiny sizes on the CPU in seconds
(tests/benchmarks/test_gpu_check.py).

The parts run in this order, the most wanted first, each within its own time allowance (``PART_BUDGET_S``; a part
that finishes early leaves its time to the next) and all within ``--budget`` seconds from the start: no row or check
starts past its part's allowance or the budget, it is recorded as "skipped: time budget" instead.

1. ``speed``: Llama-3.2-1B's shape at full depth (hidden 2048, 16 layers, 32 query / 8 KV heads of width 64, MLP
   8192, vocabulary 128256) in bf16 as transformers' ``LlamaForCausalLM`` (the baseline), ``DiffLlamaForCausalLM``, V1
   and V2, interleaved and paired as benchmarks/bench.py does (``harness.run_interleaved``: medians, quartiles,
   per-round ratios; the clock synchronizes the GPU), in this order: prefill 1×8192 and 8×2048, a training step at
   8×2048 without and with gradient checkpointing, peak GPU memory, decoding 16 tokens after a 4096-token prompt at
   batch 1 and 32 with a dynamic cache (eager), then the same with a static cache and ``torch.compile`` (``generate(...,
   cache_implementation="static", compile_config=CompileConfig(...))``: CUDA graphs, how transformers users get decode
   speed; DiffLlama left out). A compiled row times the steady state (the first call, which compiles and captures,
   and a second are untimed) and reports each model's first-call seconds and compile seconds apart. Every row of a
   differential model names the kernel its attention ran (``module.last_kernel``, else the dispatch's
   ``select_kernel``); V1 rows carry the FLOP floors of the three formulations (``combined``, ``one_pass``,
   ``padded``) and are judged against the floor of the one their kernel computes. Every row is judged against
   ``GPU_TARGETS``; for a row that misses, a kernel-only profile of the missing models and of the Llama shows where
   the time goes (:func:`kernel_profile`). After the eager decode rows: kernel launches per decode step and layer of
   every model (the host-bound question). A model whose workload raises leaves its row with the reason; on a card
   under ``TRAIN_ALL_MIN_GIB`` DiffLlama leaves the training rows (every model's optimizer state is held at once).
2. ``attention``: one layer's attention at the 1B head counts by every candidate kernel (the Llama's SDPA call; V1's
   padded call, two SDPA calls, the repeated-value call, the decode kernel for decode rows, the Triton kernel), prefill
   1×8192 and 8×2048, training 8×2048 (forward and ``out.backward(dout)``), decode at batch 1 and 32 over 4096 keys;
   for each, the SDPA backend it ran (cuDNN, flash, memory-efficient, math: from the kernel and operator names of a
   short profile) and its agreement with the padded call.
3. ``tuning``: the Triton kernel's tuning sweep (``kernels.triton.attention.tuning_sweep``), where the module has one.
4. ``checks``: correctness, each check one entry ``{name, status, passed, max_err, bound, detail, seconds}`` (status:
   pass, fail, error — it raised, skipped — with the reason, absent — the backend's package or the function is not
   there); a failing or raising check never stops the others. The reference and the bounds are the CPU tests' own,
   from difftransformer/testing_utils.py. In order:

   * ``reference {layout}``: the float64 model on the device (``.double()``, eager) equals the explicit float64
     reference (testing_utils.reference_forward: docs/model.md, "What it computes") on the CPU, within the float32
     tolerance;
   * ``forward {layout} {backend} {dtype}``: a left-padded batch's logits in fp32, bf16 and fp16 against the float64
     model with the same weights, on the same device. fp32: the CPU tests' 2e-5; bf16 and fp16: the rounding model of
     the CPU tests (``RoundingModel``, 8 draws, 3 × the largest drawn error; fp16 with its own unit roundoff 2⁻¹¹);
     ``forward {layout} kernel={name} {dtype}``: the same with V1's kernel forced (``set_differential_kernel``);
   * ``grads {layout} {backend} fp32``: one training step's parameter gradients against eager's (relative error);
     ``grads {layout} {backend} bf16`` and ``grads {layout} kernel={name} bf16``: against the float64 reference's,
     within the rounding model's bound per parameter; ``max_err`` is the worst error in units of its bound;
   * ``generate {layout} {backend} dynamic`` (and ``kernel={name}``): greedy decoding with a dynamic cache equals
     uncached greedy decoding (fp32); ``left-padding {layout} {backend}``: a left-padded batch generates what each
     prompt generates alone; ``generate {layout} sdpa compiled-static``: a static cache and
     ``CompileConfig(fullgraph=True, dynamic=False)``;
   * ``liger {layout}``: Liger Kernel's patched model against the unpatched one;
   * ``triton {case} d{d} {dtype}``: V1's one-pass Triton kernel alone against the float64 formula
     (testing_utils.reference_differential_attention): output and the gradients of q, k, v and λ;
   * last, every flex_attention check (each compiles: the slowest checks).

   Backends: eager, sdpa, flex_attention, and flash_attention_2 / flash_attention_3 where ``flash_attn`` /
   ``flash_attn_interface`` can be imported ("absent" otherwise).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

_STARTED = time.perf_counter()  # the time budget counts from here, before torch and transformers are imported

import torch  # noqa: E402

from benchmarks import bench, harness  # noqa: E402
from difftransformer.testing_utils import (  # noqa: E402
    FP32_LOGITS_ATOL,
    GRAD_RTOL,
    ROUNDING_DRAWS,
    ROUNDING_FACTOR,
    SCORES_ATOL,
    RoundingModel,
    bf16_error_bound,
    greedy_with_scores,
    left_padded_batch,
    randomize_norms,
    reference_differential_attention,
    reference_forward,
    tiny_config,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
# The package each flash backend needs; without it the backend is reported "absent".
FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
LAYOUTS = ("v1_gqa", "v1_mha", "v2_gqa", "v2_mha")  # testing_utils.LAYOUTS: V1/V2, GQA and MHA
# Every flex_attention check compiles: the three layouts of test_modeling_difftransformer.py's FLEX_PAIRS.
FLEX_LAYOUTS = ("v1_gqa", "v1_mha", "v2_gqa")
COMPILED_LAYOUTS = ("v1_gqa", "v2_gqa")  # as tests/models/test_generation_difftransformer.py: one compile each
# V1's kernels that run prompts (modeling_difftransformer.select_kernel's names; "decode_kernel" takes one token only),
# each forced through ``model.set_differential_kernel`` in the checks.
V1_PROMPT_KERNELS = ("sdpa_two_calls", "sdpa_repeated_value", "triton", "padded", "blocked")
# The FLOP formulation each V1 kernel computes (V1_FORMULATIONS below).
KERNEL_FORMULATION = {
    "sdpa_two_calls": "one_pass",
    "sdpa_repeated_value": "one_pass",
    "triton": "one_pass",
    "blocked": "combined",
    "decode_kernel": "combined",
    "padded": "padded",
}
# Every check's model has heads 32 wide (tiny_config's default is 8): flex attention's GPU kernels need at least 16.
HEAD_DIM = 32
# The tolerances (FP32_LOGITS_ATOL, SCORES_ATOL, GRAD_RTOL, ROUNDING_DRAWS × ROUNDING_FACTOR) are testing_utils'.
REPORT, SUMMARY = "gpu_check.json", "gpu_check.txt"
MODULE_COMMAND = "python -m benchmarks.gpu_check"


class Float16RoundingModel(RoundingModel):
    """The rounding model with float16's unit roundoff (11 significand bits) instead of bfloat16's."""

    u = 2.0**-11


ROUNDING_MODELS = {"bf16": RoundingModel, "fp16": Float16RoundingModel}


# ----------------------------------------------------------------------------------------------------------------
# What to run, in which order, within which time
# ----------------------------------------------------------------------------------------------------------------

PARTS = ("speed", "attention", "tuning", "checks")
# Seconds each part may start rows in, from its own start (None: until the budget ends). Sized from the 2026-11-28
# H200 run (docs/reports/2026-11-28-gpu-check.md): its 1B-shape eager rows took 78 s for three models, its
# one-layer attention rows 18 s, its correctness checks 252 s (most of them flex attention's compiles); compiled
# decoding was measured at about 1.2 s per model and layer on 2026-11-26; the tuning sweep is meant to take ~90 s.
PART_BUDGET_S = {"speed": 330.0, "attention": 40.0, "tuning": 100.0, "checks": None}
# The whole run: no row or check starts past it. Under scripts/gpu_check.sh's hard timeout (GPU_CHECK_TIMEOUT, 540 s),
# under the 10 minutes one command may take on a GPU machine, and with start-up inside a 15-minute slot.
DEFAULT_BUDGET_S = 510.0


@dataclass
class SpeedShape:
    """One model shape of the speed rows: the models compared (``llama`` first), bench.py's plan for them, and the
    models of the compiled decode rows."""

    name: str
    shape: bench.Shape
    models: tuple[str, ...]
    plan: bench.Plan
    compiled_models: tuple[str, ...] = ("llama", "ours_v1", "ours_v2")


# The workloads users run: prefill of 1×8192 and 8×2048 tokens, a training step at 8×2048 (with and without gradient
# checkpointing), decoding 16 tokens at batch 1 and 32 after a 4096-token prompt, peak memory. reps ≥ 4 gives
# bench.py's paired ratios and their quartiles; 7 rounds let an exact paired test reach p < 0.05 (5 cannot: 2/32 is
# the least two-sided p of 5 pairs). One warm-up after the traced call (itself a warm call).
GPU_PLAN = bench.Plan(
    prefill_shapes=[(1, 8192), (8, 2048)],
    decode_batches=[1, 32],
    prompt_len=4096,
    new_tokens=16,
    train_shape=(8, 2048),
    memory_prefill=(8, 2048),
    memory_decode_batch=32,
    reps=7,
    warmup=1,
    clock="cuda",
)
# Llama-3.2-1B's published shape at full depth (tied embeddings), as Llama, DiffLlama, V1 and V2 with its head counts.
LLAMA_3_2_1B = bench.Shape(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    intermediate_size=8192,
    max_position_embeddings=8192 + 64,
    tie_word_embeddings=True,
)
GPU_SHAPES = [SpeedShape("llama-3.2-1b", LLAMA_3_2_1B, ("llama", "diffllama", "ours_v1", "ours_v2"), GPU_PLAN)]
# Speed groups in the order they run: the cheap rows first, then eager decoding (and the launch counts), compiled
# decoding (the costliest per row) last.
SPEED_ORDER = ("prefill", "train", "train_ckpt", "memory", "decode", "decode_compiled")
# Seconds a row of a group takes at most, about, with four models (the 2026-11-28 run's rows × 4/3, plus a profile):
# it starts only while that much of the part's time is left.
RESERVE_S = {"prefill": 10, "train": 20, "train_ckpt": 25, "memory": 30, "decode": 45}
# A compiled-decode row mostly compiles, in about this many seconds per model and decoder layer (replaced by the rate
# each compiled row measures); its reserve is that times its models and layers, plus COMPILE_BASE_S.
COMPILE_S_PER_LAYER, COMPILE_BASE_S = 1.5, 20.0
# Training holds every model's AdamW state at once (the rows interleave the models): four 1B-class models and a
# 50 GiB training step need more than an 80 GB card; below this much GPU memory DiffLlama leaves the training rows.
TRAIN_ALL_MIN_GIB = 100.0
PROFILE_RESERVE_S = 4.0  # one kernel-only profile of one model's step
ATTENTION_RESERVE_S = 12.0  # one attention row: every candidate, timed and profiled
TUNING_MIN_S = 30.0  # the tuning sweep starts only with this much of its part left (its own budget_s caps it)


@dataclass
class Profile:
    """Everything one run does. :func:`gpu_profile` is the GPU run, :func:`smoke_profile` its CPU smoke."""

    device: str
    dtypes: tuple[str, ...] = tuple(DTYPES)
    layouts: tuple[str, ...] = LAYOUTS
    flex_layouts: tuple[str, ...] = FLEX_LAYOUTS
    compiled_layouts: tuple[str, ...] = COMPILED_LAYOUTS
    # backend → why it is not run (e.g. flex attention compiles too slowly on a CPU for the smoke run)
    skip_backends: dict[str, str] = field(default_factory=dict)
    skip_compiled: str | None = None  # why the compiled generate check is not run, or None
    skip_kernels: dict[str, str] = field(default_factory=dict)  # V1 kernel → why its forced-kernel checks are not run
    speed_shapes: list[SpeedShape] = field(default_factory=lambda: list(GPU_SHAPES))
    speed_dtype: str = "bf16"
    compiled_decode_batches: tuple[int, ...] = (1, 32)
    # CompileConfig fields of the compiled decode rows beyond generate()'s defaults (on CUDA: Inductor, CUDA graphs)
    compile_options: dict = field(default_factory=dict)
    skip_compiled_rows: dict[int, str] = field(default_factory=dict)  # batch → why its compiled row is not run
    rounding_draws: int = ROUNDING_DRAWS
    threads: int | None = None  # torch.set_num_threads, where set
    budget_s: float = DEFAULT_BUDGET_S
    part_budget_s: dict[str, float | None] = field(default_factory=lambda: dict(PART_BUDGET_S))
    triton_head_dims: tuple[int, ...] = (64, 128)  # the Triton kernel's checks: d 64 in every dtype, others in bf16
    triton_cases: tuple[tuple, ...] = ()  # () = TRITON_CASES
    attention_heads: tuple[int, int, int] = (32, 8, 64)  # one layer's query heads, KV heads, head width
    attention_shapes: tuple[tuple, ...] = ()  # () = ATTENTION_SHAPES
    skip_candidates: dict[str, str] = field(default_factory=dict)  # attention candidate → why it is not timed
    tuning: str | None = None  # why the tuning sweep is not run, or None
    mode: str = "gpu"


def gpu_profile(device: str = "cuda", budget_s: float = DEFAULT_BUDGET_S) -> Profile:
    return Profile(device=device, budget_s=budget_s)


def smoke_profile(device: str = "cpu", budget_s: float = DEFAULT_BUDGET_S) -> Profile:
    """Tiny sizes on the CPU, fp32 and bf16, eager and sdpa, 3 rounding-model draws, one thread, one repetition: every
    code path runs in seconds but GPU memory and Inductor. The compiled decode row runs at batch 1 through Dynamo with
    its "eager" backend (no Inductor, no CUDA graphs: compiling for real takes ~15 s per model on a CPU); the tuning
    sweep runs its smoke problems on Triton's interpreter."""
    plan, shape = bench.smoke_plan_and_shape()
    plan = replace(plan, prefill_shapes=plan.prefill_shapes[:1], reps=1, warmup=0, clock="wall")
    return Profile(
        device=device,
        dtypes=("fp32", "bf16"),
        layouts=("v1_gqa", "v2_gqa"),
        rounding_draws=3,
        threads=1,
        skip_backends={"flex_attention": "skipped: smoke mode (flex attention compiles ~10 s per shape on a CPU)"},
        skip_compiled="skipped: smoke mode (compiling takes ~15 s per model on a CPU)",
        skip_kernels={
            "triton": "skipped: smoke mode (Triton's CPU interpreter takes 5-30 s per model "
            "check; the triton checks cover the kernel)"
        },
        speed_shapes=[
            SpeedShape(
                "smoke", shape, ("llama", "diffllama", "ours_v1", "ours_v2"), plan, compiled_models=("llama", "ours_v1")
            )
        ],
        speed_dtype="fp32",
        compiled_decode_batches=tuple(plan.decode_batches),
        compile_options={"backend": "eager", "mode": None},
        skip_compiled_rows={
            2: "skipped: smoke mode (Dynamo traces every model again for a second batch, "
            "~5 s each on a CPU; batch 1 runs the compiled path)"
        },
        budget_s=budget_s,
        part_budget_s={part: None for part in PARTS},
        mode="smoke",
        triton_head_dims=(16,),
        triton_cases=SMOKE_TRITON_CASES,
        attention_heads=(8, 4, 16),
        attention_shapes=SMOKE_ATTENTION_SHAPES,
        skip_candidates={"triton": "skipped: smoke mode (Triton's CPU interpreter takes seconds per call)"},
    )


# ----------------------------------------------------------------------------------------------------------------
# Recording
# ----------------------------------------------------------------------------------------------------------------


class Skip(Exception):
    """Raised by a check that does not apply; its message is the recorded reason."""


class Budget:
    """Seconds since the run started, against the whole budget and the current part's allowance."""

    def __init__(self, budget_s: float, start: float | None = None):
        self.start, self.budget_s = time.perf_counter() if start is None else start, budget_s
        self.deadline_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def begin(self, allowance_s: float | None) -> None:
        """A part starts: it may start rows for ``allowance_s`` seconds from now (None: until the budget ends)."""
        self.deadline_s = self.budget_s if allowance_s is None else min(self.budget_s, self.elapsed() + allowance_s)

    def allows(self, reserve_s: float = 0.0) -> bool:
        return self.elapsed() + reserve_s <= self.deadline_s


class Recorder:
    """Runs checks and speed rows, keeps the report and rewrites it after each, so that a run cut short keeps what
    it measured. Checks can be deferred to the end of the checks part (:meth:`run_deferred`)."""

    def __init__(self, report: dict, out_dir: str, budget: Budget, log: Callable[[str], None]):
        self.report, self.out_dir, self.budget, self.log = report, out_dir, budget, log
        self.deferred: list[tuple[str, Callable[[], dict], float]] = []

    def save(self, code: bool = False) -> None:
        """Rewrite the report; ``code``: also its provenance's record of the repository code this process ran
        (``harness.code_record``: parses the files it names, so only at the end of each part)."""
        self.report["meta"]["elapsed_s"] = round(self.budget.elapsed(), 1)
        self.report["counts"] = counts(self.report["checks"])
        if code:
            self.report["provenance"]["code"] = harness.code_record()
        path = os.path.join(self.out_dir, REPORT)
        with open(path + ".tmp", "w") as f:
            json.dump(self.report, f, indent=1, default=str)
        os.replace(path + ".tmp", path)

    def stamp(self) -> str:
        return f"[{self.budget.elapsed():6.1f} s]"

    def check(self, name: str, fn: Callable[[], dict], reserve_s: float = 5.0, defer: bool = False) -> dict | None:
        """Run one check: ``fn`` returns ``{max_err, bound, detail}`` (and ``passed`` where more than ``max_err ≤
        bound`` decides), raises :class:`Skip`, or raises anything else (status "error", the traceback's end kept).
        ``defer``: run it at :meth:`run_deferred` instead (returns None)."""
        if defer:
            self.deferred.append((name, fn, reserve_s))
            return None
        start = time.perf_counter()
        entry = {"name": name, "status": None, "passed": None, "max_err": None, "bound": None, "detail": ""}
        if not self.budget.allows(reserve_s):
            entry |= {"status": "skipped", "detail": "skipped: time budget"}
        else:
            try:
                out = fn()
                passed = bool(out.get("passed", True)) and _le(out["max_err"], out["bound"])
                entry |= {
                    "status": "pass" if passed else "fail",
                    "passed": passed,
                    "max_err": out["max_err"],
                    "bound": out["bound"],
                    "detail": out.get("detail", ""),
                }
            except Skip as skip:
                entry |= {"status": "absent" if str(skip).startswith("absent") else "skipped", "detail": str(skip)}
            except Exception as exc:  # recorded; the other checks go on
                entry |= {
                    "status": "error",
                    "passed": False,
                    "detail": f"{type(exc).__name__}: {exc}"[:1500] + "\n" + traceback.format_exc()[-1500:],
                }
                torch._dynamo.reset()  # a failed compile leaves state that breaks later compiles (tests do the same)
        entry["seconds"] = round(time.perf_counter() - start, 2)
        self.report["checks"].append(entry)
        self.log(
            f"{self.stamp()} {entry['status'].upper():7s} {name}"
            + (f"  max_err {_fmt(entry['max_err'])} bound {_fmt(entry['bound'])}" if entry["bound"] is not None else "")
            + (f"  {entry['detail'].splitlines()[0][:200]}" if entry["status"] != "pass" and entry["detail"] else "")
        )
        self.save()
        return entry

    def run_deferred(self) -> None:
        while self.deferred:
            name, fn, reserve_s = self.deferred.pop(0)
            self.check(name, fn, reserve_s)


def _le(err, bound) -> bool:
    return err is not None and bound is not None and not math.isnan(err) and err <= bound


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.3g}"


def counts(checks: list[dict]) -> dict:
    out = {"total": len(checks)}
    for status in ("pass", "fail", "error", "skipped", "absent"):
        out[status] = sum(c["status"] == status for c in checks)
    return out


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------------
# Correctness checks
# ----------------------------------------------------------------------------------------------------------------


def backend_unavailable(backend: str, profile: Profile, layout: str) -> str | None:
    """Why ``backend`` is not run here ("absent: ..." where its package is missing), or None."""
    if backend in profile.skip_backends:
        return profile.skip_backends[backend]
    if backend == "flex_attention" and layout not in profile.flex_layouts:
        return f"skipped: flex attention compiles for every check; it runs on {', '.join(profile.flex_layouts)}"
    package = FLASH_PACKAGES.get(backend)
    if package and importlib.util.find_spec(package) is None:
        return f"absent: `{package}` is not installed"
    if package and not profile.device.startswith("cuda"):
        return f"skipped: {backend} needs a CUDA GPU"
    return None


def _deferred(backend: str) -> bool:
    """flex attention's checks run last: each compiles (most of the checks' time on the 2026-11-28 run)."""
    return backend == "flex_attention"


def _needs_half(backend: str, dtype: str) -> None:
    if backend in FLASH_PACKAGES and dtype == "fp32":
        raise Skip("skipped: flash kernels take fp16/bf16 only")


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double().cpu() - b.double().cpu()).abs().max().item()


def force_kernel(model, kernel: str, skip: dict[str, str] | None = None) -> None:
    """``model.set_differential_kernel(kernel)``: "absent" where the model has no such knob, "skipped" where the model
    refuses the kernel here (its ValueError names why) or ``skip`` names it (with the reason)."""
    if kernel in (skip or {}):
        raise Skip(skip[kernel])
    setter = getattr(model, "set_differential_kernel", None)
    if setter is None:
        raise Skip("absent: the model has no set_differential_kernel")
    try:
        setter(kernel)
    except ValueError as exc:
        raise Skip(f"skipped: {exc}") from exc


def kernels_used(model) -> list[str] | None:
    """The kernels the model's differential attention modules ran last (``module.last_kernel``), or None where the
    modules do not record one."""
    names = {m.last_kernel for m in model.modules() if isinstance(getattr(m, "last_kernel", None), str)}
    return sorted(names) or None


def _kernel_took(model, kernel: str) -> tuple[bool, str]:
    used = kernels_used(model)
    if used is None:
        return True, "; the modules record no last_kernel"
    return used == [kernel], "" if used == [kernel] else f"; ran {used}, not {kernel}"


def forward_case(layout: str):
    """test_modeling_difftransformer.py's bf16 case: attention that matters (initializer_range 0.1: peaked maps),
    heads 32 wide, non-trivial norms, a left-padded batch of 8 and 5 tokens. Returns (fp32 model on the CPU, ids,
    mask)."""
    torch.manual_seed(0)
    from difftransformer import DiffTransformerForCausalLM

    model = DiffTransformerForCausalLM(tiny_config(layout, initializer_range=0.1, head_dim=HEAD_DIM))
    randomize_norms(model, 0)
    ids, mask = left_padded_batch(model.config.vocab_size, [8, 5], seed=2)
    return model.eval(), ids, mask


def float64_twin(master, low) -> torch.nn.Module:
    """``low``'s weights in float64, in a copy of the float32 ``master``: its rotary tables keep float32's precision
    instead of ``low``'s (``.to(bf16)`` rounds the non-persistent ``inv_freq`` buffer too)."""
    twin = copy.deepcopy(master).double()
    twin.load_state_dict(low.state_dict())
    return twin.eval()


def run_forward_checks(rec: Recorder, profile: Profile) -> None:
    """``reference {layout}``, ``forward {layout} {backend} {dtype}`` and, for V1, ``forward {layout} kernel={name}
    {dtype}`` (see the module docstring)."""
    device = profile.device
    for layout in profile.layouts:
        case: dict = {}  # filled by the reference check: ids, mask, and per dtype the model, exact logits, bound

        def reference(layout=layout, case=case):
            master, ids, mask = forward_case(layout)
            valid = mask.bool()
            case.update(ids=ids.to(device), mask=mask.to(device))
            errors = {}
            for dtype in profile.dtypes:
                low = copy.deepcopy(master).to(DTYPES[dtype])
                weights = {k: v.detach() for k, v in low.state_dict().items()}
                spec = reference_forward(low, ids, mask, state_dict=weights)[0][valid]  # float64, on the CPU
                twin = float64_twin(master, low).to(device)
                twin.set_attn_implementation("eager")
                with torch.no_grad():
                    exact = twin(case["ids"], attention_mask=case["mask"]).logits[case["mask"].bool()]
                errors[dtype] = _max_abs(exact, spec)
                if dtype == "fp32":
                    bound = FP32_LOGITS_ATOL
                else:  # the rounding model's spread around the exact result, as the CPU tests derive their bounds
                    draws = [
                        reference_forward(low, ids, mask, rnd=ROUNDING_MODELS[dtype](seed), state_dict=weights)[0][
                            valid
                        ]
                        for seed in range(profile.rounding_draws)
                    ]
                    bound = bf16_error_bound(draws, spec, factor=ROUNDING_FACTOR)
                case[dtype] = {"model": low, "exact": exact, "bound": bound}
            worst = max(errors.values(), key=lambda e: math.inf if math.isnan(e) else e)
            per_dtype = ", ".join(f"{k} {v:.2g}" for k, v in errors.items())
            return {
                "max_err": worst,
                "bound": FP32_LOGITS_ATOL,
                "detail": "float64 model on the device vs the tests' "
                f"float64 reference (CPU), per weight dtype: {per_dtype}",
            }

        ref_entry = rec.check(f"reference {layout}", reference)
        kernels = V1_PROMPT_KERNELS if layout.startswith("v1") else ()
        for dtype in profile.dtypes:
            for backend in (*BACKENDS, *(f"kernel={k}" for k in kernels)):

                def forward(dtype=dtype, backend=backend, layout=layout, case=case, ref_entry=ref_entry):
                    kernel = backend.removeprefix("kernel=") if backend.startswith("kernel=") else None
                    reason = None if kernel else backend_unavailable(backend, profile, layout)
                    if reason:
                        raise Skip(reason)
                    _needs_half(backend, dtype)
                    if dtype not in case:
                        raise RuntimeError(f"no reference: {ref_entry['detail'][:300]}")
                    model = copy.deepcopy(case[dtype]["model"]).to(device)
                    model.set_attn_implementation("sdpa" if kernel else backend)
                    if kernel:
                        force_kernel(model, kernel, profile.skip_kernels)
                    with torch.no_grad():
                        logits = model(case["ids"], attention_mask=case["mask"]).logits[case["mask"].bool()]
                    took, note = _kernel_took(model, kernel) if kernel else (True, "")
                    how = (
                        "the CPU tests' fp32 tolerance"
                        if dtype == "fp32"
                        else f"rounding model, {profile.rounding_draws} draws × {ROUNDING_FACTOR:g}"
                    )
                    return {
                        "max_err": _max_abs(logits, case[dtype]["exact"]),
                        "bound": case[dtype]["bound"],
                        "passed": took,
                        "detail": f"logits of the valid positions vs the float64 model; bound: {how}{note}",
                    }

                rec.check(f"forward {layout} {backend} {dtype}", forward, defer=_deferred(backend))
        _free(device)


def run_liger_checks(rec: Recorder, profile: Profile) -> None:
    """``liger {layout}``: Liger Kernel applied by ``integrations.apply_liger_kernel_to_difftransformer`` (what
    ``Trainer(use_liger_kernel=True)`` calls) against the unpatched model: eval logits (Liger's RMSNorm and SwiGLU) and
    the training loss (its fused linear cross-entropy) in fp32, within the fp32 tolerance relative to their scale
    (float32 kernels that sum in another order). Liger's kernels are Triton on CUDA: elsewhere "skipped"."""
    device = profile.device
    for layout in ("v1_gqa", "v2_gqa"):

        def check(layout=layout):
            if importlib.util.find_spec("liger_kernel") is None:
                raise Skip("absent: liger-kernel is not installed")
            if not device.startswith("cuda"):
                raise Skip("skipped: Liger's kernels run on CUDA")
            from difftransformer.integrations import apply_liger_kernel_to_difftransformer

            model, ids, mask = forward_case(layout)
            model = model.to(device)
            ids, mask = ids.to(device), mask.to(device)
            labels = ids.masked_fill(mask == 0, -100)
            patched = copy.deepcopy(model)
            applied = apply_liger_kernel_to_difftransformer(model=patched)
            outs = []
            for m in (model, patched):
                with torch.no_grad():
                    logits = m(ids, attention_mask=mask).logits[mask.bool()]
                m.train()
                loss = m(ids, attention_mask=mask, labels=labels).loss.detach()
                m.eval()
                outs.append((logits, loss))
            err_logits = _max_abs(outs[1][0], outs[0][0]) / max(1.0, outs[0][0].abs().max().item())
            err_loss = abs(outs[1][1].item() - outs[0][1].item()) / max(1.0, abs(outs[0][1].item()))
            return {
                "max_err": max(err_logits, err_loss),
                "bound": FP32_LOGITS_ATOL,
                "passed": bool(applied.get("rms_norm")) and bool(applied.get("swiglu")),
                "detail": f"relative: logits {err_logits:.2g}, loss {err_loss:.2g}; patched "
                + ", ".join(f"{k} {len(v)}" for k, v in applied.items()),
            }

        rec.check(f"liger {layout}", check)
    _free(device)


# The one-pass Triton kernel of V1 (kernels/triton/attention.py) on its own: cases (name, batch, query tokens, keys,
# KV groups, signal heads per group n, noise ratio r, mask kind), small enough to compile and run in seconds.
TRITON_CASES = (
    ("causal n2", 1, 70, 70, 2, 2, 1, None),
    ("left-padding n2", 2, 40, 40, 2, 2, 1, "left"),
    ("mha n1", 1, 33, 33, 4, 1, 1, None),
    ("gqa n4", 1, 50, 50, 1, 4, 1, None),
    ("gda r2", 2, 24, 24, 2, 4, 2, "left"),
    ("chunk n2", 1, 17, 81, 2, 2, 1, None),
    ("decode n2", 3, 1, 90, 2, 2, 1, "static"),
)


# The smoke run's cases (Triton's CPU interpreter is slow): a masked GQA prompt, grouped noise heads, a decode step.
SMOKE_TRITON_CASES = tuple(c for c in TRITON_CASES if c[0] in ("left-padding n2", "gda r2", "decode n2"))


def _triton_case(name, b, t, s, g, n, r, mask_kind, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(b, t, g * (n + n // r), d, generator=gen, dtype=torch.float64)
    key, value = (torch.randn(b, 2 * g, s, d, generator=gen, dtype=torch.float64) for _ in range(2))
    lam = torch.tensor(0.37, dtype=torch.float64)
    allowed = None
    if mask_kind == "left":  # causal, sequence 0 left-padded by a third of its length (its first rows see nothing)
        allowed = torch.ones(b, 1, t, s, dtype=torch.bool).tril(s - t)
        allowed[0, ..., : s // 3] = False
    elif mask_kind == "static":  # a static cache's decode step: the unwritten tail hidden, sequence 0 padded
        allowed = torch.zeros(b, 1, t, s, dtype=torch.bool)
        allowed[..., : s - 20] = True
        allowed[0, ..., :5] = False
    low = [x.to(dtype) for x in (query, key, value)]
    return low, lam, allowed


def run_triton_checks(rec: Recorder, profile: Profile) -> None:
    """``triton {case} d{d} {dtype}``: the kernel's output and, for prompts, its query/key/value/λ gradients against
    the float64 formula (testing_utils.reference_differential_attention) on the kernel's own inputs. Bounds: fp32, the
    CPU tests' 2e-5 relative to the largest output (float32 accumulation, no TF32); bf16 / fp16, the rounding model (its
    draws round scores, maps and outputs to the dtype) × ROUNDING_FACTOR, per tensor."""
    from difftransformer.kernels.triton import attention as kernel

    device = profile.device
    for i, d in enumerate(profile.triton_head_dims):
        for case in profile.triton_cases or TRITON_CASES:
            for dtype in profile.dtypes if i == 0 else [x for x in profile.dtypes if x == "bf16"]:

                def check(case=case, dtype=dtype, d=d):
                    if not kernel.is_available(torch.device(device)):
                        raise Skip("absent: triton is not installed (or no CUDA device and TRITON_INTERPRET unset)")
                    name, b, t, s, g, n, r, mask_kind = case
                    (q, k, v), lam, allowed = _triton_case(*case, d, DTYPES[dtype], device)
                    grads = t > 1
                    inputs = [x.to(device).requires_grad_(grads) for x in (q, k, v)]
                    lam_dev = lam.float().to(device).requires_grad_(grads)
                    mask = None if allowed is None else allowed.to(device)
                    out = kernel.differential_attention_triton(*inputs, lam_dev, d**-0.5, n, r, mask)
                    gen = torch.Generator().manual_seed(1)
                    weights = torch.randn(out.shape, generator=gen, dtype=torch.float64)
                    got = [out.detach()]
                    if grads:
                        got += torch.autograd.grad((out.double() * weights.to(device)).sum(), [*inputs, lam_dev])

                    def reference(rnd):
                        xs = [x.detach().double().cpu().requires_grad_(grads) for x in (q, k, v)]
                        lam64 = lam.float().double().requires_grad_(grads)
                        ref = reference_differential_attention(*xs, lam64, d**-0.5, n, r, allowed, rnd=rnd)
                        outs = [ref.detach()]
                        if grads:
                            outs += torch.autograd.grad((ref * weights).sum(), [*xs, lam64])
                        return outs

                    exact = reference(lambda x: x)
                    names = ("out", "dq", "dk", "dv", "dλ")[: len(got)]
                    if dtype == "fp32":
                        bounds = [FP32_LOGITS_ATOL * max(1.0, e.abs().max().item()) for e in exact]
                    else:
                        rounding = ROUNDING_MODELS[dtype]
                        draws = [reference(rounding(seed)) for seed in range(profile.rounding_draws)]
                        bounds = [
                            bf16_error_bound([dr[i] for dr in draws], exact[i], factor=ROUNDING_FACTOR)
                            for i in range(len(exact))
                        ]
                    errors = [_max_abs(x, e) for x, e in zip(got, exact)]
                    ratio = max(err / bound if bound > 0 else math.inf for err, bound in zip(errors, bounds))
                    return {
                        "max_err": ratio,
                        "bound": 1.0,
                        "detail": "error / bound per tensor: "
                        + ", ".join(f"{nm} {err:.2g}/{bound:.2g}" for nm, err, bound in zip(names, errors, bounds)),
                    }

                rec.check(f"triton {case[0]} d{d} {dtype}", check, reserve_s=10.0)
        _free(device)


def _generation_model(layout: str, backend: str, device: str, seed: int = 0):
    """test_generation_difftransformer.py's model (heads HEAD_DIM wide): EOS disabled (fixed-length outputs), fp32."""
    from difftransformer import DiffTransformerForCausalLM

    torch.manual_seed(seed)
    model = DiffTransformerForCausalLM(tiny_config(layout, head_dim=HEAD_DIM)).eval()
    model.set_attn_implementation(backend)
    model.generation_config.eos_token_id = None
    return model.to(device)


def run_generation_checks(rec: Recorder, profile: Profile) -> None:
    """``generate ... dynamic`` (every backend, and every V1 kernel forced), ``left-padding ...`` and ``generate ...
    compiled-static`` (fp32)."""
    from transformers import CompileConfig

    device = profile.device
    for layout in profile.layouts:
        kernels = V1_PROMPT_KERNELS if layout.startswith("v1") else ()
        for backend in (*BACKENDS, *(f"kernel={k}" for k in kernels)):

            def cached(layout=layout, backend=backend):
                kernel = backend.removeprefix("kernel=") if backend.startswith("kernel=") else None
                reason = None if kernel else backend_unavailable(backend, profile, layout)
                if reason:
                    raise Skip(reason)
                _needs_half(backend, "fp32")
                model = _generation_model(layout, "sdpa" if kernel else backend, device)
                if kernel:
                    force_kernel(model, kernel, profile.skip_kernels)
                ids, _ = left_padded_batch(model.config.vocab_size, [7], seed=5)
                ids = ids.to(device)
                ref_seq, ref_scores = greedy_with_scores(model, ids, use_cache=False)
                seq, scores = greedy_with_scores(model, ids)
                took, note = _kernel_took(model, kernel) if kernel else (True, "")
                same = torch.equal(seq, ref_seq)
                return {
                    "passed": same and took,
                    "max_err": _max_abs(scores, ref_scores),
                    "bound": SCORES_ATOL,
                    "detail": ("" if same else "greedy sequences differ; ") + "scores vs uncached greedy" + note,
                }

            rec.check(f"generate {layout} {backend} dynamic", cached, defer=_deferred(backend))

        for backend in BACKENDS:

            def padded(layout=layout, backend=backend):
                reason = backend_unavailable(backend, profile, layout)
                if reason:
                    raise Skip(reason)
                _needs_half(backend, "fp32")
                model = _generation_model(layout, backend, device)
                lengths = [8, 5, 3]
                ids, mask = left_padded_batch(model.config.vocab_size, lengths, seed=8)
                ids, mask = ids.to(device), mask.to(device)
                batch_seq, batch_scores = greedy_with_scores(model, ids, mask)
                worst, differ = 0.0, []
                for b, length in enumerate(lengths):
                    alone_seq, alone_scores = greedy_with_scores(model, ids[b : b + 1, -length:])
                    if not torch.equal(batch_seq[b, -(length + 10) :], alone_seq[0]):
                        differ.append(b)
                    worst = max(worst, _max_abs(batch_scores[:, b], alone_scores[:, 0]))
                return {
                    "passed": not differ,
                    "max_err": worst,
                    "bound": SCORES_ATOL,
                    "detail": (f"prompts {differ} generate other tokens in the batch; " if differ else "")
                    + "scores of batch rows vs each prompt alone",
                }

            rec.check(f"left-padding {layout} {backend}", padded, defer=_deferred(backend))
        _free(device)
    for layout in profile.layouts:  # last: each compiles a model

        def compiled(layout=layout):
            if profile.skip_compiled:
                raise Skip(profile.skip_compiled)
            if layout not in profile.compiled_layouts:
                raise Skip("skipped: one compile per version (v1_gqa, v2_gqa), as the CPU tests")
            model = _generation_model(layout, "sdpa", device)
            ids, _ = left_padded_batch(model.config.vocab_size, [6], seed=6)
            ids = ids.to(device)
            ref_seq, ref_scores = greedy_with_scores(model, ids, use_cache=False)
            torch._dynamo.reset()
            compile_config = CompileConfig(fullgraph=True, dynamic=False)
            compile_config._compile_all_devices = True  # generate() compiles on CUDA anyway; on CPU only with this
            seq, scores = greedy_with_scores(model, ids, cache_implementation="static", compile_config=compile_config)
            took = hasattr(model, "_compiled_call")
            same = torch.equal(seq, ref_seq)
            return {
                "passed": same and took,
                "max_err": _max_abs(scores, ref_scores),
                "bound": SCORES_ATOL,
                "detail": ("" if took else "generate() did not take the compiled path; ")
                + ("" if same else "greedy sequences differ; ")
                + "scores vs uncached greedy",
            }

        rec.check(f"generate {layout} sdpa compiled-static", compiled, reserve_s=60.0)


def grads_case(layout: str, dtype: str):
    """test_kernels_difftransformer.py's training case (heads HEAD_DIM wide): initializer_range 0.1, non-trivial norms,
    V1's λ vectors moved off their init, a left-padded batch of 12 and 9 tokens, labels ignoring padding and every
    token predicted from a padding row (each kernel fills those rows differently). Returns (model on the CPU in
    ``dtype``, ids, mask, labels)."""
    from difftransformer import DiffTransformerForCausalLM
    from difftransformer.modeling_difftransformer import DiffTransformerV1Attention

    torch.manual_seed(3)
    config = tiny_config(layout, initializer_range=0.1, head_dim=HEAD_DIM)
    model = randomize_norms(DiffTransformerForCausalLM(config), 3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, DiffTransformerV1Attention):
                for p in (m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2):
                    p.add_(torch.randn_like(p) * 0.3)
    ids, mask = left_padded_batch(model.config.vocab_size, [12, 9], seed=2)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    return model.to(DTYPES[dtype]), ids, mask, labels


def _grads(
    model, backend: str, ids, mask, labels, device: str, skip: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """One training step's parameter gradients; ``backend`` ``kernel=NAME`` forces V1's kernel under sdpa (unless
    ``skip`` names it: :func:`force_kernel`)."""
    model = copy.deepcopy(model).to(device).train()
    kernel = backend.removeprefix("kernel=") if backend.startswith("kernel=") else None
    model.set_attn_implementation("sdpa" if kernel else backend)
    if kernel:
        force_kernel(model, kernel, skip)
    model(ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss.backward()
    if kernel:
        took, note = _kernel_took(model, kernel)
        if not took:
            raise RuntimeError(f"the forced kernel did not run{note}")
    return {k: p.grad.double().cpu() for k, p in model.named_parameters()}


def run_grad_checks(rec: Recorder, profile: Profile) -> None:
    """``grads {layout} {backend} fp32`` against eager, ``grads {layout} {backend} bf16`` (and, for V1,
    ``grads {layout} kernel={name} bf16``) against the rounding model."""
    device = profile.device
    for layout in profile.layouts:
        if "fp32" in profile.dtypes:
            model, ids, mask, labels = grads_case(layout, "fp32")
            eager: dict = {}
            for backend in BACKENDS[1:]:

                def fp32(backend=backend, layout=layout, model=model, ids=ids, mask=mask, labels=labels, eager=eager):
                    reason = backend_unavailable(backend, profile, layout)
                    if reason:
                        raise Skip(reason)
                    _needs_half(backend, "fp32")
                    if not eager:
                        eager.update(_grads(model, "eager", ids, mask, labels, device))
                    grads = _grads(model, backend, ids, mask, labels, device)
                    rel = {k: _max_abs(g, eager[k]) / max(eager[k].abs().max().item(), 1e-30) for k, g in grads.items()}
                    worst = max(rel, key=lambda k: math.inf if math.isnan(rel[k]) else rel[k])
                    return {
                        "max_err": rel[worst],
                        "bound": GRAD_RTOL,
                        "detail": f"max over parameters of max|g − g_eager| / max|g_eager|; worst: {worst}",
                    }

                rec.check(f"grads {layout} {backend} fp32", fp32, defer=_deferred(backend))
        if "bf16" in profile.dtypes:
            model, ids, mask, labels = grads_case(layout, "bf16")
            bounds: dict = {}

            def reference_grads(rnd, model=model, ids=ids, mask=mask, labels=labels):
                sd = {k: v.detach().double().requires_grad_() for k, v in model.state_dict().items()}
                reference_forward(model, ids, mask, rnd=rnd, state_dict=sd, labels=labels)[2].backward()
                return {k: v.grad for k, v in sd.items()}

            kernels = V1_PROMPT_KERNELS if layout.startswith("v1") else ()
            for backend in (*BACKENDS, *(f"kernel={k}" for k in kernels)):

                def bf16(
                    backend=backend,
                    layout=layout,
                    model=model,
                    ids=ids,
                    mask=mask,
                    labels=labels,
                    bounds=bounds,
                    reference_grads=reference_grads,
                ):
                    reason = (
                        profile.skip_kernels.get(backend.removeprefix("kernel="))
                        if backend.startswith("kernel=")
                        else backend_unavailable(backend, profile, layout)
                    )
                    if reason:
                        raise Skip(reason)
                    if not bounds:
                        exact = reference_grads(lambda x: x)
                        draws = [reference_grads(RoundingModel(seed)) for seed in range(profile.rounding_draws)]
                        bounds.update(
                            {
                                k: (exact[k], bf16_error_bound([d[k] for d in draws], exact[k], ROUNDING_FACTOR))
                                for k in exact
                            }
                        )
                    grads = _grads(model, backend, ids, mask, labels, device, profile.skip_kernels)
                    units = {k: _max_abs(g, bounds[k][0]) / bounds[k][1] for k, g in grads.items()}
                    worst = max(units, key=lambda k: math.inf if math.isnan(units[k]) else units[k])
                    return {
                        "max_err": units[worst],
                        "bound": 1.0,
                        "detail": "worst parameter gradient error in units of its rounding-model bound "
                        f"({profile.rounding_draws} draws × {ROUNDING_FACTOR:g}): {worst}",
                    }

                rec.check(f"grads {layout} {backend} bf16", bf16, defer=_deferred(backend))
        _free(device)


def run_checks(rec: Recorder, profile: Profile) -> None:
    """The correctness part, the quickest and most telling checks first, the compiling ones (flex attention) last."""
    run_forward_checks(rec, profile)
    run_grad_checks(rec, profile)
    run_generation_checks(rec, profile)
    run_liger_checks(rec, profile)
    run_triton_checks(rec, profile)
    rec.run_deferred()


# ----------------------------------------------------------------------------------------------------------------
# Kernel-only profiles
# ----------------------------------------------------------------------------------------------------------------

# CUPTI's overhead records (torch.profiler._cupti_monitor's names): the CPU waiting on a full launch queue ("Command
# Buffer Full"), buffer flushes, lazy loading... They reach torch.profiler as device-side events but run no kernel.
OVERHEAD_RECORDS = frozenset(
    {
        "Command Buffer Full",
        "Buffer Flush",
        "Instrumentation",
        "Resource",
        "Runtime Triggered Module Loading",
        "Lazy Function Loading",
        "Activity Buffer Request",
        "UVM Activity Init",
        "Driver Compiler",
        "Unknown",
    }
)
# Kineto activity types that are not work on the device (where torch's events carry ``activity_type``).
NOT_KERNELS = frozenset(
    {
        "overhead",
        "gpu_user_annotation",
        "user_annotation",
        "cpu_op",
        "python_function",
        "cuda_runtime",
        "cuda_driver",
        "external_correlation",
        "cpu_instant_event",
        "cuda_sync",
    }
)


def is_device_kernel(event) -> bool:
    """Whether a torch.profiler event (``FunctionEvent``) is one piece of device work: a CUDA event that is neither a
    user annotation nor an overhead record. Device events are counted once, by their own duration: key_averages'
    device time of a CPU operator is the time of the kernels it launched, so summing every event counts each kernel
    twice."""
    from torch.autograd import DeviceType

    if getattr(event, "device_type", None) != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
        return False
    if event.name in OVERHEAD_RECORDS:
        return False
    activity = getattr(event, "activity_type", None)
    return activity is None or str(activity).lower() not in NOT_KERNELS


def is_top_level_cpu_op(event) -> bool:
    """The CPU stand-in for a kernel (no device): an operator that no other operator called (annotations aside)."""
    from torch.autograd import DeviceType

    if getattr(event, "device_type", None) != DeviceType.CPU or getattr(event, "is_user_annotation", False):
        return False
    if getattr(event, "is_python_function", False) or event.name.startswith("ProfilerStep"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if not getattr(parent, "is_user_annotation", False):
            return False
        parent = parent.cpu_parent
    return True


def _kernel_category(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("_diff_attn", "flash", "fmha", "attention", "efficient_attention", "cudnn", "sdpa")):
        return "attention"
    if any(
        k in n
        for k in (
            "gemm",
            "cutlass",
            "nvjet",
            "sm90_",
            "sm80_",
            "matmul",
            "cublas",
            "wgmma",
            "aten::mm",
            "aten::bmm",
            "aten::addmm",
            "aten::linear",
        )
    ):
        return "matmul"
    if any(k in n for k in ("rms", "norm")):
        return "norm"
    if any(k in n for k in ("copy", "cat", "transpose", "contiguous", "index", "fill", "memcpy", "memset")):
        return "copy"
    if any(k in n for k in ("softmax", "cross_entropy", "log_softmax", "nll")):
        return "loss/softmax"
    return "elementwise/other"


def summarize_kernels(
    events, wall_s: float, device: str, steps: int = 1, layers: int | None = None, top: int = 10
) -> dict:
    """The kernel-only summary of a profiled run: device kernels (:func:`is_device_kernel`) on CUDA, top-level CPU
    operators (:func:`is_top_level_cpu_op`) elsewhere, each counted once; their total against the run's wall time
    (``wall_s``), launches per step (and per layer), time by category and the ``top`` kernels."""
    cuda = device.startswith("cuda")
    picked = [e for e in events if (is_device_kernel(e) if cuda else is_top_level_cpu_op(e))]
    by_name: dict[str, list[float]] = {}
    for e in picked:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    total_us = sum(sum(v) for v in by_name.values())
    categories: dict[str, float] = {}
    for name, times in by_name.items():
        categories[_kernel_category(name)] = categories.get(_kernel_category(name), 0.0) + sum(times)
    wall_ms = wall_s * 1e3
    kernel_ms = total_us / 1e3
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    out = {
        "what": "device kernels: CUDA events, no user annotations, no overhead records"
        if cuda
        else "CPU stand-in: top-level operators (no device kernels on a CPU)",
        "kernel_ms": round(kernel_ms, 4),
        "wall_ms": round(wall_ms, 4),
        "kernel_over_wall": round(kernel_ms / wall_ms, 4) if wall_ms > 0 else None,
        # one stream cannot run more kernel time than the run's wall time: more means events counted twice
        "double_counted": kernel_ms > wall_ms * 1.01,
        "launches": len(picked),
        "steps": steps,
        "launches_per_step": round(len(picked) / steps, 2),
        "categories": {k: round(v / total_us, 4) for k, v in sorted(categories.items())} if total_us else {},
        "top": [
            {
                "name": name[:120],
                "ms": round(sum(times) / 1e3, 4),
                "calls": len(times),
                "share": round(sum(times) / total_us, 4) if total_us else 0.0,
            }
            for name, times in ranked[:top]
        ],
    }
    if layers:
        out["launches_per_step_per_layer"] = round(len(picked) / steps / layers, 2)
    return out


class _Hook:
    """A callable that calls ``fn`` where one is set: bench.decode_workload's ``on_first_token``, through which a
    profile starts when the decode steps begin."""

    fn: Callable[[], object] | None = None

    def __call__(self):
        if self.fn is not None:
            self.fn()


def kernel_profile(
    run: Callable[[], float], device: str, hook: _Hook | None = None, steps: int = 1, layers: int | None = None
) -> dict:
    """One call of a workload (already warm) under torch.profiler, summarized by :func:`summarize_kernels` against
    the seconds the call itself measured (its synchronized clock). Decode workloads pass their ``hook``: the profile
    then starts when the first token has been chosen, so it holds the decode steps only."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    started = []

    def start():
        _sync(device)  # the prompt's kernels finish before the profile begins
        prof.start()
        started.append(True)

    try:
        if hook is None:
            start()
            seconds = run()
        else:
            hook.fn = start
            seconds = run()
    finally:
        if hook is not None:
            hook.fn = None
        if started:
            _sync(device)
            prof.stop()
    return summarize_kernels(prof.events(), seconds, device, steps, layers)


# ----------------------------------------------------------------------------------------------------------------
# Speed
# ----------------------------------------------------------------------------------------------------------------


def memory_rows(models: dict[str, torch.nn.Module], plan: bench.Plan) -> list[dict]:
    """bench.py's three memory workloads, as growth of ``torch.cuda.max_memory_allocated`` over the resident model
    (+ optimizer state for training) during the second of two runs (the first warms allocator pools and creates the
    optimizer state). GPU memory is deterministic: one measured run per model."""
    rows = []
    for workload, label in (
        ("prefill", "prefill {}x{}".format(*plan.memory_prefill)),
        ("decode", f"decode b{plan.memory_decode_batch}"),
        ("train", "train {}x{}".format(*plan.train_shape)),
    ):
        stats = {}
        for kind, model in models.items():
            if workload == "prefill":
                run = bench.prefill_workload(model, *plan.memory_prefill)
            elif workload == "decode":
                run = bench.decode_workload(model, plan.memory_decode_batch, plan.prompt_len, plan.new_tokens)
            else:
                run = bench.train_workload(model, *plan.train_shape)
            run()
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run()
            torch.cuda.synchronize()
            growth = (torch.cuda.max_memory_allocated() - base) / 2**20
            stats[kind] = harness.summarize([growth]) | {"resident_mib": base / 2**20}
            del run
            gc.collect()
        rows.append(bench.with_ratios({"item": f"peak MiB {label}", "family": "memory", "length": None}, stats, "MiB"))
    return rows


# V1's attention arithmetic per formulation, beyond bench.forward_flops's ("combined": both maps' scores, a Llama's
# QKᵀ, then (A1 − λA2) times the 2d-wide value once, a Llama's PV; what the CPU kernels and the decode kernel compute).
# "one_pass" (two SDPA calls, the repeated-value call, the Triton kernel) multiplies both maps by the value: + one
# Llama PV. "padded" (one standard call with zero-padded queries) also computes 2d-wide scores: + one QKᵀ + one PV.
V1_FORMULATIONS = {"combined": 0, "one_pass": 1, "padded": 2}


def v1_extra_flops(config, spec: dict, plan: bench.Plan, formulation: str) -> float:
    """FLOPs a V1 model computes under ``formulation`` beyond bench.forward_flops, for the row ``spec`` (the timed part:
    decode steps after the prompt, or the prefill / training step; training ×3)."""
    units = V1_FORMULATIONS[formulation]
    per_key = 2 * config.num_attention_heads * config.head_dim * config.num_hidden_layers  # one Llama QKᵀ or PV
    if spec["family"] == "decode":
        keys = sum(plan.prompt_len + j + 1 for j in range(plan.new_tokens - 1))  # one query over its visible keys
        return units * per_key * keys * spec["args"][0]
    batch, seq = spec["args"][:2]
    return units * per_key * batch * seq * (seq + 1) / 2 * (3 if spec["family"] == "train" else 1)


def kernel_record(model, workload: str, compiled: bool = False) -> dict | None:
    """The kernel a differential model's attention ran in the row just measured: ``last`` (``module.last_kernel``
    after the row's last call) and ``selected`` (the dispatch's ``select_kernel`` for this device, workload and dtype);
    None for a model without differential attention. Either is None where this version of the package lacks it.
    ``compiled``: the modules record no kernel inside torch.compile (their ``last_kernel`` is the eager prompt's), so
    the dispatch's choice stands alone."""
    version = getattr(model.config, "diff_version", None)
    if version is None:
        return None
    from difftransformer import modeling_difftransformer as mdt

    selected = None
    select = getattr(mdt, "select_kernel", None)
    if select is not None:
        try:
            selected = select(version, model.device.type, workload, model.dtype)
        except Exception as exc:  # recorded, not fatal: the row's numbers stand without it
            selected = f"error: {type(exc).__name__}: {exc}"[:200]
    return {"last": None if compiled else kernels_used(model), "selected": selected}


def v1_formulation(model, spec: dict, kernel: dict | None) -> str:
    """The formulation V1's attention computed in a row: that of the kernel it ran (``kernel_record``), else what the
    code before the dispatch's ``select_kernel`` ran (the Triton kernel where it runs, the CPU kernels on a CPU, the
    padded call for prompts and the decode kernel for decoding elsewhere)."""
    names = (kernel or {}).get("last") or []
    name = names[0] if len(names) == 1 else (kernel or {}).get("selected")
    if name in KERNEL_FORMULATION:
        return KERNEL_FORMULATION[name]
    from difftransformer import modeling_difftransformer as mdt

    device = model.device
    triton_devices, runs_on = getattr(mdt, "TRITON_KERNEL_DEVICES", ()), getattr(mdt, "triton_runs_on", None)
    if device.type in triton_devices and runs_on is not None and runs_on(device):
        return "one_pass"
    if device.type in getattr(mdt, "BLOCKED_KERNEL_DEVICES", ("cpu",)) or spec["family"] == "decode":
        return "combined"
    return "padded"


def _annotate(row: dict, spec: dict, models: dict[str, torch.nn.Module], plan: bench.Plan) -> None:
    """Every model's FLOPs (bench.py's ``forward_flops`` / ``generation_flops``), achieved TFLOP/s where the row is a
    prefill or a training step, and for differential models the kernel their attention ran and the FLOP floor (FLOPs
    over the Llama's; V1: of the formulation its kernel computes, with the other two beside it)."""
    configs = {kind: m.config for kind, m in models.items()}
    workload = spec["family"]
    for kind, stats in row["models"].items():
        cfg = configs[kind]
        if spec["family"] == "decode":  # the timed part: the decode steps after the prompt's forward
            flops = bench.generation_flops(cfg, plan.prompt_len, plan.new_tokens) - bench.forward_flops(
                cfg, plan.prompt_len, 1
            )
            flops *= spec["args"][0]
        else:
            batch, seq = spec["args"][:2]
            logits = 1 if spec["family"] == "prefill" else seq
            flops = batch * bench.forward_flops(cfg, seq, logits) * (3 if spec["family"] == "train" else 1)
            if stats.get("median"):
                stats["tflops"] = flops / stats["median"] / 1e12
        stats["flops"] = flops
        kernel = kernel_record(models[kind], workload, compiled=row.get("group") == "decode_compiled")
        if kernel is not None:
            stats["kernel"] = kernel
    base = row["models"].get("llama", {}).get("flops")
    for kind, stats in row["models"].items():
        version = getattr(configs[kind], "diff_version", None)
        if kind == "llama" or not base or version is None:
            continue
        stats["flop_floor"] = stats["flops"] / base
        if version == 1:  # the floor of the formulation the kernel computes
            floors = {
                f: (stats["flops"] + v1_extra_flops(configs[kind], spec, plan, f)) / base for f in V1_FORMULATIONS
            }
            stats["flop_floors"] = floors
            stats["formulation"] = v1_formulation(models[kind], spec, stats.get("kernel"))
            stats["flop_floor"] = floors[stats["formulation"]]


# The targets the GPU run is judged against (bf16, the 1B shape, paired against the Llama in one run): model → (row
# kind, batch or None for every batch, what the ratio is taken over, limit). V2 ≤ 1.03× the Llama in every time row,
# eager and compiled decoding at every batch included; V1 ≤ 1.10× the FLOP floor of the formulation it runs in prefill
# and training, decoding at batch 1 ≤ 1.10× the Llama compiled and ≤ 1.25× eager, training peak memory ≤ 1.05×.
# The SmolLM2 V2 upcycle (rows of runs before 2026-11-29): ≤ 1.05× its FLOP floor.
GPU_TARGETS = {
    "ours_v2": [
        ("prefill", None, "llama", 1.03),
        ("train", None, "llama", 1.03),
        ("decode", None, "llama", 1.03),
        ("decode_compiled", None, "llama", 1.03),
    ],
    "ours_v1": [
        ("prefill", None, "floor", 1.10),
        ("train", None, "floor", 1.10),
        ("decode", 1, "llama", 1.25),
        ("decode_compiled", 1, "llama", 1.10),
        ("memory_train", None, "llama", 1.05),
    ],
    "upcycle_v2": [("prefill", None, "floor", 1.05), ("train", None, "floor", 1.05), ("decode", None, "floor", 1.05)],
}


def row_kind(row: dict) -> tuple[str, int | None]:
    """(prefill, train, decode, decode_compiled, memory_train or memory; the decode batch or None) of a speed row."""
    family, item = row.get("family"), row["item"]
    if family == "memory":
        return ("memory_train" if "train" in item else "memory"), None
    if family == "decode":
        batch = int(item.split()[1].removeprefix("b"))
        return ("decode_compiled" if "compile" in item else "decode"), batch
    return family, None


def gpu_target(kind: str, row: dict) -> dict | None:
    """Model ``kind``'s target in a speed row, judged: ``{ratio, limit, against, met, settled}`` (``ratio``: the paired
    ratio, the median of per-round ratios, where the row has one; over the FLOP floor where the target is a floor;
    ``settled``: the per-round ratios' quartiles lie on one side of the limit), or None where none applies."""
    stats = row.get("models", {}).get(kind)
    if not stats:
        return None
    family, batch = row_kind(row)
    target = next((t for t in GPU_TARGETS.get(kind, []) if t[0] == family and t[1] in (None, batch)), None)
    ratio = stats.get("paired_ratio") or stats.get("ratio")
    if target is None or ratio is None:
        return None
    _, _, against, limit = target
    scale = 1.0
    if against == "floor":
        scale = stats.get("flop_floor")
        if not scale:
            return None
        against = f"{stats.get('formulation', 'FLOP')} floor"
    judged = ratio / scale
    quartiles = stats.get("paired_quartiles")
    settled = quartiles is None or quartiles[1] / scale <= limit or quartiles[0] / scale > limit
    return {"ratio": judged, "limit": limit, "against": against, "met": judged <= limit, "settled": settled}


def judge(row: dict) -> dict:
    """Every targeted model of a row, judged (:func:`gpu_target`), stored as ``row["targets"]``."""
    row["targets"] = {kind: t for kind in row.get("models", {}) if (t := gpu_target(kind, row)) is not None}
    return row["targets"]


def _row_workload(group: str, model, spec: dict, plan: bench.Plan, profile: Profile, hook: _Hook):
    if group == "prefill":
        return bench.prefill_workload(model, *spec["args"])
    if group in ("decode", "decode_compiled"):
        compiled = group == "decode_compiled"
        return bench.decode_workload(
            model,
            spec["args"][0],
            plan.prompt_len,
            plan.new_tokens,
            "static" if compiled else "dynamic",
            compiled,
            on_first_token=hook,
            compile_options=profile.compile_options if compiled else None,
        )
    return bench.train_workload(model, *spec["args"])


class _Guarded:
    """A workload that keeps its first exception instead of raising it, then returns NaN without running: a model that
    cannot run a row (a kernel failing on this GPU, memory) costs that model its cells, not the others their row."""

    def __init__(self, run: Callable[[], float]):
        self.run, self.error = run, None

    def __call__(self) -> float:
        if self.error is not None:
            return math.nan
        try:
            return self.run()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"[:1000]
            return math.nan


def measure_row(
    rec: Recorder, group: str, spec: dict, models: dict[str, torch.nn.Module], plan: bench.Plan, profile: Profile
) -> dict:
    """One speed row of ``group``: every model interleaved and paired (``harness.run_interleaved``, the first untimed
    call traced for the code record), annotated, judged; compiled rows first call each model twice untimed (compile
    and CUDA-graph capture) and report those calls' seconds; a row that misses a target gets kernel-only profiles of
    the missing models and of the Llama. A model whose workload raises leaves the row (``failed``: why); the row
    fails only with the Llama."""
    device = profile.device
    hooks = {kind: _Hook() for kind in models}
    runs = {kind: _Guarded(_row_workload(group, m, spec, plan, profile, hooks[kind])) for kind, m in models.items()}
    compiled: dict[str, dict] = {}
    if group == "decode_compiled":
        from torch._dynamo.utils import counters

        for kind, run in runs.items():
            calls, graphs = [], counters["stats"]["unique_graphs"]
            for _ in range(2):
                start = time.perf_counter()
                run()
                _sync(device)
                calls.append(time.perf_counter() - start)
            if run.error is not None:
                continue
            compiled[kind] = {
                "first_call_s": round(calls[0], 2),
                "second_call_s": round(calls[1], 2),
                "compile_s": round(max(0.0, calls[0] - calls[1]), 2),
                # generate() took its compiled call, and Dynamo compiled graphs for this batch
                "compiled_path": hasattr(models[kind], "_compiled_call"),
                "graphs_compiled": counters["stats"]["unique_graphs"] - graphs,
                "compile_options": {"fullgraph": False} | profile.compile_options,
            }
            rec.log(
                f"{rec.stamp()} COMPILED {kind} {spec['item']}: first call {calls[0]:.1f} s, second {calls[1]:.1f} s"
            )
    stats = harness.run_interleaved(runs, plan.reps, plan.warmup)
    failed = {kind: run.error for kind, run in runs.items() if run.error is not None}
    if "llama" in failed:
        raise RuntimeError(f"the Llama's {spec['item']} raised: {failed['llama']}")
    row = bench.with_ratios(spec, {k: v for k, v in stats.items() if k not in failed}, unit="s") | {"group": group}
    if failed:
        row["failed"] = failed
        rec.log(f"{rec.stamp()} FAILED  {spec['item']}: " + "; ".join(f"{k}: {e[:200]}" for k, e in failed.items()))
    for kind, info in compiled.items():
        row["models"][kind] |= info
    _annotate(row, spec, {k: m for k, m in models.items() if k not in failed}, plan)
    missed = [kind for kind, t in judge(row).items() if not t["met"]]
    if missed:
        row["profiles"] = {}
        steps = plan.new_tokens - 1 if spec["family"] == "decode" else 1
        for kind in ["llama", *missed]:
            if not rec.budget.allows(PROFILE_RESERVE_S):
                row["profiles"][kind] = {"skipped": "time budget"}
                continue
            try:
                row["profiles"][kind] = kernel_profile(
                    runs[kind].run,
                    device,
                    hooks[kind] if spec["family"] == "decode" else None,
                    steps,
                    models[kind].config.num_hidden_layers,
                ) | {"row_median_ms": row["models"][kind]["median"] * 1e3}
            except Exception as exc:  # the row stands without its profile
                row["profiles"][kind] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    del runs
    return row


def launch_counts(models: dict[str, torch.nn.Module], plan: bench.Plan, device: str, batch: int = 1) -> dict:
    """Per model: a kernel-only profile of eager decoding at ``batch`` (dynamic cache), its decode steps only:
    kernel launches per step and per step and layer (embedding, final norm, LM head and sampling included), kernel
    time against wall time per step. Where the launches' host time exceeds the kernels' time, decoding is host-bound."""
    out = {}
    for kind, model in models.items():
        hook = _Hook()
        run = bench.decode_workload(model, batch, plan.prompt_len, plan.new_tokens, on_first_token=hook)
        run()  # warm
        prof = kernel_profile(run, device, hook, plan.new_tokens - 1, model.config.num_hidden_layers)
        prof["kernel_ms_per_step"] = round(prof["kernel_ms"] / prof["steps"], 4)
        prof["wall_ms_per_step"] = round(prof["wall_ms"] / prof["steps"], 4)
        out[kind] = prof
    return out


def _models_of(group: str, s: SpeedShape, profile: Profile, notes: list[str]) -> tuple[str, ...]:
    """The models a group's rows compare."""
    if group == "decode_compiled":
        return tuple(k for k in s.models if k in s.compiled_models)
    if group.startswith("train") and "diffllama" in s.models and profile.device.startswith("cuda"):
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        if gib < TRAIN_ALL_MIN_GIB:
            note = (
                "DiffLlama is left out of the training rows (and waits in CPU memory meanwhile): every model's AdamW "
                f"state is held at once and {len(s.models)} models do not fit {gib:.0f} GiB with a training step"
            )
            if note not in notes:
                notes.append(note)
            return tuple(k for k in s.models if k != "diffllama")
    return s.models


def _place(built: dict[str, torch.nn.Module], kinds: tuple[str, ...], device: str) -> None:
    """The models of a row on ``device``; on CUDA, models a row leaves out (DiffLlama in training on a smaller card)
    wait in CPU memory, so that their weights do not take the GPU memory the others' training needs."""
    if not device.startswith("cuda"):
        return
    moved = False
    for kind, model in built.items():
        where = device if kind in kinds else "cpu"
        if model.device.type != torch.device(where).type:
            model.to(where)
            moved = True
    if moved:
        _free(device)


def run_speed(rec: Recorder, profile: Profile) -> None:
    """The speed rows of every shape, group by group (``SPEED_ORDER``), each row within the part's time, then after
    the eager decode rows the launch counts."""
    device, dtype = profile.device, DTYPES[profile.speed_dtype]
    cuda = device.startswith("cuda")
    harness.set_clock("cuda" if cuda else "wall")
    speed = rec.report["speed"]
    speed.update(
        dtype=profile.speed_dtype,
        clock="cuda (synchronized wall)" if cuda else "wall",
        shapes={},
        skipped=[],
        launches={},
    )
    for s in profile.speed_shapes:
        entry = speed["shapes"][s.name] = {
            "shape": asdict(s.shape),
            "plan": asdict(s.plan),
            "models": list(s.models),
            "compiled_models": [k for k in s.models if k in s.compiled_models],
            "results": [],
            "notes": [],
        }
        built: dict[str, torch.nn.Module] = {}
        compile_rate = COMPILE_S_PER_LAYER
        for group in SPEED_ORDER:
            kinds = _models_of(group, s, profile, entry["notes"])
            plan = s.plan
            if group == "decode_compiled":
                plan = replace(plan, decode_batches=list(profile.compiled_decode_batches))
            items = bench.group_items(group, plan) if group != "memory" else [{"item": "peak MiB", "args": None}]
            model_layers = s.shape.num_hidden_layers * len(kinds)
            for spec in items:
                label = f"{s.name}: {spec['item']}"
                reason = None
                if group == "memory" and not cuda:
                    reason = "skipped: peak GPU memory needs CUDA"
                elif group == "decode_compiled" and spec["args"][0] in profile.skip_compiled_rows:
                    reason = profile.skip_compiled_rows[spec["args"][0]]
                elif not rec.budget.allows(RESERVE_S.get(group, COMPILE_BASE_S + compile_rate * model_layers)):
                    reason = "skipped: time budget"
                if reason:
                    speed["skipped"].append({"shape": s.name, "item": spec["item"], "reason": reason})
                    rec.log(f"{rec.stamp()} SKIPPED {label}: {reason}")
                    rec.save()
                    continue
                start = time.perf_counter()
                try:
                    if not built:
                        with torch.device(device):  # random init on the device: fast for the 1B-class shape
                            built.update({m: bench.build_model(m, s.shape, dtype).to(device) for m in s.models})
                    _place(built, kinds, device)
                    models = {k: built[k] for k in kinds}
                    if group == "memory":
                        rows = memory_rows(models, plan)
                        for row in rows:
                            judge(row)
                    else:
                        rows = [measure_row(rec, group, spec, models, plan, profile)]
                except Exception as exc:  # the row is reported failed; the others go on
                    torch._dynamo.reset()
                    rows = [
                        {
                            "item": spec["item"],
                            "error": f"{type(exc).__name__}: {exc}"[:1500],
                            "traceback": traceback.format_exc()[-1500:],
                            "models": {},
                        }
                    ]
                for row in rows:
                    row["seconds"] = round(time.perf_counter() - start, 1)
                if group == "decode_compiled" and "error" not in rows[0]:
                    compile_rate = max(0.2, (rows[0]["seconds"] - COMPILE_BASE_S) / model_layers)
                entry["results"] += rows
                rec.log(
                    f"{rec.stamp()} {'ERROR' if 'error' in rows[0] else 'DONE'}    {label}"
                    + (f": {rows[0]['error'][:200]}" if "error" in rows[0] else "")
                )
                rec.save()
                _free(device)
            if group == "decode" and built:
                if rec.budget.allows(PROFILE_RESERVE_S * len(s.models)):
                    try:
                        speed["launches"][s.name] = launch_counts(built, s.plan, device)
                    except Exception as exc:
                        speed["launches"][s.name] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
                else:
                    speed["launches"][s.name] = {"skipped": "time budget"}
                rec.log(f"{rec.stamp()} PROFILED {s.name}: kernel launches per decode step")
                rec.save()
        built.clear()
        _free(device)


# ----------------------------------------------------------------------------------------------------------------
# One layer's attention, by every candidate kernel
# ----------------------------------------------------------------------------------------------------------------

# (row, batch, query tokens, keys, backward): Llama-3.2-1B's workloads for one layer.
ATTENTION_SHAPES = (
    ("prefill 1x8192", 1, 8192, 8192, False),
    ("prefill 8x2048", 8, 2048, 2048, False),
    ("train 8x2048", 8, 2048, 2048, True),
    ("decode b1 s4096", 1, 1, 4096, False),
    ("decode b32 s4096", 32, 1, 4096, False),
)
SMOKE_ATTENTION_SHAPES = (
    ("prefill 1x32", 1, 32, 32, False),
    ("train 1x16", 1, 16, 16, True),
    ("decode b2 s24", 2, 1, 24, False),
)
# The kernel functions the candidates call: (module, function) per candidate (modeling_difftransformer.select_kernel's
# names). Missing functions make their candidate "absent" (the package version before them), never the row fail.
CANDIDATE_FUNCTIONS = {
    "sdpa_two_calls": ("kernels_difftransformer", "sdpa_two_calls_attention"),
    "sdpa_repeated_value": ("kernels_difftransformer", "sdpa_repeated_value_attention"),
    "decode_kernel": ("kernels_difftransformer", "differential_decode_attention"),
    "triton": ("kernels.triton.attention", "differential_attention_triton"),
}
# SDPA backends, by the names of the operators and kernels a call ran (first match wins).
SDPA_BACKENDS = (
    ("cudnn", ("cudnn",)),
    ("flash", ("flash_attention", "flash_fwd", "flash_bwd", "pytorch_flash")),
    ("mem_efficient", ("efficient_attention", "fmha")),
    ("math", ("_scaled_dot_product_attention_math",)),
    ("triton", ("_diff_attn",)),
)


def sdpa_backends(names) -> list[str]:
    """The attention backends that operator and kernel ``names`` show (``SDPA_BACKENDS``), in order of first
    appearance."""
    found = []
    for name in names:
        low = name.lower()
        for backend, patterns in SDPA_BACKENDS:
            if any(p in low for p in patterns):
                if backend not in found:
                    found.append(backend)
                break
    return found


def attention_candidates(b: int, t: int, s: int, hq: int, hkv: int, d: int, dtype, device, backward: bool):
    """V1 attention of one layer by every candidate kernel, plus the same-shape Llama's attention (``hq`` query heads
    of width d over ``hkv`` KV heads, SDPA with GQA) as the baseline: ``(runs, absent, state)``, runs being name → a
    function that runs it (forward, and ``out.backward(dout)`` where ``backward``: the upstream gradient a layer gets,
    no reduction's extra kernels; ``step=False``: the forward alone) and returns its output, absent name → why it is
    not there, state the shared ``inputs`` (query, key, value, λ) and each candidate's ``douts``. The V1 inputs are the
    kernels' own: query ``(B, T, 2H, d)`` in q_proj's row order, key and value ``(B, Hkv, S, d)`` (the cache layout), λ
    a 0-dim float32 tensor, no mask (causal)."""
    import importlib

    import torch.nn.functional as F

    from difftransformer.kernels_difftransformer import query_padding
    from difftransformer.modeling_difftransformer import pack_groups

    g, n = hkv // 2, hq // hkv
    scaling = d**-0.5
    gen = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(b, t, hq, d, device=device, dtype=dtype, generator=gen)
    key, value = (torch.randn(b, hkv, s, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    lam = torch.tensor(0.3, device=device, requires_grad=backward)
    causal = t > 1
    inputs = (query, key, value, lam)
    for x in (query, key, value):
        x.requires_grad_(backward)
    douts: dict[str, torch.Tensor] = {}

    def done(name, out, step):
        if backward and step:
            for x in inputs:
                x.grad = None
            if name not in douts:  # one fixed upstream gradient per candidate, drawn once
                douts[name] = torch.randn(
                    out.shape, device=device, dtype=out.dtype, generator=torch.Generator(device=device).manual_seed(1)
                )
            out.backward(douts[name])
        return out

    def llama(step=True):
        q = query.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, key, value, is_causal=causal, enable_gqa=True)
        return done("llama_sdpa", out, step)

    def padded(step=True):  # one call, [Q1|0] and [0|Q2] over packed (B, G, S, 2d) groups: every other backend's
        pad = query_padding(n, n, dtype, device)
        q = (query.unflatten(2, (g, 2 * n, 1)) * pad).reshape(b, t, hq, 2 * d).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, pack_groups(key), pack_groups(value), is_causal=causal, scale=scaling, enable_gqa=True
        )  # the scale of width d: the padding adds zeros
        out = out.transpose(1, 2).unflatten(2, (g, 2, n))
        return done("padded", (out[:, :, :, 0] - lam * out[:, :, :, 1]).flatten(2, 3), step)  # (B, T, H, 2d)

    runs: dict[str, Callable[[], torch.Tensor]] = {"llama_sdpa": llama, "padded": padded}
    absent: dict[str, str] = {}
    for name, (module_name, function) in CANDIDATE_FUNCTIONS.items():
        if name == "decode_kernel" and t != 1:
            continue  # one token only
        module = importlib.import_module(f"difftransformer.{module_name}")
        fn = getattr(module, function, None)
        if fn is None:
            absent[name] = f"absent: difftransformer.{module_name} has no {function}"
            continue
        if name == "triton" and not module.is_available(torch.device(device)):
            absent[name] = "absent: the Triton kernel does not run here (no CUDA device, TRITON_INTERPRET unset)"
            continue
        if name == "decode_kernel":

            def call(fn=fn, name=name, step=True):
                return done(name, fn(query, key, value, lam, scaling), step)
        elif name == "triton":

            def call(fn=fn, name=name, step=True):
                return done(name, fn(query, key, value, lam, scaling, n), step)
        else:

            def call(fn=fn, name=name, step=True):
                return done(name, fn(query, key, value, None, lam, scaling, n), step)

        runs[name] = call
    return runs, absent, {"inputs": inputs, "douts": douts}


def _backends_of(fn: Callable[[], object], device: str) -> dict:
    """The SDPA backends (and top kernels) one call of ``fn`` ran, from a short profile: the names of its operators
    (e.g. ``aten::_scaled_dot_product_cudnn_attention``) and, on CUDA, of its kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        _sync(device)
    events = prof.events()
    ops = sorted(
        {
            e.name
            for e in events
            if "attention" in e.name.lower() or "scaled_dot_product" in e.name.lower()
            if not is_device_kernel(e)
        }
    )
    kernels = [e for e in events if is_device_kernel(e)]
    totals: dict[str, float] = {}
    for e in kernels:
        totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us()
    top = [name[:120] for name, _ in sorted(totals.items(), key=lambda kv: -kv[1])[:5]]
    return {"backends": sdpa_backends(ops + list(totals)), "ops": ops, "top_kernels": top}


def run_attention_micro(rec: Recorder, profile: Profile) -> None:
    """``attention[rows]``: one layer's attention at the 1B head counts by every candidate
    (:func:`attention_candidates`), interleaved, medians and paired ratios to the Llama's SDPA call, the SDPA backend
    each ran, and each V1 candidate's largest difference from the padded call (its forward output; an explicitly
    causal standard call): the data for V1's dispatch table."""
    device, dtype = profile.device, DTYPES[profile.speed_dtype]
    harness.set_clock("cuda" if device.startswith("cuda") else "wall")
    hq, hkv, d = profile.attention_heads
    out = rec.report["attention"] = {"heads": [hq, hkv, d], "dtype": profile.speed_dtype, "rows": []}
    for name, b, t, s, backward in profile.attention_shapes or ATTENTION_SHAPES:
        if not rec.budget.allows(ATTENTION_RESERVE_S):
            out["rows"].append({"item": name, "skipped": "time budget"})
            rec.save()
            continue
        try:
            runs, absent, _ = attention_candidates(b, t, s, hq, hkv, d, dtype, device, backward)
            for kind, why in profile.skip_candidates.items():
                if runs.pop(kind, None) is not None:
                    absent[kind] = why
            failed, outputs = dict(absent), {}
            for kind, fn in list(runs.items()):  # one candidate that cannot run must not cost the others their row
                try:
                    outputs[kind] = fn().detach()
                except Exception as exc:
                    failed[kind] = f"{type(exc).__name__}: {exc}"[:500]
                    del runs[kind]
            if "llama_sdpa" not in runs:
                raise RuntimeError(f"the Llama's SDPA call failed: {failed['llama_sdpa']}")
            stats = harness.run_interleaved(
                {k: _timed(f) for k, f in runs.items()}, reps=max(profile_reps(profile), 4), warmup=2, trace=False
            )
            base = stats["llama_sdpa"]
            row = {"item": name, "backward": "out.backward(dout)" if backward else None, "models": {}, "failed": failed}
            reference = outputs.get("padded")
            for kind, st in stats.items():
                entry = {"median_ms": st["median"] * 1e3, "ratio": st["median"] / base["median"]}
                if len(st.get("samples", ())) >= 4:
                    entry["paired_ratio"], entry["paired_quartiles"] = harness.paired(st["samples"], base["samples"])
                if kind != "llama_sdpa" and reference is not None:
                    scale = reference.double().abs().max().item()
                    diff = _max_abs(outputs[kind], reference)
                    # bf16 outputs round at 2⁻⁸ of their size: a kernel that computes something else is off by far more
                    entry |= {"max_diff_vs_padded": diff, "disagrees": diff > 0.05 * max(scale, 1e-30)}
                try:
                    entry |= _backends_of(runs[kind], device)
                except Exception as exc:  # the timing stands without the backend's name
                    entry["backends_error"] = f"{type(exc).__name__}: {exc}"[:300]
                row["models"][kind] = entry
        except Exception as exc:
            row = {"item": name, "error": f"{type(exc).__name__}: {exc}"[:1500]}
        out["rows"].append(row)
        rec.log(f"{rec.stamp()} {'ERROR' if 'error' in row else 'DONE'}    attention {name}")
        rec.save()
        _free(device)


def _timed(fn: Callable[[], object]) -> Callable[[], float]:
    """``fn`` as a run that times itself with the harness's clock (synchronized on CUDA)."""

    def run() -> float:
        start = harness.now()
        fn()
        return harness.now() - start

    return run


def profile_reps(profile: Profile) -> int:
    return max((s.plan.reps for s in profile.speed_shapes), default=5)


# ----------------------------------------------------------------------------------------------------------------
# The Triton tuning sweep
# ----------------------------------------------------------------------------------------------------------------


def run_tuning(rec: Recorder, profile: Profile) -> None:
    """``tuning``: ``attention.tuning_sweep`` (per kernel and problem, each launch configuration's time and
    the best), where the module has it and the Triton kernel runs: on the GPU over its default problems (Llama-3.2-1B's
    attention) in bf16, its own time capped by what is left of the part (``budget_s``); in smoke mode over the module's
    ``SWEEP_SMOKE_SHAPES`` in fp32, in this process (the interpreter's times are not timings: only the sweep's logic
    runs). "absent" or "skipped" with the reason otherwise. It starts only with ``TUNING_MIN_S`` of the part's time
    left."""
    import inspect

    from difftransformer.kernels.triton import attention as triton_difftransformer

    sweep = getattr(triton_difftransformer, "tuning_sweep", None)
    smoke_shapes = getattr(triton_difftransformer, "SWEEP_SMOKE_SHAPES", None)
    start = time.perf_counter()
    out: dict = {}
    if sweep is None:
        out = {"status": "absent", "reason": "absent: difftransformer.kernels.triton.attention has no tuning_sweep"}
    elif profile.tuning:
        out = {"status": "skipped", "reason": profile.tuning}
    elif profile.mode == "smoke" and smoke_shapes is None:
        out = {"status": "skipped", "reason": "skipped: smoke mode, and the module has no SWEEP_SMOKE_SHAPES"}
    elif not triton_difftransformer.is_available(torch.device(profile.device)):
        out = {"status": "absent", "reason": "absent: the Triton kernel does not run here"}
    elif not rec.budget.allows(TUNING_MIN_S):
        out = {"status": "skipped", "reason": "skipped: time budget"}
    if not out:
        params = inspect.signature(sweep).parameters
        kwargs: dict = {"dtype": DTYPES[profile.speed_dtype], "device": profile.device}
        if profile.mode == "smoke":
            kwargs["shapes"] = smoke_shapes
            if "workers" in params:
                kwargs["workers"] = 0  # no compile processes for a few interpreted kernels
        if "budget_s" in params:
            left = rec.budget.deadline_s - rec.budget.elapsed() - 5.0
            default = params["budget_s"].default
            kwargs["budget_s"] = max(5.0, min(left, default) if isinstance(default, (int, float)) else left)
        try:
            out = {
                "status": "done",
                "arguments": {k: str(v) if k == "dtype" else v for k, v in kwargs.items() if k != "shapes"}
                | {"shapes": "smoke" if "shapes" in kwargs else "default"},
                "result": sweep(**kwargs),
            }
            # Later Triton timings in this process run the configurations the sweep picked, without autotuning each
            # new shape (which would compile every configuration again).
            pin = getattr(triton_difftransformer, "set_configs", None)
            if pin is not None and out["result"].get("pinned"):
                pin(out["result"]["pinned"])
                out["pinned"] = True
        except Exception as exc:
            out = {
                "status": "error",
                "reason": f"{type(exc).__name__}: {exc}"[:1500],
                "traceback": traceback.format_exc()[-1500:],
            }
    out["seconds"] = round(time.perf_counter() - start, 1)
    rec.report["tuning"] = out
    rec.log(
        f"{rec.stamp()} {out['status'].upper():7s} tuning sweep"
        + (f": {out['reason']}" if "reason" in out else f" ({out['seconds']} s)")
    )
    rec.save()
    _free(profile.device)


def tuning_text(tuning: dict) -> str:
    """The tuning sweep's result as the module's own table (``format_sweep``), or its status and reason."""
    head = f"tuning sweep: {tuning['status']}, {tuning.get('seconds', 0)} s"
    if tuning.get("status") != "done":
        return head + (f" ({tuning['reason'][:300]})" if tuning.get("reason") else "")
    from difftransformer.kernels.triton import attention as triton_difftransformer

    formatter = getattr(triton_difftransformer, "format_sweep", None)
    try:
        return head + "\n" + (formatter(tuning["result"]) if formatter else json.dumps(tuning["result"])[:3000])
    except Exception as exc:  # a result the formatter does not know: the JSON holds it
        return head + f" (format_sweep: {type(exc).__name__}: {exc})"


# ----------------------------------------------------------------------------------------------------------------
# Report: tables (the summary's and the docs', through scripts/doc_tables.py), headline
# ----------------------------------------------------------------------------------------------------------------

NAMES = {
    "llama": "Llama",
    "diffllama": "DiffLlama",
    "ours_v1": "V1",
    "ours_v2": "V2",
    "upcycle_v2": "V2 upcycle",
    "upcycle_v1": "V1 upcycle",
}


def _name(kind: str) -> str:
    return NAMES.get(kind, kind)


def _ratio_cell(stats: dict | None) -> str:
    """A model's time over the Llama's: the paired ratio (median of per-round ratios) and its quartiles where the row
    has them, else the ratio of medians."""
    if not stats or stats.get("ratio") is None or stats["ratio"] != stats["ratio"]:
        return "–"
    if "paired_ratio" in stats:
        q1, q3 = stats["paired_quartiles"]
        return f"{stats['paired_ratio']:.2f} [{q1:.2f}–{q3:.2f}]"
    return f"{stats['ratio']:.2f}"


def _value(row: dict, stats: dict | None) -> str:
    if not stats or stats.get("median") is None or stats["median"] != stats["median"]:
        return "–"
    if row.get("unit") == "MiB":
        return f"{stats['median']:.0f} MiB"
    if "tokens_per_s" in stats:
        return f"{stats['tokens_per_s']:.0f} tok/s"
    return f"{stats['median']:.3f} s"


def _kernel_cell(stats: dict | None) -> str:
    """The kernel a differential model ran in a row and, for V1, the floor it is judged against."""
    if not stats:
        return "–"
    kernel = stats.get("kernel") or {}
    names = kernel.get("last") or ([kernel["selected"]] if kernel.get("selected") else [])
    text = ", ".join(names) if names else "not recorded"
    if "formulation" in stats:
        text += f" ({stats['formulation']} floor {stats['flop_floor']:.2f})"
    return text


def _judged_cell(target: dict | None) -> str:
    if target is None:
        return "–"
    mark = "✓" if target["met"] else "✗"
    return f"{target['ratio']:.2f} {'≤' if target['met'] else '>'} {target['limit']:.2f} {mark}" + (
        "" if target["settled"] else " (unsettled)"
    )


def doc_table_speed(datas: list[dict], opts: dict) -> list[str]:
    """The speed table of one shape (``shape=``, default the 1B shape) of a GPU check report: the Llama's value, every
    model's time (or memory) over the Llama's, the kernel each differential model ran (V1: with the FLOP floor it is
    judged against), each targeted model's ratio judged against its GPU target (``GPU_TARGETS``; over the floor where
    the target is one), and the rows that did not run."""
    data = datas[0]
    name = opts.get("shape", "llama-3.2-1b")
    shape = data["speed"]["shapes"][name]
    models = shape["models"]
    others = [m for m in models if m != "llama"]
    diff = [m for m in others if m.startswith(("ours_", "upcycle_"))]
    targeted = [m for m in others if m in GPU_TARGETS]
    head = (
        ["row", "Llama"]
        + [f"{_name(m)} ×" for m in others]
        + [f"{_name(m)} kernel" for m in diff]
        + [f"{_name(m)} judged" for m in targeted]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in shape["results"]:
        if "error" in row:
            lines.append(f"| {row['item']} | error: {row['error'].splitlines()[0][:100]} |" + " – |" * (len(head) - 2))
            continue
        stats = row["models"]
        cells = [row["item"], _value(row, stats.get("llama"))] + [_ratio_cell(stats.get(m)) for m in others]
        cells += [_kernel_cell(stats.get(m)) if row.get("family") != "memory" else "–" for m in diff]
        cells += [_judged_cell(gpu_target(m, row)) for m in targeted]
        lines.append("| " + " | ".join(cells) + " |")
    for skipped in data["speed"].get("skipped", []):
        if skipped["shape"] == name:
            lines.append(
                f"| {skipped['item']} | not run: {skipped['reason'].removeprefix('skipped: ')} |"
                + " – |" * (len(head) - 2)
            )
    return lines


def sign_test(slower: int, n: int) -> float:
    """The exact two-sided sign test's p: ``slower`` of ``n`` paired rounds on one side, under the hypothesis that
    either side is as likely."""
    tail = sum(math.comb(n, k) for k in range(min(slower, n - slower) + 1)) / 2**n
    return min(1.0, 2 * tail)


def doc_table_rounds(datas: list[dict], opts: dict) -> list[str]:
    """Per time row and model of one shape (``shape=``): in how many of the paired rounds the model was slower than
    the Llama, of how many, and the exact two-sided sign test's p (:func:`sign_test`): whether the row's difference
    from the Llama is more than the rounds' noise."""
    shape = datas[0]["speed"]["shapes"][opts.get("shape", "llama-3.2-1b")]
    others = [m for m in shape["models"] if m != "llama"]
    lines = ["| row | " + " | ".join(f"{_name(m)} slower in" for m in others) + " |", "|---|" + "---|" * len(others)]
    for row in shape["results"]:
        base = (row.get("models", {}).get("llama") or {}).get("samples")
        if row.get("unit") != "s" or "error" in row or not base:
            continue
        cells = []
        for kind in others:
            samples = (row["models"].get(kind) or {}).get("samples")
            if not samples or len(samples) != len(base):
                cells.append("–")
                continue
            slower = sum(a > b for a, b in zip(samples, base))
            cells.append(f"{slower} of {len(base)} rounds (p = {sign_test(slower, len(base)):.3g})")
        lines.append(f"| {row['item']} | " + " | ".join(cells) + " |")
    return lines


def doc_table_compile(datas: list[dict], opts: dict) -> list[str]:
    """The compiled decode rows of one shape (``shape=``): per model the first call (compiling and capturing), the
    second, the compile time (their difference) and the steady state's tokens/s."""
    shape = datas[0]["speed"]["shapes"][opts.get("shape", "llama-3.2-1b")]
    lines = [
        "| row | model | first call | second call | compile | steady decode | compiled path |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in shape["results"]:
        if row.get("group") != "decode_compiled" or "error" in row:
            continue
        for kind, stats in row["models"].items():
            lines.append(
                f"| {row['item']} | {_name(kind)} | {stats['first_call_s']:.1f} s | "
                f"{stats['second_call_s']:.1f} s | {stats['compile_s']:.1f} s | "
                f"{stats['tokens_per_s']:.0f} tok/s | {'yes' if stats['compiled_path'] else 'NO'}, "
                f"{stats.get('graphs_compiled', '?')} graphs |"
            )
    return lines


def doc_table_profiles(datas: list[dict], opts: dict) -> list[str]:
    """The kernel-only profiles of the rows that missed a target (``shape=``): per model its kernel time, the profiled
    step's wall time, their ratio, launches per step, time by category and the top kernel."""
    shape = datas[0]["speed"]["shapes"][opts.get("shape", "llama-3.2-1b")]
    lines = [
        "| row | model | kernels | wall | kernels / wall | launches per step | by category | top kernel |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in shape["results"]:
        for kind, prof in (row.get("profiles") or {}).items():
            if "kernel_ms" not in prof:
                lines.append(
                    f"| {row['item']} | {_name(kind)} | {prof.get('skipped') or prof.get('error', '')[:80]} |"
                    + " – |" * 5
                )
                continue
            cats = ", ".join(f"{c} {v:.0%}" for c, v in sorted(prof["categories"].items(), key=lambda x: -x[1])[:3])
            top = prof["top"][0] if prof["top"] else {"name": "–", "share": 0.0}
            lines.append(
                f"| {row['item']} | {_name(kind)} | {prof['kernel_ms']:.2f} ms | {prof['wall_ms']:.2f} ms | "
                f"{prof['kernel_over_wall']:.2f}{' DOUBLE-COUNTED' if prof['double_counted'] else ''} | "
                f"{prof['launches_per_step']:.0f} | {cats} | `{top['name'][:60]}` {top['share']:.0%} |"
            )
    return lines


def doc_table_launches(datas: list[dict], opts: dict) -> list[str]:
    """Kernel launches per eager decode step (batch 1) of every model (``shape=``), per step and layer, and the
    kernels' time against the step's wall time."""
    launches = datas[0]["speed"].get("launches", {}).get(opts.get("shape", "llama-3.2-1b"), {})
    lines = [
        "| model | launches per step | per step and layer | kernel time per step | wall time per step |",
        "|---|---|---|---|---|",
    ]
    for kind, prof in launches.items():
        if not isinstance(prof, dict) or "launches" not in prof:
            lines.append(f"| {_name(kind)} | {prof} | – | – | – |")
            continue
        lines.append(
            f"| {_name(kind)} | {prof['launches_per_step']:.0f} | {prof['launches_per_step_per_layer']:.1f} | "
            f"{prof['kernel_ms_per_step']:.3f} ms | {prof['wall_ms_per_step']:.3f} ms |"
        )
    return lines


def doc_table_attention(datas: list[dict], opts: dict) -> list[str]:
    """One layer's attention by every candidate kernel: median milliseconds, the paired ratio to the Llama's SDPA
    call, and the SDPA backend it ran where the report recorded it."""
    attention = datas[0].get("attention") or {}
    rows = attention.get("rows", [])
    candidates: list[str] = []
    for row in rows:
        for kind in [*row.get("models", {}), *(row.get("failed") or {})]:
            if kind not in candidates:
                candidates.append(kind)
    lines = ["| row | " + " | ".join(candidates) + " |", "|---|" + "---|" * len(candidates)]
    for row in rows:
        if "models" not in row:
            lines.append(
                f"| {row['item']} | not run: {row.get('skipped') or row.get('error', '')[:80]} |"
                + " – |" * (len(candidates) - 1)
            )
            continue
        cells = [row["item"]]
        for kind in candidates:
            stats = row["models"].get(kind)
            if stats is None:
                why = (row.get("failed") or {}).get(kind)
                cells.append("–" if why is None else ("absent" if why.startswith("absent") else "failed"))
                continue
            cell = f"{stats['median_ms']:.3f} ms ×{stats.get('paired_ratio', stats['ratio']):.2f}"
            if stats.get("backends"):
                cell += f" ({', '.join(stats['backends'])})"
            if stats.get("disagrees"):
                cell += " DISAGREES"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def doc_table_checks(datas: list[dict], opts: dict) -> list[str]:
    """Per GPU check report: its arguments, GPU, seconds, and how many checks passed, failed, raised, were skipped
    or absent."""
    kinds = ("pass", "fail", "error", "skipped", "absent")
    lines = ["| run | GPU | seconds | " + " | ".join(kinds) + " |", "|---|---|---|" + "---|" * len(kinds)]
    for d in datas:
        m = d["meta"]
        args = " ".join(a for a in m["argv"] if a not in ("--out", "OUT") and not a.startswith("/"))
        lines.append(
            f"| {args or 'everything'} | {m['gpu']} | {m['elapsed_s']:.0f} | "
            + " | ".join(str(d["counts"].get(k, 0)) for k in kinds)
            + " |"
        )
    return lines


def _check_family(name: str) -> str:
    words = name.split()
    if "flex_attention" in words:
        return "checks: flex attention (every family)"
    if words[0] == "generate" and words[-1] == "compiled-static":
        return "checks: compiled generate"
    return {
        "reference": "checks: reference and forward",
        "forward": "checks: reference and forward",
        "grads": "checks: gradients",
        "generate": "checks: generation",
        "left-padding": "checks: generation",
        "triton": "checks: Triton kernel",
        "liger": "checks: Liger",
    }.get(words[0], "checks: other")


def timing(data: dict) -> dict[str, tuple[float, int]]:
    """Where a run's time went: (seconds, how many) per part or family of rows and checks: the parts' own seconds where
    the report records them, and the sum of the recorded seconds of every speed row (by shape and group) and check
    (by family) that ran."""
    out: dict[str, tuple[float, int]] = {}

    def add(key, seconds):
        total, n = out.get(key, (0.0, 0))
        out[key] = (total + seconds, n + 1)

    for part, info in (data.get("parts") or {}).items():
        if "seconds" in info:
            out[f"part: {part}"] = (info["seconds"], 1)
    for shape, entry in (data.get("speed") or {}).get("shapes", {}).items():
        seen = set()
        for row in entry["results"]:
            group = row.get("group") or (
                "memory"
                if row.get("family") == "memory"
                else "decode_compiled"
                if "compile" in row["item"]
                else "train_ckpt"
                if row["item"].endswith("ckpt")
                else row.get("family", "?")
            )
            if group == "memory":  # the three memory rows share one measurement's seconds
                if "memory" in seen:
                    continue
                seen.add("memory")
            add(f"speed: {shape}: {group}", row.get("seconds") or 0.0)
    for check in data.get("checks", []):
        if check["status"] not in ("skipped", "absent"):
            add(_check_family(check["name"]), check["seconds"])
    return out


def doc_table_timing(datas: list[dict], opts: dict) -> list[str]:
    """How long each part of the run(s) took (:func:`timing`), one column per file."""
    per_file = [timing(d) for d in datas]
    keys: list[str] = []
    for t in per_file:
        keys += [k for k in t if k not in keys]
    heads = [" ".join(a for a in d["meta"]["argv"] if a not in ("--out", "OUT")) or "everything" for d in datas]
    lines = ["| part, rows or checks | " + " | ".join(heads) + " |", "|---|" + "---|" * len(datas)]
    for key in keys:
        cells = [f"{t[key][0]:.0f} s ({t[key][1]})" if key in t else "–" for t in per_file]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append("| whole run | " + " | ".join(f"{d['meta']['elapsed_s']:.0f} s" for d in datas) + " |")
    return lines


def readme_rows(data: dict) -> list[tuple[str, dict[str, str]]]:
    """The README's GPU rows (scripts/doc_tables.py, ``readme``): at Llama-3.2-1B's shape, each model's time over the
    Llama's (the paired median ratio) in prefill 8×2048, the training step 8×2048, eager decoding at batch 1 and,
    where measured, compiled decoding at batch 1; one number per model."""
    rows = {r["item"]: r for r in data["speed"]["shapes"]["llama-3.2-1b"]["results"] if "models" in r}
    where = f"{data['meta'].get('gpu') or 'GPU'}, bf16, Llama-3.2-1B's shape"
    out = []
    for label, item in (
        ("GPU prefill 8×2048", "prefill 8x2048"),
        ("GPU training step 8×2048", "train 8x2048"),
        ("GPU decode at batch 1, dynamic cache", "decode b1 dynamic"),
        ("GPU decode at batch 1, static cache compiled", "decode b1 static+compile"),
    ):
        if item in rows:
            models = rows[item]["models"]
            out.append(
                (
                    f"{label}, time × Llama ({where})",
                    {
                        key: f"{(models[name].get('paired_ratio') or models[name]['ratio']):.2f}"
                        for key, name in (("llama", "llama"), ("v1", "ours_v1"), ("v2", "ours_v2"))
                        if name in models
                    },
                )
            )
    return out


def meta(profile: Profile, argv: list[str]) -> dict:
    import transformers

    import difftransformer

    cuda = profile.device.startswith("cuda")
    commit, dirty, _ = harness.git_state()
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "difftransformer": difftransformer.__version__,
    }
    for package in ("triton", "huggingface_hub", "tokenizers", "safetensors", "accelerate", "flash_attn"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    versions["flash_attn_interface"] = "importable" if importlib.util.find_spec("flash_attn_interface") else None
    return {
        "mode": profile.mode,
        "device": profile.device,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "cpu": harness.cpu_info()["cpu"],
        "versions": versions,
        "git_commit": commit,
        "git_dirty": dirty,
        "source_digest": harness.source_digest(),
        "fp32_matmul_precision": torch.get_float32_matmul_precision(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "budget_s": profile.budget_s,
        "part_budget_s": profile.part_budget_s,
        "argv": argv,
        "elapsed_s": 0.0,
        "finished": False,
    }


def provenance(report_meta: dict, argv: list[str]) -> dict:
    """harness.provenance with the command as it runs (``python -m benchmarks.gpu_check ...``) and the GPU among the
    machine's facts."""
    prov = harness.provenance("gpu_check.py", argv)
    prov["command"] = prov["command"].replace("python benchmarks/gpu_check.py", MODULE_COMMAND, 1)
    if report_meta["gpu"]:
        prov["machine"] |= {"gpu": report_meta["gpu"], "gpu_memory_gib": report_meta["gpu_memory_gib"]}
    return prov


def summary_text(report: dict) -> str:
    """The parts' seconds, one line per check (PASS / FAIL / ERROR / SKIP / ABSENT), then the speed, compile, launch,
    profile and attention tables and the tuning sweep's status."""
    m = report["meta"]
    versions = m["versions"]
    lines = [
        f"GPU check ({m['mode']}) on {m['gpu'] or m['device']}: torch {versions['torch']} (CUDA "
        f"{versions['cuda']}), transformers {versions['transformers']}, Python {versions['python']}; "
        f"commit {m['git_commit']} (dirty: {m['git_dirty']}), sources {m['source_digest']}; {m['elapsed_s']} s"
        + ("" if m.get("finished") else " (CUT SHORT: the run did not finish; what it reached is below)"),
        "",
    ]
    for part, info in (report.get("parts") or {}).items():
        lines.append(
            f"part {part}: "
            + (
                f"{info['seconds']:.0f} s (allowance {info['allowance_s']})"
                if "seconds" in info
                else info.get("status", "")
            )
            + (f"; ERROR {info['error'][:200]}" if info.get("error") else "")
        )
    speed = report.get("speed") or {}
    for name, shape in speed.get("shapes", {}).items():
        s = shape["shape"]
        lines += [
            "",
            f"speed, {name} ({speed['dtype']}, clock {speed['clock']}): hidden {s['hidden_size']}, "
            f"{s['num_hidden_layers']} layers, {s['num_attention_heads']} heads / {s['num_key_value_heads']} KV, "
            f"head_dim {s['head_dim']}, vocab {s['vocab_size']}, MLP {s['intermediate_size']}; ratios: time (or "
            "memory) over the Llama's, paired [quartiles]; judged: against GPU_TARGETS",
        ]
        lines += doc_table_speed([report], {"shape": name}) + [f"note: {n}" for n in shape.get("notes", [])]
        lines += [f"  ERROR {r['item']}: {r['error'][:300]}" for r in shape["results"] if "error" in r]
        lines += [
            f"  FAILED {r['item']}: {_name(k)}: {e[:300]}"
            for r in shape["results"]
            for k, e in (r.get("failed") or {}).items()
        ]
        if any(r.get("group") == "decode_compiled" and "error" not in r for r in shape["results"]):
            lines += ["", f"compiled decoding, {name}:"] + doc_table_compile([report], {"shape": name})
        if any(r.get("profiles") for r in shape["results"]):
            lines += ["", f"kernel-only profiles of the rows that missed a target, {name}:"]
            lines += doc_table_profiles([report], {"shape": name})
        if speed.get("launches", {}).get(name):
            lines += ["", f"kernel launches per eager decode step (batch 1), {name}:"]
            lines += doc_table_launches([report], {"shape": name})
    attention = report.get("attention") or {}
    if attention.get("rows"):
        hq, hkv, d = attention["heads"]
        lines += [
            "",
            f"attention of one layer ({hq} query / {hkv} KV heads of width {d}, {attention['dtype']}): "
            "median ms, paired ratio to the Llama's SDPA call, backends",
        ] + doc_table_attention([report], {})
        for row in attention["rows"]:
            lines += [f"  {row['item']}: {k} {why[:200]}" for k, why in (row.get("failed") or {}).items()]
    tuning = report.get("tuning")
    if tuning:
        lines += ["", tuning_text(tuning)]
    lines += ["", "checks: " + ", ".join(f"{k} {v}" for k, v in report["counts"].items())]
    tags = {"pass": "PASS", "fail": "FAIL", "error": "ERROR", "skipped": "SKIP", "absent": "ABSENT"}
    for c in report["checks"]:
        line = f"{tags[c['status']]:6s} {c['name']}"
        if c["bound"] is not None:
            line += (
                f"  max_err {_fmt(c['max_err'])} ≤ {_fmt(c['bound'])}"
                if c["passed"]
                else f"  max_err {_fmt(c['max_err'])} > {_fmt(c['bound'])}"
            )
        if c["status"] != "pass" and c["detail"]:
            line += f"  ({c['detail'].splitlines()[0][:160]})"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _print(line: str) -> None:
    print(line, flush=True)


RUNNERS = {"speed": run_speed, "attention": run_attention_micro, "tuning": run_tuning, "checks": run_checks}


def run(
    profile: Profile,
    out_dir: str,
    argv: list[str] | None = None,
    parts: tuple[str, ...] = PARTS,
    log: Callable[[str], None] = _print,
    from_import: bool = False,
) -> dict:
    """The whole check, its ``parts`` in ``PARTS``'s order: writes ``gpu_check.json`` (rewritten as it goes) and
    ``gpu_check.txt`` into ``out_dir``. With several parts each starts rows within its allowance
    (``profile.part_budget_s``); a part run alone has the whole budget.

    ``from_import``: the budget counts from this module's import (the command line) instead of from this call."""
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"parts must be among {', '.join(PARTS)}; got {', '.join(unknown)}")
    os.makedirs(out_dir, exist_ok=True)
    budget = Budget(profile.budget_s, _STARTED if from_import else None)
    # Many models and shapes compile the same code: without room, dynamo would silently fall back to eager.
    limit_name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    threads, recompile_limit = torch.get_num_threads(), getattr(torch._dynamo.config, limit_name)
    if profile.threads:
        torch.set_num_threads(profile.threads)
    setattr(torch._dynamo.config, limit_name, max(recompile_limit, 64))
    try:
        argv = list(argv or [])
        report = {
            "meta": meta(profile, argv),
            "parts": {},
            "speed": {},
            "attention": {},
            "tuning": {},
            "checks": [],
            "counts": {},
        }
        report["provenance"] = provenance(report["meta"], argv)
        rec = Recorder(report, out_dir, budget, log)
        log(
            f"GPU check ({profile.mode}) on {report['meta']['gpu'] or profile.device}, versions "
            f"{report['meta']['versions']}, commit {report['meta']['git_commit']}"
        )
        for part in PARTS:
            if part not in parts:
                report["parts"][part] = {"status": "not requested"}
                continue
            allowance = profile.part_budget_s.get(part) if len(parts) > 1 else None
            budget.begin(allowance)
            started = budget.elapsed()
            report["parts"][part] = {"started_s": round(started, 1), "allowance_s": allowance}
            log(f"{rec.stamp()} PART    {part} (may start rows until {budget.deadline_s:.0f} s)")
            try:
                RUNNERS[part](rec, profile)
            except Exception as exc:  # a part that raises loses its own rows, not the other parts
                report["parts"][part]["error"] = (
                    f"{type(exc).__name__}: {exc}"[:1500] + "\n" + traceback.format_exc()[-1500:]
                )
                log(f"{rec.stamp()} ERROR   part {part}: {exc}")
                torch._dynamo.reset()
                _free(profile.device)
            report["parts"][part]["seconds"] = round(budget.elapsed() - started, 1)
            rec.save(code=True)
        report["meta"]["finished"] = True
        rec.save(code=True)
        text = summary_text(report)
        with open(os.path.join(out_dir, SUMMARY), "w") as f:
            f.write(text)
        log(text)
        return report
    finally:
        torch.set_num_threads(threads)
        setattr(torch._dynamo.config, limit_name, recompile_limit)


def parse_parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in parts if p not in PARTS]
    if not parts or unknown:
        raise argparse.ArgumentTypeError(f"--only takes parts among {', '.join(PARTS)}, comma-separated; got {text!r}")
    return parts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=MODULE_COMMAND,
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        default=os.path.join(harness.ROOT, "benchmarks", "results"),
        help=f"folder for {REPORT} and {SUMMARY} (default benchmarks/results/)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes on the CPU, fp32 and bf16, eager and sdpa, "
        "compiled decoding through Dynamo only: every other path runs in seconds (CI)",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda, cpu with --smoke")
    p.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="seconds from the start after which no row "
        f"or check begins; they are recorded as skipped (default {DEFAULT_BUDGET_S:.0f})",
    )
    p.add_argument(
        "--only",
        type=parse_parts,
        default=PARTS,
        help="run only these parts, comma-separated, e.g. "
        f"'checks' or 'speed,attention' (default all: {','.join(PARTS)}); a part alone has the whole budget",
    )
    p.add_argument("--digest", action="store_true", help="print the source digest of this checkout and exit")
    p.add_argument(
        "--summarize",
        action="store_true",
        help=f"only write {SUMMARY} from the {REPORT} in --out (what "
        "scripts/gpu_check.sh does after a run cut short by its timeout)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.digest:
        print(harness.source_digest())
        return 0
    if args.summarize:
        with open(os.path.join(args.out, REPORT)) as f:
            report = json.load(f)
        report["counts"] = counts(report["checks"])
        text = summary_text(report)
        with open(os.path.join(args.out, SUMMARY), "w") as f:
            f.write(text)
        print(text)
        return 0
    device = args.device or ("cpu" if args.smoke else "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible to torch: run with --smoke (or --device cpu) on a CPU")
    profile = (smoke_profile if args.smoke else gpu_profile)(device, args.budget)
    report = run(profile, args.out, argv, args.only, from_import=True)
    return 1 if report["counts"]["fail"] or report["counts"]["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
