"""DIFF V2 models in ``vllm.LLM``: greedy output equals our ``generate()`` on both of vLLM's ways to run them: the
package's native vLLM model (its vLLM plugin, vLLM's default ``model_impl="auto"``, no remote code) and vLLM's
Transformers backend (``model_impl="transformers"`` with the folder's remote code). The real model's chat runs in
test_openai_server.py, on the native model. DIFF V1 (native model only; the
Transformers backend refuses it), grouped differential attention and Motif-2 folders are tested in test_vllm_native.py.

vLLM's defaults stay on (prefix caching, chunked prefill, torch.compile for the random model on the native model; on
the Transformers backend it runs eager, like every engine of these tests but this native one and one V1 model in
test_vllm_native.py: compilation costs ~30 s of CI's CPU per engine, and vLLM's compilation of its Transformers backend
is vLLM's own path); ``max_num_batched_tokens``
is set below the prompt lengths so that chunked prefill really splits prompts, and a second round of prompts
sharing a cached prefix checks that prefix-cache hits happen and change nothing.
"""

from __future__ import annotations

import gc

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="serving tests need the vLLM venv: bash scripts/setup_vllm.sh")

from serving_utils import (  # noqa: E402
    LOGPROB_TOL,
    ROOT,
    assert_matches,
    greedy_reference,
    save_random_model,
)

PREFIX_LEN = 160  # > one KV block (vLLM's CPU default block_size is 128): the second round finds 128 tokens cached
CHUNK = 64  # max_num_batched_tokens: every prompt (>= 165 tokens) is prefilled in several chunks
NEW_TOKENS = 16


def shutdown(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def random_prompts(seed: int, count: int, prefix: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 60, (count,), generator=gen).tolist()
    return [prefix + torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def random_v2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("random_v2")
    model = save_random_model(folder, diff_version=2, num_key_value_heads=2)  # H=4 differential heads, n=2 per group
    return folder, model


# How vLLM runs a DIFF V2 folder: keyword arguments of vllm.LLM.
IMPLS = {
    "native": dict(),  # model_impl="auto": the architecture is registered by the package's vLLM plugin
    "transformers": dict(model_impl="transformers", trust_remote_code=True, enforce_eager=True),
}


def assert_impl(llm, impl: str):
    """The model really runs on the implementation the test names (vLLM falls back to the Transformers backend for
    architectures it does not know)."""
    model_config = llm.llm_engine.vllm_config.model_config
    assert model_config.using_transformers_backend() == (impl == "transformers"), model_config.architecture


@pytest.fixture(scope="module", params=list(IMPLS))
def random_v2_llm(request, random_v2):
    llm = vllm.LLM(
        model=str(random_v2[0]),
        **IMPLS[request.param],
        dtype="float32",
        seed=0,
        max_model_len=512,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=8,
        skip_tokenizer_init=True,
    )
    assert_impl(llm, request.param)
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    assert llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill
    yield llm
    shutdown(llm)


def run_vllm(llm, prompts):
    from vllm.inputs import TokensPrompt

    params = vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, detokenize=False)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def assert_equal_to_reference(outputs, references, tol):
    assert len(outputs) == len(references)
    for i, (out, ref) in enumerate(zip(outputs, references, strict=True)):
        got = out.outputs[0]
        logprobs = [step[token].logprob for step, token in zip(got.logprobs, got.token_ids, strict=True)]
        assert_matches(got.token_ids, logprobs, ref, tol, f"prompt {i}")


def test_v2_batch_with_chunked_prefill_and_prefix_caching_equals_generate(random_v2, random_v2_llm):
    _, model = random_v2
    prefix = torch.randint(0, 512, (PREFIX_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    first, second = random_prompts(2, 6, prefix), random_prompts(3, 6, prefix)
    refs = [greedy_reference(model, p, NEW_TOKENS) for p in first + second]

    out_first = run_vllm(random_v2_llm, first)  # 6 concurrent requests, prefilled in chunks of CHUNK tokens
    assert_equal_to_reference(out_first, refs[:6], LOGPROB_TOL)
    out_second = run_vllm(random_v2_llm, second)  # same prefix: served from the prefix cache
    assert all(o.num_cached_tokens >= 128 for o in out_second), [o.num_cached_tokens for o in out_second]
    assert_equal_to_reference(out_second, refs[6:], LOGPROB_TOL)


def test_docs_quote_the_v1_error():
    """docs/serving.md quotes the Transformers backend's refusal of V1 word for word."""
    from difftransformer.modeling_difftransformer import VLLM_V1_ERROR

    docs = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    assert f"\nValueError: {VLLM_V1_ERROR}\n" in docs
