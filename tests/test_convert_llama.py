"""Llama / Mistral / Qwen2 → difftransformer (SPEC §6): exact V2 upcycling, approximate V1 upcycling, config."""

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
from difftransformer.convert import ConversionError, convert
from difftransformer.modeling_difftransformer import lambda_init_fn

torch.set_num_threads(1)

IDS = torch.tensor([[5, 17, 3, 44, 9, 60, 2, 31, 12, 7, 50, 23], [8, 8, 1, 90, 34, 6, 71, 5, 19, 28, 3, 66]])
MASK = torch.tensor([[1] * 12, [0, 0, 0] + [1] * 9])
COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip


def llama_like(kind, hq=6, hkv=2, seed=0, **overrides):
    torch.manual_seed(seed)
    cls, cfg_cls = {"llama": (LlamaForCausalLM, LlamaConfig), "mistral": (MistralForCausalLM, MistralConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[kind]
    model = cls(cfg_cls(**{**COMMON, "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": 8, **overrides})).eval()
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
    """Llama → V1 is approximate (SPEC §6); the converted model must train: loss falls on a tiny batch."""
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


def test_v1_needs_even_kv_heads_and_llama_needs_a_version(tmp_path):
    source = llama_like("qwen2", 6, 3)
    with pytest.raises(ConversionError, match=r"even num_key_value_heads.*has 3.*--diff-version 2"):
        convert("llama", source, tmp_path / "v1", diff_version=1, progress=False)
    with pytest.raises(ConversionError, match="--from llama needs --diff-version"):
        convert("llama", source, tmp_path / "v1", progress=False)
    assert not (tmp_path / "v1").exists()


def test_sliding_window_source_gets_a_note(tmp_path):
    source = llama_like("mistral", 4, 2, sliding_window=16)
    result = convert("llama", source, tmp_path / "v2", diff_version=2, progress=False)
    assert any("sliding_window=16" in note for note in result.notes)
