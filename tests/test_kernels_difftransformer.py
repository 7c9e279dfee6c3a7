"""V1's kernel under ``attn_implementation="sdpa"`` (blocked materialisation, packed decode) against eager.

The forward of every backend is already compared with the float64 SPEC reference in test_modeling; here: the
kernel's own gradients (float64 gradcheck), its masking conventions, several blocks per call, and, inside a model,
eager's logits, generations and parameter gradients in float32 and bfloat16.
"""

import copy

import pytest
import torch

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from difftransformer import kernels_difftransformer as kernels
from difftransformer import modeling_difftransformer as mdt


def _inputs(b, g, n, t, s, d, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q1, q2 = (torch.randn(b, g, n, t, d, dtype=dtype, generator=gen) for _ in range(2))
    key, value = (torch.randn(b, g, s, 2 * d, dtype=dtype, generator=gen) for _ in range(2))
    return q1, q2, key, value, torch.tensor(0.37, dtype=dtype)


def _materialised(q1, q2, key, value, lam, allowed):
    """Whole-map ``(softmax(Q1K1ᵀ/√d) − λ softmax(Q2K2ᵀ/√d))·V`` with ``allowed`` ``(B, 1, T, S)``; → ``(B, T, G, n, 2d)``."""
    d = q1.shape[-1]
    maps = []
    for q, k in ((q1, key[..., :d]), (q2, key[..., d:])):
        scores = torch.einsum("bgntd,bgsd->bgnts", q, k) * d**-0.5
        maps.append(scores.masked_fill(~allowed[:, :, None], float("-inf")).softmax(-1))
    out = torch.einsum("bgnts,bgse->bgnte", maps[0] - lam * maps[1], value)
    return out.permute(0, 3, 1, 2, 4)


@pytest.mark.parametrize("q_len,kv_len,masked", [(5, 5, False), (3, 8, True), (6, 6, True), (1, 6, False), (1, 6, True)])
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
    torch.testing.assert_close(out, _materialised(q1, q2, key, value, lam, torch.ones(7, 7, dtype=torch.bool).tril()[None, None]))
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
    # packed decode agrees with the blocked kernel (no mask and a boolean one)
    q1, q2, key, value, lam = _inputs(b, g, n, 1, 9, d, seed=4)
    query = torch.stack((q1, q2), 2).squeeze(-2)  # (B, G, 2, n, d)
    visible = torch.ones(b, 1, 1, 9, dtype=torch.bool)
    visible[0, ..., :3] = False
    for mask in (None, visible):
        ref = kernels.blocked_differential_attention(q1, q2, key, value, lam, d**-0.5, mask, block)[:, 0]
        torch.testing.assert_close(kernels.packed_decode_attention(query, key, value, lam, d**-0.5, mask), ref)


def _model(kv_heads: int, version: int = 1, seed: int = 0) -> DiffTransformerForCausalLM:
    cfg = DiffTransformerConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=8, num_key_value_heads=kv_heads, diff_version=version, pad_token_id=0)
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
            cache: model.generate(ids[:, :12], attention_mask=mask[:, :12], max_new_tokens=6, do_sample=False,
                                  cache_implementation=cache, pad_token_id=0)
            for cache in ("dynamic", "static")
        }
    model.zero_grad()
    model.train()
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 3] = -100  # predicted from a padding row, whose output each kernel fills differently
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    model.eval()
    return logits, generated, {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("kv_heads", [4, 8, 2])  # n = 2, 1 and 4 differential heads per KV group
def test_sdpa_kernel_equals_eager_in_a_model(kv_heads, monkeypatch):
    monkeypatch.setattr(kernels, "_BLOCK_ROWS", 16)  # several blocks at these lengths (and the minimum of 16 rows)
    model = _model(kv_heads)
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    ref, fast = _run(model, "eager", ids, mask), _run(model, "sdpa", ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(fast[0][valid], ref[0][valid], rtol=1e-5, atol=1e-5)
    for cache in ("dynamic", "static"):
        assert torch.equal(fast[1][cache], ref[1][cache]), cache
    for name, grad in ref[2].items():
        torch.testing.assert_close(fast[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_sdpa_kernel_bfloat16_gradients_as_close_to_float32_as_eager():
    """bf16 training: every parameter gradient of the sdpa kernel is within 5% of float32 eager's (relative norm), or,
    where bf16 itself costs more (λ's gradient is a sum over every score), no farther than bf16 eager's."""
    model = _model(4, seed=3)
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 4] = -100
    model.set_attn_implementation("eager")
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    errors = {}
    for impl in ("eager", "sdpa"):
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        bf16.zero_grad()
        bf16.set_attn_implementation(impl)
        bf16(ids, attention_mask=mask, labels=labels).loss.backward()
        errors[impl] = {k: ((p.grad.float() - ref[k]).norm() / ref[k].norm()).item() for k, p in bf16.named_parameters()}
    for name, err in errors["sdpa"].items():
        assert err < max(0.05, 1.1 * errors["eager"][name]), (name, err, errors["eager"][name])


def test_sdpa_with_a_float_mask_uses_transformers_sdpa_and_agrees():
    """A user's additive 4-D float mask goes through transformers' sdpa function (padded queries); same logits."""
    model = _model(4).eval()
    ids = torch.randint(3, 97, (1, 10), generator=torch.Generator().manual_seed(4))
    allowed = torch.ones(10, 10, dtype=torch.bool).tril()
    allowed[6:, 2] = False  # not a plain causal mask
    float_mask = torch.zeros(1, 1, 10, 10).masked_fill(~allowed, torch.finfo(torch.float32).min)
    calls = []
    original = mdt.differential_sdpa_attention
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(ids, attention_mask=float_mask).logits
        model.set_attn_implementation("sdpa")
        try:
            mdt.differential_sdpa_attention = lambda *a, **k: calls.append(1) or original(*a, **k)
            out = model(ids, attention_mask=float_mask).logits
            plain = model(ids).logits
        finally:
            mdt.differential_sdpa_attention = original
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert len(calls) == model.config.num_hidden_layers  # only the plain call took the differential kernel
    assert not torch.allclose(plain, out)
