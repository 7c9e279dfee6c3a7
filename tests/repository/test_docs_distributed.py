"""docs/distributed.md stays true: its Python snippets run, its commands parse with the scripts they name.

The snippets run verbatim in a temporary folder holding tiny models (with tokenizers) at the paths the doc uses.
The 2-process commands are run for real, with the same scripts and options and test-sized models, by
tests/integrations/test_distributed.py, tests/integrations/test_deepspeed.py and
tests/integrations/test_pipeline_parallel.py (checked here: every option of such a command appears in a test that
launches its script); the lm-eval commands by tests/integrations/test_lm_eval.py.
"""

import contextlib
import importlib
import io
import json
import re
import shlex

import pytest
import torch

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from utils_distributed import DOC, DOC_MODEL_V1, DOC_MODEL_V2, REPO, doc_blocks, save_tiny_lm, word_tokenizer


def _snippet(keyword: str) -> str:
    return next(block for block in doc_blocks("python") if keyword in block)


@pytest.fixture
def doc_workdir(tmp_path, monkeypatch):
    """A folder with tiny V1 and V2 models (and tokenizers) where the doc expects the main job's outputs."""
    tokenizer = word_tokenizer(["def fibonacci(n): add(a, b): import os class Stack: return None"])
    save_tiny_lm(tmp_path / DOC_MODEL_V1, diff_version=1, tokenizer=tokenizer)
    save_tiny_lm(tmp_path / DOC_MODEL_V2, diff_version=2, tokenizer=tokenizer)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/distributed.md", "exec"), {"__name__": "__doc_snippet__"})
    return out.getvalue()


def _run_offload_snippet(model_path: str) -> tuple[dict, float]:
    """Run the offload snippet on `model_path`; its device map and the share of the weights it keeps in RAM."""
    namespace = {"__name__": "__doc_snippet__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(
            compile(_snippet("offload_folder").replace(DOC_MODEL_V1, model_path), "docs/distributed.md", "exec"),
            namespace,
        )
    assert "def fibonacci(n):" in out.getvalue()  # the prompt, followed by the generated text
    model = namespace["model"]
    nbytes = {p: p.numel() * p.element_size() for p in model.parameters()}
    in_ram = sum(n for p, n in nbytes.items() if p.device.type != "meta")  # offloaded weights wait on "meta"
    assert in_ram <= namespace["budget"]  # the budget holds
    return model.hf_device_map, in_ram / sum(nbytes.values())


def _doc_ram_share(sentence_start: str) -> int:
    """The percentage the doc states after `sentence_start` in its offload paragraph."""
    return int(re.search(re.escape(sentence_start) + r"[^%]*?(\d+)%", " ".join(DOC.read_text().split())).group(1))


@pytest.mark.parametrize("model_path", [DOC_MODEL_V1, DOC_MODEL_V2])
def test_offload_snippet_keeps_what_the_doc_says_in_ram_for_a_tiny_model(doc_workdir, model_path):
    device_map, share = _run_offload_snippet(model_path)
    in_ram = sorted(name for name, device in device_map.items() if device == "cpu")
    assert in_ram == ["model.embed_tokens", "model.layers.0"], device_map
    assert "disk" in device_map.values()
    assert round(100 * share) == _doc_ram_share("a 4-layer model of width 64")


def test_offload_snippet_keeps_what_the_doc_says_in_ram_at_the_main_jobs_default_size(tmp_path, monkeypatch):
    # examples/train.py's default model (its argument defaults), random weights, at the path the doc uses.
    tokenizer = word_tokenizer(["def fibonacci(n):"])
    torch.manual_seed(0)
    config = DiffTransformerConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    DiffTransformerForCausalLM(config).save_pretrained(tmp_path / DOC_MODEL_V1)
    tokenizer.save_pretrained(tmp_path / DOC_MODEL_V1)
    monkeypatch.chdir(tmp_path)
    device_map, share = _run_offload_snippet(DOC_MODEL_V1)
    assert [name for name, device in device_map.items() if device == "cpu"] == ["model.embed_tokens"], device_map
    assert round(100 * share) == _doc_ram_share("default model (width 256, 4 layers, vocabulary 4096)")


@pytest.mark.parametrize("model_path", [DOC_MODEL_V1, DOC_MODEL_V2])
def test_continuous_batching_snippet_runs(doc_workdir, model_path):
    printed = _run(_snippet("generate_batch").replace(DOC_MODEL_V1, model_path))
    assert len(printed.strip().splitlines()) == 3  # one line per request


def test_deepspeed_configs_are_zero2_and_a_zero3_that_saves_loadable_weights():
    zero2, zero3 = map(json.loads, doc_blocks("json"))
    assert (zero2["zero_optimization"]["stage"], zero3["zero_optimization"]["stage"]) == (2, 3)
    # Without it ZeRO-3's save_model writes no weights that from_pretrained can load.
    assert zero3["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def _launch_commands() -> list[list[str]]:
    return [
        shlex.split(line)
        for block in doc_blocks("bash")
        for line in block.splitlines()
        if line.startswith(("torchrun ", "accelerate launch "))
    ]


def test_every_two_or_four_process_command_is_run_by_a_test_and_the_others_are_for_8_gpus():
    """A 2- or 4-process command's script is launched by a test with every option the command uses; the rest are the
    8-GPU commands that the doc says are not run."""
    tests = {path.name: path.read_text() for path in (REPO / "tests").rglob("test_*.py")}
    for argv in _launch_commands():
        script = next(arg for arg in argv if arg.startswith("examples/distributed/")).rsplit("/", 1)[-1]
        processes = argv[argv.index("--nproc_per_node") + 1] if "--nproc_per_node" in argv else None
        if processes not in ("2", "4"):
            assert processes == "8" or argv[argv.index("--num_processes") + 1] == "8", argv
            continue
        launching = [
            text for name, text in tests.items() if script in text and ("torchrun(" in text or "launch(" in text)
        ]
        assert launching, f"no test launches {script}"
        for option in (arg for arg in argv[argv.index(next(a for a in argv if a.endswith(script))) + 1 :]):
            if option.startswith("--"):
                assert any(f'"{option}"' in text for text in launching), (
                    f"{option} of {' '.join(argv)} is run by no test"
                )


def test_every_example_command_parses_with_its_script():
    """Each `torchrun`/`accelerate launch` line of the doc names an existing script and arguments it accepts."""
    commands = _launch_commands()
    assert len(commands) >= 8
    for argv in commands:
        script = next(i for i, arg in enumerate(argv) if arg.startswith("examples/distributed/"))
        assert (REPO / argv[script]).is_file(), argv
        module = importlib.import_module(argv[script].rsplit("/", 1)[-1].removesuffix(".py"))
        module.parse_args(argv[script + 1 :])  # SystemExit (argparse error) fails the test
