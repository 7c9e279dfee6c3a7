"""Export (difftransformer/export.py; docs/ecosystem.md, "Tools"): torch.export through transformers'
``TorchExportableModuleForDecoderOnlyLM`` (its StaticCache is built from the config: ``num_key_value_heads`` ×
``head_dim`` per layer) for V1 and V2, stepped as one program instance, gives generate()'s greedy tokens; the ONNX
graph of torch's dynamo exporter, run by onnxruntime, gives the model's logits within float32 rounding. ExecuTorch is
not tested (README, "What is not tested")."""

import math

import pytest
import torch

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from difftransformer.export import export_for_decoding, export_onnx, greedy_decode

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 97


def tiny(version):
    config = DiffTransformerConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        diff_version=version,
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    torch.manual_seed(version)
    return DiffTransformerForCausalLM(config).eval()


@pytest.mark.parametrize("version", [1, 2])
def test_exported_program_decodes_as_generate(version):
    model = tiny(version)
    prompt = torch.tensor([[5, 9, 13, 17, 21]])
    expected = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)[:, prompt.shape[1] :]
    program = export_for_decoding(model, max_cache_len=32)
    got = greedy_decode(program, prompt, max_new_tokens=10)
    assert got.tolist() == expected.tolist()
    # The same program instance decodes a second prompt from position 0: the cache is overwritten, not appended to.
    other = torch.tensor([[40, 41, 42]])
    again = model.generate(other, max_new_tokens=6, do_sample=False, pad_token_id=0)[:, other.shape[1] :]
    assert greedy_decode(program, other, max_new_tokens=6).tolist() == again.tolist()


@pytest.mark.parametrize("version", [1, 2])
def test_onnx_logits_within_float32_rounding(tmp_path, version):
    """onnxruntime against the model, both float32. Error model: the two compute the same sums in different orders
    (matmul blocking, fused softmax); each of the L layers' and the head's contractions (length K ≤ 64) may differ by
    about √K·u relative (u = 2⁻²⁴), passed on through the layers: |Δlogit| ≤ 4·(L + 2)·√K·u·max|logit|."""
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install onnxruntime)")
    pytest.importorskip("onnxscript", reason="torch's dynamo ONNX exporter needs onnxscript (pip install onnxscript)")
    model = tiny(version)
    path = export_onnx(model, tmp_path / "model.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    config = model.config
    for shape in [(2, 11), (1, 23)]:  # batch and length other than the traced ones
        ids = torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(shape[1]))
        got = torch.from_numpy(session.run(["logits"], {"input_ids": ids.numpy()})[0])
        with torch.no_grad():
            expected = model(ids, use_cache=False).logits
        k = max(config.hidden_size, config.intermediate_size)
        bound = 4 * (config.num_hidden_layers + 2) * math.sqrt(k) * 2.0**-24 * expected.abs().max().item()
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= bound, ((got - expected).abs().max().item(), bound)
