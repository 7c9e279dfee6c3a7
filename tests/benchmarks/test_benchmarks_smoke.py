"""The benchmarks cannot rot, and what they report can be trusted.

* ``benchmarks/bench.py --smoke`` runs (the command of docs/performance.md), producing every table row, the JSON (with
  the record of the code it ran) and the PNG;
* the commands docs/performance.md shows parse with their scripts' flags;
* ``ours_v1_padded`` really runs one padded SDPA call per layer instead of the package's own V1 kernel, and gives the
  logits of ``ours_v1``;
* the ratios, targets, paired statistics and FLOP floors are what they claim.

The kernels' own tests (gradients, agreement with eager inside a model) are in
tests/kernels/test_kernels_difftransformer.py.

No timing is asserted anywhere: timings are the benchmarks' output, not a property of the code.
"""

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

from benchmarks import bench, bench_gda  # noqa: E402
from benchmarks.padded_sdpa import PADDED_SDPA  # noqa: E402

DOC = ROOT / "docs" / "performance.md"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _doc_commands(script: str) -> list[list[str]]:
    """The arguments of every ``python benchmarks/<script> ...`` (or ``python -m benchmarks.<module> ...``: the same
    run) command line of docs/performance.md, split like a shell would."""
    text = DOC.read_text()
    module = re.escape(script.removesuffix(".py"))
    run = rf"(?:\.venv-vllm/bin/)?python (?:benchmarks/{re.escape(script)}|-m benchmarks\.{module})(?![\w.])"
    lines = re.findall(rf"^(?:\$ )?({run}[^\n]*)$", text, flags=re.M)
    return [shlex.split(re.sub(run, "python script", line, count=1), comments=True)[2:] for line in lines]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------- smoke runs of the scripts (as documented)


def test_bench_smoke_runs_every_row_and_writes_json_and_png(tmp_path):
    smoke = [args for args in _doc_commands("bench.py") if "--smoke" in args]
    assert smoke, "docs/performance.md must show the smoke command"
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench.py", *smoke[0], "--json", str(out_json), "--png", str(out_png)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| metric | llama |" in proc.stdout
    report = json.loads(out_json.read_text())
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {r["item"]: r for r in report["results"]["fp32"]}
    plan, _ = bench.smoke_plan_and_shape()
    expected = {f"prefill {b}x{t}" for b, t in plan.prefill_shapes}
    expected |= {f"decode b{b} {c}" for b in plan.decode_batches for c in ("dynamic", "static")}
    expected |= {"train {}x{}".format(*plan.train_shape), "train {}x{} ckpt".format(*plan.train_shape)}
    expected |= {
        "peak MiB prefill {}x{}".format(*plan.memory_prefill),
        f"peak MiB decode b{plan.memory_decode_batch}",
        "peak MiB train {}x{}".format(*plan.train_shape),
    }
    assert set(rows) == expected
    # The code the run executed, recorded by tracing one untimed call per workload: the models' code and the
    # workloads, not the timing loop or the table formatting.
    code = report["provenance"]["code"]
    assert code["how"] == "traced"
    for name in (
        "difftransformer/modeling_difftransformer.py:DiffTransformerForCausalLM.forward",
        "benchmarks/bench.py:prefill_workload",
        "benchmarks/bench.py:decode_workload",
        "benchmarks/bench.py:train_workload",
        "benchmarks/bench.py:build_model",
    ):
        assert name in code["digests"], name
    assert not [
        n
        for n in code["digests"]
        if n.startswith("benchmarks/harness.py") or n.endswith((":format_table", ":main", ":chart_figure"))
    ]
    for item, row in rows.items():
        assert set(row["models"]) == set(bench.MODELS), item
        for kind, stats in row["models"].items():
            assert "error" not in stats, (item, kind, stats.get("error"))
            if row["unit"] == "s":
                assert stats["median"] > 0 and math.isfinite(stats["median"]), (item, kind)
                assert len(stats["samples"]) == plan.reps
            else:
                assert stats["resident_mib"] > 0 and stats["median"] >= 0, (item, kind)
        if row["unit"] == "s":
            assert row["models"]["llama"]["ratio"] == pytest.approx(1.0)
            if row.get("tokens"):
                assert row["models"]["llama"]["tokens_per_s"] == pytest.approx(
                    row["tokens"] / row["models"]["llama"]["median"]
                )
    # The chart marks every model's own target on its bar (not only V1's), and each timed row's paired quartiles.
    drawn = [
        (row, kind)
        for row in report["results"]["fp32"]
        for kind, stats in row["models"].items()
        if kind != "llama" and stats.get("ratio") is not None and math.isfinite(stats["ratio"])
    ]  # the bars
    targets = [bench.model_target(row, kind) for row, kind in drawn]
    targets = sorted(round(t, 9) for t in targets if t is not None)
    assert round(bench.TARGETS["decode"]["ours_v2"][None], 9) in targets  # V2's targets too
    fig = bench.chart_figure(report)
    ax = fig.axes[0]
    assert sorted(round(line.get_xdata()[0], 9) for line in ax.lines if line.get_color() == "black") == targets
    whiskers = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    assert len(whiskers) == sum("paired_quartiles" in row["models"][kind] for row, kind in drawn)
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_documented_full_commands_parse():
    """The commands shown in docs/performance.md use flags and values the scripts accept; the loops found them (the
    commands under each table, from the results' provenance, are checked by tests/repository/test_doc_numbers.py)."""
    found = {script: _doc_commands(script) for script in ("bench.py", "bench_gda.py", "bench_vllm.py")}
    assert len(found["bench.py"]) >= 3 and found["bench_gda.py"] and found["bench_vllm.py"], found
    for args in found["bench.py"]:
        ns = bench.parse_args(args)
        bench.parse_choices(ns.only, bench.GROUPS, "--only")
        bench.parse_choices(ns.models, bench.MODELS + bench.EXTRA_MODELS, "--models")
        bench.plan_and_shape(ns)
    for args in found["bench_gda.py"]:
        bench_gda.parse_args(args)
    from benchmarks import bench_vllm

    for args in found["bench_vllm.py"]:
        bench_vllm.parse_args(args)


def test_bad_flags_name_the_allowed_values(capsys):
    with pytest.raises(SystemExit, match="allowed values: prefill"):
        bench.main(["--only", "prefil", "--json", "", "--png", ""])
    with pytest.raises(SystemExit, match="BATCHxLENGTH"):
        bench.main(["--prefill-shapes", "512", "--json", "", "--png", ""])
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    assert "--smoke" in capsys.readouterr().out


# ---------------------------------------------------------------- ours_v1_padded: the previous V1 path


def test_ours_v1_padded_runs_the_previous_path_and_matches_ours_v1():
    """``ours_v1`` runs the package's differential kernel (on a CPU the blocked one) in every layer; ``ours_v1_padded``
    (same weights) never does (it gets the zero-padded queries through transformers' sdpa function) and gives the same
    logits."""
    import difftransformer.modeling_difftransformer as mdt

    _, shape = bench.smoke_plan_and_shape()
    ids = torch.randint(0, shape.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kind in ("ours_v1", "ours_v1_padded"):
        model = bench.build_model(kind, shape)
        assert model.config._attn_implementation == ("sdpa" if kind == "ours_v1" else PADDED_SDPA)
        with torch.no_grad():
            logits[kind] = model(ids).logits
        ran = [m.last_kernel for m in model.modules() if isinstance(m, mdt.DiffTransformerAttention)]
        assert ran == ["blocked" if kind == "ours_v1" else "padded"] * shape.num_hidden_layers, kind
    torch.testing.assert_close(logits["ours_v1_padded"], logits["ours_v1"], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- bench.py's bookkeeping


def test_targets_and_ratios():
    assert bench.target_for("prefill", "ours_v1", 2048) == 1.25
    assert bench.target_for("prefill", "ours_v1", 256) == 1.10
    assert bench.target_for("prefill", "ours_v1_padded", 512) == 1.10
    assert bench.target_for("decode", "ours_v2", None) == 1.03
    assert bench.target_for("train", "diffllama", None) is None
    stats = {
        "llama": {"median": 2.0},
        "diffllama": {"median": 2.6},
        "ours_v1": {"median": 2.4},
        "ours_v2": {"median": 2.04},
    }
    result = bench.with_ratios(
        {"item": "prefill 1x512", "family": "prefill", "length": 512, "tokens": 512}, stats, unit="s"
    )
    assert result["models"]["ours_v1"]["ratio"] == pytest.approx(1.2)
    assert result["models"]["llama"]["tokens_per_s"] == pytest.approx(256)
    checks = bench.check_targets(result)
    assert checks["ours_v1"] == {"target": 1.10, "met": False}
    assert checks["ours_v2"]["met"] and checks["beats_diffllama"]["ours_v1"]
    zero = bench.with_ratios(
        {"item": "m", "family": "memory", "length": None},
        {"llama": {"median": 0.0}, "ours_v1": {"median": 3.0}},
        unit="MiB",
    )
    assert zero["models"]["ours_v1"]["ratio"] is None  # no ratio against a zero baseline
    assert bench.summarize([1.0, 2.0, 3.0, 4.0, 100.0])["median"] == 3.0


def test_paired_ratios_cancel_a_slow_round_and_say_whether_a_target_is_settled():
    """Per-round ratios: a round in which the whole machine ran 1.5x slower leaves them unchanged while it moves the
    ratio of medians; a target between the per-round quartiles is reported as unsettled."""
    llama = [1.0, 1.5, 1.5, 1.0, 1.0]
    v2 = [1.10, 1.12 * 1.5, 1.14 * 1.5, 1.11, 1.13]
    stats = {"llama": bench.summarize(llama), "upcycle_v2": bench.summarize(v2)}
    spec = {"item": "train 4x256", "family": "train", "length": None, "tokens": None}
    result = bench.with_ratios(spec, stats, unit="s")
    row = result["models"]["upcycle_v2"]
    assert row["paired_ratio"] == pytest.approx(1.12)
    assert row["paired_quartiles"] == pytest.approx([1.105, 1.135])
    assert row["ratio"] == pytest.approx(1.13)  # the medians, taken apart, mix rounds
    for floor, met, settled in ((1.15 / 1.05, True, True), (1.12 / 1.05, True, False), (1.10 / 1.05, False, True)):
        row["flop_floor"] = floor
        check = bench.check_targets(result)["upcycle_v2"]
        assert (check["paired_met"], check["settled"]) == (met, settled), floor
    table = bench.format_table({"models": ["llama", "upcycle_v2"], "results": {"fp32": [result]}})
    assert "; paired 1.12 [1.1" in table and "(unsettled)" not in table  # the last floor: missed, settled
    row["flop_floor"] = 1.12 / 1.05
    assert "(unsettled)" in bench.format_table({"models": ["llama", "upcycle_v2"], "results": {"fp32": [result]}})
    fresh = {"llama": bench.summarize(llama), "upcycle_v2": bench.summarize(v2)}
    memory = bench.with_ratios({"item": "m", "family": "memory", "length": None}, fresh, unit="MiB")
    assert "paired_ratio" not in memory["models"]["upcycle_v2"]  # memory rows come from separate processes


# ---------------------------------------------------------------- upcycles of a Llama shape (--preset smollm2)


def test_upcycle_models_have_the_converters_layout_and_flop_floors():
    """``upcycle_v2`` doubles the query heads, ``upcycle_v1`` (duplicate init) doubles query and KV heads, as
    difftransformer-convert makes them; the FLOP floor counts what that adds to the source's forward."""
    shape = bench.SMOLLM2
    llama, v2, v1 = (bench.build_config(kind, shape) for kind in ("llama", "upcycle_v2", "upcycle_v1"))
    assert (v2.num_attention_heads, v2.num_key_value_heads, v2.diff_version) == (18, 3, 2)
    assert (v1.num_attention_heads, v1.num_key_value_heads, v1.diff_version) == (18, 6, 1)
    e, d, t = 576, 64, 128
    # V2 over Llama per token and layer: q_proj twice as wide, lambda_proj, twice the attention maps (scores and A·V)
    extra = 2 * e * 9 * d + 2 * e * 9 + 2 * 2 * 9 * d * (t + 1) / 2
    per_layer = 2 * e * (9 + 2 * 3) * d + 2 * 9 * d * e + 6 * e * 1536 + 2 * 2 * 9 * d * (t + 1) / 2
    expected = (30 * t * (per_layer + extra) + 2 * e * 49152) / (30 * t * per_layer + 2 * e * 49152)
    assert bench.forward_flops(v2, t, 1) / bench.forward_flops(llama, t, 1) == pytest.approx(expected, rel=1e-12)
    assert 1.05 < expected < 1.15
    result = {"family": "decode", "item": "decode b1", "models": {"upcycle_v2": {"ratio": 1.07}}, "unit": "s"}
    assert bench.check_targets(result)["upcycle_v2"] == {"target": 1.08, "met": True}


def test_generation_flops_equal_a_closed_form_count():
    """The vLLM benchmark's FLOP floor, against a count written out by hand for SmolLM2's shape (30 layers, hidden
    e = 576, 9 query / 3 KV heads of width d = 64, MLP 1536, vocabulary 49152): generating N tokens after a P-token
    prompt is the prompt's forward (its P tokens, each query seeing (t + 1) keys, the LM head on the last one) plus
    N − 1 one-token steps, the j-th seeing P + j + 1 keys. Per token and layer the Llama's projections cost
    2·e·(9 + 2·3)·d (q, k, v) + 2·9·d·e (o) + 3·2·e·1536 (MLP); attention 2·9·d per visible key for the scores and
    as much for A·V. The V2 upcycle doubles the query heads (18 maps, o_proj still 9·d wide) and adds λ (2·e·9)."""
    llama, v2 = (bench.build_config(kind, bench.SMOLLM2) for kind in ("llama", "upcycle_v2"))
    layers, e, d, inter, vocab = 30, 576, 64, 1536, 49152
    P, N = 128, 64
    keys_prompt = P * (P + 1) // 2  # Σ_t (t + 1): the keys each prompt query sees
    keys_steps = (N - 1) * (P + 1) + (N - 1) * (N - 2) // 2  # Σ_j (P + j + 1), j = 0 … N − 2

    def by_hand(query_maps, extra_per_token):
        per_token = 2 * e * (query_maps + 2 * 3) * d + 2 * 9 * d * e + 3 * 2 * e * inter + extra_per_token
        per_key = 2 * 2 * query_maps * d
        tokens, keys = P + (N - 1), keys_prompt + keys_steps
        return layers * (tokens * per_token + keys * per_key) + N * 2 * e * vocab  # LM head: one row per new token

    assert bench.generation_flops(llama, P, N) == pytest.approx(by_hand(9, 0), rel=1e-12)
    assert bench.generation_flops(v2, P, N) == pytest.approx(by_hand(18, 2 * e * 9), rel=1e-12)
    assert bench.generation_flops(llama, P, 1) == pytest.approx(
        layers * (P * (2 * e * 15 * d + 2 * 9 * d * e + 6 * e * inter) + keys_prompt * 4 * 9 * d) + 2 * e * vocab,
        rel=1e-12,
    )
    assert 1.10 < by_hand(18, 2 * e * 9) / by_hand(9, 0) < 1.12
