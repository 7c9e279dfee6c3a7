"""docs/distributed.md stays true: its Python snippets run, its commands parse with the scripts they name.

The snippets run verbatim in a temporary folder holding tiny models (with tokenizers) at the paths the doc uses.
The multi-process commands are run for real, with the same scripts and test-sized arguments, by
tests/test_distributed.py; the lm-eval commands by tests/test_lm_eval.py.
"""

import contextlib
import importlib
import io
import json
import shlex

import pytest

from utils_distributed import DOC_MODEL_V1, DOC_MODEL_V2, REPO, doc_blocks, save_tiny_lm, word_tokenizer


def _snippet(keyword: str) -> str:
    return next(block for block in doc_blocks("python") if keyword in block)


@pytest.fixture
def doc_workdir(tmp_path, monkeypatch):
    """A folder with tiny V1 and V2 models (and tokenizers) where the doc expects the main job's outputs."""
    tokenizer = word_tokenizer(["def fibonacci(n): add(a, b): import os class Stack: return None"])
    save_tiny_lm(tmp_path / DOC_MODEL_V1, diff_version=1, tokenizer=tokenizer)
    save_tiny_lm(tmp_path / DOC_MODEL_V2, diff_version=2, tokenizer=tokenizer)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/distributed.md", "exec"), {"__name__": "__doc_snippet__"})
    return out.getvalue()


@pytest.mark.parametrize("model_path", [DOC_MODEL_V1, DOC_MODEL_V2])
def test_offload_snippet_runs(doc_workdir, model_path):
    code = _snippet("offload_folder").replace(DOC_MODEL_V1, model_path)
    printed = _run(code)
    assert "'disk'" in printed  # part of the model really is offloaded
    assert "def fibonacci(n):" in printed  # the prompt, followed by the generated text


@pytest.mark.parametrize("model_path", [DOC_MODEL_V1, DOC_MODEL_V2])
def test_continuous_batching_snippet_runs(doc_workdir, model_path):
    printed = _run(_snippet("generate_batch").replace(DOC_MODEL_V1, model_path))
    assert len(printed.strip().splitlines()) == 3  # one line per request


def test_deepspeed_config_is_valid_json():
    (config,) = doc_blocks("json")
    assert json.loads(config)["zero_optimization"]["stage"] == 3


def test_every_example_command_parses_with_its_script():
    """Each `torchrun`/`accelerate launch` line of the doc names an existing script and arguments it accepts."""
    commands = [
        line
        for block in doc_blocks("bash")
        for line in block.splitlines()
        if line.startswith(("torchrun ", "accelerate launch "))
    ]
    assert len(commands) >= 6
    for command in commands:
        argv = shlex.split(command)
        script = next(i for i, arg in enumerate(argv) if arg.startswith("examples/distributed/"))
        assert (REPO / argv[script]).is_file(), command
        module = importlib.import_module(argv[script].rsplit("/", 1)[-1].removesuffix(".py"))
        module.parse_args(argv[script + 1 :])  # SystemExit (argparse error) fails the test
