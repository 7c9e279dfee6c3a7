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

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="serving tests need the vLLM venv: bash scripts/setup_vllm.sh")
peft = pytest.importorskip("peft", reason="the LoRA updates need peft")

from serving_utils import (  # noqa: E402
    LOGPROB_TOL,
    assert_matches,
    engine_jobs_in_child,
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
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=targets,
        init_lora_weights=False,
        modules_to_save=["lambda_proj"] if getattr(model.config, "diff_version", 1) == 2 else None,
    )
    tuned = get_peft_model(model, config)
    with torch.no_grad():  # a "trained" λ: V2's projection copy, V1's vectors (in place, as enable_lambda_training)
        for name, param in tuned.named_parameters():
            if "modules_to_save" in name or name.endswith(("lambda_q1", "lambda_k2")):
                param.add_(0.05 * torch.randn_like(param))
    return tuned.merge_and_unload().eval()


def test_single_tensor_weight_sync_in_any_order_repeatedly(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from difftransformer.motif import register_motif

    register_motif()  # the Auto classes load Motif's folders too (opt-in: docs/models.md)

    jobs, references = [], {}
    for name, spec in FOLDERS.items():
        folder = tmp_path / name
        spec = dict(spec)
        if "motif" in spec:
            save_motif_folder(
                folder, spec.pop("motif"), seed=spec.pop("seed"), vocab_size=512, max_position_embeddings=1024
            )
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
        jobs.append(
            {"name": name, "folder": str(folder), "updates": updates, "prompt": PROMPT, "new_tokens": NEW_TOKENS}
        )

    # vLLM imported once, in a child process, each engine inside it (serving_utils.run_weight_sync_jobs).
    results = engine_jobs_in_child(
        jobs,
        tmp_path / "child",
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        timeout=1200,
        runner="run_weight_sync_jobs",
    )
    for name, record in results.items():
        before, *after = references[name]
        assert_matches(record["before"]["ids"], record["before"]["logprobs"], before, LOGPROB_TOL, f"{name} loaded")
        assert len(record["after"]) == len(UPDATE_SEEDS)
        for i, (got, ref) in enumerate(zip(record["after"], after)):
            assert_matches(got["ids"], got["logprobs"], ref, LOGPROB_TOL, f"{name} after sync {i + 1}")
