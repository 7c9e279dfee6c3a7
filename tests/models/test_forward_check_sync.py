"""The forward's lost-cache check costs no host synchronisation: it reads position values only on the CPU.

Reading an accelerator tensor's value (`int(position_ids.min())`) makes the host wait for the device; the check runs
in every forward that passes positions without a filled cache, i.e. in every training step whose data collator
passes positions, so there it must read shapes only.
"""

import pytest
import torch

from difftransformer import DiffTransformerConfig, DiffTransformerModel
from difftransformer.compat_difftransformer import check_forward_arguments
from difftransformer.modeling_difftransformer import eager_attention_forward


def _model() -> DiffTransformerModel:
    config = DiffTransformerConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4,
    )  # fmt: skip
    return DiffTransformerModel(config)


def test_positions_off_the_cpu_are_not_read():
    # A tensor on the meta device has no values: any read of them (what a device-to-host copy would be) raises.
    positions = torch.arange(5, 11, device="meta").unsqueeze(0)
    check_forward_arguments(_model(), {}, None, positions, eager_attention_forward)


def test_positions_on_the_cpu_are_still_checked():
    with pytest.raises(ValueError, match="position_ids starting at 5 but no cache"):
        check_forward_arguments(_model(), {}, None, torch.arange(5, 11).unsqueeze(0), eager_attention_forward)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to observe host synchronisations")
def test_positions_on_a_gpu_cost_no_synchronisation():
    positions = torch.arange(6, device="cuda").unsqueeze(0) + 3
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call raises
    try:
        check_forward_arguments(_model(), {}, None, positions, eager_attention_forward)
    finally:
        torch.cuda.set_sync_debug_mode("default")
