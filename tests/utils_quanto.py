"""optimum-quanto helpers of the tests: its bit unpacking in torch (tests/conftest.py's
``quanto_without_its_compiled_kernel`` gives it to quanto in place of its compiled kernel)."""

import torch


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """optimum-quanto's 2/4-bit unpack (its reference algorithm, ``optimum.quanto.library.unpack``): value ``i`` of a
    byte is bits ``[bits·i, bits·(i+1))``; the values of each position are concatenated along the first dimension."""
    return torch.cat([(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(8 // bits)]).to(torch.uint8)
