"""Every number the README and docs show from a result is the result's, with its provenance, and "stale" means stale.

* Every table block of the README, docs/ and docs/reports/ (``<!-- table: ... -->``) equals what its renderer makes of
  the JSONs it names (scripts/doc_tables.py; the benchmark scripts' own table formatting). How many blocks each
  document holds is counted: losing one fails.
* Prose cites tables: a result-like number (two or more decimals, or a percentage) in prose must appear in a table
  block of the same document.
* A result is stale exactly when the code it ran has changed: the run's record of the functions it executed
  (benchmarks/harness.py traces them) against the checkout's code. Checked on scratch code here, without git.
* Every committed result JSON records its provenance (command, commit, machine, versions, its code record); a
  reconstructed code record equals the code at the commit it names (that check needs git history and skips without).
"""

import json
import re
import shlex
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from benchmarks import harness  # noqa: E402
from scripts import doc_tables  # noqa: E402

HAS_HISTORY = (
    shutil.which("git") is not None
    and subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    == "false"
)
needs_history = pytest.mark.skipif(
    not HAS_HISTORY,
    reason="needs the repository's full git history (a shallow clone "
    "or a copy without .git has not got the commits the results name)",
)

# Table blocks per document: a document that loses one fails, one that gains one updates this. Documents not listed
# (docs/reports/ pages added later, for instance) are checked like the others without a count.
EXPECTED = {
    "README.md": 1,
    "docs/performance.md": 1,
    "docs/reports/2026-11-26-cpu-speed.md": 7,
    "docs/reports/2026-11-26-gpu-check.md": 4,
    "docs/reports/2026-11-26-vllm-throughput.md": 3,
    "docs/reports/2026-11-23-small-comparison.md": 2,
    "docs/reports/2026-11-26-upcycling.md": 4,
    "docs/reports/2026-11-27-retrieval-lowbit.md": 14,
    "docs/reports/2026-11-28-retrieval-lr-grid-and-pretrained-lowbit.md": 4,  # grid table, its other tests, 2 low-bit
}

# Quoted in prose though no table of the page shows it, with the reason. Each entry must still be found.
UNMARKED = {
    (
        "docs/reports/2026-11-23-small-comparison.md",
        "1.7%",
    ): "the uniform-attention level of the probe prompts (1.5–1.7% of their tokens are the answer value): derived "
    "from the prompts, not a result",
    **{
        ("docs/distributed.md", share): "the share of the weights accelerate keeps in RAM under the offload snippet's "
        "budget: a placement, which tests/repository/test_docs_distributed.py recomputes and compares with these words"
        for share in ("21%", "25%")
    },
}


def _result_jsons() -> list[Path]:
    return sorted(
        p for folder in ("benchmarks/results", "convert_scripts/results") for p in (ROOT / folder).rglob("*.json")
    )


def test_every_table_equals_its_json():
    report = doc_tables.check()
    assert not report.errors, "\n".join(report.errors) + (
        "\n(after changing code or a result: `python scripts/doc_tables.py --write` regenerates the tables and the "
        "lines under them, which say whether the code each run executed has changed since; commit the docs with it)"
    )
    found = {}
    for block in report.blocks:
        found[block.doc] = found.get(block.doc, 0) + 1
    assert {doc: found.get(doc, 0) for doc in EXPECTED} == EXPECTED
    compared = sum(block.end - block.start - 1 for block in report.blocks)
    assert compared > 150, compared  # lines of generated tables compared, source lines included


def test_no_doc_quotes_a_result_in_prose_that_no_table_shows():
    """The README, every reference page and every report that shows results (a table block): a result-like number in
    prose is one its tables show. Reports without result tables (investigations of sources, the CI-time log) quote
    arithmetic on published configs or logs, not result files."""
    found, seen = [], set()
    for doc in doc_tables.docs(str(ROOT)):
        lines = (ROOT / doc).read_text().split("\n")
        if doc.startswith("docs/reports/") and not doc_tables.parse_blocks(doc, lines):
            continue
        for line in doc_tables.unchecked_numbers(doc, lines):
            key = (doc, line.split(": ", 1)[1].split(" in ", 1)[0])
            if key in UNMARKED:
                seen.add(key)
            else:
                found.append(line)
    assert not found, f"{len(found)} numbers in prose that no table shows:\n" + "\n".join(found[:40])
    assert seen == set(UNMARKED), f"no longer found (remove from UNMARKED): {set(UNMARKED) - seen}"


def test_the_checker_catches_an_edited_cell_and_a_number_no_table_shows(tmp_path):
    # A scratch page under tmp_path, named in parts: tests/repository/test_references.py checks that every docs page
    # named exists.
    doc = Path("docs", "x.md").as_posix()
    (tmp_path / "docs").mkdir()
    real = ROOT / "benchmarks/results/bench_t1cpu_fp32.json"
    (tmp_path / "bench.json").write_text(real.read_text())
    (tmp_path / doc).write_text("<!-- table: bench bench.json -->\n<!-- end table -->\n")
    doc_tables.load.cache_clear()
    assert doc_tables.check([doc], root=str(tmp_path), write=True).errors == []
    written = (tmp_path / doc).read_text()
    cell = re.search(r"\| (\d+\.\d\d) ±", written)
    edited = written[: cell.start(1)] + f"{float(cell[1]) + 0.1:.2f}" + written[cell.end(1) :]
    (tmp_path / doc).write_text(edited)
    doc_tables.load.cache_clear()
    assert "differs from its JSON" in doc_tables.check([doc], root=str(tmp_path)).errors[0]
    lines = (written + f"\nThe first row reads {cell[1]}, the second 9.87.\n").split("\n")
    unchecked = doc_tables.unchecked_numbers(doc, lines)
    assert len(unchecked) == 1 and "9.87" in unchecked[0]  # the cited table value passes, the other does not


def test_the_readme_rows_join_the_files_of_one_result_run_in_parallel(tmp_path, monkeypatch):
    """The README's block (``<!-- table: readme -->``) renders README_ROWS: an entry of two files gives the rows of the
    script's ``combined`` of both, a column per model with "–" where a model has no value, and a link to its page;
    the block's files (what --changes and the command check read) are every file of README_ROWS."""
    joined = types.ModuleType("benchmarks.joined_demo")
    joined.combined = lambda datas: {"n": sum(d["n"] for d in datas)}
    joined.readme_rows = lambda data: [("joined result", {"v2": f"{data['n']}"})]
    monkeypatch.setitem(sys.modules, "benchmarks.joined_demo", joined)
    for name, n in (("a.json", 1), ("b.json", 2)):
        prov = {
            "script": "joined_demo.py",
            "commit": "a" * 40,
            "command": "python benchmarks/joined_demo.py",
            "code": {"how": "unknown", "digests": {}},
            "utc": "2026-11-27T00:00:00+00:00",
        }
        (tmp_path / name).write_text(json.dumps({"n": n, "provenance": prov}))
    link = "/".join(["docs", "r.md"])  # a scratch name, built in parts
    monkeypatch.setattr(doc_tables, "README_ROWS", ((("a.json", "b.json"), link),))
    (tmp_path / "README.md").write_text("<!-- table: readme -->\n<!-- end table -->\n")
    doc_tables.load.cache_clear()
    report = doc_tables.check(["README.md"], root=str(tmp_path), write=True)
    assert report.errors == [] and report.blocks[0].files == ["a.json", "b.json"]
    lines = (tmp_path / "README.md").read_text().split("\n")
    assert lines[1] == "| result | Llama | DIFF V1 | DIFF V2 | details |"
    assert lines[3] == f"| joined result | – | – | 3 | [r]({link}) |"
    doc_tables.load.cache_clear()


def _scratch_module(tmp_path: Path, body: str) -> Path:
    folder = tmp_path / "benchmarks"
    folder.mkdir(exist_ok=True)
    path = folder / "model.py"
    path.write_text(body)
    return path


def test_a_code_record_changes_with_the_code_it_ran_and_only_with_it(tmp_path):
    """On scratch code: a result that ran ``f`` is current while ``f`` and the module constant it reads are; a reworded
    comment or docstring, a change to a function it did not run or a new constant leaves it current; a changed line of
    ``f``, even one that only renames a variable, or a change of the constant makes it stale, naming what changed."""
    source = (
        'SCALE = 2\n\n\ndef f(x):\n    """Double."""\n    return SCALE * x  # doubled\n\n\ndef g(x):\n    return x\n'
    )
    path = _scratch_module(tmp_path, source)
    first_line = 4  # the line `def f` starts on: what a trace records for a call of f
    record = harness.code_record({"benchmarks/model.py": {first_line}}, {"benchmarks/model.py": source})
    assert record["how"] == "traced"
    assert set(record["digests"]) == {
        "benchmarks/model.py:f",
        "benchmarks/model.py:<module>.SCALE",
        "benchmarks/model.py:<module>",
    }  # g did not run
    assert harness.code_changes(record, str(tmp_path)) == []
    path.write_text(
        source.replace('"""Double."""', '"""Twice x."""')
        .replace("# doubled", "# twice")
        .replace("return x\n", "return x + 1\n")
    )
    assert harness.code_changes(record, str(tmp_path)) == []
    path.write_text(source.replace("def f(x):", "def f(y):").replace("SCALE * x", "SCALE * y"))
    assert harness.code_changes(record, str(tmp_path)) == ["benchmarks/model.py:f"]
    path.write_text(source.replace("SCALE = 2", "SCALE = 3"))
    assert harness.code_changes(record, str(tmp_path)) == ["benchmarks/model.py:<module>.SCALE"]
    path.write_text(source + "\nOTHER = 1\n")  # a constant f does not read
    assert harness.code_changes(record, str(tmp_path)) == []
    path.write_text(source.replace("def f(x):", "def h(x):"))
    assert harness.code_changes(record, str(tmp_path)) == ["benchmarks/model.py:f"]  # gone counts as changed
    assert harness.code_changes({"how": "unknown", "digests": {}}, str(tmp_path)) is None


def test_the_provenance_line_says_current_changed_or_unknown(tmp_path):
    source = "def f(x):\n    return 2 * x\n"
    path = _scratch_module(tmp_path, source)
    record = harness.code_record({"benchmarks/model.py": {1}}, {"benchmarks/model.py": source})
    prov = {
        "script": "model.py",
        "commit": "a" * 40,
        "command": "python benchmarks/model.py",
        "code": record,
        "versions": {"torch": "2.13.0"},
    }
    assert "the code it ran is unchanged since" in doc_tables.provenance_sentence(
        "r.json", {"provenance": prov}, str(tmp_path)
    )
    path.write_text(source.replace("2 * x", "x + x"))
    assert "the code it ran has changed since" in doc_tables.provenance_sentence(
        "r.json", {"provenance": prov}, str(tmp_path)
    )
    assert doc_tables.code_status(prov, str(tmp_path)) == ("changed", ["benchmarks/model.py:f"])
    line = doc_tables.provenance_sentence(
        "r.json", {"provenance": prov | {"code": {"how": "unknown", "digests": {}}}}, str(tmp_path)
    )
    assert "whether the code it ran has changed since is unknown" in line
    reconstructed = prov | {"recovered": True, "command_note": "as the docs give it; not recorded by the run"}
    assert "(command reconstructed after the run)" in doc_tables.provenance_sentence(
        "r.json", {"provenance": reconstructed}, str(tmp_path)
    )


def test_interleave_traces_one_untimed_call_of_each_run_and_times_the_rest_untraced():
    """The one timing loop: one traced call per run (its code record), then warm-ups and rotated rounds, untraced."""
    from benchmarks import bench

    calls, traced_during = [], []

    def run(name):
        def call():
            calls.append(name)
            traced_during.append(sys.getprofile() is not None)
            bench.forward_flops(
                bench.build_config("llama", bench.Shape(hidden_size=64, num_hidden_layers=1, vocab_size=32)), 4, 1
            )
            return 1.0

        return call

    harness.EXECUTED.clear()
    samples = harness.interleave({"a": run("a"), "b": run("b")}, reps=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "a", "b", "b", "a", "a", "b"]  # traced, warm-up, then rotated rounds
    assert traced_during == [True, True] + [False] * 8
    assert samples == {"a": [1.0] * 3, "b": [1.0] * 3}
    names = set(harness.code_record()["digests"])
    assert {"benchmarks/bench.py:forward_flops", "benchmarks/bench.py:build_config"} <= names
    assert not any(n.startswith("benchmarks/harness.py") or n.endswith(":format_table") for n in names)
    harness.EXECUTED.clear()


def test_every_result_json_records_its_provenance_and_its_code():
    files = _result_jsons()
    assert len(files) >= 20, files
    for path in files:
        name = path.relative_to(ROOT)
        prov = json.loads(path.read_text()).get("provenance")
        assert prov, f"{name} has no provenance entry"
        assert re.fullmatch(r"[0-9a-f]{40}", prov["commit"]), name
        assert prov["dirty"] in (True, False, "unknown"), name
        assert prov["command"] and (prov.get("machine") or prov.get("machine_note")), name
        assert prov.get("versions") or prov.get("recovered"), name
        assert prov.get("utc") or prov.get("committed_utc"), name
        if prov.get("recovered"):  # added afterwards: it says how much it knows
            assert prov["commit_note"] and prov["command_note"], name
        code = prov.get("code")
        assert code and code["how"] and isinstance(code["digests"], dict), f"{name}: no code record"
        if not code["digests"]:
            assert code["how"].startswith(("unknown", "not traced")), name


@needs_history
def test_every_reconstructed_code_record_is_the_code_at_its_commit():
    """A record reconstructed after the run stores digests of the code at the commit it names: recomputed from git."""
    checked = 0
    for path in _result_jsons():
        prov = json.loads(path.read_text())["provenance"]
        for p in (prov, prov.get("resumed_from") or {}):
            code = p.get("code") or {}
            if not code.get("how", "").startswith("reconstructed"):
                continue
            assert subprocess.run(["git", "cat-file", "-e", code["at"] + "^{commit}"], cwd=ROOT).returncode == 0, path
            read, defs = harness.git_reader(code["at"]), {}
            for key, digest in code["digests"].items():
                file, name = key.rsplit(":", 1)
                if file not in defs:
                    text = read(file)
                    defs[file] = harness.definitions(text) if text is not None else {}
                assert (defs[file].get(name) or (None, None, None))[2] == digest, (path.name, key)
            checked += 1
    assert checked >= 10, checked


@needs_history
def test_every_result_names_a_commit_of_this_repository():
    for path in _result_jsons():
        prov = json.loads(path.read_text())["provenance"]
        assert subprocess.run(["git", "cat-file", "-e", prov["commit"] + "^{commit}"], cwd=ROOT).returncode == 0, path


def test_every_quoted_benchmark_command_parses_with_its_script():
    """The command under each table (its JSON's provenance) uses flags its script still accepts."""
    from benchmarks import bench, bench_gda, bench_vllm

    parsers = {
        "bench.py": bench.parse_args,
        "bench_gda.py": bench_gda.parse_args,
        "bench_vllm.py": bench_vllm.parse_args,
    }
    parsed = 0
    for block in doc_tables.check().blocks:
        for path in block.files:
            command = doc_tables.load(path)["provenance"]["command"]
            argv = shlex.split(command.split(" (in a checkout")[0])
            while argv and "=" in argv[0] and not argv[0].startswith("-"):  # NAME=value: harness.MEASURED_ENV
                argv.pop(0)
            script = Path(argv[1]).name if len(argv) > 1 else ""
            if argv[0].endswith("python") and script in parsers:
                parsers[script](argv[2:])
                parsed += 1
    assert parsed >= 10, parsed


def test_the_readme_remeasure_script_runs_the_rows_it_measured():
    """scripts/remeasure_readme.sh: valid bash; its bench.py flags parse; its rows are the committed fp32 run's (every
    group but the uncompiled static cache), its models Llama, DiffLlama, ours V1 and V2; and it rewrites the tables."""
    from benchmarks import bench

    path = ROOT / "scripts" / "remeasure_readme.sh"
    script = path.read_text()
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    groups = re.search(r"^groups=(\S+)$", script, re.M).group(1)
    common = re.search(r"^common=\((.*?)\)$", script, re.M | re.S).group(1).replace("$groups", groups)
    args = [a for a in shlex.split(common) if a not in ('"${smoke[@]}"', "${smoke[@]}")]
    for dtype in ("fp32", "bf16"):
        assert f'--dtype {dtype} "${{common[@]}}" --json $OUT/bench_t1cpu_{dtype}.json' in script
        ns = bench.parse_args(["--dtype", dtype, *args])
        assert bench.parse_choices(ns.only, bench.GROUPS, "--only") == [g for g in bench.GROUPS if g != "decode_static"]
        assert bench.parse_choices(ns.models, bench.MODELS, "--models") == list(bench.MODELS)
        plan, shape = bench.plan_and_shape(ns)
        assert (plan.reps, plan.threads, plan.clock, shape.hidden_size, shape.num_hidden_layers) == (
            5,
            1,
            "cpu",
            512,
            8,
        )
    assert "scripts/doc_tables.py --write" in script
    committed = shlex.split(
        json.loads((ROOT / "benchmarks/results/bench_t1cpu_fp32.json").read_text())["provenance"]["command"]
    )
    assert bench.parse_args(committed[2:]).only == groups


def test_a_resumed_result_names_the_run_it_kept():
    """A run continued with ``--resume`` (compare_upcycled.py) keeps the earlier run's provenance as ``resumed_from``:
    the line under its table names both commands, both commits and both transformers releases."""
    data = json.loads((ROOT / "benchmarks/results/compare_upcycled_smollm2/results.json").read_text())
    earlier = data["provenance"]["resumed_from"]
    line = doc_tables.provenance_sentence("results.json", data)
    assert line.count("`python benchmarks/compare_upcycled.py") == 2 and "It kept the runs of an earlier run" in line
    for prov in (data["provenance"], earlier):
        assert f"measured at commit {prov['commit'][:7]}" in line
        assert f"transformers {prov['versions']['transformers']}" in line
