"""Deprecated path of :mod:`difftransformer.research.probes`, kept for one release; import from there instead.

The research tools moved out of the model package (CHANGELOG.md, 0.3.0); this module warns once and is then that
module under its old name.
"""

import sys
import warnings

from .research import probes as _moved

warnings.warn(
    "difftransformer.probes is deprecated and will be removed in the next release: import from "
    "difftransformer.research.probes instead",
    FutureWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved  # the old name is the new module: same objects, one warning
