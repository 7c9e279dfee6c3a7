"""README.md carries every docs/*.md section as written (the docs' examples are what the other tests execute), and
its Python example and CI command are the real ones."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_is_built_from_the_docs():
    result = subprocess.run([sys.executable, "scripts/build_readme.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


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


def test_readme_documents_every_config_field():
    """Each config field is a checkpoint-compatibility promise: the README's configuration table names all of them,
    with the default the class really has."""
    from difftransformer import DiffTransformerConfig

    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    documented = {name: row for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    fields = [f for f in DiffTransformerConfig.__annotations__ if not f.startswith("_")]
    assert fields and not [f for f in fields if f not in documented]
    defaults = DiffTransformerConfig()
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "diff_version", "lambda_std", "max_position_embeddings", "initializer_range"):
        assert f"| {getattr(defaults, name)} |" in documented[name], name
