"""Motif-2 checkpoints (``model_type "Motif"``) load and run as a configuration of our model, and convert.

The oracle is tests/motif_reference.py: an independent plain-torch re-implementation of Motif's published forward, run
in float64 on random weights in Motif's exact key layout (nobody here has the real weights). Checked: loading a Motif
folder with ``MotifForCausalLM.from_pretrained`` (no registration, no remote code: the folder's ``auto_map`` names
Motif's files, which are absent) and, after the opt-in ``register_motif()``, with ``AutoModelForCausalLM``; logits and
greedy tokens at tiny shapes (MHA r = 1, GQA r = 1 with two noise heads per KV pair, GDA r = 4) and at the released
layer shapes, ``save_pretrained`` back to Motif's layout, ``Trainer``'s label smoothing, and ``difftransformer-convert
--from motif``. That ``import difftransformer`` registers no Motif name, and that ``register_motif`` never replaces
another's: tests/models/test_registration.py. CI runs this module on the lowest, the pinned and the newest transformers
release.

How close is "within float32 rounding"? The model runs in float32, the oracle in float64. A float32 forward's error is
a property of the function and the input (how much the arithmetic amplifies 2⁻²⁴ relative roundings), not of the code,
so the oracle itself run in float32 measures it: an exact implementation lies within a small factor of that
independent float32 run's error (measured: 0.7-1.4 ×); the bound is 8 × it. Every semantic slip is orders of magnitude
above: the paper's λinit schedule instead of Motif's (tested below), noise rows in the wrong order (tested below).
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from difftransformer import DiffTransformerForCausalLM, MotifConfig, MotifForCausalLM
from difftransformer.convert import cli as convert_cli
from difftransformer.motif import MotifQueryRows, motif_query_heads, register_motif
from motif_reference import motif_config, motif_forward, motif_state_dict_shapes, parameter_count
from utils_motif import motif_folder
from utils_remote_code import NEW_TOKENS, remote_generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = ["tiny-mha", "tiny-gqa", "tiny-gda"]
FLOAT32_FACTOR = 8.0


def float32_bound(cfg, state, ids, exact):
    """FLOAT32_FACTOR × the error of the oracle's own float32 run (see the module docstring)."""
    return FLOAT32_FACTOR * (motif_forward(cfg, state, ids, dtype=torch.float32).double() - exact).abs().max().item()


def oracle_greedy(cfg, state, ids, steps):
    """Greedy continuation by the float64 oracle, and the smallest top-2 logit margin met on the way."""
    margin = math.inf
    for _ in range(steps):
        logits = motif_forward(cfg, state, ids)[:, -1]
        top2 = logits.topk(2, dim=-1).values
        margin = min(margin, (top2[:, 0] - top2[:, 1]).min().item())
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids, margin


def _ids(vocab, shape, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", TINY)
def test_motif_folder_loads_without_remote_code_and_matches_the_oracle(kind, tmp_path):
    """``MotifForCausalLM.from_pretrained`` (its own query-row conversion, no registration) matches the oracle; the
    Auto class after ``register_motif()`` loads the same class with the same tensors."""
    cfg, state = motif_folder(tmp_path / kind, kind, seed=1)
    model, info = MotifForCausalLM.from_pretrained(tmp_path / kind, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # every tensor used, none missing
    register_motif()
    # trust_remote_code=True too: the registered class wins over the folder's auto_map (Motif's absent files)
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / kind, dtype=torch.float32, trust_remote_code=True)
    assert type(auto) is MotifForCausalLM and type(auto).__module__ == "difftransformer.motif"
    assert all(torch.equal(t, auto.state_dict()[k]) for k, t in model.state_dict().items())
    assert model.config.lambda_init_layer_offset == -1 and model.config.hidden_act == "poly_norm"
    assert model.config.subln_eps == cfg["attn_rms_norm_eps"] and model.config.noise_heads == cfg.get(
        "num_noise_heads", cfg["num_attention_heads"] // 2
    )
    ids = _ids(cfg["vocab_size"], (2, 12))
    exact = motif_forward(cfg, state, ids)
    bound = float32_bound(cfg, state, ids, exact)
    with torch.no_grad():
        for attn in ("sdpa", "eager"):
            model.set_attn_implementation(attn)
            err = (model(ids).logits.double() - exact).abs().max().item()
            assert err <= bound, (attn, err, bound)
    # left padding (the oracle masks padded keys and counts positions from the first real token)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits.double()
    exact_padded = motif_forward(cfg, state, ids, attention_mask=mask)
    assert (padded - exact_padded)[mask.bool()].abs().max() <= bound


@pytest.mark.parametrize("kind", ["tiny-mha", "tiny-gda"])
def test_greedy_tokens_equal_the_oracles_with_and_without_cache(kind, tmp_path):
    """generate() with the dynamic cache, the static cache and no cache gives the oracle's greedy tokens; every step's
    top-2 margin exceeds twice the float32 bound, so the equality is not luck."""
    cfg, state = motif_folder(tmp_path / kind, kind, seed=2)
    model = MotifForCausalLM.from_pretrained(tmp_path / kind, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = _ids(cfg["vocab_size"], (1, 6), seed=3)
    expected, margin = oracle_greedy(cfg, state, ids, steps=8)
    bound = float32_bound(cfg, state, expected, motif_forward(cfg, state, expected))
    assert margin > 2 * bound, (margin, bound)
    for kwargs in ({}, {"use_cache": False}, {"cache_implementation": "static"}):
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, **kwargs)
        assert torch.equal(out, expected), kwargs


def test_rows_are_reordered_at_load_where_motif_and_our_orders_differ(tmp_path, monkeypatch):
    """tiny-gqa has two noise heads per KV pair: Motif's rows ``[s0, n0, s1, n1]`` per pair are ours ``[s0, s1, n0,
    n1]`` (a real permutation, done by the load-time conversion the class carries); without it the logits leave the
    bound. The released shapes need none (one noise head per KV pair)."""
    for kind, expected in (
        ("tiny-gqa", [0, 2, 1, 3, 4, 6, 5, 7]),
        ("tiny-gda", list(range(10))),
        ("2.6b", list(range(16))),
        ("12.7b", list(range(40))),
    ):
        assert motif_query_heads(MotifConfig(**motif_config(kind))).tolist() == expected, kind
    cfg, state = motif_folder(tmp_path / "m", "tiny-gqa", seed=4)
    ids = _ids(cfg["vocab_size"], (2, 10))
    exact = motif_forward(cfg, state, ids)
    bound = float32_bound(cfg, state, ids, exact)
    monkeypatch.setattr(MotifQueryRows, "_rows", lambda self, config: None)
    with torch.no_grad():
        unordered = MotifForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)(ids).logits.double()
    assert (unordered - exact).abs().max() > 1000 * bound


def test_motifs_lambda_init_schedule_is_what_makes_it_exact(tmp_path):
    """Non-vacuity of the bound: with the paper's λinit (offset 0 instead of Motif's −1) the logits leave it by far."""
    cfg, state = motif_folder(tmp_path / "m", "tiny-mha", seed=5)
    model = MotifForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    ids = _ids(cfg["vocab_size"], (2, 10))
    exact = motif_forward(cfg, state, ids)
    for layer in model.model.layers:
        layer.self_attn.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer.self_attn.layer_idx)
    with torch.no_grad():
        assert (model(ids).logits.double() - exact).abs().max() > 1000 * float32_bound(cfg, state, ids, exact)


# The released checkpoints, as published: parameters (billions, the models' names) and, for Motif-2-12.7B, the tensor
# shapes measured on its real weights (the MLX port's README, tests/motif_reference.py's source [MLX]).
RELEASED_BILLIONS = {"2.6b": 2.6, "12.7b": 12.7}
RELEASED_12_7B_SHAPES = {
    "self_attn.q_proj.weight": (5120, 4096),
    "self_attn.k_proj.weight": (2048, 4096),
    "self_attn.o_proj.weight": (4096, 8192),
    "self_attn.subln.weight": (256,),
}


@pytest.mark.parametrize("kind", ["2.6b", "12.7b"])
def test_released_configs_build_every_released_tensor(kind):
    """Our model built from each released config (every layer, the real vocabulary; on the meta device, no memory)
    holds exactly the tensors of a released checkpoint, by name and shape, as the reference lays them out: loading one
    uses every tensor and misses none. Its parameter count is the reference's and rounds to the model's name."""
    cfg = motif_config(kind)
    with torch.device("meta"):
        model = MotifForCausalLM(MotifConfig(**cfg))
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        del ours["lm_head.weight"]  # a tied checkpoint does not store it
    assert ours == motif_state_dict_shapes(cfg)
    count = sum(p.numel() for p in model.parameters())
    assert count == parameter_count(kind) and round(count / 1e9, 1) == RELEASED_BILLIONS[kind]
    if kind == "12.7b":
        last = cfg["num_hidden_layers"] - 1
        assert {name: ours[f"model.layers.{last}.{name}"] for name in RELEASED_12_7B_SHAPES} == RELEASED_12_7B_SHAPES


@pytest.mark.parametrize("kind", ["2.6b", "12.7b"])
def test_released_layer_shapes_match_the_oracle(kind, tmp_path):
    """The released models' layer shapes (2.6B: 16 half-heads of 128, MHA, hidden 2048, MLP 8192; 12.7B: 40 half-heads =
    8 × (4 signal + 1 noise), 16 KV half-heads, hidden 4096, MLP 16384), one layer, a 256-token vocabulary, weights in
    bfloat16 as released; the model loads them in float32."""
    cfg, state = motif_folder(tmp_path / kind, kind, dtype=torch.bfloat16, num_hidden_layers=1, vocab_size=256)
    model = MotifForCausalLM.from_pretrained(tmp_path / kind, dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    assert attn.o_proj.in_features == 2 * model.config.num_diff_heads * 128 and attn.noise_ratio == (
        4 if kind == "12.7b" else 1
    )
    ids = _ids(256, (1, 8))
    exact = motif_forward(cfg, state, ids)
    with torch.no_grad():
        err = (model(ids).logits.double() - exact).abs().max().item()
    assert err <= float32_bound(cfg, state, ids, exact), err


def test_save_pretrained_writes_motifs_layout_back(tmp_path):
    """A loaded Motif model saves as a Motif folder: model_type "Motif", Motif's row order (the inverse permutation),
    every tensor equal to the source's; it reloads to the same logits. A model built from its config (not loaded)
    saves Motif's order too: the class records its conversion for saving."""
    cfg, state = motif_folder(tmp_path / "m", "tiny-gqa", seed=6)
    model = MotifForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    built = MotifForCausalLM(model.config)
    built.load_state_dict(model.state_dict())
    for source, folder in ((model, tmp_path / "saved"), (built, tmp_path / "built")):
        source.save_pretrained(folder)
        saved = load_file(folder / "model.safetensors")
        assert saved.keys() == state.keys() and all(torch.equal(saved[k], state[k]) for k in state), folder
        assert json.loads((folder / "config.json").read_text())["model_type"] == "Motif"
        assert not list(folder.glob("*.py"))  # no difftransformer code in a Motif folder
    assert not torch.equal(
        model.model.layers[0].self_attn.q_proj.weight, state["model.layers.0.self_attn.q_proj.weight"]
    )
    ids = _ids(cfg["vocab_size"], (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(
            MotifForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)(ids).logits, model(ids).logits
        )


def test_trainer_shifts_labels_for_label_smoothing(tmp_path):
    """``Trainer`` with ``label_smoothing_factor`` computes next-token targets only for class names in transformers'
    causal-LM table; building a ``MotifForCausalLM`` adds its name there (no ``register_motif`` needed), so the
    smoothed loss is the one over shifted labels (an unshifted one, each position predicting its own token, is far
    from it). That nothing is added before: tests/models/test_registration.py."""
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_pt_utils import LabelSmoother

    cfg, _ = motif_folder(tmp_path / "m", "tiny-mha", seed=10)
    model = MotifForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    args = TrainingArguments(str(tmp_path / "run"), label_smoothing_factor=0.1, use_cpu=True, report_to="none")
    trainer = Trainer(model=model, args=args)
    ids = _ids(cfg["vocab_size"], (2, 9), seed=11)
    with torch.no_grad():
        loss = trainer.compute_loss(model, {"input_ids": ids, "labels": ids})
        outputs = model(input_ids=ids)
    smoother = LabelSmoother(epsilon=0.1)
    torch.testing.assert_close(loss, smoother(outputs, ids, shift_labels=True))
    assert (loss - smoother(outputs, ids)).abs() > 1e-3


@pytest.mark.parametrize(
    "override,texts",
    [
        (dict(k_ratio=2), ["k_ratio", "1"]),
        (dict(use_sliding_window=True, sliding_window=4), ["use_sliding_window", "false"]),
        (dict(use_bias=True, qkv_bias=False), ["qkv_bias", "o_proj bias"]),
        (dict(num_noise_heads=3), ["num_noise_heads", "one of [2]"]),
    ],
)
def test_motif_configs_our_model_cannot_compute_are_refused(override, texts):
    with pytest.raises(ValueError) as err:
        MotifConfig(**{**motif_config("tiny-gda"), **override})  # (the oracle's own config check would refuse them too)
    for text in texts:
        assert text in str(err.value), str(err.value)


def test_converter_writes_a_difftransformer_folder_equal_to_the_motif_model(tmp_path, capsys):
    """difftransformer-convert --from motif: our model_type with remote code, same logits as the loaded Motif folder
    (float32, to the bit), input untouched; a bad config field is one line naming field and file, exit 2, nothing
    written."""
    cfg, state = motif_folder(tmp_path / "m", "tiny-gda", seed=7)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "m").iterdir()}
    out = tmp_path / "ours"
    assert (
        convert_cli.main(
            [
                "--from",
                "motif",
                "--input",
                str(tmp_path / "m"),
                "--output",
                str(out),
                "--dtype",
                "float32",
                "--no-progress",
            ]
        )
        == 0
    )
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "m").iterdir()} == before
    assert {"modeling_difftransformer.py", "configuration_difftransformer.py", "kernels_difftransformer.py"} <= {
        p.name for p in out.iterdir()
    }
    config = AutoConfig.from_pretrained(out)
    assert (
        config.model_type == "difftransformer" and config.num_noise_heads == 2 and config.lambda_init_layer_offset == -1
    )
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    motif = MotifForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    assert type(ours) is DiffTransformerForCausalLM
    ids = _ids(cfg["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, motif(ids).logits)

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0}))
    (bad / "model.safetensors").write_bytes((tmp_path / "m" / "model.safetensors").read_bytes())
    for config_edit, field in (
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"k_ratio": 3}, "k_ratio"),
        ({"attn_rms_norm_eps": -1.0}, "attn_rms_norm_eps"),
        ({"model_type": "llama"}, "model_type"),
    ):
        (bad / "config.json").write_text(json.dumps({**cfg, **config_edit}))
        capsys.readouterr()
        assert (
            convert_cli.main(["--from", "motif", "--input", str(bad), "--output", str(tmp_path / "x"), "--no-progress"])
            == 2
        )
        err = capsys.readouterr().err
        assert field in err and err.count("\n") == 1, err
        assert str(bad / "config.json") in err or field == "model_type", err
        assert not (tmp_path / "x").exists()


def test_converted_folder_runs_as_remote_code_without_the_package(tmp_path):
    """The converted GDA + PolyNorm + Motif-λinit folder, loaded with trust_remote_code in a process where
    difftransformer cannot be imported, gives the oracle's greedy tokens with and without the cache."""
    cfg, state = motif_folder(tmp_path / "m", "tiny-gda", seed=8)
    convert_cli.main(
        [
            "--from",
            "motif",
            "--input",
            str(tmp_path / "m"),
            "--output",
            str(tmp_path / "ours"),
            "--dtype",
            "float32",
            "--no-progress",
        ]
    )
    ids = _ids(cfg["vocab_size"], (1, 5), seed=9)
    expected, _ = oracle_greedy(cfg, state, ids, steps=NEW_TOKENS)
    remote = remote_generate(tmp_path / "ours", ids, tmp_path)
    assert remote["cached"] == remote["uncached"] == expected[:, ids.shape[1] :].tolist()
