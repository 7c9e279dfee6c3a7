"""Checks of the Motif test oracle (tests/motif_reference.py) against the published facts it is built from.

- PolyNorm against the test vectors published in junhoyeo/mlx-motif's fixtures.
- The loop-simple attention equals an independently written "four attentions" formula (vLLM's differential
  flash-attention backend: A1 V1, A1 V2, A2 V1, A2 V2) and the single-map formula (A1 - lambda A2)[V1; V2].
- GDA (r = 4) equals the r = 1 model whose noise query rows are duplicated r times (the published claim).
- The whole r = 1 forward equals a vectorised re-statement (RoPE as a complex rotation, norms inline).
- Checkpoint key layout; left padding; the released shapes (one layer) run in float32.
"""

import math

import pytest
import torch

from motif_reference import (
    differential_attention_core,
    gda_as_diff_v1,
    lambda_init,
    motif_config,
    motif_forward,
    motif_head_layout,
    motif_state_dict_shapes,
    polynorm,
    random_motif_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

F64 = torch.float64


# ---------------------------------------------------------------------------------------------------------- PolyNorm


def test_polynorm_published_vectors():
    # junhoyeo/mlx-motif tests/fixtures/motif_parity_cases.json, "polynorm_reference_2x3" (eps 1e-6)
    x = torch.tensor([[-1.5, -0.5, 0.0], [0.5, 1.0, 2.0]], dtype=F64)
    expected = torch.tensor(
        [
            [-0.5263191243230241, -0.10430044066400287, 0.125],
            [0.3508009408581749, 0.6717202624593248, 1.7277992321668438],
        ],
        dtype=F64,
    )
    got = polynorm(x, torch.tensor([0.2, 0.3, 0.5], dtype=F64), torch.tensor([0.125], dtype=F64), eps=1e-6)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    # swift/Tests/MotifKitTests/Fixtures/motif_golden_config.json "polynorm" (1-D input, scalar bias)
    x = torch.tensor([1.0, -2.0, 0.5, -0.25], dtype=F64)
    expected = torch.tensor([0.554770091995, -0.683406429142, 0.228869676585, -0.007551984844], dtype=F64)
    got = polynorm(x, torch.tensor([0.4, 0.3, 0.3], dtype=F64), torch.tensor(0.05, dtype=F64))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-11)
    # low-precision input: computed in float32, returned in the input dtype
    xb = torch.randn(3, 8).to(torch.bfloat16)
    yb = polynorm(xb, torch.ones(3) / 3, torch.zeros(1))
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(
        yb.float(), polynorm(xb.float(), torch.ones(3) / 3, torch.zeros(1)), rtol=1e-2, atol=1e-2
    )


def test_lambda_init_is_shifted_by_one_layer():
    assert lambda_init(0) == pytest.approx(0.8 - 0.6 * math.exp(0.3))
    assert lambda_init(0) == pytest.approx(-0.0099152845, abs=1e-9)
    assert lambda_init(1) == pytest.approx(0.2)
    assert lambda_init(2) == pytest.approx(0.8 - 0.6 * math.exp(-0.3))


# ---------------------------------------------------------------------------------------------- attention formulas


def _causal(t):
    return torch.ones(t, t, dtype=torch.bool).tril()


def _softmax_masked(scores, allowed):
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


def _four_attentions_r1(q, k, v, lam, lam_init, w, eps):
    """vLLM's DifferentialFlashAttentionImpl.forward, restated vectorised: "(H two)" split of q, k, v; four causal
    attentions with the GQA rule i // (H / G); [A1V1, A1V2] - lambda [A2V1, A2V2]; per-head RMSNorm; (1 - lambda_init);
    heads back to "(H two) D" order."""
    b, hq, t, d = q.shape
    h, g = hq // 2, k.shape[1] // 2
    q1, q2 = q.view(b, h, 2, t, d).unbind(2)
    k1, k2 = k.view(b, g, 2, t, d).unbind(2)
    v1, v2 = v.view(b, g, 2, t, d).unbind(2)
    rep = h // g
    k1, k2, v1, v2 = (x.repeat_interleave(rep, dim=1) for x in (k1, k2, v1, v2))

    def attn(qq, kk, vv):
        return _softmax_masked(qq @ kk.transpose(-1, -2) / math.sqrt(d), _causal(t)) @ vv

    a1 = torch.cat([attn(q1, k1, v1), attn(q1, k1, v2)], dim=-1)
    a2 = torch.cat([attn(q2, k2, v1), attn(q2, k2, v2)], dim=-1)
    o = a1 - lam * a2
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + eps) * w * (1 - lam_init)  # (b, h, t, 2d)
    return o.transpose(1, 2).reshape(b, t, h * 2 * d)


def _single_map_r1(q, k, v, lam, lam_init, w, eps):
    """The paper's form: (softmax(Q1 K1^T) - lambda softmax(Q2 K2^T)) [V1; V2], same pairing as above."""
    b, hq, t, d = q.shape
    h, g = hq // 2, k.shape[1] // 2
    out = []
    for head in range(h):
        kv = head // (h // g)
        a1 = _softmax_masked(q[:, 2 * head] @ k[:, 2 * kv].transpose(-1, -2) / math.sqrt(d), _causal(t))
        a2 = _softmax_masked(q[:, 2 * head + 1] @ k[:, 2 * kv + 1].transpose(-1, -2) / math.sqrt(d), _causal(t))
        o = (a1 - lam * a2) @ torch.cat([v[:, 2 * kv], v[:, 2 * kv + 1]], dim=-1)
        out.append(o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * w * (1 - lam_init))
    return torch.cat(out, dim=-1)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 4), (8, 2)])
def test_attention_core_r1_equals_four_attentions(hq, hkv):
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    b, t, d = 2, 7, 8
    cfg = motif_config("tiny", num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d)
    layout = motif_head_layout(cfg)
    q = torch.randn(b, hq, t, d, generator=gen, dtype=F64)
    k = torch.randn(b, hkv, t, d, generator=gen, dtype=F64)
    v = torch.randn(b, hkv, t, d, generator=gen, dtype=F64)
    w = 1 + 0.1 * torch.randn(2 * d, generator=gen, dtype=F64)
    lam, lam_init = 0.37, 0.2
    got = differential_attention_core(q, k, v, lam, lam_init, w, 1e-5, layout)
    torch.testing.assert_close(got, _four_attentions_r1(q, k, v, lam, lam_init, w, 1e-5), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, _single_map_r1(q, k, v, lam, lam_init, w, 1e-5), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("hn,hkv", [(2, 4), (2, 2), (4, 4)])
def test_gda_core_equals_r1_with_duplicated_noise_rows(hn, hkv):
    """GDA with r = 4: the r = 1 four-attention formula on the query rows [signal i, noise i // r] gives the same."""
    gen = torch.Generator().manual_seed(100 + hn * 10 + hkv)
    r, b, t, d = 4, 2, 6, 8
    hq = hn * (r + 1)
    cfg = motif_config("tiny-gda", num_attention_heads=hq, num_noise_heads=hn, num_key_value_heads=hkv, head_dim=d)
    layout = motif_head_layout(cfg)
    assert layout["r"] == r and layout["hs"] == hn * r
    q = torch.randn(b, hq, t, d, generator=gen, dtype=F64)
    k = torch.randn(b, hkv, t, d, generator=gen, dtype=F64)
    v = torch.randn(b, hkv, t, d, generator=gen, dtype=F64)
    w = 1 + 0.1 * torch.randn(2 * d, generator=gen, dtype=F64)
    got = differential_attention_core(q, k, v, -0.4, 0.5, w, 1e-5, layout)
    # rebuild the query rows by hand: group g holds [s_g0 .. s_g3, n_g]
    pairs = []
    for g in range(hn):
        for j in range(r):
            pairs += [q[:, g * (r + 1) + j], q[:, g * (r + 1) + r]]
    q_r1 = torch.stack(pairs, dim=1)
    want = _four_attentions_r1(q_r1, k, v, -0.4, 0.5, w, 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------------- full model


def _rope_complex(x, pos, theta):
    """NeoX RoPE restated as a complex rotation of the pairs (x_i, x_{i + d/2})."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=F64) / d)
    rot = torch.polar(torch.ones(len(pos), d // 2, dtype=F64), pos[:, None].to(F64) * inv)
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * rot
    return torch.cat([z.real, z.imag], dim=-1)


def _vectorised_forward_r1(cfg, sd, ids):
    sd = {k: v.to(F64) for k, v in sd.items()}
    e, hq, hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or e // hq
    eps = cfg["rms_norm_eps"]
    b, t = ids.shape
    pos = torch.arange(t)

    def rms(x, w, eps_):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps_) * w

    def pn(x, w, bias):
        return sum(w[i] * rms(x ** (3 - i), 1.0, 1e-6) for i in range(3)) + bias

    h = sd["model.embed_tokens.weight"][ids]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        x = rms(h, sd[p + "input_layernorm.weight"], eps)
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(b, t, hq, d).transpose(1, 2)
        k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(b, t, hkv, d).transpose(1, 2)
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(b, t, hkv, d).transpose(1, 2)
        q, k = _rope_complex(q, pos, cfg["rope_theta"]), _rope_complex(k, pos, cfg["rope_theta"])
        li = 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))
        lam = (
            torch.exp((sd[p + "self_attn.lambda_q1"] * sd[p + "self_attn.lambda_k1"]).sum())
            - torch.exp((sd[p + "self_attn.lambda_q2"] * sd[p + "self_attn.lambda_k2"]).sum())
            + li
        )
        a = _four_attentions_r1(q, k, v, lam, li, sd[p + "self_attn.subln.weight"], cfg["attn_rms_norm_eps"])
        h = h + a @ sd[p + "self_attn.o_proj.weight"].T
        x = rms(h, sd[p + "post_attention_layernorm.weight"], eps)
        act = pn(x @ sd[p + "mlp.gate_proj.weight"].T, sd[p + "mlp.act_fn.weight"], sd[p + "mlp.act_fn.bias"])
        h = h + (act * (x @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T
    h = rms(h, sd["model.norm.weight"], eps)
    head = sd["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else sd["lm_head.weight"]
    return h @ head.T


@pytest.mark.parametrize("kind", ["tiny-mha", "tiny-gqa"])
def test_forward_r1_equals_vectorised_restatement(kind):
    cfg = motif_config(kind)
    sd = random_motif_checkpoint(cfg, seed=3)
    ids = torch.randint(0, cfg["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    got = motif_forward(cfg, sd, ids)
    torch.testing.assert_close(got, _vectorised_forward_r1(cfg, sd, ids), rtol=1e-10, atol=1e-10)


def test_gda_model_equals_r1_model_with_duplicated_noise_rows():
    cfg = motif_config("tiny-gda")
    sd = random_motif_checkpoint(cfg, seed=5)
    cfg1, sd1 = gda_as_diff_v1(cfg, sd)
    assert cfg1["num_attention_heads"] == 16 and "num_noise_heads" not in cfg1
    assert motif_head_layout(cfg1)["r"] == 1
    assert sd1["model.layers.0.self_attn.q_proj.weight"].shape == (16 * 16, 64)
    ids = torch.randint(0, cfg["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(motif_forward(cfg, sd, ids), motif_forward(cfg1, sd1, ids), rtol=1e-10, atol=1e-10)
    # and the r = 1 rewrite is an ordinary model the vectorised restatement agrees with
    torch.testing.assert_close(
        motif_forward(cfg1, sd1, ids), _vectorised_forward_r1(cfg1, sd1, ids), rtol=1e-10, atol=1e-10
    )


def test_noise_rows_matter():
    """Guard against a vacuous GDA test: permuting the groups' noise rows changes the output."""
    cfg = motif_config("tiny-gda")
    sd = random_motif_checkpoint(cfg, seed=6)
    ids = torch.randint(0, cfg["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(2))
    ref = motif_forward(cfg, sd, ids)
    bad = dict(sd)
    w = sd["model.layers.1.self_attn.q_proj.weight"].view(10, 16, 64).clone()
    w[[4, 9]] = w[[9, 4]]  # swap the two groups' noise heads
    bad["model.layers.1.self_attn.q_proj.weight"] = w.view(160, 64)
    assert (motif_forward(cfg, bad, ids) - ref).abs().max() > 1e-3


def test_left_padding_matches_unpadded():
    cfg = motif_config("tiny-gda")
    sd = random_motif_checkpoint(cfg, seed=7)
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(0, cfg["vocab_size"], (1, 7), generator=gen)
    bseq = torch.randint(0, cfg["vocab_size"], (1, 4), generator=gen)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), bseq], dim=1)])
    mask = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]])
    got = motif_forward(cfg, sd, ids, attention_mask=mask)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[0], motif_forward(cfg, sd, a)[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1, 3:], motif_forward(cfg, sd, bseq)[0], rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------ layout and random weights


def test_checkpoint_key_layout():
    cfg = motif_config("tiny-gda")
    sd = random_motif_checkpoint(cfg, seed=0)
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.lambda_q1",
        "self_attn.lambda_k1",
        "self_attn.lambda_q2",
        "self_attn.lambda_k2",
        "self_attn.subln.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "mlp.act_fn.weight",
        "mlp.act_fn.bias",
    ]
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    expected |= {f"model.layers.{i}.{n}" for i in range(2) for n in per_layer}
    assert set(sd) == expected
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (10 * 16, 64)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (4 * 16, 64)
    assert sd["model.layers.0.self_attn.o_proj.weight"].shape == (64, 2 * 8 * 16)
    assert sd["model.layers.0.self_attn.subln.weight"].shape == (32,)
    assert sd["model.layers.0.self_attn.lambda_q1"].shape == (16,)
    assert sd["model.layers.0.mlp.act_fn.weight"].shape == (3,) and sd["model.layers.0.mlp.act_fn.bias"].shape == (1,)
    # tied: no lm_head.weight; biases: q/k/v/o and MLP biases appear with use_bias
    assert "lm_head.weight" not in random_motif_checkpoint(motif_config("tiny-gqa"))
    biased = motif_state_dict_shapes(motif_config("tiny", use_bias=True))
    assert {
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.o_proj.bias",
        "model.layers.0.mlp.down_proj.bias",
    } <= set(biased)
    # the released 12.7B shapes
    big = motif_state_dict_shapes(motif_config("12.7b"))
    assert big["model.layers.0.self_attn.q_proj.weight"] == (40 * 128, 4096)
    assert big["model.layers.0.self_attn.k_proj.weight"] == (16 * 128, 4096)
    assert big["model.layers.0.self_attn.o_proj.weight"] == (4096, 8192)
    assert big["model.layers.39.self_attn.subln.weight"] == (256,)
    assert motif_head_layout(motif_config("12.7b"))["r"] == 4
    small = motif_state_dict_shapes(motif_config("2.6b"))
    assert small["model.layers.0.self_attn.o_proj.weight"] == (2048, 2048) and "lm_head.weight" not in small


def test_random_checkpoint_is_deterministic_and_not_degenerate():
    cfg = motif_config("tiny-gda")
    sd = random_motif_checkpoint(cfg, seed=11)
    again = random_motif_checkpoint(cfg, seed=11)
    assert all(torch.equal(sd[k], again[k]) for k in sd)
    assert random_motif_checkpoint(cfg, seed=11, dtype=torch.bfloat16)["lm_head.weight"].dtype == torch.bfloat16
    ids = torch.randint(0, cfg["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(4))
    logits = motif_forward(cfg, sd, ids)
    assert 1.0 < logits.std() < 10.0
    probs = logits.softmax(-1)
    assert probs.max(-1).values.max() < 0.99 and probs.max(-1).values.min() > 2.0 / cfg["vocab_size"]
    assert (logits[:, 1:] - logits[:, :-1]).abs().mean() > 0.5  # positions differ
    # lambda departs from lambda_init, so its formula is exercised
    p = "model.layers.1.self_attn."
    lam = torch.exp((sd[p + "lambda_q1"] * sd[p + "lambda_k1"]).sum()) - torch.exp(
        (sd[p + "lambda_q2"] * sd[p + "lambda_k2"]).sum()
    )
    assert abs(lam) > 0.05


# ------------------------------------------------------------------------------------------------ configs and shapes


def test_config_validation():
    with pytest.raises(NotImplementedError, match="k_ratio"):
        motif_config("tiny-gda", k_ratio=2)
    with pytest.raises(ValueError, match="even"):
        motif_config("tiny", num_key_value_heads=3)
    with pytest.raises(ValueError, match="multiple"):
        motif_config("tiny-gda", num_noise_heads=3, num_attention_heads=10)
    with pytest.raises(NotImplementedError, match="rope_scaling"):
        motif_config("tiny", rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert motif_head_layout(motif_config("tiny"))["hn"] == 4  # num_noise_heads absent: Hq / 2
    assert "num_noise_heads" not in motif_config("2.6b") and motif_config("12.7b")["num_noise_heads"] == 8
