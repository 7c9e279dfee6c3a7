"""Pipeline-parallel inference: the decoder layers split evenly over the processes, one stage each.

`from_pretrained(..., distributed_config=DistributedConfig(pp_size=P))` keeps on process `i` only its slice of the
decoder layers (the first stage also the embeddings, the last the final norm and `lm_head`); each forward passes the
hidden states from stage to stage and the last stage broadcasts the logits, so `generate()` runs unchanged on every
process. transformers' pipeline parallelism is an inference-only even split (no training schedule).

    torchrun --nproc_per_node 2 examples/distributed/pp_generate.py --model FOLDER --prompt "def main("
    torchrun --nproc_per_node 2 examples/distributed/pp_generate.py --model FOLDER --prompt "import os" --prompt "x"
    torchrun --nproc_per_node 2 examples/distributed/pp_generate.py --model FOLDER --input-ids 1 5 7 --save-logits
    out.pt

Several `--prompt`s form one left-padded batch. On GPUs it uses nccl, on CPU gloo. Rank 0 prints the generated
continuations (greedy) as one JSON line.
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


def load_pipeline_parallel(model_path: str):
    """The model split over all processes of this torchrun job, one pipeline stage per process."""
    world_size = int(os.environ["WORLD_SIZE"])
    return AutoModelForCausalLM.from_pretrained(model_path, distributed_config=DistributedConfig(pp_size=world_size))


def stage_report(model) -> dict:
    """Which decoder layers this process holds (the others are placeholders without parameters)."""
    layers = model.model.layers
    owned = [i for i, layer in enumerate(layers) if any(True for _ in layer.parameters())]
    return {"rank": dist.get_rank(), "layers": owned, "num_layers": len(layers)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        sys.exit("Launch with torchrun, e.g. `torchrun --nproc_per_node 2 examples/distributed/pp_generate.py ...`.")
    model = load_pipeline_parallel(args.model).eval()
    tokenizer = None
    if args.prompt is not None:
        tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
        inputs = tokenizer(args.prompt, return_tensors="pt", padding=True)
        input_ids, attention_mask = inputs.input_ids, inputs.attention_mask
    else:
        input_ids = torch.tensor([args.input_ids])
        attention_mask = torch.ones_like(input_ids)
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits  # broadcast from the last stage
    generated = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=args.max_new_tokens, do_sample=False
    )
    new_tokens = generated[:, input_ids.shape[1] :].tolist()
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, stage_report(model))
    result = {"world_size": dist.get_world_size(), "generated_ids": new_tokens, "stages": stages}
    if tokenizer is not None:
        result["text"] = tokenizer.batch_decode(new_tokens)
    if dist.get_rank() == 0:
        if args.save_logits:
            torch.save(logits.cpu(), args.save_logits)
        print(json.dumps(result))
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a saved model folder (save_pretrained)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt", action="append", help="text prompt (needs a tokenizer in the model folder); repeat for a batch"
    )
    prompt.add_argument("--input-ids", type=int, nargs="+", help="one prompt as token ids")
    p.add_argument("--max-new-tokens", type=int, default=8, help="greedy tokens to generate")
    p.add_argument("--save-logits", default=None, help="rank 0 saves the prompts' logits here (torch.save)")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
