"""Synthetic retrieval tasks over a small integer vocabulary: multi-needle retrieval with prefix distractors, and MQAR.

No tokenizer: every token is an integer of a fixed layout (:class:`TaskVocab`), so a task is learned from scratch in
minutes on a CPU and every position of the evidence is known exactly. Two tasks, after the Differential Transformer
paper's key-information retrieval (Ye et al., arXiv 2410.05258, §3.3: several needles, distractors, one queried) and
Zoology's multi-query associative recall (Arora et al. 2023):

* :func:`multi_needle`: ``N`` needles ``[NEEDLE, p, s, v]`` (a two-token key ``p s``, a value ``v``) inserted into
  random filler tokens; the sequence ends with ``R`` queries ``[QUERY, p, s, v]``, each asking for one needle's value.
  Keys form a grid: needle ``i`` takes prefix ``i // 2`` (``ceil(N/2)`` prefixes) and suffix ``i mod 2`` of two
  suffixes shared by the sequence. So every needle of an even count has a distractor that shares its prefix and
  differs in its suffix, and from four needles on others share its suffix: neither key token alone names the needle,
  the model must match both. Values are distinct, so the needle a prediction names is known.
* :func:`mqar`: ``n`` key-value pairs ``k v`` (one token each, keys distinct), then a separator and half the keys
  queried in random order, each followed by its value (teacher forcing: one prediction per query).

A third kind, :func:`repeated_copy` (a random sequence, then the same again), is training data only: it teaches the
induction mechanism both tasks rely on, which small models otherwise take many thousands of steps to find.

Every sequence starts with ``BOS``. Examples are :class:`TaskExample`: token ids, the positions whose next-token
prediction is scored (``targets``: position of the last query token, answer token), the candidates (the values in the
context, for a multiple-choice reading), the evidence's token span per query and, for needles, the distractors' spans.
Everything is drawn from ``random.Random`` seeded by a string built from the seed and the cell, so a set is identical
across runs and machines, and a cell does not depend on which other cells are generated.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .probes import seeded_rng

TASKS = ("needle", "mqar", "copy")


@dataclass(frozen=True)
class TaskVocab:
    """The token layout: five special tokens, then the prefix, suffix, MQAR-key, value and filler ranges."""

    num_prefixes: int = 16
    num_suffixes: int = 16
    num_keys: int = 48
    num_values: int = 48
    num_filler: int = 64

    PAD = 0
    BOS = 1
    NEEDLE = 2
    QUERY = 3
    SEP = 4
    NUM_SPECIAL = 5

    def __post_init__(self):
        for name in ("num_prefixes", "num_suffixes", "num_keys", "num_values", "num_filler"):
            if getattr(self, name) < 2:
                raise ValueError(f"TaskVocab.{name} must be >= 2, got {getattr(self, name)}.")

    def _start(self, part: str) -> int:
        order = ("prefixes", "suffixes", "keys", "values", "filler")
        start = self.NUM_SPECIAL
        for name in order:
            if name == part:
                return start
            start += getattr(self, f"num_{name}")
        raise KeyError(part)

    def tokens(self, part: str) -> range:
        """Token ids of ``part``: one of prefixes, suffixes, keys, values, filler."""
        start = self._start(part)
        return range(start, start + getattr(self, f"num_{part}"))

    @property
    def size(self) -> int:
        return self._start("filler") + self.num_filler


@dataclass
class TaskExample:
    """One sequence. ``targets[j] = (position, answer)``: the logits at ``position`` must predict ``answer`` (the token
    at ``position + 1``). ``evidence[j]``: token span ``(start, end)`` of the needle or pair that answers query ``j``;
    ``distractors[j]``: spans of the other needles sharing its prefix (needles only); ``question_start``: first token
    of the query block. ``context_length`` is the sequence length in tokens; ``count`` the number of needles / pairs."""

    task: str
    input_ids: list[int]
    targets: list[tuple[int, int]]
    candidates: list[int]
    evidence: list[tuple[int, int]]
    question_start: int
    count: int
    depth: float | None = None
    distractors: list[list[tuple[int, int]]] = field(default_factory=list)

    @property
    def context_length(self) -> int:
        return len(self.input_ids)


def multi_needle(
    vocab: TaskVocab, length: int, num_needles: int, num_queries: int, rng: random.Random, depth: float | None = None
) -> TaskExample:
    """One multi-needle sequence of exactly ``length`` tokens (module docstring). ``depth`` (0 = right after BOS,
    1 = just before the queries) places the needle of the first query; ``None`` places every needle at random."""
    if num_needles < 1 or num_queries < 1 or num_queries > num_needles:
        raise ValueError(
            f"need 1 <= num_queries <= num_needles, got num_needles={num_needles}, num_queries={num_queries}."
        )
    if num_needles > min(2 * vocab.num_prefixes, vocab.num_values):
        raise ValueError(
            f"num_needles={num_needles} exceeds what the vocabulary's prefixes and values allow "
            f"({min(2 * vocab.num_prefixes, vocab.num_values)})."
        )
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1] or None, got {depth}.")
    filler_count = length - 1 - 4 * num_needles - 4 * num_queries
    if filler_count < 0:
        raise ValueError(
            f"length={length} is too short for {num_needles} needles and {num_queries} queries "
            f"(needs at least {1 + 4 * num_needles + 4 * num_queries} tokens)."
        )
    # Needle i has prefix i // 2 and suffix i % 2 of two suffixes shared by the whole sequence: from 4 needles on,
    # neither key token alone names a needle (its prefix twin and the needles with the same suffix are distractors).
    groups = rng.sample(vocab.tokens("prefixes"), (num_needles + 1) // 2)
    suffixes = rng.sample(vocab.tokens("suffixes"), 2)
    values = rng.sample(vocab.tokens("values"), num_needles)
    keys = [(groups[i // 2], suffixes[i % 2]) for i in range(num_needles)]
    queried = rng.sample(range(num_needles), num_queries)
    # Slot j = after j filler tokens. The first query's needle at `depth`; the others uniformly.
    slots = [rng.randint(0, filler_count) for _ in range(num_needles)]
    if depth is not None:
        slots[queried[0]] = round(depth * filler_count)
    order = sorted(range(num_needles), key=lambda i: (slots[i], rng.random()))
    filler = [rng.choice(vocab.tokens("filler")) for _ in range(filler_count)]
    ids, spans, f = [vocab.BOS], {}, 0
    for i in order:
        ids += filler[f : slots[i]]
        f = max(f, slots[i])
        spans[i] = (len(ids), len(ids) + 4)
        ids += [vocab.NEEDLE, *keys[i], values[i]]
    ids += filler[f:]
    question_start = len(ids)
    targets, evidence, distractors = [], [], []
    for i in queried:
        ids += [vocab.QUERY, *keys[i]]
        targets.append((len(ids) - 1, values[i]))
        ids.append(values[i])
        evidence.append(spans[i])
        distractors.append([spans[j] for j in range(num_needles) if j != i and keys[j][0] == keys[i][0]])
    assert len(ids) == length
    return TaskExample("needle", ids, targets, list(values), evidence, question_start, num_needles, depth, distractors)


def mqar(
    vocab: TaskVocab, num_pairs: int, rng: random.Random, depth: float | None = None, num_queries: int | None = None
) -> TaskExample:
    """One MQAR sequence: ``BOS k1 v1 ... kn vn SEP`` then ``num_queries`` distinct keys (default ``n // 2``) queried
    in random order, each followed by its value; ``2 + 2n + 2·num_queries`` tokens. ``depth`` (0 = first pair, 1 =
    last) puts the first query on that pair.

    Why not every key: with all ``n`` keys queried (teacher-forced), "copy a value not answered yet" scores
    ``H_n / n`` (``H_n`` the harmonic number: 0.52 for 4 pairs, 0.34 for 8) without any recall, and small models
    settle on that shortcut; with half the keys queried it is worth little more than a uniform guess."""
    if not 2 <= num_pairs <= min(vocab.num_keys, vocab.num_values):
        raise ValueError(f"num_pairs must be in [2, {min(vocab.num_keys, vocab.num_values)}], got {num_pairs}.")
    num_queries = max(1, num_pairs // 2) if num_queries is None else num_queries
    if not 1 <= num_queries <= num_pairs:
        raise ValueError(f"num_queries must be in [1, num_pairs={num_pairs}], got {num_queries}.")
    keys = rng.sample(vocab.tokens("keys"), num_pairs)
    values = rng.sample(vocab.tokens("values"), num_pairs)
    ids = [vocab.BOS]
    for k, v in zip(keys, values):
        ids += [k, v]
    ids.append(vocab.SEP)
    question_start = len(ids)
    order = rng.sample(range(num_pairs), num_pairs)
    if depth is not None:
        first = round(depth * (num_pairs - 1))
        order.remove(first)
        order.insert(0, first)
    order = order[:num_queries]
    targets, evidence = [], []
    for i in order:
        ids.append(keys[i])
        targets.append((len(ids) - 1, values[i]))
        ids.append(values[i])
        evidence.append((1 + 2 * i, 3 + 2 * i))
    return TaskExample("mqar", ids, targets, list(values), evidence, question_start, num_pairs, depth)


def mqar_length(num_pairs: int) -> int:
    """Tokens of an MQAR sequence of ``num_pairs`` pairs with the default ``num_pairs // 2`` queries."""
    return 2 + 2 * num_pairs + 2 * max(1, num_pairs // 2)


def repeated_copy(vocab: TaskVocab, length: int, rng: random.Random) -> TaskExample:
    """``BOS x1 .. xm SEP x1 .. xm`` with ``m = (length − 2) // 2`` random non-special tokens; every token of the copy
    is a target. The canonical data on which a two-layer transformer forms induction heads (a previous-token head,
    then a head that attends to the token after an earlier occurrence of the current one): the mechanism both
    retrieval tasks need. Without it, small models stay for thousands of steps on the plateau where they copy any
    value of the context, never the right one (measured: docs/reports/2026-11-27-retrieval-lowbit.md)."""
    m = (length - 2) // 2
    if m < 1:
        raise ValueError(f"length must be >= 4 for a copy sequence, got {length}.")
    tokens = [rng.randrange(vocab.NUM_SPECIAL, vocab.size) for _ in range(m)]
    ids = [vocab.BOS, *tokens, vocab.SEP, *tokens]
    start = m + 2
    return TaskExample(
        "copy", ids, [(start + i - 1, tokens[i]) for i in range(m)], [], [(1 + i, 2 + i) for i in range(m)], start, m
    )


def needle_grid(
    vocab: TaskVocab,
    lengths: Sequence[int],
    needle_counts: Sequence[int],
    depths: Sequence[float],
    samples: int,
    seed: int,
    num_queries: int = 1,
) -> list[TaskExample]:
    """Held-out multi-needle examples: ``samples`` per (length, needle count, depth) cell, ``min(num_queries, N)``
    queries each (the first one's needle at the cell's depth)."""
    return [
        multi_needle(vocab, L, n, min(num_queries, n), seeded_rng(seed, "needle", L, n, d, s), d)
        for L in lengths
        for n in needle_counts
        for d in depths
        for s in range(samples)
    ]


def mqar_grid(vocab: TaskVocab, pair_counts: Sequence[int], samples: int, seed: int) -> list[TaskExample]:
    """Held-out MQAR examples: ``samples`` sequences per number of pairs (every key queried)."""
    return [mqar(vocab, n, seeded_rng(seed, "mqar", n, s)) for n in pair_counts for s in range(samples)]


def training_examples(
    vocab: TaskVocab,
    count: int,
    seed: int,
    max_length: int,
    needle_counts: Sequence[int],
    pair_counts: Sequence[int],
    needle_fraction: float = 0.5,
    max_queries: int = 4,
    min_length: int = 32,
    copy_fraction: float = 0.0,
    copy_lengths: tuple[int, int] = (8, 40),
) -> list[TaskExample]:
    """``count`` training sequences: a ``copy_fraction`` share :func:`repeated_copy` (length uniform in
    ``copy_lengths``, capped at ``max_length``: short copies form induction heads fastest), a ``needle_fraction`` share
    multi-needle (length uniform in ``[min_length, max_length]``, needle count drawn from ``needle_counts``, ``max(1,
    min(max_queries, N // 2))`` queries), the rest MQAR (pair count from ``pair_counts``, only those whose sequence fits
    in ``max_length``)."""
    if not 0.0 <= needle_fraction <= 1.0 or not 0.0 <= copy_fraction <= 1.0 or needle_fraction + copy_fraction > 1.0:
        raise ValueError(
            f"needle_fraction and copy_fraction must be in [0, 1] with a sum <= 1, got {needle_fraction} and "
            f"{copy_fraction}."
        )
    fitting_pairs = [n for n in pair_counts if mqar_length(n) <= max_length]
    if needle_fraction + copy_fraction < 1.0 and not fitting_pairs:
        raise ValueError(
            f"no pair count of {list(pair_counts)} fits in max_length={max_length} (2 + 2n + 2(n // 2) tokens)."
        )
    out = []
    for i in range(count):
        rng = seeded_rng(seed, "train", i)
        kind = rng.random()
        if kind < copy_fraction:
            lo, hi = min(copy_lengths[0], max_length), min(copy_lengths[1], max_length)
            out.append(repeated_copy(vocab, rng.randint(lo, hi), rng))
        elif kind < copy_fraction + needle_fraction:
            n = rng.choice(list(needle_counts))
            r = max(1, min(max_queries, n // 2))  # half the needles at most: no "not answered yet" shortcut (mqar)
            shortest = 1 + 4 * n + 4 * r
            out.append(
                multi_needle(vocab, rng.randint(max(min_length, shortest), max(max_length, shortest)), n, r, rng)
            )
        else:
            out.append(mqar(vocab, rng.choice(fitting_pairs), rng))
    return out


def encode(examples: Sequence[TaskExample], pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of shape ``(N, T)``, right-padded with ``PAD`` to the longest (or ``pad_to``); labels
    are ``-100`` except at the answer tokens (the standard shifted causal-LM loss then scores exactly the targets)."""
    longest = max(ex.context_length for ex in examples)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest example ({longest} tokens).")
    ids = torch.full((len(examples), width), TaskVocab.PAD, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, ex in enumerate(examples):
        ids[row, : ex.context_length] = torch.tensor(ex.input_ids)
        for pos, answer in ex.targets:
            labels[row, pos + 1] = answer
    return ids, labels


@torch.no_grad()
def score(model, examples: Sequence[TaskExample], batch_size: int = 32) -> list[dict]:
    """Per example: ``correct`` (list over its queries: the argmax over the whole vocabulary is the answer),
    ``choice_correct`` (argmax over the example's candidates; the whole vocabulary where it has none), ``loss``
    (cross-entropy of each answer, nats). Examples are batched by equal length (no padding reaches the scored
    positions)."""
    by_length: dict[int, list[int]] = {}
    for i, ex in enumerate(examples):
        by_length.setdefault(ex.context_length, []).append(i)
    out: list[dict | None] = [None] * len(examples)
    device = next(model.parameters()).device
    for indices in by_length.values():
        for b in range(0, len(indices), batch_size):
            chunk = indices[b : b + batch_size]
            ids = torch.tensor([examples[i].input_ids for i in chunk], device=device)
            logits = model(input_ids=ids, use_cache=False).logits.float()
            logp = torch.log_softmax(logits, -1)
            for row, i in enumerate(chunk):
                ex = examples[i]
                pos = torch.tensor([p for p, _ in ex.targets], device=device)
                ans = torch.tensor([a for _, a in ex.targets], device=device)
                lp = logp[row, pos]  # (R, V)
                correct = lp.argmax(-1) == ans
                if ex.candidates:
                    cand = torch.tensor(ex.candidates, device=device)
                    choice_correct = cand[lp[:, cand].argmax(-1)] == ans
                else:  # no candidate list (copy sequences): the whole vocabulary
                    choice_correct = correct
                out[i] = {
                    "correct": correct.tolist(),
                    "choice_correct": choice_correct.tolist(),
                    "loss": (-lp.gather(1, ans[:, None])[:, 0]).tolist(),
                }
    return out  # type: ignore[return-value]


__all__ = [
    "TASKS",
    "TaskExample",
    "TaskVocab",
    "encode",
    "mqar",
    "mqar_grid",
    "mqar_length",
    "multi_needle",
    "needle_grid",
    "repeated_copy",
    "score",
    "training_examples",
]
