"""No file of the repository cites a document its reader does not have: a specification's sections, an issue tracker's
numbers, a seed's notes. It names the docs section it means instead (docs/model.md holds the equations, the row order
and the configuration; docs/convert.md the conversions; docs/performance.md the benchmarks).

Two kinds of file are left as they are: tests/assets/ (a byte-for-byte copy of a released version's code, which the
remote-code tests load as it shipped) and benchmarks/results/ (what the runs wrote); and this file, for its examples."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Built from parts, so that this file does not match itself: a specification's sections, an issue number, a seed's
# notes, and a notes file of the workspace outside the repository (``shared/SOMETHING.md``, an absolute /work path).
CITATION = re.compile(r"\b" + "SP" + r"EC\b|\b[Ii]" + r"ssue #?\d+|\bseed " + "note|(?<![\w./-])" + "sha" + r"red/[A-Z][\w-]*\.md|"
                      r"(?<![\w.])/" + "wo" + r"rk/")
KEPT = ("tests/assets/", "benchmarks/results/", "tests/test_references.py")  # the last: its own examples
TEXT = (".py", ".md", ".sh", ".txt", ".toml", ".cfg", ".yml", ".yaml", ".json")


def citations() -> dict[str, list[str]]:
    """Every tracked text file (outside ``KEPT``) → its lines that cite a specification, an issue or a seed note."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = {}
    for name in files:
        if not name.endswith(TEXT) or name.startswith(KEPT) or not (ROOT / name).is_file():
            continue
        lines = [f"{i}: {line.strip()[:120]}" for i, line in enumerate((ROOT / name).read_text(errors="replace")
                                                                       .splitlines(), 1) if CITATION.search(line)]
        if lines:
            found[name] = lines
    return found


def test_the_pattern_finds_what_it_is_for():
    for line in ("the SPEC §3 row order", "as issue 5 asks", "(Issue #12)", "a classic slip (seed note 003)",
                 "compared with " + "sha" + "red/MOTIF-NOTES.md", "see /" + "work/notes/x.md"):
        assert CITATION.search(line), line
    for line in ("SPECIAL_TOKENS", "an issue of numerics", "the seed 3", "specification", "docs/shared/x.md",
                 "shared_memory/Notes.md", "the network/"):
        assert not CITATION.search(line), line


def test_no_file_cites_a_document_the_reader_does_not_have():
    found = citations()
    assert not found, "\n".join(f"{name}:{line}" for name, lines in found.items() for line in lines)
