"""Microsoft reference modules → difftransformer (docs/convert.md), checked against an independent float64 model of
Microsoft's layout (tests/utils_microsoft.py), which shares no code with the converter or the model.
"""

import json

import pytest
import torch
from transformers import DiffLlamaForCausalLM

from difftransformer import DiffTransformerForCausalLM
from difftransformer.convert import ConversionError, convert
from utils_microsoft import ms_config, ms_model_logits, ms_state_dict, write_source

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one thread for these tests, not for the whole session


IDS = torch.tensor([[5, 17, 3, 44, 9, 60, 2, 31, 12, 7, 50, 23]])


def our_logits(folder, attn):
    model = DiffTransformerForCausalLM.from_pretrained(folder, attn_implementation=attn).eval()
    with torch.no_grad():
        return model(IDS).logits[0].double()


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "H,G,module",
    [
        (4, 4, "MultiheadDiffAttn"),  # MHA from the naive file (n = 1: identical to the flash files)
        (4, 4, None),  # MHA, module unnamed: fine, all files agree when n = 1
        (4, 2, "MultiheadFlashDiff1"),  # GQA, n = 2
        (4, 1, "MultiheadFlashDiff2"),  # GQA, n = 4
    ],
)
def test_microsoft_v1_logits_match_reference(tmp_path, H, G, module):
    sd = ms_state_dict(1, H, G, seed=H + G)
    src = write_source(tmp_path / "ms", sd, ms_config(H, G, module=module))
    out = tmp_path / "ours"
    result = convert("microsoft-v1", src, out, progress=False)
    assert result.exact and result.config.num_attention_heads == 2 * H and result.config.num_key_value_heads == 2 * G
    ref = ms_model_logits(sd, IDS[0], 1, H, G, naive=module == "MultiheadDiffAttn")
    for attn in ("eager", "sdpa"):
        torch.testing.assert_close(our_logits(out, attn), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("H,G,d", [(4, 4, 8), (4, 2, 8), (2, 1, 16)])
def test_microsoft_v2_logits_match_reference(tmp_path, H, G, d):
    sd = ms_state_dict(2, H, G, d=d, seed=10 + G)
    src = write_source(tmp_path / "ms", sd, ms_config(H, G, d=d))
    out = tmp_path / "ours"
    result = convert("microsoft-v2", src, out, progress=False)
    assert result.config.diff_version == 2 and result.config.head_dim == d
    ref = ms_model_logits(sd, IDS[0], 2, H, G, d=d)
    for attn in ("eager", "sdpa"):
        torch.testing.assert_close(our_logits(out, attn), ref, atol=2e-5, rtol=2e-5)


def test_naive_file_under_gqa_is_refused_with_explanation(tmp_path):
    sd = ms_state_dict(1, 4, 2)
    src = write_source(tmp_path / "ms", sd, ms_config(4, 2, module="MultiheadDiffAttn"))
    with pytest.raises(ConversionError, match=r"MultiheadDiffAttn.*not DIFF V1.*same key head"):
        convert("microsoft-v1", src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    # The reference shows why: under GQA the naive pairing is a different function from the flash files'.
    naive, flash = (ms_model_logits(sd, IDS[0], 1, 4, 2, naive=b) for b in (True, False))
    assert (naive - flash).abs().max() > 1e-3


def test_gqa_without_module_name_asks_for_it(tmp_path):
    src = write_source(tmp_path / "ms", ms_state_dict(1, 4, 2), ms_config(4, 2))
    with pytest.raises(ConversionError, match="--microsoft-module"):
        convert("microsoft-v1", src, tmp_path / "out", progress=False)
    # Naming it on the command line (function argument) is enough.
    convert("microsoft-v1", src, tmp_path / "out", microsoft_module="MultiheadFlashDiff1", progress=False)
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_key_map_renames_other_layouts_and_tied_embeddings(tmp_path):
    """A torchscale-style naming, mapped back with a small JSON file; tied embeddings carry over."""
    H, G = 4, 2
    sd = ms_state_dict(1, H, G, seed=3, tied=True)
    renames = {
        "model.embed_tokens.": "decoder.embed_tokens.",
        "model.norm.": "decoder.layer_norm.",
        "model.layers.{l}.self_attn.": "decoder.layers.{l}.attn.",
        "model.layers.{l}.input_layernorm.": "decoder.layers.{l}.attn_norm.",
        "model.layers.{l}.post_attention_layernorm.": "decoder.layers.{l}.ffn_norm.",
        "model.layers.{l}.mlp.": "decoder.layers.{l}.ffn.",
    }

    def rename(key):
        for ours, theirs in renames.items():
            pat = ours.replace("{l}", "")
            if "{l}" in ours and key.startswith("model.layers."):
                layer = key.split(".")[2]
                if key.startswith(ours.replace("{l}", layer)):
                    return theirs.replace("{l}", layer) + key[len(ours.replace("{l}", layer)) :]
            elif key.startswith(pat):
                return theirs + key[len(pat) :]
        raise AssertionError(key)

    theirs = {rename(k): v for k, v in sd.items()}
    src = write_source(tmp_path / "ms", theirs, ms_config(H, G, module="MultiheadFlashDiff1", tied=True))
    key_map = tmp_path / "keys.json"
    key_map.write_text(json.dumps({v: k for k, v in renames.items()}))

    with pytest.raises(ConversionError, match="unknown tensors: decoder"):
        convert("microsoft-v1", src, tmp_path / "bad", progress=False)
    out = tmp_path / "ours"
    result = convert("microsoft-v1", src, out, key_map=key_map, progress=False)
    assert result.config.tie_word_embeddings
    ref = ms_model_logits(sd, IDS[0], 1, H, G, tied=True)
    torch.testing.assert_close(our_logits(out, "sdpa"), ref, atol=2e-5, rtol=2e-5)


def test_weightless_subln_of_early_files_and_partial_subln_error(tmp_path):
    """Early versions of the files used RMSNorm(elementwise_affine=False): no subln.weight anywhere → ones."""
    sd = ms_state_dict(1, 4, 4, seed=5)
    no_w = {k: v for k, v in sd.items() if not k.endswith("subln.weight")}
    src = write_source(tmp_path / "ms", no_w, ms_config(4, 4))
    out = tmp_path / "ours"
    convert("microsoft-v1", src, out, progress=False)
    torch.testing.assert_close(our_logits(out, "sdpa"), ms_model_logits(no_w, IDS[0], 1, 4, 4), atol=2e-5, rtol=2e-5)

    partial = {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.subln.weight"}
    src2 = write_source(tmp_path / "ms2", partial, ms_config(4, 4))
    with pytest.raises(ConversionError, match=r"missing tensors: model\.layers\.1\.self_attn\.subln\.weight"):
        convert("microsoft-v1", src2, tmp_path / "out2", progress=False)


def test_microsoft_v1_straight_to_diffllama(tmp_path):
    """--to diffllama composes with any V1 source: stock transformers then serves Microsoft-layout weights."""
    sd = ms_state_dict(1, 4, 2, seed=8)
    cfg = {**ms_config(4, 2, module="MultiheadFlashDiff1"), "rms_norm_eps": 1e-5}  # = Microsoft's subln eps
    src = write_source(tmp_path / "ms", sd, cfg)
    convert("microsoft-v1", src, tmp_path / "dl", target="diffllama", progress=False)
    served = DiffLlamaForCausalLM.from_pretrained(tmp_path / "dl").eval()
    with torch.no_grad():
        logits = served(IDS).logits[0].double()
    torch.testing.assert_close(logits, ms_model_logits(sd, IDS[0], 1, 4, 2, eps=1e-5), atol=2e-5, rtol=2e-5)
    # With a model eps different from the per-head norm's, DiffLlama cannot hold it exactly: refused.
    src2 = write_source(tmp_path / "ms2", sd, ms_config(4, 2, module="MultiheadFlashDiff1"))
    with pytest.raises(ConversionError, match="subln_eps"):
        convert("microsoft-v1", src2, tmp_path / "dl2", target="diffllama", progress=False)


def test_in_memory_state_dict_and_config_errors(tmp_path):
    sd = ms_state_dict(2, 4, 2, d=8)
    cfg = ms_config(4, 2, d=8)
    convert("microsoft-v2", sd, tmp_path / "ours", source_config=cfg, progress=False)
    torch.testing.assert_close(
        our_logits(tmp_path / "ours", "eager"), ms_model_logits(sd, IDS[0], 2, 4, 2, d=8), atol=2e-5, rtol=2e-5
    )

    with pytest.raises(ConversionError, match=r"Unknown field\(s\) \['num_attention_heads'\]"):
        convert("microsoft-v2", sd, tmp_path / "x", source_config={**cfg, "num_attention_heads": 8}, progress=False)
    with pytest.raises(ConversionError, match="lacks 'num_heads'"):
        convert(
            "microsoft-v2",
            sd,
            tmp_path / "x",
            source_config={k: v for k, v in cfg.items() if k != "num_heads"},
            progress=False,
        )
    # V1 weights offered as V2: names and shapes do not fit, and the error says which.
    with pytest.raises(ConversionError, match=r"missing tensors: .*o_proj.*unknown tensors: .*out_proj"):
        convert(
            "microsoft-v2", ms_state_dict(1, 4, 4), tmp_path / "x", source_config=ms_config(4, 4, d=4), progress=False
        )
