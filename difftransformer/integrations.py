"""Glue between difftransformer and the libraries users train with: PEFT and transformers' ``Trainer``.

Both libraries key some behaviour off *static* tables of known architectures, which a model registered at run time
is missing from:

* PEFT picks default adapter targets (``LoraConfig(task_type="CAUSAL_LM")`` without ``target_modules``) from
  ``peft.utils.constants.TRANSFORMERS_MODELS_TO_*_TARGET_MODULES_MAPPING`` by ``config.model_type``; an unknown type
  raises. :func:`register_peft` adds ``"difftransformer"`` with Llama's entries: our module names are Llama's
  (``q_proj``, ``v_proj``, ``down_proj``, ...), so every PEFT method's Llama default applies unchanged.
* ``Trainer`` with ``label_smoothing_factor > 0`` shifts labels by one (next-token targets) only when the model's
  class name is in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; the modeling file itself adds our causal-LM class there,
  so that this also holds when the model is loaded as remote code without the package.

:func:`register_integrations` runs at ``import difftransformer``. The differential λ parameters can be trained next to an adapter:

* V2: ``lambda_proj`` is an ``nn.Linear``; PEFT's own ``modules_to_save=["lambda_proj"]`` trains it and stores it in
  the adapter (see :func:`lambda_modules_to_save`).
* V1: ``lambda_q1/k1/q2/k2`` are bare ``nn.Parameter`` vectors of the attention module, which PEFT cannot wrap
  (``modules_to_save`` wraps modules, and wrapping ``self_attn`` would fully fine-tune q/k/v/o and forbid LoRA inside
  it; ``target_parameters`` needs 2-D weights). :func:`enable_lambda_training` marks them trainable and makes
  that PeftModel's ``save_pretrained`` :func:`save_adapter`, which writes them into ``adapter_model.safetensors``
  under the names PEFT's loader matches. So everything that saves through ``save_pretrained`` keeps λ: the user's
  own call, ``Trainer`` checkpoints (``save_steps``) and ``trainer.save_model()`` (transformers' ``Trainer._save``
  calls ``PeftModel.save_pretrained``); and everything that loads through PEFT's loader restores it:
  ``PeftModel.from_pretrained`` and ``Trainer.train(resume_from_checkpoint=...)`` (which calls
  ``PeftModel.load_adapter``; both pass the λ keys to ``load_state_dict(strict=False)`` unchanged).
"""

from __future__ import annotations

import os
import re
import types
from pathlib import Path

MODEL_TYPE = "difftransformer"
# Names of the V1 λ vectors inside an attention module (SPEC §3).
V1_LAMBDA_NAMES = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
_V1_LAMBDA_RE = re.compile(r"(^|\.)self_attn\.(" + "|".join(V1_LAMBDA_NAMES) + r")$")


def register_peft() -> bool:
    """Give ``model_type="difftransformer"`` PEFT's Llama defaults for every adapter method. Idempotent.

    Returns ``False`` (and does nothing) when PEFT is not installed.
    """
    try:
        from peft.utils import constants
    except ImportError:
        return False
    for name in dir(constants):
        table = getattr(constants, name)
        # Mutated in place: PEFT's tuner classes hold references to these very dicts (e.g.
        # LoraModel.target_module_mapping is TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and "llama" in table:
            table.setdefault(MODEL_TYPE, table["llama"])
    return True


def register_integrations() -> None:
    """:func:`register_peft`; meant to run at ``import difftransformer``."""
    register_peft()


def _config_of(model):
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) != MODEL_TYPE:
        raise ValueError(f"Expected a difftransformer model (config.model_type={MODEL_TYPE!r}), got {type(model).__name__}.")
    return config


def lambda_modules_to_save(config) -> list[str]:
    """``modules_to_save`` entries that train λ with PEFT's own mechanism: ``["lambda_proj"]`` for V2.

    V1 has no λ *module* (λ is four vectors on the attention module): the list is empty; use
    :func:`enable_lambda_training` and :func:`save_adapter` instead.
    """
    return ["lambda_proj"] if config.diff_version == 2 else []


def enable_lambda_training(peft_model) -> list[str]:
    """Mark λ trainable in a PEFT-wrapped (or plain) model and return the names of the parameters switched on.

    V1: the four λ vectors of every layer (float32, ``head_dim`` each: a few hundred parameters per model).
    V2: rejected with a pointer to ``modules_to_save=["lambda_proj"]``, PEFT's native route (it also keeps the base
    ``lambda_proj`` untouched, so ``disable_adapter()`` still gives the base model).

    Note that V1 λ are trained *in place* in the base model (PEFT has no copy-on-train mechanism for bare
    parameters): ``disable_adapter()`` disables the LoRA update but not a λ change.

    For a ``PeftModel``, this instance's ``save_pretrained`` becomes :func:`save_adapter` (bound to the instance,
    the class is untouched), so Trainer checkpoints and ``trainer.save_model()`` store the trained λ with the adapter
    and ``resume_from_checkpoint`` / ``PeftModel.from_pretrained`` restore them (module docstring).
    """
    config = _config_of(peft_model)
    if config.diff_version != 1:
        raise ValueError(
            "enable_lambda_training is for diff_version=1 (λ vectors); for diff_version=2 add "
            "modules_to_save=['lambda_proj'] to the PEFT config (see lambda_modules_to_save)."
        )
    names = []
    for name, param in peft_model.named_parameters():
        if _V1_LAMBDA_RE.search(name):
            param.requires_grad_(True)
            names.append(name)
    if names and _is_peft_model(peft_model):
        peft_model.save_pretrained = types.MethodType(save_adapter, peft_model)
    return names


def _is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def save_adapter(peft_model, save_directory: str | os.PathLike, **kwargs) -> Path:
    """``peft_model.save_pretrained(save_directory, **kwargs)``, plus trainable V1 λ inside the adapter file.

    The λ tensors are stored under the PeftModel's own parameter names (``base_model.model.model.layers.{l}.
    self_attn.lambda_q1``, ...), which PEFT's ``set_peft_model_state_dict`` passes unchanged to
    ``load_state_dict(strict=False)``: ``PeftModel.from_pretrained(base, folder)`` restores them with no extra step.
    Returns the folder of the default adapter file. After :func:`enable_lambda_training` a PeftModel's own
    ``save_pretrained`` does this, so calling it directly is no longer needed.
    """
    from safetensors.torch import load_file, save_file

    _config_of(peft_model)
    # The class's method: after enable_lambda_training, the instance's save_pretrained is this very function.
    type(peft_model).save_pretrained(peft_model, save_directory, **kwargs)
    if not kwargs.get("is_main_process", True):  # distributed: only the main process writes (as PEFT does)
        return Path(save_directory)
    lambdas = {
        name: param.detach().to("cpu").contiguous()
        for name, param in peft_model.named_parameters()
        if param.requires_grad and _V1_LAMBDA_RE.search(name)
    }
    adapter_name = getattr(peft_model, "active_adapter", "default")
    folder = Path(save_directory) if adapter_name == "default" else Path(save_directory) / adapter_name
    if lambdas:
        path = folder / "adapter_model.safetensors"
        if not path.is_file():
            raise ValueError(
                f"{path} not found: V1 λ are stored inside the safetensors adapter file; "
                "do not pass safe_serialization=False."
            )
        tensors = load_file(path)
        tensors.update(lambdas)
        save_file(tensors, path, metadata={"format": "pt"})
    return folder


__all__ = [
    "V1_LAMBDA_NAMES",
    "enable_lambda_training",
    "lambda_modules_to_save",
    "register_integrations",
    "register_peft",
    "save_adapter",
]
