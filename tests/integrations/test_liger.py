"""Liger Kernel (``Trainer(use_liger_kernel=True)``): after the explicit ``integrations.register_liger()``
(docs/ecosystem.md, "Liger Kernel"; ``import difftransformer`` alone adds nothing to Liger's table:
tests/models/test_registration.py), transformers' ``apply_liger_kernel`` (what ``Trainer.train`` calls) patches our
RMSNorms, SwiGLU MLPs and the loss; what cannot be applied is warned at WARNING level. Liger's kernels are Triton, for
GPUs: here the patching is checked, not the kernels (the GPU check runs them through
``apply_liger_kernel_to_difftransformer``, which returns what it patched)."""

import pytest
import torch

pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (pip install liger-kernel)")
from transformers.integrations.liger import apply_liger_kernel  # noqa: E402
from transformers.testing_utils import CaptureLogger  # noqa: E402

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM, integrations  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(version=1, **overrides):
    config = DiffTransformerConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        diff_version=version,
        **overrides,
    )
    torch.manual_seed(0)
    return DiffTransformerForCausalLM(config).eval()


@pytest.mark.parametrize("version", [1, 2])
def test_trainers_liger_call_patches_norms_mlps_and_loss(version):
    from liger_kernel.transformers import LigerRMSNorm, LigerSwiGLUMLP
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    integrations.register_liger()
    integrations.register_liger()  # idempotent
    assert MODEL_TYPE_TO_APPLY_LIGER_FN["difftransformer"] is integrations.apply_liger_kernel_to_difftransformer
    model = tiny(version)
    apply_liger_kernel(model, {})  # Trainer.train with use_liger_kernel=True and no liger_kernel_config
    layers = model.model.layers
    norms = [model.model.norm] + [
        m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    assert all(n.forward.__func__ is LigerRMSNorm.forward for n in norms)
    assert all(layer.mlp.forward.__func__ is LigerSwiGLUMLP.forward for layer in layers)
    assert model.forward.__func__ is integrations._liger_fused_loss_forward


def test_fused_loss_forward_keeps_the_models_outputs_outside_training():
    model, reference = tiny(2), tiny(2)
    patched = integrations.apply_liger_kernel_to_difftransformer(model=model, rms_norm=False, swiglu=False)
    assert patched["fused_linear_cross_entropy"] == [""] and not patched["rms_norm"]
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, expected = model(ids, labels=ids), reference(ids, labels=ids)  # eval: the class's forward
    torch.testing.assert_close(got.logits, expected.logits)
    torch.testing.assert_close(got.loss, expected.loss)


def test_what_is_not_applied_is_warned():
    integrations.register_liger()  # apply_liger_kernel (Trainer's call) below reaches our function through the table
    logger = integrations.logger
    with CaptureLogger(logger) as captured:
        patched = apply_liger_kernel(
            tiny(1), {"rope": True, "rms_norm": False, "swiglu": False, "fused_linear_cross_entropy": False}
        )
    assert "not applied" in captured.out and "rope" in captured.out
    assert "nothing applied" in captured.out
    motif_like = tiny(1, hidden_act="poly_norm")
    with CaptureLogger(logger) as captured:
        patched = integrations.apply_liger_kernel_to_difftransformer(model=motif_like, fused_linear_cross_entropy=False)
    assert "swiglu" in captured.out and len(patched["rms_norm"]) == 5 and patched["swiglu"] == []
    with pytest.raises(ValueError, match="cannot both be True"):
        integrations.apply_liger_kernel_to_difftransformer(model=tiny(1), cross_entropy=True)
