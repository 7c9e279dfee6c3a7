"""How the test command (scripts/test.sh) lays out its four venvs on the disk it finds.

The four venvs take about 18 GB together (.venv-latest and .venv-min hold CUDA builds of torch). scripts/test.sh sets
up .venv-latest, .venv-min and .venv-vllm beside the pinned run, which needs all of them on the disk at once. A machine
with less free disk than that runs them one at a time instead: each is set up after the run before it, and removed
once its run is over, so that the disk holds at most .venv and one other. That costs the minutes of set-up the parallel
layout hides (about 15), and says so in CI's summary.

Prints one word, "parallel" or "sequential", and a line on standard error with the free space and what each layout
needs; exits 1, naming both, where not even the sequential layout fits. DIFFTRANSFORMER_CI_LAYOUT=parallel or
=sequential chooses instead of the free space.

    python3 scripts/ci_disk.py [ROOT]     (ROOT: the checkout; default: this file's)
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

# MB each venv takes once set up, rounded up from `du -sm` of CI's venvs at the pins of 2026-11-28 (3,310; 5,900;
# 5,595; 3,661). tests/repository/test_ci_disk.py checks .venv's against its real size.
VENV_MB = {".venv": 3600, ".venv-latest": 6300, ".venv-min": 6000, ".venv-vllm": 4000}
EXTRA = (".venv-latest", ".venv-min", ".venv-vllm")
# pip's downloads before it unpacks them (a CUDA build of torch is a wheel of about 0.9 GB; the parallel layout runs
# three pips at once), pytest's temporary folders and torch.compile's caches.
MARGIN_MB = 3000
LAYOUTS = ("parallel", "sequential")


def needs(present: set[str]) -> tuple[int, int]:
    """(parallel, sequential): MB of free disk each layout needs, where the venvs in `present` already exist."""
    missing = {name: mb for name, mb in VENV_MB.items() if name not in present}
    extra = [mb for name, mb in missing.items() if name in EXTRA]
    parallel = sum(missing.values()) + MARGIN_MB
    # Sequential: .venv, then one other at a time, each removed after its run (an existing one stays until then).
    sequential = missing.get(".venv", 0) + max(extra, default=0) + MARGIN_MB
    return parallel, sequential


def plan(free_mb: int, present: set[str]) -> str:
    """The layout that fits `free_mb`: "parallel" where everything fits at once, else "sequential"; ValueError where
    neither fits."""
    parallel, sequential = needs(present)
    if free_mb >= parallel:
        return "parallel"
    if free_mb >= sequential:
        return "sequential"
    raise ValueError(
        f"{free_mb / 1000:.1f} GB free on the checkout's disk; the tests' venvs need {parallel / 1000:.1f} GB set up "
        f"side by side, or {sequential / 1000:.1f} GB one at a time (scripts/ci_disk.py)"
    )


def _temp_disk(root: Path) -> str:
    """pip and pytest write to the temporary folder: its free space, where it is another disk than the checkout's."""
    temp = tempfile.gettempdir()
    if os.stat(temp).st_dev == os.stat(root).st_dev:
        return ""
    return f" (the temporary folder {temp}, another disk: {shutil.disk_usage(temp).free / 10**9:.1f} GB free)"


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parents[1])
    present = {name for name in VENV_MB if os.access(root / name / "bin" / "python", os.X_OK)}
    free_mb = shutil.disk_usage(root).free // 10**6
    chosen = os.environ.get("DIFFTRANSFORMER_CI_LAYOUT")
    if chosen is not None:
        if chosen not in LAYOUTS:
            print(
                f"ci_disk.py: DIFFTRANSFORMER_CI_LAYOUT={chosen!r}: allowed values are {', '.join(LAYOUTS)}",
                file=sys.stderr,
            )
            return 2
        print(
            f"ci_disk.py: {free_mb / 1000:.1f} GB free; {chosen} (DIFFTRANSFORMER_CI_LAYOUT){_temp_disk(root)}",
            file=sys.stderr,
        )
        print(chosen)
        return 0
    try:
        layout = plan(free_mb, present)
    except ValueError as error:
        print(f"ci_disk.py: {error}{_temp_disk(root)}", file=sys.stderr)
        return 1
    parallel, sequential = needs(present)
    print(
        f"ci_disk.py: {free_mb / 1000:.1f} GB free; the venvs need {parallel / 1000:.1f} GB side by side, "
        f"{sequential / 1000:.1f} GB one at a time: {layout}{_temp_disk(root)}",
        file=sys.stderr,
    )
    print(layout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
