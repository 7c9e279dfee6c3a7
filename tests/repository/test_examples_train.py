"""The main demo, examples/train.py: --help, a --smoke run through the CLI, and interrupt → resume equivalence."""

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("difftransformer_examples_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_script = _load_script()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokenizer-cache"))


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, tokenizer_cache):
    """The smoke command, uninterrupted, in a fresh process, writing to the default --output-dir under a scratch
    working directory: the reference for the resume test and the model the docs examples use."""
    cwd = tmp_path_factory.mktemp("cli")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--tokenizer-cache", tokenizer_cache, "--threads", "1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cwd / "runs" / "difftransformer-stdlib", proc.stdout + proc.stderr


def test_help_explains_every_flag():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    parser = train_script.build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help text"
            assert action.option_strings[0] in proc.stdout


def test_smoke_cli_trains_reports_saves_samples_and_plots(cli_run):
    out, log = cli_run
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["global_step"] == metrics["max_steps"] == train_script.SMOKE["max_steps"]
    assert not metrics["interrupted"]
    assert 0 < metrics["validation_loss"] < 10 and f"validation loss {metrics['validation_loss']:.4f}" in log
    assert "%|" in log  # tqdm progress bar
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # telemetry: its plot, and one summary line per probe on the terminal instead of a dictionary of per-layer values
    assert (out / "telemetry.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[diffattn] " in log and "max logit map 1" in log and "layer_0" not in log
    sample = (out / "sample.txt").read_text()
    assert sample.startswith("def ") and len(sample) > len("def ")
    # The saved folder is a complete model + tokenizer: generation and the reported loss reproduce.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from difftransformer.research.data import build_blocks, corpus_texts

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    assert model.config.diff_version == 1 and len(tokenizer) == model.config.vocab_size
    blocks = build_blocks(
        tokenizer,
        corpus_texts("validation", train_script.SMOKE["validation_max_chars"]),
        train_script.SMOKE["block_size"],
        train_script.SMOKE["eval_blocks"],
    )
    with torch.no_grad():
        losses = [model(input_ids=b, labels=b).loss for b in blocks.split(train_script.SMOKE["batch_size"])]
    assert torch.stack(losses).mean().item() == pytest.approx(metrics["validation_loss"], rel=1e-4)
    assert "DIFF V1" in (out / "model" / "README.md").read_text()


class _SigintAt:
    """Sends this process a real SIGINT (what Ctrl-C does) as step ``step + 1`` begins."""

    def __init__(self, step):
        from transformers import TrainerCallback

        target = step

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == target:
                    os.kill(os.getpid(), signal.SIGINT)

        self.callback = _Callback()


def test_interrupted_run_resumes_to_the_same_model(cli_run, tmp_path, tokenizer_cache):
    reference, _ = cli_run
    argv = ["--smoke", "--output-dir", str(tmp_path / "run"), "--tokenizer-cache", tokenizer_cache]
    assert torch.get_num_threads() == 1  # as the reference's --threads 1: same reduction order, same numbers
    handler = signal.getsignal(signal.SIGINT)  # the default one, or SIG_IGN in a background job
    first = train_script.run(train_script.parse_args(argv), callbacks=[_SigintAt(step=3).callback])
    assert first["interrupted"] and first["global_step"] == 4
    # The signal handler saved a checkpoint at a step that is not a --save-steps multiple.
    assert (tmp_path / "run" / "checkpoint-4").is_dir() and not (tmp_path / "run" / "model").exists()
    assert signal.getsignal(signal.SIGINT) is handler  # handler restored

    second = train_script.run(train_script.parse_args(argv))
    assert not second["interrupted"] and second["global_step"] == train_script.SMOKE["max_steps"]
    resumed = load_file(tmp_path / "run" / "model" / "model.safetensors")
    expected = load_file(reference / "model" / "model.safetensors")
    assert resumed.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(resumed[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert second["validation_loss"] == pytest.approx(
        json.loads((reference / "metrics.json").read_text())["validation_loss"], rel=1e-5
    )


def test_resuming_with_different_settings_is_refused(tmp_path, tokenizer_cache):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoint-3").mkdir(parents=True)
    args = train_script.parse_args(["--smoke", "--output-dir", str(run_dir), "--tokenizer-cache", tokenizer_cache])
    (run_dir / "run_args.json").write_text(json.dumps({**vars(args), "hidden_size": 64}))
    with pytest.raises(SystemExit, match="hidden_size: checkpoint 64 vs now 32"):
        train_script.run(args)


def test_bad_flags_are_rejected():
    with pytest.raises(SystemExit):
        train_script.parse_args(["--diff-version", "3"])
    with pytest.raises(SystemExit):
        train_script.parse_args(["--max-steps", "0"])


def test_smoke_keeps_explicit_flags():
    args = train_script.parse_args(["--smoke", "--max-steps=9", "--diff-version", "2"])
    assert args.max_steps == 9 and args.diff_version == 2 and args.hidden_size == train_script.SMOKE["hidden_size"]


def _python_blocks(markdown: str) -> list[str]:
    blocks, inside = [], None
    for line in markdown.splitlines():
        if inside is None and line.strip() == "```python":
            inside = []
        elif inside is not None and line.strip() == "```":
            blocks.append("\n".join(inside))
            inside = None
        elif inside is not None:
            inside.append(line)
    return blocks


def test_docs_ecosystem_examples_run(cli_run, tmp_path, monkeypatch):
    """Every Python block of docs/ecosystem.md, as written, in the folder the main demo (--smoke) ran in."""
    from types import SimpleNamespace

    from huggingface_hub import HfApi

    run_dir, _ = cli_run
    blocks = _python_blocks((REPO / "docs" / "ecosystem.md").read_text())
    assert len(blocks) >= 6
    monkeypatch.chdir(run_dir.parent.parent)
    monkeypatch.setenv("DIFFTRANSFORMER_CACHE", str(tmp_path / "cache"))
    uploaded = {}  # the Hub's HTTP API, replaced by a record of what would be committed
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: SimpleNamespace(repo_id=repo_id))
    monkeypatch.setattr(
        HfApi,
        "create_commit",
        lambda self, repo_id, operations, **kw: uploaded.update(
            {repo_id: sorted(op.path_in_repo for op in operations)}
        ),
    )
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/ecosystem.md[python block {i}]", "exec"), {"__name__": "__main__"})
    # What the blocks promise exists.
    assert (Path("runs/finetune/final") / "model.safetensors").is_file()
    assert (Path("runs/lora/adapter") / "adapter_model.safetensors").is_file()
    assert (Path("runs/lora/merged") / "modeling_difftransformer.py").is_file()
    assert Path("runs/telemetry/telemetry.png").stat().st_size > 10_000
    assert sorted(p.name for p in Path("runs/hub-upload").iterdir()) == uploaded["your-name/difftransformer-stdlib"]


def test_smoke_run_of_diff_v2(tmp_path, tokenizer_cache):
    metrics = train_script.run(
        train_script.parse_args(
            [
                "--smoke",
                "--diff-version",
                "2",
                "--output-dir",
                str(tmp_path / "v2"),
                "--tokenizer-cache",
                tokenizer_cache,
            ]
        )
    )
    assert not metrics["interrupted"] and metrics["diff_version"] == 2 and math.isfinite(metrics["validation_loss"])
    config = json.loads((tmp_path / "v2" / "model" / "config.json").read_text())
    assert config["diff_version"] == 2
    assert "DIFF V2" in (tmp_path / "v2" / "model" / "README.md").read_text()
