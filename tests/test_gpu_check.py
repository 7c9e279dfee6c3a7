"""The prepared GPU check (benchmarks/gpu_check.py, scripts/gpu_check.sh) works before a GPU is lent: its CPU smoke mode
produces a complete report, its time guard skips instead of overrunning, and the shell scripts parse.

GPU time is rare and short: a check that crashes or reports nothing there is a lost run. Everything but the CUDA-only
parts (flex attention, compiling, GPU memory) runs here; GPU memory is measured with a stand-in allocator."""

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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench, gpu_check, harness  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMOKE_LAYOUTS = ("v1_gqa", "v2_gqa")
SMOKE_DTYPES = ("fp32", "bf16")
BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


def _expected_checks() -> dict[str, str]:
    """Every check the smoke run must report, with the status it must have on a CPU."""
    flash = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}

    def status(backend):
        if backend == "flex_attention":
            return "skipped"  # compiles too slowly for the smoke run
        if backend in flash:
            return "absent" if importlib.util.find_spec(flash[backend]) is None else "skipped"
        return "pass"

    expected = {}
    triton = "pass" if importlib.util.find_spec("triton") else "absent"
    for case in gpu_check.SMOKE_TRITON_CASES:
        for dtype in SMOKE_DTYPES:
            expected[f"triton {case[0]} d16 {dtype}"] = triton
    for layout in SMOKE_LAYOUTS:
        expected[f"liger {layout}"] = "absent" if importlib.util.find_spec("liger_kernel") is None else "skipped"
        expected[f"reference {layout}"] = "pass"
        for backend in BACKENDS:
            for dtype in SMOKE_DTYPES:
                expected[f"forward {layout} {backend} {dtype}"] = status(backend)
                if backend != "eager" or dtype != "fp32":  # fp32 gradients are compared with eager's
                    expected[f"grads {layout} {backend} {dtype}"] = status(backend)
            expected[f"generate {layout} {backend} dynamic"] = status(backend)
            expected[f"left-padding {layout} {backend}"] = status(backend)
        expected[f"generate {layout} sdpa compiled-static"] = "skipped"
    return expected


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    report = gpu_check.run(gpu_check.smoke_profile(), str(out), ["--smoke"], log=lambda line: None)
    return report, out


def test_smoke_reports_every_check_with_a_verdict(smoke_report):
    report, out = smoke_report
    on_disk = json.loads((out / gpu_check.REPORT).read_text())
    assert on_disk["checks"] == json.loads(json.dumps(report["checks"]))  # the file holds the final report
    got = {c["name"]: c for c in report["checks"]}
    assert len(got) == len(report["checks"]), "check names repeat"
    expected = _expected_checks()
    assert set(got) == set(expected)
    wrong = {name: (got[name]["status"], got[name]["detail"][:300]) for name, status in expected.items()
             if got[name]["status"] != status}
    assert not wrong, wrong
    for c in got.values():
        assert set(c) >= {"name", "status", "passed", "max_err", "bound", "detail", "seconds"}
        if c["status"] == "pass":
            assert c["passed"] is True and 0 <= c["max_err"] <= c["bound"], c
        else:
            assert c["passed"] is None and c["detail"], c
    assert report["counts"]["fail"] == report["counts"]["error"] == 0


def test_smoke_records_versions_commit_and_device(smoke_report):
    meta = smoke_report[0]["meta"]
    assert meta["mode"] == "smoke" and meta["device"] == "cpu" and meta["gpu"] is None
    versions = meta["versions"]
    assert versions["torch"] == torch.__version__ and versions["python"] and versions["transformers"]
    assert meta["git_commit"] and meta["git_dirty"] is not None
    int(meta["source_digest"], 16)  # a hex digest (not compared with a fresh one: the sources may change meanwhile)
    assert len(meta["source_digest"]) == 16
    assert meta["elapsed_s"] > 0 and meta["finished"] is True
    provenance = smoke_report[0]["provenance"]  # what every result JSON records (benchmarks/harness.py)
    assert provenance["script"] == "gpu_check.py" and provenance["command"] == "python benchmarks/gpu_check.py --smoke"
    assert provenance["commit"] == meta["git_commit"] and provenance["versions"]["torch"] == torch.__version__


def test_smoke_speed_rows_have_numbers_and_flop_floors(smoke_report):
    speed = smoke_report[0]["speed"]
    shape = speed["shapes"]["smoke"]
    plan = gpu_check.smoke_profile().speed_shapes[0].plan
    expected = {f"prefill {b}x{t}" for b, t in plan.prefill_shapes}
    expected |= {f"decode b{b} dynamic" for b in plan.decode_batches} | {"train {}x{}".format(*plan.train_shape)}
    expected |= {"train {}x{} ckpt".format(*plan.train_shape)}
    rows = {r["item"]: r for r in shape["results"]}
    assert set(rows) == expected
    for item, row in rows.items():
        assert "error" not in row, (item, row.get("error"))
        assert set(row["models"]) == {"llama", "ours_v1", "ours_v2"}
        for kind, stats in row["models"].items():
            assert stats["median"] > 0 and math.isfinite(stats["median"]), (item, kind)
            assert stats["flops"] > 0
            if kind != "llama":
                assert stats["ratio"] > 0 and 0.5 < stats["flop_floor"] < 1.5, (item, kind)
    # without CUDA: no GPU memory; smoke: no compiling
    assert {(s["item"], s["reason"].split(":")[0]) for s in speed["skipped"]} == {("peak MiB", "skipped")} | {
        (f"decode b{b} static+compile", "skipped") for b in gpu_check.Profile("cpu").compiled_decode_batches}
    # V1 rows carry the floors of the three formulations and judge the one its kernel computes (CPU: combined)
    v1 = rows["prefill {}x{}".format(*plan.prefill_shapes[0])]["models"]["ours_v1"]
    assert v1["formulation"] == "combined" and v1["flop_floor"] == v1["flop_floors"]["combined"]
    assert v1["flop_floors"]["combined"] < v1["flop_floors"]["one_pass"] < v1["flop_floors"]["padded"]


def test_smoke_times_attention_candidates_and_profiles_every_model(smoke_report):
    report = smoke_report[0]
    rows = report["attention"]["rows"]
    assert rows and all("models" in row for row in rows), rows
    for row in rows:
        assert {"llama_sdpa", "v1_padded_sdpa", "v1_two_calls_sdpa"} <= set(row["models"])
        assert row["models"]["llama_sdpa"]["ratio"] == 1.0
        assert all(v["median_ms"] > 0 for v in row["models"].values())
    profiles = report["profiles"]["smoke"]
    assert set(profiles) == {"llama", "ours_v1", "ours_v2"}
    for workloads in profiles.values():
        for prof in workloads.values():
            assert prof["total_ms"] > 0 and prof["top"] and abs(sum(prof["categories"].values()) - 1) < 1e-3


def test_smoke_writes_the_summary(smoke_report):
    report, out = smoke_report
    text = (out / gpu_check.SUMMARY).read_text()
    lines = text.splitlines()
    tags = {"pass": "PASS", "fail": "FAIL", "error": "ERROR", "skipped": "SKIP", "absent": "ABSENT"}
    for c in report["checks"]:  # one line per check: its verdict, its name, then its numbers or why not
        head = f"{tags[c['status']]:6s} {c['name']}"
        assert sum(line == head or line.startswith(head + "  ") for line in lines) == 1, head
    assert "| metric | llama |" in text and "prefill" in text
    assert "GPU targets:" in text and "attention of one layer" in text and "profile, smoke" in text
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
    assert [r["item"] for r in rows] == ["peak MiB prefill {}x{}".format(*plan.memory_prefill),
                                         f"peak MiB decode b{plan.memory_decode_batch}",
                                         "peak MiB train {}x{}".format(*plan.train_shape)]
    for row in rows:
        assert row["unit"] == "MiB"
        assert row["models"]["llama"]["median"] == pytest.approx(2.0) and row["models"]["ours_v2"]["ratio"] == 1.0
        assert row["models"]["ours_v2"]["resident_mib"] == pytest.approx(resident["ours_v2"] / 2**20)


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
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--help"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "Usage:" in proc.stdout and "GIT_COMMIT" in proc.stdout and "set -" not in proc.stdout
