"""Training: loss through transformers' loss function, gradients everywhere, checkpointing, bf16."""

import pytest
import torch

from difftransformer import DiffTransformerForCausalLM
from difftransformer.testing_utils import left_padded_batch, tiny_config


def _model(layout, attn="sdpa", seed=0):
    torch.manual_seed(seed)
    model = DiffTransformerForCausalLM(tiny_config(layout))
    model.set_attn_implementation(attn)
    return model.train()


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_loss_is_shifted_cross_entropy_and_honours_num_items_in_batch(layout):
    model = _model(layout)
    ids, mask = left_padded_batch(model.config.vocab_size, [9, 6], seed=0)
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, model.config.vocab_size)
    target = labels[:, 1:].reshape(-1)
    expected = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    # With num_items_in_batch (gradient accumulation in Trainer) the loss is a sum divided by that count.
    n = int((target != -100).sum()) * 3
    out = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(n))
    summed = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(out.loss, summed / n)


@pytest.mark.parametrize("layout", ["v1_gqa", "v1_mha", "v2_gqa"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_every_parameter_gets_a_gradient_and_checkpointing_gives_the_same_ones(layout, attn):
    model = _model(layout, attn)
    ids = torch.randint(3, model.config.vocab_size, (2, 10))
    model(ids, labels=ids).loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    missing = [name for name, g in grads.items() if g is None or g.abs().sum() == 0]
    assert not missing, f"parameters without gradient: {missing}"
    assert any("lambda_q1" in n for n in grads) or any("lambda_proj" in n for n in grads)

    model.zero_grad()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing
    model(ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_bfloat16_forward_backward_and_a_few_steps_reduce_loss(layout):
    model = _model(layout).to(torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        out = model(ids, labels=ids)
        loss = out.loss
        # The loss is computed in float32 from the bf16 logits (transformers' causal-LM loss upcasts them): equal to the
        # float64 cross-entropy of those logits to float32 rounding (a bf16 loss would be off by about 2^-8).
        exact = torch.nn.functional.cross_entropy(out.logits[:, :-1].double().flatten(0, 1), ids[:, 1:].flatten())
        assert loss.dtype == torch.float32 and loss.item() == pytest.approx(exact.item(), rel=1e-5)
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in model.parameters())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
