"""DeepSpeed ZeRO-2 and ZeRO-3 through the `Trainer` on 2 CPU processes, with docs/distributed.md's config files.

examples/distributed/train_trainer.py runs under torchrun with each documented config, from the same saved tiny
model as a one-process run with the same global batch (2 processes x 2 sequences against 1 x 4):

* the loss at every step and the trained weights equal the one-process run's within float32 rounding;
* the folder `trainer.save_model` writes loads with `from_pretrained`, with exactly the weights the DeepSpeed
  checkpoint of the last step holds (its fp32 master weights, gathered with DeepSpeed's own `zero_to_fp32`);
* ZeRO-3 builds the model partitioned (`deepspeed.zero.Init`): at initialisation each process holds about half of
  the parameters, ZeRO-2 all of them;
* a ZeRO-3 run resumed from its step-2 checkpoint continues the uninterrupted run: same losses, same weights.

DeepSpeed JIT-builds a CPU communication op on its first run (about 100 s on 2 cores, cached under
`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions), so the first launch has a long timeout.
"""

import json
from pathlib import Path

import dist_common
import pytest
import torch
import torch.distributed as dist
import train_trainer
from transformers import AutoModelForCausalLM

import difftransformer  # noqa: F401
from utils_distributed import doc_blocks
from utils_launch import check, launch

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (requirements-dev.txt pins it)")

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is unavailable",
)

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "distributed" / "train_trainer.py"
STEPS = 4
# The tolerance of the DDP and FSDP2 tests: the same float32 training, gradients summed over 2 processes instead of
# over one batch of 4 (a different summation order: rounding of a few float32 ulps, grown by 4 AdamW steps).
RTOL, ATOL = 1e-4, 1e-5


def doc_config(stage: int) -> dict:
    """The DeepSpeed config file docs/distributed.md gives for ZeRO `stage`."""
    (config,) = [c for c in map(json.loads, doc_blocks("json")) if c["zero_optimization"]["stage"] == stage]
    return config


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-process run per ZeRO stage (a checkpoint every 2 steps, the model saved at the end), a ZeRO-3 run
    resumed from its step-2 checkpoint, and the one-process reference."""
    tmp = tmp_path_factory.mktemp("deepspeed")
    dist_common.tiny_model(diff_version=1, seed=0).save_pretrained(tmp / "init")
    common = ["--model", str(tmp / "init"), "--max-steps", str(STEPS), "--learning-rate", "3e-3", "--save"]
    for stage in (2, 3):
        (tmp / f"ds_zero{stage}.json").write_text(json.dumps(doc_config(stage)))
        check(
            launch(
                SCRIPT,
                *("--deepspeed", f"ds_zero{stage}.json", "--output-dir", f"zero{stage}", "--save-steps", "2"),
                *("--per-device-batch-size", "2", *common),
                cwd=tmp,
                timeout=600 if stage == 2 else 300,  # the first launch may build DeepSpeed's CPU op
            )
        )
    check(
        launch(
            SCRIPT,
            *("--deepspeed", "ds_zero3.json", "--output-dir", "zero3-resumed"),
            *("--resume-from-checkpoint", "zero3/checkpoint-2", "--per-device-batch-size", "2", *common),
            cwd=tmp,
            timeout=300,
        )
    )
    single = train_trainer.train(
        train_trainer.parse_args(["--output-dir", str(tmp / "single"), "--per-device-batch-size", "4", *common])
    )
    return tmp, single


def _state_dict(folder: Path) -> dict:
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_training_equals_one_process(runs, stage):
    tmp, single = runs
    run = json.loads((tmp / f"zero{stage}" / "losses.json").read_text())
    assert run["world_size"] == 2
    assert len(run["losses"]) == len(single) == STEPS and single[-1] < single[0]
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(single), rtol=RTOL, atol=ATOL)

    trained, reference, initial = (_state_dict(tmp / f) for f in (f"zero{stage}/model", "single/model", "init"))
    assert trained.keys() == reference.keys()
    name = "model.layers.0.self_attn.lambda_q1"
    assert not torch.equal(reference[name], initial[name])  # λ trained too
    for name, tensor in reference.items():
        torch.testing.assert_close(trained[name], tensor, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("stage", [2, 3])
def test_saved_folder_holds_the_trained_weights(runs, stage):
    """`from_pretrained` of the saved folder gives the weights DeepSpeed trained: its last checkpoint's fp32 master
    weights (float32 training: the gathered 16-bit-option weights are those same float32 values)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tmp, _ = runs
    master = get_fp32_state_dict_from_zero_checkpoint(str(tmp / f"zero{stage}" / f"checkpoint-{STEPS}"))
    loaded = _state_dict(tmp / f"zero{stage}" / "model")
    assert set(master) <= set(loaded)
    assert set(loaded) - set(master) <= {"lm_head.weight"}  # tied to the embeddings, stored once
    for name, tensor in master.items():
        assert torch.equal(loaded[name], tensor.float()), name


def test_zero3_partitions_the_model_at_initialisation(runs):
    tmp, _ = runs
    zero2, zero3 = (json.loads((tmp / f"zero{s}" / "losses.json").read_text())["parameters"] for s in (2, 3))
    total = zero2[0]["total_numel"]
    assert [rank["local_numel"] for rank in zero2] == [total, total]  # ZeRO-2 partitions only optimizer state
    assert [rank["total_numel"] for rank in zero3] == [total, total]
    # ZeRO-3: each process holds its half of every tensor (rounded up), never a whole model.
    half = sum(-(-p.numel() // 2) for p in AutoModelForCausalLM.from_pretrained(tmp / "init").parameters())
    assert [rank["local_numel"] for rank in zero3] == [half, half]
    assert [rank["local_bytes"] for rank in zero3] == [4 * half, 4 * half]  # float32


def test_zero3_resumed_from_a_checkpoint_continues_the_run(runs):
    tmp, _ = runs
    uninterrupted = json.loads((tmp / "zero3" / "losses.json").read_text())["losses"]
    resumed = json.loads((tmp / "zero3-resumed" / "losses.json").read_text())["losses"]
    assert len(resumed) == STEPS  # steps 1-2 from the checkpoint's log, 3-4 trained after resuming
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted), rtol=1e-6, atol=1e-7)
    final, resumed_final = _state_dict(tmp / "zero3" / "model"), _state_dict(tmp / "zero3-resumed" / "model")
    for name, tensor in final.items():
        torch.testing.assert_close(resumed_final[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
