"""TRL's trainers on DiffTransformer V1 and V2 (docs/ecosystem.md, "Tools"): SFTTrainer with its default loss (which
computes the logits itself from the base model and the output embeddings, bypassing the model's forward: it must
equal the model's own loss), SFTTrainer with padding-free packing (sequences concatenated into one row, their
boundaries given by position ids that restart at 0: the loss must equal that of the same examples padded, i.e. no
token attends across a boundary), and DPOTrainer. vLLM weight sync for GRPOTrainer:
tests_serving/test_vllm_weight_sync.py."""

import copy
import math

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install trl)")
from datasets import Dataset  # noqa: E402  (a TRL dependency)
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM  # noqa: E402
from difftransformer.research.data import get_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nprint(os.getcwd())\n",
    "class Stack:\n    pass\n",
    "x = [i * i for i in range(10)]\n",
    "while True:\n    break\n",
    "from math import pi\nr = 2 * pi\n",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return get_tokenizer(vocab_size=512, cache_dir=tmp_path_factory.mktemp("tokenizer-cache"))


def tiny(version, tokenizer, seed=0):
    config = DiffTransformerConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        diff_version=version,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return DiffTransformerForCausalLM(config)


def sft_args(tmp_path, **kwargs):
    return SFTConfig(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=6,
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        **kwargs,
    )


@pytest.mark.parametrize("version", [1, 2])
def test_sft_default_loss_is_the_models_loss_and_trains(tmp_path, tokenizer, version):
    model = tiny(version, tokenizer)
    trainer = SFTTrainer(
        model=model,
        args=sft_args(tmp_path, max_length=64),
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"text": TEXTS}),
    )
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert (batch["labels"] == -100).any()  # padded: the padding is ignored by both losses
    with torch.no_grad():
        trl_loss = trainer.compute_loss(model, dict(batch))
        own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    torch.testing.assert_close(trl_loss, own, rtol=1e-5, atol=1e-6)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 4 and losses[-1] < losses[0], losses


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_sequences_attend_within_their_boundaries(tokenizer, version, attn_implementation):
    """Sequences concatenated in one row with restarting position ids (no attention mask, no cache: what padding-free
    training passes) give each sequence the logits it has alone: transformers' mask builder turns the restarts into
    a block-diagonal causal mask, which every backend of the model (V1's own SDPA kernel included) honours."""
    model = tiny(version, tokenizer).eval()
    model.set_attn_implementation(attn_implementation)
    parts = [torch.randint(4, len(tokenizer), (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 3)]
    positions = torch.cat([torch.arange(p.shape[1]) for p in parts])[None]
    with torch.no_grad():
        alone = torch.cat([model(p, use_cache=False).logits for p in parts], dim=1)
        packed = model(torch.cat(parts, dim=1), position_ids=positions, use_cache=False).logits
        unbounded = model(torch.cat(parts, dim=1), use_cache=False).logits
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (unbounded - alone).abs().max() > 1e-3  # without the boundaries the later sequences see the earlier ones
    # The config's use_cache=True would build a cache, and transformers' masks honour packing only without one: the
    # model builds none for packed inputs (the same logits, no cache returned) and refuses an explicit cache.
    from transformers import DynamicCache

    from difftransformer.compat_difftransformer import CACHE_NAME

    with torch.no_grad():
        default = model(torch.cat(parts, dim=1), position_ids=positions)
        torch.testing.assert_close(default.logits, alone, rtol=1e-5, atol=1e-5)
        assert getattr(default, CACHE_NAME) is None
        with pytest.raises(ValueError, match="packed sequences"):
            model(torch.cat(parts, dim=1), position_ids=positions, **{CACHE_NAME: DynamicCache(config=model.config)})


@pytest.mark.parametrize("version", [1, 2])
def test_sft_padding_free_packing_equals_the_padded_batch(tmp_path, tokenizer, version):
    """SFTTrainer with packing (best-fit decreasing, padding-free): one row, position ids restarting per example.
    Its loss on the examples equals the default collator's loss on the same examples padded."""
    model = tiny(version, tokenizer)
    data = Dataset.from_dict({"text": TEXTS})
    packed = SFTTrainer(
        model=model,
        processing_class=tokenizer,
        train_dataset=data,
        args=sft_args(tmp_path / "packed", packing=True, max_length=256),
    )
    padded = SFTTrainer(
        model=model, processing_class=tokenizer, train_dataset=data, args=sft_args(tmp_path / "padded", max_length=256)
    )
    assert packed.padding_free
    packed_batch = packed._prepare_inputs(
        packed.data_collator([packed.train_dataset[i] for i in range(len(packed.train_dataset))])
    )
    padded_batch = padded._prepare_inputs(padded.data_collator([padded.train_dataset[i] for i in range(len(TEXTS))]))
    assert packed_batch["input_ids"].shape[0] == 1 and "attention_mask" not in packed_batch
    restarts = (packed_batch["position_ids"][0] == 0).sum().item()
    assert restarts == len(TEXTS)  # every example starts at position 0 inside the one row
    assert packed_batch["input_ids"].numel() == padded_batch["attention_mask"].sum()  # the same tokens, no padding
    with torch.no_grad():
        loss_packed = packed.compute_loss(model, dict(packed_batch))
        loss_padded = padded.compute_loss(model, dict(padded_batch))
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-6)
    packed.train()
    assert all(math.isfinite(e["loss"]) for e in packed.state.log_history if "loss" in e)


@pytest.mark.parametrize("version", [1, 2])
def test_dpo_trains(tmp_path, tokenizer, version):
    """DPOTrainer with a frozen copy as reference: at the first step policy = reference, so the sigmoid loss is
    exactly log 2 (rewards 0); after a few steps the policy prefers the chosen answers more than the reference."""
    model = tiny(version, tokenizer)
    prompts = ["def f(x):\n", "import ", "class A:\n", "for i in "]
    data = Dataset.from_dict(
        {
            "prompt": prompts,
            "chosen": ["    return x\n", "os\n", "    pass\n", "range(3):\n"],
            "rejected": ["))((\n", "+++\n", "]]]\n", "::::\n"],
        }
    )
    args = DPOConfig(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        report_to="none",
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        max_length=64,
        beta=0.1,
    )
    trainer = DPOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=args, processing_class=tokenizer, train_dataset=data
    )
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert logs[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert logs[-1]["loss"] < logs[0]["loss"]
    margin = next(k for k in logs[-1] if k.endswith("rewards/margins"))
    assert logs[-1][margin] > 0
