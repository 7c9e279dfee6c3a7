"""What every script in benchmarks/ shares: the clock, the statistics, the provenance of a result, and chart helpers.

* **Clock.** ``set_clock(name)`` picks what :func:`now` returns, for the whole process: ``wall`` (elapsed seconds),
  ``cpu`` (this process's CPU seconds: with one thread it leaves out the time other processes hold the core),
  ``thread`` (this thread's CPU seconds) or ``cuda`` (elapsed seconds after ``torch.cuda.synchronize()``: GPU work
  is asynchronous, so an unsynchronised clock would time the kernel launches).
* **Timing.** :func:`interleave` is the one timing loop: warm-ups, then ``reps`` rounds over every run with the
  order rotated by one each round, so that load from other processes hits all of them alike;
  :func:`run_interleaved` summarizes runs that time themselves (they return seconds).
* **Statistics.** :func:`summarize` (median, spread = IQR / median, the samples), :func:`quartiles`,
  :func:`paired` (median and quartiles of the per-round ratios of two interleaved sample lists: a round in which the
  whole machine slows down cancels in its own ratio).
* **The code a result ran.** :func:`trace_code` records the repository functions that run (``interleave`` traces one
  untimed call of each run), :func:`code_record` digests them, :func:`code_changes` says which of them differ in a
  checkout: a result is stale exactly when one does (see "The code a result ran" below).
* **Provenance.** :func:`provenance` returns the git commit (and whether the working tree differed from it, and in
  which files), the command line, the machine (CPU model, its AVX2 / AVX-512 / AMX flags, its cores), the Python,
  torch and transformers versions, the UTC time and the code record; :func:`write_json` writes a result with it.
* **Charts.** :func:`pyplot` (matplotlib with the Agg backend) and :func:`save_figure`.

Nothing here imports torch or transformers at module level: provenance works where they are absent.
"""

from __future__ import annotations

import datetime
import hashlib
import json
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


CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    "cpu": time.process_time,
    "thread": time.thread_time,
    "cuda": _cuda_synchronized_clock,
}
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


def paired(samples: Sequence[float], base: Sequence[float]) -> tuple[float, list[float]]:
    """Median and [first, third] quartiles of the per-round ratios ``samples[i] / base[i]``."""
    if len(samples) != len(base) or not samples:
        raise ValueError(f"paired ratios need two equally long, non-empty sample lists ({len(samples)}, {len(base)})")
    ratios = [x / y for x, y in zip(samples, base)]
    return statistics.median(ratios), list(quartiles(ratios))


# ----------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------


def interleave(
    runs: dict[str, Callable[[], object]],
    reps: int,
    warmup: int = 1,
    progress=None,
    new_round: Callable[[int], object] | None = None,
    trace: bool = True,
) -> dict[str, list]:
    """The one timing loop of the benchmarks: ``warmup`` calls of every run, then ``reps`` rounds over all of them,
    the order rotated by one each round, so that load from other processes hits every run alike. Returns, per name,
    what each timed call returned (seconds for a run that times itself; any value, e.g. a dict, otherwise).

    ``trace``: first, one untimed call of every run under :func:`trace_code` with torch.compile off
    (``torch.compiler.set_stance("force_eager")``: compiled code hides the Python it inlined), which records the
    repository code the run executes for its result's provenance (:func:`code_record`); the warm-ups and the timed
    rounds run untraced. ``new_round(rep)`` is called before each round (e.g. to draw that round's prompts);
    ``progress`` (a tqdm bar) gets one update per timed call."""
    if trace:
        for run in runs.values():
            with trace_code(), _eager():
                run()
    with _untraced():
        for run in runs.values():
            for _ in range(warmup):
                run()
        samples: dict[str, list] = {name: [] for name in runs}
        names = list(runs)
        for rep in range(reps):
            if new_round is not None:
                new_round(rep)
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                samples[name].append(runs[name]())
                if progress is not None:
                    progress.update(1)
    return samples


def run_interleaved(
    runs: dict[str, Callable[[], float]], reps: int, warmup: int, progress=None, trace: bool = True
) -> dict[str, dict]:
    """:func:`interleave` over runs that time themselves (each returns its seconds): :func:`summarize` per name."""
    samples = interleave(runs, reps, warmup, progress, trace=trace)
    return {name: summarize(s) for name, s in samples.items()}


def _eager():
    """torch.compile off (``force_eager``) where torch is imported and has stances; else nothing."""
    import contextlib

    torch = sys.modules.get("torch")
    stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------------------
# The code a result ran
# ----------------------------------------------------------------------------------------------------------------

# A result is stale when the code it ran has changed since, and only then. What it ran is recorded at run time:
# :func:`trace_code` notes every function of the repository (these folders) that starts executing, and
# :func:`code_record` stores a digest of each: of its syntax tree without docstrings (comments are not in it), so that
# a reworded comment changes nothing and a renamed variable does. A function is named by its file and its top-level
# definition (``file.py:function`` or ``file.py:Class.method``; nested functions, lambdas and comprehensions count as
# part of the function that defines them), with its context in that file (:func:`with_context`): its class's other
# statements, the module-level assignments it reads, the file's other module-level statements. :func:`code_changes`
# compares such a record with the code of a checkout: no git history is needed. What is outside: the Python a traced
# function calls in other packages (their versions are recorded), and code that runs in another process (vLLM's
# engine: its benchmarks record whole modules instead, :func:`module_record`).
CODE_FOLDERS = ("difftransformer", "benchmarks", "examples", "convert_scripts")
EXECUTED: dict[str, set[int]] = {}  # path (relative to ROOT) -> first lines of the code objects that ran there
_SOURCES: dict[str, str] = {}  # path -> its text when a trace first met it (what ran, even if edited later)
# This file is not traced: the clock, the loop and the tracer decide how a result is measured, not what it measures
# (a change to the loop reaches every benchmark's next run, not the meaning of a recorded result).
_SELF = os.path.join("benchmarks", "harness.py")


def _profile(frame, event, arg):
    if event != "call":
        return
    code = frame.f_code
    path = code.co_filename
    if not path.startswith(ROOT):
        return
    rel = os.path.relpath(path, ROOT)
    if rel.split(os.sep, 1)[0] not in CODE_FOLDERS or not rel.endswith(".py") or rel == _SELF:
        return
    lines = EXECUTED.get(rel)
    if lines is None:
        lines = EXECUTED[rel] = set()
        try:
            with open(path, encoding="utf-8") as f:
                _SOURCES[rel] = f.read()
        except OSError:
            pass
    lines.add(code.co_firstlineno)


class trace_code:
    """Context manager: record (in ``EXECUTED``) every repository function that starts running inside it, in this
    thread and in threads started inside it. Nestable; costs a Python call per function call, so benchmarks trace
    one untimed call (:func:`interleave` does), never the timed ones."""

    def __enter__(self):
        import threading

        self._saved = (sys.getprofile(), threading.getprofile() if hasattr(threading, "getprofile") else None)
        sys.setprofile(_profile)
        threading.setprofile(_profile)
        return self

    def __exit__(self, *exc):
        import threading

        sys.setprofile(self._saved[0])
        threading.setprofile(self._saved[1])
        return False


class _untraced:
    """Inside a trace: nothing is recorded (timed calls must not pay for the profiler)."""

    def __enter__(self):
        import threading

        self._saved = (sys.getprofile(), threading.getprofile() if hasattr(threading, "getprofile") else None)
        sys.setprofile(None)
        threading.setprofile(None)
        return self

    def __exit__(self, *exc):
        import threading

        sys.setprofile(self._saved[0])
        threading.setprofile(self._saved[1])
        return False


def _strip_docstrings(tree):
    import ast

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return tree


def _digest(node) -> str:
    import ast

    return hashlib.sha256(ast.dump(node).encode()).hexdigest()[:12]


def definitions(text: str) -> dict[str, tuple[int, int, str, frozenset]]:
    """A Python file's top-level definitions: name → (first line, last line, digest of the code without docstrings, the
    names it reads). Names: ``function``, ``Class.method``, ``Class.<class>`` (a class's statements outside its
    methods), ``<module>.NAME`` (a module-level assignment to NAME) and ``<module>`` (the other module-level
    statements, imports aside). A function's first line is that of its first decorator, as Python's code objects
    count it. A file that does not parse: one entry, ``<module>``, of its text."""
    import ast
    import copy

    try:
        tree = _strip_docstrings(ast.parse(text))
    except SyntaxError:
        return {"<module>": (0, 0, hashlib.sha256(text.encode()).hexdigest()[:12], frozenset())}
    defs: dict[str, tuple[int, int, str, frozenset]] = {}
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)

    def entry(node, first=None):
        reads = frozenset(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) if first is None else first
        return (start, getattr(node, "end_lineno", start), _digest(node), reads)

    module = []
    for node in tree.body:
        if isinstance(node, functions):
            defs[node.name] = entry(node)
        elif isinstance(node, ast.ClassDef):
            rest = copy.copy(node)
            rest.body = []
            for item in node.body:
                if isinstance(item, functions):
                    defs[f"{node.name}.{item.name}"] = entry(item)
                else:
                    rest.body.append(item)
            defs[f"{node.name}.<class>"] = entry(rest)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            for name in names:
                defs[f"<module>.{name}"] = entry(node, 0)
            if not names:
                module.append(node)
        elif not isinstance(node, (ast.Import, ast.ImportFrom)):
            module.append(node)
    defs["<module>"] = entry(ast.Module(body=module, type_ignores=[]), 0)
    return defs


def _names_at(defs: dict[str, tuple], lines: set[int]) -> set[str]:
    """The functions and methods whose code starts at, or contains, one of ``lines`` (nested code belongs to its
    definition)."""
    spans = sorted(
        (d[0], d[1], name)
        for name, d in defs.items()
        if not name.startswith("<module>") and not name.endswith(".<class>")
    )
    found = set()
    for line in lines:
        inside = [name for a, b, name in spans if a <= line <= b]
        if inside:
            found.add(min(inside, key=lambda n: defs[n][1] - defs[n][0]))  # the innermost: a method, not its class
    return found


def with_context(defs: dict[str, tuple], names: set[str]) -> set[str]:
    """``names`` (functions and methods of one file) with what they depend on in that file besides other functions:
    their classes' ``<class>`` entries, the module-level assignments they read (and those these read), and the
    file's other module-level statements (``<module>``: registrations, conditional definitions)."""
    found = set(names) | {n.split(".")[0] + ".<class>" for n in names if "." in n and not n.startswith("<module>")}
    found.add("<module>")
    todo = list(found)
    while todo:
        name = todo.pop()
        for read in defs.get(name, (0, 0, "", frozenset()))[3]:
            constant = f"<module>.{read}"
            if constant in defs and constant not in found:
                found.add(constant)
                todo.append(constant)
    return {n for n in found if n in defs}


def code_record(executed: dict[str, set[int]] | None = None, sources: dict[str, str] | None = None) -> dict:
    """``{"how": "traced", "digests": {"file.py:name": digest}}`` of the code :func:`trace_code` saw run (default: all
    traces of this process), each function with its context (:func:`with_context`). ``how`` is ``"not traced"``
    (and ``digests`` empty) where nothing was traced."""
    executed = EXECUTED if executed is None else executed
    sources = _SOURCES if sources is None else sources
    digests = {}
    for path, lines in sorted(executed.items()):
        text = sources.get(path)
        if text is None:
            text = _read(path)
            if text is None:
                continue
        defs = definitions(text)
        names = _names_at(defs, lines)
        if names:
            digests.update({f"{path}:{n}": defs[n][2] for n in sorted(with_context(defs, names))})
    return {"how": "traced" if digests else "not traced", "digests": digests}


def module_record(paths: Sequence[str], read: Callable[[str], str | None] | None = None, how: str = "modules") -> dict:
    """A record of whole files (every definition of each): for code a trace cannot see, such as vLLM's engine
    process. ``read(path)`` gives a file's text (default: the working tree's)."""
    read = read or _read
    digests = {}
    for path in paths:
        text = read(path)
        if text is None:
            digests[f"{path}:<module>"] = None
            continue
        digests.update({f"{path}:{name}": d[2] for name, d in definitions(text).items()})
    return {"how": how, "digests": digests}


def _read(path: str, root: str = ROOT) -> str | None:
    try:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def code_changes(record: dict | None, root: str = ROOT) -> list[str] | None:
    """The entries of a :func:`code_record` whose code differs in the checkout at ``root`` (changed, or gone): empty
    while the result is current; ``None`` where the record holds no digests (the run recorded none: unknown)."""
    if not record or not record.get("digests"):
        return None
    texts: dict[str, dict] = {}
    changed = []
    for key, digest in record["digests"].items():
        path, name = key.rsplit(":", 1)
        if path not in texts:
            text = _read(path, root)
            texts[path] = definitions(text) if text is not None else {}
        now = texts[path].get(name)
        if digest is None or now is None or now[2] != digest:
            changed.append(key)
    return changed


def package_imports(module_path: str, read: Callable[[str], str | None] | None = None) -> list[str]:
    """``module_path`` and every file of the package it imports, transitively (relative imports and
    ``difftransformer.…`` ones), as paths: the modules a process that imports it loads from the repository."""
    import ast

    read = read or _read
    seen, todo = [], [module_path]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        text = read(path)
        if text is None:
            continue
        seen.append(path)
        package = os.path.dirname(path)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package
                    for _ in range(node.level - 1):
                        base = os.path.dirname(base)
                    mod = os.path.join(base, *node.module.split(".")) if node.module else base
                    targets = [mod] + [os.path.join(mod, a.name) for a in node.names]
                elif node.module and node.module.split(".")[0] == "difftransformer":
                    mod = os.path.join(*node.module.split("."))
                    targets = [mod] + [os.path.join(mod, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [
                    os.path.join(*a.name.split(".")) for a in node.names if a.name.split(".")[0] == "difftransformer"
                ]
            for target in targets:
                for candidate in (target + ".py", os.path.join(target, "__init__.py")):
                    if read(candidate) is not None and candidate not in seen:
                        todo.append(candidate)
    return sorted(seen)


# ----------------------------------------------------------------------------------------------------------------
# Provenance
# ----------------------------------------------------------------------------------------------------------------

# /proc/cpuinfo flags that decide which CPU kernels torch runs (bf16 and int8 matmuls, vector width).
CPU_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


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
    return {
        "cpu": model,
        "cpu_flags": [f for f in CPU_FLAGS if f in flags],
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
    }


def machine_info(threads: int | None = None) -> dict:
    """:func:`cpu_info` with torch's CPU capability (the vector unit its kernels use), the versions, the load average
    and ``threads`` (torch's thread count, where given): the ``machine`` entry of the results."""
    import torch
    import transformers

    info = cpu_info() | {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_avg_start": os.getloadavg(),
    }
    if threads is not None:
        info["threads"] = threads
    return info


def git_reader(rev: str, root: str = ROOT) -> Callable[[str], str | None]:
    """``read(path)``: the file's text at commit ``rev`` of this repository (None where it did not exist)."""
    return lambda path: _show(f"{rev}:{path}", root)


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


def command_line(
    argv: Sequence[str] | None = None, script: str | None = None, env: dict[str, str] | None = None
) -> str:
    """The command as a user would type it from the repository root: ``python <script> <argv>``, after the
    ``MEASURED_ENV`` variables ``env`` holds (default: those set at start, ``STARTUP_ENV``) as ``NAME=value``."""
    script = script or sys.argv[0]
    if os.path.isabs(script) and script.startswith(ROOT + os.sep):
        script = os.path.relpath(script, ROOT)
    args = list(sys.argv[1:] if argv is None else argv)
    env = STARTUP_ENV if env is None else env
    return " ".join(
        [f"{name}={shlex.quote(value)}" for name, value in env.items()] + [shlex.join(["python", script, *args])]
    )


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


def provenance(script: str, argv: Sequence[str] | None = None, code: dict | None = None) -> dict:
    """Where a result comes from: ``script`` (its file name in benchmarks/ or convert_scripts/), the git commit,
    whether the tracked files differed from it and which, the command line, the machine, the versions, the UTC time
    and ``code``: the code the run executed (default: :func:`code_record` of this process's traces)."""
    commit, dirty, dirty_files = git_state()
    path = next(
        (p for p in (f"benchmarks/{script}", f"convert_scripts/{script}") if os.path.exists(os.path.join(ROOT, p))),
        script,
    )
    utc = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {
        "script": script,
        "commit": commit,
        "dirty": dirty,
        "dirty_files": dirty_files,
        "command": command_line(argv, path),
        "machine": cpu_info(),
        "versions": _versions(),
        "source_digest": source_digest(),
        "utc": utc,
        "code": code if code is not None else code_record(),
    }


def write_json(
    path: str | os.PathLike,
    report: dict,
    script: str,
    argv: Sequence[str] | None = None,
    indent: int = 1,
    code: dict | None = None,
) -> dict:
    """Write ``report`` with its ``provenance`` (:func:`provenance` with ``code``, unless it already has one) to
    ``path``, making the folder; returns the report as written."""
    report = report if "provenance" in report else report | {"provenance": provenance(script, argv, code)}
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
