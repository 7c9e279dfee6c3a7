"""Data-parallel training of a DiffTransformer with the transformers `Trainer`: one process, DDP, FSDP2 or DeepSpeed.

The script is launcher-agnostic: the launcher decides the number of processes, the Trainer (through accelerate)
wraps the model accordingly.

    python examples/distributed/train_trainer.py --output-dir out                         # one process
    torchrun --nproc_per_node 2 examples/distributed/train_trainer.py --output-dir out    # DDP (gloo on CPU)
    accelerate launch --multi_gpu --num_processes 2 examples/distributed/train_trainer.py --output-dir out  # same
    torchrun --nproc_per_node 8 examples/distributed/train_trainer.py --fsdp --output-dir out     # FSDP2 (GPUs)
    torchrun --nproc_per_node 2 examples/distributed/train_trainer.py --deepspeed ds_zero3.json --output-dir out

The accelerate line needs `--multi_gpu` even on a machine without GPUs: there it starts a 2-process gloo job, while
`--num_processes 2` alone (or with `--cpu`, or a MULTI_CPU config file) starts one process. DeepSpeed (ZeRO-2 or
ZeRO-3, `pip install deepspeed`) runs on GPUs and on CPU processes alike. The `TrainingArguments` are created before
the model is loaded: with a ZeRO-3 config they make `from_pretrained`/`from_config` build the model already
partitioned over the processes (`deepspeed.zero.Init`), so no process ever holds all of its parameters.

Each process draws `--per-device-batch-size` sequences per step, so the global batch is that times the number of
processes; the tests check that 2 processes x 2 sequences follow the same loss trajectory as 1 process x 4, under
DDP (tests/integrations/test_distributed.py) and ZeRO-2/ZeRO-3 (tests/integrations/test_deepspeed.py). The data is a
deterministic synthetic corpus (`dist_common.synthetic_dataset`) so that the script runs anywhere without downloads;
`--model` starts from a saved model folder instead of a fresh tiny model.
"""

import argparse
import json
import os

import torch
from dist_common import synthetic_dataset, tiny_config  # examples/distributed/dist_common.py, beside this file
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments


def fsdp_config() -> dict:
    """FSDP2 through accelerate: one shard group per decoder layer (the model's `_no_split_modules`) plus the root."""
    return {
        "version": 2,
        "transformer_layer_cls_to_wrap": ["DiffTransformerDecoderLayer"],
        "reshard_after_forward": True,
    }


def training_arguments(args: argparse.Namespace) -> TrainingArguments:
    on_cpu = not torch.accelerator.is_available()
    if args.fsdp and on_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # accelerate (1.x, accelerate/state.py AcceleratorState) turns an FSDP plugin into FSDP only for accelerator
        # backends; on multi-CPU it would silently fall back to DDP, so refuse instead of training something else.
        raise SystemExit(
            "--fsdp needs GPUs/accelerators: accelerate runs multi-CPU training as DDP only. On CPU use "
            "examples/distributed/train_fsdp2.py (FSDP2 through transformers' DistributedConfig)."
        )
    return TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_batch_size,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        # Same sample order whatever the number of processes: process i takes the i-th slice of every global batch.
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to="none",
        disable_tqdm=True,
        seed=args.seed,
        # Without an accelerator, accelerate sets up multi-process (gloo) training only when told to use the CPU;
        # otherwise every torchrun process would silently train alone on its own slice of the data.
        use_cpu=on_cpu,
        fsdp=True if args.fsdp else None,
        fsdp_config=fsdp_config() if args.fsdp else None,
        deepspeed=args.deepspeed,
    )


def load_model(args: argparse.Namespace):
    """The model to train: `--model`'s folder, or a fresh tiny model seeded with `--seed`.

    Call it after creating the `TrainingArguments`: with a ZeRO-3 DeepSpeed config they register it with
    transformers, and `from_pretrained`/`from_config` then build the model inside `deepspeed.zero.Init`, every process
    holding only its partition of each parameter."""
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model)
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(tiny_config(args.diff_version))


def parameter_footprint(model) -> dict:
    """Parameters this process holds (its ZeRO-3 partitions, else whole tensors) against the model's total."""
    params = list(model.parameters())
    local = [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in params]
    return {
        "local_numel": sum(t.numel() for t in local),
        "local_bytes": sum(t.numel() * t.element_size() for t in local),
        "total_numel": sum(getattr(p, "ds_numel", p.numel()) for p in params),
    }


def train(args: argparse.Namespace) -> list[float]:
    """Train with `Trainer`; returns the loss logged at every step (the mean over all processes' tokens), the steps
    before `--resume-from-checkpoint`'s checkpoint included."""
    training_args = training_arguments(args)  # before the model: see load_model
    model = load_model(args)
    footprint = parameter_footprint(model)  # at initialisation, before the Trainer wraps the model
    data = synthetic_dataset(args.num_samples, args.seq_len, model.config.vocab_size, args.seed)
    trainer = Trainer(model=model, args=training_args, train_dataset=data)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if args.save:
        trainer.save_model(os.path.join(args.output_dir, "model"))
    footprints = [footprint]
    if torch.distributed.is_initialized():
        footprints = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(footprints, footprint)
    if trainer.is_world_process_zero():
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "losses.json"), "w") as f:
            json.dump({"world_size": trainer.args.world_size, "losses": losses, "parameters": footprints}, f)
    return losses


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", required=True, help="where losses.json (and, with --save, the model) is written")
    p.add_argument(
        "--model", default=None, help="a saved model folder to fine-tune; default: a fresh tiny random model"
    )
    p.add_argument("--diff-version", type=int, default=1, choices=(1, 2), help="DIFF version of the fresh tiny model")
    p.add_argument("--per-device-batch-size", type=int, default=2, help="sequences per process per step")
    p.add_argument("--max-steps", type=int, default=5, help="optimizer steps")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW learning rate (constant schedule)")
    p.add_argument("--num-samples", type=int, default=64, help="size of the synthetic training set")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per synthetic sequence")
    p.add_argument("--seed", type=int, default=0, help="seed of the model initialisation and of the data")
    p.add_argument(
        "--fsdp", action="store_true", help="shard parameters, gradients and optimizer state with FSDP2 (GPUs)"
    )
    p.add_argument(
        "--deepspeed", default=None, metavar="JSON", help="a DeepSpeed config file (needs `pip install deepspeed`)"
    )
    p.add_argument("--save", action="store_true", help="save the trained model to OUTPUT_DIR/model")
    p.add_argument(
        "--save-steps", type=int, default=None, help="write a checkpoint (OUTPUT_DIR/checkpoint-N) every N steps"
    )
    p.add_argument(
        "--resume-from-checkpoint",
        default=None,
        metavar="CHECKPOINT",
        help="continue the training saved in this checkpoint folder (written with --save-steps)",
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    losses = train(parse_args())
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"losses": losses}))
