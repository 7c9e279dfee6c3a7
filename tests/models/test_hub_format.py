"""Hub readiness without the network: the exact files a push uploads (through huggingface_hub's and transformers' own
push code, with only the HTTP calls replaced) form a folder that loads in a fresh process without the package."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import EntryNotFoundError

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from difftransformer.hub import (
    INSTALL_LINE,
    SOURCE_FILES,
    USAGE_PLACEHOLDER,
    check_hub_folder,
    model_card,
    push_to_hub,
    save_for_hub,
)
from difftransformer.research.data import get_tokenizer

IDS = [[1, 40, 41, 42, 43, 44, 45, 46]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return get_tokenizer(vocab_size=512, cache_dir=tmp_path_factory.mktemp("tokenizer-cache"))


def make_model(tokenizer, version):
    config = DiffTransformerConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        diff_version=version,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(version)
    return DiffTransformerForCausalLM(config).eval()


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """Replaces only the network calls of huggingface_hub (repo creation, commit, card download):
    repositories are folders under tmp_path/hub."""
    root = tmp_path / "hub"
    commits = []

    def create_repo(self, repo_id, *args, **kwargs):
        (root / repo_id).mkdir(parents=True, exist_ok=True)
        return SimpleNamespace(repo_id=repo_id)

    def create_commit(self, repo_id, operations, *args, **kwargs):
        commits.append((repo_id, sorted(op.path_in_repo for op in operations)))
        for op in operations:
            target = root / repo_id / op.path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(op.path_or_fileobj, target)
        return SimpleNamespace(oid="0" * 40, commit_url=f"file://{root / repo_id}")

    def no_remote_card(*args, **kwargs):
        raise EntryNotFoundError("no README.md in the (fake) remote repository")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    monkeypatch.setattr(ModelCard, "load", no_remote_card)
    return SimpleNamespace(root=root, commits=commits)


def test_save_for_hub_writes_every_file_and_a_card_stating_the_version(tokenizer, tmp_path):
    # docs/ecosystem.md, "Hub"
    for version in (1, 2):
        folder = save_for_hub(make_model(tokenizer, version), tmp_path / f"v{version}", tokenizer=tokenizer)
        names = {p.name for p in folder.iterdir()}
        assert {
            "config.json",
            "model.safetensors",
            "generation_config.json",
            "configuration_difftransformer.py",
            "modeling_difftransformer.py",
            "tokenizer.json",
            "tokenizer_config.json",
            "README.md",
        } <= names
        config = json.loads((folder / "config.json").read_text())
        assert config["diff_version"] == version
        assert {"AutoConfig", "AutoModel", "AutoModelForCausalLM"} <= config["auto_map"].keys()
        card = ModelCard((folder / "README.md").read_text())
        assert f"DIFF V{version}" in card.text and "2410.05258" in card.text and "@inproceedings" in card.text
        assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
        assert "custom_code" in card.data.tags and f"diff-v{version}" in card.data.tags


def test_check_hub_folder_names_what_is_missing(tokenizer, tmp_path):
    folder = save_for_hub(make_model(tokenizer, 1), tmp_path / "m", tokenizer=tokenizer)
    (folder / "modeling_difftransformer.py").unlink()
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"missing modeling_difftransformer\.py.*missing tokenizer\.json"):
        check_hub_folder(folder)


def test_model_card_rejects_other_models():
    with pytest.raises(ValueError, match="model_type"):
        model_card({"model_type": "llama"})


REMOTE_LOAD = textwrap.dedent("""
    import json, sys
    sys.modules["difftransformer"] = None  # the package is not installed here
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, pipeline
    for folder in sys.argv[1:]:
        expected = json.load(open(folder + ".expected.json"))
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        assert config.diff_version == expected["diff_version"]
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(expected["ids"])).logits
        torch.testing.assert_close(logits, torch.tensor(expected["logits"]), rtol=1e-5, atol=1e-5)
        base = AutoModel.from_pretrained(folder, trust_remote_code=True)
        assert type(base).__name__ == "DiffTransformerModel"
        assert GenerationConfig.from_pretrained(folder).eos_token_id == expected["eos"]
        if expected["tokenizer"]:
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
            generator = pipeline("text-generation", model=folder, trust_remote_code=True)
            text = generator("def f(", max_new_tokens=5, min_new_tokens=5, do_sample=False)[0]["generated_text"]
            prompt_length = len(tokenizer("def f(")["input_ids"])
            assert text.startswith("def f(") and len(tokenizer(text)["input_ids"]) > prompt_length
    print("ok")
""")


def _expected(model, folder, with_tokenizer):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(IDS)).logits
    folder.with_name(folder.name + ".expected.json").write_text(
        json.dumps(
            {
                "ids": IDS,
                "logits": logits.tolist(),
                "diff_version": model.config.diff_version,
                "eos": model.config.eos_token_id,
                "tokenizer": with_tokenizer,
            }
        )
    )


def test_pushed_folders_load_elsewhere_without_the_package(tokenizer, fake_hub, tmp_path):
    # 1. difftransformer.hub.push_to_hub: model + tokenizer + our model card in one commit.
    v1 = make_model(tokenizer, 1)
    push_to_hub(v1, "user/diff-v1", tokenizer=tokenizer)
    # 2. transformers' own model.push_to_hub (and tokenizer.push_to_hub), as users call them.
    v2 = make_model(tokenizer, 2)
    v2.push_to_hub("user/diff-v2")
    tokenizer.push_to_hub("user/diff-v2")

    pushed = dict(fake_hub.commits)
    assert pushed["user/diff-v1"] == sorted(
        [
            "README.md",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            *SOURCE_FILES,
        ]
    )
    assert {"configuration_difftransformer.py", "modeling_difftransformer.py", "kernels_difftransformer.py"} <= set(
        SOURCE_FILES
    )
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "configuration_difftransformer.py",
        "modeling_difftransformer.py",
    } <= set(fake_hub.commits[1][1])
    check_hub_folder(fake_hub.root / "user" / "diff-v1")
    assert "DIFF V1" in (fake_hub.root / "user" / "diff-v1" / "README.md").read_text()

    folders = [fake_hub.root / "user" / "diff-v1", fake_hub.root / "user" / "diff-v2"]
    _expected(v1, folders[0], True)
    _expected(v2, folders[1], True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}
    # Then the model card's usage snippet, as a reader pastes it, with stdin closed: it loads and generates without
    # transformers' "[y/N]" remote-code prompt and without its warning about a model of type "".
    out = subprocess.run(
        [sys.executable, "-c", REMOTE_LOAD + _card_snippet(folders[0]), *map(str, folders)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    printed = out.stdout[-2000:] + out.stderr[-3000:]
    assert out.returncode == 0, printed
    assert "ok\n" in out.stdout and out.stdout.split("ok\n", 1)[1].startswith("def main("), printed
    assert "[y/N]" not in out.stdout + out.stderr and "trust_remote_code" not in out.stdout + out.stderr, printed
    assert "to instantiate a model of type" not in out.stderr, printed


def test_save_for_hub_refuses_a_model_that_would_lose_its_source_files(tokenizer, tmp_path, monkeypatch):
    model = make_model(tokenizer, 1)
    monkeypatch.setattr(model, "_auto_class", None)
    with pytest.raises(ValueError, match="remote code"):
        save_for_hub(model, tmp_path / "m")


def _card_snippet(folder) -> str:
    """The Python block of a saved folder's model card, with the folder's path for its placeholder."""
    snippet = (folder / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    assert USAGE_PLACEHOLDER in snippet
    return snippet.replace(USAGE_PLACEHOLDER, str(folder))


def test_model_card_install_line_is_the_readme_install():
    """The card tells a reader to install the package the way the repository README's Install does (no package index
    serves it)."""
    card = model_card(DiffTransformerConfig(diff_version=2, num_key_value_heads=8)).text
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert any(line.split("#")[0].strip() == INSTALL_LINE for line in install.splitlines()), INSTALL_LINE
    assert f"`{INSTALL_LINE}`" in card and "pip install difftransformer" not in card
