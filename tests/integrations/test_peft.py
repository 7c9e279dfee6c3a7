"""PEFT LoRA on DiffTransformer: default targets by model type (after the explicit ``register_peft()``, as
docs/ecosystem.md says; without it PEFT asks for ``target_modules``: tests/models/test_registration.py), explicit and
"all-linear" targets, λ trained with the adapter and saved in it, adapter save → load, merge_and_unload → a normal
folder loading with and without the package."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

peft = pytest.importorskip("peft", reason="PEFT is not installed (pip install peft, or the [train] extra)")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402
from safetensors import safe_open  # noqa: E402

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM  # noqa: E402
from difftransformer.integrations import (  # noqa: E402
    enable_lambda_training,
    lambda_modules_to_save,
    register_peft,
    save_adapter,
)

IDS = torch.randint(4, 128, (2, 12), generator=torch.Generator().manual_seed(0))


pytestmark = pytest.mark.usefixtures("one_torch_thread", "peft_defaults")


@pytest.fixture(scope="module")
def peft_defaults():
    """What docs/ecosystem.md, "PEFT LoRA", tells users to call once before LoraConfig without target_modules."""
    return register_peft()


def base_model(version, seed=0):
    config = DiffTransformerConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        diff_version=version,
    )
    torch.manual_seed(seed)
    return DiffTransformerForCausalLM(config).eval()


def lora_targets(model):
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LoraLayer)})


def train_a_little(model, steps=3):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    for _ in range(steps):
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("version", [1, 2])
def test_lora_without_target_modules_uses_registered_defaults(version):
    # docs/ecosystem.md, "PEFT LoRA"
    model = get_peft_model(base_model(version), LoraConfig(task_type="CAUSAL_LM"))
    assert lora_targets(model) == ["q_proj", "v_proj"]  # Llama's defaults: our module names are Llama's
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    torch.testing.assert_close(logits(model), logits(base_model(version)))  # LoRA B starts at zero


def test_register_peft_gives_our_type_llamas_defaults_in_every_table(peft_defaults):
    """Every PEFT table with a Llama entry gets the same entry for "difftransformer" (LoRA's and IA³'s checked by
    value); a second call changes nothing and reports the same tables."""
    from peft.utils import constants
    from peft.utils.constants import (
        TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING,
        TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING,
    )

    with_llama = sorted(
        n
        for n, t in vars(constants).items()
        if n.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(t, dict) and "llama" in t
    )
    assert peft_defaults == with_llama and "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING" in with_llama
    assert TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["difftransformer"] == ["q_proj", "v_proj"]
    assert TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING["difftransformer"] == ["k_proj", "v_proj", "down_proj"]
    assert register_peft() == peft_defaults


@pytest.mark.parametrize("version", [1, 2])
def test_explicit_and_all_linear_targets(version):
    explicit = get_peft_model(base_model(version), LoraConfig(target_modules=["k_proj", "o_proj", "down_proj"]))
    assert lora_targets(explicit) == ["down_proj", "k_proj", "o_proj"]
    every = get_peft_model(base_model(version), LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear"))
    # lm_head excluded, as for every transformers model; V2's λ projection too: it is no nn.Linear (quantizers must
    # leave it alone, docs/ecosystem.md), and trains through modules_to_save (below)
    expected = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert lora_targets(every) == expected
    before = logits(every)
    train_a_little(every, steps=1)
    assert not torch.allclose(logits(every), before)


@pytest.mark.parametrize("version", [1, 2])
def test_lambda_trains_with_the_adapter_and_save_load_reproduces_logits(version, tmp_path):
    """PEFT's own save_pretrained (no extra step) keeps the trained λ: V2's lambda_proj through modules_to_save, V1's
    vectors because enable_lambda_training made that PeftModel's save_pretrained write them; PeftModel.from_pretrained
    into a fresh base model restores LoRA and λ (float32 stored as is: the same logits)."""
    config = LoraConfig(task_type="CAUSAL_LM", modules_to_save=lambda_modules_to_save(base_model(version).config))
    model = get_peft_model(base_model(version), config)
    if version == 1:
        names = enable_lambda_training(model)
        assert len(names) == 4 * 2  # four λ vectors per layer
    lam_before = base_model(version).layer_lambdas() if version == 1 else None
    train_a_little(model)
    expected = logits(model)
    model.save_pretrained(tmp_path / "adapter")

    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    lam_key = "self_attn.lambda_q1" if version == 1 else "self_attn.lambda_proj.weight"
    assert any(k.endswith(lam_key) for k in keys), keys
    assert any("lora_A" in k for k in keys)  # PEFT's own adapter is still there

    # Plain PEFT loading into a fresh base model restores LoRA *and* λ.
    loaded = PeftModel.from_pretrained(base_model(version), tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(loaded), expected)
    if version == 1:
        lam_loaded = loaded.get_base_model().layer_lambdas()
        assert not torch.allclose(lam_loaded, lam_before)  # λ really moved and came back from the adapter file
        assert torch.equal(lam_loaded, model.get_base_model().layer_lambdas())
    else:
        wrapped = loaded.get_base_model().model.layers[0].self_attn.lambda_proj
        trained = wrapped.modules_to_save["default"].weight
        assert not torch.equal(trained, wrapped.original_module.weight)


def _trained_v1(adapter_name="default"):
    model = get_peft_model(base_model(1), LoraConfig(task_type="CAUSAL_LM"), adapter_name=adapter_name)
    enable_lambda_training(model)
    train_a_little(model)
    return model


@pytest.mark.parametrize("route", ["bin", "named_adapter", "deepcopy", "save_adapter", "enabled_twice"])
def test_every_v1_save_route_keeps_the_trained_lambdas(route, tmp_path):
    """The other ways a PEFT user saves: the legacy .bin file (safe_serialization=False), an adapter with a name
    (PEFT's subfolder), a deep copy of the model (its own λ, not the original's), save_adapter (the explicit helper),
    and enable_lambda_training called twice. Each reloads into a fresh base model with the trained λ and logits."""
    import copy

    model = _trained_v1("extra" if route == "named_adapter" else "default")
    if route == "enabled_twice":
        enable_lambda_training(model)
    if route == "deepcopy":
        model = copy.deepcopy(model)
        with torch.no_grad():
            model.get_base_model().model.layers[1].self_attn.lambda_k2.add_(0.25)  # only the copy's λ
    lambdas, expected = model.get_base_model().layer_lambdas(), logits(model)
    folder = tmp_path / "adapter"
    if route == "bin":
        model.save_pretrained(folder, safe_serialization=False)
        assert (folder / "adapter_model.bin").is_file() and not (folder / "adapter_model.safetensors").exists()
    elif route == "save_adapter":
        assert save_adapter(model, folder) == folder
    else:
        model.save_pretrained(folder)
    if route == "named_adapter":
        folder = folder / "extra"
    loaded = PeftModel.from_pretrained(base_model(1), folder).eval()
    assert not torch.equal(lambdas, base_model(1).layer_lambdas())  # trained: the check below can fail
    assert torch.equal(loaded.get_base_model().layer_lambdas(), lambdas)
    torch.testing.assert_close(logits(loaded), expected)


def test_saving_without_the_active_adapter_warns_that_the_lambdas_are_not_saved(tmp_path, caplog):
    """λ are stored with the active adapter; selected_adapters without it saves no λ, and says so."""
    model = _trained_v1()
    model.add_adapter("other", LoraConfig(task_type="CAUSAL_LM"))
    with caplog.at_level("WARNING", logger="difftransformer.integrations"):
        model.save_pretrained(tmp_path / "a", selected_adapters=["other"])
    assert "were not saved" in caplog.text and "'default'" in caplog.text, caplog.text
    with safe_open(str(tmp_path / "a" / "other" / "adapter_model.safetensors"), "pt") as f:
        assert not any("lambda_" in k for k in f.keys())


def test_enable_lambda_training_points_v2_users_to_modules_to_save():
    model = get_peft_model(base_model(2), LoraConfig(task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match="modules_to_save"):
        enable_lambda_training(model)


REMOTE_LOAD = textwrap.dedent("""
    import json, sys
    sys.modules["difftransformer"] = None  # the package is not installed here
    import torch
    from transformers import AutoModelForCausalLM
    for folder in sys.argv[1:]:
        expected = json.load(open(folder + "/../expected.json"))
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            out = model(input_ids=torch.tensor(expected["ids"])).logits
        torch.testing.assert_close(out, torch.tensor(expected["logits"]), rtol=1e-5, atol=1e-5)
    print("ok")
""")


def test_merge_and_unload_gives_a_normal_folder_with_and_without_the_package(tmp_path):
    from transformers import AutoModelForCausalLM

    folders = []
    for version in (1, 2):
        config = LoraConfig(
            task_type="CAUSAL_LM",
            target_modules="all-linear",
            modules_to_save=lambda_modules_to_save(base_model(version).config),
        )
        model = get_peft_model(base_model(version), config)
        if version == 1:
            enable_lambda_training(model)
        train_a_little(model, steps=2)
        expected = logits(model)
        merged = model.merge_and_unload()
        assert type(merged) is DiffTransformerForCausalLM
        folder = tmp_path / f"v{version}" / "merged"
        merged.save_pretrained(folder)
        assert not any("lora" in k for k in safe_open(str(folder / "model.safetensors"), "pt").keys())
        assert (folder / "modeling_difftransformer.py").is_file()
        # With the package: a plain transformers load.
        torch.testing.assert_close(
            logits(AutoModelForCausalLM.from_pretrained(folder).eval()), expected, rtol=1e-5, atol=1e-5
        )
        (folder.parent / "expected.json").write_text(json.dumps({"ids": IDS.tolist(), "logits": expected.tolist()}))
        folders.append(str(folder))
    # Without the package: remote code from the folder itself, in a fresh process.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", REMOTE_LOAD, *folders],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]
