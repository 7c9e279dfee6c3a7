"""Serving tests: DIFF models under vLLM's Transformers backend and its OpenAI-compatible server.

They run in the vLLM venv, never in the main one (vLLM pins its own transformers):

    bash scripts/setup_vllm.sh
    HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m pytest tests_serving -q

vLLM starts its engine processes with spawn; the test process only holds the client side, so the references computed
here with plain transformers (``generate()``) never share a process with vLLM's model. Every folder is built once per
session and every ``LLM`` once per module.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The package is installed in .venv-vllm (scripts/setup_vllm.sh: `pip install -e .`), for vLLM's spawned processes too;
# the main suite's helpers (tests/: its skip recorder) are on sys.path through pyproject.toml's pytest `pythonpath`.

# Before vLLM is imported: 1 GiB of KV cache (its smallest setting) instead of a share of the machine's memory.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The processes the tests start (convert.py for the SmolLM2 folders, ``vllm serve``) compute on one thread too, for the
# reason below: the V1 conversion took 98 s on two threads beside a busy core, 53 s on one. vLLM's CPU workers bind
# their own threads whatever this says (VLLM_CPU_OMP_THREADS_BIND).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

# The references (generate(), the SmolLM2 conversions) run on one thread: CI keeps both cores busy, and two OpenMP
# threads on a busy machine stall at every barrier (a 16-token generate() of a tiny model: 1.8 s on two threads
# beside another busy process, 0.09 s on one). vLLM's engines pick their own threads (one per rank, bound).
torch.set_num_threads(1)

from serving_utils import chat_references, serve_smollm2  # noqa: E402

from utils_skips import SkipRecorder  # noqa: E402

# Skips are never silent (tests/utils_skips.py): a module skipped whole (vLLM, the openai client, PEFT absent) and a
# skipped test that guards a feature the docs claim are listed at the end of the run and in CI's summary
# (scripts/test.sh: the serving run writes to the same $DIFFTRANSFORMER_SKIP_REPORT as the others, as venv "serving").
# Node-id prefix → the claim the test guards; each must match a collected test when the whole suite runs.
GUARDED_CLAIMS = {
    "tests_serving/test_vllm_native.py::test_two_tensor_parallel_ranks_equal_generate": "vLLM tensor parallelism: 2 "
    "ranks of the native model",
}
SKIPS = SkipRecorder(GUARDED_CLAIMS, Path(__file__).parent)


def pytest_collectreport(report):
    SKIPS.collectreport(report)


def pytest_runtest_logreport(report):
    SKIPS.runtest_logreport(report)


def pytest_collection_finish(session):
    SKIPS.check_guards(session)


def pytest_terminal_summary(terminalreporter):
    SKIPS.terminal_summary(terminalreporter)


@pytest.fixture(scope="session")
def smollm2_workdir(tmp_path_factory) -> Path:
    """Where the SmolLM2 folders go. ``DIFFTRANSFORMER_SERVING_CACHE=DIR`` keeps them in DIR between runs."""
    cache = os.environ.get("DIFFTRANSFORMER_SERVING_CACHE")
    return Path(cache) if cache else tmp_path_factory.mktemp("smollm2")


@pytest.fixture(scope="session")
def smollm2_v2_folder(smollm2_workdir) -> Path:
    """SmolLM2-135M-Instruct's exact V2 upcycle, converted from its GGUF file by convert.py."""
    return serve_smollm2.prepare_v2(smollm2_workdir)


@pytest.fixture(scope="session")
def smollm2_v1_folder(smollm2_workdir) -> Path:
    """SmolLM2-135M-Instruct's V1 upcycle (approximate: ``--v1-init duplicate``, the converter's choice for its 3 KV
    heads), converted from its GGUF file by convert.py."""
    return serve_smollm2.prepare_v1(smollm2_workdir)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_v2_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_v2_folder)


@pytest.fixture(scope="session")
def smollm2_v2_model(smollm2_v2_folder):
    """Our model (the package, plain transformers) for the references: float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    import difftransformer  # noqa: F401  (registers the Auto classes)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(smollm2_v2_folder, dtype=torch.float32).eval()
    assert type(model).__name__ == "DiffTransformerForCausalLM" and model.config.diff_version == 2
    return model


@pytest.fixture(scope="session")
def smollm2_chat_refs(smollm2_v2_model, smollm2_tokenizer):
    """Our greedy answers to serving_utils.CHAT_PROMPTS (chat template applied by the tokenizer)."""
    return chat_references(smollm2_v2_model, smollm2_tokenizer)


@pytest.fixture(scope="session")
def smollm2_v1_tokenizer(smollm2_v1_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_v1_folder)


@pytest.fixture(scope="session")
def smollm2_v1_chat_refs(smollm2_v1_folder, smollm2_v1_tokenizer):
    """The V1 upcycle's greedy answers (our model, plain transformers, float32), as ``smollm2_chat_refs``."""
    import torch
    from transformers import AutoModelForCausalLM

    import difftransformer  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(smollm2_v1_folder, dtype=torch.float32).eval()
    assert type(model).__name__ == "DiffTransformerForCausalLM" and model.config.diff_version == 1
    return chat_references(model, smollm2_v1_tokenizer)
