"""The benchmarks cannot rot, and what they report can be trusted.

* ``benchmarks/bench.py --smoke`` and ``benchmarks/attention_micro.py --smoke`` run (the commands of
  docs/performance.md), producing every table row, the JSON and the PNG;
* every attention strategy of the micro-benchmark (among them ``ours``, the modeling file's blocked/packed V1 kernel,
  and ``padded_sdpa``, its previous path) equals the float64 evaluation of V1's attention (docs/model.md, "What it computes"), whose own correctness is checked
  against the modeling file's eager path, and a wrong strategy is flagged;
* ``ours_v1_padded`` (``benchmarks/padded_sdpa.py``) really runs the previous one-padded-SDPA-call path, and gives
  the logits of ``ours_v1``.

The kernel's own tests (gradients, agreement with eager inside a model) are in tests/test_kernels_difftransformer.py.

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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import attention_micro as am  # noqa: E402
from benchmarks import bench  # noqa: E402
from benchmarks import decode_parts  # noqa: E402
from benchmarks import profile_train  # noqa: E402
from benchmarks import v2_prompt_attention as v2p  # noqa: E402
from benchmarks.padded_sdpa import PADDED_SDPA  # noqa: E402
from difftransformer.modeling_difftransformer import CACHE_NAME, eager_attention_forward  # noqa: E402

DOC = ROOT / "docs" / "performance.md"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _doc_commands(script: str) -> list[list[str]]:
    """Every ``python benchmarks/<script> ...`` command line of docs/performance.md, split like a shell would."""
    text = DOC.read_text()
    lines = re.findall(rf"^(?:\$ )?(python benchmarks/{re.escape(script)}[^\n]*)$", text, flags=re.M)
    return [shlex.split(line, comments=True)[2:] for line in lines]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------- smoke runs of the scripts (as documented)


def test_bench_smoke_runs_every_row_and_writes_json_and_png(tmp_path):
    smoke = [args for args in _doc_commands("bench.py") if "--smoke" in args]
    assert smoke, "docs/performance.md must show the smoke command"
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run([sys.executable, "benchmarks/bench.py", *smoke[0], "--json", str(out_json), "--png", str(out_png)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| metric | llama |" in proc.stdout
    report = json.loads(out_json.read_text())
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {r["item"]: r for r in report["results"]["fp32"]}
    plan, _ = bench.smoke_plan_and_shape()
    expected = {f"prefill {b}x{t}" for b, t in plan.prefill_shapes}
    expected |= {f"decode b{b} {c}" for b in plan.decode_batches for c in ("dynamic", "static")}
    expected |= {"train {}x{}".format(*plan.train_shape), "train {}x{} ckpt".format(*plan.train_shape)}
    expected |= {"peak MiB prefill {}x{}".format(*plan.memory_prefill), f"peak MiB decode b{plan.memory_decode_batch}",
                 "peak MiB train {}x{}".format(*plan.train_shape)}
    assert set(rows) == expected
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
                assert row["models"]["llama"]["tokens_per_s"] == pytest.approx(row["tokens"] / row["models"]["llama"]["median"])
    # The chart marks every model's own target on its bar (not only V1's), and each timed row's paired quartiles.
    drawn = [(row, kind) for row in report["results"]["fp32"] for kind, stats in row["models"].items()
             if kind != "llama" and stats.get("ratio") is not None and math.isfinite(stats["ratio"])]  # the bars
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


def test_attention_micro_smoke_checks_and_times_every_strategy(tmp_path):
    smoke = [args for args in _doc_commands("attention_micro.py") if "--smoke" in args]
    assert smoke, "docs/performance.md must show the micro-benchmark's smoke command"
    out = am.main([*smoke[0], "--threads", "1", "--json", str(tmp_path / "micro.json")])
    saved = json.loads((tmp_path / "micro.json").read_text())
    assert len(saved["results"]) == len(out["results"]) == 3
    for res in out["results"]:
        for name, row in res["rows"].items():
            assert row.get("median_s", 0) > 0, (res["case"]["label"], name, row)
            if name != "llama_sdpa":
                assert row["ok"], (res["case"]["label"], name, row)
    counts = out["around"]["fp32"]["op_counts"]
    assert set(counts) == set(am.DECODE_KINDS) and all(c > 0 for c in counts.values())


def test_v2_prompt_attention_smoke_checks_and_times_both_paths(tmp_path):
    """The documented smoke command checks both strategies against float64 (forward, and gradients for train) with
    several 16-row blocks, times them and writes the JSON; a wrong kernel fails the check."""
    smoke = [args for args in _doc_commands("v2_prompt_attention.py") if "--smoke" in args]
    assert smoke, "docs/performance.md must show the V2 prompt micro-benchmark's smoke command"
    out = v2p.main([*smoke[0], "--threads", "1", "--json", str(tmp_path / "v2.json")])
    saved = json.loads((tmp_path / "v2.json").read_text())
    assert [(r["phase"], r["length"]) for r in saved["results"]] == [("prefill", 40), ("train", 40)]
    for row in out["results"]:
        assert all(e <= v2p.TOLERANCE for e in row["rel_err"].values())
        assert all(row["stats"][name]["median_s"] > 0 for name in ("sdpa", "blocks16"))
    inputs = v2p.make_inputs(1, 40, 4, 2, 16)
    good = v2p.strategies(4, 2, 0.25, blocks=[16])["blocks16"]
    not_causal = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=0.25)
    assert v2p.check(good, inputs, train=True) <= v2p.TOLERANCE < v2p.check(not_causal, inputs, train=False)


@pytest.mark.parametrize("workload", ["train", "decode"])
def test_profile_train_smoke_splits_every_models_step_into_operator_groups(tmp_path, workload):
    """The documented smoke commands of the profile (a training step; decode steps) run, and every model's step really
    contains matmuls and an attention kernel (the groups the docs' table reads); the decode profile starts after the
    prompt's forward (no prompt-length matmul in it); operator names fall into the right groups."""
    smoke = [args for args in _doc_commands("profile_train.py") if "--smoke" in args
             and ("--workload" in args) == (workload == "decode")]
    assert smoke, f"docs/performance.md must show the {workload} profile's smoke command"
    out = profile_train.main([*smoke[0], "--json", str(tmp_path / "profile.json")])
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert list(saved["models"]) == list(bench.MODELS) and saved["table"] == out["table"]
    assert saved["workload"] == workload
    for kind, row in saved["models"].items():
        assert row["step_median_s"] > 0 and row["groups_s"]["matmul"] > 0, kind
        assert row["groups_s"]["attention"] > 0, f"{kind}: no attention kernel found in its step"
    if workload == "decode":
        plan, shape = bench.smoke_plan_and_shape()
        model = bench.build_model("ours_v2", shape)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        profile_train.workload("decode", model, 1, None, plan)(prof)
        rows = {tuple(s[0]) for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::mm"
                for s in [e.input_shapes] if s and s[0]}
        assert rows and all(r[0] == 1 for r in rows), rows  # one token per step, never the prompt's rows
    assert profile_train.op_group("aten::mm") == "matmul"
    assert profile_train.op_group("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert profile_train.op_group("CausalBlockAttentionBackward") == "attention"
    assert profile_train.op_group("aten::silu") == "other"


def test_decode_parts_smoke_times_every_part_on_the_same_cache(tmp_path):
    """The documented smoke command of decode_parts.py times every part of both models (the Llama has no λ) and
    writes the JSON; each part runs what it is named for in every layer, and the calls that append a token leave the
    cache at the prompt's length, so every round sees the same cache."""
    smoke = [args for args in _doc_commands("decode_parts.py") if "--smoke" in args]
    assert smoke, "docs/performance.md must show the decode parts' smoke command"
    out = decode_parts.main([*smoke[0], "--json", str(tmp_path / "parts.json")])
    saved = json.loads((tmp_path / "parts.json").read_text())
    assert list(saved["parts"]) == list(decode_parts.PARTS) and saved["table"] == out["table"]
    for part, row in saved["parts"].items():
        assert row["upcycle_v2_s"] > 0 and (row["llama_s"] > 0) == (part != "λ"), part
    _, shape = bench.smoke_plan_and_shape()
    model = bench.build_model("upcycle_v2", shape)
    runs = decode_parts.part_runs("upcycle_v2", model, batch=2, prompt_len=5)
    calls, cache_lengths = [], []
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "lambda_proj"):
            getattr(layer.self_attn, name).register_forward_hook(lambda m, a, o, name=name: calls.append(name))
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, a, kw: cache_lengths.append(kw.get("cache", kw.get(CACHE_NAME)).get_seq_length()), with_kwargs=True)
    layers = shape.num_hidden_layers
    for part, names in (("q_proj", ["q_proj"]), ("k_proj + v_proj", ["k_proj", "v_proj"]), ("o_proj", ["o_proj"]),
                        ("λ", ["lambda_proj"])):
        calls.clear()
        runs[part]()
        assert sorted(calls) == sorted(names * layers), part
    for part in ("step", "attention", "step"):
        runs[part]()
    assert cache_lengths == [5, 5, 5]


def test_documented_full_commands_parse():
    """The commands shown in docs/performance.md use flags and values the scripts accept; the loops found them (the
    commands under each table, from the results' provenance, are checked by tests/test_doc_numbers.py)."""
    found = {script: _doc_commands(script) for script in ("bench.py", "attention_micro.py", "v2_prompt_attention.py",
                                                           "decode_parts.py", "profile_train.py")}
    assert {script: len(commands) >= 1 for script, commands in found.items()} == dict.fromkeys(found, True), found
    assert len(found["bench.py"]) >= 3 and len(found["profile_train.py"]) >= 2, found
    for args in found["bench.py"]:
        ns = bench.parse_args(args)
        bench._choices(ns.only, bench.GROUPS, "--only")
        bench._choices(ns.models, bench.MODELS + bench.EXTRA_MODELS, "--models")
        bench.plan_and_shape(ns)
    for args in found["attention_micro.py"]:
        ns = am.parse_args(args)
        assert set(ns.strategies.split(",")) <= set(am.STRATEGIES)
    for args in found["v2_prompt_attention.py"]:
        v2p.parse_args(args)
    for args in found["decode_parts.py"]:
        decode_parts.parse_args(args)
    for args in found["profile_train.py"]:
        ns = profile_train.parse_args(args)
        bench._choices(ns.models or "llama", bench.MODELS + bench.EXTRA_MODELS, "--models")


def test_bad_flags_name_the_allowed_values(capsys):
    with pytest.raises(SystemExit, match="allowed values: prefill"):
        bench.main(["--only", "prefil", "--json", "", "--png", ""])
    with pytest.raises(SystemExit, match="BATCHxLENGTH"):
        bench.main(["--prefill-shapes", "512", "--json", "", "--png", ""])
    with pytest.raises(SystemExit, match="allowed: padded_sdpa"):
        am.main(["--strategies", "fastest"])
    for main in (bench.main, am.main):
        with pytest.raises(SystemExit) as exc:
            main(["--help"])
        assert exc.value.code == 0
    assert "--smoke" in capsys.readouterr().out


# ---------------------------------------------------------------- the micro-benchmark's correctness gate


def test_reference_is_the_model_eager_attention():
    """The float64 reference used to judge strategies computes what the modeling file's eager path computes."""
    x = am.make_inputs(batch=2, q_len=5, kv_len=9, num_heads=4, num_groups=2, head_dim=8, dtype=torch.float64)
    b, t, s, h, g, d = x.shape
    pad = torch.eye(2, dtype=x.query.dtype).view(2, 1, 2, 1)
    query = (x.query.unflatten(2, (-1, 2, x.n, 1)) * pad).reshape(b, t, -1, 2 * d).transpose(1, 2)
    visible = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t)
    mask = torch.zeros(t, s, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)

    class Module:
        num_key_value_groups, pair_stride = 2 * x.n, x.n

    out, _ = eager_attention_forward(Module(), query, x.key_packed, x.value_packed, mask, x.scaling, diff_lambda=x.lam.double())
    # eager takes its softmax in float32 (by design); everything else here is float64
    torch.testing.assert_close(out, am.reference_attention(x), rtol=1e-6, atol=1e-6)


CASES = [(1, 9), (7, 7), (5, 12)]  # decode, square prefill, prefill after a cached prefix


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("q_len,kv_len", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_strategy_equals_the_float64_reference(n, q_len, kv_len, dtype):
    x = am.make_inputs(batch=2, q_len=q_len, kv_len=kv_len, num_heads=4, num_groups=4 // n, head_dim=8, dtype=dtype)
    reference = am.reference_attention(x)
    for name in am.STRATEGIES:
        if name == "flex":
            continue  # compiling takes ~15 s; the CLI checks it in full runs (`--strategies flex`)
        fn = am.STRATEGIES[name]
        if name.startswith("blocked"):
            fn = lambda inp: am.blocked(inp, block=3)  # noqa: E731  (several blocks, one reaching the diagonal)
        check = am.check_strategy(fn, x, reference)
        assert check["ok"], (name, check)


def test_checker_flags_a_wrong_strategy():
    """Swapping the maps' roles (λ on the first map) is exactly the kind of fast-but-wrong kernel the gate catches."""
    x = am.make_inputs(batch=1, q_len=6, kv_len=6, num_heads=4, num_groups=2, head_dim=8)

    def swapped(inp):
        b, t, s, h, g, d = inp.shape
        q = inp.query.view(b, t, g, 2, inp.n, d).flip(3).reshape(b, t, 2 * h, d)  # Q2 where Q1 belongs
        k = inp.key_packed.view(b, g, s, 2, d).flip(3).reshape(b, g, s, 2 * d)
        swapped_inp = am.AttentionInputs(q, k, inp.value_packed, inp.key_std, inp.value_std, inp.lam, inp.n)
        return am.padded_sdpa(swapped_inp)

    assert am.check_strategy("padded_sdpa", x)["ok"]
    assert not am.check_strategy(swapped, x)["ok"]


# ---------------------------------------------------------------- ours_v1_padded: the previous V1 path


def test_ours_v1_padded_runs_the_previous_path_and_matches_ours_v1(monkeypatch):
    """``ours_v1`` runs the modeling file's differential kernel once per layer; ``ours_v1_padded`` (same weights)
    never does (it gets the zero-padded queries through transformers' sdpa function) and gives the same logits."""
    import difftransformer.modeling_difftransformer as mdt

    calls = []
    kernel = mdt.differential_sdpa_attention
    monkeypatch.setattr(mdt, "differential_sdpa_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    _, shape = bench.smoke_plan_and_shape()
    ids = torch.randint(0, shape.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kind in ("ours_v1", "ours_v1_padded"):
        model = bench.build_model(kind, shape)
        assert model.config._attn_implementation == ("sdpa" if kind == "ours_v1" else PADDED_SDPA)
        calls.clear()
        with torch.no_grad():
            logits[kind] = model(ids).logits
        assert len(calls) == (shape.num_hidden_layers if kind == "ours_v1" else 0), kind
    torch.testing.assert_close(logits["ours_v1_padded"], logits["ours_v1"], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- bench.py's bookkeeping


def test_targets_and_ratios():
    assert bench.target_for("prefill", "ours_v1", 2048) == 1.25
    assert bench.target_for("prefill", "ours_v1", 256) == 1.10
    assert bench.target_for("prefill", "ours_v1_padded", 512) == 1.10
    assert bench.target_for("decode", "ours_v2", None) == 1.03
    assert bench.target_for("train", "diffllama", None) is None
    stats = {"llama": {"median": 2.0}, "diffllama": {"median": 2.6}, "ours_v1": {"median": 2.4}, "ours_v2": {"median": 2.04}}
    result = bench._with_ratios({"item": "prefill 1x512", "family": "prefill", "length": 512, "tokens": 512}, stats, unit="s")
    assert result["models"]["ours_v1"]["ratio"] == pytest.approx(1.2)
    assert result["models"]["llama"]["tokens_per_s"] == pytest.approx(256)
    checks = bench.check_targets(result)
    assert checks["ours_v1"] == {"target": 1.10, "met": False}
    assert checks["ours_v2"]["met"] and checks["beats_diffllama"]["ours_v1"]
    zero = bench._with_ratios({"item": "m", "family": "memory", "length": None}, {"llama": {"median": 0.0}, "ours_v1": {"median": 3.0}}, unit="MiB")
    assert zero["models"]["ours_v1"]["ratio"] is None  # no ratio against a zero baseline
    assert bench.summarize([1.0, 2.0, 3.0, 4.0, 100.0])["median"] == 3.0


def test_paired_ratios_cancel_a_slow_round_and_say_whether_a_target_is_settled():
    """Per-round ratios: a round in which the whole machine ran 1.5x slower leaves them unchanged while it moves the
    ratio of medians; a target between the per-round quartiles is reported as unsettled."""
    llama = [1.0, 1.5, 1.5, 1.0, 1.0]
    v2 = [1.10, 1.12 * 1.5, 1.14 * 1.5, 1.11, 1.13]
    stats = {"llama": bench.summarize(llama), "upcycle_v2": bench.summarize(v2)}
    spec = {"item": "train 4x256", "family": "train", "length": None, "tokens": None}
    result = bench._with_ratios(spec, stats, unit="s")
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
    memory = bench._with_ratios({"item": "m", "family": "memory", "length": None}, fresh, unit="MiB")
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
        rel=1e-12)
    assert 1.10 < by_hand(18, 2 * e * 9) / by_hand(9, 0) < 1.12
