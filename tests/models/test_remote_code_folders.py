"""Saved folders keep working as remote code, and an outdated folder's code is refreshed by one command.

A folder written by ``save_pretrained``, by the converter or by the upcycling job carries the package's source files;
with ``trust_remote_code=True`` and without the package, transformers runs that copy. CI runs this module on the lowest,
the pinned and the newest transformers releases the package supports: on each, every kind of folder loads there and
its greedy output, with and without the cache, equals the package's.

``tests/assets/remote_code_0.1.0/`` holds the source files of release 0.1.0 (commit fe352af), which read the cache as
``past_key_values`` only: under transformers >= 5.24 a folder with that code decodes every step without its past.
``difftransformer-update-code FOLDER`` replaces them by the installed release's.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from difftransformer import DiffTransformerForCausalLM
from difftransformer.compat_difftransformer import CACHE_RENAMED
from difftransformer.convert import convert
from difftransformer.hub import SOURCE_FILES, main_update_code, update_remote_code
from difftransformer.testing_utils import tiny_config
from utils_remote_code import NEW_TOKENS, remote_generate, remote_generate_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ASSETS = Path(__file__).parents[1] / "assets" / "remote_code_0.1.0"
PACKAGE = Path(__file__).resolve().parents[2] / "difftransformer"


def package_greedy(folder: Path, ids: torch.Tensor) -> list:
    """The installed package's greedy tokens for the same folder (a loop of full forwards, no generate())."""
    model = DiffTransformerForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return ids[:, -NEW_TOKENS:].tolist()


def saved_folder(tmp_path, layout):
    torch.manual_seed(0)
    folder = tmp_path / layout
    DiffTransformerForCausalLM(tiny_config(layout)).save_pretrained(folder)
    return folder


def converted_folder(tmp_path, version):
    torch.manual_seed(1)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=97,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
        )
    )
    source = tmp_path / "llama"
    llama.save_pretrained(source)
    return Path(
        convert("llama", source, tmp_path / f"converted_v{version}", diff_version=version, progress=False).output
    )


def upcycled_folder(tmp_path):
    """The folder the upcycling job publishes (its smoke settings: a tiny random source, a few steps)."""
    from difftransformer.research import upcycle as up

    script = Path(__file__).resolve().parents[2] / "examples" / "upcycle.py"
    spec = importlib.util.spec_from_file_location("difftransformer_examples_upcycle", script)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    settings = up.UpcycleSettings(
        **{
            **cli.SMOKE_SETTINGS,
            "output_dir": str(tmp_path / "upcycle"),
            "progress": False,
            "diff_version": 2,
            "method": "full",
        }
    )
    up.run_upcycle(settings, source=up.smoke_source(), log=lambda *_: None)
    return tmp_path / "upcycle" / "model"


FOLDERS = {
    "save_pretrained_v1": lambda tmp: saved_folder(tmp, "v1_gqa"),
    "save_pretrained_v2": lambda tmp: saved_folder(tmp, "v2_gqa"),
    "converter_v1": lambda tmp: converted_folder(tmp, 1),
    "converter_v2": lambda tmp: converted_folder(tmp, 2),
    "upcycling_job_v2": upcycled_folder,
}


@pytest.fixture(scope="module")
def remote_results(tmp_path_factory):
    """kind → (folder, the package's greedy tokens, the folder's cached and uncached greedy tokens as remote code):
    every kind of folder built, then all loaded in one process without the package."""
    built = {}
    for kind, make in FOLDERS.items():
        folder = make(tmp_path_factory.mktemp(kind))
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        ids = torch.randint(3, vocab, (1, 7), generator=torch.Generator().manual_seed(4))
        built[kind] = (folder, ids, package_greedy(folder, ids))
    got = remote_generate_all([(folder, ids) for folder, ids, _ in built.values()], tmp_path_factory.mktemp("remote"))
    return {
        kind: (folder, expected, result)
        for (kind, (folder, _, expected)), result in zip(built.items(), got, strict=True)
    }


@pytest.mark.parametrize("kind", FOLDERS)
def test_saved_folders_generate_correctly_as_remote_code_without_the_package(remote_results, kind):
    folder, expected, got = remote_results[kind]
    for name in SOURCE_FILES:  # the folder carries exactly this release's code
        assert (folder / name).read_bytes() == (PACKAGE / name).read_bytes(), name
    # the Triton kernels stay in the package (difftransformer/kernels/triton/): no folder carries them
    assert not [p.name for p in folder.rglob("*") if "triton" in p.name.lower() or p.name == "kernels"], folder
    assert got["cached"] == expected and got["uncached"] == expected, (got, expected)


def test_update_code_command_refreshes_a_folder_saved_by_release_0_1_0(tmp_path, capsys):
    """A folder whose code is release 0.1.0's (before transformers 5.24 support): wrong cached decoding where the
    installed transformers renamed the cache argument; after `difftransformer-update-code`, right everywhere."""
    folder = saved_folder(tmp_path, "v2_gqa")
    for name in SOURCE_FILES:  # the folder holds 0.1.0's files only (later releases ship more)
        (folder / name).unlink()
    for path in ASSETS.glob("*.py"):
        shutil.copyfile(path, folder / path.name)
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(5))
    expected = package_greedy(folder, ids)
    before = remote_generate(folder, ids, tmp_path)
    assert before["uncached"] == expected
    if CACHE_RENAMED:  # what the update fixes: 0.1.0's code ignores the cache transformers now passes as `cache`
        assert before["cached"] != expected, before
    else:
        assert before["cached"] == expected

    assert main_update_code(["--check", str(folder)]) == 1  # the command's --check, in this process
    assert "modeling_difftransformer.py" in capsys.readouterr().out
    command = Path(sys.executable).parent / "difftransformer-update-code"
    assert command.is_file(), "the console script is installed with the package (pip install -e .)"
    run = subprocess.run([str(command), str(folder)], capture_output=True, text=True)
    assert run.returncode == 0 and "updated" in run.stdout, run.stdout + run.stderr
    assert update_remote_code(folder, check=True) == []
    after = remote_generate(folder, ids, tmp_path)
    assert after["cached"] == expected and after["uncached"] == expected, after


def test_update_code_refuses_a_folder_that_is_not_ours(tmp_path):
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=97,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    ).save_pretrained(tmp_path / "llama")
    before = sorted(os.listdir(tmp_path / "llama"))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        update_remote_code(tmp_path / "llama")
    assert sorted(os.listdir(tmp_path / "llama")) == before
