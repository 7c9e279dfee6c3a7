"""Grouped differential attention (GDA, arXiv 2510.06949; ``num_noise_heads``): r signal maps share one noise map.

Every backend, cache and training path against the explicit float64 reference of difftransformer/testing_utils.py (a
loop over heads that recomputes each head's noise map from the row order of docs/model.md), the kernels against their
formulas, bf16 within the rounding model, and the exact rewrite as a plain model with duplicated noise heads
(difftransformer/convert/gda.py). The layouts (GDA_LAYOUTS) cover V1 and V2, one and two noise heads per KV group.
"""

import copy

import pytest
import torch
from transformers import CompileConfig, ContinuousBatchingConfig, GenerationConfig

from convert_scripts import convert as convert_cli
from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from difftransformer import kernels_difftransformer as kernels
from difftransformer import modeling_difftransformer as mdt
from difftransformer.convert import ConversionError, convert, duplicated_to_gda, gda_to_duplicated
from difftransformer.testing_utils import (
    GDA_LAYOUTS,
    RoundingModel,
    bf16_error_bound,
    bf16_gradient_bounds,
    greedy_with_scores,
    left_padded_batch,
    randomize_norms,
    reference_forward,
    tiny_config,
)
from utils_difftransformer import CONTRACT_CALLS

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LAYOUTS = list(GDA_LAYOUTS)


def _model(layout, attn="sdpa", seed=0, **overrides):
    torch.manual_seed(seed)
    model = DiffTransformerForCausalLM(tiny_config(layout, **overrides))
    randomize_norms(model, seed)
    with torch.no_grad():  # λ away from λinit, so that a wrong noise map shows in V1 too
        for m in model.modules():
            if isinstance(m, mdt.DiffTransformerV1Attention):
                for p in (m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2):
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.3)
    model.set_attn_implementation(attn)
    model.generation_config.eos_token_id = None
    return model.eval()


# ------------------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("layout", LAYOUTS)
def test_derived_sizes(layout):
    version, hq, hkv, noise = GDA_LAYOUTS[layout]
    cfg = tiny_config(layout)
    groups = hkv // 2 if version == 1 else hkv
    assert (cfg.noise_heads, cfg.num_diff_heads, cfg.noise_ratio, cfg.num_kv_groups) == (
        noise,
        hq - noise,
        (hq - noise) // noise,
        groups,
    )
    attn = DiffTransformerForCausalLM(cfg).model.layers[0].self_attn
    assert attn.o_proj.in_features == cfg.num_diff_heads * (2 if version == 1 else 1) * cfg.head_dim
    assert attn.q_proj.out_features == hq * cfg.head_dim and attn.num_key_value_groups == hq // groups


@pytest.mark.parametrize(
    "overrides,texts",
    [
        (dict(num_noise_heads=3), ["num_noise_heads", "(3)", "one of [2]"]),  # 10 heads: 3 does not divide
        (dict(num_noise_heads=10), ["num_noise_heads", "smaller"]),
        (dict(num_noise_heads=0), ["num_noise_heads", "positive integer"]),
        (dict(num_key_value_heads=8), ["num_noise_heads", "num_key_value_heads must be one of [2, 4]", "got 8"]),
        (dict(num_key_value_heads=3), ["num_key_value_heads", "even"]),
        (dict(diff_version=2, num_key_value_heads=4), ["num_key_value_heads must be one of [1, 2]"]),
        (dict(lambda_init_layer_offset=0.5), ["lambda_init_layer_offset"]),
    ],
)
def test_invalid_grouped_configs_name_the_fields_and_allowed_values(overrides, texts):
    base = dict(
        hidden_size=64, num_attention_heads=10, num_key_value_heads=4, num_noise_heads=2, head_dim=8, diff_version=1
    )
    with pytest.raises(Exception) as err:
        DiffTransformerConfig(**{**base, **overrides})
    for text in texts:
        assert text in str(err.value), (text, str(err.value))


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_one_noise_head_per_signal_head_is_todays_model(layout):
    """num_noise_heads = num_attention_heads / 2 (r = 1) is the model without the field: same keys and shapes, same
    random initialisation, bit-identical logits and gradients."""
    cfg = tiny_config(layout)
    models = []
    for noise in (None, cfg.num_attention_heads // 2):
        torch.manual_seed(0)
        models.append(DiffTransformerForCausalLM(tiny_config(layout, num_noise_heads=noise)))
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    outs = [m(ids, labels=ids) for m in models]
    for out in outs:
        out.loss.backward()
    assert torch.equal(outs[0].logits, outs[1].logits)
    for (k0, p0), (k1, p1) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert k0 == k1 and torch.equal(p0, p1) and torch.equal(p0.grad, p1.grad), k0


# ----------------------------------------------------------------------------------------------- forward, backends
BACKENDS = ["eager", "sdpa", "sdpa-non-cpu", "sdpa-two-calls", "contract_sdpa"]


@pytest.fixture(autouse=True)
def _contract_sdpa_must_run(request):
    CONTRACT_CALLS.clear()
    yield
    if "contract_sdpa" in request.node.name:
        assert CONTRACT_CALLS, "the model never called the contract-checking attention function"


def _set_backend(model, backend, monkeypatch):
    if backend == "sdpa-non-cpu":  # the fallback every other backend runs: V1's padded call, V2's standard call
        model.set_differential_kernel(mdt.FALLBACK_KERNEL[model.config.diff_version])
    elif backend == "sdpa-two-calls":  # CUDA's default for V1: two stock SDPA calls (V2: its default)
        model.set_differential_kernel("sdpa_two_calls" if model.config.diff_version == 1 else "auto")
    model.set_attn_implementation(backend.removesuffix("-non-cpu").removesuffix("-two-calls"))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_match_float64_reference(layout, backend, monkeypatch):
    """Left-padded batch and an unpadded one without a mask (causality applied by the kernel), float32 within 2e-5."""
    model = _model(layout, hidden_act="poly_norm" if layout.endswith("m2") else "silu")
    _set_backend(model, backend, monkeypatch)
    ids, mask = left_padded_batch(model.config.vocab_size, [9, 6, 3], seed=1)
    ref, _ = reference_forward(model, ids, mask)
    plain = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        unmasked = model(plain).logits
    valid = mask.bool()
    torch.testing.assert_close(logits[valid].double(), ref[valid], atol=2e-5, rtol=0)
    torch.testing.assert_close(unmasked.double(), reference_forward(model, plain)[0], atol=2e-5, rtol=0)


@pytest.mark.parametrize("layout", ["v1_gda4", "v2_gda2_m2"])
def test_flex_attention_matches_float64_reference(layout):
    model = _model(layout, "flex_attention")
    ids, mask = left_padded_batch(model.config.vocab_size, [9, 6, 3], seed=1)
    ref, _ = reference_forward(model, ids, mask)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(logits[valid].double(), ref[valid], atol=2e-5, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_output_attentions_are_the_grouped_differential_maps(layout):
    """Eager returns ``A_h − λ A_noise(h)`` per head, the maps the reference computes, and its output is made of
    them."""
    model = _model(layout, "eager")
    ids, mask = left_padded_batch(model.config.vocab_size, [7, 4], seed=3)
    _, ref_maps = reference_forward(model, ids, mask)
    out = model(ids, attention_mask=mask, output_attentions=True)
    for maps, ref in zip(out.attentions, ref_maps):
        assert maps.shape == (2, model.config.num_diff_heads, 7, 7)
        rows = mask.bool()[:, None, :, None].expand_as(maps)
        torch.testing.assert_close(maps[rows].double(), ref[rows], atol=2e-6, rtol=0)


def test_a_mispaired_noise_head_is_caught_by_the_reference():
    """Non-vacuity: the reference tells the two noise heads of a KV group apart (swapping their q_proj rows moves the
    logits far beyond the tolerance), so the tests above check which noise map each signal head subtracts."""
    model = _model("v1_gda2_m2", "sdpa")
    ids, mask = left_padded_batch(model.config.vocab_size, [9, 6], seed=1)
    ref, _ = reference_forward(model, ids, mask)
    d, n = model.config.head_dim, 4  # 4 signal rows, then 2 noise rows, per KV group
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.self_attn.q_proj.weight
            first, second = w[n * d : (n + 1) * d].clone(), w[(n + 1) * d : (n + 2) * d].clone()
            w[n * d : (n + 1) * d], w[(n + 1) * d : (n + 2) * d] = second, first
        logits = model(ids, attention_mask=mask).logits
    assert (logits[mask.bool()].double() - ref[mask.bool()]).abs().max() > 1e-2


# ----------------------------------------------------------------------------------------------------------- kernels
def test_blocked_kernel_gradients_with_shared_noise_maps_are_exact():
    """float64 gradcheck of V1's blocked kernel with 4 signal heads and 2 noise heads per group (r = 2): masked, two
    rows per block, one sequence's first keys hidden by padding."""
    gen = torch.Generator().manual_seed(0)
    b, g, n, m, t, s, d = 2, 2, 4, 2, 3, 5, 2
    q1 = torch.randn(b, g, n, t, d, dtype=torch.float64, generator=gen).requires_grad_()
    q2 = torch.randn(b, g, m, t, d, dtype=torch.float64, generator=gen).requires_grad_()
    key, value = (torch.randn(b, 2 * g, s, d, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(2))
    lam = torch.tensor(0.37, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(b, 1, t, s, dtype=torch.bool).tril(s - t)
    mask[0, :, :, :2] = False
    fn = lambda *a: kernels.BlockedDifferentialAttention.apply(*a, d**-0.5, mask, 2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q1, q2, key, value, lam))
    # the forward equals the materialised formula with each noise map repeated for its r signal maps
    out = kernels.blocked_differential_attention(q1, q2, key, value, lam, d**-0.5, mask, 2)
    q2_repeated = q2.repeat_interleave(n // m, dim=2)
    ref = kernels.blocked_differential_attention(q1, q2_repeated, key, value, lam, d**-0.5, mask, 2)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("version", [1, 2])
def test_decode_kernels_with_shared_noise_maps_equal_the_formula(version):
    """One query token: V1's decode kernel (rows ``[signal × n, noise × m]`` per group) and V2's pair decode (blocks
    ``[signal × r, noise]``) against a loop over heads, float64, with and without a padding mask."""
    gen = torch.Generator().manual_seed(version)
    b, g, s, d, r, m = 2, 2, 9, 8, 3, 2  # m noise heads per KV group, r signal heads per noise head
    n = r * m
    lam1 = torch.tensor(0.4, dtype=torch.float64)
    visible = torch.ones(b, 1, 1, s, dtype=torch.bool)
    visible[0, ..., :3] = False
    width = 2 * d if version == 1 else d
    heads = 2 * g if version == 1 else g  # V1: group g's key and value heads 2g, 2g + 1 (as cached)
    key, value = (torch.randn(b, heads, s, d, dtype=torch.float64, generator=gen) for _ in range(2))
    if version == 1:
        query = torch.randn(b, g, n + m, d, dtype=torch.float64, generator=gen)
    else:
        query = torch.randn(b, 1, g * m * (r + 1), d, dtype=torch.float64, generator=gen)
        lam2 = torch.rand(b, 1, g * n, dtype=torch.float64, generator=gen)
    for mask in (None, visible):
        allowed = torch.ones(b, s, dtype=torch.bool) if mask is None else mask[:, 0, 0]

        def softmax(q, k):
            return (torch.einsum("bd,bsd->bs", q, k) * d**-0.5).masked_fill(~allowed, float("-inf")).softmax(-1)

        ref = torch.empty(b, g * n, width, dtype=torch.float64)
        for h in range(g * n):
            gg, j = divmod(h, n)
            if version == 1:
                a1 = softmax(query[:, gg, j], key[:, 2 * gg])
                a2 = softmax(query[:, gg, n + j // r], key[:, 2 * gg + 1])
                ref[:, h] = torch.einsum(
                    "bs,bse->be", a1 - lam1 * a2, torch.cat((value[:, 2 * gg], value[:, 2 * gg + 1]), -1)
                )
            else:
                k = h // r  # noise head
                a1, a2 = (softmax(query[:, 0, k * (r + 1) + i], key[:, gg]) for i in (h % r, r))
                ref[:, h] = torch.einsum("bs,bse->be", a1 - lam2[:, 0, h, None] * a2, value[:, gg])
        if version == 1:
            out = kernels.differential_decode_attention(
                query.reshape(b, 1, -1, d), key, value, lam1, d**-0.5, mask, noise_ratio=r
            )[:, 0]
        else:
            out = kernels.pair_decode_attention(query, key, value, lam2, d**-0.5, mask, noise_ratio=r)[:, 0]
        torch.testing.assert_close(out, ref)


# ---------------------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("layout", ["v1_gda4", "v1_gda2_m2", "v2_gda4"])
@pytest.mark.parametrize("backend", ["eager", "sdpa", "sdpa-non-cpu", "sdpa-two-calls"])
def test_gradients_match_float64_reference(layout, backend, monkeypatch):
    """Every parameter gradient of a left-padded batch's loss (V1's blocked kernel and its backward under sdpa, the
    padded call of other devices, eager) against the float64 reference's autograd gradients; v1_gda2_m2 with Motif's
    options (PolyNorm MLP, λinit offset −1), so their parameters are checked too. The model runs in float64
    (``model.double()``: the differential attention is float64 end to end; transformers' RMSNorm and rotary tables
    around it compute in float32, hence about 1e-6 of relative error, measured); in float32 the cancellations in λ's
    gradient alone cost up to 5e-5 of its size."""
    motif = dict(hidden_act="poly_norm", lambda_init_layer_offset=-1) if layout == "v1_gda2_m2" else {}
    model = _model(layout, **motif).double().train()
    _set_backend(model, backend, monkeypatch)
    ids, mask = left_padded_batch(model.config.vocab_size, [10, 7], seed=2)
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 3] = -100  # predicted from a padding row, which each implementation fills differently
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    sd = {k: v.detach().double().requires_grad_() for k, v in model.state_dict().items()}
    reference_forward(model, ids, mask, state_dict=sd, labels=labels)[2].backward()
    for name, param in model.named_parameters():
        exact = sd[name].grad
        assert param.grad is not None and exact.abs().max() > 0, name
        assert (param.grad - exact).abs().max() <= 1e-5 * exact.abs().max(), name


# ---------------------------------------------------------------------------------------------------------- bfloat16
@pytest.fixture(scope="module", params=["v1_gda4", "v2_gda4"])
def bf16_case(request):
    """A bf16 model whose attention matters (initializer_range 0.1), a left-padded batch, its exact float64 logits and
    the bound of the rounding model: 3 × the largest error of 8 draws (testing_utils.RoundingModel)."""
    model = _model(request.param, "eager", initializer_range=0.1, head_dim=32).to(torch.bfloat16)
    ids, mask = left_padded_batch(model.config.vocab_size, [8, 5], seed=2)
    valid = mask.bool()
    exact = reference_forward(model, ids, mask)[0][valid]
    bound = bf16_error_bound(
        [reference_forward(model, ids, mask, rnd=RoundingModel(s))[0][valid] for s in range(8)], exact, 3.0
    )
    return request.param, model, ids, mask, exact, bound


@pytest.mark.parametrize("backend", ["eager", "sdpa", "contract_sdpa"])
def test_bfloat16_within_the_rounding_model(bf16_case, backend):
    """bf16 logits within the rounding model's bound, as for the plain layouts; a mis-paired noise head (the signal
    heads of one noise head read another) leaves it."""
    layout, model, ids, mask, exact, bound = bf16_case
    valid = mask.bool()
    model = copy.deepcopy(model)
    model.set_attn_implementation(backend)
    with torch.no_grad():
        err = (model(ids, attention_mask=mask).logits[valid].double() - exact).abs().max().item()
    assert err <= bound, (err, bound)
    if backend == "sdpa":
        wrong = copy.deepcopy(model)
        cfg, d = model.config, model.config.head_dim
        noise = list(GDA_LAYOUTS[layout])[3]
        rows = (
            [h * (cfg.noise_ratio + 1) + cfg.noise_ratio for h in range(noise)]
            if cfg.diff_version == 2
            else [
                g * (cfg.num_attention_heads // cfg.num_kv_groups) + cfg.num_diff_heads // cfg.num_kv_groups
                for g in range(cfg.num_kv_groups)
            ]
        )
        with torch.no_grad():
            for layer in wrong.model.layers:
                w = layer.self_attn.q_proj.weight
                a, b_ = w[rows[0] * d : (rows[0] + 1) * d].clone(), w[rows[1] * d : (rows[1] + 1) * d].clone()
                w[rows[0] * d : (rows[0] + 1) * d], w[rows[1] * d : (rows[1] + 1) * d] = b_, a
            wrong_err = (wrong(ids, attention_mask=mask).logits[valid].double() - exact).abs().max().item()
        assert wrong_err > bound, (wrong_err, bound)


@pytest.fixture(scope="module")
def bf16_training_case():
    """A bf16 V1 GDA model (r = 4), a left-padded batch, and the float64 gradients of its loss: exact, and the bound of
    the rounding model per parameter (3 × the largest error of 8 draws, as
    tests/kernels/test_kernels_difftransformer.py)."""
    model = _model("v1_gda4", initializer_range=0.1).to(torch.bfloat16)
    ids, mask = left_padded_batch(model.config.vocab_size, [20, 16], seed=2)
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 4] = -100  # predicted from a padding row, which each implementation fills differently

    exact, bounds = bf16_gradient_bounds(model, ids, mask, labels, draws=8, factor=3.0)
    return model, ids, mask, labels, exact, bounds


@pytest.mark.parametrize("backend", ["eager", "sdpa", "sdpa-non-cpu", "sdpa-two-calls"])
def test_bfloat16_gradients_within_the_rounding_model(bf16_training_case, backend, monkeypatch):
    """bf16 training of a GDA model through eager, V1's blocked kernel (its backward sums each noise map's r signal
    gradients) and the padded call of other devices: every parameter gradient, λ's included, within its bound."""
    model, ids, mask, labels, exact, bounds = bf16_training_case
    model = copy.deepcopy(model).train()
    _set_backend(model, backend, monkeypatch)
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    outside = {
        k: round((p.grad.double() - exact[k]).abs().max().item() / bounds[k], 2)
        for k, p in model.named_parameters()
        if (p.grad.double() - exact[k]).abs().max().item() > bounds[k]
    }
    assert not outside, f"gradient errors in units of their bound: {outside}"


# ------------------------------------------------------------------------------------------------- caches, generate
def _greedy(model, ids, mask=None, max_new_tokens=8, **kwargs):
    return greedy_with_scores(model, ids, mask, max_new_tokens, **kwargs)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn", ["sdpa", "eager", "contract_sdpa"])
def test_dynamic_and_static_cache_equal_uncached_greedy(layout, attn):
    model = _model(layout, attn)
    ids, _ = left_padded_batch(model.config.vocab_size, [7], seed=5)
    ref_seq, ref_scores = _greedy(model, ids, use_cache=False)
    for kwargs in ({}, {"cache_implementation": "static"}):
        seq, scores = _greedy(model, ids, **kwargs)
        assert torch.equal(seq, ref_seq), kwargs
        torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["v1_gda4"])  # inductor compiles on CPU for ~30 s: V1's decode kernel
def test_compiled_static_cache_decode(layout):
    model = _model(layout)
    ids, _ = left_padded_batch(model.config.vocab_size, [6], seed=6)
    ref_seq, ref_scores = _greedy(model, ids, use_cache=False)
    torch._dynamo.reset()
    compile_config = CompileConfig(fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True
    seq, scores = _greedy(model, ids, cache_implementation="static", compile_config=compile_config)
    assert hasattr(model, "_compiled_call")
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["v1_gda4", "v2_gda4"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_batched_left_padding_equals_each_prompt_alone(layout, attn):
    model = _model(layout, attn)
    lengths = [8, 5, 3]
    ids, mask = left_padded_batch(model.config.vocab_size, lengths, seed=8)
    batch_seq, batch_scores = _greedy(model, ids, mask)
    for b, length in enumerate(lengths):
        alone_seq, alone_scores = _greedy(model, ids[b : b + 1, -length:])
        assert torch.equal(batch_seq[b, -(length + 8) :], alone_seq[0])
        torch.testing.assert_close(batch_scores[:, b], alone_scores[:, 0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["v1_gda4", "v2_gda4"])
def test_quantized_cache_within_its_error(layout, quanto_without_its_compiled_kernel):
    """As tests/models/test_generation_difftransformer.py: on a model trained to clear margins, greedy with the 4-bit
    cache equals uncached greedy, every step's margin exceeds twice its logit error, and the error stays small."""
    model = _model(layout).train()
    period = 11
    cycle = torch.randperm(model.config.vocab_size - 3, generator=torch.Generator().manual_seed(0))[:period] + 3
    batch = torch.stack([cycle[(start + torch.arange(24)) % period] for start in range(8)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        optimizer.zero_grad()
        model(batch, labels=batch).loss.backward()
        optimizer.step()
    model.eval()
    ids = cycle[torch.arange(3, 9) % period][None]
    cache_config = {"backend": "quanto", "nbits": 4, "q_group_size": 8, "residual_length": 2}
    out = model.generate(
        ids,
        max_new_tokens=16,
        do_sample=False,
        cache_implementation="quantized",
        cache_config=cache_config,
        return_dict_in_generate=True,
        output_scores=True,
        pad_token_id=0,
    )
    uncached, _ = _greedy(model, ids, use_cache=False, max_new_tokens=16)
    assert torch.equal(out.sequences, uncached)
    with torch.no_grad():
        exact = model(out.sequences).logits[0, ids.shape[1] - 1 : -1]
    err = (torch.stack(out.scores)[:, 0] - exact).abs().amax(-1)
    top2 = exact.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1] > 2 * err).all()
    assert err[1:].max() > 1e-3 and err.max() < 0.25 * exact.std()


@pytest.mark.parametrize("layout,attn", [("v1_gda4", "sdpa"), ("v1_gda4", "eager"), ("v2_gda2_m2", "sdpa")])
def test_continuous_batching_matches_generate(layout, attn):
    """transformers' generate_batch (paged cache written inside the attention function; V1 through the padded call)."""
    model = _model(layout, attn)
    prompts = [[5, 17, 3, 90, 42, 7], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
    greedy = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=2, pad_token_id=0)
    outputs = model.generate_batch(
        prompts,
        generation_config=greedy,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=16, page_size=8, max_batch_tokens=64),
    )
    by_prompt = {tuple(out.prompt_ids): out for out in outputs.values()}
    for prompt in prompts:
        out = by_prompt[tuple(prompt)]
        assert out.error is None, out.error
        expected = model.generate(torch.tensor([prompt]), generation_config=greedy)[0, len(prompt) :].tolist()
        assert out.generated_tokens == expected, (prompt, out.generated_tokens, expected)


# ------------------------------------------------------------------------------------------- GDA ↔ duplicated form
@pytest.mark.parametrize("layout", LAYOUTS)
def test_duplicated_form_computes_the_same_function_and_converts_back(layout):
    """gda_to_duplicated: a plain (r = 1) model with each noise head's query rows copied for its r signal heads; same
    logits (sdpa and eager) and greedy tokens; duplicated_to_gda gives the original tensors back, bit for bit."""
    model = _model(layout)
    plain = gda_to_duplicated(model)
    cfg = plain.config
    assert (
        cfg.noise_ratio == 1
        and cfg.num_noise_heads is None
        and cfg.num_attention_heads == 2 * model.config.num_diff_heads
    )
    ids, mask = left_padded_batch(model.config.vocab_size, [9, 6], seed=4)
    for attn in ("sdpa", "eager"):
        model.set_attn_implementation(attn)
        plain.set_attn_implementation(attn)
        with torch.no_grad():
            torch.testing.assert_close(
                plain(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits, atol=1e-6, rtol=1e-6
            )
    assert torch.equal(_greedy(plain, ids, mask)[0], _greedy(model, ids, mask)[0])
    back = duplicated_to_gda(plain, model.config.noise_heads)
    assert back.config.to_diff_dict() == model.config.to_diff_dict()
    for (k, v), (k2, v2) in zip(model.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k


def test_model_card_names_the_noise_heads():
    from difftransformer.hub import model_card

    card = str(model_card(tiny_config("v1_gda4")))
    assert "| differential heads / noise heads (grouped: `num_noise_heads`) | 8 / 2 |" in card


def test_duplicated_to_gda_refuses_noise_heads_whose_copies_differ():
    plain = gda_to_duplicated(_model("v1_gda4"))
    with torch.no_grad():
        plain.model.layers[1].self_attn.q_proj.weight[6 * 8] += 1e-3  # query head 6: one copy of group 0's noise head
    with pytest.raises(ConversionError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight.*\[6\]"):
        duplicated_to_gda(plain, 2)
    with pytest.raises(ConversionError, match="one of \\[1, 2, 4, 8\\]"):
        duplicated_to_gda(plain, 3)
    with pytest.raises(ConversionError, match="already a plain"):
        gda_to_duplicated(plain)


def test_folder_conversion_to_duplicated_and_back(tmp_path, capsys):
    """difftransformer-convert --to duplicated and --to gda --num-noise-heads: exact (--verify compares logits), nothing
    written on a refused conversion, one-line errors with exit 2."""
    model = _model("v2_gda4")
    model.save_pretrained(tmp_path / "gda")
    result = convert(
        "difftransformer", tmp_path / "gda", tmp_path / "dup", target="duplicated", verify=True, progress=False
    )
    assert result.exact and result.max_logit_diff <= 1e-5 and result.config.num_attention_heads == 16
    result = convert(
        "difftransformer",
        tmp_path / "dup",
        tmp_path / "back",
        target="gda",
        num_noise_heads=2,
        verify=True,
        progress=False,
    )
    assert result.max_logit_diff == 0 and result.config.num_noise_heads == 2
    back = DiffTransformerForCausalLM.from_pretrained(tmp_path / "back")
    for (k, v), v2 in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(v, v2), k
    cli = ["--from", "difftransformer", "--no-progress"]
    for extra, message in (
        (
            ["--to", "gda", "--input", str(tmp_path / "dup"), "--output", str(tmp_path / "x")],
            "--num-noise-heads goes with --to gda",
        ),
        (["--to", "duplicated", "--input", str(tmp_path / "dup"), "--output", str(tmp_path / "x")], "already a plain"),
        (
            [
                "--to",
                "gda",
                "--num-noise-heads",
                "8",
                "--input",
                str(tmp_path / "gda"),
                "--output",
                str(tmp_path / "x"),
            ],
            "already grouped",
        ),
        (["--to", "diffllama", "--input", str(tmp_path / "gda"), "--output", str(tmp_path / "x")], "DIFF V1 only"),
    ):
        capsys.readouterr()
        assert convert_cli.main(cli + extra) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not (tmp_path / "x").exists()


def test_speed_benchmark_runs():
    """benchmarks/bench_gda.py --smoke: both forms of both versions through every workload, one row per workload and
    version, each with its paired ratio (docs/reports/2026-11-26-cpu-speed.md, "Grouped differential attention",
    quotes the full run)."""
    from benchmarks import bench_gda

    report = bench_gda.main(["--smoke"])
    assert [(r["workload"], r["diff_version"]) for r in report["rows"]] == [
        (w, v) for w in ("prefill 1x16", "decode b2", "train 2x8") for v in (1, 2)
    ]
    assert all(r["gda"]["median"] > 0 and r["duplicated"]["median"] > 0 and r["paired"][0] > 0 for r in report["rows"])
