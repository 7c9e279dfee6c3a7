"""FSDP2 training of a DiffTransformer through transformers' own `DistributedConfig` (no Trainer, no accelerate).

`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=N))` shards the model with PyTorch's
`fully_shard` (FSDP2) following the config's `base_model_fsdp_plan` (embeddings, every decoder layer, the final
norm, the root): each process then holds 1/N of every parameter, gradient and optimizer state. The loop below is
plain PyTorch; rank `r` takes the `r`-th slice of every global batch, so the loss trajectory equals a
single-process run on the whole batch (tests/integrations/test_distributed.py checks this, and that the saved model
equals the single-process result).

    python examples/distributed/train_fsdp2.py --model FOLDER --output-dir out                         # 1 process
    torchrun --nproc_per_node 2 examples/distributed/train_fsdp2.py --model FOLDER --output-dir out    # FSDP2

Works on CPU (gloo) and GPUs (nccl); transformers picks the backend from the machine.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from dist_common import synthetic_token_ids  # examples/distributed/dist_common.py, beside this file
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig


def load_sharded(model_path: str, world_size: int):
    """The model, FSDP2-sharded over `world_size` processes (unsharded when `world_size == 1`)."""
    if world_size == 1:
        return AutoModelForCausalLM.from_pretrained(model_path)
    return AutoModelForCausalLM.from_pretrained(model_path, distributed_config=DistributedConfig(fsdp_size=world_size))


def local_fraction(model) -> float:
    """Share of the parameters this process holds (1 / world size when fully sharded, 1.0 unsharded)."""
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    return local / sum(p.numel() for p in model.parameters())  # a DTensor's numel() is the global one


def train(args: argparse.Namespace) -> list[float]:
    """Train for `args.max_steps` steps; returns the global-batch loss of every step (identical on every rank)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model = load_sharded(args.model, world_size)
    rank = dist.get_rank() if world_size > 1 else 0
    if args.global_batch_size % world_size:
        raise ValueError(
            f"--global-batch-size ({args.global_batch_size}) must be divisible by the number of processes "
            f"({world_size})."
        )
    data = synthetic_token_ids(
        args.global_batch_size * args.max_steps, args.seq_len, model.config.vocab_size, args.seed
    )
    held = local_fraction(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(args.max_steps):
        batch = data[step * args.global_batch_size : (step + 1) * args.global_batch_size]
        local = batch.chunk(world_size)[rank]  # equal token counts per rank: mean of local means = global mean
        loss = model(input_ids=local, labels=local).loss
        loss.backward()  # FSDP2 reduce-scatters (averages) the gradients across ranks
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if world_size > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    if args.save:
        # Every rank must call save_pretrained: the shards are gathered to rank 0, which writes a normal folder.
        model.save_pretrained(os.path.join(args.output_dir, "model"))
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "losses.json"), "w") as f:
            json.dump({"world_size": world_size, "local_fraction": held, "losses": losses}, f)
    return losses


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a saved model folder (save_pretrained) to train")
    p.add_argument("--output-dir", required=True, help="where losses.json (and, with --save, the model) is written")
    p.add_argument("--global-batch-size", type=int, default=4, help="sequences per step over all processes")
    p.add_argument("--max-steps", type=int, default=5, help="optimizer steps")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per synthetic sequence")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    p.add_argument("--save", action="store_true", help="gather the trained weights and save them to OUTPUT_DIR/model")
    return p.parse_args(argv)


if __name__ == "__main__":
    losses = train(parse_args())
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"losses": losses}))
    if dist.is_initialized():
        dist.destroy_process_group()
