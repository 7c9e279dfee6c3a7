"""transformers Trainer with DiffTransformer: defaults, evaluation, checkpoint resume, gradient checkpointing, bf16,
label smoothing (shifted labels) and num_items_in_batch (gradient accumulation with uneven label counts)."""

import copy
import math

import pytest
import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments
from transformers.trainer_pt_utils import LabelSmoother

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from difftransformer.research.data import get_tokenizer, lm_datasets
from difftransformer.testing_utils import (
    ROUNDING_DRAWS,
    ROUNDING_FACTOR,
    RoundingModel,
    bf16_error_bound,
    reference_forward,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return get_tokenizer(vocab_size=512, cache_dir=tmp_path_factory.mktemp("tokenizer-cache"))


@pytest.fixture(scope="module")
def datasets(tokenizer):
    return lm_datasets(
        tokenizer, 32, train_max_chars=40_000, validation_max_chars=20_000, max_train_blocks=64, max_validation_blocks=8
    )


def make_model(tokenizer, version=1, seed=0):
    config = DiffTransformerConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        diff_version=version,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return DiffTransformerForCausalLM(config)


def args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=3e-3,
        max_steps=4,
        report_to="none",
        use_cpu=True,
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        dataloader_pin_memory=False,
        save_strategy="no",
    )
    return TrainingArguments(**{**base, **overrides})


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_params(a, b, **tol):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=name, **tol)


@pytest.mark.parametrize("version", [1, 2])
def test_default_training_arguments_train_and_evaluate(tokenizer, datasets, tmp_path, version):
    # docs/ecosystem.md, "Trainer"
    train, valid = datasets
    model = make_model(tokenizer, version)
    before = params(model)
    # Defaults except logging every step (the default, every 500 steps, would log no loss within 3 steps).
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=str(tmp_path), max_steps=3, report_to="none", use_cpu=True, disable_tqdm=True, logging_steps=1
        ),
        train_dataset=train,
        eval_dataset=valid,
    )
    result = trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses), losses
    # The reported training loss is the mean of the logged step losses.
    assert result.training_loss == pytest.approx(sum(losses) / 3, rel=1e-6)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    # λ trains too (V1: the four λ vectors; V2: lambda_proj)
    lam = "lambda_q1" if version == 1 else "lambda_proj.weight"
    assert not torch.equal(
        before[f"model.layers.0.self_attn.{lam}"], dict(model.named_parameters())[f"model.layers.0.self_attn.{lam}"]
    )

    metrics = trainer.evaluate()
    model.eval()
    with torch.no_grad():
        manual = torch.stack([model(input_ids=b, labels=b).loss for b in valid.blocks.split(8)]).mean()
    assert metrics["eval_loss"] == pytest.approx(manual.item(), rel=1e-5)


def test_checkpoint_resume_reproduces_uninterrupted_training(tokenizer, datasets, tmp_path):
    train, valid = datasets
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2)
    full = make_model(tokenizer)
    Trainer(model=full, args=args(tmp_path / "full", **common), train_dataset=train, eval_dataset=valid).train()
    checkpoint = tmp_path / "full" / "checkpoint-2"  # as if the run had been killed after step 2
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "optimizer.pt").is_file()

    resumed = make_model(tokenizer, seed=123)  # weights come from the checkpoint, not from the seed
    trainer = Trainer(model=resumed, args=args(tmp_path / "resumed", **common), train_dataset=train, eval_dataset=valid)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 4
    assert_same_params(params(resumed), params(full), rtol=1e-5, atol=1e-6)
    assert [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e][-1] == pytest.approx(
        Trainer(model=full, args=args(tmp_path / "e"), eval_dataset=valid).evaluate()["eval_loss"], rel=1e-5
    )


def test_gradient_checkpointing_gives_the_same_training(tokenizer, datasets, tmp_path):
    train, _ = datasets
    plain = make_model(tokenizer)
    Trainer(model=plain, args=args(tmp_path / "a", max_steps=2), train_dataset=train).train()
    checkpointed = make_model(tokenizer)
    seen = []
    layer = checkpointed.model.layers[0]
    layer.register_forward_pre_hook(lambda m, a: seen.append(m.gradient_checkpointing and torch.is_grad_enabled()))
    trainer = Trainer(
        model=checkpointed, args=args(tmp_path / "b", max_steps=2, gradient_checkpointing=True), train_dataset=train
    )
    trainer.train()
    assert checkpointed.is_gradient_checkpointing and any(seen)
    assert_same_params(params(checkpointed), params(plain), rtol=1e-5, atol=1e-6)


def _bf16_bound(model, ids):
    """(float64 loss, bound): transformers' loss of ``model`` on ``ids`` from the float64 reference, and the bf16 bound
    on it from the rounding model (difftransformer.testing_utils.RoundingModel: every intermediate and weight that a
    bf16 kernel may round, rounded by a relative error of at most 2^-8; the bound is ROUNDING_FACTOR x the largest error
    of ROUNDING_DRAWS draws). It holds whichever CPU runs the bf16 matmuls: AMX, AVX512-BF16 or torch's emulation."""
    exact = reference_forward(model, ids, labels=ids)[2]
    draws = [reference_forward(model, ids, labels=ids, rnd=RoundingModel(seed))[2] for seed in range(ROUNDING_DRAWS)]
    return exact.item(), bf16_error_bound(draws, exact, ROUNDING_FACTOR)


def test_bf16_mixed_precision_training(tokenizer, datasets, tmp_path):
    """bf16=True on the CPU: autocast runs the projections in bfloat16 and the weights stay float32. Runs on every x86
    CPU (without AVX512-BF16/AMX, torch emulates bf16 matmuls: slower, the same rounding). The first step's loss and
    the evaluation loss lie within the rounding model's bf16 bound of their float64 values; float32 evaluation of the
    same weights lies within float32 rounding of it."""
    train, valid = datasets
    model = make_model(tokenizer)
    initial = copy.deepcopy(model)
    dtypes, first = [], []
    model.lm_head.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))

    def record_first_step(module, positional, kwargs, output):
        if not first:
            first.append((kwargs["input_ids"].clone(), output.loss.detach()))

    model.register_forward_hook(record_first_step, with_kwargs=True)
    trainer = Trainer(model=model, args=args(tmp_path, max_steps=3, bf16=True), train_dataset=train, eval_dataset=valid)
    trainer.train()
    assert dtypes and set(dtypes) == {torch.bfloat16}  # autocast was active in every forward pass
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay float32
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    ids, loss = first[0]
    exact, bound = _bf16_bound(initial, ids)
    assert abs(loss.item() - exact) <= bound, (loss.item(), exact, bound)
    # Evaluation of the trained weights, bf16 (autocast) and float32, against the float64 loss of the same weights on
    # the whole validation set (equal batches of equal blocks: the Trainer's mean of batch means is the token mean).
    exact, bound = _bf16_bound(model, valid.blocks)
    bf16_eval = trainer.evaluate()["eval_loss"]
    assert abs(bf16_eval - exact) <= bound, (bf16_eval, exact, bound)
    fp32_eval = Trainer(model=model, args=args(tmp_path / "eval"), eval_dataset=valid).evaluate()["eval_loss"]
    assert fp32_eval == pytest.approx(exact, rel=1e-5)  # float32: about 100 ulps (2^-24) of a 2-layer model's loss


def test_label_smoothing_scores_next_tokens(tokenizer, datasets, tmp_path):
    """With label_smoothing_factor, Trainer computes the loss itself and shifts labels only for class names in its
    causal-LM table; `import difftransformer` adds ours (the modeling file registers it, so remote code gets it too)."""
    train, _ = datasets
    model = make_model(tokenizer).eval()
    eps = 0.1
    trainer = Trainer(model=model, args=args(tmp_path, label_smoothing_factor=eps), train_dataset=train)
    batch = {"input_ids": train.blocks[:4], "labels": train.blocks[:4].clone()}
    with torch.no_grad():
        loss = trainer.compute_loss(model, dict(batch))
        logits = model(input_ids=batch["input_ids"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    targets = batch["labels"][:, 1:]
    expected = (1 - eps) * -logp.gather(-1, targets[..., None]).mean() + eps * -logp.mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    unshifted = LabelSmoother(epsilon=eps)({"logits": logits}, batch["labels"], shift_labels=False)
    assert abs(loss.item() - unshifted.item()) > 1e-3  # the check above would catch the unshifted bug


class _Uneven(Dataset):
    """Four sequences whose numbers of scored labels differ a lot (as with padding or prompt masking)."""

    def __init__(self, blocks):
        self.items = []
        for i, row in enumerate(blocks[:4]):
            labels = row.clone()
            labels[: [28, 0, 20, 4][i]] = -100
            self.items.append({"input_ids": row, "labels": labels})

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.items[i]


def test_num_items_in_batch_makes_gradient_accumulation_exact(tokenizer, datasets, tmp_path):
    """One step over 4 sequences: batch 4, or 2 micro-batches of 2 accumulated. The Trainer passes the token count of
    the whole step (num_items_in_batch) to the model's loss, so both give the same update even though the
    micro-batches score very different numbers of tokens."""
    data = _Uneven(datasets[0].blocks)
    common = dict(
        max_steps=1,
        optim="sgd",
        learning_rate=1.0,
        max_grad_norm=0.0,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        train_sampling_strategy="sequential",
    )
    whole = make_model(tokenizer)
    Trainer(model=whole, args=args(tmp_path / "a", per_device_train_batch_size=4, **common), train_dataset=data).train()
    accumulated = make_model(tokenizer)
    trainer = Trainer(
        model=accumulated,
        args=args(tmp_path / "b", per_device_train_batch_size=2, gradient_accumulation_steps=2, **common),
        train_dataset=data,
    )
    assert trainer.model_accepts_loss_kwargs
    trainer.train()
    assert_same_params(params(accumulated), params(whole), rtol=1e-4, atol=1e-6)

    # The test has teeth: averaging the two micro-batch means (no num_items_in_batch) gives another gradient.
    model = make_model(tokenizer)
    grads = []
    for chunk in ([0, 1], [2, 3], [0, 1, 2, 3]):
        model.zero_grad()
        batch = {k: torch.stack([data[i][k] for i in chunk]) for k in ("input_ids", "labels")}
        model(**batch).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    naive, exact = (grads[0] + grads[1]) / 2, grads[2]
    assert (naive - exact).norm() > 0.05 * exact.norm()


def _lora_v1(tokenizer):
    """A LoRA PeftModel of the seed-0 V1 model with its λ switched on (enable_lambda_training)."""
    peft = pytest.importorskip("peft", reason="PEFT is not installed (pip install peft, or the [train] extra)")
    from difftransformer.integrations import enable_lambda_training

    model = peft.get_peft_model(make_model(tokenizer), peft.LoraConfig(target_modules=["q_proj", "v_proj"]))
    assert enable_lambda_training(model)
    return model


def test_v1_lambdas_survive_trainer_save_model_checkpoints_and_resume(tokenizer, datasets, tmp_path):
    """LoRA + V1 λ saved the ordinary Trainer ways, with no callback: trainer.save_model's folder and the last
    checkpoint load (PeftModel.from_pretrained into a fresh base model) with the trained λ and logits;
    resume_from_checkpoint from the middle checkpoint continues with that checkpoint's λ and ends where the
    uninterrupted run ended; merge_and_unload's model holds the trained λ."""
    from peft import PeftModel

    train, _ = datasets
    common = dict(max_steps=4, save_strategy="steps", save_steps=2)
    model = _lora_v1(tokenizer)
    initial = model.get_base_model().layer_lambdas()
    trainer = Trainer(model=model, args=args(tmp_path / "run", **common), train_dataset=train)
    trainer.train()
    trained = model.get_base_model().layer_lambdas()
    assert not torch.allclose(trained, initial, rtol=0, atol=1e-4)  # λ trained: the checks below can fail
    ids = train.blocks[:2]
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
    trainer.save_model(str(tmp_path / "final"))
    for folder in (tmp_path / "final", tmp_path / "run" / "checkpoint-4"):
        loaded = PeftModel.from_pretrained(make_model(tokenizer), folder).eval()
        assert torch.equal(loaded.get_base_model().layer_lambdas(), trained), folder.name  # float32, stored as is
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, expected, msg=folder.name)

    resumed = _lora_v1(tokenizer)  # the same base weights; LoRA and λ come from the checkpoint
    Trainer(model=resumed, args=args(tmp_path / "resumed", **common), train_dataset=train).train(
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2")
    )
    assert_same_params(params(resumed), params(model), rtol=1e-5, atol=1e-6)

    merged = model.merge_and_unload()
    assert type(merged) is DiffTransformerForCausalLM and torch.equal(merged.layer_lambdas(), trained)


def _docs_example(heading):
    """The first Python block of docs/ecosystem.md's section ``## heading``, as written."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "ecosystem.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("\n```", 1)[0]


def run_docs_example(heading, folder_model, tokenizer, cwd, allowed=()):
    """Run the docs example of ``heading`` in ``cwd``, where ``runs/difftransformer-stdlib/model`` holds
    ``folder_model`` and ``tokenizer`` (what the training example writes there), recording every warning; fails on
    any DeprecationWarning or FutureWarning whose message does not start with one of ``allowed``. The docs follow
    transformers 5.23's names (the rename of gradient checkpointing), so on earlier releases the example runs and
    its warnings are not checked: what an older release deprecates is no sign of a stale example."""
    import os
    import warnings

    import transformers
    from packaging import version

    folder = cwd / "runs" / "difftransformer-stdlib" / "model"
    folder_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    code = compile(_docs_example(heading), f"docs/ecosystem.md[{heading}]", "exec")
    before = os.getcwd()
    os.chdir(cwd)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(code, {"__name__": "__main__"})
    finally:
        os.chdir(before)
    if version.parse(transformers.__version__) < version.parse("5.23"):
        return
    deprecated = [
        f"{w.category.__name__} at {w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if issubclass(w.category, (DeprecationWarning, FutureWarning)) and not str(w.message).startswith(tuple(allowed))
    ]
    assert not deprecated, "\n".join(deprecated)


def test_docs_trainer_example_runs_without_deprecation_warnings(tokenizer, tmp_path):
    """docs/ecosystem.md's Trainer example on the current TrainingArguments names (activation_checkpointing, not the
    deprecated gradient_checkpointing), run as written on a small model."""
    if "activation_checkpointing" not in TrainingArguments.__dataclass_fields__:
        pytest.skip("transformers before 5.23 has no TrainingArguments(activation_checkpointing=...), the docs' name")
    run_docs_example("Trainer", make_model(tokenizer), tokenizer, tmp_path)
    assert (tmp_path / "runs" / "finetune" / "final" / "model.safetensors").is_file()


def test_docs_peft_example_runs_and_keeps_the_lambdas(tokenizer, tmp_path):
    """docs/ecosystem.md's PEFT example, run as written on a small V1 model: no deprecation warning but the one the
    docs name (PEFT itself reads transformers' deprecated is_gradient_checkpointing in get_peft_model), and the
    adapter folder trainer.save_model wrote holds the trained λ."""
    pytest.importorskip("peft", reason="PEFT is not installed (pip install peft, or the [train] extra)")
    from safetensors.torch import load_file

    model = make_model(tokenizer)
    run_docs_example("PEFT LoRA", model, tokenizer, tmp_path, allowed=["`is_gradient_checkpointing` is deprecated"])
    saved = load_file(tmp_path / "runs" / "lora" / "adapter" / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.lambda_q1"
    assert not torch.equal(saved[key], model.model.layers[0].self_attn.lambda_q1.detach())  # trained, then saved
    assert (tmp_path / "runs" / "lora" / "merged" / "model.safetensors").is_file()
