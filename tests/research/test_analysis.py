"""The attention-noise lens (difftransformer.research.analysis) on tiny random and hand-set models."""

import json
import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from difftransformer.research import analysis
from difftransformer.research.analysis import attention_maps, attention_shares, lens, split_pairs

# (diff_version, Hq, Hkv): V1/V2, MHA and GQA (n > 1, where a wrong pairing would show).
LAYOUTS = {"v1_mha": (1, 8, 8), "v1_gqa": (1, 8, 4), "v1_gqa4": (1, 8, 2), "v2_mha": (2, 8, 4), "v2_gqa": (2, 8, 2)}


def diff_model(layout, seed=0, **overrides):
    version, hq, hkv = LAYOUTS[layout]
    kwargs = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=8,
        diff_version=version,
        initializer_range=0.3,
        **({"lambda_std": 0.3} if version == 1 else {}),
    )  # V1-only field (a V2 config warns that it does not read it)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return DiffTransformerForCausalLM(DiffTransformerConfig(**kwargs)).eval()


def llama_model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
    )
    return LlamaForCausalLM(cfg).eval()


def broadcast_lambda(lam):
    return lam if lam.dim() == 0 else lam.transpose(1, 2)[..., None]  # V2 (B, T, H) -> (B, H, T, 1)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_recomputed_softmax_maps_reproduce_the_models_differential_maps(layout):
    model = diff_model(layout)
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(1))
    layers = attention_maps(model, ids)
    # The model's own maps from an independent eager call (the lens must not change what it measures).
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(ids, output_attentions=True, output_lambdas=True, use_cache=False)
    model.set_attn_implementation("sdpa")
    num_heads = model.config.num_attention_heads // 2
    for lm, ref, lam in zip(layers, out.attentions, out.lambdas, strict=True):
        a1, a2 = lm.maps["softmax1"], lm.maps["softmax2"]
        assert a1.shape == a2.shape == ref.shape == (2, num_heads, 11, 11)
        torch.testing.assert_close(a1.sum(-1), torch.ones(2, num_heads, 11))
        assert torch.all(a1.triu(1) == 0) and torch.all(a2.triu(1) == 0)  # causal
        torch.testing.assert_close(a1 - broadcast_lambda(lam) * a2, ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lm.maps["diff"], ref)
        # The two maps of a head really differ (weights are not near-uniform), so a wrong pairing would show.
        assert (a1 - a2).abs().max() > 0.05


def test_a_wrong_pairing_would_be_detected():
    """The equality above is informative: splitting V1 GQA maps with V2's (adjacent) pairing does not match."""
    model = diff_model("v1_gqa")
    ids = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(2))
    module = analysis.diff_attention_modules(model)[0]
    captured = {}
    handle = module.register_forward_pre_hook(lambda m, a, k: captured.update(k), with_kwargs=True)
    layers = attention_maps(model, ids)
    handle.remove()
    maps = analysis.softmax_maps(
        module, captured["hidden_states"], captured["position_embeddings"], captured["attention_mask"]
    )
    wrong1, wrong2 = split_pairs(maps, pair_stride=1)
    lam = layers[0].lam
    assert (wrong1 - lam * wrong2 - layers[0].maps["diff"]).abs().max() > 1e-2


def test_padding_mask_is_respected():
    model = diff_model("v2_gqa")
    ids = torch.randint(4, 61, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in the first row
    layers = attention_maps(model, ids, attention_mask=mask)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True, output_lambdas=True, use_cache=False)
    model.set_attn_implementation("sdpa")
    for lm, ref, lam in zip(layers, out.attentions, out.lambdas, strict=True):
        assert torch.all(lm.maps["softmax1"][0, :, 3:, :3] == 0)  # real tokens never see padding
        diff = lm.maps["softmax1"] - broadcast_lambda(lam) * lm.maps["softmax2"]
        torch.testing.assert_close(diff[:, :, 3:], ref[:, :, 3:], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        llama_model,
        lambda: GPT2LMHeadModel(GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval(),
    ],
    ids=["llama", "gpt2"],
)
def test_standard_models_softmax_shares_sum_to_one(make):
    model = make()
    ids = torch.randint(0, 61, (14,), generator=torch.Generator().manual_seed(4))
    impl = model.config._attn_implementation
    report = lens(model, ids, answer_span=(3, 6), query_positions=[10, 13])
    assert model.config._attn_implementation == impl  # restored after the eager pass
    assert report.kinds == ("softmax",) and report.lambdas is None
    shares = report.shares["softmax"]
    assert shares.shape == (2, 4, 3)
    torch.testing.assert_close(shares.sum(-1), torch.ones(2, 4))
    assert torch.all(shares[..., 2] == 0)  # no context span: nothing is "other"
    # With a context span the three regions still sum to one, and every mode agrees for softmax maps.
    with_ctx = {
        m: lens(model, ids, (3, 6), context_span=(0, 9), mode=m).shares["softmax"] for m in analysis.SHARE_MODES
    }
    torch.testing.assert_close(with_ctx["positive"].sum(-1), torch.ones(2, 4))
    assert torch.all(with_ctx["positive"][..., 2] > 0)
    torch.testing.assert_close(with_ctx["positive"], with_ctx["signed"])
    torch.testing.assert_close(with_ctx["positive"], with_ctx["raw"])


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_lens_report_shapes_lambdas_and_json(layout):
    model = diff_model(layout)
    ids = torch.randint(0, 61, (12,), generator=torch.Generator().manual_seed(5))
    report = lens(model, ids, (2, 4), context_span=(0, 8))
    assert report.kinds == analysis.DIFF_KINDS
    for kind in report.kinds:
        assert report.shares[kind].shape == (2, 4, 3)
    for kind in ("softmax1", "softmax2"):
        torch.testing.assert_close(report.shares[kind].sum(-1), torch.ones(2, 4))
    if model.config.diff_version == 1:
        torch.testing.assert_close(report.lambdas, model.layer_lambdas())
    else:  # per-token λ statistics per layer and head: mean, std, min, max, all in (0, 1) (a sigmoid)
        assert report.lambdas.shape == (2, 4, 4)
        stats = report.lambdas
        assert torch.all((stats[..., 2] <= stats[..., 0]) & (stats[..., 0] <= stats[..., 3]))
        assert torch.all((stats[..., 2] > 0) & (stats[..., 3] < 1))
    rows = report.rows()
    assert len(rows) == 3 * 2 * 4 and {"answer", "noise", "other"} <= set(rows[0])
    blob = json.loads(json.dumps(report.to_json()))
    assert blob["diff_version"] == model.config.diff_version and len(blob["lambdas"]) == (
        2 if model.config.diff_version == 1 else 8
    )
    md = report.to_markdown()
    assert "| diff | 1 |" in md and "λ" in md


def test_share_modes_on_a_signed_map():
    # One differential row over 4 keys: answer = key 0, context = keys 0..2, key 3 = the question ("other").
    row = torch.tensor([[0.5, -0.1, 0.2, 0.1]])
    positive = attention_shares(row, (0, 1), (0, 3), mode="positive")
    signed = attention_shares(row, (0, 1), (0, 3), mode="signed")
    raw = attention_shares(row, (0, 1), (0, 3), mode="raw")
    torch.testing.assert_close(positive, torch.tensor([0.5, 0.2, 0.1]) / 0.8)
    torch.testing.assert_close(signed, torch.tensor([0.5, 0.1, 0.1]) / 0.7)
    torch.testing.assert_close(raw, torch.tensor([0.5, 0.1, 0.1]))
    for bad in ({"mode": "abs"}, {"query_positions": [7]}):
        with pytest.raises(ValueError, match="mode|query_positions"):
            attention_shares(row, (0, 1), **bad)
    with pytest.raises(ValueError, match="answer"):
        attention_shares(row, (2, 9))


def _attend_to_marker(attn, marker_rows_k, strength=40.0):
    """Hand-set one attention module so that every query attends to tokens whose embedding has feature 0 set.

    q and k are non-zero only in the last rotary pair's first feature (index d/2 − 1): with rope_theta = 1e12 its
    rotation angle is ~1e-9 rad per position, so scores do not depend on position.
    """
    d = attn.head_dim
    with torch.no_grad():
        attn.q_proj.weight.zero_()
        attn.k_proj.weight.zero_()
        for h in range(attn.q_proj.out_features // d):
            attn.q_proj.weight[h * d + d // 2 - 1, 1] = strength  # feature 1 = 1 for every token
        for h in marker_rows_k:
            attn.k_proj.weight[h * d + d // 2 - 1, 0] = strength  # feature 0 = 1 only for the marker token


def _marker_embeddings(model, marker):
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.zero_()
        emb[:, 1] = 1.0
        emb[marker, 0] = 1.0
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)


def _marker_model(kind, marker=7):
    """A one-layer model whose every head puts (almost) all its attention on the token ``marker``."""
    common = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1e12},
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_attention_heads=2, num_key_value_heads=2, **common)).eval()
        key_heads = range(2)
    else:
        model = DiffTransformerForCausalLM(
            DiffTransformerConfig(num_attention_heads=4, num_key_value_heads=2, diff_version=int(kind[1]), **common)
        ).eval()
        # Only the first map of every head gets the marker key; the second map stays uniform (q·k = 0).
        key_heads = [0] if kind == "v1" else [0, 1]  # V1 key rows (g, c): c = 0 is row 0; V2: both pairs' shared head
    _marker_embeddings(model, marker)
    attn = model.model.layers[0].self_attn
    _attend_to_marker(attn, key_heads)
    if kind == "v2":  # V2 pairs share one key head: silence the second query of each pair instead
        with torch.no_grad():
            for h in range(2):
                attn.q_proj.weight[(2 * h + 1) * 8 : (2 * h + 2) * 8] = 0
    return model


@pytest.mark.parametrize("kind", ["llama", "v1", "v2"])
def test_a_model_that_attends_only_to_the_answer_scores_100_percent(kind):
    """Hand-set weights: every head of layer 0 puts (almost) all its attention on the answer token."""
    marker, T = 7, 16
    model = _marker_model(kind, marker)
    ids = torch.full((T,), 3)
    ids[5] = marker
    report = lens(model, ids, answer_span=(5, 6), context_span=(0, T - 1))
    main = "softmax" if kind == "llama" else "diff"
    answer = report.shares[main][0, :, 0]
    assert torch.all(answer > 0.999), answer
    assert torch.all(report.shares[main][0, :, 1] < 1e-3)
    if kind != "llama":
        # The first map finds the answer; the second (uniform) map carries the "noise" that the difference cancels.
        assert torch.all(report.shares["softmax1"][0, :, 0] > 0.999)
        torch.testing.assert_close(report.shares["softmax2"][0, :, 0], torch.full((2,), 1 / T))


@pytest.mark.parametrize("kind", ["llama", "v1"])
def test_lens_on_spans_averages_prompts_and_reports_extra_regions(kind):
    """Token-span prompts (synthetic tasks): the shares are the mean of lens() over the prompts, and an extra region
    covering the answer gets exactly the answer's share (both are that region's part of the whole row)."""
    marker, T = 7, 16
    model = _marker_model(kind, marker)
    prompts = []
    for at in (5, 9):
        ids = torch.full((T,), 3)
        ids[at] = marker
        prompts.append(analysis.SpanExample(ids, (at, at + 1), (0, T - 1), {"marker": (at, at + 1), "start": (0, 2)}))
    got = analysis.lens_on_spans(model, prompts)
    main = "softmax" if kind == "llama" else "diff"
    reports = [lens(model, p.input_ids, p.answer, p.context) for p in prompts]
    assert got.examples == 2 and set(got.shares) == set(reports[0].shares)
    for k in got.shares:
        torch.testing.assert_close(got.shares[k], (reports[0].shares[k] + reports[1].shares[k]) / 2)
    torch.testing.assert_close(got.region_shares["marker"][main], got.shares[main][..., 0])
    assert torch.all(got.region_shares["marker"][main] > 0.999) and torch.all(got.region_shares["start"][main] < 1e-3)
    if kind == "v1":
        torch.testing.assert_close(got.lambdas, (reports[0].lambdas + reports[1].lambdas) / 2)
    with pytest.raises(ValueError, match="regions"):
        analysis.lens_on_spans(model, [prompts[0], analysis.SpanExample(prompts[1].input_ids, (9, 10))])


def test_find_token_span_and_errors():
    from difftransformer.research.data import corpus_texts, train_tokenizer

    tok = train_tokenizer(corpus_texts("train", max_chars=20_000), vocab_size=300)
    text = "x = 1\nneedle_key = 42\ny = 2\nassert needle_key =="
    start, end = analysis.find_token_span(tok, text, "42")
    ids = tok(text)["input_ids"]
    assert tok.decode(ids[start:end]).strip() == "42"
    second = analysis.find_token_span(tok, text, "needle_key", occurrence=1)
    assert second[0] > end
    with pytest.raises(ValueError, match="occurs fewer"):
        analysis.find_token_span(tok, text, "missing")
    model = llama_model()
    with pytest.raises(ValueError, match="answer_span"):
        lens(model, torch.arange(5), answer_span=(4, 9))
    with pytest.raises(ValueError, match="one prompt"):
        lens(model, torch.zeros(2, 5, dtype=torch.long), answer_span=(0, 1))


def test_heatmaps_and_shares_plots(tmp_path):
    v1, llama = diff_model("v1_gqa"), llama_model()
    ids = torch.randint(0, 61, (10,), generator=torch.Generator().manual_seed(6))
    reports = [lens(v1, ids, (2, 4), model_name="v1"), lens(llama, ids, (2, 4), model_name="llama")]
    png = analysis.plot_heatmaps(reports[0], str(tmp_path / "h.png"), layers=[0, 1], heads=[0, 3])
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert open(analysis.plot_shares(reports, str(tmp_path / "s.png")), "rb").read(4) == b"\x89PNG"
    with pytest.raises(ValueError, match="heads"):
        analysis.plot_heatmaps(reports[0], str(tmp_path / "x.png"), heads=[4])
    with pytest.raises(ValueError, match="kinds"):
        analysis.plot_heatmaps(reports[1], str(tmp_path / "x.png"), kinds=["diff"])


def test_lens_is_deterministic():
    ids = torch.randint(0, 61, (10,), generator=torch.Generator().manual_seed(7))
    a = lens(diff_model("v2_mha", seed=3), ids, (1, 3)).shares
    b = lens(diff_model("v2_mha", seed=3), ids, (1, 3)).shares
    for kind in a:
        assert torch.equal(a[kind], b[kind])
    assert all(math.isfinite(x) for x in a["diff"].flatten().tolist())
    other = lens(diff_model("v2_mha", seed=4), ids, (1, 3)).shares  # the seed is what decides: another one differs
    assert not torch.equal(a["diff"], other["diff"])


def _doc_blocks(lang):
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "analysis.md").read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_docs_examples_run(tmp_path, monkeypatch):
    """Every Python example of docs/analysis.md runs as written, then its lens command line on what they saved."""
    import os
    import shlex
    import subprocess
    import sys

    monkeypatch.chdir(tmp_path)
    namespace = {}
    blocks = _doc_blocks("python")
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block, "docs/analysis.md", "exec"), namespace)
    for png in ("lens_v1.png", "shares.png", "niah_v1.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    commands = [b for b in _doc_blocks("bash") if "difftransformer.research.analysis" in b]
    assert commands
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for command in commands:
        argv = shlex.split(command.strip())
        assert argv[0] == "python"
        done = subprocess.run(
            [sys.executable, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "| diff | 1 |" in done.stdout
    saved = json.loads((tmp_path / "lens_out" / "lens.json").read_text())
    assert len(saved) == 2  # side by side: our V1 and a standard Llama, one report each
    assert saved[0]["diff_version"] == 1 and len(saved[0]["shares"]) == 3 * 2 * 2
    assert len(saved[1]["shares"]) == 1 * 2 * 4  # a standard model: one softmax map per layer and head
    assert (tmp_path / "lens_out" / "heatmap_m0.png").exists() and (tmp_path / "lens_out" / "heatmap_m1.png").exists()
