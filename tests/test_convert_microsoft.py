"""Microsoft reference modules → difftransformer (docs/convert.md), checked against an independent float64 model.

The reference below re-implements Microsoft's layout from its description (microsoft/unilm
``Diff-Transformer/multihead_diffattn.py``, ``multihead_flashdiff_1.py``, ``Diff-Transformer-V2/
multihead_flashdiffv2.py``): interleaved (GPT-J) rotary, query heads ordered (g, r, c) with the two maps of a head
adjacent, ``out_proj``, λ and ``subln`` as in the paper, and Llama blocks around attention. It shares no code with
the converter or the model.
"""

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import DiffLlamaForCausalLM

from difftransformer import DiffTransformerForCausalLM
from difftransformer.convert import ConversionError, convert

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one thread for these tests, not for the whole session

VOCAB, E, LAYERS, FFN, THETA, EPS = 61, 32, 2, 64, 10000.0, 1e-6


# ---------------------------------------------------------------- float64 reference in Microsoft's layout


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotary_interleaved(x, theta):
    """x: (T, heads, d). Pairs (2i, 2i+1) rotate by angle t·theta^(-2i/d) (flash_attn's interleaved=True)."""
    T, _, d = x.shape
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def causal_softmax(q, k, d):
    T = q.shape[0]
    scores = (q @ k.T) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1)


def ms_attention_v1(sd, p, x, H, G, layer, naive):
    """MultiheadFlashDiff1/2 (naive=False) or MultiheadDiffAttn (naive=True) on one sequence x: (T, E)."""
    T = x.shape[0]
    d = E // H // 2
    n = H // G
    q = rotary_interleaved((x @ sd[p + "q_proj.weight"].T).view(T, 2 * H, d), THETA)
    k = rotary_interleaved((x @ sd[p + "k_proj.weight"].T).view(T, 2 * G, d), THETA)
    v = (x @ sd[p + "v_proj.weight"].T).view(T, G, 2 * d)
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * layer)
    lam = (
        torch.exp(torch.dot(sd[p + "lambda_q1"], sd[p + "lambda_k1"]))
        - torch.exp(torch.dot(sd[p + "lambda_q2"], sd[p + "lambda_k2"]))
        + lam_init
    )
    w = sd.get(p + "subln.weight", torch.ones(2 * d, dtype=torch.float64))
    heads = []
    for h in range(H):
        maps = []
        for c in range(2):
            qi = 2 * h + c  # their query rows: head h's two maps adjacent
            # flash files: map c of head h reads key c of group h // n; the naive file repeats 2G key heads over
            # 2H query heads, so query head i reads key head i // n.
            kj = (h // n) * 2 + c if not naive else qi // n
            maps.append(causal_softmax(q[:, qi], k[:, kj], d))
        o = (maps[0] - lam * maps[1]) @ v[:, h // n]
        heads.append(rms(o, w, 1e-5) * (1 - lam_init))
    return torch.cat(heads, -1) @ sd[p + "out_proj.weight"].T


def ms_attention_v2(sd, p, x, H, G, d):
    """MultiheadFlashDiffV2: 2H query heads, GQA over G heads, o_h = a_2h − sigmoid(x Wλ)_h · a_2h+1."""
    T = x.shape[0]
    q = rotary_interleaved((x @ sd[p + "q_proj.weight"].T).view(T, 2 * H, d), THETA)
    k = rotary_interleaved((x @ sd[p + "k_proj.weight"].T).view(T, G, d), THETA)
    v = (x @ sd[p + "v_proj.weight"].T).view(T, G, d)
    rep = 2 * H // G
    a = torch.stack([causal_softmax(q[:, j], k[:, j // rep], d) @ v[:, j // rep] for j in range(2 * H)], 1)  # (T, 2H, d)
    lam = torch.sigmoid(x @ sd[p + "lambda_proj.weight"].T)  # (T, H)
    o = a[:, 0::2] - lam[..., None] * a[:, 1::2]
    return o.reshape(T, H * d) @ sd[p + "o_proj.weight"].T


def ms_model_logits(sd, ids, version, H, G, naive=False, d=None, tied=False, eps=EPS):
    sd = {k: v.double() for k, v in sd.items()}
    x = sd["model.embed_tokens.weight"][ids]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        h = rms(x, sd[p + "input_layernorm.weight"], eps)
        a = p + "self_attn."
        x = x + (ms_attention_v1(sd, a, h, H, G, layer, naive) if version == 1 else ms_attention_v2(sd, a, h, H, G, d))
        h = rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        mlp = torch.nn.functional.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ sd[p + "mlp.down_proj.weight"].T
    x = rms(x, sd["model.norm.weight"], eps)
    return x @ (sd["model.embed_tokens.weight"] if tied else sd["lm_head.weight"]).T


# ---------------------------------------------------------------- random Microsoft-format checkpoints


def ms_state_dict(version, H, G, d=None, seed=0, tied=False):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, std=0.2: torch.randn(*shape, generator=g) * std  # noqa: E731
    sd = {"model.embed_tokens.weight": rnd(VOCAB, E, std=1.0), "model.norm.weight": 1 + rnd(E, std=0.1)}
    if not tied:
        sd["lm_head.weight"] = rnd(VOCAB, E)
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        sd[p + "input_layernorm.weight"] = 1 + rnd(E, std=0.1)
        sd[p + "post_attention_layernorm.weight"] = 1 + rnd(E, std=0.1)
        sd[p + "mlp.gate_proj.weight"] = rnd(FFN, E)
        sd[p + "mlp.up_proj.weight"] = rnd(FFN, E)
        sd[p + "mlp.down_proj.weight"] = rnd(E, FFN)
        a = p + "self_attn."
        if version == 1:
            hd = E // H // 2
            sd[a + "q_proj.weight"] = rnd(E, E, std=0.4)
            sd[a + "k_proj.weight"] = rnd(2 * G * hd, E, std=0.4)
            sd[a + "v_proj.weight"] = rnd(2 * G * hd, E)
            sd[a + "out_proj.weight"] = rnd(E, E)
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                sd[a + name] = rnd(hd, std=0.4)
            sd[a + "subln.weight"] = 1 + rnd(2 * hd, std=0.2)
        else:
            sd[a + "q_proj.weight"] = rnd(2 * H * d, E, std=0.4)
            sd[a + "k_proj.weight"] = rnd(G * d, E, std=0.4)
            sd[a + "v_proj.weight"] = rnd(G * d, E)
            sd[a + "o_proj.weight"] = rnd(E, H * d)
            sd[a + "lambda_proj.weight"] = rnd(H, E, std=0.5)
    return sd


def ms_config(H, G, d=None, module=None, tied=False):
    cfg = {
        "vocab_size": VOCAB,
        "hidden_size": E,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_heads": H,
        "num_kv_heads": G,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 64,
    }
    if d is not None:
        cfg["head_dim"] = d
    if module is not None:
        cfg["attention_module"] = module
    return cfg


def write_source(folder, sd, cfg):
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


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
    torch.testing.assert_close(our_logits(tmp_path / "ours", "eager"), ms_model_logits(sd, IDS[0], 2, 4, 2, d=8), atol=2e-5, rtol=2e-5)

    with pytest.raises(ConversionError, match=r"Unknown field\(s\) \['num_attention_heads'\]"):
        convert("microsoft-v2", sd, tmp_path / "x", source_config={**cfg, "num_attention_heads": 8}, progress=False)
    with pytest.raises(ConversionError, match="lacks 'num_heads'"):
        convert("microsoft-v2", sd, tmp_path / "x", source_config={k: v for k, v in cfg.items() if k != "num_heads"}, progress=False)
    # V1 weights offered as V2: names and shapes do not fit, and the error says which.
    with pytest.raises(ConversionError, match=r"missing tensors: .*o_proj.*unknown tensors: .*out_proj"):
        convert("microsoft-v2", ms_state_dict(1, 4, 4), tmp_path / "x", source_config=ms_config(4, 4, d=4), progress=False)
