"""Tensor-parallel, FSDP2 and tensor x FSDP2 training of a DiffTransformer through transformers' `DistributedConfig`.

`from_pretrained(..., distributed_config=DistributedConfig(tp_size=T, fsdp_size=F))` shards the model with the
config's `base_model_tp_plan` over `T` ranks (q/k/v column-wise, o_proj row-wise, the MLP likewise; V1's λ vectors
and per-head norm replicated, their gradients summed over the tensor-parallel group) and, when `F > 1`, with FSDP2
(`fully_shard`) over `F` data-parallel groups on top (`T = 1`: FSDP2 alone). The `T` ranks of a tensor-parallel group
see the same batch; the `F` groups take the slices of every global batch, so the loss trajectory equals a
single-process run on the whole batch. tests/integrations/test_distributed.py checks the losses, every gathered
parameter, and that the ranks of a tensor-parallel group hold identical replicated parameters, in float32 and (FSDP2)
bfloat16.

    python examples/distributed/train_parallel.py --model FOLDER --output-dir out                  # one process
    torchrun --nproc_per_node 2 examples/distributed/train_parallel.py --model FOLDER --output-dir out   # TP = 2
    torchrun --nproc_per_node 2 examples/distributed/train_parallel.py --model FOLDER --output-dir out
        --fsdp-size 2 --dtype bfloat16                                         # (one line) FSDP2 = 2, bfloat16
    torchrun --nproc_per_node 4 examples/distributed/train_parallel.py --model FOLDER --output-dir out
        --fsdp-size 2                                                          # (one line) TP = 2 within FSDP2 = 2

Works on CPU (gloo) and GPUs (nccl); transformers picks the backend from the machine.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from dist_common import synthetic_token_ids  # examples/distributed/dist_common.py, beside this file
from torch.distributed.tensor import DTensor, Replicate
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def load_parallel(model_path: str, world_size: int, fsdp_size: int, dtype: torch.dtype):
    """The model, tensor-parallel over `world_size / fsdp_size` ranks and FSDP2-sharded over `fsdp_size` groups
    (unsharded when `world_size == 1`)."""
    if world_size == 1:
        if dtype == torch.float64:  # a float64 reference: every parameter, λ included, cast to float64
            return AutoModelForCausalLM.from_pretrained(model_path).double()
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    if dtype == torch.float64:
        raise ValueError("--dtype float64 is for the single-process reference; launch it with python, not torchrun.")
    if world_size % fsdp_size:
        raise ValueError(f"--fsdp-size ({fsdp_size}) must divide the number of processes ({world_size}).")
    config = DistributedConfig(tp_size=world_size // fsdp_size, fsdp_size=fsdp_size)
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, distributed_config=config)


def data_parallel_rank(model, world_size: int) -> tuple[int, int]:
    """This rank's data-parallel coordinate and the number of data-parallel groups (the ranks of one tensor-parallel
    group share a coordinate: they compute on the same batch)."""
    if world_size == 1:
        return 0, 1
    fsdp = model._mesh_manager.get_mesh("fsdp")
    return fsdp.get_local_rank(), fsdp.size()


def replicated_gap(model) -> float:
    """The largest difference, over the ranks of this rank's tensor-parallel group, between the local values of every
    parameter that tensor parallelism replicates (not sharded over the group): 0.0 when the group agrees."""
    tp_mesh = model._mesh_manager.get_mesh("tp")
    group, size = tp_mesh.get_group(), tp_mesh.size()
    gap = torch.zeros(())
    for param in model.parameters():
        if isinstance(param, DTensor):
            names = param.device_mesh.mesh_dim_names or ()
            if "tp" in names and param.placements[names.index("tp")] != Replicate():
                continue  # sharded over the tensor-parallel group: each rank holds a different piece
            local = param.to_local()
        else:
            local = param
        local = local.detach().float().contiguous()
        copies = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(copies, local, group=group)
        gap = torch.maximum(gap, max((c - local).abs().max() for c in copies))
    return gap.item()


def train(args: argparse.Namespace) -> list[float]:
    """Train for `args.max_steps` AdamW steps; returns the global-batch loss of every step (identical on every rank)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model = load_parallel(args.model, world_size, args.fsdp_size, DTYPES[args.dtype])
    dp_rank, dp_size = data_parallel_rank(model, world_size)
    if args.global_batch_size % dp_size:
        raise ValueError(
            f"--global-batch-size ({args.global_batch_size}) must be divisible by --fsdp-size ({dp_size})."
        )
    data = synthetic_token_ids(
        args.global_batch_size * args.max_steps, args.seq_len, model.config.vocab_size, args.seed
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, eps=args.adam_eps, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(args.max_steps):
        batch = data[step * args.global_batch_size : (step + 1) * args.global_batch_size]
        local = batch.chunk(dp_size)[dp_rank]  # equal token counts per group: mean of local means = global mean
        loss = torch.zeros((), dtype=torch.float64)  # the float64 reference's loss stays float64
        for micro in local.chunk(args.grad_accum_steps):  # gradient accumulation: equal micro-batches
            micro_loss = model(input_ids=micro, labels=micro).loss / args.grad_accum_steps
            micro_loss.backward()
            loss += micro_loss.detach().double()
        optimizer.step()
        optimizer.zero_grad()
        if world_size > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the TP ranks of a group hold the same loss
        losses.append(loss.item())
    gap = replicated_gap(model) if world_size > 1 else 0.0
    if args.save:
        # Every rank must call save_pretrained: the shards are gathered to rank 0, which writes a normal folder.
        model.save_pretrained(os.path.join(args.output_dir, "model"))
    if int(os.environ.get("RANK", "0")) == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "losses.json"), "w") as f:
            json.dump({"world_size": world_size, "losses": losses, "replicated_gap": gap}, f)
    return losses


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a saved model folder (save_pretrained) to train")
    p.add_argument("--output-dir", required=True, help="where losses.json (and, with --save, the model) is written")
    p.add_argument("--fsdp-size", type=int, default=1, help="FSDP2 groups; tensor parallelism takes the other ranks")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype the model is loaded in")
    p.add_argument("--global-batch-size", type=int, default=4, help="sequences per step over all FSDP groups")
    p.add_argument("--max-steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    p.add_argument(
        "--grad-accum-steps", type=int, default=1, help="micro-batches per step (divides the per-group batch)"
    )
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
