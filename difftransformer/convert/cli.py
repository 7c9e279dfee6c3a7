"""The command line of :mod:`difftransformer.convert`: ``difftransformer-convert`` (the console script) and
``python convert_scripts/convert.py`` (the same, from a checkout).

    difftransformer-convert --from llama --to difftransformer --diff-version 2 \\
        --input ./my-llama --output ./my-llama-diff-v2 --verify

Every option is explained by ``--help``; the conversions themselves live in the modules beside this one.
"""

import argparse
import sys
from pathlib import Path

from .api import SOURCES, TARGETS, convert
from .engine import DEFAULT_MAX_SHARD_SIZE, DTYPES, ConversionError
from .llama import V1_CALIBRATIONS, V1_INITS
from .microsoft import MICROSOFT_V1_MODULES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="difftransformer-convert",
        description=(
            "Convert a checkpoint folder into the difftransformer format (or a V1 model into transformers' DiffLlama). "
            "The source is checked key by key and shape by shape before anything is written; the result is written "
            "to a temporary folder beside --output and renamed into place at the end. See docs/convert.md."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--from",
        dest="source",
        required=True,
        choices=SOURCES,
        help="Source format. diffllama: transformers DiffLlamaForCausalLM folder (V1, exact). microsoft-v1 / "
        "microsoft-v2: full-model state dict whose attention modules are Microsoft's MultiheadDiffAttn / "
        "MultiheadFlashDiff1 / MultiheadFlashDiff2 (V1) or MultiheadFlashDiffV2 (V2), Llama names elsewhere, with a "
        "config.json in Microsoft's head convention (num_heads = differential heads, num_kv_heads). llama: any Llama "
        "/ Mistral / Qwen2 causal LM folder, or a Llama-family .gguf file (needs --diff-version). motif: a "
        "Motif-2.6B / Motif-2-12.7B folder (model_type Motif; DIFF V1 with grouped differential attention, exact). "
        "difftransformer: our own format (re-save with another dtype or shard size, or export with --to diffllama / "
        "duplicated / gda).",
    )
    parser.add_argument(
        "--to",
        dest="target",
        default="difftransformer",
        choices=TARGETS,
        help="Target format. difftransformer: our format, loadable with AutoModelForCausalLM (custom code and auto_map "
        "included). diffllama: transformers' DiffLlama, for V1 models only (subln folded into o_proj; needs "
        "subln_eps == rms_norm_eps). duplicated: a grouped-differential-attention model (num_noise_heads) written as "
        "a plain DIFF model, each noise head's query rows duplicated for its r signal heads (exact). gda: the way "
        "back, a plain model whose noise query rows come in identical copies written with --num-noise-heads noise "
        "heads (exact; refused when the copies differ).",
    )
    parser.add_argument(
        "--input",
        required=True,
        type=Path,
        help="Source folder (config.json plus safetensors, sharded or not), or with --from llama a .gguf file (read "
        "through transformers' GGUF loader, de-quantised to float32; its tokenizer, chat template and end-of-turn "
        "token come along).",
    )
    parser.add_argument(
        "--output",
        required=True,
        type=Path,
        help="Folder to create. Never the input or a folder containing it; a non-empty folder is refused unless "
        "--overwrite.",
    )
    parser.add_argument(
        "--diff-version",
        type=int,
        choices=(1, 2),
        default=None,
        help="Only for --from llama (required there): 2 = exact upcycling (query heads duplicated, λ = 0.5, o_proj "
        "doubled: same logits); 1 = approximate upcycling (see --v1-init; continued training is advised). Other "
        "sources imply their version.",
    )
    parser.add_argument(
        "--v1-init",
        default="auto",
        choices=V1_INITS,
        help="--from llama --diff-version 1 only. pair: adjacent source heads become the two maps of a differential "
        "head, same head counts (needs even num_key_value_heads). duplicate: every query and KV head is duplicated "
        "into both maps (any head layout; doubles query and KV heads, so the KV cache doubles), o_proj scaled so the "
        "output equals the source's wherever a head's output has its calibrated rms. auto: pair when possible.",
    )
    parser.add_argument(
        "--v1-calibration",
        default="auto",
        choices=V1_CALIBRATIONS,
        help="--v1-init duplicate only: the tokens the o_proj scales are calibrated on (the source model runs on "
        "them). auto: the embedded corpus (train split) through the source's tokenizer, random ids without one; "
        "corpus: require the tokenizer; random: random ids (--seed); none: no calibration (rms 1 assumed).",
    )
    parser.add_argument(
        "--v1-subln-eps",
        type=float,
        default=None,
        help="--from llama --diff-version 1 only: eps of V1's per-head RMSNorm (default: the source's rms_norm_eps, "
        "the paper's setting). A large value such as 1 gives the V1 layout with its per-head norm made nearly inert: "
        "with --v1-init duplicate the converted model then nearly equals the source, but it is not the paper's V1 "
        "(docs/convert.md); export to DiffLlama is then not exact.",
    )
    parser.add_argument(
        "--num-noise-heads",
        type=int,
        default=None,
        help="--to gda only (required there): the noise heads of the grouped result; it must divide the differential "
        "heads (num_attention_heads / 2 of the plain source), r = heads / num_noise_heads copies are merged into one.",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="dtype of the written weights; auto keeps the source's (config dtype, else its tensors'). V1 λ vectors "
        "are always stored in float32.",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="After converting, run the source and the result (float32, CPU) on a fixed 16-token prompt and print the "
        "max |logit difference|. Loads both models into memory; a .gguf source is compared as transformers' GGUF "
        "loader gives it. Microsoft sources cannot be run: only the result is checked (it loads and gives finite "
        "logits).",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace a non-empty --output folder (only once the new one is complete).",
    )
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="Accept pytorch_model.bin weights. Unpickling can run code: only for files you trust (they are read with "
        "torch.load(weights_only=True)).",
    )
    parser.add_argument(
        "--key-map",
        type=Path,
        default=None,
        help='Microsoft sources only: JSON file {"source prefix": "our prefix"} renaming the state dict into the '
        "default layout (Llama names, attention at model.layers.{l}.self_attn.); '{l}' stands for a layer index, the "
        "longest matching prefix wins, unmatched keys keep their names.",
    )
    parser.add_argument(
        "--microsoft-module",
        default=None,
        choices=MICROSOFT_V1_MODULES,
        help="microsoft-v1 only: the module that produced the weights (else 'attention_module' from config.json). "
        "Required under GQA (num_heads > num_kv_heads), where MultiheadDiffAttn checkpoints are refused (their key "
        "pairing is not DIFF V1).",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="--from llama --diff-version 1: seed of the N(0, lambda_std) λ initialisation (and of random calibration "
        "ids).",
    )
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="Largest safetensors shard (e.g. 5GB, 500MB or a byte count); larger models are split with an index. "
        "One shard is held in memory while it is written, so this also bounds the conversion's memory.",
    )
    parser.add_argument("--no-progress", action="store_true", help="Hide the progress bar over tensors.")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    max_shard_size = int(args.max_shard_size) if str(args.max_shard_size).isdigit() else args.max_shard_size
    try:
        result = convert(
            args.source,
            args.input,
            args.output,
            args.target,
            diff_version=args.diff_version,
            dtype=args.dtype,
            verify=args.verify,
            overwrite=args.overwrite,
            allow_pickle=args.allow_pickle,
            key_map=args.key_map,
            microsoft_module=args.microsoft_module,
            seed=args.seed,
            v1_init=args.v1_init,
            v1_calibration=args.v1_calibration,
            v1_subln_eps=args.v1_subln_eps,
            num_noise_heads=args.num_noise_heads,
            max_shard_size=max_shard_size,
            progress=not args.no_progress,
        )
    except ConversionError as err:
        message = " ".join(str(err).split())  # one line, whatever the message
        print(f"difftransformer-convert: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C; what it left is logged (a complete output, or the previous one untouched)
        print("difftransformer-convert: interrupted", file=sys.stderr)
        return 130
    # result.notes were logged (as warnings, to stderr) while converting.
    print(f"wrote {result.output} ({'exact' if result.exact else 'approximate'} conversion)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
