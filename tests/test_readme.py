"""README.md is a front page: at most 250 lines, its Python example runs as pasted, its CI command is CI's, its links
point at files that exist, and it says nothing about the machines the project was developed on."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


MACHINE_AND_HISTORY_PHRASES = ("this machine", "this project's machines", "this cpu", "earlier run", "previous run",
                               "latest run", "earlier measurement")


def test_docs_speak_of_the_project_not_of_its_machines_or_history():
    for doc in sorted((ROOT / "docs").glob("*.md")):
        text = doc.read_text().lower()
        for phrase in MACHINE_AND_HISTORY_PHRASES:
            assert phrase not in text, (doc.name, phrase)
        assert "placeholder" not in text and "pending" not in text, doc.name


def test_docs_relative_links_and_images_exist():
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for target in re.findall(r"\]\(((?:\.\./|\./)?[\w./-]+\.(?:md|png|py|json|sh))(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).resolve().exists(), (doc.name, target)


def test_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "PENDING" not in readme  # every number is filled in from a committed result
    for phrase in MACHINE_AND_HISTORY_PHRASES:
        assert phrase not in readme.lower(), phrase
    for target in re.findall(r"\]\(((?:docs|benchmarks|examples|scripts|tests)/[^)#]+)", readme):
        assert (ROOT / target).exists(), target


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_readme_python_example_runs():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Python example\n\n```python\n(.*?)```", readme, re.S).group(1)
    namespace = {}
    cwd = Path.cwd()
    try:
        import os, tempfile

        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)
            exec(compile(block, "README.md", "exec"), namespace)
            assert (Path(tmp) / "my-diff-model" / "config.json").exists()
    finally:
        os.chdir(cwd)
    assert namespace["out"].attentions[0].shape == (1, 4, 12, 12)


def test_docs_document_every_config_field():
    """Each config field is a checkpoint-compatibility promise: docs/model.md's configuration table names all of them,
    with the default the class really has."""
    from difftransformer import DiffTransformerConfig

    doc = (ROOT / "docs" / "model.md").read_text()
    table = doc.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    documented = {name: row for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    fields = [f for f in DiffTransformerConfig.__annotations__ if not f.startswith("_")]
    assert fields and not [f for f in fields if f not in documented]
    defaults = DiffTransformerConfig()
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "diff_version", "lambda_std", "max_position_embeddings", "initializer_range"):
        assert f"| {getattr(defaults, name)} |" in documented[name], name
