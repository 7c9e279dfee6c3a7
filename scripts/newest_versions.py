"""The newest releases pyproject.toml allows, as pip's dry run resolved them (``pip install --dry-run --report``),
against the pins of requirements-dev.txt (what the pinned run installs).

    python3 scripts/newest_versions.py REPORT.json

Prints the resolved versions in the CI summary's format (``torch X | transformers Y | ...``); exits 0 where every one
of them is the pinned version (the pinned run then covered them), 4 where only torch differs (the registry's newest
torch, a CUDA build, against the CPU wheel pinned: the newest run installs it and runs the core suite), 3 where another
one differs (the newest run installs them and runs its larger set: scripts/setup_latest.sh), 2 where the report lacks
one.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "transformers", "peft", "accelerate", "huggingface_hub", "tokenizers", "safetensors")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolved(report: dict) -> dict[str, str]:
    """name → version of every package the dry run would install."""
    return {normalize(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}


def pinned() -> dict[str, str]:
    found = {}
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([0-9][^\s#]*)", line.strip())
        if match:
            found[normalize(match[1])] = match[2]
    return found


def compare(report: dict) -> tuple[str, int]:
    """(the versions line, exit code)."""
    versions, pins = resolved(report), pinned()
    missing = [name for name in PACKAGES if normalize(name) not in versions]
    if missing:
        return f"the dry run resolved no {', '.join(missing)}", 2
    line = " | ".join(f"{name} {versions[normalize(name)]}" for name in PACKAGES)
    differ = [name for name in PACKAGES if versions[normalize(name)].split("+")[0] != pins.get(normalize(name))]
    return line, 0 if not differ else 4 if differ == ["torch"] else 3


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    line, code = compare(json.loads(Path(argv[0]).read_text()))
    print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
