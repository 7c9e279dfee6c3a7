"""Damaged input files get a one-line error naming the file and what is wrong, exit code 2 from the command line, and
leave no output or temporary folder behind (docs/convert.md: damaged input files)."""

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from difftransformer.convert import ConversionError, convert
from utils_cli import own_stderr_lines
from utils_gguf import write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one thread for these tests, not for the whole session
REPO = Path(__file__).resolve().parents[2]


def _llama_folder(folder: Path) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def truncated_safetensors(src: Path):
    weights = _llama_folder(src) / "model.safetensors"
    _truncate(weights, weights.stat().st_size // 2)
    return src, weights, r"is not a readable safetensors file \(truncated or damaged\): .*incomplete metadata"


def random_safetensors(src: Path):
    weights = _llama_folder(src) / "model.safetensors"
    weights.write_bytes(random.Random(0).randbytes(4096))
    return src, weights, r"is not a readable safetensors file \(truncated or damaged\): .*header"


def malformed_config(src: Path):
    config = _llama_folder(src) / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"hidden_size": 32,', '"hidden_size": 32,,'))
    return src, config, r"is not valid JSON: Expecting property name enclosed in double quotes at line \d+ column \d+"


def wrong_field_type(src: Path):
    config = _llama_folder(src) / "config.json"
    fields = json.loads(config.read_text())
    fields["num_attention_heads"] = "nine"
    config.write_text(json.dumps(fields))
    return src, config, r": `num_attention_heads` must be a positive integer, got 'nine'\."


def truncated_gguf(src: Path):
    src.mkdir()
    gguf = write_tiny_gguf(src / "model.gguf")
    size = gguf.stat().st_size
    _truncate(gguf, size - 1000)
    return (
        gguf,
        gguf,
        rf"is truncated: its tensor table places tensor data up to byte {size} \(last tensor '[\w.]+'\), but the file "
        rf"has {size - 1000} bytes",
    )


def gguf_cut_in_header(src: Path):
    src.mkdir()
    gguf = write_tiny_gguf(src / "model.gguf")
    _truncate(gguf, 200)
    return gguf, gguf, r"is not a readable GGUF file \(truncated or damaged header, 200 bytes\)"


def random_gguf(src: Path):
    src.mkdir()
    gguf = src / "model.gguf"
    gguf.write_bytes(random.Random(1).randbytes(4096))
    return gguf, gguf, r"is not a readable GGUF file: .*does not start with the GGUF magic bytes"


CASES = {
    f.__name__: f
    for f in (truncated_safetensors, random_safetensors, malformed_config, wrong_field_type, truncated_gguf,
              gguf_cut_in_header, random_gguf)
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_python_api_names_the_file_and_writes_nothing(tmp_path, case):
    source, damaged, what = CASES[case](tmp_path / "src")
    with pytest.raises(ConversionError) as err:
        convert("llama", source, tmp_path / "out", diff_version=2, progress=False)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(str(damaged)), message
    assert re.search(what, message), message
    assert os.listdir(tmp_path) == ["src"]  # no output folder, no temporary folder


def test_command_line_exits_2_with_one_line_and_no_traceback(tmp_path):
    """A damaged file of each format through the real command line (a process each, run side by side). Every case
    raises ConversionError (test above), which the command line turns into this one line and exit status 2."""
    runs = {}
    for case in ("truncated_safetensors", "truncated_gguf"):
        make = CASES[case]
        work = tmp_path / case
        work.mkdir()
        source, damaged, what = make(work / "src")
        argv = [sys.executable, str(REPO / "convert_scripts" / "convert.py"), "--from", "llama", "--diff-version", "2",
                "--input", str(source), "--output", str(work / "out")]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        runs[case] = (
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
            work,
            damaged,
            what,
        )
    for case, (proc, work, damaged, what) in runs.items():
        stdout, stderr = proc.communicate(timeout=300)
        lines = own_stderr_lines(stderr)  # without the lines any import of the libraries prints
        assert proc.returncode == 2, (case, stderr[-3000:])
        assert len(lines) == 1 and "Traceback" not in stderr, (case, stderr[-3000:])
        prefix = f"difftransformer-convert: error: {damaged}"
        assert lines[0].startswith(prefix) and re.search(what, lines[0]), (case, lines[0])
        assert os.listdir(work) == ["src"], (case, os.listdir(work))
