"""The Triton kernels live in ``difftransformer.kernels.triton``, outside the flat model files: importing the model
does not load them, the remote code a folder carries names none of them, and the old module paths
(``difftransformer.triton_difftransformer``, ``difftransformer.triton_epilogue_difftransformer``) still import for one
release, with a FutureWarning naming the new path, re-exporting the same objects."""

import importlib
import subprocess
import sys

import pytest

from difftransformer.hub import SOURCE_FILES


def test_the_remote_code_files_hold_no_triton_kernel():
    assert SOURCE_FILES and not [name for name in SOURCE_FILES if "triton" in name], SOURCE_FILES


def test_importing_the_model_does_not_load_the_triton_kernels():
    code = (
        "import sys, difftransformer, difftransformer.modeling_difftransformer\n"
        "print(sorted(m for m in sys.modules if m.split('.')[:2] == ['difftransformer', 'kernels']"
        " or m.startswith('difftransformer.triton_')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out


@pytest.mark.parametrize(
    "old, new",
    [
        ("difftransformer.triton_difftransformer", "difftransformer.kernels.triton.attention"),
        ("difftransformer.triton_epilogue_difftransformer", "difftransformer.kernels.triton.epilogue"),
    ],
)
def test_old_paths_warn_and_reexport_the_new_names(monkeypatch, old, new):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(FutureWarning, match=r"difftransformer\.kernels\.triton"):
        module = importlib.import_module(old)
    moved = importlib.import_module(new)
    assert module.__all__ and set(moved.__all__) <= set(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is getattr(moved, name), name
