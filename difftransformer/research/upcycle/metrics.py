"""What the upcycling job measures on teacher and student: held-out perplexity, λ, greedy chat answers."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch


def unwrap(model):
    """The transformers model under a PEFT wrapper (LoRA layers and modules_to_save stay active inside it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextlib.contextmanager
def eval_mode(model) -> Iterator[torch.device]:
    """Run the block in eval mode (yields the model's device); the previous mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield next(model.parameters()).device
    finally:
        model.train(was_training)


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch_size: int = 4, on_batch: Callable[[], object] | None = None) -> float:
    """``exp`` of the mean next-token cross-entropy over every predicted token of ``blocks`` (``length − 1`` per
    row; all rows have the same length, so the mean of the row means is the token mean). ``on_batch`` is called
    after each of the ``ceil(len(blocks) / batch_size)`` forwards (a progress bar's ``update``)."""
    total, rows = 0.0, 0
    with eval_mode(model) as device:
        for chunk in blocks.split(batch_size):
            chunk = chunk.to(device)
            total += model(input_ids=chunk, labels=chunk, use_cache=False).loss.item() * chunk.shape[0]
            rows += chunk.shape[0]
            if on_batch is not None:
                on_batch()
    return math.exp(total / rows)


@torch.no_grad()
def lambda_statistics(
    model, blocks: torch.Tensor | None = None, batch_size: int = 4, on_batch: Callable[[], object] | None = None
) -> dict:
    """λ of a difftransformer model (plain or PEFT-wrapped).

    V1: ``{"per_layer": [λ_l]}`` (``exp(λq1·λk1) − exp(λq2·λk2) + λinit``, one scalar per layer). V2: λ is
    ``sigmoid(x W_λ)`` per token and head; ``{"mean": [...], "std": [...]}`` per layer over every (token, head) of
    ``blocks`` (held-out text, required), plus ``"head_mean_spread"``: per layer, the std over heads of each head's
    mean λ (0 while all heads are equal, as right after the exact conversion). ``on_batch`` is called after each V2
    forward (V1 runs none).
    """
    base = unwrap(model)
    if base.config.diff_version == 1:
        return {"diff_version": 1, "per_layer": [float(x) for x in base.layer_lambdas()]}
    if blocks is None:
        raise ValueError("V2 λ depends on the input: pass held-out `blocks` to average over.")
    sums = sq = heads_sum = None
    count = 0
    with eval_mode(base) as device:
        for chunk in blocks.split(batch_size):
            lams = base(input_ids=chunk.to(device), output_lambdas=True, use_cache=False, logits_to_keep=1).lambdas
            lam = torch.stack([x.double() for x in lams])  # (L, B, T, H)
            s, q, h = lam.sum((1, 2, 3)), (lam**2).sum((1, 2, 3)), lam.sum((1, 2))
            sums, sq, heads_sum = (s, q, h) if sums is None else (sums + s, sq + q, heads_sum + h)
            count += lam[0].numel()
            if on_batch is not None:
                on_batch()
    mean = sums / count
    std = (sq / count - mean**2).clamp(min=0).sqrt()
    head_means = heads_sum / (count / heads_sum.shape[1])
    return {
        "diff_version": 2,
        "mean": mean.tolist(),
        "std": std.tolist(),
        "head_mean_spread": head_means.std(1).tolist(),
        "tokens": count // heads_sum.shape[1],
    }


@torch.no_grad()
def chat(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 48, on_answer: Callable[[], object] | None = None
) -> list[dict]:
    """Greedy answers to single-turn chat prompts through the tokenizer's chat template; ``on_answer`` is called
    after each answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; chat samples need one.")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answers = []
    with eval_mode(model) as device:
        for prompt in prompts:
            enc = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            enc = {k: v.to(device) for k, v in enc.items()}
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
            new = out[0, enc["input_ids"].shape[1] :]
            answers.append(
                {
                    "prompt": prompt,
                    "answer": tokenizer.decode(new, skip_special_tokens=True).strip(),
                    "new_tokens": int(new.numel()),
                }
            )
            if on_answer is not None:
                on_answer()
    return answers
