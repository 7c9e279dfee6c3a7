"""Data-parallel training of a DiffTransformer with the transformers `Trainer`: one process, DDP, FSDP2 or DeepSpeed.

The script is launcher-agnostic: the launcher decides the number of processes, the Trainer (through accelerate)
wraps the model accordingly.

    python examples/distributed/train_trainer.py --output-dir out                         # one process
    torchrun --nproc_per_node 2 examples/distributed/train_trainer.py --output-dir out    # DDP (gloo on CPU)
    accelerate launch --num_processes 2 examples/distributed/train_trainer.py --output-dir out   # same, via accelerate
    torchrun --nproc_per_node 8 examples/distributed/train_trainer.py --fsdp --output-dir out     # FSDP2 (GPUs)
    torchrun --nproc_per_node 8 examples/distributed/train_trainer.py --deepspeed ds.json --output-dir out  # DeepSpeed

Each process draws `--per-device-batch-size` sequences per step, so the global batch is that times the number of
processes; tests/test_distributed.py checks that 2 processes x 2 sequences follow the same loss trajectory as
1 process x 4. The data is a deterministic synthetic corpus (`dist_common.synthetic_dataset`) so that the script
runs anywhere without downloads; `--model` starts from a saved model folder instead of a fresh tiny model.
"""

import argparse
import json
import os

import torch
from dist_common import synthetic_dataset, tiny_model  # examples/distributed/dist_common.py, beside this file
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
        save_strategy="no",
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


def train(args: argparse.Namespace) -> list[float]:
    """Train with `Trainer`; returns the loss logged at every step (the mean over all processes' tokens)."""
    model = AutoModelForCausalLM.from_pretrained(args.model) if args.model else tiny_model(args.diff_version, args.seed)
    data = synthetic_dataset(args.num_samples, args.seq_len, model.config.vocab_size, args.seed)
    trainer = Trainer(model=model, args=training_arguments(args), train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if args.save:
        trainer.save_model(os.path.join(args.output_dir, "model"))
    if trainer.is_world_process_zero():
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "losses.json"), "w") as f:
            json.dump({"world_size": trainer.args.world_size, "losses": losses}, f)
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
    return p.parse_args(argv)


if __name__ == "__main__":
    losses = train(parse_args())
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"losses": losses}))
