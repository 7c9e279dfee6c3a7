"""Exact tests for the small samples the benchmark reports compare: a handful of seeds, a few hundred items.

At these sample sizes a normal approximation misstates the p-value, so every test here enumerates (or sums) its null
distribution exactly; each returns a two-sided p-value, except :func:`signed_rank`, which also gives a one-sided one.

* :func:`binomial_two_sided` (and :func:`sign_test`, :func:`mcnemar`): a count of successes against Binomial(n, p);
  two-sided as the sum of the probabilities of every outcome no more likely than the one observed.
* :func:`fisher_exact`: a 2 × 2 table (e.g. seeds that learned, per model), two-sided in the same way over the
  hypergeometric distribution of the table with its margins fixed.
* :func:`stratified_fisher`: several 2 × 2 tables of one comparison (e.g. seeds that learned, per model, at each of
  several learning rates), the exact conditional test of no association in any of them: the sum over the tables of
  the first cell, its distribution the convolution of each table's hypergeometric law with that table's margins
  fixed, two-sided as Fisher's.
* :func:`rank_sum`: two unpaired samples (e.g. steps to 90% of the runs of two models), the Wilcoxon–Mann–Whitney rank
  sum with midranks for ties, its distribution enumerated over every split of the pooled values. Runs that never got
  there within a common budget enter as a value above every observed one (they tie among themselves): with the same
  budget for every run this is their true order, and ties only make the test conservative.
* :func:`signed_rank`: paired differences (e.g. one model's loss minus another's, per seed), the Wilcoxon signed-rank
  statistic (the sum of the ranks of the positive differences' magnitudes; zero differences dropped, midranks for
  tied magnitudes), its distribution counted over all 2^n assignments of signs to the ranks; one-sided
  (``alternative="greater"``: the differences tend to be positive; ``"less"``) or two-sided.
* :func:`holm`: p-values of several tests adjusted for their number (Holm's step-down method: controls the chance of any
  false rejection among them, with no assumption on how the tests depend on each other).
* :func:`kendall`: Kendall's rank correlation τ of values without ties, its exact p-value from the number of
  permutations with each count of inversions (any n: no enumeration of the n! permutations needed).
* :func:`spearman`: Spearman's rank correlation with its exact permutation p-value (every permutation of one
  variable's ranks is counted, by dynamic programming over subsets: up to :data:`SPEARMAN_MAX_N` values).

The same definitions as scipy's ``binomtest``, ``fisher_exact``, ``mannwhitneyu(method="exact")`` (without ties),
``wilcoxon(method="exact")`` (without ties or zeros), ``kendalltau(method="exact")`` and ``spearmanr``'s statistic
(tests/benchmarks/test_exact_tests.py compares them where scipy is installed); written out here because scipy is no
dependency of the package or its tests.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np

# Outcomes whose probability is within this relative tolerance of the observed one count as "as likely" (the
# floating-point sums of equal probabilities differ in their last bits; scipy uses the same factor).
_RELATIVE = 1 + 1e-7
SPEARMAN_MAX_N = 14  # 2^14 subsets of arrays: the exact distribution stays cheap


def binomial_two_sided(k: int, n: int, p: float = 0.5) -> float:
    """Two-sided exact binomial p-value of ``k`` successes in ``n`` trials of probability ``p``."""
    if not (isinstance(k, int) and isinstance(n, int) and 0 <= k <= n):
        raise ValueError(f"binomial test: need integers 0 <= k <= n, got k={k!r}, n={n!r}")
    if not 0 < p < 1:
        raise ValueError(f"binomial test: p must be in (0, 1), got {p!r}")
    if n == 0:
        return 1.0
    probs = [math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(n + 1)]
    return min(1.0, sum(q for q in probs if q <= probs[k] * _RELATIVE))


def sign_test(differences: Sequence[float]) -> tuple[int, int, float]:
    """(positive, negative, two-sided p) of paired differences; zeros are dropped (they carry no sign)."""
    pos = sum(d > 0 for d in differences)
    neg = sum(d < 0 for d in differences)
    return pos, neg, binomial_two_sided(pos, pos + neg)


def mcnemar(only_first: int, only_second: int) -> float:
    """Exact McNemar test of paired binary outcomes: the discordant pairs (``only_first``: the first succeeded and the
    second did not) against an even split."""
    return binomial_two_sided(only_first, only_first + only_second)


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided Fisher exact test of the 2 × 2 table ``[[a, b], [c, d]]`` (rows: groups; columns: outcome yes/no)."""
    if min(a, b, c, d) < 0:
        raise ValueError(f"fisher_exact: counts must be non-negative, got {(a, b, c, d)}")
    row1, col1, n = a + b, a + c, a + b + c + d
    if n == 0:
        return 1.0
    lo, hi = max(0, col1 - (n - row1)), min(row1, col1)
    probs = {x: math.comb(col1, x) * math.comb(n - col1, row1 - x) / math.comb(n, row1) for x in range(lo, hi + 1)}
    return min(1.0, sum(q for q in probs.values() if q <= probs[a] * _RELATIVE))


def stratified_fisher(tables: Sequence[tuple[int, int, int, int]]) -> float:
    """Two-sided exact p-value of no association in any of several 2 × 2 tables ``[[a, b], [c, d]]`` (rows: groups;
    columns: outcome yes/no; one table per stratum): the statistic is the sum of the ``a`` cells, whose null law, with
    every table's margins fixed, is the convolution of the tables' hypergeometric laws; the p-value sums the
    probabilities of every total no more likely than the observed one. One table: :func:`fisher_exact`."""
    if not tables:
        raise ValueError("stratified_fisher: need at least one 2 x 2 table")
    law = {0: 1.0}
    observed = 0
    for table in tables:
        a, b, c, d = table
        if min(table) < 0:
            raise ValueError(f"stratified_fisher: counts must be non-negative, got {tuple(table)}")
        row1, col1, n = a + b, a + c, a + b + c + d
        observed += a
        if n == 0:
            continue
        lo, hi = max(0, col1 - (n - row1)), min(row1, col1)
        one = {x: math.comb(col1, x) * math.comb(n - col1, row1 - x) / math.comb(n, row1) for x in range(lo, hi + 1)}
        joined: dict[int, float] = {}
        for total, p in law.items():
            for x, q in one.items():
                joined[total + x] = joined.get(total + x, 0.0) + p * q
        law = joined
    return min(1.0, sum(q for q in law.values() if q <= law[observed] * _RELATIVE))


def midranks(values: Sequence[float]) -> list[float]:
    """Ranks 1..n, ties given the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def rank_sum(x: Sequence[float], y: Sequence[float]) -> float:
    """Two-sided exact p-value of the rank-sum test of unpaired samples ``x`` and ``y`` (midranks for ties): the share
    of the C(n, len(x)) splits of the pooled values whose rank sum is at least as far from its mean as ``x``'s."""
    if not x or not y:
        raise ValueError(f"rank_sum: both samples need a value, got {len(x)} and {len(y)}")
    n = len(x) + len(y)
    if math.comb(n, len(x)) > 2_000_000:
        raise ValueError(f"rank_sum: {len(x)} + {len(y)} values have too many splits to enumerate")
    ranks = midranks(list(x) + list(y))
    expected = len(x) * (n + 1) / 2
    observed = abs(sum(ranks[: len(x)]) - expected)
    hits = total = 0
    for chosen in itertools.combinations(ranks, len(x)):
        total += 1
        hits += abs(sum(chosen) - expected) >= observed - 1e-9
    return hits / total


SIGNED_RANK_ALTERNATIVES = ("greater", "less", "two-sided")


def signed_rank(differences: Sequence[float], alternative: str = "two-sided") -> tuple[float, int, float]:
    """(W+, n, p) of the exact Wilcoxon signed-rank test of paired ``differences``: zero differences are dropped
    (they carry no sign), the remaining n magnitudes get midranks, and W+ is the sum of the ranks of the positive
    differences. Under the null each difference is as likely positive as negative, so every one of the 2^n
    assignments of signs to the ranks is equally likely; the p-value is the share of them whose W+ is at least the
    observed one (``alternative="greater"``: the differences tend to be positive), at most it (``"less"``), or, for
    ``"two-sided"``, twice the smaller of the two shares, capped at 1. No nonzero difference: p = 1."""
    if alternative not in SIGNED_RANK_ALTERNATIVES:
        raise ValueError(
            f"signed_rank: alternative must be one of {', '.join(SIGNED_RANK_ALTERNATIVES)}, got {alternative!r}"
        )
    values = [float(d) for d in differences]
    if any(math.isnan(d) for d in values):
        raise ValueError("signed_rank: a difference is NaN")
    nonzero = [d for d in values if d != 0]
    n = len(nonzero)
    if n == 0:
        return 0.0, 0, 1.0
    # Doubled midranks are integers: the count of sign assignments per doubled W+ is exact in integers.
    ranks = [round(2 * r) for r in midranks([abs(d) for d in nonzero])]
    observed = sum(r for r, d in zip(ranks, nonzero) if d > 0)
    counts = [0] * (sum(ranks) + 1)  # counts[w]: assignments whose doubled W+ is w
    counts[0] = 1
    for r in ranks:  # each rank is positive or negative: the assignments without it, and those with it added
        counts = [c + (counts[w - r] if w >= r else 0) for w, c in enumerate(counts)]
    total = 2**n
    upper = sum(counts[observed:]) / total
    lower = sum(counts[: observed + 1]) / total
    p = {"greater": upper, "less": lower, "two-sided": min(1.0, 2 * min(upper, lower))}[alternative]
    return observed / 2, n, p


def kendall(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(Kendall's τ, its two-sided exact p-value) of paired samples without ties: τ = (concordant − discordant pairs)
    / C(n, 2); under independence every ordering of ``y`` against ``x`` is equally likely, and the number of the n!
    orderings with k discordant pairs (inversions) is counted by the recursion over n (Mahonian numbers, exact
    integers). The p-value is the share of orderings whose |τ| reaches the observed one."""
    n = len(x)
    if n != len(y) or n < 2:
        raise ValueError(f"kendall: need two samples of the same length >= 2, got {len(x)} and {len(y)}")
    if len(set(x)) < n or len(set(y)) < n:
        raise ValueError("kendall: the exact distribution here is for values without ties; a sample has a tie")
    pairs = n * (n - 1) // 2
    discordant = sum((x[i] - x[j]) * (y[i] - y[j]) < 0 for i in range(n) for j in range(i + 1, n))
    tau = (pairs - 2 * discordant) / pairs
    counts = [1]  # counts[k]: orderings of m values with k inversions, built up from m = 1
    for m in range(2, n + 1):  # the m-th value adds 0 to m - 1 inversions
        grown = [0] * (len(counts) + m - 1)
        for k, c in enumerate(counts):
            for extra in range(m):
                grown[k + extra] += c
        counts = grown
    far = abs(pairs - 2 * discordant)  # |concordant - discordant|
    hits = sum(c for k, c in enumerate(counts) if abs(pairs - 2 * k) >= far)
    return tau, hits / math.factorial(n)


def spearman(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(Spearman's ρ, its two-sided exact permutation p-value): ρ is Pearson's correlation of the midranks; the p-value
    counts the permutations of ``y``'s ranks whose |ρ| reaches the observed one."""
    n = len(x)
    if n != len(y) or n < 3:
        raise ValueError(f"spearman: need two samples of the same length >= 3, got {len(x)} and {len(y)}")
    if n > SPEARMAN_MAX_N:
        raise ValueError(f"spearman: the exact distribution is computed up to n = {SPEARMAN_MAX_N}, got n = {n}")
    # Doubled midranks are integers; ρ is an increasing function of the sum of their products.
    rx = [round(2 * r) for r in midranks(x)]
    ry = [round(2 * r) for r in midranks(y)]
    mx, my = sum(rx) / n, sum(ry) / n
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        raise ValueError("spearman: a sample with every value equal has no rank correlation")
    observed = sum(a * b for a, b in zip(rx, ry))
    rho = (observed - n * mx * my) / math.sqrt(sxx * syy)
    return rho, _spearman_p(tuple(rx), tuple(ry), observed)


@functools.lru_cache(maxsize=64)
def _spearman_p(rx: tuple[int, ...], ry: tuple[int, ...], observed: int) -> float:
    """The share of the n! pairings of ``rx`` with a permutation of ``ry`` whose sum of products is at least as far
    from its mean as ``observed``. Dynamic programming over the subsets of ``ry`` used by the first positions: one
    array of counts per subset, indexed by the partial sum (exact integers: n! < 2^63 for n <= 20)."""
    n = len(rx)
    top = sum(sorted(rx)[i] * sorted(ry)[i] for i in range(n)) + 1
    layer = {0: np.zeros(top, dtype=np.int64)}
    layer[0][0] = 1
    for i in range(n):
        nxt: dict[int, np.ndarray] = {}
        for mask, counts in layer.items():
            for j in range(n):
                if mask >> j & 1:
                    continue
                add = rx[i] * ry[j]
                target = nxt.get(mask | 1 << j)
                if target is None:
                    target = nxt[mask | 1 << j] = np.zeros(top, dtype=np.int64)
                target[add:] += counts[: top - add]
        layer = nxt
    (full,) = layer.values()
    centre = sum(rx) * sum(ry) / n
    sums = np.arange(top)
    hits = int(full[np.abs(sums - centre) >= abs(observed - centre) - 1e-9].sum())
    return hits / math.factorial(n)


def binomial_noise(accuracy: float, n: int) -> float:
    """Standard deviation of an accuracy measured on ``n`` independent queries: sqrt(p(1 − p)/n)."""
    if n <= 0:
        raise ValueError(f"binomial_noise: n must be positive, got {n}")
    return math.sqrt(max(0.0, accuracy * (1 - accuracy)) / n)


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's adjustment of ``ps`` (in their order): the i-th smallest is multiplied by (m − i + 1), then made no
    smaller than the adjusted value before it, and capped at 1."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adjusted = [0.0] * len(ps)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


def format_p(p: float) -> str:
    """A p-value as the reports print it: two significant digits, at most 1."""
    return f"{min(p, 1.0):.2g}" if p >= 0.001 else f"{p:.1e}"


__all__ = [
    "SPEARMAN_MAX_N",
    "binomial_noise",
    "binomial_two_sided",
    "fisher_exact",
    "format_p",
    "holm",
    "kendall",
    "mcnemar",
    "midranks",
    "rank_sum",
    "sign_test",
    "signed_rank",
    "spearman",
    "stratified_fisher",
]
