"""What every script in benchmarks/ shares: the clock, the statistics, the provenance of a result, and chart helpers.

* **Clock.** ``set_clock(name)`` picks what :func:`now` returns, for the whole process: ``wall`` (elapsed seconds),
  ``cpu`` (this process's CPU seconds: with one thread it leaves out the time other processes hold the core),
  ``thread`` (this thread's CPU seconds) or ``cuda`` (elapsed seconds after ``torch.cuda.synchronize()``: GPU work
  is asynchronous, so an unsynchronised clock would time the kernel launches).
* **Timing.** :func:`run_interleaved` takes callables that time themselves (they return seconds);
  :func:`time_interleaved` times plain callables, looping the short ones. Both warm every callable up, then run
  ``reps`` rounds over all of them with the order rotated by one each round, so that load from other processes hits
  all of them alike.
* **Statistics.** :func:`summarize` (median, spread = IQR / median, the samples), :func:`quartiles`,
  :func:`paired` (median and quartiles of the per-round ratios of two interleaved sample lists: a round in which the
  whole machine slows down cancels in its own ratio).
* **Provenance.** :func:`provenance` returns the git commit (and whether the working tree differed from it, and in
  which files), the command line, the machine (CPU model, its AVX2 / AVX-512 / AMX flags, its cores), the Python,
  torch and transformers versions and the UTC time; :func:`write_json` writes a result with it. ``MEASURED_CODE``
  names, per script, the code whose change makes its results stale (tests/test_doc_numbers.py reads it).
* **Charts.** :func:`pyplot` (matplotlib with the Agg backend) and :func:`save_figure`.

Nothing here imports torch or transformers at module level: provenance works where they are absent.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------------------------------------------
# Clock
# ----------------------------------------------------------------------------------------------------------------


def _cuda_synchronized_clock() -> float:
    import torch

    torch.cuda.synchronize()
    return time.perf_counter()


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time,
                                          "thread": time.thread_time, "cuda": _cuda_synchronized_clock}
_clock: Callable[[], float] = time.perf_counter


def set_clock(name: str) -> None:
    """Every later :func:`now` (and so every timing of the benchmarks) reads clock ``name`` (one of ``CLOCKS``)."""
    global _clock
    if name not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {name!r}")
    _clock = CLOCKS[name]


def now() -> float:
    """Seconds on the clock :func:`set_clock` chose (``wall`` until then)."""
    return _clock()


# ----------------------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------------------


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """First and third quartiles of ``values`` (``statistics.quantiles``' default method); their minimum and
    maximum below 4 values."""
    values = list(values)
    if len(values) < 4:
        return min(values), max(values)
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3


def summarize(samples: Sequence[float]) -> dict:
    """``{"median", "spread", "samples"}``: spread is IQR / median ((max − min) / median below 4 samples; 0 for one)."""
    samples = list(samples)
    med = statistics.median(samples)
    q1, q3 = quartiles(samples)
    spread = (q3 - q1) / med if len(samples) > 1 and med else 0.0
    return {"median": med, "spread": spread, "samples": samples}


def call_stats(samples: Sequence[float]) -> dict:
    """The micro-benchmarks' per-call statistics: ``{"median_s", "iqr" (the spread of :func:`summarize`), "min_s",
    "n"}``."""
    stats = summarize(samples)
    return {"median_s": stats["median"], "iqr": stats["spread"], "min_s": min(stats["samples"]), "n": len(samples)}


def paired(samples: Sequence[float], base: Sequence[float]) -> tuple[float, list[float]]:
    """Median and [first, third] quartiles of the per-round ratios ``samples[i] / base[i]``."""
    if len(samples) != len(base) or not samples:
        raise ValueError(f"paired ratios need two equally long, non-empty sample lists ({len(samples)}, {len(base)})")
    ratios = [x / y for x, y in zip(samples, base)]
    return statistics.median(ratios), list(quartiles(ratios))


# ----------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------


def _rotations(names: list[str], reps: int):
    for rep in range(reps):
        yield rep, names[rep % len(names):] + names[: rep % len(names)]


def run_interleaved(runs: dict[str, Callable[[], float]], reps: int, warmup: int, progress=None) -> dict[str, dict]:
    """Warm every run up ``warmup`` times, then ``reps`` rounds over all of them, the order rotated by one each round.
    Each run times itself (returns its seconds). Returns :func:`summarize` per name; ``progress`` (a tqdm bar) gets
    one update per run."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _, order in _rotations(list(runs), reps):
        for name in order:
            samples[name].append(runs[name]())
            if progress is not None:
                progress.update(1)
    return {name: summarize(s) for name, s in samples.items()}


def _calls_per_sample(fn: Callable[[], object], min_seconds: float) -> int:
    """Calls per timing sample so that one sample lasts at least ``min_seconds`` (small decode calls take µs)."""
    start = now()
    fn()
    once = max(now() - start, 1e-7)
    return max(1, math.ceil(min_seconds / once))


def time_interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 1, min_seconds: float = 0.02,
                     progress=None) -> dict[str, list[float]]:
    """Seconds per call of every function, ``reps`` samples each, the order rotated each round; a function faster
    than ``min_seconds`` is called several times per sample. ``progress`` gets one update per round."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    inner = {name: _calls_per_sample(fn, min_seconds) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _, order in _rotations(list(fns), reps):
        for name in order:
            start = now()
            for _ in range(inner[name]):
                fns[name]()
            samples[name].append((now() - start) / inner[name])
        if progress is not None:
            progress.update(1)
    return samples


# ----------------------------------------------------------------------------------------------------------------
# Provenance
# ----------------------------------------------------------------------------------------------------------------

# The code each script's results measure: a commit that changes one of these after the result's commit makes the
# result stale (tests/test_doc_numbers.py). The package's model code, the script and what it imports of benchmarks/.
_MODEL = ["difftransformer/modeling_difftransformer.py", "difftransformer/kernels_difftransformer.py",
          "difftransformer/configuration_difftransformer.py"]
_BENCH = ["benchmarks/bench.py", "benchmarks/padded_sdpa.py", "benchmarks/harness.py"]
MEASURED_CODE: dict[str, list[str]] = {
    "bench.py": _MODEL + _BENCH,
    "decode_parts.py": _MODEL + _BENCH + ["benchmarks/decode_parts.py"],
    "bench_gda.py": _MODEL + _BENCH + ["benchmarks/bench_gda.py", "difftransformer/convert/gda.py"],
    "bench_gda_vllm": _MODEL + ["benchmarks/bench_gda.py", "benchmarks/bench_vllm.py", "benchmarks/harness.py",
                                "difftransformer/convert/gda.py", "difftransformer/vllm_model.py",
                                "difftransformer/vllm_plugin.py"],  # bench_gda.py --vllm
    "profile_train.py": _MODEL + _BENCH + ["benchmarks/profile_train.py"],
    "attention_micro.py": _MODEL + ["benchmarks/attention_micro.py", "benchmarks/harness.py"],
    "v2_prompt_attention.py": _MODEL + ["benchmarks/v2_prompt_attention.py", "benchmarks/attention_micro.py",
                                        "benchmarks/harness.py"],
    "gpu_check.py": _MODEL + _BENCH + ["benchmarks/gpu_check.py", "difftransformer/testing_utils.py"],
    "bench_vllm.py": _MODEL + ["difftransformer/vllm_model.py", "difftransformer/vllm_plugin.py",
                               "benchmarks/bench_vllm.py", "benchmarks/harness.py", "examples/serve_smollm2.py"],
    "compare_small.py": _MODEL + ["benchmarks/compare_small.py", "difftransformer/probes.py",
                                  "difftransformer/analysis.py", "difftransformer/data.py"],
    "compare_upcycled.py": _MODEL + ["benchmarks/compare_upcycled.py", "difftransformer/upcycle.py",
                                     "difftransformer/upcycle", "difftransformer/probes.py", "difftransformer/data.py"],
    "upcycle": _MODEL + ["difftransformer/upcycle.py", "difftransformer/upcycle", "difftransformer/convert",
                         "difftransformer/data.py"],  # upcycle.py until it became the package upcycle/
    "measure_v1_init.py": _MODEL + ["convert_scripts/measure_v1_init.py", "difftransformer/convert",
                                    "difftransformer/data.py"],
}

# /proc/cpuinfo flags that decide which CPU kernels torch runs (bf16 and int8 matmuls, vector width).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_int8")


def cpu_info() -> dict:
    """CPU model, which of ``CPU_FLAGS`` it has, logical CPUs and the ones this process may run on."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {"cpu": model, "cpu_flags": [f for f in CPU_FLAGS if f in flags], "logical_cpus": os.cpu_count(),
            "usable_cpus": usable}


def machine_info(threads: int | None = None) -> dict:
    """:func:`cpu_info` with torch's CPU capability (the vector unit its kernels use), the versions, the load average
    and ``threads`` (torch's thread count, where given): the ``machine`` entry of the results."""
    import torch
    import transformers

    info = cpu_info() | {"torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                         "load_avg_start": os.getloadavg()}
    if threads is not None:
        info["threads"] = threads
    return info


def measured_code_changes(commit: str, script: str, root: str = ROOT, first: bool = False) -> list[str]:
    """The commits after ``commit`` (reachable from HEAD, not from ``commit``), oldest first, that changed the code
    ``script``'s results measure (``MEASURED_CODE``): empty while a result of ``commit`` is current. A commit that
    changed only comments and docstrings of those files changed no code and does not count. ``first``: only the first
    such commit (what a document names), without reading the later ones. Raises
    ``subprocess.CalledProcessError`` where ``commit`` is not in this repository's history."""
    paths = MEASURED_CODE[script]
    commits = _git("log", "--format=%H", "--reverse", f"{commit}..HEAD", "--", *paths, root=root).split()
    changes = []
    for c in commits:
        if _changes_code(c, tuple(paths), root):
            changes.append(c)
            if first:
                break
    return changes


def _code_of(text: str | None, path: str) -> str | None:
    """What of a file's text can change a measurement: a Python file's syntax tree without docstrings (comments are
    not in it), any other file's text."""
    if text is None or not path.endswith(".py"):
        return text
    import ast

    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


@functools.lru_cache(maxsize=None)  # a commit never changes: one answer per (commit, paths, repository)
def _changes_code(commit: str, paths: tuple[str, ...], root: str) -> bool:
    """Whether ``commit`` changed more than comments and docstrings in any of ``paths``."""
    changed = _git("diff-tree", "--no-commit-id", "--name-only", "-r", f"{commit}^", commit, "--", *paths, root=root).split()
    for path in changed:
        before, after = (_show(f"{rev}:{path}", root) for rev in (f"{commit}^", commit))
        if _code_of(before, path) != _code_of(after, path):
            return True
    return False


def _show(spec: str, root: str) -> str | None:
    try:
        return _git("show", spec, root=root)
    except subprocess.CalledProcessError:
        return None  # the file does not exist at that revision


def _git(*args: str, root: str = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=20, check=True).stdout


def git_state(root: str = ROOT) -> tuple[str, bool | str, list[str]]:
    """(commit, dirty, the tracked files that differ from it). ``GIT_COMMIT`` / ``GIT_DIRTY`` from the environment
    where set (a copy without .git, such as the GPU machine's), else git's answer, else
    ``("unknown", "unknown", [])``."""
    commit = os.environ.get("GIT_COMMIT")
    if commit:
        dirty = os.environ.get("GIT_DIRTY", "unknown")
        return commit, {"1": True, "true": True, "0": False, "false": False}.get(str(dirty).lower(), dirty), []
    try:
        commit = _git("rev-parse", "HEAD", root=root).strip()
        status = _git("status", "--porcelain", "--untracked-files=no", root=root)
    except (OSError, subprocess.SubprocessError):
        return "unknown", "unknown", []
    files = [line[3:] for line in status.splitlines() if line.strip()]
    return commit, bool(files), files


def source_digest(root: str = ROOT) -> str:
    """SHA-256 (16 hex digits) of the package's Python sources, paths and contents: names the code that ran where no
    .git came along."""
    h = hashlib.sha256()
    pkg = os.path.join(root, "difftransformer")
    for folder, _, files in sorted(os.walk(pkg)):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read() + b"\0")
    return h.hexdigest()[:16]


# Environment variables that change what a run measures without changing its arguments (the memory allocator: glibc's
# malloc tunables, or a preloaded allocator): those set when the benchmark started lead its recorded command. Read at
# import, before the benchmark imports libraries that set some of them for themselves (vLLM's CPU platform preloads
# libgomp).
MEASURED_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES", "LD_PRELOAD")


def measured_env(environ=os.environ) -> dict[str, str]:
    """The ``MEASURED_ENV`` variables set in ``environ``."""
    return {name: environ[name] for name in MEASURED_ENV if environ.get(name)}


STARTUP_ENV = measured_env()


def command_line(argv: Sequence[str] | None = None, script: str | None = None, env: dict[str, str] | None = None) -> str:
    """The command as a user would type it from the repository root: ``python <script> <argv>``, after the
    ``MEASURED_ENV`` variables ``env`` holds (default: those set at start, ``STARTUP_ENV``) as ``NAME=value``."""
    script = script or sys.argv[0]
    if os.path.isabs(script) and script.startswith(ROOT + os.sep):
        script = os.path.relpath(script, ROOT)
    args = list(sys.argv[1:] if argv is None else argv)
    env = STARTUP_ENV if env is None else env
    return " ".join([f"{name}={shlex.quote(value)}" for name, value in env.items()]
                    + [shlex.join(["python", script, *args])])


def _versions() -> dict:
    versions = {"python": platform.python_version()}
    for package in ("torch", "transformers"):
        module = sys.modules.get(package)
        if module is None:
            try:
                module = __import__(package)
            except ImportError:
                module = None
        versions[package] = getattr(module, "__version__", None)
    return versions


def provenance(script: str, argv: Sequence[str] | None = None) -> dict:
    """Where a result comes from: ``script`` (its file name in benchmarks/ or convert_scripts/, a key of
    ``MEASURED_CODE``), the git commit, whether the tracked files differed from it and which, the command line, the
    machine, the versions and the UTC time."""
    commit, dirty, dirty_files = git_state()
    path = next((p for p in (f"benchmarks/{script}", f"convert_scripts/{script}")
                 if os.path.exists(os.path.join(ROOT, p))), script)
    utc = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"script": script, "commit": commit, "dirty": dirty, "dirty_files": dirty_files,
            "command": command_line(argv, path), "machine": cpu_info(), "versions": _versions(),
            "source_digest": source_digest(), "utc": utc}


def write_json(path: str | os.PathLike, report: dict, script: str, argv: Sequence[str] | None = None,
               indent: int = 1) -> dict:
    """Write ``report`` with its ``provenance`` (:func:`provenance`, unless it already has one) to ``path``, making
    the folder; returns the report as written."""
    report = report if "provenance" in report else report | {"provenance": provenance(script, argv)}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=indent)
    return report


# ----------------------------------------------------------------------------------------------------------------
# Charts
# ----------------------------------------------------------------------------------------------------------------


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, dpi: int = 110) -> None:
    """Save ``fig`` as a PNG at ``path`` (making the folder) and close it."""
    plt = pyplot()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
