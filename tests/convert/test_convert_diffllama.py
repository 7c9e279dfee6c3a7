"""transformers DiffLlama ↔ difftransformer V1 (docs/convert.md): logits within 1e-5 absolute + 1e-5 relative both ways
(tiny random float32 models, eager and sdpa, unpadded positions), the weights back bit for bit, subln folding."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DiffLlamaConfig, DiffLlamaForCausalLM

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from difftransformer.convert import ConversionError, convert

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one thread for these tests, not for the whole session

IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [2, 71, 82, 81, 82, 84, 59, 0, 45, 23]])
MASK = torch.tensor([[1] * 10, [0, 0] + [1] * 8])  # left padding in the second row


def tiny_diffllama(hq, hkv, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=8,
        rms_norm_eps=1e-6,
        lambda_std_dev=0.3,  # larger than the default so that λ moves away from λinit
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    cfg.update(overrides)
    return DiffLlamaForCausalLM(DiffLlamaConfig(**cfg)).eval()


def logits(model, attn):
    model.set_attn_implementation(attn)
    with torch.no_grad():
        return model(IDS, attention_mask=MASK).logits


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 4), (8, 2)], ids=["mha", "gqa_n2", "gqa_n4"])
def test_diffllama_to_v1_logits_and_round_trip(tmp_path, hq, hkv):
    source = tiny_diffllama(hq, hkv, seed=hkv)
    source.save_pretrained(tmp_path / "dl")
    result = convert("diffllama", tmp_path / "dl", tmp_path / "ours", progress=False)
    cfg = result.config
    assert (cfg.diff_version, cfg.num_attention_heads, cfg.num_key_value_heads) == (1, hq, hkv)
    assert cfg.subln_eps == source.config.rms_norm_eps and cfg.rope_parameters["rope_theta"] == 500.0

    ours, info = DiffTransformerForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ours.eval()
    for attn in ("eager", "sdpa"):
        torch.testing.assert_close(
            logits(ours, attn)[MASK.bool()], logits(source, attn)[MASK.bool()], atol=1e-5, rtol=1e-5
        )

    # ...and back: the original weights, bit for bit.
    convert("difftransformer", tmp_path / "ours", tmp_path / "back", target="diffllama", progress=False)
    original, back = (
        load_file(tmp_path / "dl" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert original.keys() == back.keys()
    for key in original:
        assert torch.equal(original[key], back[key]), key
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(reloaded).__name__ == "DiffLlamaForCausalLM"


def test_trained_v1_model_exports_to_diffllama(tmp_path):
    """A V1 model with a non-trivial subln weight and biases: DiffLlama serves it with logits within 1e-5."""
    torch.manual_seed(1)
    cfg = DiffTransformerConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-5, subln_eps=1e-5, attention_bias=True,
        tie_word_embeddings=True,
    )  # fmt: skip
    ours = DiffTransformerForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if name.endswith(("subln.weight", ".bias")):
                param.add_(torch.randn_like(param) * 0.3)
    result = convert("difftransformer", ours, tmp_path / "dl", target="diffllama", verify=True, progress=False)
    assert result.max_logit_diff < 1e-4
    served = DiffLlamaForCausalLM.from_pretrained(tmp_path / "dl").eval()
    assert served.config.tie_word_embeddings
    for attn in ("eager", "sdpa"):
        torch.testing.assert_close(
            logits(served, attn)[MASK.bool()], logits(ours, attn)[MASK.bool()], atol=1e-5, rtol=1e-5
        )


def test_what_diffllama_cannot_represent_is_refused(tmp_path):
    base = dict(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    cases = [
        (dict(diff_version=2), "DIFF V1 only"),
        (dict(subln_eps=1e-6, rms_norm_eps=1e-5), r"subln_eps \(1e-06\)"),
        (dict(lambda_init=0.8), "lambda_init=0.8"),
        (dict(mlp_bias=True), "mlp_bias"),
    ]
    for i, (override, message) in enumerate(cases):
        model = DiffTransformerForCausalLM(DiffTransformerConfig(**{**base, **override}))
        with pytest.raises(ConversionError, match=message):
            convert("difftransformer", model, tmp_path / f"out{i}", target="diffllama", progress=False)
        assert not (tmp_path / f"out{i}").exists()
    with pytest.raises(ConversionError, match="nothing to convert"):
        convert("diffllama", tiny_diffllama(4, 2), tmp_path / "same", target="diffllama", progress=False)
