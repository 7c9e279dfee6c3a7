"""Helpers for the docs/distributed.md tests: the doc's code blocks, and tiny model folders with a tokenizer."""

import re
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "distributed.md"
# Where the doc's examples expect a model (the main job's output folder, V1); tests substitute a V2 twin for it.
DOC_MODEL_V1 = "runs/difftransformer-stdlib/model"
DOC_MODEL_V2 = "runs/difftransformer-stdlib-v2/model"


def doc_blocks(language: str) -> list[str]:
    """The fenced code blocks of docs/distributed.md in `language`, in order (indented blocks included)."""
    text = DOC.read_text(encoding="utf-8")
    blocks = []
    for match in re.finditer(rf"^( *)```{language}\n(.*?)^\1```", text, flags=re.S | re.M):
        indent = len(match.group(1))
        blocks.append("".join(line[indent:] for line in match.group(2).splitlines(keepends=True)))
    return blocks


def word_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer knowing every word of `texts` (no training, no download)."""
    words = sorted({word for text in texts for word in text.split()})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def save_tiny_lm(
    folder, diff_version: int, tokenizer: PreTrainedTokenizerFast, num_hidden_layers: int = 4, seed: int = 0
):
    """Save a tiny random DiffTransformer sized for `tokenizer`, with the tokenizer, like the main job's folder."""
    torch.manual_seed(seed)
    config = DiffTransformerConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=8,
        num_key_value_heads=4 if diff_version == 1 else 2,
        diff_version=diff_version,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = DiffTransformerForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


# Unit roundoff of the dtypes a training run is compared in.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def assert_as_close_as_one_process(
    parallel: dict, single: dict, reference: dict, dtype: torch.dtype, what: str, initial: dict | None = None
):
    """Every tensor of a parallel run within the rounding error of the same run in one process.

    The error model is the one-process run's own: both compute the same float64-defined training in `dtype` and differ
    only in how float sums are ordered and split, so against the float64 run (`reference`) the parallel run's error on
    a tensor must be of the one-process run's size: at most 4 times the sum of
    * the one-process run's largest error on that tensor,
    * its largest error relative to a tensor's training update (`reference - initial`), over all tensors, times this
      tensor's update: how far rounding moves an optimizer step depends on the cancellation in each gradient, which is
      the model's, not the engine's (a tensor of one entry gives a single sample of it),
    * a rounding of the tensor's largest entry (for a tensor the one-process run happens to hit exactly).
    A gradient summed over the wrong ranks (rank-local λ, a norm over a shard) is off by orders of magnitude more."""
    assert parallel.keys() == single.keys() == reference.keys(), what
    unit = UNIT_ROUNDOFF[dtype]
    errors, updates = {}, {}
    for name, ref in reference.items():
        errors[name] = (single[name].double() - ref.double()).abs().max().item()
        updates[name] = 0.0 if initial is None else (ref.double() - initial[name].double()).abs().max().item()
    relative = max((errors[n] / updates[n] for n in reference if updates[n] > 0), default=0.0)
    for name, ref in reference.items():
        ref = ref.double()
        bound = 4 * (errors[name] + relative * updates[name] + unit * ref.abs().max().item())
        error = (parallel[name].double() - ref).abs().max().item()
        assert error <= bound, (
            f"{what}: {name} is {error:.3g} from the float64 run, one process {errors[name]:.3g} (bound {bound:.3g})"
        )
