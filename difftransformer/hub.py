"""Hub readiness: the exact folder a push uploads, a model card that says what the model is, and the push itself.

A Differential Transformer folder must load where this package is not installed, through the Hub's remote-code
format: ``config.json`` with ``auto_map``, the source files (``modeling_difftransformer.py`` and the files it imports
relatively: ``SOURCE_FILES``), the weights,
``generation_config.json``, the tokenizer, and a model card (``README.md``) stating the DIFF version and citing the
paper (arXiv 2410.05258). :func:`save_for_hub` writes that folder with transformers' ``save_pretrained`` and
``huggingface_hub.ModelCard``; :func:`check_hub_folder` names anything missing; :func:`push_to_hub` uploads the folder
in one commit, the way transformers' own ``push_to_hub`` does (save to a temporary folder, ``HfApi.create_commit``),
with the tokenizer and our card in the same commit.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from transformers.dynamic_module_utils import get_relative_import_files

PAPER_URL = "https://arxiv.org/abs/2410.05258"
CITATION = """@inproceedings{ye2025differential,
  title     = {Differential Transformer},
  author    = {Tianzhu Ye and Li Dong and Yuqing Xia and Yutao Sun and Yi Zhu and Gao Huang and Furu Wei},
  booktitle = {The Thirteenth International Conference on Learning Representations (ICLR)},
  year      = {2025},
  url       = {https://arxiv.org/abs/2410.05258}
}"""
# The remote code a saved folder carries: the modeling file and every file it imports relatively, as transformers'
# save_pretrained copies them.
SOURCE_FILES = tuple(
    sorted(
        {"modeling_difftransformer.py"}
        | {
            Path(name).name
            for name in get_relative_import_files(Path(__file__).with_name("modeling_difftransformer.py"))
        }
    )
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# The usage snippet's placeholder for the folder or Hub repository id the reader loads from.
USAGE_PLACEHOLDER = "<this folder or repo id>"
# How the package is installed (the line of the repository README's Install): it is served by no package index.
INSTALL_LINE = 'pip install -e ".[train,gguf]"'

_VERSION_TEXT = {
    1: (
        "DIFF V1 (the paper's differential attention): every head computes two softmax maps and subtracts them, "
        "`(softmax(Q1 K1ᵀ/√d) − λ · softmax(Q2 K2ᵀ/√d)) V`, with one learnable scalar λ per layer "
        "(re-parameterised as `exp(λq1·λk1) − exp(λq2·λk2) + λinit`), a per-head RMSNorm and `(1 − λinit)` scaling."
    ),
    2: (
        "DIFF V2 (Ye, Dong, Sun, Wei, 2026): adjacent query heads over one shared KV head form a pair, "
        "`o_h = a_2h − sigmoid(x W_λ)_h · a_2h+1`, with λ computed per token and head; no per-head norm. "
        "Its KV cache and attention kernels are a standard GQA model's."
    ),
}


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json: save the model there first (model.save_pretrained).")
    return json.loads(path.read_text(encoding="utf-8"))


def model_card(config, *, model_name: str | None = None, training_note: str | None = None, license: str | None = None):
    """A ``huggingface_hub.ModelCard`` for a difftransformer model: DIFF version, sizes, usage, citation.

    ``config`` is a ``DiffTransformerConfig`` or its ``config.json`` dict. The metadata header marks the repository
    as ``custom_code`` (the Hub shows the ``trust_remote_code`` notice) with ``pipeline_tag: text-generation``.
    """
    from huggingface_hub import ModelCard, ModelCardData

    cfg = config if isinstance(config, dict) else config.to_dict()
    if cfg.get("model_type") != "difftransformer":
        raise ValueError(
            f"`config` must be a difftransformer config (model_type 'difftransformer'), got {cfg.get('model_type')!r}."
        )
    version = cfg.get("diff_version", 1)
    if version not in _VERSION_TEXT:
        raise ValueError(f"`diff_version` must be one of {tuple(_VERSION_TEXT)}, got {version!r}.")
    name = model_name or f"DiffTransformer (DIFF V{version})"
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        tags=["difftransformer", "differential-transformer", f"diff-v{version}", "custom_code", "text-generation"],
    )
    hq, hkv, noise = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg.get("num_noise_heads")
    heads = (
        f"| differential heads (`num_attention_heads / 2`) | {hq // 2} |\n"
        if noise in (None, hq // 2)
        else f"| differential heads / noise heads (grouped: `num_noise_heads`) | {hq - noise} / {noise} |\n"
    )
    sizes = (
        f"| field | value |\n|---|---|\n| `diff_version` | {version} |\n| layers | {cfg['num_hidden_layers']} |\n"
        f"| hidden size | {cfg['hidden_size']} |\n{heads}"
        f"| query heads / KV heads | {hq} / {hkv} |\n| head dim | {cfg.get('head_dim')} |\n"
        f"| vocabulary | {cfg['vocab_size']} |\n"
    )
    body = f"""# {name}

A **Differential Transformer** language model, architecture **DIFF V{version}**
([Ye et al., *Differential Transformer*, arXiv 2410.05258]({PAPER_URL})), in the Hugging Face `transformers`
format of the `difftransformer` package.

{_VERSION_TEXT[version]}

{sizes}
{training_note + chr(10) if training_note else ""}
## Usage

The repository carries its modeling code, so it loads without the `difftransformer` package:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

repo = "{USAGE_PLACEHOLDER}"
model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)
# The tokenizer reads the same config.json, which names the custom code: trust_remote_code again, or transformers asks.
tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
out = model.generate(**tokenizer("def main(", return_tensors="pt"), max_new_tokens=32)
print(tokenizer.decode(out[0], skip_special_tokens=True))
```

With the `difftransformer` package installed, `import difftransformer` registers the classes and
`trust_remote_code` is not needed. It is not on PyPI: install it from a clone of its repository, with its README's
Install line `{INSTALL_LINE}`.

## Citation

```bibtex
{CITATION}
```
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def write_model_card(folder: str | os.PathLike, config=None, **card_kwargs) -> Path:
    """Write ``README.md`` (see :func:`model_card`) into ``folder``; the config is read from the folder if omitted."""
    folder = Path(folder)
    card = model_card(config if config is not None else _read_config(folder), **card_kwargs)
    path = folder / "README.md"
    card.save(path)
    return path


def check_hub_folder(folder: str | os.PathLike, require_tokenizer: bool = True) -> None:
    """Raise ``ValueError`` naming every file or ``auto_map`` entry a remote-code load of ``folder`` would miss."""
    folder = Path(folder)
    config = _read_config(folder)
    problems = []
    auto_map = config.get("auto_map") or {}
    for key in ("AutoConfig", "AutoModel", "AutoModelForCausalLM"):
        if key not in auto_map:
            problems.append(f"config.json auto_map lacks {key!r}")
    expected = list(SOURCE_FILES) + ["generation_config.json", "README.md"]
    if require_tokenizer:
        expected += list(TOKENIZER_FILES)
    problems += [f"missing {name}" for name in expected if not (folder / name).is_file()]
    if not any(folder.glob("*.safetensors")):
        problems.append("missing weights (*.safetensors)")
    if problems:
        raise ValueError(f"{folder} is not Hub-ready: " + "; ".join(problems) + ".")


def save_for_hub(model, folder: str | os.PathLike, tokenizer=None, **card_kwargs) -> Path:
    """Write the exact folder :func:`push_to_hub` uploads: weights, config with ``auto_map``, both source files,
    generation config, tokenizer (if given) and model card; then :func:`check_hub_folder` it."""
    folder = Path(folder)
    if getattr(model, "_auto_class", None) is None:
        raise ValueError(
            "The model class is not marked for remote code, so save_pretrained would not copy the source files: "
            "create it after `import difftransformer` (or load it with trust_remote_code=True)."
        )
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    write_model_card(folder, model.config, **card_kwargs)
    check_hub_folder(folder, require_tokenizer=tokenizer is not None)
    return folder


def push_to_hub(
    model,
    repo_id: str,
    tokenizer=None,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload DiffTransformer model",
    **card_kwargs,
):
    """Create ``repo_id`` if needed and upload :func:`save_for_hub`'s folder as one commit. Needs the network.

    Like transformers' ``push_to_hub`` (save to a temporary folder, then ``HfApi.create_commit`` with one
    ``CommitOperationAdd`` per file), but the tokenizer and our model card travel in the same commit.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as tmp:
        save_for_hub(model, tmp, tokenizer=tokenizer, **card_kwargs)
        operations = [
            CommitOperationAdd(path_in_repo=path.relative_to(tmp).as_posix(), path_or_fileobj=str(path))
            for path in sorted(Path(tmp).rglob("*"))
            if path.is_file()
        ]
        return api.create_commit(repo_id=repo_id, operations=operations, commit_message=commit_message)


def update_remote_code(folder: str | os.PathLike, check: bool = False) -> list[str]:
    """Replace the source files of a saved folder by this package's, and complete its ``auto_map``.

    A folder carries the modeling code of the release that saved it, and ``trust_remote_code=True`` runs that copy.
    Code saved before difftransformer followed transformers 5.24's renaming of the cache argument decodes wrongly
    there (every step without its past); this brings it up to date without touching the weights. Each file is written
    to a temporary name and moved into place, so an interrupted update leaves every file whole. With ``check=True``
    nothing is written. Returns the names of the files that differ(ed) from this package's.
    """
    from .modeling_difftransformer import AUTO_MAP

    folder = Path(folder)
    config = _read_config(folder)
    if config.get("model_type") != "difftransformer":
        raise ValueError(
            f"{folder}/config.json has model_type {config.get('model_type')!r}, not 'difftransformer': not a folder "
            "this package saved (convert other checkpoints with difftransformer-convert)."
        )
    package = Path(__file__).resolve().parent
    stale = [
        name
        for name in SOURCE_FILES
        if not (folder / name).is_file() or (folder / name).read_bytes() != (package / name).read_bytes()
    ]
    auto_map = {
        "AutoConfig": "configuration_difftransformer.DiffTransformerConfig",
        **{auto: f"modeling_difftransformer.{name}" for auto, name in AUTO_MAP.items()},
    }
    if (config.get("auto_map") or {}) != {**(config.get("auto_map") or {}), **auto_map}:
        stale.append("config.json")
    if check or not stale:
        return stale
    for name in stale:
        target = folder / name
        data = (
            (package / name).read_bytes()
            if name != "config.json"
            else (
                json.dumps(
                    {**config, "auto_map": {**(config.get("auto_map") or {}), **auto_map}}, indent=2, sort_keys=True
                )
                + "\n"
            ).encode("utf-8")
        )
        tmp = target.with_name(f".{name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)
    return stale


def main_update_code(argv=None) -> int:
    """``difftransformer-update-code FOLDER [FOLDER ...]``: the console script of :func:`update_remote_code`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="difftransformer-update-code",
        description="Replace the remote code (configuration/modeling/kernels_difftransformer.py) of folders saved by "
        "difftransformer with this installed release's, so they load correctly with trust_remote_code=True on "
        "the transformers releases this release supports. Weights are not touched.",
    )
    parser.add_argument(
        "folders",
        nargs="+",
        help="folders written by save_pretrained, difftransformer-convert or "
        "the upcycling example (download a Hub model's folder first, update it, push it again)",
    )
    parser.add_argument("--check", action="store_true", help="only report which files are out of date (exit 1 if any)")
    args = parser.parse_args(argv)
    outdated = False
    for folder in args.folders:
        try:
            stale = update_remote_code(folder, check=args.check)
        except ValueError as err:
            print(f"difftransformer-update-code: {err}")
            return 2
        outdated |= bool(stale)
        verb = "out of date" if args.check else "updated"
        print(f"{folder}: {verb}: {', '.join(stale)}" if stale else f"{folder}: up to date")
    return 1 if args.check and outdated else 0


__all__ = [
    "CITATION",
    "INSTALL_LINE",
    "USAGE_PLACEHOLDER",
    "check_hub_folder",
    "model_card",
    "push_to_hub",
    "save_for_hub",
    "update_remote_code",
    "write_model_card",
]


if __name__ == "__main__":
    raise SystemExit(main_update_code())
