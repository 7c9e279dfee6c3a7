"""Tensor-parallel inference: every process holds a slice of every layer (`base_model_tp_plan`).

`from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))` shards q/k/v (and V2's `lambda_proj`)
column-wise and `o_proj` row-wise, MLP likewise, embeddings by vocabulary rows. With the row order of docs/model.md
("What it computes") a contiguous shard holds whole KV groups, so every process computes whole differential heads; V1's
λ vectors and `subln` are replicated. `tp_size` must divide the number of KV groups (V1: `num_key_value_heads / 2`, V2:
`num_key_value_heads`).

    torchrun --nproc_per_node 2 examples/distributed/tp_generate.py --model FOLDER --prompt "def main("
    torchrun --nproc_per_node 2 examples/distributed/tp_generate.py --model FOLDER --input-ids 1 5 7 --save-logits
    out.pt

On GPUs it uses nccl, on CPU gloo. Rank 0 prints the generated continuation (greedy).
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.distributed import DistributedConfig

import difftransformer  # noqa: F401  (registers the model type with the Auto classes)


def load_tensor_parallel(model_path: str):
    """The model sharded over all processes of this torchrun job with the model's own tensor-parallel plan."""
    return AutoModelForCausalLM.from_pretrained(model_path, distributed_config=DistributedConfig(tp_plan="auto"))


def shard_report(model) -> dict:
    """Local (per-process) and global shapes of the first layer's attention weights: shows what is sharded."""
    attn = model.model.layers[0].self_attn
    report = {}
    for name, param in attn.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        report[name] = {"local": list(local.shape), "global": list(param.shape)}
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        sys.exit("Launch with torchrun, e.g. `torchrun --nproc_per_node 2 examples/distributed/tp_generate.py ...`.")
    model = load_tensor_parallel(args.model)
    tokenizer = None
    if args.prompt is not None:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    else:
        input_ids = torch.tensor([args.input_ids])
    input_ids = input_ids.to(model.device)
    with torch.no_grad():
        # full vocabulary on every rank (lm_head: colwise_gather_output), λ of every differential head
        outputs = model(input_ids, output_lambdas=True)
    generated = model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    new_tokens = generated[0, input_ids.shape[1] :].tolist()
    result = {"world_size": dist.get_world_size(), "generated_ids": new_tokens, "shards": shard_report(model)}
    if tokenizer is not None:
        result["text"] = tokenizer.decode(new_tokens)
    if dist.get_rank() == 0:
        if args.save_logits:
            torch.save(outputs.logits.cpu(), args.save_logits)
        if args.save_lambdas:
            torch.save([lam.cpu() for lam in outputs.lambdas], args.save_lambdas)
        print(json.dumps(result))
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a saved model folder (save_pretrained)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text prompt (needs a tokenizer in the model folder)")
    prompt.add_argument("--input-ids", type=int, nargs="+", help="prompt as token ids")
    p.add_argument("--max-new-tokens", type=int, default=8, help="greedy tokens to generate")
    p.add_argument("--save-logits", default=None, help="rank 0 saves the prompt's logits here (torch.save)")
    p.add_argument(
        "--save-lambdas", default=None, help="rank 0 saves the prompt's λ of every layer here (output_lambdas)"
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
