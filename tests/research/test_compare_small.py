"""benchmarks/compare_small.py: parameter matching, identical data for every model, and a smoke run end to end."""

import importlib.util
import json
import math
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cs():
    spec = importlib.util.spec_from_file_location("compare_small", ROOT / "benchmarks" / "compare_small.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tok():
    from difftransformer.research.data import get_tokenizer

    return get_tokenizer()


@pytest.mark.parametrize("size", ["default", "reduced"])
def test_models_are_parameter_matched(cs, size):
    p = cs.SIZES[size]
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "seq_len",
    )
    configs = cs.build_configs(4096, *(p[k] for k in keys))
    counts = {name: cs._count(cs.build_model(name, cfg, 0)) for name, cfg in configs.items()}
    E, L, d = p["hidden_size"], p["num_hidden_layers"], p["head_dim"]
    assert counts["v1"] - counts["llama"] == L * (4 * d + 2 * d)  # only λ vectors and the subln weight differ
    assert abs(counts["v2"] - counts["llama"]) <= L * 3 * E / 2  # within half an MLP unit per layer
    assert (
        configs["v1"].num_attention_heads == configs["llama"].num_attention_heads == configs["v2"].num_attention_heads
    )


def test_training_data_is_deterministic_and_mixed(cs, tok):
    kwargs = dict(seq_len=96, batch_size=4, steps=3, retrieval_fraction=0.5, eval_blocks=3, max_corpus_chars=100_000)
    a = cs.make_training_data(tok, seed=0, **kwargs)
    b = cs.make_training_data(tok, seed=0, **kwargs)
    c = cs.make_training_data(tok, seed=1, **kwargs)
    for (xa, ya), (xb, yb) in zip(a["train_batches"], b["train_batches"]):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert any(not torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a["train_batches"], c["train_batches"]))
    ids, labels = a["train_batches"][0]
    assert ids.shape == labels.shape == (4, 96)
    corpus, retrieval = slice(0, 2), slice(2, 4)
    assert torch.equal(ids[corpus], labels[corpus])  # corpus blocks: every position labelled
    pad = tok.pad_token_id
    assert torch.all((labels[retrieval] == -100) == (ids[retrieval] == pad))  # retrieval rows: padding unlabelled
    # Validation retrieval rows are labelled on the answer only.
    vids, vlab = a["val_retrieval"]
    labelled = (vlab != -100).sum(1)
    assert torch.all(labelled >= 1) and torch.all(labelled <= 6)
    assert torch.equal(a["val_corpus"], b["val_corpus"])


def _docs_commands():
    """The comparison commands of docs/analysis.md, as argument lists."""
    import re
    import shlex

    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "analysis.md").read_text(), flags=re.S)
    lines = [line for b in blocks for line in b.strip().splitlines() if "compare_small.py" in line]
    assert lines
    commands = [shlex.split(line, comments=True) for line in lines]
    for argv in commands:
        assert argv[:2] == ["python", "benchmarks/compare_small.py"]
    return [argv[2:] for argv in commands]


def test_smoke_run_end_to_end(cs, tmp_path):
    """The docs' command, at the smoke size (same code path, seconds instead of minutes)."""
    out = tmp_path / "cmp"
    commands = _docs_commands()
    for argv in commands[1:]:
        cs.resolve_args(argv)  # every documented command parses
    argv = commands[0]
    argv[argv.index("--size") + 1] = "smoke"
    if "--save-models" in argv:
        argv[argv.index("--save-models") + 1] = str(tmp_path / "models")
    result = cs.main(argv + ["--out", str(out)])
    files = {p.name for p in out.iterdir()}
    assert {"results.json", "results.md", "loss_curves.png", "shares.png"} <= files
    assert {f"probe_{p}_{m}.png" for p in ("niah", "mqar", "icl") for m in ("v1", "v2", "llama")} <= files
    saved = json.loads((out / "results.json").read_text())
    assert saved["meta"]["command"].startswith("python benchmarks/compare_small.py --size smoke")
    runs = saved["results"]
    assert set(runs) == {"v1", "v2", "llama"}
    steps = cs.SIZES["smoke"]["steps"]
    for name, r in runs.items():
        c = r["curves"]
        assert c["eval_step"][0] == 0 and c["eval_step"][-1] == steps and len(c["train_loss"]) == steps
        assert all(math.isfinite(x) for x in c["val_loss"] + c["val_retrieval_loss"] + c["train_loss"])
        for probe in ("niah", "mqar", "icl"):
            assert 0.0 <= r["eval"]["probes"][probe]["accuracy"] <= 1.0
        lens = r["eval"]["lens"]
        assert lens["kind"] == ("softmax" if name == "llama" else "diff")
        if name == "llama":  # softmax shares: answer + noise + other = 1 in every layer
            for row in lens["per_layer"]["softmax"]:
                assert abs(sum(row) - 1) < 1e-5
        else:
            assert set(lens["per_layer"]) == {"diff", "softmax1", "softmax2"}
    assert len(runs["v1"]["eval"]["lambdas"]) == cs.SIZES["smoke"]["num_hidden_layers"]
    assert abs(runs["v2"]["params"] - runs["llama"]["params"]) / runs["llama"]["params"] < 1e-3
    md = (out / "results.md").read_text()
    assert "| DIFF V1 |" in md and "| Llama |" in md and saved["meta"]["command"] in md
    assert result["results"]["v1"]["params"] == runs["v1"]["params"]
    if "--save-models" in argv:  # the saved models load back through the Auto classes
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "v2")
        assert loaded.config.diff_version == 2 and cs._count(loaded) == runs["v2"]["params"]


def test_cli_rejects_unknown_models(cs):
    with pytest.raises(SystemExit, match="--models"):
        cs.resolve_args(["--models", "v1,gpt"])
    with pytest.raises(SystemExit, match="--steps"):
        cs.resolve_args(["--steps", "0"])


def test_docs_tables_are_rendered_from_the_committed_runs():
    """The small-comparison report's default-size and reduced-size tables are table blocks of these runs'
    results.json (scripts/doc_tables.py renders them with compare_small.summary_table;
    tests/repository/test_doc_numbers.py checks every block), and the runs used the presets the report describes."""
    results = ROOT / "benchmarks" / "results"
    default = json.loads((results / "compare_small_default" / "results.json").read_text())
    assert default["meta"]["command"] == "python benchmarks/compare_small.py --size default --no-progress"
    assert [
        json.loads((results / d / "results.json").read_text())["meta"]["args"]["seed"]
        for d in ("compare_small_reduced", "compare_small_reduced_seed1")
    ] == [0, 1]
    report = (ROOT / "docs" / "reports" / "2026-11-23-small-comparison.md").read_text()
    assert "<!-- table: compare-small benchmarks/results/compare_small_default/results.json -->" in report
    assert (
        "<!-- table: compare-small benchmarks/results/compare_small_reduced/results.json "
        "benchmarks/results/compare_small_reduced_seed1/results.json -->"
    ) in report
