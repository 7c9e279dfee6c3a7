"""Deprecated path of :mod:`difftransformer.research.upcycle`, kept for one release; import from there instead.

The research tools moved out of the model package (CHANGELOG.md, 0.3.0); this package warns once and is then that
package under its old name, its submodules (``difftransformer.upcycle.job`` and the others) included.
"""

import sys
import warnings

from ..research import upcycle as _moved

SUBMODULES = ("data", "job", "metrics", "plotting", "report", "source", "training")

warnings.warn(
    "difftransformer.upcycle is deprecated and will be removed in the next release: import from "
    "difftransformer.research.upcycle instead",
    FutureWarning,
    stacklevel=2,
)
for _name in SUBMODULES:  # `import difftransformer.upcycle.job` then finds the moved module, loaded once
    sys.modules[f"{__name__}.{_name}"] = sys.modules[f"{_moved.__name__}.{_name}"]
sys.modules[__name__] = _moved
