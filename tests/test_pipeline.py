"""pipeline("text-generation", model=folder), also with device_map="auto", for DIFF V1 and V2."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from difftransformer.data import get_tokenizer


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one thread is as fast, and immune to the 2-thread OpenMP stalls of a busy shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return get_tokenizer(vocab_size=512, cache_dir=tmp_path_factory.mktemp("tokenizer-cache"))


@pytest.fixture(scope="module", params=[1, 2], ids=["v1", "v2"])
def folder(request, tokenizer, tmp_path_factory):
    """A saved model + tokenizer folder, as examples/train.py writes it (random weights: only the plumbing matters)."""
    config = DiffTransformerConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, diff_version=request.param, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
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
