"""The package's native vLLM model (difftransformer/vllm_model.py, registered by its vLLM plugin) for DIFF V1, grouped
differential attention and Motif-2 checkpoints: greedy tokens equal our ``generate()`` and log-probabilities agree
within float32 rounding, with concurrent requests, chunked prefill and prefix caching on, with and without vLLM's
torch.compile, and on two tensor-parallel ranks; vLLM's Transformers backend refuses V1 with an error that points to the
native model. (V2 without GDA: test_vllm_offline.py; the real SmolLM2 upcycles through ``vllm serve``:
test_openai_server.py.)

Models (``Hq`` query half-heads, ``Hkv`` KV half-heads; V1: ``H`` differential heads in ``G = Hkv/2`` groups of
``n = H/G``; GDA: ``N`` noise heads, each shared by ``r`` signal heads):

* V1 in every head layout the package supports: ``v1_mha_n1`` (Hq 8, Hkv 8: n = 1, Microsoft's layout), ``v1_gqa_n2``
  (Hq 16, Hkv 8: n = 2, 4 groups), ``v1_gqa_n3`` (Hq 12, Hkv 4: n = 3; runs under vLLM's torch.compile, every other
  model eager) and ``v1_duplicate_3q1kv``: a random Llama with 3 query heads over 1 KV head upcycled by
  ``convert("llama", ..., diff_version=1, v1_init="duplicate")``: Hq 6, Hkv 2 (H = 3 heads, odd, in G = 1 group);
* grouped differential attention in the package's own format: ``v1_gda_r4`` (Hq 10 = 8 signal + 2 noise, Hkv 4: each
  of the 2 groups has 4 signal heads and 1 noise head) and ``v2_gda_r2`` (Hq 6 = 2 blocks of [signal, signal, noise],
  Hkv 2);
* Motif-2 checkpoint folders (``model_type "Motif"``, ``MotifForCausalLM``, Motif's keys and row order, random
  weights; tests/motif_reference.py): ``motif_mha`` (Motif-2.6B's topology, r = 1, MHA), ``motif_gqa`` (r = 1 with two
  noise heads per KV pair: the one layout whose query rows the native model must permute at load) and ``motif_gda``
  (Motif-2-12.7B's topology scaled down: 2 groups of 4 signal + 1 noise), all with the PolyNorm MLP and λinit from
  depth − 1. Their reference is our ``MotifForCausalLM`` in transformers, itself checked against the plain-torch oracle
  of Motif's published forward in tests/models/test_motif.py.

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
    save_motif_folder,
    save_random_model,
)

PREFIX_LEN = 160  # > one KV block (vLLM's CPU default block_size is 128): the second round finds 128 tokens cached
CHUNK = 64  # max_num_batched_tokens: every prompt (>= 165 tokens) is prefilled in several chunks
NEW_TOKENS = 16
VOCAB = 512
# Motif's tiny kinds with vLLM-sized heads (its CPU attention needs 2·head_dim in {32, 64, ...}) and room for the
# prompts.
MOTIF_OVERRIDES = dict(vocab_size=VOCAB, max_position_embeddings=1024)

# name: how to build it. The seeds give every reference step a top-1 margin of at least 1.2e-3, three times the
# 2·LOGPROB_TOL that assert_matches requires (seed 0 of v1_gqa_n3 has a step at 7.7e-5: a near-tie whose greedy
# choice is rounding).
MODELS = {
    "v1_mha_n1": dict(diff_version=1, num_attention_heads=8, num_key_value_heads=8, seed=0),
    "v1_gqa_n2": dict(diff_version=1, num_attention_heads=16, num_key_value_heads=8, seed=3),
    "v1_gqa_n3": dict(diff_version=1, num_attention_heads=12, num_key_value_heads=4, seed=1),
    "v1_duplicate_3q1kv": dict(duplicate=(3, 1), seed=3),
    "v1_gda_r4": dict(diff_version=1, num_attention_heads=10, num_key_value_heads=4, num_noise_heads=2, seed=0),
    "v2_gda_r2": dict(diff_version=2, num_attention_heads=6, num_key_value_heads=2, num_noise_heads=2, seed=0),
    "v2_gqa_n2": dict(diff_version=2, num_attention_heads=8, num_key_value_heads=2, seed=0),
    "motif_mha": dict(motif="tiny-mha", overrides={"head_dim": 16}, seed=2),  # its own head_dim 8: 2·8 too small
    "motif_gqa": dict(motif="tiny-gqa", overrides={}, seed=0),
    "motif_gda": dict(motif="tiny-gda", overrides={}, seed=1),
}
# (Hq, Hkv, noise heads, r) each model must have: the layouts the tests claim.
LAYOUTS = {
    "v1_mha_n1": (8, 8, 4, 1),
    "v1_gqa_n2": (16, 8, 8, 1),
    "v1_gqa_n3": (12, 4, 6, 1),
    "v1_duplicate_3q1kv": (6, 2, 3, 1),
    "v1_gda_r4": (10, 4, 2, 4),
    "v2_gda_r2": (6, 2, 2, 2),
    "v2_gqa_n2": (8, 2, 4, 1),
    "motif_mha": (8, 8, 4, 1),
    "motif_gqa": (8, 4, 4, 1),
    "motif_gda": (10, 4, 2, 4),
}
COMPILED = (
    "v1_gqa_n3"  # vLLM's default (torch.compile); the others run enforce_eager (compilation costs ~30 s of CPU each)
)
# Plain V1 with several groups per rank (4 groups, 2 each), plain V2 (2 groups, one each), and Motif-2's grouped noise
# heads (2 groups of 4 signal + 1 noise heads: one whole group per rank, and PolyNorm's all-reduce). Each two-rank
# engine costs CI about a minute of both cores.
TENSOR_PARALLEL = ("v1_gqa_n2", "v2_gqa_n2", "motif_gda")


def random_prompts(seed: int, count: int, prefix: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 60, (count,), generator=gen).tolist()
    return [prefix + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


PREFIX = torch.randint(0, VOCAB, (PREFIX_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
ROUNDS = [random_prompts(2, 6, PREFIX), random_prompts(3, 6, PREFIX)]  # 6 concurrent requests each; same prefix


def engine_kwargs(**extra) -> dict:
    return dict(
        dtype="float32",
        seed=0,
        max_model_len=512,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=8,
        skip_tokenizer_init=True,
        **extra,
    )


def build(name: str, folder):
    """The folder of model ``name`` and our model loaded from it (float32, eval)."""
    from transformers import AutoModelForCausalLM

    from difftransformer.motif import register_motif

    register_motif()  # the Auto classes load Motif's folders too (opt-in: docs/models.md)

    spec = dict(MODELS[name])
    seed = spec.pop("seed")
    if "duplicate" in spec:
        hq, hkv = spec["duplicate"]
        save_duplicated_v1_upcycle(folder, num_attention_heads=hq, num_key_value_heads=hkv, seed=seed)
    elif "motif" in spec:
        save_motif_folder(folder, spec["motif"], seed=seed, **MOTIF_OVERRIDES, **spec["overrides"])
    else:
        return folder, save_random_model(folder, seed=seed, **spec)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name → (folder, our model in float32, its greedy references for ROUNDS)."""
    built = {}
    for name in MODELS:
        folder, model = build(name, tmp_path_factory.mktemp(name) / "model")
        refs = [[greedy_reference(model, p, NEW_TOKENS) for p in prompts] for prompts in ROUNDS]
        built[name] = (folder, model, refs)
    return built


@pytest.fixture(scope="module")
def engine_results(models, tmp_path_factory):
    """One child process: every model on the native model (default model_impl), then the Transformers backend on a
    V1 folder (which must refuse it)."""
    jobs = [
        dict(
            name=name,
            model=str(folder),
            new_tokens=NEW_TOKENS,
            rounds=ROUNDS,
            llm=engine_kwargs(**({} if name == COMPILED else {"enforce_eager": True})),
        )
        for name, (folder, _, _) in models.items()
    ]
    jobs.append(
        dict(
            name="transformers_backend",
            model=str(models["v1_gqa_n2"][0]),
            new_tokens=NEW_TOKENS,
            rounds=[],
            llm=engine_kwargs(model_impl="transformers", trust_remote_code=True, enforce_eager=True),
        )
    )
    return engine_jobs_in_child(
        jobs, tmp_path_factory.mktemp("native_engines"), env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    )


def assert_rounds_equal_references(result: dict, refs, what: str, architecture: str):
    """Both rounds equal the references; the second round was served from the prefix cache."""
    assert result["error"] is None, result["error"]
    assert not result["transformers_backend"] and result["architecture"] == architecture, (what, result["architecture"])
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


def architecture(name: str) -> str:
    return "MotifForCausalLM" if name.startswith("motif") else "DiffTransformerForCausalLM"


@pytest.mark.parametrize("name", list(MODELS))
def test_native_model_equals_generate(name, models, engine_results):
    _, model, refs = models[name]
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.noise_heads, config.noise_ratio) == LAYOUTS[
        name
    ]
    assert config.diff_version == (2 if name.startswith("v2") else 1)
    if name.startswith("motif"):
        assert type(model).__name__ == "MotifForCausalLM" and config.hidden_act == "poly_norm"
        assert config.lambda_init_layer_offset == -1
    assert_rounds_equal_references(engine_results[name], refs, name, architecture(name))


def test_motif_gqa_query_rows_are_permuted_at_load(models):
    """motif_gqa is the layout where Motif's query rows differ from ours (two noise heads per KV pair), so that its
    exactness above tests the native model's load-time permutation; the others need none."""
    from difftransformer.motif import motif_query_heads

    for name in ("motif_mha", "motif_gqa", "motif_gda"):
        heads = motif_query_heads(models[name][1].config)
        assert torch.equal(heads, torch.arange(heads.numel())) == (name != "motif_gqa"), name


def test_transformers_backend_refuses_v1_and_points_to_the_native_model(engine_results):
    """vLLM's Transformers backend allocates num_key_value_heads cache heads of width head_dim and cannot run V1's
    2·head_dim-wide single call: it refuses at build time, naming the native model and how to get it."""
    from difftransformer.modeling_difftransformer import VLLM_V1_ERROR

    error = engine_results["transformers_backend"]["error"]
    assert error == f"ValueError: {VLLM_V1_ERROR}"
    assert "native vLLM model" in error and "model_impl" in error and "cannot be served" not in error


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor-parallel ranks need two CPU cores (one bound each)")
def test_two_tensor_parallel_ranks_equal_generate(models, tmp_path_factory):
    """``tensor_parallel_size=2`` (vLLM's multiprocess executor, one worker per rank, each bound to its own core) on a
    plain V1 folder, a plain V2 folder and Motif-2's grouped noise heads: every rank holds whole KV groups with their
    query heads and o_proj columns (v1_gqa_n2: two groups per rank, with λ and subln replicated; v2_gqa_n2: one group,
    with its lambda_proj rows; motif_gda: one group of 4 signal + 1 noise heads), and PolyNorm's means of squares are
    summed over the ranks."""
    jobs = [
        dict(
            name=name,
            model=str(models[name][0]),
            new_tokens=NEW_TOKENS,
            rounds=ROUNDS,
            llm=engine_kwargs(tensor_parallel_size=2, enforce_eager=True),
        )
        for name in TENSOR_PARALLEL
    ]
    # vLLM's CPU build binds each rank's threads to NUMA nodes by default and refuses two ranks on one node.
    results = engine_jobs_in_child(jobs, tmp_path_factory.mktemp("tp2"), env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    for name in TENSOR_PARALLEL:
        assert_rounds_equal_references(
            results[name], models[name][2], f"{name}, tensor_parallel_size=2", architecture(name)
        )


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v1_eager_forms_equal_the_native_forms(dtype):
    """The forms V1's custom ops take in eager mode on CPU equal the native forms (what vLLM compiles, and the
    transformers model's own): the padded queries exactly, over a reused buffer that grows, is read back by a
    shorter step after a longer one (its stale rows must not leak) and holds GDA's uneven rows; the per-head norm
    on vLLM's fused kernel within float32 rounding (the same float32 products, summed in another order), cast to the
    model's dtype once."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from difftransformer.vllm_model import DiffTransformerHeadRMSNormOp, DiffTransformerQueryPadOp

    torch.manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        pads = [
            DiffTransformerQueryPadOp(groups=2, rows=6, signal_rows=3, head_dim=16),  # r = 1: n = 3
            DiffTransformerQueryPadOp(groups=2, rows=5, signal_rows=4, head_dim=16),
        ]  # GDA r = 4: 4 + 1 rows
        norm = DiffTransformerHeadRMSNormOp(32, eps=1e-5, scale=0.7)
    # Every platform's form runs: vLLM dispatches eager GPUs to forward_cuda (CustomOp's own raises), ROCm to
    # forward_hip (which calls it), the others to their native forms.
    platform_forms = ("forward_cuda", "forward_hip", "forward_xpu", "forward_tpu", "forward_oot")
    q = torch.randn(5, pads[0].groups * pads[0].rows * pads[0].head_dim)
    for form in platform_forms:
        assert torch.equal(getattr(pads[0], form)(q), pads[0].forward_native(q)), form
        assert torch.equal(getattr(norm, form)(q.view(5, -1, 32)), norm.forward_native(q.view(5, -1, 32))), form
    for pad in pads:
        width = pad.groups * pad.rows * pad.head_dim
        for tokens in (7, 40, 3, 40, 1):  # grows at 40, then shorter steps over stale rows
            qkv = torch.randn(tokens, width + 2 * 16, dtype=dtype)
            q = qkv[:, :width]  # a column slice of the fused projection, as vLLM's split gives it
            eager = pad.forward_cpu(q)
            assert eager.shape == (tokens, 2 * width) and torch.equal(eager, pad.forward_native(q)), (pad.rows, tokens)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(32))
    heads = (3 * torch.randn(11, 4, 32)).to(dtype)
    eager, native = norm.forward_cpu(heads), norm.forward_native(heads)
    assert eager.dtype == native.dtype == dtype
    # float32 rounding of the sums, then (bfloat16) one rounding each: at most one ulp of the output's dtype apart.
    ulp = torch.finfo(dtype).eps * native.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((eager.float() - native.float()).abs() <= ulp + 1e-6 * native.float().abs()).all()
