"""No file of the repository cites a document its reader does not have: a specification's sections, an issue tracker's
numbers, a seed's notes. It names the docs section it means instead (docs/model.md holds the equations, the row order
and the configuration; docs/convert.md the conversions; docs/performance.md the benchmarks). And what it names is
there: every docs page it names (``docs/NAME.md``, ``docs/reports/NAME.md``, with or without an ``#anchor``) exists,
every section it quotes right after one (``docs/NAME.md, "Section"``, ``docs/NAME.md ("Section")``,
``docs/NAME.md's "Section"``) is part of one of that page's headings, and every relative Markdown link
(``[text](path#anchor)``) leads to a file and, with an anchor, to one of its headings (GitHub's anchors: the heading
lowercased, its punctuation but ``-`` and ``_`` dropped, each space a ``-``).

Two kinds of file are left as they are: tests/assets/ (a byte-for-byte copy of a released version's code, which the
remote-code tests load as it shipped) and benchmarks/results/ (what the runs wrote); and this file, for its examples.
A page named after a revision (``git show REV:docs/NAME.md``) is history, not a reference."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Built from parts, so that this file does not match itself: a specification's sections, an issue number, a seed's
# notes, and a notes file of the workspace outside the repository (``shared/SOMETHING.md``, an absolute /work path).
CITATION = re.compile(
    r"\b"
    + "SP"
    + r"EC\b|\b[Ii]"
    + r"ssue #?\d+|\bseed "
    + "note|"
    + r"(?<![\w./-])"
    + "sha"
    + r"red/[A-Z][\w-]*\.md|"
    + r"(?<![\w.])/"
    + "wo"
    + r"rk/"
)
KEPT = ("tests/assets/", "benchmarks/results/", "tests/repository/test_references.py")  # the last: its own examples
TEXT = (".py", ".md", ".sh", ".txt", ".toml", ".cfg", ".yml", ".yaml", ".json")

# A docs page named in a file (not inside a longer path, nor after a revision's colon), with its #anchor if any.
DOC_PAGE = re.compile(r"(?<![\w./:-])(docs/(?:reports/)?[\w.-]+\.md)(?:#([\w-]+))?")
# A section quoted right after a docs page (in text whose line breaks, with a comment's `#`, read as spaces).
QUOTED_SECTION = re.compile(r"(?<![\w./:-])(docs/(?:reports/)?[\w.-]+\.md)(?:, | \(|'s )\"([^\"]+)\"")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # a Markdown link; its target


def tracked_texts() -> dict[str, str]:
    """Every tracked text file outside ``KEPT`` → its text."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return {
        name: (ROOT / name).read_text(errors="replace")
        for name in files
        if name.endswith(TEXT) and not name.startswith(KEPT) and (ROOT / name).is_file()
    }


def citations() -> dict[str, list[str]]:
    """Every tracked text file (outside ``KEPT``) → its lines that cite a specification, an issue or a seed note."""
    found = {}
    for name, text in tracked_texts().items():
        lines = [f"{i}: {line.strip()[:120]}" for i, line in enumerate(text.splitlines(), 1) if CITATION.search(line)]
        if lines:
            found[name] = lines
    return found


def headings(text: str) -> list[str]:
    """A Markdown page's headings (``#`` to ``######``), outside fenced code blocks."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)(?:\s+#+)?\s*$", line)):
            found.append(m[1])
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: a link in it reads as its text; lowercased; punctuation but ``-`` and ``_``
    dropped (backticks, colons, apostrophes, arrows); each space a ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (GitHub numbers a repeated one: ``name``, ``name-1``, ``name-2``, ...)."""
    found, counts = set(), {}
    for heading in headings(text):
        name = slug(heading)
        found.add(name if name not in counts else f"{name}-{counts[name]}")
        counts[name] = counts.get(name, 0) + 1
    return found


def _page(path: Path) -> str | None:
    return path.read_text(errors="replace") if path.is_file() else None


def broken_references(texts: dict[str, str]) -> list[str]:
    """``file:line: what`` for every docs page named that does not exist, every anchor or quoted section that is not
    one of its page's headings, and every relative Markdown link (in a ``.md`` file) whose file or anchor is missing."""
    broken = []
    for name, text in texts.items():
        for i, line in enumerate(text.splitlines(), 1):
            for m in DOC_PAGE.finditer(line):
                page = _page(ROOT / m[1])
                if page is None:
                    broken.append(f"{name}:{i}: {m[1]} does not exist")
                elif m[2] and m[2] not in anchors(page):
                    broken.append(f"{name}:{i}: {m[1]} has no heading with the anchor #{m[2]}")
            if not name.endswith(".md"):
                continue
            for m in LINK.finditer(line):
                path, _, anchor = m[1].partition("#")
                if re.match(r"[a-z][a-z0-9+.-]*:", path):
                    continue  # https:, mailto:, ...
                target = (ROOT / name).parent / path if path else ROOT / name
                if not target.exists():
                    broken.append(f"{name}:{i}: the link ({m[1]}) leads to no file")
                elif anchor and anchor not in anchors(_page(target) or ""):
                    broken.append(f"{name}:{i}: the link ({m[1]}) leads to no heading with that anchor")
        flat = re.sub(r"[ \t]*\n[ \t]*(?:#+[ \t]*)?", " ", text)  # a quoted section may be wrapped over lines
        for m in QUOTED_SECTION.finditer(flat):
            page = _page(ROOT / m[1])  # (a missing page is reported above)
            if page is not None and not any(m[2] in heading for heading in headings(page)):
                broken.append(f"{name}: {m[1]} has no heading holding the quoted section {m[2]!r}")
    return broken


def test_the_pattern_finds_what_it_is_for():
    for line in (
        "the SPEC §3 row order",
        "as issue 5 asks",
        "(Issue #12)",
        "a classic slip (seed note 003)",
        "compared with " + "sha" + "red/MOTIF-NOTES.md",
        "see /" + "work/notes/x.md",
    ):
        assert CITATION.search(line), line
    for line in (
        "SPECIAL_TOKENS",
        "an issue of numerics",
        "the seed 3",
        "specification",
        "docs/shared/x.md",
        "shared_memory/Notes.md",
        "the network/",
    ):
        assert not CITATION.search(line), line


def test_no_file_cites_a_document_the_reader_does_not_have():
    found = citations()
    assert not found, "\n".join(f"{name}:{line}" for name, lines in found.items() for line in lines)


def test_the_reference_checks_find_what_they_are_for():
    assert slug("Llama, Mistral, Qwen2 → DIFF V2 (exact upcycling)") == "llama-mistral-qwen2--diff-v2-exact-upcycling"
    assert slug("Continuous batching and paged attention: `generate_batch`") == (
        "continuous-batching-and-paged-attention-generate_batch"
    )
    assert slug("Updating a saved folder's code") == "updating-a-saved-folders-code"
    assert anchors("# A\n```bash\n# not a heading\n```\n## B\n## B\n") == {"a", "b", "b-1"}
    texts = {
        "docs/a.md": 'See docs/model.md, "Configuration", [the check](performance.md#the-gpu-check) and\n'
        "[a report](reports/) (history: `git show 3c6e660:docs/gone.md`).\n",
        "x.py": '# docs/model.md, "What it\n# computes" and docs/model.md#loading\n',
    }
    assert broken_references(texts) == []
    texts = {
        "docs/a.md": 'docs/gone.md, [x](model.md#no-such-heading), [y](nowhere.md) and docs/performance.md, "GDA"\n',
        "x.py": '"docs/model.md#nowhere"\n',
    }
    assert broken_references(texts) == [
        "docs/a.md:1: docs/gone.md does not exist",
        "docs/a.md:1: the link (model.md#no-such-heading) leads to no heading with that anchor",
        "docs/a.md:1: the link (nowhere.md) leads to no file",
        "docs/a.md: docs/performance.md has no heading holding the quoted section 'GDA'",
        "x.py:1: docs/model.md has no heading with the anchor #nowhere",
    ]


def test_every_docs_page_section_and_link_named_exists():
    """Pages, quoted sections and Markdown links, in every tracked text file but ``KEPT``. Nothing is excused: a page
    being written shows here until it is committed."""
    broken = broken_references(tracked_texts())
    assert not broken, f"{len(broken)} references lead nowhere:\n" + "\n".join(broken)
