"""benchmarks/exact_tests.py: every p-value is its null distribution summed exactly. Checked against enumerations
written out here (every table, every split, every permutation), against closed forms, and against scipy where it is
installed (scipy is no dependency of the package or its tests)."""

import itertools
import math
import random

import pytest

from benchmarks import exact_tests as et


def _two_sided(probabilities: dict, observed) -> float:
    """Sum of the probabilities of every outcome no more likely than ``observed``."""
    return sum(p for p in probabilities.values() if p <= probabilities[observed] * (1 + 1e-7))


def test_binomial_sign_and_mcnemar_against_the_binomial_law():
    for n, p in ((5, 0.5), (12, 0.3), (9, 0.75)):
        law = {k: math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)}
        for k in range(n + 1):
            assert et.binomial_two_sided(k, n, p) == pytest.approx(min(1.0, _two_sided(law, k)), abs=1e-12)
    assert et.binomial_two_sided(5, 5) == pytest.approx(2 / 32)  # five of five: one in sixteen
    assert et.sign_test([1.0, -2.0, 0.0, 3.0, 4.0]) == (3, 1, et.binomial_two_sided(3, 4))  # the zero is dropped
    assert et.mcnemar(2, 0) == pytest.approx(0.5)
    assert et.mcnemar(0, 0) == 1.0
    for bad in ((3, 2), (-1, 2)):
        with pytest.raises(ValueError, match="binomial"):
            et.binomial_two_sided(*bad)


def test_fisher_exact_against_the_hypergeometric_law():
    for a, b, c, d in ((5, 0, 3, 2), (1, 4, 4, 1), (0, 6, 3, 3), (2, 2, 2, 2)):
        row, col, n = a + b, a + c, a + b + c + d
        law = {
            x: math.comb(col, x) * math.comb(n - col, row - x) / math.comb(n, row)
            for x in range(max(0, col - (n - row)), min(row, col) + 1)
        }
        assert et.fisher_exact(a, b, c, d) == pytest.approx(min(1.0, _two_sided(law, a)))
    assert et.fisher_exact(5, 0, 3, 2) == pytest.approx(4 / 9)  # five of five against three of five
    with pytest.raises(ValueError, match="non-negative"):
        et.fisher_exact(1, -1, 0, 0)


def test_stratified_fisher_against_the_product_of_hypergeometric_laws():
    # Hand-worked: three strata of 4 runs against 4, the first group learning in all of them, the second in 1, 1 and 2:
    # the all-learned corner has probability C(5,4)/C(8,4) = 5/70 in each of the first two strata and C(6,4)/C(8,4) =
    # 15/70 in the third; the opposite corner (a = 1, 1, 2) is as likely, and every other total more likely.
    corner = (5 / 70) * (5 / 70) * (15 / 70)
    assert et.stratified_fisher([(4, 0, 1, 3), (4, 0, 1, 3), (4, 0, 2, 2)]) == pytest.approx(2 * corner)
    for table in ((5, 0, 3, 2), (1, 4, 4, 1), (2, 2, 2, 2)):
        assert et.stratified_fisher([table]) == pytest.approx(et.fisher_exact(*table))  # one stratum: Fisher's
    rng = random.Random(4)
    for _ in range(10):
        tables = [tuple(rng.randint(0, 4) for _ in range(4)) for _ in range(rng.randint(1, 3))]
        laws = []
        for a, b, c, d in tables:
            row, col, n = a + b, a + c, a + b + c + d
            lo, hi = max(0, col - (n - row)), min(row, col)
            laws.append(
                {x: math.comb(col, x) * math.comb(n - col, row - x) / math.comb(n, row) for x in range(lo, hi + 1)}
            )
        total: dict = {}
        for combo in itertools.product(*(law.items() for law in laws)):
            key = sum(x for x, _ in combo)
            total[key] = total.get(key, 0.0) + math.prod(q for _, q in combo)
        observed = sum(t[0] for t in tables)
        assert et.stratified_fisher(tables) == pytest.approx(min(1.0, _two_sided(total, observed)))
    with pytest.raises(ValueError, match="non-negative"):
        et.stratified_fisher([(1, -1, 0, 0)])
    with pytest.raises(ValueError, match="at least one"):
        et.stratified_fisher([])


def test_kendall_against_every_permutation():
    rng = random.Random(5)
    for n in (2, 4, 6):
        x = rng.sample(range(50), n)
        y = rng.sample(range(50), n)
        tau, p = et.kendall(x, y)

        def t(b):
            s = sum((x[i] - x[j]) * (b[i] - b[j]) > 0 for i in range(n) for j in range(i + 1, n))
            return (2 * s - n * (n - 1) / 2) / (n * (n - 1) / 2)

        assert tau == pytest.approx(t(y))
        taus = [t(list(perm)) for perm in itertools.permutations(y)]
        assert p == pytest.approx(sum(abs(v) >= abs(tau) - 1e-9 for v in taus) / len(taus))
    assert et.kendall([1, 2, 3, 4], [10, 20, 30, 40]) == (1.0, pytest.approx(2 / 24))  # one of 24 orderings each way
    with pytest.raises(ValueError, match="tie"):
        et.kendall([1, 1, 2], [1, 2, 3])


def test_rank_sum_against_its_enumeration_with_ties():
    assert et.rank_sum([1, 2, 3], [4, 5, 6]) == pytest.approx(2 / 20)  # the smallest p three against three
    assert et.rank_sum([1, 2, 3, 4, 5], [6, 7, 8, 9, 9]) == pytest.approx(2 / 252)
    rng = random.Random(0)
    for _ in range(20):
        x = [rng.choice((1, 2, 2, 3, 5)) for _ in range(rng.randint(1, 4))]
        y = [rng.choice((2, 3, 3, 4, 9)) for _ in range(rng.randint(1, 4))]
        pooled = x + y
        ranks = et.midranks(pooled)
        mean = len(x) * (len(pooled) + 1) / 2
        sums = [sum(ranks[i] for i in chosen) for chosen in itertools.combinations(range(len(pooled)), len(x))]
        observed = abs(sum(ranks[: len(x)]) - mean)
        assert et.rank_sum(x, y) == pytest.approx(sum(abs(s - mean) >= observed - 1e-9 for s in sums) / len(sums))
    assert et.midranks([3, 1, 3, 2]) == [3.5, 1.0, 3.5, 2.0]
    with pytest.raises(ValueError, match="both samples"):
        et.rank_sum([], [1])


def test_spearman_against_every_permutation():
    rng = random.Random(1)
    for n in (3, 5, 7):
        x = [rng.random() for _ in range(n)]
        y = [a + rng.gauss(0, 0.3) for a in x]
        y[0] = y[1]  # a tie
        rho, p = et.spearman(x, y)
        rx, ry = et.midranks(x), et.midranks(y)

        def corr(a, b):
            ma, mb = sum(a) / n, sum(b) / n
            cov = sum((u - ma) * (v - mb) for u, v in zip(a, b))
            return cov / math.sqrt(sum((u - ma) ** 2 for u in a) * sum((v - mb) ** 2 for v in b))

        assert rho == pytest.approx(corr(rx, ry))
        perms = [corr(rx, list(perm)) for perm in itertools.permutations(ry)]
        assert p == pytest.approx(sum(abs(r) >= abs(rho) - 1e-9 for r in perms) / len(perms))
    assert et.spearman([1, 2, 3, 4, 5], [2, 4, 6, 8, 10]) == (pytest.approx(1.0), pytest.approx(2 / 120))
    with pytest.raises(ValueError, match="up to n"):
        et.spearman(list(range(et.SPEARMAN_MAX_N + 1)), list(range(et.SPEARMAN_MAX_N + 1)))
    with pytest.raises(ValueError, match="every value equal"):
        et.spearman([1, 1, 1], [1, 2, 3])


def test_signed_rank_on_a_hand_worked_case_and_against_every_sign_assignment():
    # Hand-worked: the zero is dropped; magnitudes 1.5, 0.5, 2, 2, 3 rank 2, 1, 3.5, 3.5, 5 (the tie shares 3 and 4), so
    # W+ = 2 + 3.5 + 3.5 = 9 of a total 15. W+ >= 9 exactly when the negative ranks sum to 6 or less: the empty set,
    # the five single ranks and {1, 2}, {1, 3.5} twice, {1, 5}, {2, 3.5} twice: 12 of the 2^5 = 32 assignments.
    # W+ <= 9 when the negative ranks sum to 6 or more: 32 minus the 11 sets that sum to less (all of the above but
    # {1, 5}) = 21.
    differences = [0.0, 1.5, -0.5, 2.0, 2.0, -3.0]
    assert et.signed_rank(differences, "greater") == (9.0, 5, pytest.approx(12 / 32))
    assert et.signed_rank(differences, "less") == (9.0, 5, pytest.approx(21 / 32))
    assert et.signed_rank(differences) == (9.0, 5, pytest.approx(24 / 32))  # two-sided: twice the smaller share
    assert et.signed_rank([0.1 * (i + 1) for i in range(8)], "greater")[2] == pytest.approx(1 / 256)  # 8 of 8: floor
    assert et.signed_rank([-1.0, -2.0], "greater")[2] == 1.0
    assert et.signed_rank([0.0, 0.0], "greater") == (0.0, 0, 1.0)  # nothing left to rank
    rng = random.Random(3)
    for _ in range(20):
        d = [rng.choice((-3, -2, -1, -1, 0, 1, 2, 2, 4)) * 0.5 for _ in range(rng.randint(1, 8))]
        nonzero = [v for v in d if v != 0]
        ranks = et.midranks([abs(v) for v in nonzero])
        observed = sum(r for r, v in zip(ranks, nonzero) if v > 0)
        sums = [sum(r for r, s in zip(ranks, signs) if s) for signs in itertools.product((0, 1), repeat=len(ranks))]
        greater = sum(w >= observed - 1e-9 for w in sums) / len(sums)
        less = sum(w <= observed + 1e-9 for w in sums) / len(sums)
        assert et.signed_rank(d, "greater") == (pytest.approx(observed), len(nonzero), pytest.approx(greater))
        assert et.signed_rank(d, "less")[2] == pytest.approx(less)
        assert et.signed_rank(d)[2] == pytest.approx(min(1.0, 2 * min(greater, less)))
    with pytest.raises(ValueError, match="alternative must be one of greater, less, two-sided"):
        et.signed_rank([1.0], "larger")
    with pytest.raises(ValueError, match="NaN"):
        et.signed_rank([1.0, float("nan")])


def test_the_same_values_as_scipy_where_it_is_installed():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(2)
    for _ in range(5):
        k, n = rng.randint(0, 12), 12
        assert et.binomial_two_sided(k, n, 0.4) == pytest.approx(stats.binomtest(k, n, 0.4).pvalue, rel=1e-9)
        table = [rng.randint(0, 6) for _ in range(4)]
        assert et.fisher_exact(*table) == pytest.approx(stats.fisher_exact([table[:2], table[2:]]).pvalue, rel=1e-9)
        x, y = rng.sample(range(0, 40, 2), 4), rng.sample(range(1, 41, 2), 3)  # no ties: scipy's exact has none
        assert et.rank_sum(x, y) == pytest.approx(stats.mannwhitneyu(x, y, method="exact").pvalue, rel=1e-9)
        a = [rng.random() for _ in range(9)]
        b = [rng.random() for _ in range(9)]
        assert et.spearman(a, b)[0] == pytest.approx(stats.spearmanr(a, b).statistic, rel=1e-9)
        u, v = rng.sample(range(100), 20), rng.sample(range(100), 20)  # no ties: scipy's exact Kendall has none
        assert et.kendall(u, v)[1] == pytest.approx(stats.kendalltau(u, v, method="exact").pvalue, rel=1e-9)
        # Distinct nonzero magnitudes: scipy's exact signed-rank distribution has neither ties nor zeros.
        d = [m * rng.choice((-1, 1)) for m in rng.sample(range(1, 30), rng.randint(3, 10))]
        for alternative in ("greater", "less", "two-sided"):
            want = stats.wilcoxon(d, alternative=alternative, method="exact").pvalue
            assert et.signed_rank(d, alternative)[2] == pytest.approx(want, rel=1e-9)


def test_binomial_noise_and_p_formatting():
    assert et.binomial_noise(0.85, 120) == pytest.approx(math.sqrt(0.85 * 0.15 / 120))  # the issue's ±0.03
    assert et.binomial_noise(1.0, 10) == 0.0
    with pytest.raises(ValueError, match="n must be positive"):
        et.binomial_noise(0.5, 0)
    assert [et.format_p(p) for p in (1.0000000002, 0.4444, 0.0079365, 0.00012)] == ["1", "0.44", "0.0079", "1.2e-04"]


def test_holm_multiplies_the_ith_smallest_by_m_minus_i_plus_one_and_keeps_the_order():
    # Sorted: 0.01 x 3 = 0.03; 0.03 x 2 = 0.06; 0.04 x 1 = 0.04, raised to the 0.06 before it. Returned in input order.
    assert et.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert et.holm([0.6, 0.7]) == [1.0, 1.0]  # capped at 1
    assert et.holm([0.02857]) == [0.02857]  # one test: unchanged
    assert et.holm([]) == []
