"""Deprecated path of V1's one-pass Triton kernel, kept for one release: it moved to
``difftransformer.kernels.triton`` (the module ``difftransformer.kernels.triton.attention``), outside the flat model
files, so that saved remote-code folders no longer carry it. Importing this module warns and re-exports the kernel's
public names from there (the same objects, so ``set_configs`` here configures the kernel the model runs)."""

import warnings

from .kernels.triton.attention import *  # noqa: F403
from .kernels.triton.attention import __all__ as _names
from .kernels.triton.attention import triton  # noqa: F401

warnings.warn(
    "difftransformer.triton_difftransformer is deprecated and will be removed in the next release: import from "
    "difftransformer.kernels.triton (the module difftransformer.kernels.triton.attention) instead",
    FutureWarning,
    stacklevel=2,
)

__all__ = [*_names, "triton"]
