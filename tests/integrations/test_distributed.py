"""Multi-process training and inference on 2 CPU processes (gloo), launched with torchrun.

Each test runs a script of examples/distributed/ under `torchrun --standalone --nproc_per_node 2` and compares
it with the same script's function run in this single process:

* DDP through the transformers `Trainer`: same loss at every step as one process with the same global batch;
* FSDP2 (transformers' `DistributedConfig(fsdp_size=2)`, i.e. `fully_shard` per decoder layer): each process
  holds half the parameters, the loss trajectory and the saved (gathered) weights equal the single-process run, and
  the saved folder is the folder a single process writes;
* tensor parallelism with the model's `base_model_tp_plan` (`DistributedConfig(tp_plan="auto")`): the shards hold
  whole KV groups, logits, every head's λ and greedy tokens equal the unsharded model's, for V1 and V2; a `tp_size`
  that would split a KV group is refused with a clear error;
* training (examples/distributed/train_parallel.py, AdamW with gradient accumulation) under tensor parallelism (2
  processes; V1, V2, grouped noise heads, a Motif-2 layout), FSDP2 in bfloat16 (V1, V2) and tensor parallelism within
  FSDP2 (4 processes, V1, V2): losses and every gathered parameter as close to a float64 run as the same training in
  one process is (`utils_distributed.assert_as_close_as_one_process`), and the processes of a tensor-parallel group
  holding identical replicated parameters.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import dist_common
import pytest
import torch
import torch.distributed as dist
import train_fsdp2
import train_parallel
import train_trainer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import difftransformer  # noqa: F401
import utils_launch
from utils_distributed import assert_as_close_as_one_process, word_tokenizer

# Its modules (dist_common, train_fsdp2, train_trainer) are on sys.path through pyproject.toml's pytest `pythonpath`.
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "distributed"

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is unavailable",
)


def torchrun(script: str, *args: str, cwd: Path, nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run examples/distributed/<script> on `nproc` CPU processes; fail with the processes' output if it fails or
    runs past `timeout` (then every rank is killed: utils_launch)."""
    return utils_launch.check(utils_launch.launch(EXAMPLES / script, *args, cwd=cwd, nproc=nproc, timeout=timeout))


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    # The in-process reference runs must not believe they are part of a distributed job.
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_ddp_trainer_matches_one_process_with_the_same_global_batch(tmp_path):
    common = ["--diff-version", "2", "--max-steps", "5", "--learning-rate", "3e-3"]
    torchrun(
        "train_trainer.py", "--output-dir", str(tmp_path / "ddp"), "--per-device-batch-size", "2", *common, cwd=tmp_path
    )
    ddp = json.loads((tmp_path / "ddp" / "losses.json").read_text())
    assert ddp["world_size"] == 2  # really one DDP job, not two processes training alone

    single = train_trainer.train(
        train_trainer.parse_args(["--output-dir", str(tmp_path / "single"), "--per-device-batch-size", "4", *common])
    )
    assert len(single) == len(ddp["losses"]) == 5
    assert single[-1] < single[0]  # it trains
    torch.testing.assert_close(torch.tensor(ddp["losses"]), torch.tensor(single), rtol=1e-4, atol=1e-5)


def test_trainer_script_refuses_fsdp_on_multi_cpu(tmp_path, monkeypatch):
    # accelerate runs FSDP only on accelerators; on CPU it would silently train DDP, so the script must refuse.
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: FSDP through the Trainer is supported here")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="--fsdp needs GPUs"):
        train_trainer.training_arguments(train_trainer.parse_args(["--fsdp", "--output-dir", str(tmp_path)]))


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """One FSDP2 job on 2 processes and the same training in this process, both saving the trained model."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    dist_common.tiny_model(diff_version=1, seed=0).save_pretrained(tmp / "init")
    common = [
        "--model",
        str(tmp / "init"),
        "--max-steps",
        "4",
        "--global-batch-size",
        "4",
        "--learning-rate",
        "3e-3",
        "--save",
    ]
    torchrun("train_fsdp2.py", "--output-dir", str(tmp / "fsdp"), *common, cwd=tmp)
    single = train_fsdp2.train(train_fsdp2.parse_args(["--output-dir", str(tmp / "single"), *common]))
    return tmp, single


def test_fsdp2_shards_and_matches_one_process(fsdp_run):
    tmp, single = fsdp_run
    fsdp = json.loads((tmp / "fsdp" / "losses.json").read_text())
    assert fsdp["world_size"] == 2
    assert fsdp["local_fraction"] < 0.6  # each process holds about half of the parameters
    torch.testing.assert_close(torch.tensor(fsdp["losses"]), torch.tensor(single), rtol=1e-4, atol=1e-5)

    # save_pretrained gathered the shards into a normal checkpoint equal to the single-process result.
    sharded_trained = load_file(tmp / "fsdp" / "model" / "model.safetensors")
    single_trained = load_file(tmp / "single" / "model" / "model.safetensors")
    initial = load_file(tmp / "init" / "model.safetensors")
    assert not torch.equal(
        single_trained["model.layers.0.self_attn.q_proj.weight"], initial["model.layers.0.self_attn.q_proj.weight"]
    )
    assert sharded_trained.keys() == single_trained.keys()
    for name, tensor in single_trained.items():
        torch.testing.assert_close(sharded_trained[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp / "fsdp" / "model")
    assert reloaded.config.diff_version == 1


def test_fsdp2_saved_folder_is_remote_code_ready(fsdp_run):
    # The gathered folder must be the folder a single process writes: same files, same auto_map and architectures.
    tmp, _ = fsdp_run
    sharded, single = tmp / "fsdp" / "model", tmp / "single" / "model"
    assert sorted(p.name for p in sharded.iterdir()) == sorted(p.name for p in single.iterdir())
    sharded_config, single_config = (json.loads((f / "config.json").read_text()) for f in (sharded, single))
    assert sharded_config["auto_map"] == single_config["auto_map"]
    assert sharded_config["architectures"] == single_config["architectures"] == ["DiffTransformerForCausalLM"]


@pytest.mark.parametrize("diff_version", [1, 2])
def test_tensor_parallel_plan_gives_the_same_logits_and_tokens(tmp_path, diff_version):
    model = dist_common.tiny_model(diff_version=diff_version, seed=0).eval()
    model.save_pretrained(tmp_path / "model")
    if diff_version == 1:  # prompt as token ids
        prompt = [5, 17, 3, 99, 42, 7, 64]
        prompt_args = ["--input-ids", *map(str, prompt)]
    else:  # prompt as text, through the tokenizer saved with the model (the doc's form)
        text = "def main ( argv ) : return"
        tokenizer = word_tokenizer([text])
        tokenizer.save_pretrained(tmp_path / "model")
        prompt, prompt_args = tokenizer(text).input_ids, ["--prompt", text]
    proc = torchrun(
        "tp_generate.py",
        "--model",
        str(tmp_path / "model"),
        *prompt_args,
        "--max-new-tokens",
        "6",
        "--save-logits",
        str(tmp_path / "logits.pt"),
        "--save-lambdas",
        str(tmp_path / "lambdas.pt"),
        cwd=tmp_path,
    )
    result = utils_launch.last_json_line(proc.stdout)
    assert result["world_size"] == 2

    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = model(ids, output_lambdas=True)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected.logits, rtol=1e-5, atol=1e-5)
    # λ of every differential head (V2: (1, T, H) per layer, gathered from the ranks' heads; V1: one scalar per layer)
    lambdas = torch.load(tmp_path / "lambdas.pt")
    assert [lam.shape for lam in lambdas] == [lam.shape for lam in expected.lambdas]
    for lam, expected_lam in zip(lambdas, expected.lambdas):
        torch.testing.assert_close(lam, expected_lam, rtol=1e-5, atol=1e-6)
    expected_tokens = model.generate(ids, max_new_tokens=6, do_sample=False)[0, len(prompt) :].tolist()
    assert result["generated_ids"] == expected_tokens
    if diff_version == 2:
        assert result["text"] == tokenizer.decode(expected_tokens)

    # What is sharded: q/k/v by output rows (whole KV groups per process), o_proj by input columns.
    shards, config = result["shards"], model.config
    d = config.head_dim
    assert shards["q_proj.weight"]["local"] == [config.num_attention_heads * d // 2, config.hidden_size]
    assert shards["k_proj.weight"]["local"] == [config.num_key_value_heads * d // 2, config.hidden_size]
    assert shards["o_proj.weight"]["local"][1] == shards["o_proj.weight"]["global"][1] // 2
    if diff_version == 1:  # λ vectors and the per-head norm are replicated
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "subln.weight"):
            assert shards[name]["local"] == shards[name]["global"], name
    else:  # one λ row per differential head, sharded with its heads
        assert shards["lambda_proj.weight"]["local"] == [config.num_attention_heads // 4, config.hidden_size]


def test_tensor_parallel_refuses_to_split_a_kv_group(tmp_path):
    # V1 with num_key_value_heads=2 has a single KV group (K1, K2 and both value halves): it cannot be split in two.
    dist_common.tiny_model(diff_version=1, num_key_value_heads=2).save_pretrained(tmp_path / "model")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(EXAMPLES / "tp_generate.py"),
        "--model",
        str(tmp_path / "model"),
        "--input-ids",
        "5",
        "17",
        "3",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "KV groups" in proc.stderr and "tp_size" in proc.stderr, proc.stderr[-3000:]


# Head layouts trained under tensor parallelism: the tiny model's (dist_common.tiny_config) with these overrides.
TRAINING_LAYOUTS = {
    "v1": dict(diff_version=1),
    "v2": dict(diff_version=2),
    # grouped differential attention: 2 noise maps for 6 signal maps (r = 3), over 2 KV groups
    "v2-grouped-noise-heads": dict(diff_version=2, num_noise_heads=2),
    # Motif-2-12.7B's layout at tiny size: V1 with grouped noise heads (r = 4), PolyNorm MLP, λinit one layer off
    "motif-2": dict(
        diff_version=1,
        hidden_act="poly_norm",
        num_attention_heads=10,
        num_noise_heads=2,
        head_dim=8,
        lambda_init_layer_offset=-1,
    ),
}


RUNS = ("parallel", "single", "float64")


def train_in_parallel_and_alone(tmp, layout: str, nproc: int, dtype: str, *options: str) -> dict:
    """The same AdamW training (gradient accumulation over 2 micro-batches) launched on `nproc` processes with
    train_parallel.py's `options`, in this process in `dtype`, and in this process in float64; the saved (gathered)
    weights and the losses of all three."""
    dist_common.tiny_model(seed=0, **TRAINING_LAYOUTS[layout]).save_pretrained(tmp / "init")
    common = [
        "--model",
        str(tmp / "init"),
        "--max-steps",
        "3",
        "--global-batch-size",
        "4",
        "--grad-accum-steps",
        "2",
        "--learning-rate",
        "3e-3",
        "--save",
    ]
    out = ["--output-dir", str(tmp / "parallel"), "--dtype", dtype]
    torchrun("train_parallel.py", *out, *options, *common, cwd=tmp, nproc=nproc)
    runs = {"parallel": json.loads((tmp / "parallel" / "losses.json").read_text())}
    assert runs["parallel"]["world_size"] == nproc
    for run, run_dtype in (("single", dtype), ("float64", "float64")):
        args = train_parallel.parse_args(["--output-dir", str(tmp / run), "--dtype", run_dtype, *common])
        runs[run] = {"losses": train_parallel.train(args)}
    for run in runs:
        runs[run]["weights"] = load_file(tmp / run / "model" / "model.safetensors")
    runs["initial"] = load_file(tmp / "init" / "model.safetensors")
    return runs


def assert_training_equals_one_process(runs: dict, dtype: torch.dtype):
    losses = {run: {"loss": torch.tensor(runs[run]["losses"], dtype=torch.float64)} for run in RUNS}
    assert_as_close_as_one_process(losses["parallel"], losses["single"], losses["float64"], dtype, "losses")
    assert runs["float64"]["losses"][-1] < runs["float64"]["losses"][0]  # it trains
    weights = {run: runs[run]["weights"] for run in RUNS}
    assert_as_close_as_one_process(
        weights["parallel"], weights["single"], weights["float64"], dtype, "weights", initial=runs["initial"]
    )
    # The processes of a tensor-parallel group hold the same replicated parameters (V1's λ and per-head norm too).
    assert runs["parallel"]["replicated_gap"] == 0.0


@pytest.mark.parametrize("layout", sorted(TRAINING_LAYOUTS))
def test_tensor_parallel_training_equals_one_process(tmp_path, layout):
    runs = train_in_parallel_and_alone(tmp_path, layout, 2, "float32")
    assert_training_equals_one_process(runs, torch.float32)


@pytest.mark.parametrize("diff_version", [1, 2])
def test_fsdp2_trains_in_bfloat16(tmp_path, diff_version):
    # from_pretrained(dtype=torch.bfloat16) keeps V1's λ vectors float32 (_keep_in_fp32_modules_strict); FSDP2 needs
    # one dtype per shard group, which transformers then gives them.
    runs = train_in_parallel_and_alone(tmp_path, f"v{diff_version}", 2, "bfloat16", "--fsdp-size", "2")
    assert_training_equals_one_process(runs, torch.bfloat16)
    saved = runs["parallel"]["weights"]
    assert saved["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    kept = [name for name in saved if re.search(r"self_attn\.lambda_[qk][12]$", name)]
    assert len(kept) == (4 * 2 if diff_version == 1 else 0)  # 2 layers
    assert all(saved[name].dtype == torch.float32 for name in kept)


@pytest.mark.parametrize("diff_version", [1, 2])
def test_tensor_parallel_within_fsdp2_equals_one_process(tmp_path, diff_version):
    # 4 processes: 2 FSDP2 groups (each a different half of every batch) of 2 tensor-parallel processes.
    runs = train_in_parallel_and_alone(tmp_path, f"v{diff_version}", 4, "float32", "--fsdp-size", "2")
    assert_training_equals_one_process(runs, torch.float32)
