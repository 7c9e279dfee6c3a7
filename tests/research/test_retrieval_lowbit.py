"""Synthetic retrieval tasks (difftransformer.research.retrieval_tasks) and benchmarks/retrieval_lowbit.py: the
sequences hold what they claim, scoring reads the right positions, and the experiment runs end to end, pairs seeds and
resumes."""

import itertools
import json
import math
import pathlib
import random
import re
import statistics

import pytest
import torch

from difftransformer.research import retrieval_tasks as rt

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB = rt.TaskVocab()


def test_multi_needle_sequences_hold_needles_distractors_and_queries():
    for n, r, length, depth in ((1, 1, 40, 0.0), (4, 2, 64, 0.5), (8, 4, 128, 1.0), (5, 3, 200, None)):
        ex = rt.multi_needle(VOCAB, length, n, r, random.Random(f"t{n}"), depth)
        ids = ex.input_ids
        assert len(ids) == length == ex.context_length and ids[0] == VOCAB.BOS
        starts = [i for i, t in enumerate(ids[: ex.question_start]) if t == VOCAB.NEEDLE]
        assert len(starts) == n
        needles = {(ids[i + 1], ids[i + 2]): ids[i + 3] for i in starts}
        assert len(needles) == n and sorted(needles.values()) == sorted(ex.candidates)  # keys and values distinct
        prefixes, suffixes = [p for p, _ in needles], [s for _, s in needles]
        if n >= 2:  # (even n) every needle shares its prefix with another one; two suffixes in all
            assert sum(prefixes.count(p) >= 2 for p in prefixes) >= n - n % 2 and len(set(suffixes)) == 2
        if n >= 4:  # neither token alone names a needle (but the odd one out of an odd count)
            assert sum(suffixes.count(s) >= 2 for s in suffixes) == n
        filler = set(VOCAB.tokens("filler"))
        covered = {j for i in starts for j in range(i, i + 4)}
        assert all(t in filler for j, t in enumerate(ids[1 : ex.question_start], 1) if j not in covered)
        assert len(ex.targets) == r and ids[ex.question_start :].count(VOCAB.QUERY) == r
        for (pos, answer), (a, b), distractors in zip(ex.targets, ex.evidence, ex.distractors):
            key = (ids[pos - 1], ids[pos])
            assert ids[pos - 2] == VOCAB.QUERY and ids[pos + 1] == answer == needles[key]
            assert ids[a:b] == [VOCAB.NEEDLE, *key, answer]  # the evidence is the queried needle
            assert len(distractors) == prefixes.count(key[0]) - 1
            assert all(ids[s + 1] == key[0] and ids[s + 2] != key[1] for s, _ in distractors)
        if depth is not None:  # the first query's needle sits at that fraction of the filler
            a = ex.evidence[0][0]
            filler_before = sum(1 for j in range(1, a) if j not in covered)
            filler_total = ex.question_start - 1 - 4 * n
            assert filler_before == round(depth * filler_total)


def test_mqar_sequences_and_errors():
    ex = rt.mqar(VOCAB, 6, random.Random(0), depth=1.0)
    ids = ex.input_ids
    assert (
        len(ids) == 2 + 2 * 6 + 2 * 3 == rt.mqar_length(6)
        and ids[0] == VOCAB.BOS
        and ids[ex.question_start - 1] == VOCAB.SEP
    )
    pairs = dict(zip(ids[1:13:2], ids[2:13:2]))
    assert len(pairs) == 6 and set(ids[1:13:2]) <= set(VOCAB.tokens("keys"))
    queried = [ids[p] for p, _ in ex.targets]
    assert queried == list(ids[ex.question_start :: 2]) and len(set(queried)) == 3  # half the keys, each once
    assert set(queried) <= set(pairs)
    assert all(pairs[ids[p]] == a == ids[p + 1] for p, a in ex.targets)
    assert ex.evidence[0] == (11, 13)  # depth 1: the first query asks for the last pair
    assert len(rt.mqar(VOCAB, 6, random.Random(0), num_queries=6).targets) == 6
    for bad, match in (
        (lambda: rt.mqar(VOCAB, 1, random.Random(0)), "num_pairs"),
        (lambda: rt.mqar(VOCAB, 4, random.Random(0), num_queries=5), "num_queries"),
        (lambda: rt.multi_needle(VOCAB, 20, 4, 1, random.Random(0)), "too short"),
        (lambda: rt.multi_needle(VOCAB, 64, 2, 3, random.Random(0)), "num_queries"),
        (lambda: rt.multi_needle(VOCAB, 64, 2, 1, random.Random(0), 1.5), "depth"),
        (lambda: rt.TaskVocab(num_values=1), "num_values"),
    ):
        with pytest.raises(ValueError, match=match):
            bad()


def test_sets_are_deterministic_and_cells_independent():
    a = rt.needle_grid(VOCAB, [64, 96], [2, 4], [0.0, 1.0], 2, seed=3)
    b = rt.needle_grid(VOCAB, [64, 96], [2, 4], [0.0, 1.0], 2, seed=3)
    c = rt.needle_grid(VOCAB, [64, 96], [2, 4], [0.0, 1.0], 2, seed=4)
    only = rt.needle_grid(VOCAB, [96], [4], [1.0], 2, seed=3)
    assert [x.input_ids for x in a] == [x.input_ids for x in b] != [x.input_ids for x in c]
    assert [x.input_ids for x in only] == [
        x.input_ids for x in a if x.context_length == 96 and x.count == 4 and x.depth == 1.0
    ]
    train = rt.training_examples(VOCAB, 50, 0, 96, (1, 4), (4, 8, 40))
    assert {x.task for x in train} == {"needle", "mqar"} and max(x.context_length for x in train) <= 96
    assert all(x.count in (4, 8) for x in train if x.task == "mqar")  # 40 pairs do not fit in 96 tokens
    assert all(len(x.targets) == max(1, x.count // 2) for x in train if x.task == "needle")


def test_encode_labels_exactly_the_answers_and_score_reads_them():
    examples = rt.needle_grid(VOCAB, [48], [2], [0.5], 2, seed=0, num_queries=2) + rt.mqar_grid(VOCAB, [4], 1, seed=0)
    ids, labels = rt.encode(examples)
    for row, ex in enumerate(examples):
        labelled = (labels[row] != -100).nonzero()[:, 0].tolist()
        assert labelled == [p + 1 for p, _ in ex.targets]
        assert labels[row, labelled].tolist() == [a for _, a in ex.targets] == ids[row, labelled].tolist()

    class Oracle(torch.nn.Module):
        """Next-token logits: a one-hot of the true next token (``sign`` = -1: every token but that one)."""

        def __init__(self, sign):
            super().__init__()
            self.sign = sign
            self.dummy = torch.nn.Parameter(torch.zeros(()))

        def forward(self, input_ids, **kwargs):
            nxt = torch.roll(input_ids, -1, 1)
            logits = self.sign * 10 * torch.nn.functional.one_hot(nxt, VOCAB.size).float()
            return type("Out", (), {"logits": logits})()

    good, bad = rt.score(Oracle(1), examples, batch_size=2), rt.score(Oracle(-1), examples)
    assert all(all(s["correct"]) and all(s["choice_correct"]) for s in good)
    assert not any(any(s["correct"]) or any(s["choice_correct"]) for s in bad)
    assert all(len(s["loss"]) == len(ex.targets) for s, ex in zip(good, examples))


@pytest.fixture(scope="module")
def script():
    from benchmarks import retrieval_lowbit

    return retrieval_lowbit


def test_smoke_run_pairs_seeds_and_resumes(script, tmp_path, monkeypatch):
    out = tmp_path / "out"
    argv = ["--preset", "smoke", "--out", str(out)]
    report = script.main(argv)
    runs = {(r["model"], r["seed"]): r for r in report["runs"]}
    assert set(runs) == {(m, s) for m in script.MODELS for s in (0, 1)}
    params = {m: runs[(m, 0)]["params"] for m in script.MODELS}
    assert params["v1"] - params["llama"] == 2 * 6 * 8  # λ vectors (4d) and subln (2d) per layer, as compare_small
    for r in runs.values():
        assert set(r["lowbit"]["accuracy"]) == {"none"} | {
            f"{t}/{g}/{b}" for t in script.TARGETS for g in script.GRANULARITIES for b in (4,)
        }
        assert len(r["lowbit"]["activations"]["logits"]) == len(r["lowbit"]["activations"]["hidden"]) == 2
        assert 0 <= r["lens"]["answer_mean"] <= 1 and 0 <= r["lens"]["distractor_mean"] <= 1
        assert r["lens"]["kind"] == ("softmax" if r["model"] == "llama" else "diff")
        assert set(r["eval"]["needle"]["by_length"]) == {"48", "64"}
    # Paired differences: per seed, V1 minus the Llama of the same seed.
    acc = report["summary"]["needle_accuracy"]
    for seed in ("0", "1"):
        assert acc["v1"]["diff_vs_llama"]["per_seed"][seed] == pytest.approx(
            acc["v1"]["per_seed"][seed] - acc["llama"]["per_seed"][seed]
        )
    saved = json.loads((out / "results.json").read_text())
    assert saved["provenance"]["script"] == "retrieval_lowbit.py" and saved["meta"]["setting_id"]
    # The code record names what ran (the staleness of the result is judged from it): tasks, model, low-bit, lens.
    ran = {key.rsplit(":", 1)[0] for key in saved["provenance"]["code"]["digests"]}
    assert saved["provenance"]["code"]["how"] == "traced"
    assert {
        "difftransformer/research/retrieval_tasks.py",
        "difftransformer/modeling_difftransformer.py",
        "difftransformer/research/lowbit.py",
        "difftransformer/research/analysis.py",
        "benchmarks/retrieval_lowbit.py",
    } <= ran
    # The report's tables and the README row are rendered from the file: one row per quantity, the paired column is
    # the per-seed difference; two files of the same setting combine, and a run found twice is refused.
    lines = script.doc_table_retrieval([saved], {})
    needle_row = next(line for line in lines if line.startswith("| needle accuracy, trained lengths"))
    metric = script.retrieval_metrics(saved)[needle_row.split(" | ")[0][2:]]
    by_seed = {m: {r["seed"]: metric(r) for r in saved["runs"] if r["model"] == m} for m in script.MODELS}
    diffs = [by_seed["v1"][s] - by_seed["llama"][s] for s in (0, 1)]
    assert needle_row.split(" | ")[4].startswith(f"{statistics.mean(diffs):.2f} ± {statistics.stdev(diffs):.2f}")
    plain = script.doc_table_lowbit([saved], {"task": "mqar"})
    assert len(plain) == 2 + len(saved["runs"][0]["lowbit"]["accuracy"]) + 2
    everyone = script.doc_table_lowbit([saved], {"task": "mqar", "learned": "0"})  # every run qualifies: counts added
    assert everyone[3].split(" | ")[1] == plain[3].split(" | ")[1].replace(" (±", " (2; ±")
    cell = re.fullmatch(r"(\S+) ± \S+ \(±(\S+)\)", plain[3].split(" | ")[1])  # the binomial noise at the mean
    n = saved["runs"][0]["lowbit"]["accuracy"]["none"]["mqar"]["n"]
    assert float(cell[2]) == pytest.approx(math.sqrt(float(cell[1]) * (1 - float(cell[1])) / n), abs=0.006)
    assert len(everyone[0].split(" | ")) == len(plain[0].split(" | ")) + 2  # the unpaired columns
    assert script.doc_table_lowbit([saved], {"task": "mqar", "learned": "2"})[0] == "| quantized |"  # none qualifies
    losses = script.doc_table_lowbit([saved], {"task": "needle", "measure": "loss"})
    r = saved["runs"][0]["lowbit"]["accuracy"]
    llama = [x for x in saved["runs"] if x["model"] == "llama"]
    assert (
        losses[2]
        .split(" | ")[1]
        .startswith(f"{statistics.mean(x['lowbit']['accuracy']['none']['needle']['loss'] for x in llama):.2f}")
    )
    assert "loss added" in losses[0] and set(r) == {"none"} | {
        f"{t}/{g}/4" for t in script.TARGETS for g in script.GRANULARITIES
    }
    with pytest.raises(ValueError, match="measure='nats'"):
        script.doc_table_lowbit([saved], {"measure": "nats"})
    assert len(script.doc_table_per_seed([saved], {})) == 2 + 6 + 2
    # The summary and the unpaired tables render on any results, saying where there are too few runs to test.
    summary = script.doc_summary([saved], {})
    assert len(summary) == 5 and all(line.startswith("- **") for line in summary)
    assert "ρ: too few runs" in summary[-1]  # no run learned: nothing to correlate
    assert len(script.doc_table_learned([saved], {})) == 2 + len(script.learned_rows(saved)) + 2
    assert sum(line.startswith("| ") for line in script.doc_table_outlier_runs([saved], {})) == 1 + 6
    for render in (script.doc_table_outliers, script.doc_table_lens):
        assert all(line.count("|") == 7 for line in render([saved], {}) if line.startswith("|"))
        kept = render([saved], {"learned": "0"})  # every run qualifies: the same values, each cell counting its runs
        assert kept[2].split(" | ")[1] == render([saved], {})[2].split(" | ")[1] + " (2)"
        assert render([saved], {"learned": "2"})[0] == "| quantity |"  # no run learned: no model column
    rows = script.readme_rows(saved)
    assert "2 paired seeds" in rows[0][0] and set(rows[0][1]) == {"llama", "v1", "v2"}
    assert [label.split(" accuracy")[0] for label, _ in rows[1:]] == ["… needle", "… MQAR"]  # both tasks' 4-bit losses
    half = {k: v for k, v in saved.items() if k != "runs"}
    seed0, seed1 = ([r for r in saved["runs"] if r["seed"] == s] for s in (0, 1))
    assert script.combined([half | {"runs": seed0}, half | {"runs": seed1}])["runs"] == seed0 + seed1
    with pytest.raises(ValueError, match="share a"):
        script.combined([saved, saved])
    other = half | {"meta": saved["meta"] | {"setting_id": "x"}, "runs": seed1}
    with pytest.raises(ValueError, match="different settings"):
        script.combined([half | {"runs": seed0}, other])
    table = (out / "results.md").read_text()
    assert "| needle_accuracy | DIFF V1 |" in table and "paired diff vs Llama" in table
    for png in ("curves.png", "accuracy_vs_length.png", "accuracy_vs_bits.png", "attention_shares.png"):
        assert (out / png).stat().st_size > 0
    # The same data in the same order for every model of a seed, and another order for another seed.
    args = script.resolve_args(argv)
    a, b, c = script.make_data(args, 0), script.make_data(args, 0), script.make_data(args, 1)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a["batches"], b["batches"]))
    assert any(not torch.equal(x[0], y[0]) for x, y in zip(a["batches"], c["batches"]))

    # Resume: a rerun with the same setting trains nothing; one run missing is trained alone; another setting restarts.
    trained = []
    real_train = script.train
    monkeypatch.setattr(script, "train", lambda model, *a, **k: trained.append(model) or real_train(model, *a, **k))
    script.main(argv)
    assert trained == [] and json.loads((out / "results.json").read_text())["provenance"] == saved["provenance"]
    saved["runs"] = [r for r in saved["runs"] if not (r["model"] == "v2" and r["seed"] == 1)]
    (out / "results.json").write_text(json.dumps(saved))
    again = script.main(argv)
    assert len(trained) == 1 and len(again["runs"]) == 6
    assert again["provenance"]["resumed_from"] == saved["provenance"]  # the kept runs' own record
    # Seeds run in parallel into another folder: --plot-with draws their runs too, and trains and rewrites nothing.
    full = json.loads((out / "results.json").read_text())
    mine = full | {"runs": [r for r in full["runs"] if r["seed"] == 0]}
    (out / "results.json").write_text(json.dumps(mine))
    (tmp_path / "other.json").write_text(json.dumps(full | {"runs": [r for r in full["runs"] if r["seed"] == 1]}))
    (out / "curves.png").unlink()
    script.main(argv + ["--seeds", "0", "--plot-with", str(tmp_path / "other.json")])
    assert len(trained) == 1 and (out / "curves.png").stat().st_size > 0
    assert json.loads((out / "results.json").read_text()) == mine
    with pytest.raises(ValueError, match="share a"):  # a run in both files
        script.main(argv + ["--seeds", "0", "--plot-with", str(out / "results.json")])
    script.main(argv + ["--models", "llama", "--seeds", "0", "--no-analysis", "--steps", "2"])
    assert len(trained) == 2


def test_bad_flags_are_named(script):
    for argv, match in (
        (["--models", "gpt2"], "--models"),
        (["--steps", "0"], "--steps"),
        (["--lowbit-bits", "1"], "--lowbit-bits"),
    ):
        with pytest.raises(SystemExit, match=match):
            script.resolve_args(["--preset", "smoke", *argv])
    with pytest.raises(SystemExit, match="--stop-held"):
        script.resolve_args(["--preset", "smoke", "--stop-held", "-1"])


def test_a_run_stops_once_both_tasks_hold_90_percent(script, monkeypatch):
    """--stop-held n: training ends at the validation where needle and MQAR accuracy have been >= 0.9 n times in a row
    (the learning-rate grid's runs); a run that gets there only for one task goes to the end."""
    args = script.resolve_args(["--preset", "smoke", "--steps", "12", "--eval-every", "2"])
    data = script.make_data(args, 0)
    model = script.build_model("llama", script.build_configs(rt.TaskVocab().size, 32, 2, 4, 2, 8, 64, 64)["llama"], 0)
    schedules = {  # validation accuracy per task at validations 0, 2, 4, ... (the stub's answers)
        "stops": {"needle": [0.1, 0.95, 0.5, 0.92, 0.93, 0.99, 1.0], "mqar": [0.0, 0.9, 0.91, 0.95, 0.97, 0.99, 1.0]},
        "never": {"needle": [1.0] * 7, "mqar": [0.5] * 7},
    }
    for name, accs in schedules.items():
        calls = iter(range(7))

        def fake_grouped(examples, scores, key, accs=accs, calls=calls):
            i = next(calls)
            return {t: {"accuracy": a[i], "loss": 0.0, "choice_accuracy": 0.0, "n": 1} for t, a in accs.items()}

        monkeypatch.setattr(script, "grouped", fake_grouped)
        curves = script.train(model, data["batches"], data["val"], 1e-3, 1, 2, "cpu", schedule="constant", stop_held=3)
        if name == "stops":  # >= 0.9 on both at steps 6, 8, 10: stops at step 10 (needle fell to 0.5 at step 4)
            assert curves["stopped_at"] == 10 and curves["eval_step"][-1] == 10 and curves["step"][-1] == 10
            assert script.steps_to(curves, "needle", 0.9) == 2 and script.steps_to(curves, "mqar", 0.9) == 2
        else:
            assert curves["stopped_at"] is None and curves["eval_step"][-1] == 12
    stopped = script.resolve_args(["--preset", "smoke", "--stop-held", "3"])
    assert script.setting_of(stopped)["stop_held"] == 3
    assert "stop_held" not in script.setting_of(script.resolve_args(["--preset", "smoke"]))  # older settings keep ids
    assert script.resolve_args(["--preset", "lr_grid"]).stop_held == 3


# ----------------------------------------------------------------------------------------------- the report


REPORT = ROOT / "docs" / "reports" / "2026-11-27-retrieval-lowbit.md"
RESULTS = [
    "benchmarks/results/retrieval_lowbit/results.json",
    "benchmarks/results/retrieval_lowbit_seeds34/results.json",
]


def _block(doc: str, renderer: str) -> list[str]:
    """The generated lines of the block of ``renderer`` in ``doc`` (without the Sources lines under it)."""
    lines = doc.split("\n")
    marker = f"<!-- table: benchmarks.retrieval_lowbit:{renderer} "
    start = next(i for i, line in enumerate(lines) if line.startswith(marker))
    end = next(i for i in range(start, len(lines)) if lines[i] == "<!-- end table -->")
    body = lines[start + 1 : end]
    return body[: body.index("Sources:") - 1] if "Sources:" in body else body


def _brute_rank_p(x, y) -> float:
    """Two-sided rank-sum p by enumerating every split (ties: midranks), written out independently."""
    pooled = sorted(x + y)
    rank = {v: statistics.mean(i + 1 for i, w in enumerate(pooled) if w == v) for v in pooled}
    ranks = [rank[v] for v in x + y]
    mean = len(x) * (len(ranks) + 1) / 2
    observed = abs(sum(ranks[: len(x)]) - mean)
    sums = [sum(c) for c in itertools.combinations(ranks, len(x))]
    return sum(abs(s - mean) >= observed - 1e-9 for s in sums) / len(sums)


def _fmt(p: float) -> str:
    return f"{min(p, 1.0):.2g}"


def test_the_report_summary_is_the_one_its_json_gives(script):
    """Every number of the report's summary comes from the results files. The committed block equals what
    doc_summary renders from them, and the headline counts and tests, recomputed here straight from the JSON (not
    through the script's helpers), are the ones it states."""
    datas = [json.loads((ROOT / path).read_text()) for path in RESULTS]
    doc = REPORT.read_text()
    summary = _block(doc, "doc_summary")
    assert summary == script.doc_summary(datas, {}), "regenerate: python scripts/doc_tables.py --write " + str(REPORT)
    runs = [r for d in datas for r in d["runs"]]
    seeds = sorted({r["seed"] for r in runs})
    text = "\n".join(summary)

    def needle(r):  # held-out accuracy at the trained lengths (48 and 64 tokens)
        return statistics.mean(r["eval"]["needle"]["by_length"][k]["accuracy"] for k in ("48", "64"))

    learned = {m: {r["seed"] for r in runs if r["model"] == m and needle(r) >= 0.9} for m in ("llama", "v1", "v2")}
    for model, label in (("llama", "Llama"), ("v1", "DIFF V1"), ("v2", "DIFF V2")):
        assert f"{label} {len(learned[model])}/{len(seeds)}" in text
    k, j, n = len(learned["v2"]), len(learned["llama"]), len(seeds)
    tables = {
        a: math.comb(n, a) * math.comb(n, k + j - a) / math.comb(2 * n, k + j)
        for a in range(max(0, k + j - n), min(n, k + j) + 1)
    }
    fisher = sum(p for p in tables.values() if p <= tables[k] * (1 + 1e-7))
    assert f"Fisher's exact test p = {_fmt(fisher)}" in text

    def steps(r):  # the first validation at 90% needle accuracy; never: beyond the budget
        hits = [s for s, a in zip(r["curves"]["eval_step"], r["curves"]["val_accuracy_by_task"]["needle"]) if a >= 0.9]
        return hits[0] if hits else math.inf

    by = {m: {r["seed"]: steps(r) for r in runs if r["model"] == m} for m in ("llama", "v2")}
    first = sum(by["v2"][s] < by["llama"][s] for s in seeds)
    assert f"V2 got there before the Llama of the same seed in {first} of {len(seeds)} seeds" in text
    budget = datas[0]["meta"]["setting"]["steps"]
    rank = _brute_rank_p(
        [min(v, budget + 1) for v in by["v2"].values()], [min(v, budget + 1) for v in by["llama"].values()]
    )
    assert f"exact rank-sum test p = {_fmt(rank)}" in text
    # 4-bit logits: the needle accuracy each learned run loses, and V1's runs against the Llama's
    lost = {
        m: sorted(
            r["lowbit"]["accuracy"]["none"]["needle"]["accuracy"]
            - r["lowbit"]["accuracy"]["logits/tensor/4"]["needle"]["accuracy"]
            for r in runs
            if r["model"] == m and r["lowbit"]["accuracy"]["none"]["needle"]["accuracy"] >= 0.9
        )
        for m in ("llama", "v1")
    }
    assert f"needle accuracy lost Llama {lost['llama'][0]:.2f}–{lost['llama'][-1]:.2f} ({len(lost['llama'])})" in text
    assert f"DIFF V1 {lost['v1'][0]:.2f}–{lost['v1'][-1]:.2f} ({len(lost['v1'])})" in text
    assert f"in accuracy (p = {_fmt(_brute_rank_p(lost['v1'], lost['llama']))})" in text
    # the README rows name both tasks' 4-bit losses, the means of the runs that learned each
    rows = dict(script.readme_rows(script.combined(datas)))
    needle = next(cells for label, cells in rows.items() if label.startswith("… needle"))
    assert needle["llama"] == f"{sum(lost['llama']) / len(lost['llama']):.2f}"
    assert needle["v1"] == f"{sum(lost['v1']) / len(lost['v1']):.2f}"
    assert any(label.startswith("… MQAR") for label in rows)


def test_the_calibration_run_reused_as_a_test_run_is_named(script):
    path = ROOT / "benchmarks/results/retrieval_lowbit/calibration/c11_E64_L2_T64_10k.json"
    calibration = json.loads(path.read_text())
    datas = [json.loads((ROOT / path).read_text()) for path in RESULTS]
    (line,) = script.doc_calibration_reuse([calibration, *datas], {"files": ["c11.json"]})
    final = next(r for r in datas[0]["runs"] if r["model"] == "llama" and r["seed"] == 0)
    same = sum(a == b for a, b in zip(calibration["runs"][0]["curves"]["train_loss"], final["curves"]["train_loss"]))
    assert f"{same:,} of {len(calibration['runs'][0]['curves']['train_loss']):,}" in line and "is that run" in line
    changed = json.loads(json.dumps(calibration))
    changed["runs"][0]["curves"]["train_loss"][5] += 1e-6
    assert "is not that run" in script.doc_calibration_reuse([changed, *datas], {"files": ["c11.json"]})[0]


# ----------------------------------------------------------------------------------------------- the learning-rate grid


def _grid_file(lr: float, seed: int, hits: dict, budget: int = 1000, every: int = 100) -> dict:
    """A results file of the grid (one learning rate, one seed): per model the validation step at which each task
    first reaches 0.9 (None: never within the budget); a run stops three validations after both held."""
    runs = []
    for model, (needle, mqar) in hits.items():
        steps, accs = [], {"needle": [], "mqar": []}
        stopped = None
        for step in range(0, budget + 1, every):
            steps.append(step)
            for task, hit in (("needle", needle), ("mqar", mqar)):
                accs[task].append(0.95 if hit is not None and step >= hit else 0.2)
            if needle is not None and mqar is not None and step >= max(needle, mqar) + 2 * every:
                stopped = step
                break
        runs.append(
            {
                "model": model,
                "seed": seed,
                "curves": {"eval_step": steps, "val_accuracy_by_task": accs, "stopped_at": stopped},
            }
        )
    return {"meta": {"setting": {"lr": lr, "steps": budget}, "preset": "lr_grid"}, "runs": runs}


def test_the_lr_grid_table_reports_learned_shares_medians_best_rates_and_tests(script):
    """Synthetic grid: the Llama learns both tasks in 2 of 4 seeds at 5e-4 and 4 of 4 at 1e-3; V2 in 4 of 4 at both
    rates, sooner at 1e-3 (its best: a tie on learned runs broken by the median); V1 never learns MQAR at 1e-3."""
    seeds = (5, 6, 7, 8)
    plan = {  # (lr, seed) -> model -> (needle step, MQAR step)
        (5e-4, 5): {"llama": (600, 700), "v1": (500, None), "v2": (300, 300)},
        (5e-4, 6): {"llama": (None, 800), "v1": (None, None), "v2": (400, 300)},
        (5e-4, 7): {"llama": (700, 600), "v1": (600, 600), "v2": (300, 400)},
        (5e-4, 8): {"llama": (None, None), "v1": (None, None), "v2": (500, 500)},
        **{
            (1e-3, s): {"llama": (400 + 100 * i, 500), "v1": (300, None), "v2": (200, 200 + 100 * (i % 2))}
            for i, s in enumerate(seeds)
        },
    }
    datas = [_grid_file(lr, seed, hits) for (lr, seed), hits in plan.items()]
    grid = script.grid_cells(datas)
    cells, best = grid["cells"], grid["best"]
    assert best == {"llama": 1e-3, "v1": 5e-4, "v2": 1e-3}
    llama = cells[("llama", 5e-4)]
    assert llama["learned"] == {"needle": 2, "mqar": 3, "both": 2} and llama["seeds"] == list(seeds)
    assert math.isinf(llama["median"]["both"])  # two of four never: the median involves a censored run
    assert cells[("v2", 1e-3)]["median"]["both"] == statistics.median([200, 300, 200, 300])
    assert cells[("v1", 1e-3)]["learned"]["both"] == 0
    lines = script.doc_table_lr_grid(datas, {})
    rows = [line for line in lines if line.startswith("| DIFF V2 |")]
    assert rows[1].startswith("| DIFF V2 | 0.001 **(best)** | 4 (5, 6, 7, 8) | 4/4 | 4/4 | 4/4 |")
    assert "> 1,000" in next(line for line in lines if line.startswith("| Llama | 0.0005 |"))
    v2 = next(line for line in lines if line.startswith("DIFF V2 at 0.001 against the Llama at 0.001"))
    rank = _brute_rank_p(
        [max(h) for s in seeds for h in [plan[(1e-3, s)]["v2"]]],
        [max(h) for s in seeds for h in [plan[(1e-3, s)]["llama"]]],
    )
    assert "4/4 against 4/4 (Fisher's exact test p = 1, Holm-adjusted p = 1)" in v2
    # V2's is the smaller of the two rank-sum p-values (V1's best rate has censored runs): Holm doubles it.
    assert f"(exact rank-sum test p = {_fmt(rank)}, Holm-adjusted p = {_fmt(2 * rank)})" in v2
    # Holm over all four tests at once: V2's rank-sum p is the smallest of the four, so it is multiplied by four.
    every = next(line for line in lines if line.startswith("Holm-adjusted over all 4 of these tests at once"))
    assert f"DIFF V2 Fisher p = 1, rank-sum p = {_fmt(min(1.0, 4 * rank))}." in every
    v1 = next(line for line in lines if line.startswith("DIFF V1 at 0.0005"))
    assert "learned both tasks 1/4 against 4/4" in v1  # V1's best rate: one seed learned both
    # The README's rows: each model at its best rate (Llama 1e-3, V1 5e-4, V2 1e-3).
    # Each cell: the runs that reached 90% on both tasks, at which rate, and the steps of each (no median).
    ((label, cells),) = script.readme_rows_files(datas)
    assert "4 new seeds at each of 0.0005, 0.001" in label and "within 1,000 steps" in label
    assert f"DIFF V2 against the Llama: exact rank-sum test p = {_fmt(rank)} (4 vs 4 runs)" in label
    assert cells == {
        "llama": "4/4 at 0.001: 500, 500, 600, 700",
        "v1": "1/4 at 0.0005: 600",
        "v2": "4/4 at 0.001: 200, 200, 300, 300",
    }
    never = [_grid_file(lr, 5, {"llama": (None, 500)}) for lr in (1e-3, 5e-4)]  # no rate learns both: the lowest
    assert "| Llama | 0.0005 **(best: none learned)** |" in "\n".join(script.doc_table_lr_grid(never, {}))
    with pytest.raises(ValueError, match="twice"):
        script.grid_runs(datas + datas[:1])
    other_budget = _grid_file(5e-4, 9, {"llama": (100, 100)}, budget=2000)
    with pytest.raises(ValueError, match="different budgets"):
        script.grid_cells(datas + [other_budget])


def _with_lowbit(data: dict, values: dict) -> dict:
    """``data`` with each run's low-bit record: ``values[(model, seed)]`` = (largest logit, median logit, MQAR accuracy
    unquantized, at 4 bits, loss added at 4 bits); needle retrieval copies MQAR."""
    for r in data["runs"]:
        top, median, acc, acc4, added = values[(r["model"], r["seed"])]
        task = {"accuracy": acc, "loss": 1.0}
        four = {"accuracy": acc4, "loss": 1.0 + added}
        r["lowbit"] = {
            "accuracy": {"none": {"mqar": task, "needle": task}, "logits/tensor/4": {"mqar": four, "needle": four}},
            "activations": {"logits": [{"max": top, "median": median}]},
        }
    return data


def test_the_grid_findings_name_each_comparison_with_its_runs_and_exact_test(script):
    """Synthetic grid (two rates, seeds 5 and 6) and a synthetic first study (seeds 0 and 1, at 0.001, 500 steps):
    the per-rate comparisons, the stratified test, the pooled comparison censored at the smaller budget, V1's largest
    logit against the Llama's per seed, and the 4-bit costs and their correlations, each recomputed here."""
    plan = {
        (5e-4, 5): {"llama": (None, None), "v1": (400, 400), "v2": (300, 300)},
        (5e-4, 6): {"llama": (600, 700), "v1": (None, None), "v2": (200, 300)},
        (1e-3, 5): {"llama": (500, 500), "v1": (700, 700), "v2": (200, 200)},
        (1e-3, 6): {"llama": (None, 800), "v1": (300, 300), "v2": (100, 200)},
    }
    low = {  # (model, seed) -> largest logit, median, accuracy, at 4 bits, loss added: V1 always below the Llama
        ("llama", 5): (20.0, 2.0, 0.95, 0.80, 1.5),
        ("llama", 6): (18.0, 1.0, 0.92, 0.70, 2.0),
        ("v1", 5): (9.0, 1.0, 0.96, 0.94, 0.2),
        ("v1", 6): (8.0, 2.0, 0.91, 0.90, 0.1),
        ("v2", 5): (14.0, 0.5, 0.97, 0.85, 1.0),
        ("v2", 6): (13.0, 1.3, 0.80, 0.60, 0.7),  # never learned its low-bit set: left out of the 4-bit rows
    }
    grid = []
    for (lr, seed), hits in plan.items():
        data = _with_lowbit(_grid_file(lr, seed, hits), low)
        if lr == 1e-3:  # another rate: other values, the same order (V1 below the Llama)
            for r in data["runs"]:
                r["lowbit"]["activations"]["logits"][0]["max"] += 1.0
        grid.append(data)
    first = _grid_file(1e-3, 0, {"llama": (None, 300), "v1": (400, 200), "v2": (200, 200)}, budget=500)
    first["runs"] += _grid_file(1e-3, 1, {"llama": (300, 400), "v1": (None, None), "v2": (100, 100)}, budget=500)[
        "runs"
    ]
    first["meta"] |= {"preset": "default", "setting_id": "first"}
    first["meta"]["setting"]["train_length"] = 64
    _with_lowbit(first, {(m, s): low[(m, s + 5)] for m in ("llama", "v1", "v2") for s in (0, 1)})
    held_out = {("llama", 0): 0.5, ("llama", 1): 0.95, ("v1", 0): 0.92, ("v1", 1): 0.3, ("v2", 0): 0.97, ("v2", 1): 0.9}
    answer = {("llama", 1): 0.5, ("v2", 0): 0.3, ("v2", 1): 0.4, ("llama", 0): 0.1, ("v1", 0): 0.2, ("v1", 1): 0.2}
    for r in first["runs"]:  # held-out needle accuracy at the trained length (learned: 0.9) and the answer's share
        acc = held_out[(r["model"], r["seed"])]
        r["eval"] = {"needle": {"by_length": {"64": {"accuracy": acc, "n": 10}}}, "mqar": {"by_pairs": {}}}
        r["lens"] = {"answer_mean": answer[(r["model"], r["seed"])]}
    f = script.grid_findings(grid, [first])
    both = {k: {m: max(x if x is not None else 1100 for x in h) for m, h in hits.items()} for k, hits in plan.items()}
    for lr in (5e-4, 1e-3):
        for x in ("v1", "v2"):
            want = _brute_rank_p([both[(lr, s)][x] for s in (5, 6)], [both[(lr, s)]["llama"] for s in (5, 6)])
            assert f["per_rate"][lr][x]["p"] == pytest.approx(want)
    assert f["per_rate"][5e-4]["v2"]["all_first"] and f["v2_first_every_rate"] == 2
    assert f["per_rate"][1e-3]["v1"]["llama_reached_first"] is False and not f["per_rate"][1e-3]["v1"]["all_first"]

    # Stratified over the two rates, V2 learned both in 4 of 4, the Llama in 1 of 2 at each rate: each table's
    # hypergeometric law (2 of 4 learned... ) convolved, written out here.
    def hyper(a, row, col, n):
        return math.comb(col, a) * math.comb(n - col, row - a) / math.comb(n, row)

    law = {}
    for a1 in range(1, 3):
        for a2 in range(1, 3):
            law[a1 + a2] = law.get(a1 + a2, 0) + hyper(a1, 2, 3, 4) * hyper(a2, 2, 3, 4)
    assert f["stratified"]["v2"]["p"] == pytest.approx(sum(q for q in law.values() if q <= law[4] * (1 + 1e-7)))
    # Pooled at 0.001: the first study's runs and the grid's, censored at the first study's 500 steps (the grid's
    # Llama of seed 6, which never got there within its 1,000, counts as more than 500, like the first study's seed 0).
    pool = f["pooled"]
    assert pool["cap"] == 500 and sorted(pool["llama"]) == [400, 500, 501, 501]
    assert pool["v2"]["p"] == pytest.approx(_brute_rank_p(pool["v2"]["steps"], pool["llama"]))
    assert pool["v2"]["all_first"]
    # Largest logit: V1 below the Llama in all 6 pairs (2 first-study seeds, 2 grid seeds at 2 rates): 4 seeds.
    o = f["outliers"]["max"]
    assert (o["runs"], o["below"], o["seeds"], o["seeds_below"]) == (6, 6, 4, 4)
    assert o["p"] == pytest.approx(2 / 16)
    # 4-bit MQAR over the grid's runs whose unquantized accuracy reaches 0.9 (V2's seed 6 does not).
    e = f["lowbit"]["mqar"]
    assert e["n"] == {"llama": 4, "v1": 4, "v2": 2}
    lost = {m: [low[(m, s)][2] - low[(m, s)][3] for s in (5, 6)] * 2 for m in ("llama", "v1")}
    assert e["v1"] == pytest.approx(_brute_rank_p(lost["v1"], lost["llama"]))
    assert e["mean"]["llama"] == pytest.approx(statistics.mean(lost["llama"]))
    assert e["runs"] == 10 and e["max"] is None  # the two rates repeat a loss added: a tie, no exact Kendall test
    # The first study's runs that learned needle retrieval: V2 in seeds 0 and 1, the Llama in seed 1 only.
    a = f["answer_share"]
    assert sorted(a["v2"]) == [0.3, 0.4] and a["llama"] == [0.5] and a["all_below"]
    assert a["p"] == pytest.approx(_brute_rank_p([0.3, 0.4], [0.5]))
    top = f["ratio_top"]
    assert top["grid"]["llama"] == pytest.approx(19.0 / 1.0)  # seed 6 at 1e-3: largest 18 + 1, median 1
    assert top["first"]["llama"] == pytest.approx(18.0 / 1.0) and top["first"]["v1"] == pytest.approx(9.0 / 1.0)
    lines = script.doc_grid_findings(grid + [first], {})
    text = "\n".join(lines)
    assert "V2 got there before the Llama of the same seed at every rate in 2 of 2 seeds" in text
    assert "Pooled at 0.001** (the first study's rate; seeds 0 to 6" in text and "censored at 500 steps" in text
    assert "below the Llama's in 6 of 6" in text and f"4 of 4 below, p = {_fmt(2 / 16)}" in text
    assert "largest logit: no exact test (too few runs or a tie)" in text and lines[-1].startswith("Exploratory")


def test_the_documented_commands_parse(script):
    """docs/analysis.md's commands of this study (python -m benchmarks.retrieval_lowbit / lowbit_pretrained) use flags
    the scripts accept."""
    import shlex

    from benchmarks import lowbit_pretrained

    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "analysis.md").read_text(), flags=re.S)
    parsers = {
        "benchmarks.retrieval_lowbit": script.resolve_args,
        "benchmarks.lowbit_pretrained": lowbit_pretrained.resolve_args,
    }
    seen = set()
    for line in (line for b in blocks for line in b.strip().splitlines()):
        argv = shlex.split(line, comments=True)
        while argv and "=" in argv[0]:  # OMP_NUM_THREADS=1
            argv.pop(0)
        if argv[:2] == ["python", "-m"] and argv[2] in parsers:
            parsers[argv[2]](argv[3:])
            seen.add(argv[2])
    assert seen == set(parsers)
