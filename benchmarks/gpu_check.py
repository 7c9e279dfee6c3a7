"""One prepared GPU check: every attention backend's correctness, and speed against Llama, in one run.

GPU time is lent rarely and briefly, so everything worth knowing from one CUDA GPU is gathered by one command
(``bash scripts/gpu_check.sh``, which calls ``python3 benchmarks/gpu_check.py --out DIR``) that finishes in a few
minutes, survives its own failures, and writes one JSON report (``gpu_check.json``) and a short text summary
(``gpu_check.txt``). ``--smoke`` runs the same code on tiny sizes on the CPU in seconds (tests/test_gpu_check.py).

Correctness, each check one entry ``{name, status, passed, max_err, bound, detail, seconds}`` (status: pass, fail,
error — it raised, skipped — with the reason, absent — the backend's package is not installed); a failing or raising
check never stops the others. The reference and the bounds are the CPU tests' own, from the module both import
(difftransformer/testing_utils.py):

* ``reference {layout}``: the float64 model on the device (``.double()``, eager) equals the explicit float64
  reference (testing_utils.reference_forward: docs/model.md, "What it computes") on the CPU, within the float32
  tolerance: it is a trustworthy reference;
* ``forward {layout} {backend} {dtype}``: a left-padded batch's logits in fp32, bf16 and fp16 against the float64 model
  with the same weights, on the same device. fp32: the CPU tests' 2e-5; bf16 and fp16: the rounding model of the CPU
  tests (``RoundingModel``, 8 draws, 3 × the largest drawn error; fp16 with its own unit roundoff 2⁻¹¹);
* ``generate {layout} {backend} dynamic``: greedy decoding with a dynamic cache equals uncached greedy decoding (fp32);
* ``generate {layout} sdpa compiled-static``: the same with ``cache_implementation="static"`` and
  ``CompileConfig(fullgraph=True, dynamic=False)``: the compiled decode step (V1's: the one-pass Triton kernel, as
  the custom op ``torch.ops.difftransformer.diff_attn_v1_inference`` in the compiled graph);
* ``left-padding {layout} {backend}``: a left-padded batch generates what each prompt generates alone;
* ``grads {layout} {backend} fp32``: one training step's parameter gradients against eager's (relative error);
* ``grads {layout} {backend} bf16``: bf16 gradients against the float64 reference's, within the rounding model's bound
  per parameter (tests/test_kernels_difftransformer.py's method); ``max_err`` is the worst error in units of its bound.

Backends: eager, sdpa, flex_attention, and flash_attention_2 / flash_attention_3 where ``flash_attn`` /
``flash_attn_interface`` can be imported ("absent" otherwise).

Also, first: ``triton {case} d{d} {dtype}``, V1's one-pass Triton kernel on its own against the float64 formula
(testing_utils.reference_differential_attention): output and the gradients of q, k, v and λ; causal, chunked prefill,
left padding, GQA factors 1, 2 and 4, grouped noise heads, a static cache's decode step; fp32, bf16, fp16.

Speed (bf16 on the GPU), each model against a transformers ``LlamaForCausalLM`` of the same shape in the same
process, interleaved and paired exactly as benchmarks/bench.py does (its workloads, ``time_group``, medians,
quartiles; the clock waits for the GPU: ``harness.CLOCKS["cuda"]``), at the sizes users run: Llama-3.2-1B's
shape at full depth (hidden 2048, 16 layers, 32 query / 8 KV heads of width 64, MLP 8192, vocabulary 128256) as
Llama, V1 and V2, and SmolLM2-135M's against its V2 and V1 upcycles; a training step at 8×2048 with and without
gradient checkpointing, prefill of 1×8192 and 8×2048, decoding at batch 1 and 32 after a 4096-token prompt (dynamic
cache eager, static cache compiled), peak GPU memory (``torch.cuda.max_memory_allocated`` growth over the resident
model). Every V1 row carries the FLOP floors of the three formulations (``combined``: the CPU and decode kernels;
``one_pass``: the Triton kernel; ``padded``: one standard call) and judges the one the dispatch runs; the GPU targets
(``GPU_TARGETS``) are checked per row. Beside them: one layer's attention by every candidate kernel
(``run_attention_micro``: the Triton kernel, the padded SDPA call, two SDPA calls with the 2d-wide value) against the
Llama's SDPA call, and a ``torch.profiler`` step of every model (device time by kernel category, top kernels). The
cheap rows run first, the compiled decode last; a row that would start past the time budget (``--budget``, 420 s from
the start by default) is recorded as "skipped: time budget" instead. The report is rewritten after every check and
row, so whatever ran survives a run cut short.
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

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # benchmarks.bench when run as a script
    sys.path.insert(0, _ROOT)

from benchmarks import bench, harness  # noqa: E402
from difftransformer.testing_utils import (  # noqa: E402
    FP32_LOGITS_ATOL,
    GRAD_RTOL,
    ROUNDING_DRAWS,
    ROUNDING_FACTOR,
    SCORES_ATOL,
    RoundingModel,
    bf16_error_bound,
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
COMPILED_LAYOUTS = ("v1_gqa", "v2_gqa")  # as tests/test_generation_difftransformer.py: one compile each
# Every check's model has heads 32 wide (tiny_config's default is 8): flex attention's GPU kernels need at least 16.
HEAD_DIM = 32
# The tolerances (FP32_LOGITS_ATOL, SCORES_ATOL, GRAD_RTOL, ROUNDING_DRAWS × ROUNDING_FACTOR) are testing_utils'.
REPORT, SUMMARY = "gpu_check.json", "gpu_check.txt"


class Float16RoundingModel(RoundingModel):
    """The rounding model with float16's unit roundoff (11 significand bits) instead of bfloat16's."""

    u = 2.0**-11


ROUNDING_MODELS = {"bf16": RoundingModel, "fp16": Float16RoundingModel}


# ----------------------------------------------------------------------------------------------------------------
# What to run
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class SpeedShape:
    """One model shape of the speed rows: the models compared (``llama`` first) and bench.py's plan for them."""

    name: str
    shape: bench.Shape
    models: tuple[str, ...]
    plan: bench.Plan


# Short measurements: the whole GPU run has minutes. reps ≥ 4 gives bench.py's paired ratios and their quartiles.
# The workloads users run: a training step at 8×2048 (with and without gradient checkpointing), prefill of
# 1×8192 and 8×2048 tokens, decoding 16 tokens at batch 1 and 32 after a 4096-token prompt, peak memory. reps ≥ 4
# gives bench.py's paired ratios and their quartiles.
GPU_PLAN = bench.Plan(prefill_shapes=[(1, 8192), (8, 2048)], decode_batches=[1, 32], prompt_len=4096, new_tokens=16,
                      train_shape=(8, 2048), memory_prefill=(8, 2048), memory_decode_batch=32, reps=5, warmup=2,
                      clock="cuda")
# Llama-3.2-1B's published shape at full depth (tied embeddings), as Llama, V1 and V2 with the Llama's head counts.
LLAMA_3_2_1B = bench.Shape(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=64, vocab_size=128256, intermediate_size=8192, max_position_embeddings=8192 + 64,
                           tie_word_embeddings=True)
GPU_SHAPES = [
    SpeedShape("llama-3.2-1b", LLAMA_3_2_1B, ("llama", "ours_v1", "ours_v2"), GPU_PLAN),
    SpeedShape("smollm2", replace(bench.SMOLLM2, max_position_embeddings=8192 + 64), ("llama", "upcycle_v2", "upcycle_v1"),
               GPU_PLAN),
]
# Speed groups in the order they run (over every shape each): the cheap rows first, compiled decoding last.
SPEED_GROUPS = ("prefill", "train", "train_ckpt", "memory", "decode", "decode_compiled")
# Seconds an item of a group may take at most, about: it starts only while that much of the budget is left.
RESERVE_S = {"prefill": 10, "train": 20, "train_ckpt": 25, "memory": 30, "decode": 40}
# A compiled-decode row mostly compiles, in about this many seconds per model and decoder layer (a guess, replaced by
# the rate each compiled row measures); its reserve is that times its models and layers, plus COMPILE_BASE_S.
COMPILE_S_PER_LAYER, COMPILE_BASE_S = 2.0, 15.0


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
    skip_compiled: str | None = None  # why compiled generate / decode are not run, or None
    speed_shapes: list[SpeedShape] = field(default_factory=lambda: list(GPU_SHAPES))
    speed_dtype: str = "bf16"
    compiled_decode_batches: tuple[int, ...] = (1, 32)
    rounding_draws: int = ROUNDING_DRAWS
    threads: int | None = None  # torch.set_num_threads, where set
    budget_s: float = 420.0
    checks_share: float = 0.4  # no check starts past this share of the budget: the speed rows get the rest
    triton_head_dims: tuple[int, ...] = (64, 128)  # the Triton kernel's checks: d 64 in every dtype, others in bf16
    triton_cases: tuple[tuple, ...] = ()  # () = TRITON_CASES
    profile_shapes: tuple[str, ...] = ("llama-3.2-1b",)  # one torch.profiler step per model and workload
    mode: str = "gpu"


def gpu_profile(device: str = "cuda", budget_s: float = 420.0) -> Profile:
    return Profile(device=device, budget_s=budget_s)


def smoke_profile(device: str = "cpu", budget_s: float = 420.0) -> Profile:
    """Tiny sizes on the CPU, fp32 and bf16, eager and sdpa, 3 rounding-model draws, one thread, one repetition: every
    code path but compiling and GPU memory runs, in seconds."""
    plan, shape = bench.smoke_plan_and_shape()
    plan = replace(plan, prefill_shapes=plan.prefill_shapes[:1], reps=1, warmup=0, clock="wall")
    return Profile(device=device, dtypes=("fp32", "bf16"), layouts=("v1_gqa", "v2_gqa"), rounding_draws=3, threads=1,
                   skip_backends={"flex_attention": "skipped: smoke mode (flex attention compiles ~10 s per shape on a CPU)"},
                   skip_compiled="skipped: smoke mode (compiling takes ~15 s per model on a CPU)",
                   speed_shapes=[SpeedShape("smoke", shape, ("llama", "ours_v1", "ours_v2"), plan)],
                   speed_dtype="fp32", budget_s=budget_s, mode="smoke", triton_head_dims=(16,),
                   triton_cases=SMOKE_TRITON_CASES, profile_shapes=("smoke",))


# ----------------------------------------------------------------------------------------------------------------
# Recording
# ----------------------------------------------------------------------------------------------------------------


class Skip(Exception):
    """Raised by a check that does not apply; its message is the recorded reason."""


class Budget:
    """Seconds since the run started, against the budget."""

    def __init__(self, budget_s: float, start: float | None = None):
        self.start, self.budget_s = time.perf_counter() if start is None else start, budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, reserve_s: float = 0.0, share: float = 1.0) -> bool:
        return self.elapsed() + reserve_s <= self.budget_s * share


class Recorder:
    """Runs checks and speed rows, keeps the report and rewrites it after each, so that a run cut short keeps what
    it measured."""

    def __init__(self, report: dict, out_dir: str, budget: Budget, log: Callable[[str], None], checks_share: float = 1.0):
        self.report, self.out_dir, self.budget, self.log = report, out_dir, budget, log
        self.checks_share = checks_share  # no check starts past this share of the budget

    def save(self) -> None:
        self.report["meta"]["elapsed_s"] = round(self.budget.elapsed(), 1)
        self.report["counts"] = counts(self.report["checks"])
        path = os.path.join(self.out_dir, REPORT)
        with open(path + ".tmp", "w") as f:
            json.dump(self.report, f, indent=1, default=str)
        os.replace(path + ".tmp", path)

    def check(self, name: str, fn: Callable[[], dict], reserve_s: float = 5.0) -> dict:
        """Run one check: ``fn`` returns ``{max_err, bound, detail}`` (and ``passed`` where more than ``max_err ≤
        bound`` decides), raises :class:`Skip`, or raises anything else (status "error", the traceback's end kept)."""
        start = time.perf_counter()
        entry = {"name": name, "status": None, "passed": None, "max_err": None, "bound": None, "detail": ""}
        if not self.budget.allows(reserve_s, self.checks_share):
            entry |= {"status": "skipped", "detail": "skipped: time budget"}
        else:
            try:
                out = fn()
                passed = bool(out.get("passed", True)) and _le(out["max_err"], out["bound"])
                entry |= {"status": "pass" if passed else "fail", "passed": passed, "max_err": out["max_err"],
                          "bound": out["bound"], "detail": out.get("detail", "")}
            except Skip as skip:
                entry |= {"status": "absent" if str(skip).startswith("absent") else "skipped", "detail": str(skip)}
            except Exception as exc:  # recorded; the other checks go on
                entry |= {"status": "error", "passed": False,
                          "detail": f"{type(exc).__name__}: {exc}"[:1500] + "\n" + traceback.format_exc()[-1500:]}
                torch._dynamo.reset()  # a failed compile leaves state that breaks later compiles (tests do the same)
        entry["seconds"] = round(time.perf_counter() - start, 2)
        self.report["checks"].append(entry)
        self.log(f"[{self.budget.elapsed():6.1f} s] {entry['status'].upper():7s} {name}"
                 + (f"  max_err {_fmt(entry['max_err'])} bound {_fmt(entry['bound'])}" if entry["bound"] is not None else "")
                 + (f"  {entry['detail'].splitlines()[0][:200]}" if entry["status"] != "pass" and entry["detail"] else ""))
        self.save()
        return entry


def _le(err, bound) -> bool:
    return err is not None and bound is not None and not math.isnan(err) and err <= bound


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.3g}"


def counts(checks: list[dict]) -> dict:
    out = {"total": len(checks)}
    for status in ("pass", "fail", "error", "skipped", "absent"):
        out[status] = sum(c["status"] == status for c in checks)
    return out


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


def _needs_half(backend: str, dtype: str) -> None:
    if backend in FLASH_PACKAGES and dtype == "fp32":
        raise Skip("skipped: flash kernels take fp16/bf16 only")


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double().cpu() - b.double().cpu()).abs().max().item()


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
    """``reference {layout}`` and ``forward {layout} {backend} {dtype}`` (see the module docstring)."""
    device = profile.device
    for layout in profile.layouts:
        case: dict = {}  # filled by the reference check: ids, mask, and per dtype the model, exact logits, bound

        def reference(layout=layout):
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
                    draws = [reference_forward(low, ids, mask, rnd=ROUNDING_MODELS[dtype](seed), state_dict=weights)[0][valid]
                             for seed in range(profile.rounding_draws)]
                    bound = bf16_error_bound(draws, spec, factor=ROUNDING_FACTOR)
                case[dtype] = {"model": low, "exact": exact, "bound": bound}
            worst = max(errors.values(), key=lambda e: math.inf if math.isnan(e) else e)
            return {"max_err": worst, "bound": FP32_LOGITS_ATOL, "detail": "float64 model on the device vs the tests' float64 reference "
                    "(CPU), per weight dtype: " + ", ".join(f"{k} {v:.2g}" for k, v in errors.items())}

        ref_entry = rec.check(f"reference {layout}", reference)
        for dtype in profile.dtypes:
            for backend in BACKENDS:
                def forward(dtype=dtype, backend=backend, ref_entry=ref_entry):
                    reason = backend_unavailable(backend, profile, layout)
                    if reason:
                        raise Skip(reason)
                    _needs_half(backend, dtype)
                    if dtype not in case:
                        raise RuntimeError(f"no reference: {ref_entry['detail'][:300]}")
                    model = copy.deepcopy(case[dtype]["model"]).to(device)
                    model.set_attn_implementation(backend)
                    with torch.no_grad():
                        logits = model(case["ids"], attention_mask=case["mask"]).logits[case["mask"].bool()]
                    how = "the CPU tests' fp32 tolerance" if dtype == "fp32" else \
                        f"rounding model, {profile.rounding_draws} draws × {ROUNDING_FACTOR:g}"
                    return {"max_err": _max_abs(logits, case[dtype]["exact"]), "bound": case[dtype]["bound"],
                            "detail": f"logits of the valid positions vs the float64 model; bound: {how}"}

                rec.check(f"forward {layout} {backend} {dtype}", forward)
        case.clear()
        _free(device)


# The one-pass Triton kernel of V1 (triton_difftransformer.py) on its own: cases (name, batch, query tokens, keys,
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
    CPU tests' 2e-5 relative to the largest output (float32 accumulation, no TF32); bf16 / fp16, the rounding model
    (its draws round scores, maps and outputs to the dtype) × ROUNDING_FACTOR, per tensor."""
    from difftransformer import triton_difftransformer as kernel

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
                        bounds = [bf16_error_bound([dr[i] for dr in draws], exact[i], factor=ROUNDING_FACTOR)
                                  for i in range(len(exact))]
                    errors = [_max_abs(x, e) for x, e in zip(got, exact)]
                    ratio = max(err / bound if bound > 0 else math.inf for err, bound in zip(errors, bounds))
                    return {"max_err": ratio, "bound": 1.0, "detail": "error / bound per tensor: " + ", ".join(
                        f"{nm} {err:.2g}/{bound:.2g}" for nm, err, bound in zip(names, errors, bounds))}

                rec.check(f"triton {case[0]} d{d} {dtype}", check, reserve_s=10.0)
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
            return {"max_err": max(err_logits, err_loss), "bound": FP32_LOGITS_ATOL,
                    "passed": bool(applied.get("rms_norm")) and bool(applied.get("swiglu")),
                    "detail": f"relative: logits {err_logits:.2g}, loss {err_loss:.2g}; patched "
                    + ", ".join(f"{k} {len(v)}" for k, v in applied.items())}

        rec.check(f"liger {layout}", check)
    _free(device)


def _generation_model(layout: str, backend: str, device: str, seed: int = 0):
    """test_generation_difftransformer.py's model (heads HEAD_DIM wide): EOS disabled (fixed-length outputs), fp32."""
    from difftransformer import DiffTransformerForCausalLM

    torch.manual_seed(seed)
    model = DiffTransformerForCausalLM(tiny_config(layout, head_dim=HEAD_DIM)).eval()
    model.set_attn_implementation(backend)
    model.generation_config.eos_token_id = None
    return model.to(device)


def _greedy(model, ids, mask=None, max_new_tokens=10, **kwargs):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_scores=True, **kwargs)
    return out.sequences, torch.stack(out.scores)


def run_generation_checks(rec: Recorder, profile: Profile) -> None:
    """``generate ... dynamic``, ``generate ... compiled-static`` and ``left-padding ...`` (fp32)."""
    from transformers import CompileConfig

    device = profile.device
    for layout in profile.layouts:
        for backend in BACKENDS:
            def cached(layout=layout, backend=backend):
                reason = backend_unavailable(backend, profile, layout)
                if reason:
                    raise Skip(reason)
                _needs_half(backend, "fp32")
                model = _generation_model(layout, backend, device)
                ids, _ = left_padded_batch(model.config.vocab_size, [7], seed=5)
                ids = ids.to(device)
                ref_seq, ref_scores = _greedy(model, ids, use_cache=False)
                seq, scores = _greedy(model, ids)
                same = torch.equal(seq, ref_seq)
                return {"passed": same, "max_err": _max_abs(scores, ref_scores), "bound": SCORES_ATOL,
                        "detail": ("" if same else "greedy sequences differ; ") + "scores vs uncached greedy"}

            rec.check(f"generate {layout} {backend} dynamic", cached)

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
                batch_seq, batch_scores = _greedy(model, ids, mask)
                worst, differ = 0.0, []
                for b, length in enumerate(lengths):
                    alone_seq, alone_scores = _greedy(model, ids[b : b + 1, -length:])
                    if not torch.equal(batch_seq[b, -(length + 10):], alone_seq[0]):
                        differ.append(b)
                    worst = max(worst, _max_abs(batch_scores[:, b], alone_scores[:, 0]))
                return {"passed": not differ, "max_err": worst, "bound": SCORES_ATOL,
                        "detail": (f"prompts {differ} generate other tokens in the batch; " if differ else "")
                        + "scores of batch rows vs each prompt alone"}

            rec.check(f"left-padding {layout} {backend}", padded)
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
            ref_seq, ref_scores = _greedy(model, ids, use_cache=False)
            torch._dynamo.reset()
            compile_config = CompileConfig(fullgraph=True, dynamic=False)
            compile_config._compile_all_devices = True  # generate() compiles on CUDA anyway; on CPU only with this
            seq, scores = _greedy(model, ids, cache_implementation="static", compile_config=compile_config)
            took = hasattr(model, "_compiled_call")
            same = torch.equal(seq, ref_seq)
            return {"passed": same and took, "max_err": _max_abs(scores, ref_scores), "bound": SCORES_ATOL,
                    "detail": ("" if took else "generate() did not take the compiled path; ")
                    + ("" if same else "greedy sequences differ; ") + "scores vs uncached greedy"}

        rec.check(f"generate {layout} sdpa compiled-static", compiled, reserve_s=60.0)


def grads_case(layout: str, dtype: str):
    """test_kernels_difftransformer.py's training case (heads HEAD_DIM wide): initializer_range 0.1, non-trivial norms,
    V1's λ vectors moved off their init, a left-padded batch of 12 and 9 tokens, labels ignoring padding and every
    token predicted from a padding row (each kernel fills those rows differently). Returns (model on the CPU in
    ``dtype``, ids, mask, labels)."""
    from difftransformer import DiffTransformerForCausalLM
    from difftransformer.modeling_difftransformer import DiffTransformerV1Attention

    torch.manual_seed(3)
    model = randomize_norms(DiffTransformerForCausalLM(tiny_config(layout, initializer_range=0.1, head_dim=HEAD_DIM)), 3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, DiffTransformerV1Attention):
                for p in (m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2):
                    p.add_(torch.randn_like(p) * 0.3)
    ids, mask = left_padded_batch(model.config.vocab_size, [12, 9], seed=2)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    return model.to(DTYPES[dtype]), ids, mask, labels


def _grads(model, backend: str, ids, mask, labels, device: str) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model).to(device).train()
    model.set_attn_implementation(backend)
    model(ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss.backward()
    return {k: p.grad.double().cpu() for k, p in model.named_parameters()}


def run_grad_checks(rec: Recorder, profile: Profile) -> None:
    """``grads {layout} {backend} fp32`` against eager, ``grads {layout} {backend} bf16`` against the rounding model."""
    device = profile.device
    for layout in profile.layouts:
        if "fp32" in profile.dtypes:
            model, ids, mask, labels = grads_case(layout, "fp32")
            eager: dict = {}
            for backend in BACKENDS[1:]:
                def fp32(backend=backend, model=model, ids=ids, mask=mask, labels=labels):
                    reason = backend_unavailable(backend, profile, layout)
                    if reason:
                        raise Skip(reason)
                    _needs_half(backend, "fp32")
                    if not eager:
                        eager.update(_grads(model, "eager", ids, mask, labels, device))
                    grads = _grads(model, backend, ids, mask, labels, device)
                    rel = {k: _max_abs(g, eager[k]) / max(eager[k].abs().max().item(), 1e-30) for k, g in grads.items()}
                    worst = max(rel, key=lambda k: math.inf if math.isnan(rel[k]) else rel[k])
                    return {"max_err": rel[worst], "bound": GRAD_RTOL, "detail": "max over parameters of "
                            f"max|g − g_eager| / max|g_eager|; worst: {worst}"}

                rec.check(f"grads {layout} {backend} fp32", fp32)
        if "bf16" in profile.dtypes:
            model, ids, mask, labels = grads_case(layout, "bf16")
            bounds: dict = {}

            def reference_grads(rnd):
                sd = {k: v.detach().double().requires_grad_() for k, v in model.state_dict().items()}
                reference_forward(model, ids, mask, rnd=rnd, state_dict=sd, labels=labels)[2].backward()
                return {k: v.grad for k, v in sd.items()}

            for backend in BACKENDS:
                def bf16(backend=backend):
                    reason = backend_unavailable(backend, profile, layout)
                    if reason:
                        raise Skip(reason)
                    if not bounds:
                        exact = reference_grads(lambda x: x)
                        draws = [reference_grads(RoundingModel(seed)) for seed in range(profile.rounding_draws)]
                        bounds.update({k: (exact[k], bf16_error_bound([d[k] for d in draws], exact[k], ROUNDING_FACTOR))
                                       for k in exact})
                    grads = _grads(model, backend, ids, mask, labels, device)
                    units = {k: _max_abs(g, bounds[k][0]) / bounds[k][1] for k, g in grads.items()}
                    worst = max(units, key=lambda k: math.inf if math.isnan(units[k]) else units[k])
                    return {"max_err": units[worst], "bound": 1.0, "detail": "worst parameter gradient error in units "
                            f"of its rounding-model bound ({profile.rounding_draws} draws × {ROUNDING_FACTOR:g}): {worst}"}

                rec.check(f"grads {layout} {backend} bf16", bf16)
        _free(device)


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------------
# Speed
# ----------------------------------------------------------------------------------------------------------------


def memory_rows(models: dict[str, torch.nn.Module], plan: bench.Plan) -> list[dict]:
    """bench.py's three memory workloads, as growth of ``torch.cuda.max_memory_allocated`` over the resident model
    (+ optimizer state for training) during the second of two runs (the first warms allocator pools and creates the
    optimizer state). GPU memory is deterministic: one measured run per model."""
    rows = []
    for workload, label in (("prefill", "prefill {}x{}".format(*plan.memory_prefill)),
                            ("decode", f"decode b{plan.memory_decode_batch}"),
                            ("train", "train {}x{}".format(*plan.train_shape))):
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


def _annotate(row: dict, spec: dict, models: dict[str, torch.nn.Module], plan: bench.Plan) -> None:
    """Every model's FLOP floor (its matmul FLOPs over Llama's: bench.py's ``forward_flops`` / ``generation_flops``)
    and achieved TFLOP/s where the row is a prefill or a training step."""
    configs = {kind: m.config for kind, m in models.items()}
    for kind, stats in row["models"].items():
        cfg = configs[kind]
        if spec["family"] == "decode":  # the timed part: the decode steps after the prompt's forward
            flops = bench.generation_flops(cfg, plan.prompt_len, plan.new_tokens) - bench.forward_flops(cfg, plan.prompt_len, 1)
            flops *= spec["args"][0]
        else:
            batch, seq = spec["args"][:2]
            logits = 1 if spec["family"] == "prefill" else seq
            flops = batch * bench.forward_flops(cfg, seq, logits) * (3 if spec["family"] == "train" else 1)
            if stats.get("median"):
                stats["tflops"] = flops / stats["median"] / 1e12
        stats["flops"] = flops
    base = row["models"].get("llama", {}).get("flops")
    for kind, stats in row["models"].items():
        if kind != "llama" and base:
            stats["flop_floor"] = stats["flops"] / base
            if getattr(configs[kind], "diff_version", None) == 1:  # the floor of the formulation the kernel computes
                floors = {f: (stats["flops"] + v1_extra_flops(configs[kind], spec, plan, f)) / base for f in V1_FORMULATIONS}
                stats["flop_floors"] = floors
                stats["formulation"] = v1_formulation(models[kind], spec)
                stats["flop_floor"] = floors[stats["formulation"]]


# V1's attention arithmetic per formulation, beyond bench.forward_flops's ("combined": both maps' scores, a Llama's
# QKᵀ, then (A1 − λA2) times the 2d-wide value once, a Llama's PV; what the CPU kernels and the decode kernel compute).
# "one_pass" (the Triton kernel) multiplies both maps by the value: + one Llama PV. "padded" (one standard call with
# zero-padded queries) also computes 2d-wide scores: + one Llama QKᵀ + one Llama PV.
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


def v1_formulation(model, spec: dict) -> str:
    """Which formulation V1's sdpa path runs for ``spec`` on the model's device (modeling_difftransformer's dispatch):
    the Triton kernel where it runs, compiled or not (compiled decoding runs it as a custom op); the CPU kernels on the
    CPU; elsewhere the padded call for prompts and training and the decode kernel for decoding."""
    from difftransformer import modeling_difftransformer as mdt

    device = model.device
    if device.type in mdt.TRITON_KERNEL_DEVICES and mdt.triton_runs_on(device):
        return "one_pass"
    if device.type in mdt.BLOCKED_KERNEL_DEVICES or spec["family"] == "decode":
        return "combined"
    return "padded"


def run_speed(rec: Recorder, profile: Profile, groups: tuple[str, ...] = SPEED_GROUPS) -> None:
    """The speed rows of every shape, group by group (``groups``, in SPEED_GROUPS's order), each row within the time
    budget; a later call adds the rows of further groups to the same report."""
    device, dtype = profile.device, DTYPES[profile.speed_dtype]
    cuda = device.startswith("cuda")
    speed = rec.report["speed"]
    if "shapes" not in speed:
        speed.update(dtype=profile.speed_dtype, clock="cuda (synchronized wall)" if cuda else "wall", shapes={},
                     skipped=[])
        for s in profile.speed_shapes:
            speed["shapes"][s.name] = {"shape": asdict(s.shape), "plan": asdict(s.plan), "models": list(s.models),
                                       "results": []}
    built: dict[str, dict[str, torch.nn.Module]] = {}
    compile_rate = COMPILE_S_PER_LAYER
    for group in groups:
        shapes = profile.speed_shapes
        if group == "decode_compiled":  # the quickest compiles first
            shapes = sorted(shapes, key=lambda s: s.shape.num_hidden_layers * len(s.models))
        for s in shapes:
            plan = s.plan
            model_layers = s.shape.num_hidden_layers * len(s.models)
            if group == "decode_compiled":
                plan = replace(plan, decode_batches=list(profile.compiled_decode_batches))
            items = bench.group_items(group, plan) if group != "memory" else [{"item": "peak MiB", "args": None}]
            for spec in items:
                label = f"{s.name}: {spec['item']}"
                reason = None
                if group == "memory" and not cuda:
                    reason = "skipped: peak GPU memory needs CUDA"
                elif group == "decode_compiled" and profile.skip_compiled:
                    reason = profile.skip_compiled
                elif not rec.budget.allows(RESERVE_S.get(group, COMPILE_BASE_S + compile_rate * model_layers)):
                    reason = "skipped: time budget"
                if reason:
                    speed["skipped"].append({"shape": s.name, "item": spec["item"], "reason": reason})
                    rec.log(f"[{rec.budget.elapsed():6.1f} s] SKIPPED {label}: {reason}")
                    rec.save()
                    continue
                start = time.perf_counter()
                try:
                    if s.name not in built:
                        with torch.device(device):  # random init on the device: fast for the 1B-class shape
                            built[s.name] = {m: bench.build_model(m, s.shape, dtype).to(device) for m in s.models}
                    models = built[s.name]
                    harness.set_clock("cuda" if cuda else plan.clock)
                    if group == "memory":
                        rows = memory_rows(models, plan)
                    else:
                        one = _one_item_plan(group, plan, spec)
                        rows = bench.time_group(group, models, one)
                        for row in rows:
                            _annotate(row, spec, models, plan)
                except Exception as exc:  # the row is reported failed; the others go on
                    torch._dynamo.reset()
                    rows = [{"item": spec["item"], "error": f"{type(exc).__name__}: {exc}"[:1500],
                             "traceback": traceback.format_exc()[-1500:], "models": {}}]
                for row in rows:
                    row["seconds"] = round(time.perf_counter() - start, 1)
                if group == "decode_compiled" and "error" not in rows[0]:
                    compile_rate = max(0.2, (rows[0]["seconds"] - COMPILE_BASE_S) / model_layers)
                speed["shapes"][s.name]["results"] += rows
                rec.log(f"[{rec.budget.elapsed():6.1f} s] {'ERROR' if 'error' in rows[0] else 'DONE'}    {label}"
                        + (f": {rows[0]['error'][:200]}" if "error" in rows[0] else ""))
                rec.save()
        if group == "decode":
            torch._dynamo.reset()  # the compiled rows compile afresh, one model at a time
    built.clear()
    _free(device)


# The GPU targets (bf16, docs/performance.md): V2 with the Llama's head counts ≤ 1.03× the Llama in every time row; the SmolLM2 V2
# upcycle ≤ 1.05× its FLOP floor; V1 ≤ 1.10× the floor of its formulation in prefill and training and ≤ 1.10× the Llama
# in decoding (it reads the same cache bytes); V1's training peak memory ≤ 1.05× the Llama's.
GPU_TARGETS = {
    "ours_v2": {"prefill": ("llama", 1.03), "train": ("llama", 1.03), "decode": ("llama", 1.03)},
    "upcycle_v2": {"prefill": ("floor", 1.05), "train": ("floor", 1.05), "decode": ("floor", 1.05)},
    "ours_v1": {"prefill": ("floor", 1.10), "train": ("floor", 1.10), "decode": ("llama", 1.10),
                "memory train": ("llama", 1.05)},
}


def gpu_target(kind: str, row: dict) -> tuple[float, bool] | None:
    """(the ratio judged, whether it meets its GPU target) for model ``kind`` in a speed row, or None where none applies.
    Time rows judge the paired ratio (median of per-round ratios) where there is one."""
    family = "memory train" if row.get("family") == "memory" and "train" in row["item"] else row.get("family")
    target = GPU_TARGETS.get(kind, {}).get(family)
    stats = row.get("models", {}).get(kind)
    if target is None or not stats:
        return None
    ratio = stats.get("paired_ratio") or stats.get("ratio")
    if ratio is None:
        return None
    against, limit = target
    if against == "floor":
        floor = stats.get("flop_floor")
        if not floor:
            return None
        ratio = ratio / floor
    return ratio, ratio <= limit


def targets_text(shape: dict) -> list[str]:
    """One line per row and targeted model: the judged ratio, its limit, ✓ / ✗."""
    lines = []
    for row in shape["results"]:
        for kind in row.get("models", {}):
            judged = gpu_target(kind, row)
            if judged is None:
                continue
            against, limit = GPU_TARGETS[kind]["memory train" if row.get("family") == "memory" else row["family"]]
            stats = row["models"][kind]
            what = f"/ its {stats.get('formulation', 'FLOP')} floor {stats.get('flop_floor', 0):.3f}" if against == "floor" else "× Llama"
            lines.append(f"  {row['item']:<28s} {kind:<11s} {judged[0]:.3f} {what} (target ≤ {limit}) {'✓' if judged[1] else '✗'}")
    return lines


def _kernel_category(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("_diff_attn", "flash", "fmha", "attention", "efficient_attention", "cudnn_sdp", "sdpa")):
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "nvjet", "sm90_", "sm80_", "matmul", "cublas", "wgmma", "aten::mm", "aten::bmm",
                            "aten::addmm")):
        return "matmul"
    if any(k in n for k in ("rms", "norm")):
        return "norm"
    if any(k in n for k in ("copy", "cat", "transpose", "contiguous", "index", "fill", "memcpy", "memset")):
        return "copy"
    if any(k in n for k in ("softmax", "cross_entropy", "log_softmax", "nll")):
        return "loss/softmax"
    return "elementwise/other"


def profile_step(run: Callable[[], object], device: str, top: int = 12) -> dict:
    """One call of ``run`` under torch.profiler: device-kernel time by category and the ``top`` kernels (self time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    run()  # warm (allocator, autotuning, lazily built state)
    with profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    kernels = [(e.key, getattr(e, attr, 0.0) or 0.0, e.count) for e in events]
    if cuda:  # device kernels only (their CPU-side launch ops have no self device time of their own)
        kernels = [k for k in kernels if k[1] > 0]
    total = sum(k[1] for k in kernels) or 1.0
    categories: dict[str, float] = {}
    for name, us, _ in kernels:
        categories[_kernel_category(name)] = categories.get(_kernel_category(name), 0.0) + us
    kernels.sort(key=lambda k: -k[1])
    return {"total_ms": total / 1e3, "categories": {k: round(v / total, 4) for k, v in sorted(categories.items())},
            "top": [{"name": n[:120], "ms": round(us / 1e3, 3), "share": round(us / total, 4), "calls": c}
                    for n, us, c in kernels[:top]]}


def run_profiles(rec: Recorder, profile: Profile) -> None:
    """``profiles[shape][model][workload]``: one prefill and one training step of every model of the shapes in
    ``profile.profile_shapes``, under torch.profiler (where the time goes, beside the speed rows' ratios)."""
    device, dtype = profile.device, DTYPES[profile.speed_dtype]
    out = rec.report.setdefault("profiles", {})
    for s in profile.speed_shapes:
        if s.name not in profile.profile_shapes:
            continue
        if not rec.budget.allows(30.0):
            out[s.name] = {"skipped": "time budget"}
            rec.save()
            continue
        try:
            with torch.device(device):
                models = {m: bench.build_model(m, s.shape, dtype).to(device) for m in s.models}
            b, t = s.plan.prefill_shapes[-1]
            tb, tt = s.plan.train_shape
            for kind, model in models.items():
                out.setdefault(s.name, {})[kind] = {
                    f"prefill {b}x{t}": profile_step(bench.prefill_workload(model, b, t), device),
                    f"train {tb}x{tt}": profile_step(bench.train_workload(model, tb, tt), device),
                }
                rec.log(f"[{rec.budget.elapsed():6.1f} s] PROFILED {s.name}: {kind}")
                rec.save()
            del models
        except Exception as exc:
            out.setdefault(s.name, {})["error"] = f"{type(exc).__name__}: {exc}"[:1500]
            rec.log(f"[{rec.budget.elapsed():6.1f} s] ERROR   profile {s.name}: {exc}")
        _free(device)
        rec.save()


def attention_candidates(b: int, t: int, s: int, hq: int, hkv: int, d: int, dtype, device, backward: bool):
    """V1 attention of one layer by every way stock torch and this package offer (each → ``(B, T, H, 2d)`` outputs),
    plus the same-shape Llama's attention (``hq`` query heads of width d over ``hkv`` KV heads, SDPA with GQA) as the
    baseline: name → a function of no arguments that runs it (forward, and backward where ``backward``)."""
    import torch.nn.functional as F

    from difftransformer import triton_difftransformer
    from difftransformer.kernels_difftransformer import query_padding
    from difftransformer.modeling_difftransformer import pack_groups

    g, n = hkv // 2, hq // hkv
    gen = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(b, t, hq, d, device=device, dtype=dtype, generator=gen)
    key, value = (torch.randn(b, hkv, s, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    lam = torch.tensor(0.3, device=device, requires_grad=backward)
    causal = t > 1
    for x in (query, key, value):
        x.requires_grad_(backward)

    def done(out):
        if backward:
            out.float().square().mean().backward()
        return out

    def llama():
        return done(F.scaled_dot_product_attention(query.transpose(1, 2), key, value, is_causal=causal, enable_gqa=True))

    def padded():  # one call, [Q1|0] and [0|Q2] over packed (B, G, S, 2d) groups; flash where it runs
        pad = query_padding(n, n, dtype, device)
        q = (query.unflatten(2, (g, 2 * n, 1)) * pad).reshape(b, t, hq, 2 * d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, pack_groups(key), pack_groups(value), is_causal=causal, enable_gqa=True)
        out = out.transpose(1, 2).unflatten(2, (g, 2, n))
        return done(out[:, :, :, 0] - lam * out[:, :, :, 1])

    def two_calls():  # each map over its key head, with the 2d-wide value (SDPA's memory-efficient / math backends)
        q = query.unflatten(2, (g, 2, n))
        v = pack_groups(value)
        outs = [F.scaled_dot_product_attention(q[:, :, :, c].flatten(2, 3).transpose(1, 2), key[:, c::2], v,
                                               is_causal=causal, enable_gqa=True) for c in (0, 1)]
        return done(outs[0] - lam * outs[1])

    def one_pass():
        return done(triton_difftransformer.differential_attention_triton(query, key, value, lam, d**-0.5, n))

    runs = {"llama_sdpa": llama, "v1_padded_sdpa": padded, "v1_two_calls_sdpa": two_calls}
    if triton_difftransformer.is_available(torch.device(device)):
        runs["v1_one_pass_triton"] = one_pass
    return runs


ATTENTION_SHAPES = (("prefill 1x8192", 1, 8192, 8192, False), ("prefill 8x2048", 8, 2048, 2048, False),
                    ("train 8x2048", 8, 2048, 2048, True), ("decode b1 s4096", 1, 1, 4096, False),
                    ("decode b32 s4096", 32, 1, 4096, False))


def run_attention_micro(rec: Recorder, profile: Profile) -> None:
    """``attention[shape]``: one layer's attention at Llama-3.2-1B's head counts (32 query heads / 8 KV heads of width
    64) by every candidate (:func:`attention_candidates`), interleaved, medians and paired ratios to the Llama's SDPA
    call: the data for choosing V1's kernel per workload."""
    device, dtype = profile.device, DTYPES[profile.speed_dtype]
    shapes = ATTENTION_SHAPES if profile.mode == "gpu" else (("prefill 1x64", 1, 64, 64, False), ("train 2x32", 2, 32, 32, True),
                                                             ("decode b2 s48", 2, 1, 48, False))
    hq, hkv, d = (32, 8, 64) if profile.mode == "gpu" else (8, 4, 16)
    out = rec.report.setdefault("attention", {"heads": [hq, hkv, d], "dtype": profile.speed_dtype, "rows": []})
    for name, b, t, s, backward in shapes:
        if not rec.budget.allows(15.0):
            out["rows"].append({"item": name, "skipped": "time budget"})
            continue
        try:
            runs = attention_candidates(b, t, s, hq, hkv, d, dtype, device, backward)
            failed = {}
            for kind, fn in list(runs.items()):  # one candidate that cannot run must not cost the others their row
                try:
                    fn()
                except Exception as exc:
                    failed[kind] = f"{type(exc).__name__}: {exc}"[:500]
                    del runs[kind]
            if "llama_sdpa" not in runs:
                raise RuntimeError(f"the Llama's SDPA call failed: {failed['llama_sdpa']}")
            harness.set_clock("cuda" if device.startswith("cuda") else "wall")
            stats = harness.run_interleaved({k: _timed(f) for k, f in runs.items()}, reps=max(profile_reps(profile), 4),
                                            warmup=2, trace=False)
            base = stats["llama_sdpa"]
            row = {"item": name, "models": {}, "failed": failed}
            for kind, st in stats.items():
                entry = {"median_ms": st["median"] * 1e3, "ratio": st["median"] / base["median"]}
                if len(st.get("samples", ())) >= 4:
                    entry["paired_ratio"], entry["paired_quartiles"] = harness.paired(st["samples"], base["samples"])
                row["models"][kind] = entry
        except Exception as exc:
            row = {"item": name, "error": f"{type(exc).__name__}: {exc}"[:1500]}
        out["rows"].append(row)
        rec.log(f"[{rec.budget.elapsed():6.1f} s] {'ERROR' if 'error' in row else 'DONE'}    attention {name}")
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


def _one_item_plan(group: str, plan: bench.Plan, spec: dict) -> bench.Plan:
    """``plan`` reduced to the one item ``spec`` of ``group``, so that bench.time_group measures just that row."""
    if group == "prefill":
        return replace(plan, prefill_shapes=[spec["args"]])
    if group.startswith("decode"):
        return replace(plan, decode_batches=[spec["args"][0]])
    return plan


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------


def meta(profile: Profile, argv: list[str]) -> dict:
    import transformers

    import difftransformer

    cuda = profile.device.startswith("cuda")
    commit, dirty, _ = harness.git_state()
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "transformers": transformers.__version__, "difftransformer": difftransformer.__version__}
    for package in ("triton", "huggingface_hub", "tokenizers", "safetensors", "accelerate", "flash_attn"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    versions["flash_attn_interface"] = "importable" if importlib.util.find_spec("flash_attn_interface") else None
    return {"mode": profile.mode, "device": profile.device,
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
            "cpu": harness.cpu_info()["cpu"], "versions": versions,
            "git_commit": commit, "git_dirty": dirty, "source_digest": harness.source_digest(),
            "fp32_matmul_precision": torch.get_float32_matmul_precision(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "budget_s": profile.budget_s, "argv": argv, "elapsed_s": 0.0, "finished": False}


def summary_text(report: dict) -> str:
    """One line per check (PASS / FAIL / ERROR / SKIP / ABSENT), then bench.py's table per speed shape."""
    m = report["meta"]
    lines = [f"GPU check ({m['mode']}) on {m['gpu'] or m['device']}: torch {m['versions']['torch']} (CUDA "
             f"{m['versions']['cuda']}), transformers {m['versions']['transformers']}, Python {m['versions']['python']}; "
             f"commit {m['git_commit']} (dirty: {m['git_dirty']}), sources {m['source_digest']}; {m['elapsed_s']} s"
             + ("" if m.get("finished") else " (CUT SHORT: the run did not finish; what it reached is below)"),
             "", "checks: " + ", ".join(f"{k} {v}" for k, v in report["counts"].items())]
    tags = {"pass": "PASS", "fail": "FAIL", "error": "ERROR", "skipped": "SKIP", "absent": "ABSENT"}
    for c in report["checks"]:
        line = f"{tags[c['status']]:6s} {c['name']}"
        if c["bound"] is not None:
            line += f"  max_err {_fmt(c['max_err'])} ≤ {_fmt(c['bound'])}" if c["passed"] else \
                f"  max_err {_fmt(c['max_err'])} > {_fmt(c['bound'])}"
        if c["status"] != "pass" and c["detail"]:
            line += f"  ({c['detail'].splitlines()[0][:160]})"
        lines.append(line)
    speed = report.get("speed") or {}
    for name, shape in speed.get("shapes", {}).items():
        ok = [r for r in shape["results"] if "error" not in r]
        s = shape["shape"]
        lines += ["", f"speed, {name} ({speed['dtype']}, clock {speed['clock']}): hidden {s['hidden_size']}, "
                  f"{s['num_hidden_layers']} layers, {s['num_attention_heads']} heads / {s['num_key_value_heads']} KV, "
                  f"head_dim {s['head_dim']}, vocab {s['vocab_size']}, MLP {s['intermediate_size']}; "
                  f"models {', '.join(shape['models'])} (targets: the CPU benchmark's, bench.TARGETS)"]
        if ok:
            lines.append(bench.format_table({"models": shape["models"], "results": {speed["dtype"]: ok}}, paired=True))
            lines += ["GPU targets:"] + (targets_text({"results": ok}) or ["  none applies"])
        lines += [f"ERROR {r['item']}: {r['error'][:200]}" for r in shape["results"] if "error" in r]
    for s in speed.get("skipped", []):
        lines.append(f"SKIP  speed {s['shape']}: {s['item']} ({s['reason']})")
    attention = report.get("attention") or {}
    if attention.get("rows"):
        hq, hkv, d = attention["heads"]
        lines += ["", f"attention of one layer ({hq} query / {hkv} KV heads of width {d}, {attention['dtype']}): median ms, "
                  "paired ratio to the Llama's SDPA call"]
        for row in attention["rows"]:
            if "models" not in row:
                lines.append(f"  {row['item']}: {row.get('error') or 'skipped: ' + row.get('skipped', '')}"[:200])
                continue
            lines.append(f"  {row['item']:<18s} " + "; ".join(
                f"{k} {v['median_ms']:.3f} ms ×{v.get('paired_ratio', v['ratio']):.2f}" for k, v in row["models"].items())
                + "".join(f"; {k} FAILED ({msg[:80]})" for k, msg in (row.get("failed") or {}).items()))
    for shape_name, models in (report.get("profiles") or {}).items():
        lines += ["", f"profile, {shape_name}: device time by kernel category (one step each)"]
        for kind, workloads in (models.items() if isinstance(models, dict) else []):
            if not isinstance(workloads, dict):
                lines.append(f"  {kind}: {workloads}"[:200])
                continue
            for workload, prof in workloads.items():
                cats = ", ".join(f"{c} {v:.0%}" for c, v in sorted(prof["categories"].items(), key=lambda x: -x[1]))
                top = "; ".join(f"{k['name'][:40]} {k['share']:.0%}" for k in prof["top"][:4])
                lines.append(f"  {kind:<11s} {workload:<14s} {prof['total_ms']:.1f} ms: {cats} | top: {top}")
    return "\n".join(lines) + "\n"


def _print(line: str) -> None:
    print(line, flush=True)


def run(profile: Profile, out_dir: str, argv: list[str] | None = None, only: tuple[str, ...] = ("checks", "speed"),
        log: Callable[[str], None] = _print, from_import: bool = False) -> dict:
    """The whole check: writes ``gpu_check.json`` (rewritten as it goes) and ``gpu_check.txt`` into ``out_dir``.

    ``from_import``: the budget counts from this module's import (the command line) instead of from this call."""
    os.makedirs(out_dir, exist_ok=True)
    budget = Budget(profile.budget_s, _STARTED if from_import else None)
    # Many models and shapes compile the same code: without room, dynamo would silently fall back to eager.
    limit_name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    threads, recompile_limit = torch.get_num_threads(), getattr(torch._dynamo.config, limit_name)
    if profile.threads:
        torch.set_num_threads(profile.threads)
    setattr(torch._dynamo.config, limit_name, max(recompile_limit, 64))
    try:
        report = {"meta": meta(profile, list(argv or [])), "checks": [], "counts": {}, "speed": {},
                  "provenance": harness.provenance("gpu_check.py", list(argv or []))}
        rec = Recorder(report, out_dir, budget, log, profile.checks_share)
        log(f"GPU check ({profile.mode}) on {report['meta']['gpu'] or profile.device}, versions "
            f"{report['meta']['versions']}, commit {report['meta']['git_commit']}")
        rec.save()
        if "checks" in only:  # the compiling checks (flex attention, compiled decoding) last within each family
            run_triton_checks(rec, profile)
            run_liger_checks(rec, profile)
            run_forward_checks(rec, profile)
            run_grad_checks(rec, profile)
            run_generation_checks(rec, profile)
        if "speed" in only:  # compiled decoding last: it costs the most per row
            run_attention_micro(rec, profile)
            run_speed(rec, profile, tuple(g for g in SPEED_GROUPS if g != "decode_compiled"))
            run_profiles(rec, profile)
            run_speed(rec, profile, ("decode_compiled",))
        report["meta"]["finished"] = True
        rec.save()
        text = summary_text(report)
        with open(os.path.join(out_dir, SUMMARY), "w") as f:
            f.write(text)
        log(text)
        return report
    finally:
        torch.set_num_threads(threads)
        setattr(torch._dynamo.config, limit_name, recompile_limit)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results"),
                   help=f"folder for {REPORT} and {SUMMARY} (default benchmarks/results/)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, fp32 and bf16, eager and sdpa, nothing "
                   "compiled: every other path runs in seconds (CI)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda, cpu with --smoke")
    p.add_argument("--budget", type=float, default=420.0, help="seconds from the start after which no speed row "
                   "(or check) begins; they are recorded as skipped (default 420)")
    p.add_argument("--only", choices=("checks", "speed"), default=None, help="run only the correctness checks or the "
                   "speed rows (default both)")
    p.add_argument("--digest", action="store_true", help="print the source digest of this checkout and exit")
    p.add_argument("--summarize", action="store_true", help=f"only write {SUMMARY} from the {REPORT} in --out (what "
                   "scripts/gpu_check.sh does after a run cut short by its timeout)")
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
    report = run(profile, args.out, argv, (args.only,) if args.only else ("checks", "speed"), from_import=True)
    return 1 if report["counts"]["fail"] or report["counts"]["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
