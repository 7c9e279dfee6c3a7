"""save_pretrained / from_pretrained: exact round trips, Hub remote-code format, meta-device init, loud failures."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
)

from difftransformer import DiffTransformerForCausalLM
from difftransformer.modeling_difftransformer import DiffTransformerAttention
from difftransformer.testing_utils import randomize_norms, tiny_config
from utils_stats import normal_std_interval


def assert_same_state(model, loaded):
    original, reloaded = model.state_dict(), loaded.state_dict()
    assert original.keys() == reloaded.keys()
    for key in original:
        assert torch.equal(original[key], reloaded[key]), key


def _saved(tmp_path, layout, **overrides):
    torch.manual_seed(0)
    model = randomize_norms(DiffTransformerForCausalLM(tiny_config(layout, **overrides)).eval())
    folder = tmp_path / layout
    model.save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_round_trip_is_exact_in_safetensors(tmp_path, layout):
    model, folder = _saved(tmp_path, layout)
    assert (folder / "model.safetensors").exists() and not list(folder.glob("*.bin"))
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded) is DiffTransformerForCausalLM
    assert_same_state(model, loaded)
    if layout.startswith("v1"):
        assert loaded.model.layers[0].self_attn.lambda_q1.dtype == torch.float32
    ids = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_bfloat16_round_trip(tmp_path):
    torch.manual_seed(0)
    model = DiffTransformerForCausalLM(tiny_config("v1_gqa")).to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert_same_state(model, loaded)


def test_folder_is_in_hub_remote_code_format(tmp_path):
    _, folder = _saved(tmp_path, "v1_gqa")
    assert (folder / "configuration_difftransformer.py").exists() and (folder / "modeling_difftransformer.py").exists()
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoConfig"] == "configuration_difftransformer.DiffTransformerConfig"
    assert auto_map["AutoModel"] == "modeling_difftransformer.DiffTransformerModel"
    assert auto_map["AutoModelForCausalLM"] == "modeling_difftransformer.DiffTransformerForCausalLM"


REMOTE_CODE_CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.modules["difftransformer"] = None  # the package must not be importable here
    try:
        import difftransformer
        raise SystemExit("difftransformer is importable")
    except ImportError:
        pass
    from transformers import AutoModel, AutoModelForCausalLM
    folder, ids, expected = sys.argv[1], torch.load(sys.argv[2]), torch.load(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        # another thread count: float rounding
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-6, rtol=1e-5)
    base = AutoModel.from_pretrained(folder, trust_remote_code=True)
    assert type(base).__name__ == "DiffTransformerModel"
    # Trainer's label smoothing shifts labels only for causal LMs named in this table: the remote code registers itself.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get("difftransformer") == "DiffTransformerForCausalLM"
    print("REMOTE_CODE_OK")
    """
)


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_loads_with_trust_remote_code_in_a_process_without_the_package(tmp_path, layout):
    model, folder = _saved(tmp_path, layout)
    ids = torch.randint(3, 97, (1, 6))
    with torch.no_grad():
        torch.save(model(ids).logits, tmp_path / "expected.pt")
    torch.save(ids, tmp_path / "ids.pt")
    script = tmp_path / "check.py"
    script.write_text(REMOTE_CODE_CHECK)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, str(script), str(folder), str(tmp_path / "ids.pt"), str(tmp_path / "expected.pt")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert "REMOTE_CODE_OK" in result.stdout, result.stdout + result.stderr


def _meta_then_init(cfg):
    """Build on the meta device, materialise with NaN everywhere, then run the model's own initialisation: any
    parameter or buffer that _init_weights misses stays NaN."""
    with torch.device("meta"):
        model = DiffTransformerForCausalLM(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
            t.fill_(float("nan"))
    model.init_weights()
    uninitialised = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.isnan().any()]
    assert not uninitialised, uninitialised
    return model


def test_meta_device_init_covers_lambda_and_subln():
    cfg = tiny_config("v1_gqa", num_hidden_layers=4, head_dim=64, hidden_size=64)
    model = _meta_then_init(cfg)
    ids = torch.randint(3, cfg.vocab_size, (1, 6))
    fresh = DiffTransformerForCausalLM(cfg)
    fresh.load_state_dict(model.state_dict())  # the rotary buffers were re-initialised too: same function
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, fresh(ids).logits)
    for attn in (m for m in model.modules() if isinstance(m, DiffTransformerAttention)):
        lam = torch.cat([attn.lambda_q1, attn.lambda_k1, attn.lambda_q2, attn.lambda_k2])
        low, high = normal_std_interval(lam.numel(), 0.1)  # N(0, lambda_std=0.1): chi-square tails, p ≤ 2e-9
        assert torch.isfinite(lam).all() and low < lam.std() < high
        assert torch.equal(attn.subln.weight, torch.ones_like(attn.subln.weight))
    model = _meta_then_init(tiny_config("v2_gqa", hidden_size=256))
    w = model.model.layers[0].self_attn.lambda_proj.weight
    low, high = normal_std_interval(w.numel(), 0.02)  # N(0, initializer_range=0.02)
    assert torch.isfinite(w).all() and low < w.std() < high


def test_from_pretrained_initialises_nothing_the_checkpoint_provides(tmp_path):
    model, folder = _saved(tmp_path, "v1_gqa")
    torch.manual_seed(123)  # a different seed: any random init would show
    loaded = DiffTransformerForCausalLM.from_pretrained(folder)
    assert_same_state(model, loaded)
    # A new task head on the same backbone is the only thing initialised fresh.
    clf = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3)
    assert torch.equal(clf.model.layers[1].self_attn.lambda_k2, model.model.layers[1].self_attn.lambda_k2)
    assert AutoModel.from_pretrained(folder).layers[0].self_attn.subln.weight.shape == (16,)


@pytest.mark.parametrize(
    "key",
    [
        "model.layers.1.self_attn.lambda_q2",
        "model.layers.0.self_attn.subln.weight",
        "model.layers.2.self_attn.k_proj.weight",
    ],
)
def test_checkpoint_missing_a_tensor_is_initialised_and_reported(tmp_path, key, caplog):
    """transformers' loading contract: a tensor the checkpoint lacks is initialised by _init_weights (λ vectors
    N(0, lambda_std), subln ones, projections N(0, initializer_range)) and named in the load report and the log."""
    model, folder = _saved(tmp_path, "v1_gqa")
    tensors = load_file(folder / "model.safetensors")
    del tensors[key]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    loaded, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == {key} or sorted(info["missing_keys"]) == [key]
    assert key in caplog.text
    original, reloaded = model.state_dict(), loaded.state_dict()
    for name in original:
        assert torch.equal(original[name], reloaded[name]) == (name != key), name  # only the missing one differs
    fresh = reloaded[key]
    if key.endswith("subln.weight"):
        assert torch.equal(fresh, torch.ones_like(fresh))
    else:
        low, high = normal_std_interval(fresh.numel(), 0.1 if "lambda" in key else 0.02)
        assert torch.isfinite(fresh).all() and low < fresh.std() < high


def test_a_llama_checkpoint_is_refused_with_a_pointer_to_the_converter(tmp_path):
    """The mistake that would silently change the function: a V1 model has a Llama's shapes, so a Llama's weights
    would load into differently-wired heads. Refused both by its config.json and, under our config.json, by its
    weights (no differential tensor at all)."""
    cfg = tiny_config("v1_gqa")
    llama = LlamaForCausalLM(
        LlamaConfig(
            **{
                k: getattr(cfg, k)
                for k in (
                    "vocab_size",
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                )
            }
        )
    )
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match=r"'llama' checkpoint.*difftransformer-convert --from llama"):
        DiffTransformerForCausalLM.from_pretrained(tmp_path / "llama")
    cfg.save_pretrained(tmp_path / "llama")  # our config.json beside the Llama weights
    with pytest.raises(ValueError, match=r"none of the differential-attention ones.*difftransformer-convert"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "llama")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_empty_state_dict_initialises_every_tensor_like_a_new_model(layout, dtype):
    """transformers' own way to build a model through from_pretrained (its common tests use it): every tensor is
    missing, so every one is initialised as docs/model.md ("Loading") says: projections and embeddings
    N(0, initializer_range) (the padding row zero), norms (V1's subln too) ones, V1's λ vectors N(0, lambda_std).
    Checked by their statistics: each matrix's standard deviation within 25% of its std (at least 192 draws: about
    5 standard errors) and its mean within 5 standard errors of 0; the λ vectors pooled (96 draws) within 35%. Every
    tensor has the dtype asked for except V1's λ vectors, which stay float32 (docs/model.md, "Numerics: float64,
    float32, bfloat16")."""
    cfg = tiny_config(layout)
    torch.manual_seed(0)
    model, info = DiffTransformerForCausalLM.from_pretrained(
        None, config=cfg, state_dict={}, dtype=dtype, output_loading_info=True
    )
    assert set(info["missing_keys"]) >= {k for k in model.state_dict() if k != "lm_head.weight"}
    lambdas, checked = [], set()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all() and p.device.type == "cpu", name
        loaded, p = p.dtype, p.detach().double()  # the dtype as loaded; the statistics in float64
        is_lambda = name.rsplit(".", 1)[-1] in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
        assert loaded == (torch.float32 if is_lambda else dtype), (name, loaded)
        if name.endswith(("norm.weight", "layernorm.weight", "subln.weight")):
            assert torch.equal(p, torch.ones_like(p)), name
        elif is_lambda:
            assert p.numel() == cfg.head_dim, name
            lambdas.append(p)
        elif p.dim() == 2:
            if name == "model.embed_tokens.weight":
                assert torch.equal(p[cfg.pad_token_id], torch.zeros_like(p[0])), "padding row"
                p = torch.cat([p[: cfg.pad_token_id], p[cfg.pad_token_id + 1 :]])
            assert p.numel() >= 192, (name, p.shape)
            assert abs(p.std().item() / cfg.initializer_range - 1) < 0.25, (name, p.std().item())
            assert abs(p.mean().item()) < 5 * cfg.initializer_range / p.numel() ** 0.5, (name, p.mean().item())
        else:
            raise AssertionError(f"no initialisation rule checked for {name} {tuple(p.shape)}")
        checked.add(name)
    assert checked == {name for name, _ in model.named_parameters()}
    if cfg.diff_version == 1:
        pooled = torch.cat(lambdas)
        assert len(lambdas) == 4 * cfg.num_hidden_layers
        assert abs(pooled.std().item() / cfg.lambda_std - 1) < 0.35, pooled.std().item()
        assert abs(pooled.mean().item()) < 5 * cfg.lambda_std / pooled.numel() ** 0.5
    else:
        assert not lambdas and any(name.endswith("lambda_proj.weight") for name in checked)


def test_checkpoint_with_mis_shaped_tensor_fails_loudly(tmp_path, caplog):
    _, folder = _saved(tmp_path, "v2_gqa")
    tensors = load_file(folder / "model.safetensors")
    key = "model.layers.0.self_attn.lambda_proj.weight"
    tensors[key] = torch.zeros(3, tensors[key].shape[1])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(folder)
    assert key in caplog.text and "[3, 48]" in caplog.text  # transformers' load report names the tensor
