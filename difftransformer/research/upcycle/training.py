"""Fine-tuning the student: what trains (:func:`prepare_student`) and the distillation ``Trainer``.

Loss (:class:`DistillationTrainer`): ``(1 − w)·LM + w·KD``, where LM is the student's next-token cross-entropy on the
corpus and KD is the token-mean ``KL(teacher ‖ student)`` of the next-token distributions at temperature ``T``, times
``T²`` (Hinton et al. 2015, so that gradients keep their scale across temperatures). Evaluation reports the plain LM
loss, so ``exp(eval_loss)`` is a perplexity."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from transformers import Trainer

METHODS = ("full", "lora")
# Peak AdamW learning rates of the recipe (docs/upcycling.md): LoRA's low-rank update needs a larger one.
DEFAULT_LEARNING_RATES = {"full": 1e-4, "lora": 1e-3}
# λ parameters: V1's lambda_q1/k1/q2/k2, V2's lambda_proj (PEFT copies included).
LAMBDA_PARAM = re.compile(r"(^|\.)lambda_(proj|[qk][12])(\.|$)")


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Token-mean ``KL(p_teacher ‖ p_student) · T²`` of the next-token distributions at temperature ``T``
    (``p = softmax(logits / T)``), computed in float32. Shapes ``(..., vocab)``; 0 when the logits agree up to a
    constant per token."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits differ in shape: {tuple(student_logits.shape)} vs "
            f"{tuple(teacher_logits.shape)}."
        )
    if temperature <= 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}.")
    vocab = student_logits.shape[-1]
    s = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, -1)
    t = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / temperature, -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


def _next_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


class DistillationTrainer(Trainer):
    """``Trainer`` whose training loss is ``(1 − distill_weight)·LM + distill_weight·KD`` (:func:`distillation_loss`
    against ``teacher``); evaluation reports the LM loss alone. Logs ``lm_loss``, ``distill_loss`` and the
    teacher's own ``teacher_lm_loss`` on the same batches, averaged over each logging interval.

    The returned loss is a mean per micro-batch (packed blocks: every micro-batch has the same token count), so
    ``Trainer`` divides it by the gradient-accumulation steps (``loss_is_scaled_for_ga = False``).
    ``lambda_lr_scale`` puts the λ parameters in their own optimizer groups at that multiple of the learning rate.
    """

    loss_is_scaled_for_ga = False

    def __init__(
        self,
        *args,
        teacher=None,
        distill_weight: float = 0.0,
        temperature: float = 1.0,
        lambda_lr_scale: float = 1.0,
        **kwargs,
    ):
        if lambda_lr_scale <= 0:
            raise ValueError(f"`lambda_lr_scale` must be > 0, got {lambda_lr_scale}.")
        if not 0.0 <= distill_weight <= 1.0:
            raise ValueError(f"`distill_weight` must be in [0, 1], got {distill_weight}.")
        if distill_weight > 0 and teacher is None:
            raise ValueError("`distill_weight` > 0 needs a `teacher` model.")
        if temperature <= 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature}.")
        super().__init__(*args, **kwargs)
        self.lambda_lr_scale = lambda_lr_scale
        self.teacher = teacher
        self.distill_weight = distill_weight
        self.temperature = temperature
        self._parts: dict[str, list[float]] = {}
        if teacher is not None:
            teacher.eval().requires_grad_(False)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels, mask = inputs["labels"], inputs.get("attention_mask")
        outputs = model(input_ids=inputs["input_ids"], attention_mask=mask, use_cache=False)
        lm = _next_token_ce(outputs.logits, labels)
        loss = lm
        if model.training:
            self._record("lm_loss", lm)
            if self.teacher is not None and self.distill_weight > 0:
                with torch.no_grad():
                    t_logits = self.teacher(input_ids=inputs["input_ids"], attention_mask=mask, use_cache=False).logits
                kd = distillation_loss(outputs.logits, t_logits.to(outputs.logits.device), self.temperature)
                loss = (1 - self.distill_weight) * lm + self.distill_weight * kd
                self._record("distill_loss", kd)
                self._record("teacher_lm_loss", _next_token_ce(t_logits, labels.to(t_logits.device)))
        outputs.loss = loss
        return (loss, outputs) if return_outputs else loss

    def create_optimizer(self, model=None):
        """``Trainer``'s optimizer, with the λ parameters (:data:`LAMBDA_PARAM`) moved into their own groups at
        ``lambda_lr_scale`` times the learning rate (the schedule scales every group alike)."""
        optimizer = super().create_optimizer(model)
        if self.lambda_lr_scale == 1.0:
            return optimizer
        names = {id(p): n for n, p in (self.model if model is None else model).named_parameters()}

        def is_lambda(p):
            return LAMBDA_PARAM.search(names.get(id(p), "")) is not None

        for group in list(optimizer.param_groups):
            lam = [p for p in group["params"] if is_lambda(p)]
            if lam:
                group["params"] = [p for p in group["params"] if not is_lambda(p)]
                optimizer.add_param_group(
                    {
                        **{k: v for k, v in group.items() if k != "params"},
                        "params": lam,
                        "lr": group["lr"] * self.lambda_lr_scale,
                    }
                )
        optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
        return optimizer

    def _record(self, name, value):
        self._parts.setdefault(name, []).append(float(value.detach()))

    def log(self, logs, start_time=None):
        if "loss" in logs and self._parts:
            for name, values in self._parts.items():
                logs[name] = round(sum(values) / len(values), 4)
            self._parts = {}
        super().log(logs, start_time)


def prepare_student(
    model,
    method: str,
    lora_r: int = 16,
    lora_alpha: int = 32,
    lora_targets: str = "all-linear",
    freeze_embeddings: bool = False,
):
    """Make the parameters that train trainable; returns the model to train (a ``PeftModel`` for LoRA).

    ``"full"``: every parameter (but the tied input/output embedding with ``freeze_embeddings``). ``"lora"``: LoRA
    on ``lora_targets`` (``"all-linear"``, or comma-separated module names), with λ trainable in a difftransformer
    model: V2's ``lambda_proj`` through ``modules_to_save``; V1's λ vectors through ``enable_lambda_training`` and its
    per-head norm ``subln`` through ``modules_to_save`` (the PeftModel's saves and the Trainer's checkpoints then keep
    V1's λ). Any other causal LM (the source Llama of the fair comparison) gets the same treatment without λ.
    """
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}, got {method!r}.")
    if method == "full":
        model.requires_grad_(True)
        if freeze_embeddings:
            model.get_input_embeddings().requires_grad_(False)
            model.get_output_embeddings().requires_grad_(False)
        return model
    from peft import LoraConfig, get_peft_model

    from ...integrations import MODEL_TYPE, enable_lambda_training, lambda_modules_to_save

    version = model.config.diff_version if model.config.model_type == MODEL_TYPE else None
    targets = (
        lora_targets if lora_targets == "all-linear" else [t.strip() for t in lora_targets.split(",") if t.strip()]
    )
    save = None if version is None else ["subln"] if version == 1 else lambda_modules_to_save(model.config)
    config = LoraConfig(
        r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=0.0,
        target_modules=targets,
        modules_to_save=save,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    if version == 1:
        enable_lambda_training(peft_model)
    return peft_model


def count_parameters(model) -> tuple[int, int]:
    """``(total, trainable)``."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
