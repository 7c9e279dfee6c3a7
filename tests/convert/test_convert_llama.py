"""Llama / Mistral / Qwen2 → difftransformer (docs/convert.md): exact V2 upcycling, approximate V1 upcycling, config."""

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from difftransformer import DiffTransformerForCausalLM
from difftransformer.convert import ConversionError, calibrate_v1_output_scales, convert
from difftransformer.modeling_difftransformer import lambda_init_fn

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one thread for these tests, not for the whole session

IDS = torch.tensor([[5, 17, 3, 44, 9, 60, 2, 31, 12, 7, 50, 23], [8, 8, 1, 90, 34, 6, 71, 5, 19, 28, 3, 66]])
MASK = torch.tensor([[1] * 12, [0, 0, 0] + [1] * 9])
COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip


def llama_like(kind, hq=6, hkv=2, seed=0, **overrides):
    torch.manual_seed(seed)
    cls, cfg_cls = {
        "llama": (LlamaForCausalLM, LlamaConfig),
        "mistral": (MistralForCausalLM, MistralConfig),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config),
    }[kind]
    model = cls(
        cfg_cls(**{**COMMON, "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": 8, **overrides})
    ).eval()
    with torch.no_grad():  # non-trivial norms and biases, so that every tensor's placement matters
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def masked_logits(model, attn="sdpa"):
    model.set_attn_implementation(attn)
    with torch.no_grad():
        return model(IDS, attention_mask=MASK).logits[MASK.bool()]


CASES = {
    "llama_gqa": ("llama", 6, 2, {}),
    "llama_mha_bias_tied_rope_scaling": (
        "llama", 4, 4,
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}),
    ),
    "mistral_gqa": ("mistral", 8, 2, dict(sliding_window=None)),
    "qwen2_gqa": ("qwen2", 6, 3, {}),  # q/k/v biases, no o_proj bias, odd KV head count
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_upcycle_to_v2_is_exact(tmp_path, case):
    kind, hq, hkv, overrides = CASES[case]
    source = llama_like(kind, hq, hkv, **overrides)
    source.save_pretrained(tmp_path / "src")
    result = convert("llama", tmp_path / "src", tmp_path / "v2", diff_version=2, progress=False)
    cfg = result.config
    assert result.exact and cfg.diff_version == 2
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2 * hq, hkv, 8)
    assert cfg.rope_parameters == source.config.rope_parameters
    assert cfg.tie_word_embeddings == source.config.tie_word_embeddings
    assert cfg.rms_norm_eps == source.config.rms_norm_eps

    model, info = DiffTransformerForCausalLM.from_pretrained(tmp_path / "v2", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    model.eval()
    for attn in ("eager", "sdpa"):
        torch.testing.assert_close(masked_logits(model, attn), masked_logits(source, attn), atol=1e-5, rtol=1e-5)
    generated = model.generate(IDS[:1], max_new_tokens=8, do_sample=False)
    assert torch.equal(generated, source.generate(IDS[:1], max_new_tokens=8, do_sample=False))


def test_in_memory_model_and_bf16_output(tmp_path):
    source = llama_like("llama", 6, 2, seed=4)
    result = convert("llama", source, tmp_path / "v2", diff_version=2, dtype="bfloat16", verify=True, progress=False)
    assert result.max_logit_diff is not None and result.max_logit_diff < 0.1  # bf16 weights, float32 compute
    with safe_open(tmp_path / "v2" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "v2").config.dtype == torch.bfloat16


def test_upcycle_to_v1_trains(tmp_path):
    """Llama → V1 is approximate (docs/convert.md); the converted model must train: loss falls on a tiny batch."""
    source = llama_like("llama", 8, 4, seed=2)
    result = convert("llama", source, tmp_path / "v1", diff_version=1, seed=7, progress=False)
    assert not result.exact and any("continued training" in n for n in result.notes)
    cfg = result.config
    assert (cfg.diff_version, cfg.num_attention_heads, cfg.num_key_value_heads) == (1, 8, 4)

    model = DiffTransformerForCausalLM.from_pretrained(tmp_path / "v1")
    lambdas = model.layer_lambdas()
    # λ vectors drawn from N(0, lambda_std), not zeros: λ differs from λinit.
    schedule = torch.tensor([lambda_init_fn(layer) for layer in range(cfg.num_hidden_layers)])
    assert torch.isfinite(lambdas).all() and (lambdas - schedule).abs().min() > 1e-4

    torch.manual_seed(0)
    batch = torch.randint(3, 97, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(8):
        loss = model(batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses

    # Same seed, same λ: the approximate conversion is reproducible.
    convert("llama", source, tmp_path / "v1b", diff_version=1, seed=7, progress=False)
    again = DiffTransformerForCausalLM.from_pretrained(tmp_path / "v1b").layer_lambdas()
    torch.testing.assert_close(again, lambdas, rtol=0, atol=0)


def test_upcycle_to_v1_keeps_kv_and_moves_o_proj_blocks(tmp_path):
    """q, k, v unchanged; o_proj column block of query head (g, c, r) moves to half c of head h = g·n + r."""
    source = llama_like("llama", 8, 4, seed=3)
    convert("llama", source, tmp_path / "v1", diff_version=1, progress=False)
    with safe_open(tmp_path / "v1" / "model.safetensors", "pt") as f:
        p = "model.layers.1.self_attn."
        for name in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(f.get_tensor(p + name + ".weight"), source.state_dict()[p + name + ".weight"])
        wo_src, wo = source.state_dict()[p + "o_proj.weight"], f.get_tensor(p + "o_proj.weight")
    d, n = 8, 2  # H = 4 heads, G = 2 groups
    for g in range(2):
        for c in range(2):
            for r in range(n):
                i, h = (2 * g + c) * n + r, g * n + r
                assert torch.equal(wo[:, (2 * h + c) * d : (2 * h + c + 1) * d], wo_src[:, i * d : (i + 1) * d])


def test_v1_pair_needs_even_kv_heads_and_llama_needs_a_version(tmp_path):
    source = llama_like("qwen2", 6, 3)
    with pytest.raises(
        ConversionError, match=r"--v1-init pair needs an even num_key_value_heads.*has 3.*--v1-init duplicate"
    ):
        convert("llama", source, tmp_path / "v1", diff_version=1, v1_init="pair", progress=False)
    with pytest.raises(ConversionError, match="--from llama needs --diff-version"):
        convert("llama", source, tmp_path / "v1", progress=False)
    assert not (tmp_path / "v1").exists()


def test_sliding_window_source_gets_a_note(tmp_path):
    source = llama_like("mistral", 4, 2, sliding_window=16)
    result = convert("llama", source, tmp_path / "v2", diff_version=2, progress=False)
    assert any("sliding_window=16" in note for note in result.notes)


# ------------------------------------------------------------------ V1 by duplication (any head layout)

DUPLICATE_CASES = {
    "odd_3_1": ("llama", 3, 1, 48, 16, {}),
    "odd_9_3": ("llama", 9, 3, 72, 8, {}),
    "even_4_2": ("llama", 4, 2, 48, 12, {}),
    "qwen2_6_3_biases": ("qwen2", 6, 3, 48, 8, {}),
    "mha_bias_tied": ("llama", 3, 3, 48, 8, dict(attention_bias=True, tie_word_embeddings=True)),
}  # fmt: skip


def duplicate_source(case, seed=0):
    kind, hq, hkv, hidden, head_dim, overrides = DUPLICATE_CASES[case]
    return llama_like(kind, hq, hkv, seed=seed, hidden_size=hidden, head_dim=head_dim, **overrides)


@pytest.mark.parametrize("case", list(DUPLICATE_CASES))
def test_v1_duplicate_layout_tensor_by_tensor(tmp_path, case):
    """Every attention tensor of the result against the duplicate method's definition (module docstring of
    difftransformer/convert/llama.py); everything else copied."""
    source = duplicate_source(case)
    hq, hkv, d = source.config.num_attention_heads, source.config.num_key_value_heads, source.config.head_dim
    n = hq // hkv
    result = convert(
        "llama", source, tmp_path / "v1", diff_version=1, v1_init="duplicate", v1_calibration="random", progress=False
    )
    cfg = result.config
    assert (cfg.diff_version, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (1, 2 * hq, 2 * hkv, d)
    assert (cfg.num_diff_heads, cfg.num_kv_groups) == (hq, hkv)
    assert not result.exact and result.info["v1_init"] == "duplicate"
    sd = {k: v.detach() for k, v in source.state_dict().items()}
    scales = result.info["v1_output_scales"]
    model = DiffTransformerForCausalLM.from_pretrained(tmp_path / "v1")
    lambdas = model.layer_lambdas()
    with safe_open(tmp_path / "v1" / "model.safetensors", "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}.self_attn."
        lam_init = lambda_init_fn(layer)
        lam = lambdas[layer].item()
        assert 1 - lam >= 0.5 * (1 - lam_init)  # λ vectors redrawn away from the λ = 1 singularity
        rho = result.info["v1_output_rms"][layer].double()
        expected_scale = torch.sqrt(rho**2 + cfg.subln_eps / (1 - lam) ** 2) / (1 - lam_init)
        torch.testing.assert_close(scales[layer], expected_scale, rtol=1e-6, atol=0)
        for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
            q, k, v = (stored[f"{p}{x}_proj.{kind}"].unflatten(0, (-1, d)) for x in "qkv")
            q_src, k_src, v_src = (sd[f"{p}{x}_proj.{kind}"].unflatten(0, (-1, d)) for x in "qkv")
            for g in range(hkv):
                for c in range(2):
                    assert torch.equal(k[2 * g + c], k_src[g]) and torch.equal(v[2 * g + c], v_src[g])
                    for r in range(n):
                        assert torch.equal(q[(2 * g + c) * n + r], q_src[g * n + r])
        wo, wo_src = stored[p + "o_proj.weight"], sd[p + "o_proj.weight"]
        for h in range(hq):
            block = wo_src[:, h * d : (h + 1) * d].double() * scales[layer][h] / 2
            for c in range(2):
                torch.testing.assert_close(
                    wo[:, (2 * h + c) * d : (2 * h + c + 1) * d].double(), block, rtol=1e-6, atol=0
                )
        if cfg.attention_bias:
            expected_bias = sd.get(p + "o_proj.bias", torch.zeros(cfg.hidden_size))
            assert torch.equal(stored[p + "o_proj.bias"], expected_bias)
        assert torch.equal(stored[p + "subln.weight"], torch.ones(2 * d))
    for key, value in sd.items():
        if ".self_attn." not in key and key in stored:
            assert torch.equal(stored[key], value), key


@pytest.mark.parametrize("case", ["odd_3_1", "odd_9_3", "even_4_2", "qwen2_6_3_biases"])
def test_v1_duplicate_is_exact_where_the_calibration_is(tmp_path, case):
    """Calibrated on one token, ρ is that token's own per-head rms: the V1 model's logits for it equal the source's
    to float32 rounding, under eager and sdpa. A second token (not calibrated on) is only approximated."""
    source = duplicate_source(case, seed=1)
    token = torch.tensor([[17]])
    convert("llama", source, tmp_path / "v1", diff_version=1, v1_init="duplicate", v1_calibration=token, progress=False)
    model = DiffTransformerForCausalLM.from_pretrained(tmp_path / "v1").eval()
    reference = logits_of(source, token)
    for attn in ("eager", "sdpa"):
        model.set_attn_implementation(attn)
        # float32: a few ulps per operation through 2 layers; 1e-5 absolute on logits of order 0.1-1.
        torch.testing.assert_close(logits_of(model, token), reference, rtol=0, atol=1e-5)
    other = torch.tensor([[17, 60, 5]])
    assert (logits_of(model, other) - logits_of(source, other)).abs().max() > 1e-3  # elsewhere approximate


def test_v1_subln_eps_makes_the_duplicated_start_near_exact_everywhere(tmp_path):
    """With V1's per-head norm eps ε large against a head's mean square m (times (1 − λ)²), the norm is near-linear and
    each head's output is off by a relative |ρ² − m_t| / 2ε' at most (ε' = ε/(1 − λ)² ≥ ε): with ε = 1e4 that is ~1e-5
    here, where the paper's ε (the source's rms_norm_eps) leaves errors of order one on tokens not calibrated on."""
    source = duplicate_source("odd_9_3", seed=1)
    other = torch.tensor([[17, 60, 5, 33, 2]])
    reference = logits_of(source, other)
    errors = {}
    for eps in (None, 1e4):
        out = tmp_path / f"v1-{eps}"
        convert(
            "llama",
            source,
            out,
            diff_version=1,
            v1_init="duplicate",
            v1_calibration=other[:, :1],
            v1_subln_eps=eps,
            progress=False,
        )
        model = DiffTransformerForCausalLM.from_pretrained(out).eval()
        assert model.config.subln_eps == (source.config.rms_norm_eps if eps is None else eps)
        errors[eps] = (logits_of(model, other) - reference).abs().max().item()
    assert errors[None] > 1e-3
    assert errors[1e4] < 1e-2 * errors[None], errors
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ConversionError, match="--v1-subln-eps must be a positive finite number"):
            convert("llama", source, tmp_path / "bad", diff_version=1, v1_subln_eps=bad, progress=False)
    with pytest.raises(ConversionError, match="--v1-subln-eps applies to --from llama --diff-version 1 only"):
        convert("llama", source, tmp_path / "bad", diff_version=2, v1_subln_eps=1.0, progress=False)
    assert not (tmp_path / "bad").exists()


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_calibration_is_the_mean_per_token_rms_of_each_heads_o_proj_input():
    source = duplicate_source("odd_9_3", seed=2)
    ids = torch.tensor([[3, 9, 27, 81, 50, 11], [4, 8, 15, 16, 23, 42]])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    seen = []
    hooks = [
        layer.self_attn.o_proj.register_forward_hook(lambda m, args, out: seen.append(args[0]))
        for layer in source.model.layers
    ]
    with torch.no_grad():
        for row in range(2):
            source(ids[row : row + 1], attention_mask=mask[row : row + 1])
    for hook in hooks:
        hook.remove()
    hq, d, layers = 9, 8, source.config.num_hidden_layers
    expected = torch.zeros(layers, hq)
    for layer in range(layers):
        per_token = [
            seen[row * layers + layer][0].view(-1, hq, d).pow(2).mean(-1).sqrt()[mask[row].bool()] for row in range(2)
        ]
        expected[layer] = torch.cat(per_token).mean(0)
    rho = calibrate_v1_output_scales(source, ids, attention_mask=mask)
    torch.testing.assert_close(rho, expected, rtol=1e-6, atol=0)
    # Padding is left out: the same rows without their padded tokens give the same ρ.
    unpadded = [ids[0:1], ids[1:2, 2:]]
    sums = sum(calibrate_v1_output_scales(source, x) * x.shape[1] for x in unpadded)
    torch.testing.assert_close(rho, sums / 10, rtol=1e-5, atol=0)


def test_v1_init_auto_and_option_errors(tmp_path):
    even, odd = llama_like("llama", 8, 4, seed=5), llama_like("qwen2", 6, 3, seed=5)
    assert convert("llama", even, tmp_path / "a", diff_version=1, progress=False).info["v1_init"] == "pair"
    result = convert("llama", odd, tmp_path / "b", diff_version=1, progress=False)
    # An in-memory model has no tokenizer: "auto" calibrates on seeded random ids.
    assert result.info["v1_init"] == "duplicate" and "random token ids (seed 0)" in result.info["calibration"]
    none = convert("llama", odd, tmp_path / "c", diff_version=1, v1_calibration="none", progress=False)
    assert torch.equal(none.info["v1_output_rms"], torch.ones(2, 6))
    with pytest.raises(ConversionError, match=r"--v1-init 'halves'; allowed: \['auto', 'pair', 'duplicate'\]"):
        convert("llama", odd, tmp_path / "d", diff_version=1, v1_init="halves", progress=False)
    with pytest.raises(ConversionError, match="--v1-init duplicate applies to --from llama --diff-version 1 only"):
        convert("llama", odd, tmp_path / "d", diff_version=2, v1_init="duplicate", progress=False)
    with pytest.raises(ConversionError, match="--v1-calibration applies to --v1-init duplicate only"):
        convert("llama", even, tmp_path / "d", diff_version=1, v1_calibration="random", progress=False)
    with pytest.raises(ConversionError, match="--v1-calibration corpus needs the source's tokenizer"):
        convert("llama", odd, tmp_path / "d", diff_version=1, v1_calibration="corpus", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]


def test_v1_duplicate_trains_and_exports_to_diffllama(tmp_path):
    """The duplicated model trains (loss falls), and as a V1 model it exports to DiffLlama with the same logits."""
    source = duplicate_source("odd_9_3", seed=3)
    convert("llama", source, tmp_path / "v1", diff_version=1, progress=False)
    model = DiffTransformerForCausalLM.from_pretrained(tmp_path / "v1")
    convert("difftransformer", tmp_path / "v1", tmp_path / "dl", target="diffllama", progress=False)
    diffllama = AutoModelForCausalLM.from_pretrained(tmp_path / "dl").eval()
    torch.testing.assert_close(logits_of(diffllama, IDS), logits_of(model.eval(), IDS), rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    batch = torch.randint(3, 97, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(8):
        loss = model(batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
