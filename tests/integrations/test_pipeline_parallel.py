"""Pipeline-parallel inference (`DistributedConfig(pp_size=2)`) on 2 CPU processes, against one process.

examples/distributed/pp_generate.py runs under torchrun: each process holds one stage (half of the decoder layers),
and `generate()` must give the greedy tokens of the unsplit model, its logits within float32 rounding. Every launch
runs in its own process group under a timeout: a stage that fails ends the job with that rank's error in the test's
failure message, and a job that hangs (a rank waiting for a stage that gave up) is killed, never left waiting.
"""

from pathlib import Path

import dist_common
import pytest
import torch
import torch.distributed as dist

import difftransformer  # noqa: F401
from utils_distributed import word_tokenizer
from utils_launch import check, last_json_line, launch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "distributed"

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is unavailable",
)


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("diff_version", [1, 2])
def test_pipeline_parallel_generate_equals_one_process(tmp_path, diff_version):
    model = dist_common.tiny_model(diff_version=diff_version, seed=0).eval()
    model.save_pretrained(tmp_path / "model")
    if diff_version == 1:  # prompt as token ids
        prompt = [5, 17, 3, 99, 42, 7, 64, 1, 2]
        prompt_args = ["--input-ids", *map(str, prompt)]
    else:  # prompt as text, through the tokenizer saved with the model (the doc's form)
        text = "def main ( argv ) : return"
        tokenizer = word_tokenizer([text])
        tokenizer.save_pretrained(tmp_path / "model")
        prompt, prompt_args = tokenizer(text).input_ids, ["--prompt", text]
    result = last_json_line(
        check(
            launch(
                EXAMPLES / "pp_generate.py",
                *("--model", str(tmp_path / "model"), *prompt_args),
                *("--max-new-tokens", "6", "--save-logits", str(tmp_path / "logits.pt")),
                cwd=tmp_path,
            )
        ).stdout
    )
    assert result["world_size"] == 2
    # Really split: each stage holds one of the two decoder layers.
    assert [stage["layers"] for stage in result["stages"]] == [[0], [1]]

    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected_logits = model(ids).logits
    # The same float32 operations in the same order, only on two processes: equal up to float32 rounding.
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected_logits, rtol=1e-5, atol=1e-5)
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)[:, len(prompt) :].tolist()
    assert result["generated_ids"] == expected
    if diff_version == 2:
        assert result["text"] == tokenizer.batch_decode(expected)


def test_pipeline_parallel_generate_of_a_padded_batch_equals_one_process(tmp_path):
    prompts = ["def main ( argv ) : return", "import os"]
    tokenizer = word_tokenizer(prompts)
    tokenizer.padding_side = "left"
    model = dist_common.tiny_model(diff_version=1, seed=0, vocab_size=len(tokenizer)).eval()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    prompt_args = [arg for prompt in prompts for arg in ("--prompt", prompt)]
    result = last_json_line(
        check(
            launch(
                EXAMPLES / "pp_generate.py",
                *("--model", str(tmp_path / "model"), *prompt_args, "--max-new-tokens", "6"),
                cwd=tmp_path,
            )
        ).stdout
    )
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    assert inputs.attention_mask.min() == 0  # the batch is padded
    expected = model.generate(**inputs, max_new_tokens=6, do_sample=False)[:, inputs.input_ids.shape[1] :]
    assert result["generated_ids"] == expected.tolist()


FAILING_STAGE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("stage 1 gave up")
dist.broadcast(torch.zeros(1), src=1)  # rank 0 waits for the stage that failed
"""


def test_a_failing_stage_ends_the_job_with_its_error(tmp_path):
    script = tmp_path / "failing_stage.py"
    script.write_text(FAILING_STAGE)
    proc = launch(script, cwd=tmp_path, timeout=120)
    assert proc.returncode not in (None, 0)  # ended by itself, not by the timeout
    assert "stage 1 gave up" in proc.stderr  # and the failing rank's error is what the test shows


def test_a_hanging_job_is_killed_at_the_timeout(tmp_path):
    # A rank that catches its stage's exception and carries on (or simply hangs) leaves the other waiting forever.
    script = tmp_path / "hanging_stage.py"
    script.write_text(FAILING_STAGE.replace('raise ValueError("stage 1 gave up")', "import time; time.sleep(600)"))
    proc = launch(script, cwd=tmp_path, timeout=20)
    assert proc.returncode is None  # killed at the timeout
    with pytest.raises(AssertionError, match="timed out"):
        check(proc)


def test_the_pipeline_forwards_wrapped_kwargs_are_named_when_something_is_lost():
    """transformers' pipeline-parallel forward binds the caller's `**kwargs` as one argument named `kwargs`: with
    only `return_dict` inside (what generate() passes; moot there) nothing is lost, anything else is named."""
    from transformers.testing_utils import CaptureLogger

    from difftransformer.compat_difftransformer import _WARNED_UNKNOWN, check_forward_arguments, logger
    from difftransformer.modeling_difftransformer import eager_attention_forward

    model = dist_common.tiny_model(diff_version=1).model
    _WARNED_UNKNOWN.discard("kwargs")
    with CaptureLogger(logger) as captured:
        check_forward_arguments(model, {"kwargs": {"return_dict": True}}, None, None, eager_attention_forward)
    assert captured.out == ""
    with CaptureLogger(logger) as captured:
        check_forward_arguments(model, {"kwargs": {"output_lambdas": True}}, None, None, eager_attention_forward)
    assert "['output_lambdas']" in captured.out and "ignored" in captured.out
    _WARNED_UNKNOWN.discard("kwargs")
