"""V1's CPU kernels under ``attn_implementation="sdpa"`` (blocked materialisation, decode) against eager.

The forward of every backend is already compared with the float64 reference (difftransformer/testing_utils.py) in
test_modeling; here: the kernel's own gradients (float64 gradcheck), its masking conventions, several blocks per call,
and, inside a model, eager's logits, generations and parameter gradients in float32 and bfloat16.
"""

import copy

import pytest
import torch

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from difftransformer import kernels_difftransformer as kernels
from difftransformer import modeling_difftransformer as mdt
from difftransformer.testing_utils import (
    FP32_LOGITS_ATOL,
    bf16_gradient_bounds,
    left_padded_batch,
    randomize_norms,
    reference_forward,
    tiny_config,
)


def _inputs(b, g, n, t, s, d, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q1, q2 = (torch.randn(b, g, n, t, d, dtype=dtype, generator=gen) for _ in range(2))
    key, value = (
        torch.randn(b, 2 * g, s, d, dtype=dtype, generator=gen) for _ in range(2)
    )  # as cached: (B, Hkv, S, d)
    return q1, q2, key, value, torch.tensor(0.37, dtype=dtype)


def _materialised(q1, q2, key, value, lam, allowed):
    """Whole-map ``(softmax(Q1K1ᵀ/√d) − λ softmax(Q2K2ᵀ/√d))·V`` with ``allowed`` ``(B, 1, T, S)``; → ``(B, T, G, n,
    2d)``."""
    d = q1.shape[-1]
    maps = []
    for q, k in ((q1, key[:, 0::2]), (q2, key[:, 1::2])):  # group g: key heads 2g (map 1) and 2g + 1 (map 2)
        scores = torch.einsum("bgntd,bgsd->bgnts", q, k) * d**-0.5
        maps.append(scores.masked_fill(~allowed[:, :, None], float("-inf")).softmax(-1))
    out = torch.einsum("bgnts,bgse->bgnte", maps[0] - lam * maps[1], torch.cat((value[:, 0::2], value[:, 1::2]), -1))
    return out.permute(0, 3, 1, 2, 4)


@pytest.mark.parametrize(
    "q_len,kv_len,masked", [(5, 5, False), (3, 8, True), (6, 6, True), (1, 6, False), (1, 6, True)]
)
def test_blocked_kernel_gradients_are_exact(q_len, kv_len, masked):
    b, g, n, d = 2, 2, 2, 4
    args = [x.requires_grad_() for x in _inputs(b, g, n, q_len, kv_len, d)]
    mask = None
    if masked:  # causal, queries last; left padding hides sequence 0's first two positions (its first rows see nothing)
        mask = torch.ones(b, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        mask[0, :, :, :2] = False
    fn = lambda *a: kernels.BlockedDifferentialAttention.apply(*a, d**-0.5, mask, 2)  # noqa: E731  (2 rows per block)
    assert torch.autograd.gradcheck(fn, tuple(args))


@pytest.mark.parametrize("block", [None, 3])
def test_mask_conventions_match_the_materialised_formula(block):
    """No mask: one query sees every key; t > 1 queries are causal from the first key (square attention, or a
    prefill into an empty static cache). A boolean mask decides everything, here with a static cache's unused tail."""
    b, g, n, d = 2, 2, 3, 4
    # square causal, no mask
    q1, q2, key, value, lam = _inputs(b, g, n, 7, 7, d)
    out = kernels.blocked_differential_attention(q1, q2, key, value, lam, d**-0.5, None, block)
    torch.testing.assert_close(
        out, _materialised(q1, q2, key, value, lam, torch.ones(7, 7, dtype=torch.bool).tril()[None, None])
    )
    # one query, no mask: the whole cache
    q1, q2, key, value, lam = _inputs(b, g, n, 1, 9, d, seed=1)
    out = kernels.blocked_differential_attention(q1, q2, key, value, lam, d**-0.5, None, block)
    torch.testing.assert_close(out, _materialised(q1, q2, key, value, lam, torch.ones(1, 1, 1, 9, dtype=torch.bool)))
    # prefill of 5 tokens into an empty static cache of 12, no mask: top-left causal
    q1, q2, key, value, lam = _inputs(b, g, n, 5, 12, d, seed=2)
    out = kernels.blocked_differential_attention(q1, q2, key, value, lam, d**-0.5, None, block)
    allowed = torch.zeros(5, 12, dtype=torch.bool)
    allowed[:, :5] = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(out, _materialised(q1, q2, key, value, lam, allowed[None, None]))
    # boolean mask: 3 new tokens after 4 cached ones in a static cache of 10, sequence 1 left-padded by 2
    q1, q2, key, value, lam = _inputs(b, g, n, 3, 10, d, seed=3)
    allowed = torch.zeros(b, 1, 3, 10, dtype=torch.bool)
    allowed[..., :7] = torch.ones(3, 7, dtype=torch.bool).tril(4)
    allowed[1, ..., :2] = False
    out = kernels.blocked_differential_attention(q1, q2, key, value, lam, d**-0.5, allowed, block)
    torch.testing.assert_close(out, _materialised(q1, q2, key, value, lam, allowed))
    # the decode kernel agrees with the blocked kernel (no mask and a boolean one)
    q1, q2, key, value, lam = _inputs(b, g, n, 1, 9, d, seed=4)
    query = torch.cat((q1, q2), 2).permute(0, 3, 1, 2, 4).reshape(b, 1, 2 * g * n, d)  # q_proj order (g, c, r)
    visible = torch.ones(b, 1, 1, 9, dtype=torch.bool)
    visible[0, ..., :3] = False
    for mask in (None, visible):
        ref = kernels.blocked_differential_attention(q1, q2, key, value, lam, d**-0.5, mask, block)
        out = kernels.differential_decode_attention(query, key, value, lam, d**-0.5, mask)
        torch.testing.assert_close(out, ref.reshape(b, 1, g * n, 2 * d))


def _model(kv_heads: int, version: int = 1, seed: int = 0) -> DiffTransformerForCausalLM:
    cfg = DiffTransformerConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        diff_version=version,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = DiffTransformerForCausalLM(cfg)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, mdt.DiffTransformerAttention) and version == 1:
                for p in (m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2, m.subln.weight):
                    p.add_(torch.randn_like(p) * 0.3)
    return model


def _run(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    model.eval()
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        generated = {
            cache: model.generate(
                ids[:, :12],
                attention_mask=mask[:, :12],
                max_new_tokens=6,
                do_sample=False,
                cache_implementation=cache,
                pad_token_id=0,
            )
            for cache in ("dynamic", "static")
        }
    model.zero_grad()
    model.train()
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 3] = -100  # predicted from a padding row, whose output each kernel fills differently
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    model.eval()
    return logits, generated, {k: p.grad.clone() for k, p in model.named_parameters()}


V1_SDPA_KERNELS = [
    ("auto", True),
    ("auto", False),
    ("padded", True),
    ("padded", False),
    ("sdpa_two_calls", True),
    ("sdpa_repeated_value", True),
]


@pytest.mark.parametrize(
    ("kernel", "padded"),
    V1_SDPA_KERNELS,
    ids=[f"{k}-{'left-padded' if p else 'no-padding'}" for k, p in V1_SDPA_KERNELS],
)
@pytest.mark.parametrize("kv_heads", [4, 8, 2])  # n = 2, 1 and 4 differential heads per KV group
def test_sdpa_kernel_equals_eager_in_a_model(kv_heads, kernel, padded, monkeypatch):
    """Logits, greedy generations (dynamic and static cache) and every parameter gradient of every V1 kernel under
    "sdpa" equal eager's: "auto" (on a CPU the blocked kernel, and the decode kernel for one token), the padded single
    call (what every other backend receives), and the two stock-SDPA paths CUDA runs (model.set_differential_kernel)."""
    monkeypatch.setattr(kernels, "_BLOCK_ROWS", 16)  # several blocks at these lengths (and the minimum of 16 rows)
    calls = []
    original = kernels.blocked_differential_attention
    monkeypatch.setattr(kernels, "blocked_differential_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = _model(kv_heads)
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0  # left padding
    ref = _run(model, "eager", ids, mask)
    calls.clear()
    model.set_differential_kernel(kernel)
    fast = _run(model, "sdpa", ids, mask)
    assert bool(calls) == (kernel == "auto")  # the blocked kernel ran exactly where it should
    ran = {m.last_kernel for m in model.modules() if isinstance(m, mdt.DiffTransformerAttention)}
    assert ran == {"blocked" if kernel == "auto" else kernel}  # the training step ran last
    valid = mask.bool()
    torch.testing.assert_close(fast[0][valid], ref[0][valid], rtol=1e-5, atol=1e-5)
    for cache in ("dynamic", "static"):
        assert torch.equal(fast[1][cache], ref[1][cache]), cache
    assert ref[2].keys() == fast[2].keys()
    for name, grad in ref[2].items():
        torch.testing.assert_close(fast[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------------- bfloat16 training
# Every bound below comes from the rounding model of difftransformer/testing_utils.py (RoundingModel): the float64
# reference, with every intermediate and every gradient perturbed by a relative error drawn from [−2⁻⁸, 2⁻⁸], drawn 8
# times; a bf16 gradient must lie within BF16_FACTOR × the largest drawn error. Nothing in it depends on the CPU.
BF16_FACTOR = 3.0
BF16_DRAWS = 8


@pytest.fixture(scope="module", params=[1, 2], ids=["v1", "v2"])
def bf16_training_case(request):
    """A bf16 model whose attention matters (initializer_range 0.1: peaked maps), a left-padded batch, and the float64
    gradients of its loss: exact, and under the rounding model."""
    version = request.param
    cfg = tiny_config("v1_gqa" if version == 1 else "v2_gqa", initializer_range=0.1)
    torch.manual_seed(3)
    model = randomize_norms(DiffTransformerForCausalLM(cfg), 3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, mdt.DiffTransformerV1Attention):
                for p in (m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2):
                    p.add_(torch.randn_like(p) * 0.3)
    model = model.to(torch.bfloat16)
    ids, mask = left_padded_batch(cfg.vocab_size, [24, 20], seed=2)
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 4] = -100  # predicted from a padding row, which each implementation fills differently

    exact, bounds = bf16_gradient_bounds(model, ids, mask, labels, BF16_DRAWS, BF16_FACTOR)
    return model, ids, mask, labels, exact, bounds


def _bf16_grads(case, impl, kernel="auto"):
    model, ids, mask, labels, _, _ = case
    model = copy.deepcopy(model).train()
    model.set_attn_implementation(impl)
    model.set_differential_kernel(kernel)
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    return {k: p.grad.double() for k, p in model.named_parameters()}


def _outside_bounds(case, grads):
    exact, bounds = case[4], case[5]
    assert grads.keys() <= exact.keys() and len(grads) == len(exact) - ("lm_head.weight" not in grads)
    return {
        k: (round((g - exact[k]).abs().max().item() / bounds[k], 2))
        for k, g in grads.items()
        if (g - exact[k]).abs().max().item() > bounds[k]
    }


def _training_kernels(version):
    """Every kernel of the version that trains (the decode kernels serve one token without autograd; Triton has its own
    tests, tests/test_triton_*.py)."""
    return [k for k in mdt.KERNELS[version] if k not in ("decode_kernel", "rows_decode", "triton")]


@pytest.mark.parametrize("path", ["eager", "sdpa"])
def test_bfloat16_gradients_within_the_rounding_model(bf16_training_case, path):
    """bf16 training through eager and the default sdpa path (V1's blocked kernel on a CPU): every parameter gradient,
    λ's included, within the bf16 error bound of the float64 reference."""
    outside = _outside_bounds(bf16_training_case, _bf16_grads(bf16_training_case, path))
    assert not outside, f"gradient errors in units of their bound: {outside}"


def test_bfloat16_gradients_of_every_kernel_within_the_rounding_model(bf16_training_case):
    """The same bound for every other kernel a user can choose (model.set_differential_kernel): V1's padded call, its
    two stock-SDPA paths (CUDA's default), V2's standard call and causal blocks (float32 only: the standard call
    here)."""
    version = bf16_training_case[0].config.diff_version
    for kernel in _training_kernels(version):
        outside = _outside_bounds(bf16_training_case, _bf16_grads(bf16_training_case, "sdpa", kernel))
        assert not outside, f"{kernel}: gradient errors in units of their bound: {outside}"


def test_bfloat16_bounds_catch_a_wrong_kernel(bf16_training_case, monkeypatch):
    """The bounds are tight enough to matter: a kernel whose λ is 25% off, or whose λ gradient is half what it should
    be, leaves them."""
    version = bf16_training_case[0].config.diff_version
    if version == 1:
        lambda_full = mdt.DiffTransformerV1Attention.lambda_full
        monkeypatch.setattr(mdt.DiffTransformerV1Attention, "lambda_full", lambda self: 1.25 * lambda_full(self))
        assert _outside_bounds(bf16_training_case, _bf16_grads(bf16_training_case, "sdpa"))
        monkeypatch.setattr(mdt.DiffTransformerV1Attention, "lambda_full", lambda_full)
        backward = kernels.BlockedDifferentialAttention.backward

        def half_lambda_grad(ctx, grad_out):
            grads = list(backward(ctx, grad_out))
            grads[4] = grads[4] / 2
            return tuple(grads)

        monkeypatch.setattr(kernels.BlockedDifferentialAttention, "backward", staticmethod(half_lambda_grad))
        outside = _outside_bounds(bf16_training_case, _bf16_grads(bf16_training_case, "sdpa"))
        assert any("lambda" in k for k in outside), outside
    else:
        original = mdt.differential_combine
        monkeypatch.setattr(mdt, "differential_combine", lambda maps, lam, *a, **k: original(maps, 1.25 * lam, *a, **k))
        assert _outside_bounds(bf16_training_case, _bf16_grads(bf16_training_case, "sdpa"))


def test_sdpa_with_a_float_mask_uses_transformers_sdpa_and_agrees():
    """A user's additive 4-D float mask goes through transformers' sdpa function (padded queries); same logits."""
    model = _model(4).eval()
    ids = torch.randint(3, 97, (1, 10), generator=torch.Generator().manual_seed(4))
    allowed = torch.ones(10, 10, dtype=torch.bool).tril()
    allowed[6:, 2] = False  # not a plain causal mask
    float_mask = torch.zeros(1, 1, 10, 10).masked_fill(~allowed, torch.finfo(torch.float32).min)
    layers = [m for m in model.modules() if isinstance(m, mdt.DiffTransformerAttention)]
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(ids, attention_mask=float_mask).logits
        model.set_attn_implementation("sdpa")
        out = model(ids, attention_mask=float_mask).logits
        assert {m.last_kernel for m in layers} == {"padded"}
        plain = model(ids).logits
        assert {m.last_kernel for m in layers} == {"blocked"}  # the plain call took the differential kernel
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, out)


def test_bfloat16_costs_lambda_gradient_more_than_any_weight_matrix(bf16_training_case):
    """What docs/model.md says bf16 does to λ: its gradient is a sum over every score of terms of both signs, so the
    rounding model's error is a larger fraction of λ's gradient than of any weight matrix's."""
    exact, bounds = bf16_training_case[4], bf16_training_case[5]
    relative = {k: bounds[k] / exact[k].abs().max().item() for k in exact if exact[k].abs().max() > 0}
    lam = {k: v for k, v in relative.items() if "lambda" in k}
    matrices = {k: v for k, v in relative.items() if k.endswith("proj.weight") and "lambda" not in k}
    assert lam and matrices
    if bf16_training_case[0].config.diff_version == 1:
        assert min(lam.values()) > max(matrices.values()), (lam, matrices)
    else:  # V2's λ comes from a projection like any other: no such gap
        assert min(lam.values()) < max(matrices.values())


# ------------------------------------------------------------------------------------- V2's causal block attention
NEEDS_GROUPED_FLASH = pytest.mark.skipif(
    not kernels.FLASH_CPU_READS_GROUPED_KEYS,
    reason=f"torch {torch.__version__}'s CPU flash kernels do not read grouped keys: V2 takes transformers' sdpa call",
)


@NEEDS_GROUPED_FLASH
@pytest.mark.parametrize("t,block", [(8, 3), (7, 7), (9, 4)])
def test_causal_block_attention_gradients_are_exact(t, block):
    """float64 gradcheck of the blocked causal attention (GQA: 4 query heads over 2 KV heads), with a last block
    shorter than the others and with one block only."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, t, 5, dtype=torch.float64, generator=gen).requires_grad_()
    key, value = (torch.randn(2, 2, t, 5, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(2))
    fn = lambda q, k, v: kernels.CausalBlockAttention.apply(q, k, v, 5**-0.5, block)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (query, key, value))


@NEEDS_GROUPED_FLASH
def test_causal_block_attention_equals_causal_sdpa():
    """float32, a (B, T, H, d) query viewed as (B, H, T, d) (the model's layout), 300 tokens in the default blocks
    (32 rows): output and gradients within float32 rounding of the float64 causal softmax attention."""
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(2, 300, 6, 16, generator=gen).transpose(1, 2).requires_grad_()
    key, value = (torch.randn(2, 3, 300, 16, generator=gen).requires_grad_() for _ in range(2))
    grad = torch.randn(2, 6, 300, 16, generator=gen)
    out = kernels.causal_block_attention(query, key, value, 0.25)
    (out * grad).sum().backward()
    inputs64 = [x.detach().double().requires_grad_() for x in (query, key, value)]
    q64, k64, v64 = inputs64
    ref = torch.nn.functional.scaled_dot_product_attention(
        q64, k64.repeat_interleave(2, 1), v64.repeat_interleave(2, 1), is_causal=True, scale=0.25
    )
    (ref * grad.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    for x, x64 in zip((query, key, value), inputs64):
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the inference path (no saved tensors) gives the same output
        torch.testing.assert_close(kernels.causal_block_attention(query, key, value, 0.25), out, rtol=0, atol=0)


@NEEDS_GROUPED_FLASH
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v2_prompt_lengths_take_the_causal_block_path_and_equal_eager(dtype, monkeypatch):
    """A V2 model under sdpa, on prompt lengths the block path covers (shrunk here to 24 tokens or more, in 8-row
    blocks): float32 logits, greedy generations and every parameter gradient equal eager's; a padded batch, a bfloat16
    model and a shorter prompt keep transformers' sdpa call."""
    monkeypatch.setattr(kernels, "_CAUSAL_BLOCK", 8)
    monkeypatch.setattr(kernels, "CAUSAL_BLOCK_MIN_LENGTH", 24)
    calls = []
    original = kernels.causal_block_attention
    monkeypatch.setattr(mdt, "causal_block_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = _model(4, version=2)
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ref = _run(model, "eager", ids, mask)
    calls.clear()
    fast = _run(model, "sdpa", ids, mask)
    # forward, training forward, and one per layer for a 40-token prompt; generate's 12-token prompts are too short
    assert len(calls) == 2 * model.config.num_hidden_layers
    torch.testing.assert_close(fast[0], ref[0], rtol=1e-5, atol=1e-5)
    for cache in ("dynamic", "static"):
        assert torch.equal(fast[1][cache], ref[1][cache]), cache
    for name, grad in ref[2].items():
        torch.testing.assert_close(fast[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    calls.clear()
    with torch.no_grad():  # generate() from a 32-token prompt: its prefill takes the block path, then decoding
        long_prompt = {
            impl: model.set_attn_implementation(impl)
            or model.generate(
                ids[:, :32], attention_mask=mask[:, :32], max_new_tokens=5, do_sample=False, pad_token_id=0
            )
            for impl in ("eager", "sdpa")
        }
    assert torch.equal(long_prompt["sdpa"], long_prompt["eager"]) and len(calls) == model.config.num_hidden_layers
    calls.clear()
    with torch.no_grad():
        model(
            ids, attention_mask=mask.index_fill(1, torch.tensor([0]), 0)
        )  # padding: a boolean mask reaches the kernel
        model(ids[:, :20])  # shorter than the block path's lengths
        model.to(dtype)(ids)  # bfloat16 keeps SDPA's single call (float32 runs the block path)
    assert len(calls) == (model.config.num_hidden_layers if dtype == torch.float32 else 0)


@pytest.mark.parametrize("n", [1, 3])  # differential heads per KV head
def test_v2_pair_decode_equals_the_formula(n):
    """V2's decode kernel: ``o_h = softmax(q_2h·Kᵀ/√d)·V − λ_h·softmax(q_2h+1·Kᵀ/√d)·V`` over KV head ``⌊h/n⌋``
    (docs/model.md, "What it computes"), in float64, without a mask and with a boolean padding mask ``(B, 1, 1, S)``."""
    b, g, s, d = 2, 2, 9, 8
    gen = torch.Generator().manual_seed(n)
    query = torch.randn(b, 1, 2 * g * n, d, dtype=torch.float64, generator=gen)  # as projected: (B, 1, 2H, d)
    key, value = (torch.randn(b, g, s, d, dtype=torch.float64, generator=gen) for _ in range(2))
    lam = torch.rand(b, 1, g * n, dtype=torch.float64, generator=gen)
    visible = torch.ones(b, 1, 1, s, dtype=torch.bool)
    visible[0, ..., :3] = False
    for mask in (None, visible):
        allowed = torch.ones(b, s, dtype=torch.bool) if mask is None else mask[:, 0, 0]
        ref = torch.empty(b, 1, g * n, d, dtype=torch.float64)
        for h in range(g * n):
            k, v = key[:, h // n], value[:, h // n]  # (B, S, d)
            a = [
                (torch.einsum("bd,bsd->bs", query[:, 0, 2 * h + c], k) * d**-0.5)
                .masked_fill(~allowed, float("-inf"))
                .softmax(-1)
                for c in (0, 1)
            ]
            ref[:, 0, h] = torch.einsum("bs,bsd->bd", a[0] - lam[:, 0, h, None] * a[1], v)
        torch.testing.assert_close(kernels.pair_decode_attention(query, key, value, lam, d**-0.5, mask), ref)


def test_v2_decode_steps_take_the_pair_kernel_and_equal_eager(monkeypatch):
    """Under sdpa, every decode step of a V2 model runs ``pair_decode_attention`` (once per layer and step, with a
    padded batch and both caches), and the logits of every generated token equal eager's; a step with autograd keeps
    the general path."""
    calls = []
    original = kernels.pair_decode_attention
    monkeypatch.setattr(kernels, "pair_decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = _model(2, version=2).eval()
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    layers = model.config.num_hidden_layers
    for cache in ("dynamic", "static"):
        out = {}
        for impl in ("eager", "sdpa"):
            model.set_attn_implementation(impl)
            calls.clear()
            with torch.no_grad():
                out[impl] = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=6,
                    do_sample=False,
                    pad_token_id=0,
                    cache_implementation=cache,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            assert len(calls) == (5 * layers if impl == "sdpa" else 0), (cache, impl)  # 6 tokens: 5 decode steps
        assert torch.equal(out["sdpa"].sequences, out["eager"].sequences), cache
        torch.testing.assert_close(
            torch.stack(out["sdpa"].logits), torch.stack(out["eager"].logits), rtol=1e-5, atol=1e-5
        )
    calls.clear()
    model(ids[:, :1]).logits.sum().backward()  # one token with autograd: no decode kernel
    assert not calls


def test_decode_kernel_takes_sdpa_outputs_in_the_memory_layout_of_cuda_kernels(monkeypatch):
    """CUDA's SDPA kernels return ``(B, G, rows, w)`` stored rows-outermost (strides of a transposed tensor): a GPU run
    of the decode kernels failed on a ``view`` of it. Here SDPA's result is given that layout on the CPU; V2's decode
    kernel (V1's calls no SDPA) must still equal its result with the contiguous layout."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def rows_outermost(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, CUDA-kernel strides

    gen = torch.Generator().manual_seed(0)
    b, g, n, s, d = 2, 2, 2, 7, 8
    query2 = torch.randn(b, 1, 2 * g * n, d, generator=gen)
    key, value = torch.randn(b, g, s, d, generator=gen), torch.randn(b, g, s, d, generator=gen)
    lam2 = torch.rand(b, 1, g * n, generator=gen)
    expected = kernels.pair_decode_attention(query2, key, value, lam2, d**-0.5)
    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", rows_outermost)
    assert not rows_outermost(query2.reshape(b, g, -1, d), key, value).is_contiguous()
    torch.testing.assert_close(kernels.pair_decode_attention(query2, key, value, lam2, d**-0.5), expected)


def test_private_flash_operators_are_used_only_with_the_schema_the_kernel_calls(caplog):
    """The causal-block kernel calls two private aten operators; remote code may meet any torch. A missing operator, or
    one whose schema changed, is not used (one log line says so), and V2 prompts then take the public sdpa path."""
    from types import SimpleNamespace

    name = "_scaled_dot_product_flash_attention_for_cpu"
    real = getattr(torch.ops.aten, name)
    assert kernels.private_op(name) is real  # this torch: the schema the kernel was written against

    class ChangedSchema:  # the same operator with one argument renamed, as a future torch might ship it
        class default:
            _schema = SimpleNamespace(
                arguments=[
                    SimpleNamespace(name=a.name.replace("scale", "softmax_scale"))
                    for a in real.default._schema.arguments
                ],
                returns=real.default._schema.returns,
            )

    with caplog.at_level("WARNING", logger=kernels.__name__):
        assert kernels.private_op(name, ops=SimpleNamespace()) is None
        assert kernels.private_op(name, ops=SimpleNamespace(**{name: ChangedSchema})) is None
    lines = [r.getMessage() for r in caplog.records]
    assert (
        len(lines) == 2
        and "has no aten." in lines[0]
        and "has a changed aten." in lines[1]
        and "softmax_scale" in lines[1]
    )
    assert all("\n" not in line for line in lines)


def test_v2_prompts_without_the_private_operators_take_the_public_path_and_equal_eager(monkeypatch):
    model = _model(2, version=2).eval()
    ids = torch.randint(3, 97, (1, kernels.CAUSAL_BLOCK_MIN_LENGTH), generator=torch.Generator().manual_seed(3))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(ids).logits
    monkeypatch.setattr(kernels, "_FLASH_CPU", None)  # as private_op returns for a missing or changed operator
    calls = []
    monkeypatch.setattr(mdt, "causal_block_attention", lambda *a, **k: calls.append(1))
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, eager, rtol=1e-4, atol=1e-4)
    assert not calls


def test_head_norm_gradients_are_exact_and_it_saves_its_input_in_its_own_dtype():
    """V1's per-head norm under autograd (kernels.HeadRMSNorm): float64 gradcheck; in bfloat16 it keeps for the
    backward the bf16 input and one float32 number per row, never a float32 copy of the input (what F.rms_norm on the
    float32 copy saves: twice the input's bytes per layer)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: kernels.HeadRMSNorm.apply(x, w, 0.7, 1e-5), (x, w))
    norm = mdt.DiffTransformerHeadRMSNorm(16, eps=1e-5)
    heads = torch.randn(2, 3, 4, 16, generator=gen).to(torch.bfloat16).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
        out = norm(heads, scale=0.7)
    assert out.dtype == torch.bfloat16
    assert (torch.float32, heads.numel()) not in saved and (torch.bfloat16, heads.numel()) in saved, saved
    with torch.no_grad():  # the same function as the inference path
        torch.testing.assert_close(out, norm(heads, scale=0.7), rtol=0, atol=0)


@pytest.mark.parametrize("kernel", ["blocked", "padded", "sdpa_two_calls", "sdpa_repeated_value"])
@pytest.mark.parametrize("layout", ["v1_mha", "v1_gqa", "v1_gqa4"])  # GQA factors n = 1, 2, 4
def test_every_v1_kernel_matches_the_float64_reference(layout, kernel):
    """Each V1 kernel a user can choose, against the float64 reference (testing_utils.reference_forward): float32
    logits of a left-padded batch and of an unpadded one without a mask within FP32_LOGITS_ATOL, and, with the model in
    float64, every parameter gradient of a left-padded batch's loss within 1e-5 of the largest (transformers' RMSNorm
    and rotary tables around the attention compute in float32: about 1e-6 of relative error)."""
    torch.manual_seed(0)
    model = randomize_norms(DiffTransformerForCausalLM(tiny_config(layout)).eval(), 0)
    model.set_differential_kernel(kernel)
    ids, mask = left_padded_batch(model.config.vocab_size, [9, 6, 3], seed=1)
    plain = torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        logits, unmasked = model(ids, attention_mask=mask).logits, model(plain).logits
    assert {m.last_kernel for m in model.modules() if isinstance(m, mdt.DiffTransformerAttention)} == {kernel}
    valid = mask.bool()
    torch.testing.assert_close(
        logits[valid].double(), reference_forward(model, ids, mask)[0][valid], atol=FP32_LOGITS_ATOL, rtol=0
    )
    torch.testing.assert_close(unmasked.double(), reference_forward(model, plain)[0], atol=FP32_LOGITS_ATOL, rtol=0)

    model = model.double().train()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)  # the label a padding row would predict
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    sd = {k: v.detach().double().requires_grad_() for k, v in model.state_dict().items()}
    reference_forward(model, ids, mask, state_dict=sd, labels=labels)[2].backward()
    for name, param in model.named_parameters():
        exact = sd[name].grad
        assert param.grad is not None and exact.abs().max() > 0, name
        assert (param.grad - exact).abs().max() <= 1e-5 * exact.abs().max(), name
