"""Every number the README and docs quote from a result is the result's: read from its JSON, with its provenance.

* Every table block of the README and docs/ (``<!-- table: ... -->``) equals what its renderer makes of the JSONs it
  names (the benchmark scripts' own table formatting), and every number quoted in prose beside a
  ``<!-- numbers: ... -->`` marker equals the marker's expression over its JSON, at the precision shown
  (benchmarks/doc_tables.py). How many blocks and markers each document holds is counted: losing one fails.
* Where the code a result measures (the modeling and kernel files, the benchmark script: ``harness.MEASURED_CODE``)
  changed after the result's commit, the document says so beside the number (the blocks' source lines do it; a
  prose paragraph must name both commits), and such a sentence is checked against git.
* Every committed result JSON records its provenance: the commit (one in this repository's history), whether the
  tree was dirty, the command, the machine and the versions.
* In the README (outside its upcycling section, whose owner marks it) and docs/performance.md no ratio or percentage
  is quoted in prose without a marker.
"""

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import doc_tables, harness  # noqa: E402

HAS_HISTORY = (ROOT / ".git").exists() and shutil.which("git") is not None
needs_history = pytest.mark.skipif(not HAS_HISTORY, reason="provenance is checked against the repository's git history")

# (table blocks, numbers markers) per document: a document that loses one fails, one that gains one updates this.
EXPECTED = {"README.md": (2, 12), "docs/performance.md": (7, 9), "docs/performance-kernels.md": (8, 3), "docs/gpu.md": (4, 0)}
# Sections of the README left out of the marker check (none: every README number has its marker).
README_UNMARKED_SECTIONS: tuple[str, ...] = ()


def _result_jsons() -> list[str]:
    files = subprocess.run(["git", "ls-files", "*.json"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in files.split() if "/results/" in f]


@needs_history
def test_every_table_and_quoted_number_equals_its_json():
    report = doc_tables.check()
    assert not report.errors, "\n".join(report.errors)
    found = {}
    for block in report.blocks:
        found.setdefault(block.doc, [0, 0])[0] += 1
    for marker in report.numbers:
        found.setdefault(marker.doc, [0, 0])[1] += 1
    assert {doc: tuple(found.get(doc, (0, 0))) for doc in EXPECTED} == EXPECTED
    compared = sum(block.end - block.start - 1 for block in report.blocks)
    assert compared > 250, compared  # lines of generated tables compared, source lines included


@needs_history
def test_the_checker_catches_a_changed_number_and_an_unflagged_stale_result(tmp_path):
    """The same check on a copy: a table cell edited by hand, a prose number off by one in its last digit, and a
    result whose measured code changed since are each named; the honest versions pass."""
    fresh = {"provenance": {"script": "bench.py", "commit": subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()},
        "value": 1.2345}
    old_result = ROOT / "benchmarks/results/bench_t1cpu_bf16.json"  # a run older than the code it measured
    old_commit = json.loads(old_result.read_text())["provenance"]["commit"]
    stale = {"provenance": {"script": "bench.py", "commit": old_commit}, "value": 1.2345}
    (tmp_path / "docs").mkdir()
    (tmp_path / "fresh.json").write_text(json.dumps(fresh))
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    first_change = harness.measured_code_changes(old_commit, "bench.py")[0][:7]

    def errors(text):
        (tmp_path / "docs" / "x.md").write_text(text)
        doc_tables._CACHE.clear()
        return doc_tables.check(["docs/x.md"], root=str(tmp_path)).errors

    assert errors("It takes 1.23 s<!-- numbers: fresh.json | j['value'] | 1.23 s -->.\n") == []
    assert "gives 1.2345" in errors("It takes 1.24 s<!-- numbers: fresh.json | j['value'] | 1.24 s -->.\n")[0]
    assert any("the paragraph does not contain" in e
               for e in errors("It takes 1.23 s<!-- numbers: fresh.json | j['value'] | lasts 1.23 s -->.\n"))
    unflagged = errors("It took 1.23 s<!-- numbers: stale.json | j['value'] | 1.23 s -->.\n")
    assert len(unflagged) == 1 and f"before {first_change}" in unflagged[0]
    assert errors(f"It took 1.23 s<!-- numbers: stale.json | j['value'] | 1.23 s --> (measured at {old_commit[:7]}, "
                  f"before {first_change} changed the code).\n") == []
    real = old_result.read_text()
    (tmp_path / "bench.json").write_text(real)
    block = "<!-- table: bench bench.json -->\n<!-- end table -->\n"
    (tmp_path / "docs" / "x.md").write_text(block)
    doc_tables._CACHE.clear()
    assert doc_tables.check(["docs/x.md"], root=str(tmp_path), write=True).errors == []
    written = (tmp_path / "docs" / "x.md").read_text()
    assert f"before {harness.measured_code_changes(old_commit, 'bench.py')[0][:7]} changed the code" in written
    cell = re.search(r"\| (\d+\.\d\d) ±", written)  # the first cell of the table, edited by hand
    edited = written[:cell.start(1)] + f"{float(cell[1]) + 0.1:.2f}" + written[cell.end(1):]
    assert edited != written
    assert "differs from its JSON" in errors(edited)[0]


@needs_history
def test_every_result_json_records_its_provenance():
    files = _result_jsons()
    assert len(files) >= 40, files
    for path in files:
        prov = json.loads((ROOT / path).read_text()).get("provenance")
        assert prov, f"{path} has no provenance entry"
        assert prov["script"] in harness.MEASURED_CODE, path
        assert re.fullmatch(r"[0-9a-f]{40}", prov["commit"]), path
        assert subprocess.run(["git", "cat-file", "-e", prov["commit"] + "^{commit}"], cwd=ROOT).returncode == 0, path
        assert prov["dirty"] in (True, False, "unknown"), path
        assert prov["command"] and (prov.get("machine") or prov.get("machine_note")), path
        assert prov.get("versions") or prov.get("recovered"), path
        assert prov.get("utc") or prov.get("committed_utc"), path
        if prov.get("recovered"):  # added afterwards: it says how much it knows
            assert prov["commit_note"] and prov["command_note"], path


@needs_history
def test_every_quoted_command_parses_with_its_script():
    """The command under each table (its JSON's provenance) uses flags its script still accepts."""
    from benchmarks import attention_micro, bench, decode_parts, profile_train, v2_prompt_attention

    parsers = {"bench.py": bench.parse_args, "attention_micro.py": attention_micro.parse_args,
               "v2_prompt_attention.py": v2_prompt_attention.parse_args, "decode_parts.py": decode_parts.parse_args,
               "profile_train.py": profile_train.parse_args}
    parsed = 0
    for block in doc_tables.check().blocks:
        for path in block.files:
            command = doc_tables.load(path)["provenance"]["command"]
            argv = shlex.split(command.split(" (in a checkout")[0])
            while argv and "=" in argv[0] and not argv[0].startswith("-"):  # NAME=value: harness.MEASURED_ENV
                argv.pop(0)
            if argv[:2] == ["python", f"benchmarks/{Path(argv[1]).name}"] and Path(argv[1]).name in parsers:
                args = [a.replace("proposed", "ours") for a in argv[2:]]  # the strategy's name when it ran
                parsers[Path(argv[1]).name](args)
                parsed += 1
    assert parsed >= 15, parsed


def _readme_lines_outside(sections) -> list[tuple[int, int]]:
    """Line ranges of the README outside ``sections`` (headings of level 2)."""
    lines = (ROOT / "README.md").read_text().split("\n")
    cuts = [i for i, line in enumerate(lines) if line.startswith("## ")] + [len(lines)]
    ranges, start = [], 0
    for a, b in zip(cuts, cuts[1:]):
        if lines[a] in sections:
            ranges.append((start, a))
            start = b
    ranges.append((start, len(lines)))
    return ranges


def test_no_result_is_quoted_in_prose_without_its_marker():
    lines = (ROOT / "README.md").read_text().split("\n")
    found = [x for a, b in _readme_lines_outside(README_UNMARKED_SECTIONS)
             for x in doc_tables.unchecked_numbers("README.md", lines, a, b)]
    performance = (ROOT / "docs" / "performance.md").read_text().split("\n")
    found += doc_tables.unchecked_numbers("docs/performance.md", performance)
    assert not found, "\n".join(found)


# Quoted in prose without a marker, with the reason. Each entry must still be found (a stale entry fails).
UNMARKED = {
    ("docs/analysis.md", "1.7%"): "the uniform-attention level of the probe prompts (1.5–1.7% of their tokens are the "
                                  "answer value): derived from the prompts, not stored in the run's results.json",
}


def test_no_doc_quotes_a_result_in_prose_without_its_marker():
    """Every number that looks like a result (two or more decimals, or a percentage) in the README's and docs' prose
    is checked by a numbers marker or a table block, except the entries of ``UNMARKED``."""
    found, seen = [], set()
    for doc in doc_tables.docs(str(ROOT)):
        for line in doc_tables.unchecked_numbers(doc, (ROOT / doc).read_text().split("\n")):
            key = (doc, line.split(": ", 1)[1].split(" in ", 1)[0])
            if key in UNMARKED:
                seen.add(key)
            else:
                found.append(line)
    assert not found, f"{len(found)} unmarked numbers:\n" + "\n".join(found[:40])
    assert seen == set(UNMARKED), f"no longer found (remove from UNMARKED): {set(UNMARKED) - seen}"


def test_the_readme_remeasure_script_runs_the_rows_it_promises():
    """scripts/remeasure_readme.sh: valid bash; its bench.py flags parse; its rows are the README's (every group
    but the uncompiled static cache), its models Llama, DiffLlama, ours V1 and V2; and it rewrites the tables."""
    from benchmarks import bench

    script = (ROOT / "scripts" / "remeasure_readme.sh").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "remeasure_readme.sh")]).returncode == 0
    groups = re.search(r"^groups=(\S+)$", script, re.M).group(1)
    common = re.search(r"^common=\((.*?)\)$", script, re.M | re.S).group(1).replace("$groups", groups)
    args = [a for a in shlex.split(common) if a != '"${smoke[@]}"' and a != "${smoke[@]}"]
    for dtype in ("fp32", "bf16"):
        assert f"--dtype {dtype} \"${{common[@]}}\" --json $OUT/bench_t1cpu_{dtype}.json" in script
        ns = bench.parse_args(["--dtype", dtype, *args])
        assert bench._choices(ns.only, bench.GROUPS, "--only") == [g for g in bench.GROUPS if g != "decode_static"]
        assert bench._choices(ns.models, bench.MODELS, "--models") == list(bench.MODELS)
        plan, shape = bench.plan_and_shape(ns)
        assert (plan.reps, plan.threads, plan.clock, shape.hidden_size, shape.num_hidden_layers) == (5, 1, "cpu", 512, 8)
    assert "benchmarks/doc_tables.py --write" in script
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/remeasure_readme.sh" in readme
    assert "<!-- table: bench-summary benchmarks/results/bench_t1cpu_fp32.json -->" in readme


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_commit_that_changes_only_comments_and_docstrings_leaves_a_result_current(tmp_path, monkeypatch):
    """In a scratch repository: a comment or docstring edit of measured code is not a change; a changed line of code,
    even one that only renames a variable, is."""
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    def commit(text, message):
        (tmp_path / "model.py").write_text(text)
        git("add", "model.py")
        git("commit", "-q", "-m", message)
        return git("rev-parse", "HEAD")

    monkeypatch.setitem(harness.MEASURED_CODE, "scratch.py", ["model.py"])
    git("init", "-q")
    measured = commit('def f(x):\n    """Double."""\n    return 2 * x\n', "measured")
    commit('def f(x):\n    """Twice x."""\n    # the factor\n    return 2 * x  # doubled\n', "comments only")
    assert harness.measured_code_changes(measured, "scratch.py", root=str(tmp_path)) == []
    changed = commit('def f(y):\n    """Twice y."""\n    return 2 * y\n', "a renamed argument")
    assert harness.measured_code_changes(measured, "scratch.py", root=str(tmp_path)) == [changed]


@needs_history
def test_a_resumed_result_names_the_run_it_kept_and_whether_that_code_changed_since():
    """A run continued with ``--resume`` (compare_upcycled.py) keeps the earlier run's provenance as ``resumed_from``:
    the source line names both commands, both commits and both transformers releases, and says of the earlier one
    when the code it measured changed after it."""
    data = json.loads((ROOT / "benchmarks/results/compare_upcycled_smollm2/results.json").read_text())
    earlier = data["provenance"]["resumed_from"]
    line = doc_tables.provenance_sentence("results.json", data)
    assert line.count("`python benchmarks/compare_upcycled.py") == 2 and "It kept the runs of an earlier run" in line
    assert f"measured at commit {data['provenance']['commit'][:7]}" in line
    assert f"measured at commit {earlier['commit'][:7]}" in line
    for prov in (data["provenance"], earlier):
        assert f"transformers {prov['versions']['transformers']}" in line
    changes = harness.measured_code_changes(earlier["commit"], "compare_upcycled.py", first=True)
    assert (f"before {changes[0][:7]} changed the code it measures" in line.split("It kept")[1]) == bool(changes)
