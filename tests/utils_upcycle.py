"""Shared helpers of the upcycling tests (test_upcycle.py, test_real_model.py, test_telemetry.py): a distillation
Trainer on a few blocks, the KL against the teacher, and the real model's chat prompt and answer."""

import torch
from transformers import TrainingArguments

from difftransformer.research import upcycle as up
from difftransformer.research.data import LMBlockDataset

# The chat prompt of the real-model tests and SmolLM2-135M-Instruct's greedy answer to it.
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SMOLLM2_ANSWER = "The capital of France is Paris."
IDS = torch.tensor([[5, 17, 3, 44, 9, 60, 2, 31, 12, 7, 50, 23]])


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def distillation_trainer(model, teacher, blocks, tmp_path, **kwargs):
    """A :class:`~difftransformer.research.upcycle.DistillationTrainer` over ``blocks``: 4 steps of batch 2, lr 3e-3, a
    log every step, no checkpoints (``args=dict(...)`` overrides TrainingArguments, other kwargs go to the trainer)."""
    args = dict(
        output_dir=str(tmp_path / "t"),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    args.update(kwargs.pop("args", {}))
    return up.DistillationTrainer(
        model=model, args=TrainingArguments(**args), train_dataset=LMBlockDataset(blocks), teacher=teacher, **kwargs
    )


def kd_loss_on(model, teacher, batch):
    """The distillation loss KL(teacher ‖ model) on ``batch``, without gradients."""
    with torch.no_grad():
        return up.distillation_loss(model(input_ids=batch).logits, teacher(input_ids=batch).logits).item()
