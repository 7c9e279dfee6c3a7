"""The prepared GPU check (``python -m benchmarks.gpu_check``, scripts/gpu_check.sh) works before any GPU time: its CPU
smoke mode runs every part in the order the slot needs (speed with compiled decoding, the attention candidates, the
tuning sweep, correctness) and produces a complete report; its kernel-only profile counts device kernels once; its
attention micro-benchmark backpropagates a given upstream gradient; its time guard skips instead of overrunning; and
the shell scripts parse and run it.

GPU time is rare and short: a check that crashes or reports nothing there is a lost run. Everything but the CUDA-only
parts (Inductor and CUDA graphs, flex attention, GPU memory, device kernels) runs here: compiled decoding goes through
Dynamo with its eager backend, GPU memory is measured with a stand-in allocator, kernel events are synthetic."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

# The smoke run checks V1's Triton kernel through Triton's CPU interpreter (where triton is installed); set before
# any kernel is first decorated, whichever test module of this process runs first.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

from benchmarks import bench, gpu_check, harness  # noqa: E402
from difftransformer import modeling_difftransformer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread", "triton_configs_restored")


@pytest.fixture(scope="module")
def triton_configs_restored():
    """The check pins the tuning sweep's configurations for the rest of its process (gpu_check.run_tuning): here the
    process goes on with other test modules, which get the kernel's own rules back."""
    yield
    triton_difftransformer = sys.modules.get("difftransformer.kernels.triton.attention")
    if triton_difftransformer is not None and hasattr(triton_difftransformer, "set_configs"):
        triton_difftransformer.set_configs(None)


SMOKE_LAYOUTS = ("v1_gqa", "v2_gqa")
SMOKE_DTYPES = ("fp32", "bf16")
BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
HAS_KNOB = hasattr(modeling_difftransformer.DiffTransformerForCausalLM, "set_differential_kernel")


def _expected_checks() -> dict[str, set[str]]:
    """Every check the smoke run must report, with the statuses it may have on a CPU."""
    flash = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}

    def status(backend):
        if backend == "flex_attention":
            return {"skipped"}  # compiles too slowly for the smoke run
        if backend in flash:
            return {"absent"} if importlib.util.find_spec(flash[backend]) is None else {"skipped"}
        if backend.startswith("kernel="):
            if not HAS_KNOB:
                return {"absent"}
            # the interpreter's Triton kernel is skipped by the smoke profile; a kernel the model refuses on a CPU
            # is skipped with the model's own ValueError
            return {"skipped"} if backend == "kernel=triton" else {"pass", "skipped"}
        return {"pass"}

    expected = {}
    triton = {"pass"} if importlib.util.find_spec("triton") else {"absent"}
    for case in gpu_check.SMOKE_TRITON_CASES:
        for dtype in SMOKE_DTYPES:
            expected[f"triton {case[0]} d16 {dtype}"] = triton
    for layout in SMOKE_LAYOUTS:
        kernels = [f"kernel={k}" for k in gpu_check.V1_PROMPT_KERNELS] if layout.startswith("v1") else []
        expected[f"liger {layout}"] = {"absent"} if importlib.util.find_spec("liger_kernel") is None else {"skipped"}
        expected[f"reference {layout}"] = {"pass"}
        for backend in (*BACKENDS, *kernels):
            for dtype in SMOKE_DTYPES:
                expected[f"forward {layout} {backend} {dtype}"] = status(backend)
                if (backend != "eager" or dtype != "fp32") and not (backend.startswith("kernel=") and dtype == "fp32"):
                    expected[f"grads {layout} {backend} {dtype}"] = status(backend)  # fp32: against eager's
            expected[f"generate {layout} {backend} dynamic"] = status(backend)
            if not backend.startswith("kernel="):
                expected[f"left-padding {layout} {backend}"] = status(backend)
        expected[f"generate {layout} sdpa compiled-static"] = {"skipped"}
    return expected


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    lines = []
    report = gpu_check.run(gpu_check.smoke_profile(), str(out), ["--smoke"], log=lines.append)
    return report, out, lines


def test_the_parts_run_in_the_order_the_slot_needs(smoke_run):
    """Speed (compiled decoding included) first, then the attention candidates, the tuning sweep, the correctness
    checks: the order in which a slot cut short loses the least."""
    report, _, lines = smoke_run
    parts = report["parts"]
    assert list(parts) == list(gpu_check.PARTS) == ["speed", "attention", "tuning", "checks"]
    starts = [parts[p]["started_s"] for p in gpu_check.PARTS]
    assert starts == sorted(starts) and all(parts[p]["seconds"] >= 0 and "error" not in parts[p] for p in parts)
    words = [line.split("]", 1)[1].split() if line.startswith("[") else [] for line in lines]  # after the clock
    headers = [i for i, w in enumerate(words) if w[:1] == ["PART"]]
    assert [words[i][1] for i in headers] == list(gpu_check.PARTS)
    compiled = next(i for i, w in enumerate(words) if w[:1] == ["DONE"] and "static+compile" in w)
    first_check = next(i for i, w in enumerate(words) if w[:1] in (["PASS"], ["ABSENT"]))
    assert headers[0] < compiled < headers[1] < headers[3] < first_check


def test_smoke_reports_every_check_with_a_verdict(smoke_run):
    report, out, _ = smoke_run
    on_disk = json.loads((out / gpu_check.REPORT).read_text())
    assert on_disk["checks"] == json.loads(json.dumps(report["checks"]))  # the file holds the final report
    got = {c["name"]: c for c in report["checks"]}
    assert len(got) == len(report["checks"]), "check names repeat"
    expected = _expected_checks()
    assert set(got) == set(expected)
    wrong = {
        name: (got[name]["status"], got[name]["detail"][:300])
        for name, allowed in expected.items()
        if got[name]["status"] not in allowed
    }
    assert not wrong, wrong
    for c in got.values():
        assert set(c) >= {"name", "status", "passed", "max_err", "bound", "detail", "seconds"}
        if c["status"] == "pass":
            assert c["passed"] is True and 0 <= c["max_err"] <= c["bound"], c
        else:
            assert c["passed"] is None and c["detail"], c
    assert report["counts"]["fail"] == report["counts"]["error"] == 0
    if HAS_KNOB:  # the forced kernels that run on a CPU are checked, not all skipped
        assert any(c["status"] == "pass" for name, c in got.items() if "kernel=" in name)
    # flex attention's checks (each compiles) come last
    names = [c["name"] for c in report["checks"]]
    flex = [i for i, n in enumerate(names) if "flex_attention" in n]
    assert flex and min(flex) > max(i for i, n in enumerate(names) if "flex_attention" not in n)


def test_smoke_records_versions_commit_device_and_the_code_it_ran(smoke_run):
    meta = smoke_run[0]["meta"]
    assert meta["mode"] == "smoke" and meta["device"] == "cpu" and meta["gpu"] is None
    versions = meta["versions"]
    assert versions["torch"] == torch.__version__ and versions["python"] and versions["transformers"]
    assert meta["git_commit"] and meta["git_dirty"] is not None
    int(meta["source_digest"], 16)  # a hex digest (not compared with a fresh one: the sources may change meanwhile)
    assert len(meta["source_digest"]) == 16
    assert meta["elapsed_s"] > 0 and meta["finished"] is True
    provenance = smoke_run[0]["provenance"]  # what every result JSON records (benchmarks/harness.py)
    assert provenance["script"] == "gpu_check.py" and provenance["command"] == "python -m benchmarks.gpu_check --smoke"
    assert provenance["commit"] == meta["git_commit"] and provenance["versions"]["torch"] == torch.__version__
    code = provenance["code"]["digests"]  # the code the run executed, for the docs' staleness line
    assert provenance["code"]["how"] == "traced"
    assert {"benchmarks/bench.py:prefill_workload", "benchmarks/bench.py:decode_workload"} <= set(code)
    assert any(k.startswith("difftransformer/modeling_difftransformer.py:") for k in code)


def test_smoke_speed_rows_name_their_kernel_floor_and_verdict(smoke_run):
    speed = smoke_run[0]["speed"]
    shape = speed["shapes"]["smoke"]
    plan = gpu_check.smoke_profile().speed_shapes[0].plan
    expected = {f"prefill {b}x{t}" for b, t in plan.prefill_shapes}
    expected |= {f"decode b{b} dynamic" for b in plan.decode_batches} | {"train {}x{}".format(*plan.train_shape)}
    expected |= {"train {}x{} ckpt".format(*plan.train_shape), "decode b1 static+compile"}
    rows = {r["item"]: r for r in shape["results"]}
    assert set(rows) == expected
    select = getattr(modeling_difftransformer, "select_kernel", None)
    for item, row in rows.items():
        assert "error" not in row, (item, row.get("error"))
        kinds = {"llama", "ours_v1"} if "compile" in item else {"llama", "diffllama", "ours_v1", "ours_v2"}
        assert set(row["models"]) == kinds
        for kind, stats in row["models"].items():
            assert stats["median"] > 0 and math.isfinite(stats["median"]), (item, kind)
            assert stats["flops"] > 0
            if kind.startswith("ours_"):
                assert stats["ratio"] > 0 and 0.5 < stats["flop_floor"] < 1.5, (item, kind)
                assert set(stats["kernel"]) == {"last", "selected"}
                if select is not None:  # the kernel the dispatch chose, and (eager rows) the one the modules ran
                    workload = row["family"]
                    assert stats["kernel"]["selected"] == select(int(kind[-1]), "cpu", workload, torch.float32)
                    assert stats["kernel"]["last"] or "compile" in item
        v1 = row["models"]["ours_v1"]  # V1 is judged against the floor of the formulation its kernel computes
        assert v1["flop_floor"] == v1["flop_floors"][v1["formulation"]]
        if select is not None:
            ran = (v1["kernel"]["last"] or [v1["kernel"]["selected"]])[0]
            assert v1["formulation"] == gpu_check.KERNEL_FORMULATION[ran]
        assert v1["flop_floors"]["combined"] < v1["flop_floors"]["one_pass"] < v1["flop_floors"]["padded"]
        for kind, target in row["targets"].items():  # judged as GPU_TARGETS says
            assert target == gpu_check.gpu_target(kind, row) and target["met"] == (target["ratio"] <= target["limit"])
    assert set(rows["decode b1 dynamic"]["targets"]) == {"ours_v1", "ours_v2"}
    assert set(rows["decode b2 dynamic"]["targets"]) == {"ours_v2"}  # V1's eager decode target is at batch 1
    # without CUDA no GPU memory; the compiled row of the second batch is skipped with its reason
    reasons = {(s["item"], s["reason"]) for s in speed["skipped"]}
    assert ("peak MiB", "skipped: peak GPU memory needs CUDA") in reasons
    assert ("decode b2 static+compile", gpu_check.smoke_profile().skip_compiled_rows[2]) in reasons


def test_smoke_compiled_decode_row_takes_the_compiled_path_and_reports_compile_time(smoke_run):
    rows = smoke_run[0]["speed"]["shapes"]["smoke"]["results"]
    row = next(r for r in rows if r["item"] == "decode b1 static+compile")
    assert row["group"] == "decode_compiled"
    for kind, stats in row["models"].items():
        assert stats["compiled_path"] is True and stats["graphs_compiled"] > 0, kind  # generate() compiled its step
        assert stats["compile_options"] == {"fullgraph": False, "backend": "eager", "mode": None}
        assert stats["first_call_s"] >= stats["compile_s"] >= 0 and stats["second_call_s"] > 0
        assert stats["first_call_s"] > stats["second_call_s"]  # the first call traced the model
        assert len(stats["samples"]) == gpu_check.smoke_profile().speed_shapes[0].plan.reps
    table = gpu_check.doc_table_compile([smoke_run[0]], {"shape": "smoke"})
    assert len(table) == 2 + len(row["models"]) and "| decode b1 static+compile | Llama |" in table[2]


def test_rows_that_miss_a_target_carry_a_kernel_only_profile(smoke_run):
    shape = smoke_run[0]["speed"]["shapes"]["smoke"]
    profiled = 0
    for row in shape["results"]:
        missed = {k for k, t in row.get("targets", {}).items() if not t["met"]}
        if not missed:
            assert "profiles" not in row
            continue
        assert set(row["profiles"]) == {"llama"} | missed, row["item"]
        for prof in row["profiles"].values():
            assert prof["what"].startswith("CPU stand-in") and prof["launches"] > 0
            assert 0 < prof["kernel_ms"] <= prof["wall_ms"] * 1.01 and not prof["double_counted"]
            profiled += 1
    assert profiled  # tiny models on one CPU thread miss the GPU targets somewhere
    launches = smoke_run[0]["speed"]["launches"]["smoke"]
    assert set(launches) == {"llama", "diffllama", "ours_v1", "ours_v2"}
    for prof in launches.values():
        plan = gpu_check.smoke_profile().speed_shapes[0].plan
        assert prof["steps"] == plan.new_tokens - 1 and prof["launches_per_step"] > 0
        assert prof["launches_per_step_per_layer"] == pytest.approx(prof["launches_per_step"] / 2, abs=0.01)


def _event(name, start, end, device="cuda", annotation=False, activity=None, parent=None):
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    event = FunctionEvent(
        id=0,
        name=name,
        thread=0,
        start_us=start,
        end_us=end,
        is_user_annotation=annotation,
        device_type=DeviceType.CUDA if device == "cuda" else DeviceType.CPU,
        activity_type=activity,
    )
    event.cpu_parent = parent
    return event


def test_the_kernel_only_profile_counts_device_kernels_once():
    """A CPU operator, a user annotation, CUPTI's "Command Buffer Full" and an overhead record are not kernels; each
    kernel counts once, by its own duration; a total above the wall time is flagged as double counting."""
    op = _event("aten::mm", 0, 100, device="cpu", activity="cpu_op")  # its device time is its kernels' time
    events = [
        op,
        _event("my step", 0, 100, device="cpu", annotation=True, activity="user_annotation"),
        _event("gemm_kernel", 10, 40, activity="kernel"),
        _event("gemm_kernel", 50, 70, activity="kernel"),
        _event("Memset (Device)", 70, 72, activity="gpu_memset"),
        _event("my step", 5, 95, annotation=True, activity="gpu_user_annotation"),
        _event("Command Buffer Full", 0, 900),
        _event("Lazy Function Loading", 0, 50, activity="overhead"),
    ]
    assert [gpu_check.is_device_kernel(e) for e in events] == [False, False, True, True, True, False, False, False]
    summary = gpu_check.summarize_kernels(events, wall_s=100e-6, device="cuda", steps=2, layers=1)
    assert summary["kernel_ms"] == pytest.approx(0.052) and summary["launches"] == 3
    assert summary["launches_per_step"] == 1.5 and summary["launches_per_step_per_layer"] == 1.5
    assert summary["top"][0] == {"name": "gemm_kernel", "ms": 0.05, "calls": 2, "share": pytest.approx(50 / 52, 1e-3)}
    assert summary["kernel_over_wall"] == pytest.approx(0.52) and not summary["double_counted"]
    assert set(summary["categories"]) == {"matmul", "copy"}
    assert gpu_check.summarize_kernels(events, wall_s=40e-6, device="cuda")["double_counted"]
    # the CPU stand-in: top-level operators only (an annotation above them does not make them nested)
    child = _event("aten::addmm", 10, 90, device="cpu", activity="cpu_op", parent=op)
    under_annotation = _event("aten::add", 100, 110, device="cpu", activity="cpu_op", parent=events[1])
    cpu = gpu_check.summarize_kernels([op, child, under_annotation, events[1]], wall_s=200e-6, device="cpu")
    assert cpu["launches"] == 2 and cpu["kernel_ms"] == pytest.approx(0.11)


def test_attention_training_rows_backpropagate_the_given_upstream_gradient():
    """``out.backward(dout)``: the query, key, value and λ gradients after a candidate's run are the vector-Jacobian
    product with its drawn dout (not the gradient of a reduction), for the Llama's call and V1's padded and library
    calls; a second run starts from fresh gradients with the same dout."""
    runs, absent, state = gpu_check.attention_candidates(1, 12, 12, 8, 4, 16, torch.float32, "cpu", True)
    inputs = state["inputs"]
    checked = 0
    for name in ("llama_sdpa", "padded", "sdpa_two_calls", "sdpa_repeated_value"):
        if name in absent:
            module, function = gpu_check.CANDIDATE_FUNCTIONS[name]
            assert not hasattr(importlib.import_module(f"difftransformer.{module}"), function), absent[name]
            continue
        runs[name]()
        got = [None if x.grad is None else x.grad.clone() for x in inputs]
        runs[name]()
        assert all(torch.equal(a, x.grad) for a, x in zip(got, inputs) if a is not None)
        dout = state["douts"][name]
        out = runs[name](step=False)  # the same forward, its graph kept
        assert dout.shape == out.shape and dout.abs().sum() > 0
        used = [x for x, g in zip(inputs, got) if g is not None]
        expected = torch.autograd.grad(out, used, dout)
        for g, e in zip([g for g in got if g is not None], expected):
            torch.testing.assert_close(g, e)
        assert (got[3] is None) == (name == "llama_sdpa")  # V1's calls give λ its gradient
        checked += 1
    assert checked >= 2


def test_smoke_times_the_attention_candidates_with_their_backends(smoke_run):
    attention = smoke_run[0]["attention"]
    assert attention["heads"] == list(gpu_check.smoke_profile().attention_heads)
    rows = attention["rows"]
    assert [r["item"] for r in rows] == [s[0] for s in gpu_check.SMOKE_ATTENTION_SHAPES]
    for row in rows:
        assert "models" in row, row
        decode = row["item"].startswith("decode")
        candidates = {"llama_sdpa", "padded", "sdpa_two_calls", "sdpa_repeated_value"} | (
            {"decode_kernel"} if decode else set()
        )
        for name in candidates - set(row["models"]):  # absent only where this version lacks the function
            module, function = gpu_check.CANDIDATE_FUNCTIONS[name]
            assert row["failed"][name].startswith("absent"), row["failed"][name]
            assert not hasattr(importlib.import_module(f"difftransformer.{module}"), function)
        assert row["failed"]["triton"] == gpu_check.smoke_profile().skip_candidates["triton"]
        assert row["backward"] == ("out.backward(dout)" if row["item"].startswith("train") else None)
        assert row["models"]["llama_sdpa"]["ratio"] == 1.0
        for name, stats in row["models"].items():  # the decode kernel is matmuls: no SDPA backend to name
            assert stats["median_ms"] > 0 and bool(stats["backends"]) == (name != "decode_kernel"), (row["item"], name)
            if name != "llama_sdpa":  # every V1 candidate computes what the padded call computes
                assert stats["disagrees"] is False and stats["max_diff_vs_padded"] < 1e-4, (row["item"], name)
        # on a CPU the Llama's SDPA call runs torch's CPU flash kernel; the 2d-wide value sends V1's calls to math
        assert row["models"]["llama_sdpa"]["backends"] == ["flash"]
        if "sdpa_two_calls" in row["models"] and not decode:
            assert row["models"]["sdpa_two_calls"]["backends"] == ["math"]


def test_sdpa_backends_are_named_from_operator_and_kernel_names():
    assert gpu_check.sdpa_backends(
        ["aten::_scaled_dot_product_cudnn_attention", "cudnn_generated_fort_native_sdpa_sm90_knob_7"]
    ) == ["cudnn"]
    assert gpu_check.sdpa_backends(
        [
            "aten::_efficient_attention_forward",
            "fmha_cutlassF_bf16_aligned_64x64_rf_sm80",
            "aten::_scaled_dot_product_flash_attention_for_cpu",
        ]
    ) == ["mem_efficient", "flash"]
    assert gpu_check.sdpa_backends(["aten::_scaled_dot_product_attention_math", "_diff_attn_fwd"]) == ["math", "triton"]
    assert gpu_check.sdpa_backends(["sm90_xmma_gemm_bf16bf16", "aten::mm"]) == []


def test_smoke_runs_the_tuning_sweep_on_its_smoke_problems(smoke_run):
    """The tuning part calls the Triton module's sweep (on the interpreter: its logic, not timings) and keeps its
    result; where this version of the module has no sweep, it says so."""
    from difftransformer.kernels.triton import attention as triton_difftransformer

    tuning = smoke_run[0]["tuning"]
    if not hasattr(triton_difftransformer, "tuning_sweep"):
        assert tuning["status"] == "absent" and "tuning_sweep" in tuning["reason"]
        return
    if not hasattr(triton_difftransformer, "SWEEP_SMOKE_SHAPES") or importlib.util.find_spec("triton") is None:
        assert tuning["status"] in ("skipped", "absent") and tuning["reason"]
        return
    assert tuning["status"] == "done", tuning.get("reason")
    assert tuning["arguments"]["shapes"] == "smoke" and tuning["arguments"]["device"] == "cpu"
    swept = {(e["kernel"], e["shape"]) for e in tuning["result"]["results"]}
    assert swept == {(k, s["name"]) for s in triton_difftransformer.SWEEP_SMOKE_SHAPES for k in s["kernels"]}
    assert gpu_check.tuning_text(tuning).startswith("tuning sweep: done") and "\n" in gpu_check.tuning_text(tuning)


def test_smoke_writes_the_summary(smoke_run):
    report, out, _ = smoke_run
    text = (out / gpu_check.SUMMARY).read_text()
    lines = text.splitlines()
    tags = {"pass": "PASS", "fail": "FAIL", "error": "ERROR", "skipped": "SKIP", "absent": "ABSENT"}
    for c in report["checks"]:  # one line per check: its verdict, its name, then its numbers or why not
        head = f"{tags[c['status']]:6s} {c['name']}"
        assert sum(line == head or line.startswith(head + "  ") for line in lines) == 1, head
    assert "| row | Llama | DiffLlama × | V1 × | V2 × |" in text and "| prefill 1x32 |" in text
    assert "compiled decoding, smoke:" in text and "kernel launches per eager decode step" in text
    assert "attention of one layer" in text and "tuning sweep:" in text and "part speed:" in text
    assert report["meta"]["git_commit"] in text
    # the summary can be rebuilt from the report alone (what gpu_check.sh does after a timeout)
    (out / gpu_check.SUMMARY).unlink()
    assert gpu_check.main(["--out", str(out), "--summarize"]) == 0
    assert (out / gpu_check.SUMMARY).read_text() == text


def test_the_time_budget_skips_instead_of_overrunning(tmp_path):
    profile = replace(gpu_check.smoke_profile(), budget_s=0.0)
    report = gpu_check.run(profile, str(tmp_path), log=lambda line: None)
    assert report["checks"] and all(c["status"] in ("skipped", "absent") for c in report["checks"])
    assert any(c["detail"] == "skipped: time budget" for c in report["checks"])
    assert report["speed"]["shapes"]["smoke"]["results"] == []
    assert {s["reason"] for s in report["speed"]["skipped"]} >= {"skipped: time budget"}
    assert all(r == {"item": r["item"], "skipped": "time budget"} for r in report["attention"]["rows"])


def test_each_part_starts_rows_only_within_its_allowance():
    budget = gpu_check.Budget(100.0, start=0.0)
    budget.elapsed = lambda: 10.0  # a clock that stands still at 10 s
    budget.begin(30.0)  # this part may start rows until 40 s
    assert budget.deadline_s == 40.0 and budget.allows(30.0) and not budget.allows(30.5)
    budget.begin(None)  # the last part: until the budget ends
    assert budget.deadline_s == 100.0
    budget.begin(500.0)  # never past the budget
    assert budget.deadline_s == 100.0
    # the GPU allowances leave the checks part time within the default budget, under the shell's hard timeout
    fixed = sum(v for v in gpu_check.PART_BUDGET_S.values() if v is not None)
    assert fixed < gpu_check.DEFAULT_BUDGET_S < 540
    assert list(gpu_check.PART_BUDGET_S) == list(gpu_check.PARTS) and gpu_check.PART_BUDGET_S["checks"] is None


def test_only_takes_parts_by_name():
    assert gpu_check.parse_args(["--only", "checks"]).only == ("checks",)
    assert gpu_check.parse_args(["--only", "speed,attention"]).only == ("speed", "attention")
    assert gpu_check.parse_args([]).only == gpu_check.PARTS
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--only", "sped"])


def test_a_model_that_raises_leaves_its_row_not_the_others(monkeypatch, tmp_path):
    """One model's workload raising (a kernel failing on the GPU, memory) costs that model its cells: the row keeps
    the others' numbers and says why the model is missing; the Llama raising fails the row."""
    plan, shape = bench.smoke_plan_and_shape()
    plan = replace(plan, reps=2, warmup=0)
    models = {m: bench.build_model(m, shape) for m in ("llama", "ours_v1", "ours_v2")}
    workload = gpu_check._row_workload

    def failing(kinds):
        def build(group, model, *args):
            if model is not None and any(model is models[k] for k in kinds):

                def run():
                    raise RuntimeError("no kernel image is available for execution on the device")

                return run
            return workload(group, model, *args)

        return build

    rec = gpu_check.Recorder(
        {"meta": {}, "checks": [], "provenance": {}}, str(tmp_path), gpu_check.Budget(60.0), lambda line: None
    )
    spec = bench.group_items("prefill", plan)[0]
    monkeypatch.setattr(gpu_check, "_row_workload", failing(["ours_v1"]))
    row = gpu_check.measure_row(rec, "prefill", spec, models, plan, gpu_check.smoke_profile())
    assert set(row["models"]) == {"llama", "ours_v2"} and row["models"]["ours_v2"]["median"] > 0
    assert row["failed"] == {"ours_v1": "RuntimeError: no kernel image is available for execution on the device"}
    assert "ours_v1" not in row["targets"] and "ours_v1" not in row.get("profiles", {})
    monkeypatch.setattr(gpu_check, "_row_workload", failing(["llama"]))
    with pytest.raises(RuntimeError, match="the Llama's prefill 1x32 raised"):
        gpu_check.measure_row(rec, "prefill", spec, models, plan, gpu_check.smoke_profile())


def test_gpu_memory_rows_with_a_stand_in_allocator(monkeypatch):
    """memory_rows reads torch.cuda's allocator statistics; here a stand-in counts each model's parameter bytes as
    resident and 2 MiB more as the peak of every run."""
    plan, shape = bench.smoke_plan_and_shape()
    models = {m: bench.build_model(m, shape) for m in ("llama", "ours_v2")}
    state = {"model": None}
    resident = {kind: sum(p.numel() * 4 for p in m.parameters()) for kind, m in models.items()}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: resident[state["model"]])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: resident[state["model"]] + 2**21)

    class Tracking(dict):  # tells the stand-in which model runs
        def items(self):
            for kind, model in super().items():
                state["model"] = kind
                yield kind, model

    rows = gpu_check.memory_rows(Tracking(models), plan)
    assert [r["item"] for r in rows] == [
        "peak MiB prefill {}x{}".format(*plan.memory_prefill),
        f"peak MiB decode b{plan.memory_decode_batch}",
        "peak MiB train {}x{}".format(*plan.train_shape),
    ]
    for row in rows:
        assert row["unit"] == "MiB"
        assert row["models"]["llama"]["median"] == pytest.approx(2.0) and row["models"]["ours_v2"]["ratio"] == 1.0
        assert row["models"]["ours_v2"]["resident_mib"] == pytest.approx(resident["ours_v2"] / 2**20)


def test_the_committed_gpu_results_render_and_give_the_readme_row():
    """The 2026-11-28 H200 run (speed and checks files) through the report's tables and the README's rows: one
    number per model and row; no compiled-decoding row (that run skipped it for time)."""
    speed = json.loads((ROOT / "benchmarks/results/gpu_check_h200_2026-11-28_speed.json").read_text())
    checks = json.loads((ROOT / "benchmarks/results/gpu_check_h200_2026-11-28_checks.json").read_text())
    readme = gpu_check.readme_rows(speed)
    assert [label.split(",")[0] for label, _ in readme] == [
        "GPU prefill 8×2048",
        "GPU training step 8×2048",
        "GPU decode at batch 1",
    ]
    assert all("(NVIDIA H200, bf16, Llama-3.2-1B's shape)" in label for label, _ in readme)
    rows = {r["item"]: r["models"] for r in speed["speed"]["shapes"]["llama-3.2-1b"]["results"]}
    v1, v2 = rows["prefill 8x2048"]["ours_v1"]["paired_ratio"], rows["prefill 8x2048"]["ours_v2"]["paired_ratio"]
    assert readme[0][1] == {"llama": "1.00", "v1": f"{v1:.2f}", "v2": f"{v2:.2f}"}
    table = gpu_check.doc_table_speed([speed], {})
    assert table[0].startswith("| row | Llama | V1 × | V2 × | V1 kernel | V2 kernel | V1 judged | V2 judged |")
    assert any(line.startswith("| decode b1 static+compile | not run: time budget |") for line in table)
    assert "| prefill 8x2048 |" in table[3] and "one_pass floor" in table[3] and "✗" in table[3]
    counts = gpu_check.doc_table_checks([speed, checks], {})
    assert counts[2] == "| --budget 420 | NVIDIA H200 | 344 | 49 | 0 | 0 | 115 | 10 |"
    assert counts[3] == "| --budget 750 --only checks | NVIDIA H200 | 252 | 107 | 0 | 0 | 11 | 56 |"
    assert len(gpu_check.doc_table_attention([speed], {})) == 2 + 5


def test_git_commit_from_the_environment(monkeypatch):
    """The GPU machine gets a copy without .git: the commit comes from GIT_COMMIT / GIT_DIRTY (harness.git_state)."""
    monkeypatch.setenv("GIT_COMMIT", "abc123")
    monkeypatch.setenv("GIT_DIRTY", "1")
    assert harness.git_state() == ("abc123", True, [])
    monkeypatch.setenv("GIT_DIRTY", "unknown")
    assert harness.git_state() == ("abc123", "unknown", [])


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_shell_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_gpu_check_sh_help_needs_no_gpu():
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--help"], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    assert "Usage:" in proc.stdout and "GIT_COMMIT" in proc.stdout and "set -" not in proc.stdout


def test_gpu_check_sh_runs_the_module_and_keeps_its_log(tmp_path):
    """The prepared command end to end, as the GPU machine runs it (no wheels, the package from the working tree on
    PYTHONPATH, ``python -m benchmarks.gpu_check``), on its cheapest part: the report, summary and log land in OUT."""
    out, wheels = tmp_path / "out", tmp_path / "no-wheels"
    wheels.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "PYTHON": sys.executable,
        "GPU_CHECK_WHEELS": str(wheels),
        "GIT_COMMIT": "0" * 40,
        "GIT_DIRTY": "0",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "--", "--smoke", "--only", "tuning"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / gpu_check.REPORT).read_text())
    assert report["meta"]["finished"] and report["meta"]["git_commit"] == "0" * 40
    assert report["provenance"]["command"].startswith("python -m benchmarks.gpu_check --out ")
    assert report["parts"]["tuning"]["seconds"] >= 0 and report["parts"]["speed"] == {"status": "not requested"}
    log = (out / "gpu_check.log").read_text()
    assert "WARNING: no wheels" in log and "tuning sweep" in log and "done, rc 0" in log
    assert (out / gpu_check.SUMMARY).read_text() in log
