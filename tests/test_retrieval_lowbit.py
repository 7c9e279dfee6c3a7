"""Synthetic retrieval tasks (difftransformer.retrieval_tasks) and benchmarks/retrieval_lowbit.py: the sequences hold
what they claim, scoring reads the right positions, and the experiment runs end to end, pairs seeds and resumes."""

import importlib.util
import json
import pathlib
import random
import statistics

import pytest
import torch

from difftransformer import retrieval_tasks as rt

ROOT = pathlib.Path(__file__).resolve().parents[1]
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
    assert len(ids) == 2 + 2 * 6 + 2 * 3 == rt.mqar_length(6) and ids[0] == VOCAB.BOS and ids[ex.question_start - 1] == VOCAB.SEP
    pairs = dict(zip(ids[1:13:2], ids[2:13:2]))
    assert len(pairs) == 6 and set(ids[1:13:2]) <= set(VOCAB.tokens("keys"))
    queried = [ids[p] for p, _ in ex.targets]
    assert queried == list(ids[ex.question_start :: 2]) and len(set(queried)) == 3  # half the keys, each once
    assert set(queried) <= set(pairs)
    assert all(pairs[ids[p]] == a == ids[p + 1] for p, a in ex.targets)
    assert ex.evidence[0] == (11, 13)  # depth 1: the first query asks for the last pair
    assert len(rt.mqar(VOCAB, 6, random.Random(0), num_queries=6).targets) == 6
    for bad, match in ((lambda: rt.mqar(VOCAB, 1, random.Random(0)), "num_pairs"),
                       (lambda: rt.mqar(VOCAB, 4, random.Random(0), num_queries=5), "num_queries"),
                       (lambda: rt.multi_needle(VOCAB, 20, 4, 1, random.Random(0)), "too short"),
                       (lambda: rt.multi_needle(VOCAB, 64, 2, 3, random.Random(0)), "num_queries"),
                       (lambda: rt.multi_needle(VOCAB, 64, 2, 1, random.Random(0), 1.5), "depth"),
                       (lambda: rt.TaskVocab(num_values=1), "num_values")):
        with pytest.raises(ValueError, match=match):
            bad()


def test_sets_are_deterministic_and_cells_independent():
    a = rt.needle_grid(VOCAB, [64, 96], [2, 4], [0.0, 1.0], 2, seed=3)
    b = rt.needle_grid(VOCAB, [64, 96], [2, 4], [0.0, 1.0], 2, seed=3)
    c = rt.needle_grid(VOCAB, [64, 96], [2, 4], [0.0, 1.0], 2, seed=4)
    only = rt.needle_grid(VOCAB, [96], [4], [1.0], 2, seed=3)
    assert [x.input_ids for x in a] == [x.input_ids for x in b] != [x.input_ids for x in c]
    assert [x.input_ids for x in only] == [x.input_ids for x in a if x.context_length == 96 and x.count == 4 and x.depth == 1.0]
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
    spec = importlib.util.spec_from_file_location("retrieval_lowbit", ROOT / "benchmarks" / "retrieval_lowbit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_pairs_seeds_and_resumes(script, tmp_path, monkeypatch):
    out = tmp_path / "out"
    argv = ["--preset", "smoke", "--out", str(out)]
    report = script.main(argv)
    runs = {(r["model"], r["seed"]): r for r in report["runs"]}
    assert set(runs) == {(m, s) for m in script.MODELS for s in (0, 1)}
    params = {m: runs[(m, 0)]["params"] for m in script.MODELS}
    assert params["v1"] - params["llama"] == 2 * 6 * 8  # λ vectors (4d) and subln (2d) per layer, as compare_small
    for r in runs.values():
        assert set(r["lowbit"]["accuracy"]) == {"none"} | {f"{t}/{g}/{b}" for t in script.TARGETS
                                                          for g in script.GRANULARITIES for b in (4,)}
        assert len(r["lowbit"]["activations"]["logits"]) == len(r["lowbit"]["activations"]["hidden"]) == 2
        assert 0 <= r["lens"]["answer_mean"] <= 1 and 0 <= r["lens"]["distractor_mean"] <= 1
        assert r["lens"]["kind"] == ("softmax" if r["model"] == "llama" else "diff")
        assert set(r["eval"]["needle"]["by_length"]) == {"48", "64"}
    # Paired differences: per seed, V1 minus the Llama of the same seed.
    acc = report["summary"]["needle_accuracy"]
    for seed in ("0", "1"):
        assert acc["v1"]["diff_vs_llama"]["per_seed"][seed] == pytest.approx(
            acc["v1"]["per_seed"][seed] - acc["llama"]["per_seed"][seed])
    saved = json.loads((out / "results.json").read_text())
    assert saved["provenance"]["script"] == "retrieval_lowbit.py" and saved["meta"]["setting_id"]
    # The code record names what ran (the staleness of the result is judged from it): tasks, model, low-bit, lens.
    ran = {key.rsplit(":", 1)[0] for key in saved["provenance"]["code"]["digests"]}
    assert saved["provenance"]["code"]["how"] == "traced"
    assert {"difftransformer/retrieval_tasks.py", "difftransformer/modeling_difftransformer.py",
            "difftransformer/lowbit.py", "difftransformer/analysis.py", "benchmarks/retrieval_lowbit.py"} <= ran
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
    assert everyone[3].split(" | ")[1] == plain[3].split(" | ")[1] + " (2)"
    assert script.doc_table_lowbit([saved], {"task": "mqar", "learned": "2"})[0] == "| quantized |"  # none qualifies
    losses = script.doc_table_lowbit([saved], {"task": "needle", "measure": "loss"})
    r = saved["runs"][0]["lowbit"]["accuracy"]
    llama = [x for x in saved["runs"] if x["model"] == "llama"]
    assert losses[2].split(" | ")[1].startswith(f"{statistics.mean(x['lowbit']['accuracy']['none']['needle']['loss'] for x in llama):.2f}")
    assert "loss added" in losses[0] and set(r) == {"none"} | {f"{t}/{g}/4" for t in script.TARGETS for g in script.GRANULARITIES}
    with pytest.raises(ValueError, match="measure='nats'"):
        script.doc_table_lowbit([saved], {"measure": "nats"})
    assert len(script.doc_table_per_seed([saved], {})) == 2 + 6
    for render in (script.doc_table_outliers, script.doc_table_lens):
        assert all(line.count("|") == 7 for line in render([saved], {}) if line.startswith("|"))
        kept = render([saved], {"learned": "0"})  # every run qualifies: the same values, each cell counting its runs
        assert kept[2].split(" | ")[1] == render([saved], {})[2].split(" | ")[1] + " (2)"
        assert render([saved], {"learned": "2"})[0] == "| quantity |"  # no run learned: no model column
    label, value = script.headline(saved)
    assert "2 paired seeds" in label and "sooner than the Llama in DIFF V1" in value
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
    for argv, match in ((["--models", "gpt2"], "--models"), (["--steps", "0"], "--steps"), (["--lowbit-bits", "1"], "--lowbit-bits")):
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
