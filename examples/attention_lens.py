"""Attention-noise lens from the command line: ``python examples/attention_lens.py --help``.

A thin wrapper over :func:`difftransformer.research.analysis.main` (also runnable as ``python -m
difftransformer.research.analysis``): for a prompt and a marked answer span, per layer and head, the share of attention
on the answer vs the rest, for our V1/V2 models (differential map and both softmax maps) and any transformers causal LM
(softmax maps), with heatmap PNGs and λ statistics. See docs/analysis.md.
"""

from difftransformer.research.analysis import main

if __name__ == "__main__":
    main()
