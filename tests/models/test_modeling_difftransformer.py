"""Forward-pass correctness of DIFF V1 and V2 against the explicit float64 reference of difftransformer/testing_utils.py
(the equations of docs/model.md), for every attention backend."""

import math

import pytest
import torch
from torch._inductor.exc import InductorError
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from difftransformer import DiffTransformerForCausalLM
from difftransformer import modeling_difftransformer as mdt
from difftransformer.kernels_difftransformer import CAUSAL_BLOCK_MIN_LENGTH, FLASH_CPU_READS_GROUPED_KEYS
from difftransformer.modeling_difftransformer import DIFF_ATTENTION_CLASSES, DiffTransformerAttention
from utils_difftransformer import (
    CONTRACT_CALLS,
    LAYOUTS,
    RoundingModel,
    bf16_error_bound,
    left_padded_batch,
    randomize_norms,
    reference_attention,
    reference_forward,
    tiny_config,
)

BACKENDS = ["eager", "sdpa", "flex_attention", "contract_sdpa"]
TOL = {torch.float32: 2e-5}


@pytest.fixture(autouse=True)
def _contract_sdpa_must_run(request):
    """Tests run with attn_implementation="contract_sdpa" must have called it (its assertions hold on every call)."""
    CONTRACT_CALLS.clear()
    yield
    if "contract_sdpa" in request.node.name:
        assert CONTRACT_CALLS, "the model never called the contract-checking attention function"


def _model(layout, attn, dtype=torch.float32, seed=0, **overrides):
    torch.manual_seed(seed)
    model = DiffTransformerForCausalLM(tiny_config(layout, **overrides))
    randomize_norms(model, seed)
    model.set_attn_implementation(attn)
    return model.to(dtype).eval()


# flex_attention compiles per shape on CPU (~10 s each): three layouts cover MHA, GQA and both versions.
FAST_PAIRS = [(layout, attn) for layout in LAYOUTS for attn in BACKENDS if attn != "flex_attention"]
FLEX_PAIRS = [(layout, "flex_attention") for layout in ("v1_mha", "v1_gqa", "v2_gqa")]


@pytest.mark.parametrize("layout,attn", FAST_PAIRS + FLEX_PAIRS)
def test_backends_match_float64_reference_with_left_padding(layout, attn):
    model = _model(layout, attn)
    ids, mask = left_padded_batch(model.config.vocab_size, [9, 6, 3], seed=1)
    ref, _ = reference_forward(model, ids, mask)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(logits[valid].double(), ref[valid], atol=TOL[torch.float32], rtol=0)


@pytest.mark.parametrize("layout,attn", FAST_PAIRS + FLEX_PAIRS[-1:])
def test_backends_match_float64_reference_without_a_mask(layout, attn):
    """No attention_mask at all: every kernel must apply causality itself (sdpa's is_causal, V1's own kernel)."""
    model = _model(layout, attn)
    ids = torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(11))
    ref, _ = reference_forward(model, ids)
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits.double(), ref, atol=TOL[torch.float32], rtol=0)


def _llama_flex_verdict(
    errors: dict, llama_scale: float, our_error: float | None, our_scale: float | None
) -> str | None:
    """Why ours may skip, or None (then the caller fails: the failure is ours). ``errors``: the same-shape Llama's
    largest logit error per bf16 backend against its float64 logits (``flex_attention`` missing: it could not compile).
    The Llama's flex attention fails where its error leaves the band of its eager and sdpa runs (3 × the larger: two
    draws of bf16 rounding, the factor our rounding-model bound uses), or is not finite. Even then our own error must
    be explained by it: relative to each model's largest exact logit, ours at most 3 × the Llama's (a NaN of ours
    against a finite error of the Llama's is not explained)."""
    if "flex_attention" not in errors:
        return "cannot compile it"
    band = 3 * max(errors["eager"], errors["sdpa"])
    if errors["flex_attention"] <= band:
        return None
    failure = f"its logits are off by {errors['flex_attention']:.3g}, eager and sdpa's band is {band:.3g}"
    llama_relative = errors["flex_attention"] / llama_scale
    if our_error is not None and llama_relative == llama_relative:  # the Llama's error is finite: bound ours by it
        our_relative = our_error / our_scale
        if not our_relative <= 3 * llama_relative:
            return None
        failure += f"; ours is {our_relative:.3g} of its logit scale, the Llama's {llama_relative:.3g}"
    return failure


def _skip_if_llama_flex_fails_too(model, ids, mask, ours, our_error=None, our_scale=None):
    """Skip when torch's bf16 flex attention fails on this CPU for a plain Llama whose kernel calls have the same shapes
    as ours (query heads, KV heads, head width), and that failure explains ours (:func:`_llama_flex_verdict`).
    Otherwise return, and the caller fails: then the failure is ours. ``ours`` says what ours did; ``our_error`` and
    ``our_scale`` are our largest logit error and largest exact logit (None where ours did not compile).
    (Seen on CI CPUs: a C++ codegen error, `cur_qSplitSize4` undeclared; on AVX2-only CPUs, NaN or wrong logits at head
    widths 8 and 16, right ones at 32 and 64.)
    """
    torch._dynamo.reset()  # a failed compile leaves inductor state that breaks later flex compiles in this process
    cfg = model.config
    attn = next(m for m in model.modules() if isinstance(m, DiffTransformerAttention))
    width = 2 * cfg.head_dim if cfg.diff_version == 1 else cfg.head_dim
    kv_heads = cfg.num_kv_groups if cfg.diff_version == 1 else cfg.num_key_value_heads
    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=attn.num_key_value_groups * kv_heads,
            num_key_value_heads=kv_heads,
            head_dim=width,
            initializer_range=cfg.initializer_range,
        )
    ).eval()
    valid = mask.bool()
    llama.double().set_attn_implementation("sdpa")  # float64 eager turns padded rows into NaN that reach valid ones
    with torch.no_grad():
        exact = llama(ids, attention_mask=mask).logits[valid]
    llama.to(torch.bfloat16)
    errors, compile_error = {}, ""
    for impl in ("eager", "sdpa", "flex_attention"):
        llama.set_attn_implementation(impl)
        try:
            with torch.no_grad():
                logits = llama(ids, attention_mask=mask).logits[valid]
        except InductorError as llama_err:
            torch._dynamo.reset()
            compile_error = f": {str(llama_err)[:200]}"
            break
        errors[impl] = (logits.double() - exact).abs().max().item()
    failure = _llama_flex_verdict(errors, exact.abs().max().item(), our_error, our_scale)
    if failure is None:
        return
    pytest.skip(
        f"torch {torch.__version__}'s bf16 flex attention fails on this CPU for Llama too ({failure}"
        f"{compile_error}); ours: {ours[:100]}"
    )


def test_bf16_flex_skip_needs_the_llamas_failure_to_explain_ours():
    """The skip above: only where the same-shape Llama's flex attention fails too, and by as much as ours."""
    good = {"eager": 0.01, "sdpa": 0.012}
    assert _llama_flex_verdict(good, 1.0, None, None) == "cannot compile it"
    assert _llama_flex_verdict(good | {"flex_attention": 0.02}, 1.0, 5.0, 1.0) is None  # the Llama's is fine
    broken = good | {"flex_attention": 0.5}
    assert "ours is 0.6" in _llama_flex_verdict(broken, 1.0, 1.2, 2.0)  # ours: 0.6 of its scale, within 3 × 0.5
    assert _llama_flex_verdict(broken, 1.0, 4.0, 2.0) is None  # ours 2.0: four times the Llama's, not explained
    assert _llama_flex_verdict(broken, 1.0, float("nan"), 2.0) is None  # NaN against a finite error
    assert _llama_flex_verdict(good | {"flex_attention": float("nan")}, 1.0, float("nan"), 2.0)  # NaN for both


def _bf16_case(layout):
    """A bf16 model whose attention matters (initializer_range 0.1: peaked maps), a left-padded batch, its exact float64
    logits and the bound the rounding model gives (RoundingModel in difftransformer/testing_utils.py: 8 draws, 3 × the
    largest drawn error; it depends on no CPU). Heads are 32 wide (kernel widths 32 and 64), where torch's bf16 flex
    kernel is right on CPUs on which it is wrong at widths 8 and 16."""
    model = _model(layout, "eager", dtype=torch.bfloat16, initializer_range=0.1, head_dim=32)
    ids, mask = left_padded_batch(model.config.vocab_size, [8, 5], seed=2)
    valid = mask.bool()
    exact = reference_forward(model, ids, mask)[0][valid]
    draws = [reference_forward(model, ids, mask, rnd=RoundingModel(seed))[0][valid] for seed in range(8)]
    return model, ids, mask, exact, bf16_error_bound(draws, exact, factor=3.0)


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
@pytest.mark.parametrize("attn", BACKENDS)
def test_backends_bfloat16_within_the_rounding_model(layout, attn):
    model, ids, mask, exact, bound = _bf16_case(layout)
    model.set_attn_implementation(attn)
    with torch.no_grad():
        try:
            logits = model(ids, attention_mask=mask).logits
        except InductorError as err:
            if attn != "flex_attention":
                raise
            _skip_if_llama_flex_fails_too(model, ids, mask, str(err))
            raise
    err = (logits[mask.bool()].double() - exact).abs().max().item()
    if attn == "flex_attention" and not err <= bound:  # also NaN
        _skip_if_llama_flex_fails_too(
            model,
            ids,
            mask,
            f"logits off by {err:.3g}, bound {bound:.3g}",
            our_error=err,
            our_scale=exact.abs().max().item(),
        )
    assert err <= bound, (err, bound)


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_bfloat16_bound_catches_a_wrong_kernel(layout):
    """The bound is tight enough to matter: scores scaled by 1/√(2d) instead of 1/√d (a classic differential-attention
    slip: the maps' width is d, not 2d) leave it."""
    model, ids, mask, exact, bound = _bf16_case(layout)
    for m in model.modules():
        if isinstance(m, DiffTransformerAttention):
            m.scaling = (2 * m.head_dim) ** -0.5
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    assert (logits[mask.bool()].double() - exact).abs().max().item() > bound


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_output_attentions_are_the_differential_maps(layout):
    model = _model(layout, "eager")
    ids, mask = left_padded_batch(model.config.vocab_size, [7, 4], seed=3)
    _, ref_maps = reference_forward(model, ids, mask)
    out = model(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    H = model.config.num_attention_heads // 2
    assert len(out.attentions) == model.config.num_hidden_layers
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    for maps, ref in zip(out.attentions, ref_maps):
        assert maps.shape == (2, H, 7, 7)
        rows = mask.bool()[:, None, :, None].expand_as(maps)  # valid query rows
        torch.testing.assert_close(maps[rows].double(), ref[rows], atol=2e-6, rtol=0)
    # The returned maps are the tensors the output is computed from (gradients reach them).
    for maps in out.attentions:
        maps.retain_grad()
    out.logits.sum().backward()
    assert all(maps.grad is not None and maps.grad.abs().sum() > 0 for maps in out.attentions)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_eager_attention_forward_with_its_defaults_is_a_plain_backend(layout):
    """``eager_attention_forward`` called without ``diff_lambda`` (as a user's AttentionInterface function might) is
    plain eager attention: one output per softmax map, which the module combines; the model still equals the float64
    reference."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    from difftransformer.modeling_difftransformer import eager_attention_forward

    def plain(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out, maps = eager_attention_forward(module, query, key, value, attention_mask, scaling)
        assert out.shape[2] == query.shape[1] and maps.shape[1] == query.shape[1]  # per map, not combined
        return out, maps

    AttentionInterface.register("plain_eager_test", plain)
    ALL_MASK_ATTENTION_FUNCTIONS.register("plain_eager_test", eager_mask)  # eager adds a float mask
    model = _model(layout, "plain_eager_test")
    ids, mask = left_padded_batch(model.config.vocab_size, [7, 4], seed=3)
    ref_logits, _ = reference_forward(model, ids, mask)
    logits = model(ids, attention_mask=mask).logits
    rows = mask.bool()
    torch.testing.assert_close(logits[rows].double(), ref_logits[rows], atol=TOL[torch.float32], rtol=0)


def test_lambdas_are_inspectable():
    v1 = _model("v1_gqa", "sdpa")
    lam = v1.layer_lambdas()
    for layer, attn in enumerate(m for m in v1.modules() if isinstance(m, DiffTransformerAttention)):
        expected = (
            math.exp(float(attn.lambda_q1 @ attn.lambda_k1))
            - math.exp(float(attn.lambda_q2 @ attn.lambda_k2))
            + 0.8
            - 0.6 * math.exp(-0.3 * layer)
        )
        assert lam[layer].item() == pytest.approx(expected, rel=1e-6)
    out = v1(torch.tensor([[5, 6, 7]]), output_lambdas=True)
    torch.testing.assert_close(torch.stack(out.lambdas), lam)

    v2 = _model("v2_gqa", "sdpa")
    ids = torch.tensor([[5, 6, 7, 8]])
    out = v2(ids, output_lambdas=True, output_hidden_states=True)
    assert len(out.lambdas) == v2.config.num_hidden_layers
    for layer, lam in enumerate(out.lambdas):
        assert lam.shape == (1, 4, v2.config.num_attention_heads // 2)
        layer_mod = v2.model.layers[layer]
        x = layer_mod.input_layernorm(out.hidden_states[layer])
        torch.testing.assert_close(lam, torch.sigmoid(layer_mod.self_attn.lambda_proj(x)))
    with pytest.raises(ValueError, match="output_lambdas"):
        v2.layer_lambdas()


def test_constant_lambda_init_option():
    model = _model("v1_gqa", "sdpa", lambda_init=0.8)
    assert all(m.lambda_init == 0.8 for m in model.modules() if isinstance(m, DiffTransformerAttention))
    ids, _ = left_padded_batch(model.config.vocab_size, [6], seed=4)
    ref, _ = reference_forward(model, ids)
    torch.testing.assert_close(model(ids).logits.double(), ref, atol=2e-5, rtol=0)


# --- Hand-set weights: a wrong pairing of maps, keys or value halves cannot pass. -------------------------------


def _pairing_case(version, hq, hkv, seed=0):
    """One attention layer whose map (h, c) provably attends to exactly one known position.

    Tokens are one-hot inputs x_t = e_t. Identity rotary (cos = 1, sin = 0). Each softmax map is made to point at
    a distinct position p(h, c); the expected output is then V(x_p(h,0)) − λ·V(x_p(h,1)) per head, computed from
    the row order of docs/model.md on the value weights alone.
    """
    torch.manual_seed(seed)
    d, H = 8, hq // 2
    G = hkv // 2 if version == 1 else hkv
    n = H // G
    width = 2 * d if version == 1 else d
    E = max(H * width, 32)
    cfg = tiny_config(
        "v1_gqa", hidden_size=E, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d, diff_version=version
    )
    attn = DIFF_ATTENTION_CLASSES[version](cfg, layer_idx=2).eval()
    big = 60.0
    T = 2 * H + 1  # distinct target position per map, and a final query token
    with torch.no_grad():
        for p in attn.parameters():
            p.zero_()
        attn.o_proj.weight[:, : H * width] = torch.eye(E)[:, : H * width]
        attn.v_proj.weight.normal_()
        last = T - 1
        targets = {}
        for h in range(H):
            g, r = divmod(h, n)
            for c in range(2):
                targets[h, c] = 2 * h + c
                if version == 1:
                    qi, kj, u = (2 * g + c) * n + r, 2 * g + c, r  # map c of head h uses K[g, c]; direction r
                else:
                    qi, kj, u = 2 * h + c, g, 2 * r + c  # V2: both maps share K[g]; direction per map
                # key head kj puts position targets[h, c] on direction u; query qi looks along u (last token).
                attn.k_proj.weight[kj * d + u, targets[h, c]] = big
                attn.q_proj.weight[qi * d + u, last] = 1.0
        if version == 1:
            attn.lambda_q1.normal_(0, 0.3), attn.lambda_k1.normal_(0, 0.3)
            attn.lambda_q2.normal_(0, 0.3), attn.lambda_k2.normal_(0, 0.3)
            attn.subln.weight.fill_(1.0)
        else:
            attn.lambda_proj.weight.normal_()
    x = torch.eye(E)[:T][None]  # (1, T, E)
    cos, sin = torch.ones(1, T, d), torch.zeros(1, T, d)
    Wv = attn.v_proj.weight.view(hkv, d, E)
    expected = []
    for h in range(H):
        g, r = divmod(h, n)
        if version == 1:
            value = lambda t: torch.cat([Wv[2 * g, :, t], Wv[2 * g + 1, :, t]])  # noqa: E731
            lam = attn.lambda_full()
            o = value(targets[h, 0]) - lam * value(targets[h, 1])
            o = o * torch.rsqrt(o.pow(2).mean() + cfg.subln_eps) * (1 - attn.lambda_init)
        else:
            lam = torch.sigmoid(attn.lambda_proj.weight[h] @ x[0, last])
            o = Wv[g, :, targets[h, 0]] - lam * Wv[g, :, targets[h, 1]]
        expected.append(o)
    expected = torch.cat(expected)
    return attn, x, (cos, sin), expected, H * width


@pytest.mark.parametrize("version,hq,hkv", [(1, 8, 4), (1, 8, 2), (1, 8, 8), (2, 8, 2), (2, 8, 4)])
@pytest.mark.parametrize(
    "attn_impl,mask_kind",
    [("eager", "additive"), ("sdpa", "additive"), ("sdpa", "bool"), ("sdpa", "none"), ("contract_sdpa", "bool")],
)
def test_hand_set_weights_pair_maps_keys_and_values_as_the_paper(version, hq, hkv, attn_impl, mask_kind):
    """Every kernel path: an additive float mask (transformers' sdpa call), a boolean mask and no mask (V1's own
    kernel under "sdpa"), and the padded single call that flash/flex receive (through the contract checker)."""
    attn, x, pos, expected, width = _pairing_case(version, hq, hkv)
    attn.config._attn_implementation = attn_impl
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()[None, None]
    mask = {"additive": torch.zeros(causal.shape).masked_fill(~causal, float("-inf")), "bool": causal, "none": None}[
        mask_kind
    ]
    with torch.no_grad():
        out, _, _ = attn(x, pos, attention_mask=mask)
    torch.testing.assert_close(out[0, -1, :width], expected, atol=1e-4, rtol=1e-4)


def test_auto_model_from_config_and_task_heads():
    from transformers import (
        AutoModel,
        AutoModelForQuestionAnswering,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    cfg = tiny_config("v2_gqa", num_labels=3)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert type(AutoModelForCausalLM.from_config(cfg)).__name__ == "DiffTransformerForCausalLM"
    assert AutoModel.from_config(cfg)(ids).last_hidden_state.shape == (1, 4, cfg.hidden_size)
    assert AutoModelForSequenceClassification.from_config(cfg)(ids).logits.shape == (1, 3)
    assert AutoModelForTokenClassification.from_config(cfg)(ids).logits.shape == (1, 4, 3)
    qa = AutoModelForQuestionAnswering.from_config(cfg)(ids)
    assert qa.start_logits.shape == qa.end_logits.shape == (1, 4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_differential_attention_is_float64_end_to_end(layout, attn):
    """Under ``model.double()`` everything this package computes stays float64 (λ, the kernels, V1's per-head norm):
    one attention layer equals the float64 reference to float64 rounding. (The layers around it are transformers'
    Llama blocks: LlamaRMSNorm and the rotary tables compute in float32 whatever the model's dtype.)"""
    model = _model(layout, attn, dtype=torch.float64)
    attn_module = model.model.layers[1].self_attn
    t = 7
    x = torch.randn(1, t, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    d, theta = model.config.head_dim, model.config.rope_parameters["rope_theta"]
    angles = torch.arange(t, dtype=torch.float64)[:, None] / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[None], torch.cat([angles.sin()] * 2, -1)[None]
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    # eager takes transformers' additive mask; sdpa's convention is no mask for plain causal attention (V1's kernel)
    mask = None if attn == "sdpa" else torch.zeros(1, 1, t, t, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        out, _, lam = attn_module(x, (cos, sin), attention_mask=mask)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    ref, _, ref_lam = reference_attention(
        state, "model.layers.1.self_attn.", model.config, x[0], torch.arange(t), allowed, 1
    )
    assert out.dtype == lam.dtype == torch.float64
    torch.testing.assert_close(out[0], ref, atol=1e-13, rtol=0)
    torch.testing.assert_close(lam.reshape(ref_lam.shape), ref_lam, atol=1e-14, rtol=0)


ROPE_SCALINGS = {
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 16},
    "longrope": {
        "short_factor": [1.0, 1.1, 1.2, 1.3],
        "long_factor": [2.0, 2.5, 3.0, 3.5],
        "original_max_position_embeddings": 16,
    },
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_SCALINGS))
def test_rope_scaling_is_transformers_own(rope_type, tmp_path):
    """Every rope scaling type of transformers: a V2 upcycle (exact, docs/convert.md) gives its Llama's logits over 40
    positions, beyond the 16 "original" ones where the scalings differ from the default."""
    from difftransformer.convert import convert

    rope = {"rope_type": rope_type, "rope_theta": 1000.0, **ROPE_SCALINGS[rope_type]}
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=64, rope_parameters=rope)).eval()  # fmt: skip
    llama.save_pretrained(tmp_path / "llama")
    convert("llama", tmp_path / "llama", tmp_path / "v2", diff_version=2, progress=False)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "v2").eval()
    assert ours.config.rope_parameters["rope_type"] == rope_type
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, llama(ids).logits, rtol=1e-5, atol=1e-5)


def test_bfloat16_loading_keeps_lambda_float32_and_casting_does_not(tmp_path):
    """What docs/model.md says about λ's dtype: from_pretrained(dtype=bf16) keeps the λ vectors float32 (λ is then
    computed from float32 vectors), .to(bf16) casts them like every parameter."""
    DiffTransformerForCausalLM(tiny_config("v1_gqa")).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    attn = loaded.model.layers[0].self_attn
    assert attn.q_proj.weight.dtype == torch.bfloat16
    assert {p.dtype for p in (attn.lambda_q1, attn.lambda_k1, attn.lambda_q2, attn.lambda_k2)} == {torch.float32}
    assert attn.lambda_full().dtype == torch.float32
    assert loaded.to(torch.bfloat16).model.layers[0].self_attn.lambda_q1.dtype == torch.bfloat16


def test_lambda_and_norm_weight_are_kept_within_generate_and_fresh_after_any_parameter_write():
    """V1's λ and its per-head norm's scaled weight are computed once per ``generate()`` call (a decode step launches
    nothing for them) and inside ``fixed_parameters()``; outside, every call sees the parameters as they are, also
    after a fused AdamW step (which does not move version counters) or a write through ``param.data``. A value kept
    under inference_mode is a plain tensor: training with frozen λ afterwards works."""
    torch.manual_seed(0)
    model = DiffTransformerForCausalLM(tiny_config("v1_gqa")).eval()
    model.generation_config.eos_token_id = None
    attn = model.model.layers[0].self_attn
    layers = len(model.model.layers)
    ids = torch.randint(3, model.config.vocab_size, (1, 6))
    computed = []
    compute = mdt.DiffTransformerV1Attention._lambda_from

    def counted(self, *params):
        computed.append(self)
        return compute(self, *params)

    def fresh():
        with torch.no_grad():
            return torch.stack([compute(m, m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2) for m in attentions])

    attentions = [m for m in model.modules() if isinstance(m, mdt.DiffTransformerV1Attention)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mdt.DiffTransformerV1Attention, "_lambda_from", counted)
        model.generate(ids, max_new_tokens=4, do_sample=False)
        assert len(computed) == layers  # once per layer for 1 prefill + 3 decode steps
        computed.clear()
        with torch.no_grad():
            model(ids), model(ids)
        assert len(computed) == 2 * layers  # outside a block: every call
        computed.clear()
        with model.fixed_parameters(), torch.inference_mode():
            model(ids)
            kept = attn.lambda_full()
            assert kept is attn.lambda_full() and len(computed) == layers
    assert "_lambda" not in attn.__dict__  # dropped when the block is left
    # A fused optimiser step writes λ without moving its version counter: the next call sees the new λ anyway.
    model.train()
    before = model.layer_lambdas()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    after = model.layer_lambdas()
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, fresh(), rtol=0, atol=0)
    with torch.no_grad():
        attn.subln.weight.data.mul_(3)  # through .data
        weight = attn.subln.weight.detach() * 0.5
        torch.testing.assert_close(attn.subln.scaled_weight(0.5, torch.float32), weight, rtol=0, atol=0)
    # λ frozen, the rest trains (an adapter's case), after values were kept under inference_mode
    for name, p in model.named_parameters():
        p.requires_grad_("lambda_" not in name and "subln" not in name)
    with model.fixed_parameters(), torch.inference_mode():
        model.eval()(ids)
        model.train().zero_grad(set_to_none=True)
    with model.fixed_parameters():
        model(ids, labels=ids).loss.backward()  # an inference tensor saved for the backward would raise here
    assert attn.q_proj.weight.grad is not None and attn.lambda_q1.grad is None


@pytest.mark.parametrize("version", [1, 2])
def test_each_layer_makes_one_attention_lookup_and_one_call(version):
    """Each attention forward looks its function up once in the modeling file's ``ALL_ATTENTION_FUNCTIONS`` and calls
    it once with ``scaling=self.scaling``: the pattern vLLM's Transformers backend reads from a forward's source to find
    a layer's attention and its scale (as in Llama's forward)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(DIFF_ATTENTION_CLASSES[version].forward)))
    names = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
        and isinstance(node.value.func.value, ast.Name)
        and node.value.func.value.id == "ALL_ATTENTION_FUNCTIONS"
        and node.value.func.attr == "get_interface"
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
    }
    calls = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in names
    ]
    assert len(names) == 1 and len(calls) == 1, (names, len(calls))
    (scaling,) = [kw.value for kw in calls[0].keywords if kw.arg == "scaling"]
    assert ast.unparse(scaling) == "self.scaling"
    assert isinstance(mdt.ALL_ATTENTION_FUNCTIONS, mdt.DifferentialAttentionInterface)


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
@pytest.mark.parametrize("t", [5, CAUSAL_BLOCK_MIN_LENGTH])
def test_every_attention_entry_returns_the_heads_the_output_projection_reads(layout, t):
    """Every entry of the modeling file's attention interface that runs on a CPU, called as a layer calls it for a
    prompt it serves, returns the same thing: the H heads ``(B, T, H, w)`` as the output projection reads them (V1:
    after its per-head norm), equal to the eager entry's within float32 rounding, and λ. (V2's causal blocks serve
    float32 prompts of ``CAUSAL_BLOCK_MIN_LENGTH`` tokens and more.)"""
    model = _model(layout, "sdpa")
    attn = model.model.layers[0].self_attn
    b = 2
    torch.manual_seed(1)
    hidden = torch.randn(b, t, model.config.hidden_size)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(t)[None].expand(b, t))
    with torch.no_grad():
        query, key, value = attn.project(hidden, (cos, sin), None, {})
        diff_lambda = attn.lambda_full() if attn.diff_version == 1 else attn.lambda_proj(hidden)
        args = (attn, query.transpose(1, 2), key, value, None)
        kwargs = dict(scaling=attn.scaling, dropout=0.0, diff_lambda=diff_lambda, cache=None)
        causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None].expand(b, 1, t, t)
        want, _, want_lam = mdt.ALL_ATTENTION_FUNCTIONS["eager"](
            attn,
            query.transpose(1, 2),
            key,
            value,
            torch.zeros(b, 1, t, t).masked_fill(~causal, float("-inf")),
            **kwargs,
        )
        width = attn.value_width
        assert want.shape == (b, t, attn.num_heads, width)
        served = {"causal_blocks": t >= CAUSAL_BLOCK_MIN_LENGTH and FLASH_CPU_READS_GROUPED_KEYS}
        served |= {"triton": False, "decode_kernel": False}
        names = [n for n in mdt.KERNELS[attn.diff_version] if served.get(n, n != "rows_decode")]
        for name in names:
            got, weights, lam = mdt.KERNELS[attn.diff_version][name](*args, **kwargs)
            assert got.shape == (b, t, attn.num_heads, width), name
            torch.testing.assert_close(got, want, atol=2e-6, rtol=0, msg=name)
            torch.testing.assert_close(lam, want_lam, msg=name)
        got, _, _ = mdt.ALL_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


def test_a_v2_float32_prompt_of_causal_block_length_under_sdpa_equals_the_reference():
    """A V2 model's float32 prompt of ``CAUSAL_BLOCK_MIN_LENGTH`` tokens under sdpa, on every torch the package
    supports: the logits equal the float64 reference. The causal blocks run where torch's CPU flash kernels read grouped
    keys (torch 2.7's return values that are not finite there: transformers' sdpa call instead)."""
    model = _model("v2_gqa", "sdpa")
    ids = torch.randint(
        3, model.config.vocab_size, (1, CAUSAL_BLOCK_MIN_LENGTH), generator=torch.Generator().manual_seed(2)
    )
    mask = torch.ones_like(ids)
    ref, _ = reference_forward(model, ids, mask)
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits.double(), ref, atol=TOL[torch.float32], rtol=0)
    kernel = "causal_blocks" if FLASH_CPU_READS_GROUPED_KEYS else "standard"
    assert {m.last_kernel for m in model.modules() if isinstance(m, DiffTransformerAttention)} == {kernel}
