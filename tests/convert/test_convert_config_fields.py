"""Every config field a converter reads is checked before anything is built or written: a bad value gives a one-line
error naming the field and the file (exit status 2 from the command line) and leaves no output behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from difftransformer.convert import ConversionError, convert
from utils_cli import own_stderr_lines

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = Path(__file__).resolve().parents[2]

BAD_LLAMA_FIELDS = {
    "num_key_value_heads": (-2, "`num_key_value_heads` must be a positive integer, got -2"),
    "num_attention_heads": (0, "`num_attention_heads` must be a positive integer, got 0"),
    "num_hidden_layers": (0, "`num_hidden_layers` must be a positive integer, got 0"),
    "intermediate_size": (-64, "`intermediate_size` must be a positive integer, got -64"),
    "vocab_size": (0, "`vocab_size` must be a positive integer, got 0"),
    "head_dim": (7, "`head_dim` must be even"),
    "rms_norm_eps": (0.0, "`rms_norm_eps` must be a positive number, got 0.0"),
    "hidden_size/heads": (None, "`hidden_size` (30) must be divisible by `num_attention_heads` (4)"),
    "heads/kv heads": (None, "`num_attention_heads` (4) must be a multiple of `num_key_value_heads` (3)"),
}


def llama_folder(folder: Path, field: str | None = None, value=None) -> Path:
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
    ).save_pretrained(folder)
    config = folder / "config.json"
    fields = json.loads(config.read_text())
    if field == "hidden_size/heads":
        fields.update(hidden_size=30, head_dim=None)
    elif field == "heads/kv heads":
        fields["num_key_value_heads"] = 3
    elif field is not None:
        fields[field] = value
    config.write_text(json.dumps(fields))
    return folder


@pytest.mark.parametrize("field", list(BAD_LLAMA_FIELDS))
@pytest.mark.parametrize("version", [1, 2])
def test_bad_llama_config_fields_are_named_with_the_file(tmp_path, field, version):
    value, what = BAD_LLAMA_FIELDS[field]
    source = llama_folder(tmp_path / "src", field, value)
    with pytest.raises(ConversionError) as err:
        convert("llama", source, tmp_path / "out", diff_version=version, progress=False)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{source / 'config.json'}: "), message
    assert what in message, message
    assert os.listdir(tmp_path) == ["src"]


def test_command_line_exits_2_on_a_negative_head_count_and_writes_nothing(tmp_path):
    source = llama_folder(tmp_path / "src", "num_key_value_heads", -2)
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "convert_scripts" / "convert.py"),
            "--from",
            "llama",
            "--diff-version",
            "2",
            "--input",
            str(source),
            "--output",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    lines = own_stderr_lines(result.stderr)  # without the lines any import of the libraries prints
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines[0] == (
        f"difftransformer-convert: error: {source / 'config.json'}: `num_key_value_heads` must be a positive integer, "
        "got -2."
    ), lines[0]
    assert os.listdir(tmp_path) == ["src"]


@pytest.mark.parametrize("field, value", [("num_heads", -4), ("num_kv_heads", 0), ("hidden_size", "64")])
def test_bad_microsoft_config_fields_are_named(tmp_path, field, value):
    config = {
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_heads": 4,
        "num_kv_heads": 2,
        field: value,
    }
    with pytest.raises(ConversionError, match=rf"`{field}` must be a positive integer, got {value!r}"):
        convert(
            "microsoft-v1",
            {},
            tmp_path / "out",
            source_config=config,
            microsoft_module="MultiheadFlashDiff2",
            progress=False,
        )
    assert os.listdir(tmp_path) == []


def test_bad_diffllama_config_fields_are_named_with_the_file(tmp_path):
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

    torch.manual_seed(0)
    DiffLlamaForCausalLM(
        DiffLlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).save_pretrained(tmp_path / "src")
    config = tmp_path / "src" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "intermediate_size": 0}))
    with pytest.raises(ConversionError) as err:
        convert("diffllama", tmp_path / "src", tmp_path / "out", progress=False)
    assert str(err.value).startswith(f"{config}: ") and "`intermediate_size` must be a positive integer" in str(
        err.value
    )
    assert os.listdir(tmp_path) == ["src"]
