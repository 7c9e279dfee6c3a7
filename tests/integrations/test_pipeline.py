"""pipeline("text-generation", model=folder), also with device_map="auto", for DIFF V1 and V2; the task heads
(sequence and token classification, question answering) on the differential backbone, and their pipeline."""

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from difftransformer import (
    DiffTransformerConfig,
    DiffTransformerForCausalLM,
    DiffTransformerForQuestionAnswering,
    DiffTransformerForSequenceClassification,
    DiffTransformerForTokenClassification,
    DiffTransformerModel,
)
from difftransformer.research.data import get_tokenizer
from difftransformer.testing_utils import left_padded_batch, randomize_norms, reference_forward, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return get_tokenizer(vocab_size=512, cache_dir=tmp_path_factory.mktemp("tokenizer-cache"))


@pytest.fixture(scope="module", params=[1, 2], ids=["v1", "v2"])
def folder(request, tokenizer, tmp_path_factory):
    """A saved model + tokenizer folder, as examples/train.py writes it (random weights: only the plumbing matters)."""
    config = DiffTransformerConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        diff_version=request.param,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = DiffTransformerForCausalLM(config).eval()
    path = tmp_path_factory.mktemp(f"pipeline-v{request.param}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _greedy_reference(path, prompt, new_tokens):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + new_tokens
    return tokenizer.decode(out[0], skip_special_tokens=True)


def test_pipeline_from_folder_generates_the_models_greedy_text(folder, caplog):
    # docs/ecosystem.md, "pipeline"
    generator = pipeline("text-generation", model=str(folder))
    with caplog.at_level(logging.ERROR, logger="transformers"):
        result = generator("def main(", max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert not [r for r in caplog.records if "not supported" in r.getMessage()]
    text = result[0]["generated_text"]
    assert text.startswith("def main(") and len(text) > len("def main(")
    assert text == _greedy_reference(folder, "def main(", 12)


def test_pipeline_with_device_map_auto(folder):
    generator = pipeline("text-generation", model=str(folder), device_map="auto")
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert generator.model.device.type == expected_device
    text = generator("import os\n", max_new_tokens=8, min_new_tokens=8, do_sample=False)[0]["generated_text"]
    if expected_device == "cpu":
        assert text == _greedy_reference(folder, "import os\n", 8)
    else:
        assert text.startswith("import os\n")


def test_pipeline_batches_prompts_of_different_lengths(folder):
    generator = pipeline("text-generation", model=str(folder))
    generator.tokenizer.padding_side = "left"
    prompts = ["x", "class Foo(object):\n    def"]
    batched = generator(prompts, max_new_tokens=6, min_new_tokens=6, do_sample=False, batch_size=2)
    single = [generator(p, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0]["generated_text"] for p in prompts]
    assert [r[0]["generated_text"] for r in batched] == single


# Task heads: transformers' generic heads over our backbone. What a user relies on: the head reads the backbone's
# hidden states, a padded batch gives each row's own result, and the loss is the task's usual one.
HEAD_LAYOUTS = ["v1_gqa", "v2_gqa"]


def _head(cls, layout):
    torch.manual_seed(0)
    model = randomize_norms(cls(tiny_config(layout, num_labels=3))).eval()
    assert type(model.model) is DiffTransformerModel
    return model


def _backbone(model, ids, mask=None, positions=None):
    with torch.no_grad():
        return model.model(ids, attention_mask=mask, position_ids=positions).last_hidden_state


def _left_padded(vocab_size, lengths):
    """Left-padded rows with the positions a row alone would have (as generate() derives them from the mask)."""
    ids, mask = left_padded_batch(vocab_size, lengths, seed=4)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
def test_sequence_classification_scores_the_last_real_token_of_each_row(layout):
    model = _head(DiffTransformerForSequenceClassification, layout)
    vocab, pad = model.config.vocab_size, model.config.pad_token_id
    lengths = [7, 4, 1]
    # Right padding: the pooled token is the last non-padding one, not the last position.
    ids = torch.full((3, 7), pad)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(b))
    mask = (ids != pad).long()
    labels = torch.tensor([0, 2, 1])
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels)
    hidden = _backbone(model, ids, mask)
    last = torch.tensor(lengths) - 1
    torch.testing.assert_close(out.logits, model.score(hidden[torch.arange(3), last]))
    assert not torch.allclose(out.logits[1:], model.score(hidden[1:, -1]), atol=1e-3)  # the last position differs
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, labels))
    # Left padding, with the mask and positions: each row gives what it gives alone.
    ids, mask, positions = _left_padded(vocab, lengths)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, position_ids=positions).logits
        for b, n in enumerate(lengths):
            torch.testing.assert_close(batched[b], model(ids[b : b + 1, -n:]).logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
def test_token_classification_scores_every_token(layout):
    model = _head(DiffTransformerForTokenClassification, layout)
    lengths = [7, 4]
    ids, mask, positions = _left_padded(model.config.vocab_size, lengths)
    labels = torch.randint(0, 3, ids.shape, generator=torch.Generator().manual_seed(1)).masked_fill(mask == 0, -100)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions, labels=labels)
    torch.testing.assert_close(out.logits, model.score(_backbone(model, ids, mask, positions)))  # eval: no dropout
    real = mask.bool()
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits[real], labels[real]))  # padding not scored
    with torch.no_grad():
        for b, n in enumerate(lengths):
            torch.testing.assert_close(out.logits[b, -n:], model(ids[b : b + 1, -n:]).logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
def test_question_answering_start_and_end_logits_and_loss(layout):
    """Start and end logits are the float64 reference model's final hidden states times the head's two rows, plus
    its bias: the reference (difftransformer/testing_utils.py) computes the backbone from the state dict alone, with
    neither our modules nor transformers' head, so a head that reads the wrong states (unnormalised, another
    layer's, shifted) or swaps start and end fails. The loss is the mean of the two cross-entropies."""
    model = _head(DiffTransformerForQuestionAnswering, layout)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    start, end = torch.tensor([1, 4]), torch.tensor([3, 8])
    with torch.no_grad():
        model.qa_outputs.bias.normal_(generator=torch.Generator().manual_seed(3))  # a bias that shows
        out = model(ids, start_positions=start, end_positions=end)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    weights["lm_head.weight"] = weights["qa_outputs.weight"]  # the reference's head: hidden @ W.T over the 2 rows
    reference, _ = reference_forward(model, ids, state_dict=weights)
    reference = reference + weights["qa_outputs.bias"].double()
    torch.testing.assert_close(out.start_logits.double(), reference[..., 0], atol=2e-5, rtol=0)
    torch.testing.assert_close(out.end_logits.double(), reference[..., 1], atol=2e-5, rtol=0)
    assert (reference[..., 0] - reference[..., 1]).abs().max() > 1e-2  # start and end differ: a swap would show
    expected = (F.cross_entropy(out.start_logits, start) + F.cross_entropy(out.end_logits, end)) / 2
    torch.testing.assert_close(out.loss, expected)


def test_text_classification_pipeline_reports_the_models_probabilities(tokenizer):
    config = DiffTransformerConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        diff_version=1,
        num_labels=3,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = DiffTransformerForSequenceClassification(config).eval()
    with torch.no_grad():
        model.score.weight.mul_(50)  # distinct probabilities: the label order of the output is then meaningful
    classify = pipeline("text-classification", model=model, tokenizer=tokenizer, top_k=None)
    texts = ["import os", "def main():\n    return 0"]
    results = classify(texts)
    for text, result in zip(texts, results, strict=True):
        with torch.no_grad():
            probs = model(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1)
        reported = {r["label"]: r["score"] for r in result}
        assert reported == pytest.approx({f"LABEL_{i}": p for i, p in enumerate(probs.tolist())}, abs=1e-5)
        assert result[0]["label"] == f"LABEL_{probs.argmax().item()}"
