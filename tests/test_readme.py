"""README.md is a front page: at most 250 lines, its Python example runs as pasted, its CI command is CI's, its links
point at files that exist, and it says nothing about "this machine" (a reader has another). The numbers it and the
docs quote are checked against their result JSONs, with their provenance, by tests/test_doc_numbers.py."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# "This machine" means nothing to a reader: a doc names the CPU (or GPU) a result ran on, as its JSON records it.
# (Provenance is welcome: "measured at commit X, before Y", "an earlier run".)
MACHINE_PHRASES = ("this machine", "this project's machines", "this cpu")


def test_docs_speak_of_the_project_not_of_its_machines():
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert len(docs) >= 9, docs
    for doc in docs:
        text = doc.read_text().lower()
        for phrase in MACHINE_PHRASES:
            assert phrase not in text, (doc.name, phrase)


def test_docs_relative_links_and_images_exist():
    checked = {}
    for doc in sorted((ROOT / "docs").glob("*.md")):
        targets = re.findall(r"\]\(((?:\.\./|\./)?[\w./-]+\.(?:md|png|py|json|sh))(?:#[^)]*)?\)", doc.read_text())
        for target in targets:
            assert (doc.parent / target).resolve().exists(), (doc.name, target)
        checked[doc.name] = len(targets)
    # the loop found the links: the docs that link to others still do
    assert sum(checked.values()) >= 4 and checked["performance.md"] >= 2 and checked["analysis.md"], checked


def test_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for phrase in MACHINE_PHRASES:
        assert phrase not in readme.lower(), phrase
    targets = re.findall(r"\]\(((?:docs|benchmarks|examples|scripts|tests)/[^)#]+)", readme)
    for target in targets:
        assert (ROOT / target).exists(), target
    assert len(targets) >= 15, targets  # the loop found the README's links


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
        value = getattr(defaults, name)
        assert f"| {value} |" in documented[name] or f"| `{value}` |" in documented[name], name
