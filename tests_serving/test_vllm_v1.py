"""DIFF V1 on the package's native vLLM model (its padded single attention call, difftransformer/vllm_model.py): greedy
tokens equal our ``generate()`` and log-probabilities agree within float32 rounding, in every head layout the package
supports, with concurrent requests, chunked prefill and prefix caching on, with and without vLLM's torch.compile, and
on two tensor-parallel ranks; vLLM's Transformers backend refuses V1 with an error that points to the native model.

Layouts (``Hq`` query half-heads, ``Hkv`` KV half-heads; ``H = Hq/2`` differential heads in ``G = Hkv/2`` groups of
``n = H/G``):

* ``mha_n1``: Hq 8, Hkv 8 (n = 1, Microsoft's layout);
* ``gqa_n2``: Hq 16, Hkv 8 (n = 2, 4 groups: two per rank on 2 tensor-parallel ranks);
* ``gqa_n3``: Hq 12, Hkv 4 (n = 3; this one runs under vLLM's torch.compile, the others eager);
* ``duplicate_3q1kv``: a random Llama with 3 query heads over 1 KV head, upcycled by ``convert("llama", ...,
  diff_version=1, v1_init="duplicate")``: Hq 6, Hkv 2 (H = 3 heads, odd, in G = 1 group, n = 3).

The engines run one after another in one child process (vLLM imported once; ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
keeps each engine inside it), the references here with plain transformers (serving_utils.engine_jobs_in_child).
"""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="serving tests need the vLLM venv: bash scripts/setup_vllm.sh")

from serving_utils import (  # noqa: E402
    LOGPROB_TOL,
    assert_matches,
    engine_jobs_in_child,
    greedy_reference,
    save_duplicated_v1_upcycle,
    save_random_model,
)

PREFIX_LEN = 160  # > one KV block (vLLM's CPU default block_size is 128): the second round finds 128 tokens cached
CHUNK = 64  # max_num_batched_tokens: every prompt (>= 165 tokens) is prefilled in several chunks
NEW_TOKENS = 16
# name: (num_attention_heads, num_key_value_heads, seed) of the random V1 model (the Llama source for the duplicated
# upcycle). The seeds give every reference step a top-1 margin of at least 1.2e-3, three times the 2·LOGPROB_TOL that
# assert_matches requires (seed 0 of gqa_n3 has a step at 7.7e-5: a near-tie whose greedy choice is rounding).
LAYOUTS = {
    "mha_n1": (8, 8, 0),
    "gqa_n2": (16, 8, 3),
    "gqa_n3": (12, 4, 1),
    "duplicate_3q1kv": (3, 1, 3),
}
COMPILED = "gqa_n3"  # vLLM's default (torch.compile); the others run enforce_eager (compilation costs ~30 s of CPU each)
TENSOR_PARALLEL = "gqa_n2"  # 4 groups: two whole groups per rank


def random_prompts(seed: int, count: int, prefix: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 60, (count,), generator=gen).tolist()
    return [prefix + torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


PREFIX = torch.randint(0, 512, (PREFIX_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
ROUNDS = [random_prompts(2, 6, PREFIX), random_prompts(3, 6, PREFIX)]  # 6 concurrent requests each; same prefix


def engine_kwargs(**extra) -> dict:
    return dict(dtype="float32", seed=0, max_model_len=512, max_num_batched_tokens=CHUNK, max_num_seqs=8,
                skip_tokenizer_init=True, **extra)


@pytest.fixture(scope="module")
def v1_models(tmp_path_factory):
    """name → (folder, our model in float32, its greedy references for ROUNDS)."""
    from transformers import AutoModelForCausalLM

    import difftransformer  # noqa: F401

    models = {}
    for name, (hq, hkv, seed) in LAYOUTS.items():
        folder = tmp_path_factory.mktemp(name) / "model"
        if name.startswith("duplicate"):
            save_duplicated_v1_upcycle(folder, num_attention_heads=hq, num_key_value_heads=hkv, seed=seed)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (2 * hq, 2 * hkv)
        else:
            model = save_random_model(folder, diff_version=1, num_attention_heads=hq, num_key_value_heads=hkv, seed=seed)
        assert model.config.diff_version == 1
        refs = [[greedy_reference(model, p, NEW_TOKENS) for p in prompts] for prompts in ROUNDS]
        models[name] = (folder, model, refs)
    return models


@pytest.fixture(scope="module")
def engine_results(v1_models, tmp_path_factory):
    """One child process: every layout on the native model (default model_impl), then the Transformers backend on a
    V1 folder (which must refuse it)."""
    jobs = [
        dict(name=name, model=str(folder), new_tokens=NEW_TOKENS, rounds=ROUNDS,
             llm=engine_kwargs(**({} if name == COMPILED else {"enforce_eager": True})))
        for name, (folder, _, _) in v1_models.items()
    ]
    jobs.append(dict(name="transformers_backend", model=str(v1_models["gqa_n2"][0]), new_tokens=NEW_TOKENS, rounds=[],
                     llm=engine_kwargs(model_impl="transformers", trust_remote_code=True, enforce_eager=True)))
    return engine_jobs_in_child(jobs, tmp_path_factory.mktemp("v1_engines"), env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def assert_rounds_equal_references(result: dict, refs, what: str):
    """Both rounds equal the references; the second round was served from the prefix cache."""
    assert result["error"] is None, result["error"]
    assert not result["transformers_backend"] and result["architecture"] == "DiffTransformerForCausalLM", what
    assert result["prefix_caching"] and result["chunked_prefill"] and result["max_num_batched_tokens"] == CHUNK, what
    assert len(result["rounds"]) == len(refs) == 2
    assert all(o["cached"] >= 128 for o in result["rounds"][1]), [o["cached"] for o in result["rounds"][1]]
    worst = 0.0
    for r, (outputs, references) in enumerate(zip(result["rounds"], refs, strict=True)):
        assert len(outputs) == len(references) == 6
        for i, (out, ref) in enumerate(zip(outputs, references, strict=True)):
            assert_matches(out["ids"], out["logprobs"], ref, LOGPROB_TOL, f"{what}: round {r}, prompt {i}")
            worst = max(worst, *(abs(a - b) for a, b in zip(out["logprobs"], ref.logprobs)))
    print(f"{what}: largest log-probability difference {worst:.2e} (tolerance {LOGPROB_TOL:.0e})")  # shown with -rA


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_v1_layout_equals_generate(layout, v1_models, engine_results):
    _, model, refs = v1_models[layout]
    config = model.config
    n = config.num_attention_heads // config.num_key_value_heads
    assert n == {"mha_n1": 1, "gqa_n2": 2, "gqa_n3": 3, "duplicate_3q1kv": 3}[layout]  # n = H / G = Hq / Hkv
    assert_rounds_equal_references(engine_results[layout], refs, layout)


def test_transformers_backend_refuses_v1_and_points_to_the_native_model(engine_results):
    """vLLM's Transformers backend allocates num_key_value_heads cache heads of width head_dim and cannot run V1's
    2·head_dim-wide single call: it refuses at build time, naming the native model and how to get it."""
    from difftransformer.modeling_difftransformer import VLLM_V1_ERROR

    error = engine_results["transformers_backend"]["error"]
    assert error == f"ValueError: {VLLM_V1_ERROR}"
    assert "native vLLM model" in error and "model_impl" in error and "cannot be served" not in error


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor-parallel ranks need two CPU cores (one bound each)")
def test_v1_two_tensor_parallel_ranks_equal_generate(v1_models, tmp_path_factory):
    """``tensor_parallel_size=2`` (vLLM's multiprocess executor, one worker per rank, each bound to its own core):
    every rank holds two whole KV groups with their query half-heads, λ and o_proj columns."""
    folder, _, refs = v1_models[TENSOR_PARALLEL]
    job = dict(name="tp2", model=str(folder), new_tokens=NEW_TOKENS, rounds=ROUNDS,
               llm=engine_kwargs(tensor_parallel_size=2, enforce_eager=True))
    # vLLM's CPU build binds each rank's threads to NUMA nodes by default and refuses two ranks on one node.
    results = engine_jobs_in_child([job], tmp_path_factory.mktemp("v1_tp2"), env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert_rounds_equal_references(results["tp2"], refs, "tensor_parallel_size=2")


def test_tensor_parallel_shards_whole_groups():
    """The shard arithmetic of vllm_model.py without an engine: ranks hold G / T whole groups; vLLM's contiguous
    shards of the group-major rows are then whole groups, and a T that does not divide G is refused by name."""
    from types import SimpleNamespace

    from difftransformer.vllm_model import tensor_parallel_groups

    v1 = SimpleNamespace(diff_version=1, num_attention_heads=16, num_key_value_heads=8)  # G = 4, n = 2
    assert [tensor_parallel_groups(v1, t) for t in (1, 2, 4)] == [4, 2, 1]
    n, groups_per_rank = 2, tensor_parallel_groups(v1, 2)
    for rank in range(2):  # QKVParallelLinear's shard of rank t: rows [t·Hq/T, (t+1)·Hq/T) and [t·Hkv/T, (t+1)·Hkv/T)
        q_rows = range(rank * 16 // 2, (rank + 1) * 16 // 2)
        kv_rows = range(rank * 8 // 2, (rank + 1) * 8 // 2)
        groups = range(rank * groups_per_rank, (rank + 1) * groups_per_rank)
        assert {i // (2 * n) for i in q_rows} == set(groups)  # query half-head i = (2g + c)·n + r belongs to group g
        assert {j // 2 for j in kv_rows} == set(groups)  # key/value half-head j = 2g + c
        assert len(q_rows) == 2 * n * len(groups) and len(kv_rows) == 2 * len(groups)
    odd = SimpleNamespace(diff_version=1, num_attention_heads=6, num_key_value_heads=2)  # the duplicated upcycle: G = 1
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the 1 KV groups"):
        tensor_parallel_groups(odd, 2)
    v2 = SimpleNamespace(diff_version=2, num_attention_heads=8, num_key_value_heads=2)
    assert tensor_parallel_groups(v2, 2) == 1
    with pytest.raises(ValueError, match=r"must divide the 2 KV groups"):
        tensor_parallel_groups(v2, 4)
