"""The Triton kernels: V1's one-pass differential attention and the decode steps' epilogues (``pip install
difftransformer[triton]``; docs/model.md, "Kernels").

* ``attention``: DIFF V1's one-pass kernel: forward, backward, decode (one query token, flash-decoding splits), their
  launch configurations and autotuning, the tuning sweep (:func:`tuning_sweep`, :func:`format_sweep`) and the PyTorch
  custom ops that ``torch.compile`` traces.
* ``epilogue``: the CUDA decode step's combines after stock SDPA, one launch each (:func:`v1_combine_norm`,
  :func:`v2_sigmoid_combine`; :func:`epilogue_runs` says where they run).

Importing this package does not need triton: without it :func:`is_available` and :func:`epilogue_runs` are False and a
kernel call says what is missing. The model files load it through ``kernels_difftransformer.triton_kernels`` (an
absolute import by name, so that no saved remote-code folder carries these files).
"""

from .attention import (
    LAUNCH_CONFIGS,
    SWEEP_SHAPES,
    SWEEP_SMOKE_SHAPES,
    differential_attention_triton,
    format_sweep,
    is_available,
    load_configs,
    set_configs,
    triton,
    tuning_sweep,
)
from .epilogue import runs as epilogue_runs
from .epilogue import v1_combine_norm, v2_sigmoid_combine

__all__ = [
    "LAUNCH_CONFIGS",
    "SWEEP_SHAPES",
    "SWEEP_SMOKE_SHAPES",
    "differential_attention_triton",
    "epilogue_runs",
    "format_sweep",
    "is_available",
    "load_configs",
    "set_configs",
    "triton",
    "tuning_sweep",
    "v1_combine_norm",
    "v2_sigmoid_combine",
]
