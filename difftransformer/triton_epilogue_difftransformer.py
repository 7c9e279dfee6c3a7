"""Deprecated path of the decode steps' Triton epilogues, kept for one release: they moved to
``difftransformer.kernels.triton`` (the module ``difftransformer.kernels.triton.epilogue``), outside the flat model
files, so that saved remote-code folders no longer carry them. Importing this module warns and re-exports their names
from there (the same objects)."""

import warnings

from .kernels.triton.epilogue import *  # noqa: F403
from .kernels.triton.epilogue import __all__ as _names

warnings.warn(
    "difftransformer.triton_epilogue_difftransformer is deprecated and will be removed in the next release: import "
    "from difftransformer.kernels.triton (the module difftransformer.kernels.triton.epilogue) instead",
    FutureWarning,
    stacklevel=2,
)

__all__ = list(_names)
