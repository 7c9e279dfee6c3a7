"""Bounds on random draws that follow from their distribution, for tests of initialisations and samplers: a test
asserts an interval that a correct draw leaves with probability at most ``p``, whatever the seed or the CPU.

Chi-square tails (Laurent and Massart 2000, Lemma 1): for ``X ~ χ²_k`` and ``x > 0``,
``P(X ≥ k + 2√(kx) + 2x) ≤ e^-x`` and ``P(X ≤ k − 2√(kx)) ≤ e^-x``.
"""

import math


def normal_std_interval(n: int, sigma: float, p: float = 1e-9) -> tuple[float, float]:
    """``(low, high)`` for the sample standard deviation (``torch.std``, n − 1 degrees of freedom) of ``n`` independent
    draws of ``N(μ, sigma²)``: a correct draw falls outside with probability at most ``2p``. ``low`` is 0 where ``n``
    is too small for the lower tail to say anything."""
    if n < 2:
        raise ValueError(f"n must be at least 2 (a sample std needs two draws); got {n}")
    k, x = n - 1, math.log(1 / p)
    low = max(0.0, 1 - 2 * math.sqrt(x / k))
    high = 1 + 2 * math.sqrt(x / k) + 2 * x / k
    return sigma * math.sqrt(low), sigma * math.sqrt(high)
