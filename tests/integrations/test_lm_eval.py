"""lm-evaluation-harness evaluates a saved DiffTransformer folder through its `hf` model type.

Runs the local-task commands of docs/distributed.md verbatim (a YAML task over a JSON-lines file: no download) in a
fresh process that never imports `difftransformer` (the folder's remote code is used), then checks every
log-likelihood lm-eval reports against the model's own forward pass, and the aggregated perplexity.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from utils_distributed import DOC_MODEL_V1, doc_blocks, save_tiny_lm, word_tokenizer

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (`pip install lm-eval`)")

TASK = "stdlib_next_word"


def _local_task_block() -> str:
    return next(block for block in doc_blocks("bash") if "--include_path" in block)


def _doc_examples(block: str) -> list[dict]:
    return [json.loads(line) for line in block.splitlines() if line.startswith('{"context"')]


def _reference_loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's definition for causal models: encode context+continuation, score the tokens after the context."""
    whole = tokenizer(context + continuation).input_ids
    n_context = len(tokenizer(context).input_ids)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    targets = torch.tensor(whole[n_context:])
    predicted = logprobs[n_context - 1 : len(whole) - 1]
    loglikelihood = predicted.gather(1, targets[:, None]).sum().item()
    return loglikelihood, bool(torch.equal(predicted.argmax(-1), targets))


def _teach_greedy_continuation(model, tokenizer, examples) -> None:
    """Hand-set the output rows of each example's (one-token) target to the direction of the final hidden state at
    the end of its context, with a logit of 20 there, so that greedy decoding continues the context with the target."""
    with torch.no_grad():
        for example in examples:
            context_ids = tokenizer(example["context"]).input_ids
            whole = tokenizer(example["context"] + " " + example["target"]).input_ids
            assert whole[:-1] == context_ids, "a one-token continuation"
            hidden = model.model(torch.tensor([context_ids])).last_hidden_state[0, -1]
            model.lm_head.weight[whole[-1]] = 20 * hidden / hidden.norm() ** 2


def test_lm_eval_hf_model_scores_a_saved_model_like_its_forward_pass(tmp_path):
    block = _local_task_block()
    examples = _doc_examples(block)
    assert len(examples) >= 4
    tokenizer = word_tokenizer([text for ex in examples for text in (ex["context"], ex["target"])])
    model = save_tiny_lm(tmp_path / DOC_MODEL_V1, diff_version=1, tokenizer=tokenizer)
    # Some examples greedy-correct, the others not, so that lm-eval's greedy flag is checked both ways.
    _teach_greedy_continuation(model, tokenizer, [examples[0], examples[2]])
    model.save_pretrained(tmp_path / DOC_MODEL_V1)

    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),  # the venv's lm_eval
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),
        "HF_MODULES_CACHE": str(tmp_path / "modules-cache"),  # where transformers copies the folder's remote code
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(
        ["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    (samples_file,) = (tmp_path / "lm_eval_out").rglob(f"samples_{TASK}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == len(examples)
    loglikelihoods, greedy_flags = [], []
    for sample in samples:
        context, continuation = sample["arguments"]["gen_args_0"]["arg_0"], sample["arguments"]["gen_args_0"]["arg_1"]
        assert continuation == " " + sample["doc"]["target"]
        reported, reported_greedy = sample["resps"][0][0]
        expected, expected_greedy = _reference_loglikelihood(model, tokenizer, context, continuation)
        assert float(reported) == pytest.approx(expected, abs=1e-4), context
        assert reported_greedy in ("True", "False")
        assert (reported_greedy == "True") == expected_greedy, context
        loglikelihoods.append(expected)
        greedy_flags.append(expected_greedy)
    assert True in greedy_flags and False in greedy_flags, greedy_flags

    (results_file,) = (tmp_path / "lm_eval_out").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"][TASK]
    # lm-eval's perplexity aggregation: exp(-mean log-likelihood) over the examples.
    assert results["perplexity,none"] == pytest.approx(math.exp(-sum(loglikelihoods) / len(loglikelihoods)), rel=1e-4)
    assert 0.0 <= results["acc,none"] <= 1.0
