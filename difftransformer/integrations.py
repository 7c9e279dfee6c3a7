"""Glue between difftransformer and the libraries users train with: PEFT, Liger Kernel and transformers' ``Trainer``.

PEFT and Liger Kernel key some behaviour off *static* tables of known architectures, which our model type is missing
from. Nothing here runs at ``import difftransformer``: each table is changed only by an explicit call, which imports
that library then (importing PEFT pulls in bitsandbytes and torchao where installed, importing Liger loads Triton), adds
an entry for our own ``model_type "difftransformer"`` only, and never replaces one (docs/ecosystem.md, "PEFT LoRA",
"Liger Kernel"):

* :func:`register_peft`: PEFT picks default adapter targets (``LoraConfig(task_type="CAUSAL_LM")`` without
  ``target_modules``) from its tables ``peft.utils.TRANSFORMERS_MODELS_TO_*_TARGET_MODULES_MAPPING`` by
  ``config.model_type``. PEFT has no registration function for them (``register_peft_method`` registers adapter
  methods, not architectures); its documented rule for an unknown type is to pass ``target_modules``, and without
  either PEFT raises ``Please specify `target_modules` in `peft_config``` (no silent default). :func:`register_peft`
  adds ``"difftransformer"`` with Llama's entries (our module names are Llama's: ``q_proj``, ``v_proj``,
  ``down_proj``, ...), so every PEFT method's Llama default applies.
* :func:`register_liger`: Liger Kernel (``TrainingArguments(use_liger_kernel=True)``, TRL's ``use_liger_kernel``)
  looks a model's patch function up by ``config.model_type`` in
  ``liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN`` and, for a type it does not know, applies
  nothing and says so only at info level (the model then trains with its own kernels: the same loss, more memory).
  :func:`register_liger` adds :func:`apply_liger_kernel_to_difftransformer` there; or call that function on the
  model yourself (it returns what it patched).
* ``Trainer`` with ``label_smoothing_factor > 0`` shifts labels by one (next-token targets) only when the model's
  class name is in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; the modeling file adds our causal-LM class there (a
  ``setdefault`` of our own key), so that this also holds when the model is loaded as remote code without the package;
  Motif's class is added by :func:`difftransformer.motif.register_motif`.

The differential λ parameters can be trained next to an adapter:

* V2: ``lambda_proj`` (a module of its own, not an ``nn.Linear``, so that quantizers leave it alone); PEFT's own
  ``modules_to_save=["lambda_proj"]`` trains it and stores it in the adapter (see :func:`lambda_modules_to_save`).
* V1: ``lambda_q1/k1/q2/k2`` are bare ``nn.Parameter`` vectors of the attention module, which PEFT cannot wrap
  (``modules_to_save`` wraps modules, and wrapping ``self_attn`` would fully fine-tune q/k/v/o and forbid LoRA inside
  it; ``target_parameters`` adds a low-rank update to 2-D weights, it does not train a vector), and PEFT's
  ``get_peft_model_state_dict`` keeps only the keys of its tuner layers and wrappers, so its ``save_pretrained``
  drops them. :func:`enable_lambda_training` marks them trainable (in place in the base model) and gives that
  PeftModel instance a ``save_pretrained`` that runs PEFT's own and then adds the λ to each saved active adapter's
  weights file (``adapter_model.safetensors``, or ``adapter_model.bin`` with ``safe_serialization=False``) under the
  PeftModel's parameter names (the class is untouched). Every save route goes through it: the user's own
  ``save_pretrained`` and ``push_to_hub``, ``trainer.save_model()`` and every Trainer checkpoint (transformers'
  ``Trainer._save`` calls ``PeftModel.save_pretrained``).

  Loading needs nothing: ``Trainer.train(resume_from_checkpoint=...)`` (``PeftModel.load_adapter``) and
  ``PeftModel.from_pretrained`` pass the λ keys to ``load_state_dict(strict=False)`` unchanged, so the saved λ come
  back. ``merge_and_unload()`` returns the base model, which holds the trained λ itself. :func:`save_adapter` and
  :class:`LambdaCheckpointCallback` (the explicit steps of earlier versions) still work and add nothing new.

:func:`apply_liger_kernel_to_difftransformer` replaces the Llama blocks our model shares with Llama by Liger's
(RMSNorm, SwiGLU MLP, cross-entropy or the fused linear cross-entropy that never materialises the logits), returns
what it patched, and warns at WARNING level about every requested kernel it cannot apply (RoPE: the attention rotates
its own packed heads; SwiGLU on Motif's PolyNorm MLP), and when it applies nothing at all.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from pathlib import Path
from types import MethodType

from transformers import TrainerCallback
from transformers.utils import logging

from .configuration_difftransformer import DiffTransformerConfig

logger = logging.get_logger(__name__)

MODEL_TYPE = DiffTransformerConfig.model_type

# Names of the V1 λ vectors inside an attention module (docs/model.md).
V1_LAMBDA_NAMES = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
_V1_LAMBDA_RE = re.compile(r"(^|\.)self_attn\.(" + "|".join(V1_LAMBDA_NAMES) + r")$")


def register_peft() -> list[str]:
    """PEFT's default adapter targets for ``model_type "difftransformer"``: Llama's, in every table
    ``peft.utils.constants.TRANSFORMERS_MODELS_TO_*_TARGET_MODULES_MAPPING`` that has a Llama entry (LoRA: ``q_proj``,
    ``v_proj``; IA³: ``k_proj``, ``v_proj``, ``down_proj``; ...), so that ``LoraConfig(task_type="CAUSAL_LM")`` needs no
    ``target_modules``. Imports PEFT. An entry PEFT (or anyone) already holds for ``"difftransformer"`` is kept.

    The tables are changed in place: PEFT's tuner classes hold these very dicts (``LoraModel.target_module_mapping``
    is ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``). Returns the names of the tables that now hold Llama's
    entry for our type. Idempotent."""
    from peft.utils import constants

    registered = []
    for name, table in sorted(vars(constants).items()):
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and "llama" in table:
            if table.setdefault(MODEL_TYPE, table["llama"]) == table["llama"]:
                registered.append(name)
    return registered


def register_liger() -> None:
    """Liger Kernel's patch function for ``model_type "difftransformer"``: :func:`apply_liger_kernel_to_difftransformer`
    in ``liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN``, the table transformers'
    ``Trainer(use_liger_kernel=True)`` and TRL's trainers look the model type up in. Imports Liger (and so Triton).
    Idempotent; a function that Liger (or anyone) already registered for ``"difftransformer"`` is kept, with a
    warning."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    found = MODEL_TYPE_TO_APPLY_LIGER_FN.setdefault(MODEL_TYPE, apply_liger_kernel_to_difftransformer)
    where = (getattr(found, "__module__", None), getattr(found, "__qualname__", repr(found)))
    if where != (__name__, apply_liger_kernel_to_difftransformer.__qualname__):  # (ours, or ours re-imported)
        logger.warning(
            f"Liger Kernel already maps model_type {MODEL_TYPE!r} to {where[0]}.{where[1]}; kept "
            "(difftransformer's apply_liger_kernel_to_difftransformer was not registered)."
        )


def apply_liger_kernel_to_difftransformer(
    rope: bool = False,
    cross_entropy: bool = False,
    fused_linear_cross_entropy: bool = True,
    rms_norm: bool = True,
    swiglu: bool = True,
    model=None,
) -> dict[str, list[str]]:
    """Liger Kernel's Triton kernels in a difftransformer model instance (what ``Trainer(use_liger_kernel=True)``
    calls, with ``liger_kernel_config`` as keyword arguments; the same arguments as Liger's Llama function).

    * ``rms_norm``: every ``LlamaRMSNorm`` (each layer's two and the final norm) runs Liger's RMSNorm (V1's
      per-head norm, our own module with its ``1 − λinit`` scale, is left as it is);
    * ``swiglu``: every SwiGLU MLP (``LlamaMLP`` with ``silu``) runs Liger's (Motif's PolyNorm MLP is not one);
    * ``fused_linear_cross_entropy`` (default): in training, with labels, the loss comes from Liger's fused
      linear cross-entropy over the last hidden states and ``lm_head``'s weight, without materialising the logits
      (the output's ``logits`` is then None, as with Liger's Llama); otherwise the model's own forward;
    * ``cross_entropy``: Liger's cross-entropy in transformers' loss functions (process-wide, as Liger does for
      Llama); not together with ``fused_linear_cross_entropy``;
    * ``rope``: not applied (the attention rotates its own, V1-packed, heads): warned.

    Returns the names of the modules patched per kernel: ``{"rms_norm": [...], "swiglu": [...],
    "fused_linear_cross_entropy": [""]`` (the model itself) ``, "cross_entropy": [...]}``; warns at WARNING level
    about each requested kernel not applied, and when nothing is applied. Liger's kernels are Triton: the patched
    model runs on a GPU (benchmarks/gpu_check.py can call this function and compare the outputs)."""
    if model is None:
        raise ValueError(
            "apply_liger_kernel_to_difftransformer patches a model instance: pass model=... (transformers' Trainer "
            "does)."
        )
    if cross_entropy and fused_linear_cross_entropy:
        raise ValueError(
            "cross_entropy and fused_linear_cross_entropy cannot both be True (Liger's rule): the fused "
            "loss replaces the cross-entropy."
        )
    from liger_kernel.transformers import LigerSwiGLUMLP
    from liger_kernel.transformers import monkey_patch as liger
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    target = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel's model
    _config_of(target)
    patched: dict[str, list[str]] = {
        "rms_norm": [],
        "swiglu": [],
        "fused_linear_cross_entropy": [],
        "cross_entropy": [],
    }
    skipped = []
    if rope:
        skipped.append(
            "rope (the differential attention rotates its own packed heads; transformers' rotary embedding stays)"
        )
    silu = getattr(target.config, "hidden_act", "silu") in ("silu", "swish")
    for name, module in target.named_modules():
        if rms_norm and isinstance(module, LlamaRMSNorm):
            liger._patch_rms_norm_module(module, eps=module.variance_epsilon)
            patched["rms_norm"].append(name)
        elif swiglu and name.endswith(".mlp"):
            if isinstance(module, LlamaMLP) and silu:
                liger._patch_swiglu_module(module, LigerSwiGLUMLP)
                patched["swiglu"].append(name)
            elif not any(reason.startswith("swiglu") for reason in skipped):
                skipped.append(
                    f"swiglu (the MLP is {type(module).__name__} with {target.config.hidden_act!r}, not SwiGLU)"
                )
    if fused_linear_cross_entropy:
        target.forward = MethodType(_liger_fused_loss_forward, target)
        patched["fused_linear_cross_entropy"].append("")
    if cross_entropy:
        from liger_kernel.transformers.functional import liger_cross_entropy
        from transformers.loss import loss_utils

        loss_utils.nn.functional.cross_entropy = liger_cross_entropy
        patched["cross_entropy"].append("transformers.loss.loss_utils")
    for reason in skipped:
        logger.warning(f"Liger Kernel: not applied to {type(target).__name__}: {reason}.")
    if not any(patched.values()):
        logger.warning(
            f"Liger Kernel: nothing applied to {type(target).__name__} (use_liger_kernel=True with "
            f"rms_norm, swiglu, cross_entropy and fused_linear_cross_entropy all off or inapplicable)."
        )
    else:
        logger.info(
            "Liger Kernel applied to %s: %s",
            type(target).__name__,
            {kernel: len(names) for kernel, names in patched.items() if names},
        )
    return patched


def _liger_fused_loss_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    inputs_embeds=None,
    labels=None,
    logits_to_keep=0,
    **kwargs,
):
    """The causal LM's forward with Liger's fused linear cross-entropy in training (with labels): the base model's
    last hidden states and ``lm_head``'s weight go to Liger's loss; the logits are never built. Otherwise the
    class's own forward."""
    if labels is None or not self.training:
        return type(self).forward(
            self,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            labels=labels,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
    from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss

    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        **kwargs,
    )
    loss = LigerForCausalLMLoss(
        hidden_states=outputs.last_hidden_state,
        lm_head_weight=self.lm_head.weight,
        labels=labels,
        hidden_size=self.config.hidden_size,
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        shift_labels=kwargs.get("shift_labels"),
    )
    output_class = sys.modules[type(self).__module__].DiffTransformerCausalLMOutputWithPast
    return output_class(loss=loss, logits=None, **{k: v for k, v in outputs.items() if k != "last_hidden_state"})


def _config_of(model):
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) != MODEL_TYPE:
        raise ValueError(
            f"Expected a difftransformer model (config.model_type={MODEL_TYPE!r}), got {type(model).__name__}."
        )
    return config


def lambda_modules_to_save(config) -> list[str]:
    """``modules_to_save`` entries that train λ with PEFT's own mechanism: ``["lambda_proj"]`` for V2.

    V1 has no λ *module* (λ is four vectors on the attention module): the list is empty; use
    :func:`enable_lambda_training` instead.
    """
    return ["lambda_proj"] if config.diff_version == 2 else []


def enable_lambda_training(peft_model) -> list[str]:
    """Mark V1's λ trainable in a PEFT-wrapped (or plain) model; returns the names of the parameters switched on.

    V1: the four λ vectors of every layer (float32, ``head_dim`` each: a few hundred parameters per model). V2:
    rejected with a pointer to ``modules_to_save=["lambda_proj"]``, PEFT's native route (it also keeps the base
    ``lambda_proj`` untouched, so ``disable_adapter()`` still gives the base model).

    V1 λ are trained *in place* in the base model (PEFT has no copy-on-train mechanism for bare parameters):
    ``disable_adapter()`` disables the LoRA update but not a λ change. For a ``PeftModel``, this instance's
    ``save_pretrained`` becomes PEFT's own followed by the λ written into each saved active adapter's weights file,
    so that ``save_pretrained``, ``push_to_hub``, ``trainer.save_model()`` and Trainer checkpoints all keep them and
    ``PeftModel.from_pretrained`` / ``resume_from_checkpoint`` restore them (module docstring). Calling it again
    changes nothing more. A plain model saves its λ with its other weights.
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
        current = vars(peft_model).get("save_pretrained")
        if isinstance(current, _SavePretrainedWithLambdas) and current.model is peft_model:
            current.names = tuple(dict.fromkeys((*current.names, *names)))
        else:
            peft_model.save_pretrained = _SavePretrainedWithLambdas(peft_model, names)
    return names


class _SavePretrainedWithLambdas:
    """The ``save_pretrained`` that :func:`enable_lambda_training` gives one PeftModel: PEFT's own
    (``type(model).save_pretrained``, every argument passed on), then the V1 λ named in ``names`` added to the weights
    file of each saved adapter that is active. A callable object rather than a bound method, so that the model still
    deep-copies (the copy's points at the copy) and pickles."""

    def __init__(self, model, names):
        self.model = model
        self.names = tuple(names)

    def __call__(self, save_directory, *args, **kwargs):
        model = self.model
        save = type(model).save_pretrained
        save(model, save_directory, *args, **kwargs)
        bound = inspect.signature(save).bind(model, save_directory, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        if not arguments.get("is_main_process", True):  # distributed: only the main process writes (as PEFT does)
            return
        extra = arguments.get("kwargs", {})
        selected = arguments.get("selected_adapters") or list(model.peft_config)
        active = list(getattr(model, "active_adapters", None) or [model.active_adapter])
        adapters = [name for name in selected if name in active]
        if not adapters:
            logger.warning(
                f"The trained V1 λ ({len(self.names)} vectors) were not saved: they are stored with the active "
                f"adapter {active}, which is not among selected_adapters={list(selected)}."
            )
            return
        lambdas = _lambda_tensors(model, self.names, extra.get("state_dict"))
        safe = arguments.get("safe_serialization", True)
        for adapter in adapters:
            folder = Path(save_directory) if adapter == "default" else Path(save_directory) / adapter
            _write_into_adapter_file(folder, lambdas, safe)


def _lambda_tensors(model, names, state_dict=None) -> dict:
    """CPU copies of the named λ: from ``state_dict`` where it holds them (the gathered state dict a Trainer passes
    under DeepSpeed or FSDP), else from the parameters."""
    params = dict(model.named_parameters())
    lambdas = {}
    for name in names:
        tensor = state_dict[name] if state_dict is not None and name in state_dict else params.get(name)
        if tensor is None:
            continue
        if tensor.numel() == 0:
            raise ValueError(
                f"{name} has no local elements (sharded, e.g. by DeepSpeed ZeRO-3): pass the gathered "
                "state_dict=... to save_pretrained, as transformers' Trainer does."
            )
        lambdas[name] = tensor.detach().to("cpu").contiguous()
    return lambdas


def _write_into_adapter_file(folder: str | os.PathLike, tensors: dict, safe_serialization: bool = True) -> Path:
    """Add ``tensors`` to the adapter weights file PEFT wrote in ``folder`` (``adapter_model.safetensors``, or
    ``adapter_model.bin`` when saved with ``safe_serialization=False``); returns the file."""
    path = Path(folder) / ("adapter_model.safetensors" if safe_serialization else "adapter_model.bin")
    if not path.is_file():
        raise ValueError(f"{path} not found: the V1 λ are stored inside the adapter weights file PEFT writes there.")
    if safe_serialization:
        from safetensors.torch import load_file, save_file

        contents = load_file(path)
        contents.update(tensors)
        save_file(contents, path, metadata={"format": "pt"})
    else:
        import torch

        contents = torch.load(path, map_location="cpu", weights_only=True)
        contents.update(tensors)
        torch.save(contents, path)
    return path


def trainable_lambdas(peft_model) -> dict:
    """The trainable V1 λ tensors (CPU copies) under the PeftModel's own parameter names (``base_model.model.model.
    layers.{l}.self_attn.lambda_q1``, ...): the keys PEFT's loader passes unchanged to ``load_state_dict``."""
    return {
        name: param.detach().to("cpu").contiguous()
        for name, param in peft_model.named_parameters()
        if param.requires_grad and _V1_LAMBDA_RE.search(name)
    }


def add_lambdas_to_adapter(peft_model, folder: str | os.PathLike) -> Path | None:
    """Add the trainable V1 λ (:func:`trainable_lambdas`) to ``folder``'s ``adapter_model.safetensors`` (the folder
    of the active adapter as PEFT saved it). Returns the file, or None when no λ trains. After
    :func:`enable_lambda_training` the PeftModel's ``save_pretrained`` has already done this."""
    lambdas = trainable_lambdas(peft_model)
    if not lambdas:
        return None
    return _write_into_adapter_file(folder, lambdas)


def save_adapter(peft_model, save_directory: str | os.PathLike, **kwargs) -> Path:
    """``peft_model.save_pretrained(save_directory, **kwargs)``, plus the trainable V1 λ inside the adapter file, so
    that ``PeftModel.from_pretrained(base, folder)`` restores them with no extra step. Returns the folder of the
    active adapter's file (``save_directory``, or its subfolder named after a non-default adapter). After
    :func:`enable_lambda_training`, ``peft_model.save_pretrained`` alone does the same; this also covers λ made
    trainable another way."""
    _config_of(peft_model)
    peft_model.save_pretrained(save_directory, **kwargs)
    adapter_name = getattr(peft_model, "active_adapter", "default")
    folder = Path(save_directory) if adapter_name == "default" else Path(save_directory) / adapter_name
    if kwargs.get("is_main_process", True):  # distributed: only the main process writes (as PEFT does)
        lambdas = trainable_lambdas(peft_model)
        if lambdas:
            _write_into_adapter_file(folder, lambdas, kwargs.get("safe_serialization", True))
    return folder


class LambdaCheckpointCallback(TrainerCallback):
    """Adds V1's trainable λ to each checkpoint a Trainer writes of a PeftModel.

    Not needed after :func:`enable_lambda_training`, whose PeftModel already writes them into every checkpoint
    (the Trainer saves through ``save_pretrained``); it still works, rewriting the same values, and covers λ made
    trainable another way. ``on_save`` runs after the Trainer has written ``OUTPUT_DIR/checkpoint-STEP`` and adds the
    λ to its ``adapter_model.safetensors``. Only the main process writes. Checkpoints of a hyperparameter search
    (``run-N`` subfolders) are not handled.
    """

    def on_save(self, args, state, control, model=None, **kwargs):
        if model is None or not state.is_world_process_zero or not _is_peft_model(model):
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        adapter_name = getattr(model, "active_adapter", "default")
        add_lambdas_to_adapter(model, folder if adapter_name == "default" else folder / adapter_name)


def _is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


__all__ = [
    "LambdaCheckpointCallback",
    "V1_LAMBDA_NAMES",
    "add_lambdas_to_adapter",
    "apply_liger_kernel_to_difftransformer",
    "enable_lambda_training",
    "lambda_modules_to_save",
    "register_liger",
    "register_peft",
    "save_adapter",
    "trainable_lambdas",
]
