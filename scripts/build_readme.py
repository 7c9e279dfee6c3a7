"""Assemble README.md: the hand-written top part, then the sections kept in docs/*.md.

The docs files are the single source of each section: tests execute their examples as written. This script copies
them below the `<!-- SECTIONS -->` marker of README.md, demoting headings so that each file's title becomes a `##`
section. `--check` exits non-zero if README.md is not up to date (a test runs it).
"""

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- SECTIONS -->"
ORDER = ["ecosystem.md", "convert.md", "performance.md", "distributed.md", "analysis.md"]


def _demote(text: str) -> str:
    """Shift headings so that the file's top heading is `##`; code blocks are left alone."""
    lines, fence, out = text.splitlines(), False, []
    top = min((len(m.group(1)) for line in lines if (m := re.match(r"(#+) ", line))), default=2)
    for line in lines:
        if line.startswith("```"):
            fence = not fence
        if not fence and (m := re.match(r"(#+) ", line)):
            line = "#" * (len(m.group(1)) - top + 2) + line[len(m.group(1)) :]
        out.append(line)
    return "\n".join(out).strip() + "\n"


def build() -> str:
    head = (ROOT / "README.md").read_text(encoding="utf-8").split(MARKER)[0]
    sections = [_demote((ROOT / "docs" / name).read_text(encoding="utf-8")) for name in ORDER]
    return head + MARKER + "\n<!-- Generated from docs/*.md by scripts/build_readme.py: edit those files. -->\n\n" + "\n".join(sections)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that README.md is up to date")
    args = parser.parse_args(argv)
    text = build()
    current = (ROOT / "README.md").read_text(encoding="utf-8")
    if args.check:
        if current != text:
            print("README.md is out of date: run python scripts/build_readme.py", file=sys.stderr)
            return 1
        return 0
    (ROOT / "README.md").write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
