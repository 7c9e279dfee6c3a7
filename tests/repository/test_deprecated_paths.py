"""The research tools' old import paths (before difftransformer.research) keep working for one release: each warns
once, naming the new path, and is the moved module itself."""

import importlib
import subprocess
import sys

import pytest

MODULES = ("analysis", "probes", "lowbit", "retrieval_tasks", "telemetry", "data")
UPCYCLE = ("job", "data", "metrics", "plotting", "report", "source", "training")  # job first: it imports the package

# One fresh interpreter (in this session another test may have imported an old path already): every old module warns
# once, naming its new path, and is the moved module; the upcycle package warns once, for all its submodules.
CHECK = """
import importlib, warnings
MODULES, UPCYCLE = {modules!r}, {upcycle!r}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import difftransformer

    def imported(old, new):
        before = len(caught)
        moved = importlib.import_module(old)
        importlib.import_module(old)  # a second import is the cached module: no second warning
        assert moved is importlib.import_module(new), (moved, new)
        return [str(w.message) for w in caught[before:] if issubclass(w.category, FutureWarning)]

    for m in MODULES:
        mine = imported(f"difftransformer.{{m}}", f"difftransformer.research.{{m}}")
        assert len(mine) == 1 and f"difftransformer.research.{{m}} " in mine[0], (m, mine)
    for i, m in enumerate(UPCYCLE):
        mine = imported(f"difftransformer.upcycle.{{m}}", f"difftransformer.research.upcycle.{{m}}")
        assert len(mine) == (1 if i == 0 else 0), (m, mine)
        assert all("difftransformer.research.upcycle " in w for w in mine), (m, mine)
    package = importlib.import_module("difftransformer.upcycle")
    assert package is importlib.import_module("difftransformer.research.upcycle")
print("ok")
""".format(modules=MODULES, upcycle=UPCYCLE)


def test_old_paths_warn_once_naming_the_new_path_and_are_the_moved_modules():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_old_names_give_the_same_objects():
    with pytest.warns(FutureWarning):  # the first import in this session warns; a cached one does not
        importlib.import_module("difftransformer.upcycle")
    from difftransformer.analysis import attention_maps
    from difftransformer.research.analysis import attention_maps as moved_maps
    from difftransformer.research.upcycle.job import run_upcycle as moved_run
    from difftransformer.upcycle.job import run_upcycle

    assert attention_maps is moved_maps and run_upcycle is moved_run


def test_import_difftransformer_loads_no_research_module():
    code = "import difftransformer, sys; print([m for m in sys.modules if 'research' in m or m.endswith('upcycle')])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr[-2000:]
