"""The package as a guest in other projects' tables (difftransformer/registration.py; docs/ecosystem.md,
"Registration"): ``import difftransformer`` registers its own ``model_type "difftransformer"`` and nothing else (no
Motif name, no PEFT or Liger entry, no import hook), refuses to replace a ``"difftransformer"`` registered by someone
else (it warns and keeps theirs), and the opt-in calls (``register_motif``, ``register_peft``, ``register_liger``) work
and never replace another's entry unless forced. What an import changes is only visible in an interpreter that has
not imported the package yet: those checks run in a fresh Python process each."""

import os
import subprocess
import sys
import textwrap

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from difftransformer import DiffTransformerForCausalLM
from difftransformer.registration import RegistrationConflict, register_model_type, registration_conflicts
from utils_motif import motif_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A fresh interpreter: what the import changes, what works without the opt-in calls and what the opt-in calls change.
CLEAN_IMPORT = textwrap.dedent("""
    import sys, warnings
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers import conversion_mapping
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    meta_path, names_before = list(sys.meta_path), dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import difftransformer
    assert not [w for w in caught if "did not register" in str(w.message)], [str(w.message) for w in caught]
    assert sys.meta_path == meta_path, "import hook installed"
    assert not [m for m in sys.modules if m.split(".")[0] in ("peft", "liger_kernel")], "PEFT or Liger imported"
    # Our own name only: config and the Auto classes; Trainer's causal-LM name once a model is built (below).
    assert CONFIG_MAPPING["difftransformer"] is difftransformer.DiffTransformerConfig
    model_class = AutoModelForCausalLM._model_mapping[difftransformer.DiffTransformerConfig]
    assert model_class is difftransformer.DiffTransformerForCausalLM
    changed = {k: v for k, v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if names_before.get(k) != v}
    assert changed == {}, changed
    # No Motif name: no config, no model, no checkpoint conversion registered with transformers.
    assert "Motif" not in CONFIG_MAPPING
    assert AutoModelForCausalLM._model_mapping.get(difftransformer.MotifConfig, None) is None
    assert conversion_mapping.get_checkpoint_conversion_mapping("Motif") is None
    assert conversion_mapping.get_checkpoint_conversion_mapping("MotifForCausalLM") is None

    # PEFT: no default targets for our type until register_peft(); PEFT itself says what is missing.
    from peft import LoraConfig, get_peft_model
    from peft.utils import constants
    tables = {n: t for n, t in vars(constants).items()
              if n.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(t, dict)}
    assert not [n for n, t in tables.items() if "difftransformer" in t]
    config = difftransformer.DiffTransformerConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    difftransformer.DiffTransformerForCausalLM(config)
    changed = {k: v for k, v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if names_before.get(k) != v}
    assert changed == {"difftransformer": "DiffTransformerForCausalLM"}, changed  # building the model added it
    try:
        get_peft_model(difftransformer.DiffTransformerForCausalLM(config), LoraConfig(task_type="CAUSAL_LM"))
    except ValueError as err:
        assert "target_modules" in str(err), err
    else:
        raise AssertionError("LoraConfig without target_modules was accepted before register_peft()")
    from difftransformer import integrations
    assert "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING" in integrations.register_peft()
    get_peft_model(difftransformer.DiffTransformerForCausalLM(config), LoraConfig(task_type="CAUSAL_LM"))

    # Liger: Trainer(use_liger_kernel=True) patches nothing until register_liger().
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    from transformers.integrations.liger import apply_liger_kernel
    assert "difftransformer" not in MODEL_TYPE_TO_APPLY_LIGER_FN
    plain = difftransformer.DiffTransformerForCausalLM(config)
    apply_liger_kernel(plain, {})
    assert "forward" not in vars(plain), "patched without register_liger()"
    integrations.register_liger()
    assert MODEL_TYPE_TO_APPLY_LIGER_FN["difftransformer"] is integrations.apply_liger_kernel_to_difftransformer
    apply_liger_kernel(plain, {})
    assert vars(plain)["forward"].__func__ is integrations._liger_fused_loss_forward

    # Motif: MotifForCausalLM loads a Motif folder with no registration (its query rows permuted at load); the Auto
    # class does not (the folder names Motif's remote code) until register_motif().
    folder = sys.argv[1]
    try:
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)
    except ValueError as err:
        assert "trust_remote_code" in str(err), err
    else:
        raise AssertionError("a Motif folder loaded through the Auto class without register_motif()")
    from safetensors.torch import load_file
    from difftransformer.motif import motif_query_rows, register_motif
    model = difftransformer.MotifForCausalLM.from_pretrained(folder, dtype=torch.float32)
    stored = load_file(folder + "/model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    rows = motif_query_rows(model.config)
    assert not torch.equal(rows, torch.arange(rows.numel()))
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, stored.index_select(0, rows))
    assert "Motif" not in CONFIG_MAPPING
    assert "MotifForCausalLM" in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()  # added by building the class
    register_motif()
    assert type(AutoModelForCausalLM.from_pretrained(folder)) is difftransformer.MotifForCausalLM

    # Re-importing the package (new class objects of the same names) registers them again, silently.
    first = difftransformer.DiffTransformerConfig
    for name in [m for m in sys.modules if m == "difftransformer" or m.startswith("difftransformer.")]:
        del sys.modules[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import difftransformer
        import difftransformer.motif
        difftransformer.motif.register_motif()
    assert not [w for w in caught if "did not register" in str(w.message)], [str(w.message) for w in caught]
    assert difftransformer.DiffTransformerConfig is not first
    assert CONFIG_MAPPING["difftransformer"] is difftransformer.DiffTransformerConfig
    assert CONFIG_MAPPING["Motif"] is difftransformer.MotifConfig
    print("ok")
""")

# A fresh interpreter where another package registered "difftransformer" and "Motif" before the import, and where
# PEFT's and Liger's tables already hold entries for our type.
OTHERS_FIRST = textwrap.dedent("""
    import logging, sys, warnings
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    class OtherConfig(PreTrainedConfig):
        model_type = "difftransformer"

    class OtherMotifConfig(PreTrainedConfig):
        model_type = "Motif"

    AutoConfig.register("difftransformer", OtherConfig)
    AutoConfig.register("Motif", OtherMotifConfig)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import difftransformer
    told = [str(w.message) for w in caught if "did not register" in str(w.message)]
    assert len(told) == 1 and "OtherConfig" in told[0] and "from_pretrained" in told[0], told
    assert CONFIG_MAPPING["difftransformer"] is OtherConfig
    assert AutoModelForCausalLM._model_mapping.get(difftransformer.DiffTransformerConfig, None) is None
    # Our classes still load our folders directly, remote code still written.
    config = difftransformer.DiffTransformerConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    difftransformer.DiffTransformerForCausalLM(config).save_pretrained(sys.argv[1])
    import os
    assert "modeling_difftransformer.py" in os.listdir(sys.argv[1])
    difftransformer.DiffTransformerForCausalLM.from_pretrained(sys.argv[1])

    from difftransformer.motif import register_motif
    from difftransformer.registration import RegistrationConflict
    try:
        register_motif()
    except RegistrationConflict as err:
        assert "OtherMotifConfig" in str(err) and "force=True" in str(err), err
    else:
        raise AssertionError("register_motif replaced another package's 'Motif'")
    assert CONFIG_MAPPING["Motif"] is OtherMotifConfig  # nothing replaced, nothing half-registered
    assert AutoModelForCausalLM._model_mapping.get(difftransformer.MotifConfig, None) is None
    register_motif(force=True)
    assert CONFIG_MAPPING["Motif"] is difftransformer.MotifConfig
    assert AutoModelForCausalLM._model_mapping[difftransformer.MotifConfig] is difftransformer.MotifForCausalLM

    from peft.utils import constants
    constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["difftransformer"] = ["o_proj"]
    from difftransformer import integrations
    registered = integrations.register_peft()
    assert constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["difftransformer"] == ["o_proj"]
    assert "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING" not in registered
    assert "TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING" in registered

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    def someone_elses(model=None, **kwargs):
        pass
    MODEL_TYPE_TO_APPLY_LIGER_FN["difftransformer"] = someone_elses
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    integrations.logger.addHandler(handler)
    integrations.register_liger()
    assert MODEL_TYPE_TO_APPLY_LIGER_FN["difftransformer"] is someone_elses
    assert any("someone_elses" in r.getMessage() and "kept" in r.getMessage() for r in records), records
    print("ok")
""")


def _run(script, *args, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    out = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


def test_import_registers_only_our_model_type_and_the_opt_in_calls_work(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("liger_kernel")
    motif_folder(tmp_path / "motif", "tiny-gqa", seed=0)  # two noise heads per KV pair: its query rows move at load
    _run(CLEAN_IMPORT, tmp_path / "motif", tmp_path=tmp_path)


def test_names_registered_by_others_are_kept(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("liger_kernel")
    _run(OTHERS_FIRST, tmp_path / "saved", tmp_path=tmp_path)


class GuestConfig(PreTrainedConfig):
    model_type = "difftransformer-registration-test"


class OtherGuestConfig(PreTrainedConfig):
    model_type = "difftransformer-registration-test"


class GuestModel(DiffTransformerForCausalLM):
    config_class = GuestConfig


class OtherGuestModel(DiffTransformerForCausalLM):
    config_class = GuestConfig


def test_register_model_type_is_idempotent_and_refuses_to_replace():
    """register_model_type in this process, on a model type of the test's own: registering the same classes again
    is a no-op; another config class for the name, or another model for the config, is refused naming the entry and
    registering nothing; force=True replaces."""
    register_model_type(GuestConfig, {AutoModelForCausalLM: GuestModel})
    register_model_type(GuestConfig, {AutoModelForCausalLM: GuestModel})
    assert CONFIG_MAPPING[GuestConfig.model_type] is GuestConfig
    with pytest.raises(RegistrationConflict, match=r"AutoConfig maps model_type .* to .*\.GuestConfig"):
        register_model_type(OtherGuestConfig, {})
    assert registration_conflicts(GuestConfig, {AutoModelForCausalLM: OtherGuestModel}) == [
        f"AutoModelForCausalLM maps GuestConfig to {__name__}.GuestModel"
    ]
    with pytest.raises(RegistrationConflict, match="GuestModel"):
        register_model_type(GuestConfig, {AutoModelForCausalLM: OtherGuestModel})
    assert AutoModelForCausalLM._model_mapping[GuestConfig] is GuestModel
    register_model_type(GuestConfig, {AutoModelForCausalLM: OtherGuestModel}, force=True)
    assert AutoModelForCausalLM._model_mapping[GuestConfig] is OtherGuestModel
    assert AutoConfig.for_model(GuestConfig.model_type).__class__ is GuestConfig
