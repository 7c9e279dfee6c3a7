"""Helpers of the serving tests: tiny random V2 folders, greedy references from our own ``generate()``, ports."""

from __future__ import annotations

import importlib.util
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# The same float32 model run by vLLM and by transformers differs by rounding only: other summation orders in attention,
# fused MLP projections and norms. A float32 dot product of length K (<= 512 here) is off by at most ~K·2^-24 ≈ 3e-5
# relative (far less on average), and a log-probability passes through ~10 such operations in the 2-layer random
# models: LOGPROB_TOL bounds the difference of log-probabilities (magnitude ~4) with room to spare. A greedy token
# is determined only where the reference's top-1 beats its top-2 by more than twice that: the tests check this
# margin at every step (a fixed seed keeps it), so that equal tokens cannot be luck and cannot flake on another CPU.
LOGPROB_TOL = 2e-4
# SmolLM2 (30 layers, hidden 576, vocab 49152): more and longer accumulations, so a tolerance 5x wider.
REAL_LOGPROB_TOL = 1e-3

# Chat prompts for the SmolLM2 V2 upcycle; greedy answers (32 tokens at most) with margins above 2 * REAL_LOGPROB_TOL
# at every step (checked by the tests).
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 plus 7?",
    "What color is the sky?",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "List two fruits.",
]
CHAT_TOKENS = 32


def _load_example():
    spec = importlib.util.spec_from_file_location("serve_smollm2", ROOT / "examples" / "serve_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


serve_smollm2 = _load_example()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def save_random_model(
    folder: Path,
    *,
    diff_version: int,
    num_key_value_heads: int,
    num_attention_heads: int = 8,
    seed: int = 0,
    **config_fields,
):
    """A tiny random DIFF model saved with save_pretrained (remote code included). head_dim 32: vLLM's CPU attention
    kernels support 32, 64, 80, ... (not the 8 of the main suite's tiny models; V1's single call runs 2·32 = 64).
    initializer_range 0.1 (instead of 0.02) gives logits far enough apart for greedy decoding to be determined (see
    assert_matches)."""
    from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM

    torch.manual_seed(seed)
    config = DiffTransformerConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=32,
        diff_version=diff_version,
        max_position_embeddings=1024,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **config_fields,
    )
    model = DiffTransformerForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def save_duplicated_v1_upcycle(folder: Path, *, num_attention_heads: int, num_key_value_heads: int, seed: int = 0):
    """A tiny random Llama (head_dim 32, initializer_range 0.1) upcycled to V1 by
    ``difftransformer.convert.convert("llama", ..., diff_version=1, v1_init="duplicate")``: ``2·Hq`` query and
    ``2·Hkv`` KV half-heads, any head counts (odd ones included). Returns the converted folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from difftransformer.convert import convert

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=32,
        max_position_embeddings=1024,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    source = Path(folder).with_name(Path(folder).name + "-llama")
    LlamaForCausalLM(config).save_pretrained(source)
    convert("llama", source, folder, diff_version=1, v1_init="duplicate", progress=False, seed=seed)
    return Path(folder)


@dataclass
class Greedy:
    """Our greedy continuation of one prompt: token ids, their log-probabilities and the top-1 − top-2 margins."""

    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    margins: list[float]


@torch.no_grad()
def greedy_reference(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id=None) -> Greedy:
    """``model.generate`` (batch 1, greedy, default cache) with its step logits."""
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id if eos_token_id is not None else 0,
    )
    ids = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs, margins = [], []
    for step, token in zip(out.logits, ids, strict=True):
        lp = torch.log_softmax(step[0].double(), -1)
        top2 = lp.topk(2).values
        logprobs.append(lp[token].item())
        margins.append((top2[0] - top2[1]).item())
    return Greedy(prompt_ids, ids, logprobs, margins)


def assert_matches(token_ids, logprobs, ref: Greedy, tol: float, what: str):
    """vLLM's greedy tokens equal ours and their log-probabilities agree within ``tol``; the reference's margins
    exceed ``2·tol`` at every step (else equality would not be a property of the model)."""
    assert min(ref.margins) > 2 * tol, (
        f"{what}: the reference's greedy choice is not determined (margin {min(ref.margins):.2e})"
    )
    assert list(token_ids) == ref.ids, what
    if logprobs is not None:
        diff = max(abs(a - b) for a, b in zip(logprobs, ref.logprobs, strict=True))
        assert diff < tol, f"{what}: log-probabilities differ by {diff:.2e}"


@torch.no_grad()
def chat_references(model, tokenizer, prompts=CHAT_PROMPTS, max_new_tokens=CHAT_TOKENS) -> list[Greedy]:
    """Our greedy chat answers: the tokenizer's chat template with the generation prompt, then one batched ``generate``
    (prompts left-padded, as ``generate`` expects), cut after each row's EOS."""
    prompt_ids = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for p in prompts
    ]
    width = max(map(len, prompt_ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
    )
    refs = []
    for row, ids in enumerate(prompt_ids):
        new = out.sequences[row, width:].tolist()
        if tokenizer.eos_token_id in new:
            new = new[: new.index(tokenizer.eos_token_id) + 1]
        logprobs, margins = [], []
        for step, token in zip(out.logits, new):
            lp = torch.log_softmax(step[row].double(), -1)
            top2 = lp.topk(2).values
            logprobs.append(lp[token].item())
            margins.append((top2[0] - top2[1]).item())
        refs.append(Greedy(ids, new, logprobs, margins))
    return refs


def save_motif_folder(folder: Path, kind: str, *, seed: int = 0, **overrides) -> Path:
    """A Motif-2 checkpoint folder as Motif publishes it (its ``config.json``, ``model_type "Motif"``,
    ``MotifForCausalLM``, with the ``auto_map`` that names Motif's own remote code, absent here) holding random
    weights in Motif's key layout and row order: tests/motif_reference.py's ``motif_config`` (``kind`` and
    ``overrides``) and ``random_motif_checkpoint``."""
    import json

    from safetensors.torch import save_file

    from motif_reference import motif_config, random_motif_checkpoint

    config = {
        **motif_config(kind, **overrides),
        "auto_map": {
            "AutoConfig": "configuration_motif.MotifConfig",
            "AutoModelForCausalLM": "modeling_motif.MotifForCausalLM",
        },
    }
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(random_motif_checkpoint(config, seed=seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


# ----------------------------------------------------------------------------------------------------------------------
# vLLM engines in a child process
#
# The references come from plain transformers in the test process; vLLM runs in a child process, so that the two never
# share torch's global state (vLLM's CPU worker binds threads, sets its own defaults). run_engine_jobs builds the jobs'
# engines one after another in that child; with VLLM_ENABLE_V1_MULTIPROCESSING=0 each engine runs inside it, so
# vLLM is imported once for all of them (most of an engine's start-up on CPU).


def run_engine_jobs(jobs_file: str, out_file: str) -> None:
    """Run the jobs of ``jobs_file`` (a JSON list) with vLLM, write what each gave to ``out_file`` (JSON).

    A job: ``name``, ``model`` (folder), ``llm`` (keyword arguments of ``vllm.LLM``), ``rounds`` (lists of prompts,
    token ids, sent as one ``generate`` call each: concurrent requests), ``new_tokens``. It records for each round and
    prompt the greedy token ids, their log-probabilities and the number of prompt tokens vLLM found in its prefix
    cache; for the engine, whether it runs the Transformers backend, its architecture, and whether prefix caching and
    chunked prefill are on. An engine that fails to build records ``error`` (type and message) instead."""
    import gc
    import json
    import time

    import vllm
    from vllm.inputs import TokensPrompt

    results = {}
    for job in json.loads(Path(jobs_file).read_text()):
        record: dict = {"error": None}
        started = time.perf_counter()
        try:
            llm = vllm.LLM(model=job["model"], **job["llm"])
        except Exception as err:  # noqa: BLE001 - the test reads the error
            record["error"] = f"{type(err).__name__}: {err}"
            results[job["name"]] = record
            gc.collect()
            continue
        record["startup_s"] = time.perf_counter() - started
        config = llm.llm_engine.vllm_config
        record["transformers_backend"] = config.model_config.using_transformers_backend()
        record["architecture"] = config.model_config.architecture
        record["prefix_caching"] = bool(config.cache_config.enable_prefix_caching)
        record["chunked_prefill"] = bool(config.scheduler_config.enable_chunked_prefill)
        record["max_num_batched_tokens"] = config.scheduler_config.max_num_batched_tokens
        params = vllm.SamplingParams(
            temperature=0, max_tokens=job["new_tokens"], ignore_eos=True, logprobs=0, detokenize=False
        )
        record["rounds"] = []
        for prompts in job["rounds"]:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            record["rounds"].append(
                [
                    {
                        "ids": list(o.outputs[0].token_ids),
                        "logprobs": [
                            step[t].logprob
                            for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
                        ],
                        "cached": o.num_cached_tokens,
                    }
                    for o in outputs
                ]
            )
        record["seconds"] = time.perf_counter() - started
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        results[job["name"]] = record
        Path(out_file).write_text(json.dumps(results))  # after each job: a crash later keeps the earlier results
    Path(out_file).write_text(json.dumps(results))


def run_weight_sync_jobs(jobs_file: str, out_file: str) -> None:
    """The weight-sync jobs of ``jobs_file`` (tests_serving/test_vllm_weight_sync.py), in the child: for each, an
    engine on its ``folder``; greedy tokens of ``prompt`` (``new_tokens`` of them) before any sync, then after each of
    its ``updates`` (safetensors files) is pushed into the model one tensor at a time, in a shuffled order, inside
    vLLM's layerwise reload (what its ``reload_weights`` does on CPU). Writes ``{name: {"before", "after"}}``, each a
    greedy result (``ids``, ``logprobs``), to ``out_file``."""
    import gc
    import json
    import random

    import vllm
    from safetensors.torch import load_file
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    results = {}
    for job in json.loads(Path(jobs_file).read_text()):
        params = vllm.SamplingParams(
            temperature=0, max_tokens=job["new_tokens"], ignore_eos=True, logprobs=0, detokenize=False
        )
        llm = vllm.LLM(
            model=job["folder"],
            dtype="float32",
            seed=0,
            max_model_len=256,
            enforce_eager=True,
            skip_tokenizer_init=True,
        )

        def greedy(llm=llm, params=params, prompt=job["prompt"]):
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
            return {"ids": list(out.token_ids), "logprobs": [s[t].logprob for s, t in zip(out.logprobs, out.token_ids)]}

        record = {"before": greedy(), "after": []}
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model  # where TRL's colocate mode loads
        for update in job["updates"]:
            tensors = list(load_file(update).items())
            random.Random(update).shuffle(tensors)
            initialize_layerwise_reload(model)
            for name, tensor in tensors:
                model.load_weights([(name, tensor)])
            finalize_layerwise_reload(model, llm.llm_engine.vllm_config.model_config)
            llm.reset_prefix_cache()
            record["after"].append(greedy())
        results[job["name"]] = record
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    Path(out_file).write_text(json.dumps(results))


def engine_jobs_in_child(
    jobs: list[dict], workdir: Path, env: dict | None = None, timeout: int = 1500, runner: str = "run_engine_jobs"
) -> dict:
    """``runner`` (a function of this module: :func:`run_engine_jobs`, :func:`run_weight_sync_jobs`) on ``jobs`` in a
    child process (``env`` added to this process's environment); returns its results. Fails with the end of the
    child's log when it does not finish."""
    import json
    import os
    import subprocess
    import sys

    workdir.mkdir(parents=True, exist_ok=True)
    jobs_file, out_file, log_file = workdir / "jobs.json", workdir / "results.json", workdir / "child.log"
    jobs_file.write_text(json.dumps(jobs))
    script = (
        f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests_serving')!r}]\n"
        f"from serving_utils import {runner}\n"
        "if __name__ == '__main__':  # vLLM may spawn processes (workers of a tensor-parallel engine)\n"
        f"    {runner}({str(jobs_file)!r}, {str(out_file)!r})\n"
    )
    with open(log_file, "wb") as log:
        proc = subprocess.run(
            [sys.executable, "-c", script],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
    if proc.returncode != 0 or not out_file.is_file():
        raise AssertionError(
            f"vLLM child process exited with {proc.returncode}:\n{log_file.read_text(errors='replace')[-6000:]}"
        )
    return json.loads(out_file.read_text())
