"""Weight sync into the native vLLM model (difftransformer/vllm_model.py), as TRL's GRPOTrainer does it with vLLM
(colocate or server mode): after each optimizer step it merges the LoRA adapter and calls the vLLM model's
``load_weights`` with ONE tensor at a time, named as the training model's ``named_parameters()`` (Hugging Face names,
our in-memory layout), in parameter order. Here every tensor of a LoRA-merged model is pushed alone, in a shuffled
order, twice in a row (two training steps' updates), into engines serving a V1, a V2, a grouped-differential-attention
and a Motif-2 folder (``motif_gqa``: the layout whose query rows differ between Motif's files and memory); after each
sync vLLM's greedy tokens equal ``generate()`` of the merged model.

vLLM's CPU backend repacks linear weights after loading and drops the originals, so on CPU single-tensor loads run
inside vLLM's layerwise reload (``initialize_layerwise_reload`` … ``finalize_layerwise_reload``, what its
``reload_weights`` does); on GPUs TRL calls ``load_weights`` directly. The model's ``load_weights`` is the same code.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="serving tests need the vLLM venv: bash scripts/setup_vllm.sh")
peft = pytest.importorskip("peft", reason="the LoRA updates need peft")

from serving_utils import (  # noqa: E402
    LOGPROB_TOL,
    ROOT,
    assert_matches,
    greedy_reference,
    save_motif_folder,
    save_random_model,
)

PROMPT = list(range(40, 72))
NEW_TOKENS = 8
FOLDERS = {  # name: how to build it (head_dim 32: vLLM's CPU attention)
    "v1": dict(diff_version=1, num_attention_heads=8, num_key_value_heads=4, seed=0),
    "v2": dict(diff_version=2, num_attention_heads=8, num_key_value_heads=2, seed=0),
    "v1_gda": dict(diff_version=1, num_attention_heads=10, num_key_value_heads=4, num_noise_heads=2, seed=0),
    "motif_gqa": dict(motif="tiny-gqa", seed=0),
}
UPDATE_SEEDS = (11, 12)  # two syncs: each a fresh random LoRA update merged into the base weights


def lora_merged(model, seed: int):
    """``model`` with a random LoRA update on every projection (V2: λ projection trained too, PEFT's
    modules_to_save) merged in: the weights TRL pushes after a step."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                        modules_to_save=["lambda_proj"] if getattr(model.config, "diff_version", 1) == 2 else None)
    tuned = get_peft_model(model, config)
    with torch.no_grad():  # a "trained" λ: V2's projection copy, V1's vectors (in place, as enable_lambda_training)
        for name, param in tuned.named_parameters():
            if "modules_to_save" in name or name.endswith(("lambda_q1", "lambda_k2")):
                param.add_(0.05 * torch.randn_like(param))
    return tuned.merge_and_unload().eval()


def sync_in_child(jobs: list[dict], workdir: Path) -> dict:
    """:func:`run_sync_jobs` in a child process (vLLM imported there once, each engine inside it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    jobs_file, out_file, log_file = workdir / "jobs.json", workdir / "results.json", workdir / "child.log"
    jobs_file.write_text(json.dumps(jobs))
    script = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests_serving')!r}]\n"
              "from test_vllm_weight_sync import run_sync_jobs\n"
              f"if __name__ == '__main__':\n    run_sync_jobs({str(jobs_file)!r}, {str(out_file)!r})\n")
    with open(log_file, "wb") as log:
        proc = subprocess.run([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT, timeout=1200,
                              env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    if proc.returncode != 0 or not out_file.is_file():
        raise AssertionError(f"vLLM child exited with {proc.returncode}:\n{log_file.read_text(errors='replace')[-6000:]}")
    return json.loads(out_file.read_text())


def run_sync_jobs(jobs_file: str, out_file: str) -> None:
    """In the child: for each job, an engine on the folder; greedy tokens before any sync, then after each pushed
    update (every tensor alone, shuffled)."""
    import gc

    from safetensors.torch import load_file
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    results = {}
    params = vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, detokenize=False)
    for job in json.loads(Path(jobs_file).read_text()):
        llm = vllm.LLM(model=job["folder"], dtype="float32", seed=0, max_model_len=256, enforce_eager=True,
                       skip_tokenizer_init=True)

        def greedy(llm=llm):
            out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0]
            return {"ids": list(out.token_ids), "logprobs": [s[t].logprob for s, t in zip(out.logprobs, out.token_ids)]}

        record = {"before": greedy(), "after": []}
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model  # where TRL's colocate mode loads
        for update in job["updates"]:
            tensors = list(load_file(update).items())
            random.Random(update).shuffle(tensors)
            initialize_layerwise_reload(model)
            for name, tensor in tensors:
                model.load_weights([(name, tensor)])
            finalize_layerwise_reload(model, llm.llm_engine.vllm_config.model_config)
            llm.reset_prefix_cache()
            record["after"].append(greedy())
        results[job["name"]] = record
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    Path(out_file).write_text(json.dumps(results))


def test_single_tensor_weight_sync_in_any_order_repeatedly(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    import difftransformer  # noqa: F401  (registers the Auto classes, Motif's included)

    jobs, references = [], {}
    for name, spec in FOLDERS.items():
        folder = tmp_path / name
        spec = dict(spec)
        if "motif" in spec:
            save_motif_folder(folder, spec.pop("motif"), seed=spec.pop("seed"), vocab_size=512,
                              max_position_embeddings=1024)
        else:
            save_random_model(folder, **spec)
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        references[name] = [greedy_reference(base, PROMPT, NEW_TOKENS)]
        updates = []
        for seed in UPDATE_SEEDS:
            merged = lora_merged(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), seed)
            references[name].append(greedy_reference(merged, PROMPT, NEW_TOKENS))
            path = tmp_path / f"{name}-update-{seed}.safetensors"  # the in-memory tensors, as TRL reads them
            save_file({n: p.detach().contiguous() for n, p in merged.named_parameters()}, str(path))
            updates.append(str(path))
        assert references[name][1].ids != references[name][0].ids, name  # the update changes the output
        jobs.append({"name": name, "folder": str(folder), "updates": updates})

    results = sync_in_child(jobs, tmp_path / "child")
    for name, record in results.items():
        before, *after = references[name]
        assert_matches(record["before"]["ids"], record["before"]["logprobs"], before, LOGPROB_TOL, f"{name} loaded")
        assert len(record["after"]) == len(UPDATE_SEEDS)
        for i, (got, ref) in enumerate(zip(record["after"], after)):
            assert_matches(got["ids"], got["logprobs"], ref, LOGPROB_TOL, f"{name} after sync {i + 1}")
