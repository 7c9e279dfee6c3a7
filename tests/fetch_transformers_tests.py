"""Download transformers' common model tests for the installed transformers version, once, into a git-ignored cache.

The transformers sdist on PyPI ships the shared test mixins (``tests/test_modeling_common.py``,
``tests/test_training_mixin.py``, ...): ``pip download --no-binary :all: --no-deps transformers==<version>``, then
its ``tests/`` folder is extracted to ``.cache/transformers-tests/<version>/tests``. The extraction goes to a temporary
folder that is renamed into place only when complete, so an interrupted fetch never leaves a half-written cache.

    python tests/fetch_transformers_tests.py          # prints the cached folder (downloads it if needed)

``tests/models/test_transformers_common.py`` calls :func:`fetch` at collection time and skips, with the reason, when the
download is impossible (no network, no such sdist).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_ROOT = REPO_ROOT / ".cache" / "transformers-tests"
# The files the test module needs; their presence marks a complete cache.
REQUIRED = ("test_modeling_common.py", "test_training_mixin.py")


class FetchError(RuntimeError):
    """The tests could not be obtained (the message says why)."""


def cached_tests_dir(version: str) -> Path:
    return CACHE_ROOT / version / "tests"


def fetch(version: str | None = None, timeout: float = 300) -> Path:
    """The folder holding the ``tests/`` of the transformers ``version`` sdist (default: the installed version)."""
    if version is None:
        import transformers

        version = transformers.__version__
    dest = cached_tests_dir(version)
    if all((dest / name).is_file() for name in REQUIRED):
        return dest
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_ROOT, prefix=".fetch-") as tmp:
        download = Path(tmp) / "download"
        args = [
            "download",
            "--no-binary",
            ":all:",
            "--no-deps",
            "--disable-pip-version-check",
            f"transformers=={version}",
        ]
        shown = f"pip {' '.join(args)}"
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", *args, "-d", str(download)],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as err:
            raise FetchError(f"`{shown}` did not finish within {timeout:.0f} s") from err
        sdists = sorted(download.glob("transformers-*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            tail = " | ".join(line for line in (proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise FetchError(f"`{shown}` failed (exit {proc.returncode}): {tail}")
        prefix = f"transformers-{version}/tests/"
        extracted = Path(tmp) / "tests"
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            for member in members:
                member.name = member.name[len(prefix) :]
            tar.extractall(extracted, members=[m for m in members if m.name], filter="data")
        missing = [name for name in REQUIRED if not (extracted / name).is_file()]
        if missing:
            raise FetchError(f"the transformers {version} sdist has no tests/{', tests/'.join(missing)}")
        if dest.exists():  # an incomplete earlier copy, or a complete one another process just wrote
            if all((dest / name).is_file() for name in REQUIRED):
                return dest
            shutil.rmtree(dest)
        dest.parent.mkdir(exist_ok=True)
        extracted.rename(dest)
    return dest


if __name__ == "__main__":
    try:
        print(fetch(sys.argv[1] if len(sys.argv) > 1 else None))
    except FetchError as err:
        sys.exit(f"fetch_transformers_tests: {err}")
