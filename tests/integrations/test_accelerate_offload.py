"""accelerate big-model inference: `device_map="auto"` with a memory budget that pushes part of a saved model to disk.

On a machine without an accelerator the only offload target below RAM is the disk: layers that do not fit in
`max_memory["cpu"]` stay on the meta device and accelerate's hooks load them from the checkpoint (or
`offload_folder`) for each forward. The model must generate exactly what the in-memory model generates, and
`_no_split_modules` must keep every decoder layer whole.
"""

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

import difftransformer  # noqa: F401
from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM

pytest.importorskip(
    "accelerate",
    reason="accelerate is not installed, though the package requires it (pyproject.toml): this venv is incomplete",
)


def _tiny(diff_version: int) -> DiffTransformerForCausalLM:
    torch.manual_seed(0)
    config = DiffTransformerConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        diff_version=diff_version,
        eos_token_id=None,
        pad_token_id=0,
    )
    return DiffTransformerForCausalLM(config).eval()


def _nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.mark.parametrize("diff_version", [1, 2])
def test_disk_offload_loads_and_generates_like_the_plain_model(tmp_path, diff_version):
    model = _tiny(diff_version)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    # RAM for about three quarters of the weights: the embeddings and the first layers stay, the rest goes to disk.
    budget = int(0.75 * _nbytes(model))
    offloaded = AutoModelForCausalLM.from_pretrained(
        folder, device_map="auto", max_memory={"cpu": budget}, offload_folder=tmp_path / "offload"
    ).eval()

    device_map = offloaded.hf_device_map
    layer_devices = {k: v for k, v in device_map.items() if k.startswith("model.layers.")}
    assert "cpu" in layer_devices.values() and "disk" in layer_devices.values(), device_map
    # _no_split_modules = ["DiffTransformerDecoderLayer"]: a layer is placed as a whole, never its submodules.
    assert all(re.fullmatch(r"model\.layers\.\d+", k) for k in layer_devices), device_map
    disk_layer = next(k for k, v in layer_devices.items() if v == "disk")
    assert all(p.device.type == "meta" for p in offloaded.get_submodule(disk_layer).parameters())

    prompts = torch.tensor([[5, 17, 3, 99, 42, 7], [11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        torch.testing.assert_close(offloaded(prompts).logits, model(prompts).logits, rtol=1e-5, atol=1e-5)
    expected = model.generate(prompts, max_new_tokens=8, do_sample=False)
    assert torch.equal(offloaded.generate(prompts, max_new_tokens=8, do_sample=False), expected)
