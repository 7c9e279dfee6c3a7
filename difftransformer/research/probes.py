"""Synthetic retrieval probes, generated on the fly from a seed, for any causal LM and tokenizer.

Three probes after the Differential Transformer paper's evaluations (Ye et al., arXiv 2410.05258, §3):

* :func:`needle_in_haystack`: several key–value "needles" buried in filler text at chosen depths; the question at
  the end asks for one of them (the paper's multi-needle key-information retrieval, after Kamradt's
  needle-in-a-haystack test).
* :func:`associative_recall`: multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"): a list of
  key–value pairs, then several keys queried in turn; each query's prompt contains the earlier queries with
  their correct answers (teacher forcing), so every query is scored separately.
* :func:`icl_shuffled`: in-context learning with shuffled demonstrations (paper §3, robustness of in-context
  learning to the order of demonstrations): items ``<prefix>_<number>`` are labelled by class, the label of each
  class is a random word chosen per episode (so it can only be learned from the demonstrations), the query is a
  new item of a seen class; the same demonstrations are presented in ``num_orders`` random orders.

The default filler is the package's embedded corpus (:func:`difftransformer.research.data.corpus_texts`, Python standard
library sources), so the default templates are lines of Python (``key = value`` needles, ``assert key ==``
questions); every template is a parameter. Everything is drawn from ``random.Random`` seeded by a string derived
from ``seed`` and the cell, so a probe set is identical across runs and machines (string seeds do not depend on
``PYTHONHASHSEED``) and each cell does not depend on which other cells are generated.

Scoring (:func:`evaluate`), for any transformers causal LM:

* ``"logits"`` (default): multiple choice over the example's candidates (the values of all needles / pairs in the
  context, the labels of all classes) by total log-likelihood of the candidate's tokens after the prompt
  (sum of token log-probabilities, no length normalisation; ties go to the first candidate). The prompt is run
  once and its KV cache reused for all candidates. Chance is ``1 / len(candidates)``.
* ``"generate"``: greedy decoding of as many tokens as the longest candidate; correct when the decoded
  continuation, with leading whitespace stripped, starts with the answer (stripped). Chance is near zero.

Each probe reports accuracy by context length (rows) and depth (columns) via :func:`accuracy_table`,
:func:`format_table` (Markdown) and :func:`plot_accuracy_heatmap` (PNG). Depth is the relative position (0 =
start of the context, 1 = end) of the evidence: the queried needle (NIAH), the queried pair (MQAR), the last
demonstration of the query's class (ICL, rounded to the nearest value of ``depths``).
"""

from __future__ import annotations

import os
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from ..compat_difftransformer import CACHE_NAME

PROBES = ("niah", "mqar", "icl")
SCORINGS = ("logits", "generate")

# Words for keys, class prefixes and labels: plain lowercase English words, valid Python identifiers.
WORDS = (
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "maple",
    "ocean",
    "pearl",
    "ember",
    "frost",
    "cedar",
    "delta",
    "eagle",
    "flint",
    "grove",
    "harbor",
    "iris",
    "jade",
    "koala",
    "lemon",
    "mango",
    "noble",
    "olive",
    "piano",
    "quartz",
    "raven",
    "sable",
    "tulip",
    "umber",
    "velvet",
    "willow",
    "yarrow",
    "zephyr",
    "amber",
    "birch",
    "coral",
    "daisy",
    "ferret",
    "garnet",
    "hazel",
    "indigo",
    "juniper",
    "kestrel",
    "lotus",
    "marble",
    "nutmeg",
    "orchid",
    "pepper",
    "quill",
    "rosemary",
    "saffron",
    "thistle",
    "violet",
    "walnut",
    "badger",
    "canyon",
    "dune",
    "falcon",
    "glacier",
    "heron",
    "island",
    "jasmine",
    "lagoon",
    "meadow",
)

NIAH_NEEDLE = "{key} = {value}\n"
NIAH_QUESTION = "assert {key} =="
NIAH_ANSWER = " {value}"
MQAR_PAIR = "{key} = {value}\n"
MQAR_QUERY = "assert {key} =="
MQAR_ANSWER = " {value}"
ICL_DEMO = 'assert label("{item}") == "{label}"\n'
ICL_QUERY = 'assert label("{item}") =='
ICL_ANSWER = ' "{label}"'


@dataclass
class ProbeExample:
    """One scored item.

    ``prompt`` ends right before the answer; ``answer`` is one of ``candidates``. ``context_length`` is the
    nominal size of the cell (tokens for NIAH, pairs for MQAR, demonstrations for ICL), ``depth`` the nominal
    depth of the evidence, ``n_tokens`` the real prompt length in tokens. ``evidence_span`` is the character span
    of the evidence's answer inside the prompt (the needle's / pair's value, or the label of the last
    demonstration of the query's class) and ``question_start`` the character where the question begins: the lens
    (:func:`difftransformer.research.analysis.lens_on_examples`) uses them as answer span and end of the context.
    """

    probe: str
    prompt: str
    answer: str
    candidates: list[str]
    context_length: int
    depth: float
    n_tokens: int
    evidence_span: tuple[int, int]
    question_start: int
    meta: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        """Prompt plus answer: the training form of the example."""
        return self.prompt + self.answer


def seeded_rng(seed: int, *parts) -> random.Random:
    """A generator seeded by a string of ``seed`` and the cell's ``parts``: the same stream on every run and machine,
    and a cell's stream does not depend on which other cells are drawn."""
    return random.Random("-".join(str(p) for p in (seed, *parts)))


def _count_tokens(tokenizer, texts: list[str]) -> list[int]:
    if not texts:
        return []
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _prompt_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text)["input_ids"])


def _check_depths(depths: Sequence[float]) -> list[float]:
    depths = [float(d) for d in depths]
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"`depths` must be a non-empty list of fractions in [0, 1], got {depths}.")
    return depths


def _check_positive(name: str, values) -> list[int]:
    values = [values] if isinstance(values, int) else list(values)
    if not values or any(not isinstance(v, int) or v <= 0 for v in values):
        raise ValueError(f"`{name}` must be positive integers, got {values}.")
    return values


def _filler_lines(tokenizer, texts: list[str], budget: int, rng: random.Random) -> tuple[list[str], list[int]]:
    """Consecutive non-empty lines of ``texts`` from a random start, until their token count reaches ``budget``."""
    lines, counts, total = [], [], 0
    doc = rng.randrange(len(texts))
    start = None
    for _ in range(len(texts) + 1):
        doc_lines = [ln + "\n" for ln in texts[doc].split("\n") if ln.strip()]
        if start is None:
            start = rng.randrange(max(1, len(doc_lines) - 1))
        for i in range(start, len(doc_lines), 64):
            chunk = doc_lines[i : i + 64]
            for ln, c in zip(chunk, _count_tokens(tokenizer, chunk)):
                if lines and total + c / 2 > budget:  # stop at the line boundary nearest to the budget
                    return lines, counts
                lines.append(ln)
                counts.append(c)
                total += c
        doc, start = (doc + 1) % len(texts), 0
    if not lines:
        raise ValueError(f"the filler texts hold fewer than {budget} tokens; pass longer `filler_texts`.")
    return lines, counts


def _default_filler(split: str) -> list[str]:
    from .data import corpus_texts

    return corpus_texts(split)


def needle_in_haystack(
    tokenizer,
    context_lengths: Sequence[int] = (256, 512),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    num_needles: int = 4,
    samples: int = 4,
    seed: int = 0,
    filler_texts: list[str] | None = None,
    filler_split: str = "validation",
    needle_template: str = NIAH_NEEDLE,
    question_template: str = NIAH_QUESTION,
    answer_template: str = NIAH_ANSWER,
    value_range: tuple[int, int] = (10, 99),
) -> list[ProbeExample]:
    """Needle-in-a-haystack examples: ``samples`` per (context length, depth) cell.

    ``num_needles`` key–value needles (``needle_template``, keys are two random words joined by ``_``, values
    distinct integers in ``value_range``) are inserted between lines of filler text (``filler_texts``, default the
    embedded corpus' ``filler_split``); the queried needle sits at ``depth`` (fraction of the filler tokens before
    it), the others at random depths. The prompt (``<filler with needles><question>``) is about
    ``context_length`` tokens. Candidates: the values of all needles, so chance is ``1 / num_needles``.
    """
    context_lengths = _check_positive("context_lengths", context_lengths)
    depths = _check_depths(depths)
    (num_needles,) = _check_positive("num_needles", num_needles)
    (samples,) = _check_positive("samples", samples)
    lo, hi = value_range
    if hi - lo + 1 < num_needles:
        raise ValueError(f"`value_range` {value_range} holds fewer than num_needles={num_needles} distinct values.")
    texts = filler_texts if filler_texts is not None else _default_filler(filler_split)
    examples = []
    for length in context_lengths:
        for depth in depths:
            for s in range(samples):
                rng = seeded_rng(seed, "niah", length, depth, s)
                keys = ["_".join(rng.sample(WORDS, 2)) for _ in range(num_needles)]
                while len(set(keys)) < num_needles:  # vanishingly rare; keep keys distinct
                    keys = ["_".join(rng.sample(WORDS, 2)) for _ in range(num_needles)]
                values = rng.sample(range(lo, hi + 1), num_needles)
                needles = [needle_template.format(key=k, value=v) for k, v in zip(keys, values)]
                question = question_template.format(key=keys[0])
                overhead = sum(_count_tokens(tokenizer, needles + [question])) + 1  # +1: bos
                budget = max(1, length - overhead)
                lines, counts = _filler_lines(tokenizer, texts, budget, rng)
                # Insertion slot i = before filler line i (len(lines) = after the last line): the line boundary
                # whose share of filler tokens before it is nearest to `depth`.
                bounds = [0]
                for c in counts:
                    bounds.append(bounds[-1] + c)
                slot = min(range(len(bounds)), key=lambda i: abs(bounds[i] - depth * bounds[-1]))
                slots = {slot: [0]}
                for j in range(1, num_needles):
                    slots.setdefault(rng.randrange(len(lines) + 1), []).append(j)
                parts, evidence = [], None
                offset = 0
                for i in range(len(lines) + 1):
                    for j in rng.sample(slots.get(i, []), len(slots.get(i, []))):
                        if j == 0:
                            value_at = needles[0].rfind(str(values[0]))
                            evidence = (offset + value_at, offset + value_at + len(str(values[0])))
                        parts.append(needles[j])
                        offset += len(needles[j])
                    if i < len(lines):
                        parts.append(lines[i])
                        offset += len(lines[i])
                prompt = "".join(parts) + question
                examples.append(
                    ProbeExample(
                        probe="niah",
                        prompt=prompt,
                        answer=answer_template.format(value=values[0]),
                        candidates=[answer_template.format(value=v) for v in values],
                        context_length=length,
                        depth=depth,
                        n_tokens=_prompt_tokens(tokenizer, prompt),
                        evidence_span=evidence,
                        question_start=offset,
                        meta={"key": keys[0], "sample": s},
                    )
                )
    return examples


def associative_recall(
    tokenizer,
    num_pairs: Sequence[int] = (16, 32),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    samples: int = 4,
    seed: int = 0,
    pair_template: str = MQAR_PAIR,
    query_template: str = MQAR_QUERY,
    answer_template: str = MQAR_ANSWER,
    value_range: tuple[int, int] = (10, 99),
    num_candidates: int = 8,
) -> list[ProbeExample]:
    """Multi-query associative recall: ``samples`` sequences per number of pairs, one query per depth each.

    A sequence lists ``n`` key–value pairs (``pair_template``), then queries the pairs at positions
    ``round(depth·(n−1))`` for every depth, in random order; the prompt of each query holds the earlier queries
    with their answers (teacher forcing). Candidates: the true value plus ``num_candidates − 1`` other values of
    the same sequence (chance ``1 / num_candidates``).
    """
    num_pairs = _check_positive("num_pairs", num_pairs)
    depths = _check_depths(depths)
    (samples,) = _check_positive("samples", samples)
    lo, hi = value_range
    if min(num_pairs) < 2 or num_candidates < 2:
        raise ValueError(f"`num_pairs` must be >= 2 and `num_candidates` >= 2, got {num_pairs}, {num_candidates}.")
    if hi - lo + 1 < max(num_pairs):
        raise ValueError(f"`value_range` {value_range} holds fewer distinct values than num_pairs={max(num_pairs)}.")
    examples = []
    for n in num_pairs:
        for s in range(samples):
            rng = seeded_rng(seed, "mqar", n, s)
            keys = set()
            while len(keys) < n:
                keys.add("_".join(rng.sample(WORDS, 2)))
            keys = rng.sample(sorted(keys), n)
            values = rng.sample(range(lo, hi + 1), n)
            pairs = [pair_template.format(key=k, value=v) for k, v in zip(keys, values)]
            starts = [sum(map(len, pairs[:i])) for i in range(n)]
            context = "".join(pairs)
            queried = [(d, round(d * (n - 1))) for d in depths]
            rng.shuffle(queried)
            prefix = context
            for depth, idx in queried:
                question = query_template.format(key=keys[idx])
                prompt = prefix + question
                value_at = starts[idx] + pairs[idx].rfind(str(values[idx]))
                others = rng.sample([v for i, v in enumerate(values) if i != idx], min(num_candidates, n) - 1)
                candidates = [answer_template.format(value=v) for v in [values[idx], *others]]
                rng.shuffle(candidates)
                answer = answer_template.format(value=values[idx])
                examples.append(
                    ProbeExample(
                        probe="mqar",
                        prompt=prompt,
                        answer=answer,
                        candidates=candidates,
                        context_length=n,
                        depth=depth,
                        n_tokens=_prompt_tokens(tokenizer, prompt),
                        evidence_span=(value_at, value_at + len(str(values[idx]))),
                        question_start=len(prefix),
                        meta={"key": keys[idx], "sample": s, "pair_index": idx},
                    )
                )
                prefix = prompt + answer + "\n"
    return examples


def mqar_sequences(examples: list[ProbeExample]) -> list[str]:
    """The full MQAR sequences (context, then every query with its answer): the training form of MQAR."""
    last = {}
    for ex in examples:
        if ex.probe != "mqar":
            raise ValueError(f"mqar_sequences() takes MQAR examples, got probe {ex.probe!r}.")
        key = (ex.context_length, ex.meta["sample"])
        if key not in last or len(ex.prompt) > len(last[key].prompt):
            last[key] = ex
    return [ex.text + "\n" for ex in last.values()]


def icl_shuffled(
    tokenizer,
    num_demos: Sequence[int] = (8, 16),
    num_classes: int = 4,
    num_orders: int = 4,
    samples: int = 4,
    seed: int = 0,
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    demo_template: str = ICL_DEMO,
    query_template: str = ICL_QUERY,
    answer_template: str = ICL_ANSWER,
) -> list[ProbeExample]:
    """In-context learning with shuffled demonstrations: ``samples`` episodes per demonstration count.

    An episode draws ``num_classes`` class prefixes and ``num_classes`` label words (random per episode, so the
    mapping exists only in context), ``k`` demonstrations ``<prefix>_<number> → label`` covering every class, and
    one query item (a new number with a seen prefix). The same demonstrations are shown in ``num_orders`` random
    orders (``meta["order"]``): accuracy per order measures robustness to permutation. Depth: position of the last
    demonstration of the query's class, rounded to the nearest of ``depths``. Candidates: all labels.
    """
    num_demos = _check_positive("num_demos", num_demos)
    depths = _check_depths(depths)
    (num_classes,) = _check_positive("num_classes", num_classes)
    (num_orders,) = _check_positive("num_orders", num_orders)
    (samples,) = _check_positive("samples", samples)
    if num_classes < 2 or 2 * num_classes > len(WORDS) or min(num_demos) < num_classes:
        raise ValueError(
            f"`num_classes` must be in [2, {len(WORDS) // 2}] and every `num_demos` >= num_classes; "
            f"got num_classes={num_classes}, num_demos={num_demos}."
        )
    examples = []
    for k in num_demos:
        for s in range(samples):
            rng = seeded_rng(seed, "icl", k, s)
            words = rng.sample(WORDS, 2 * num_classes)
            prefixes, labels = words[:num_classes], words[num_classes:]
            classes = list(range(num_classes)) + [rng.randrange(num_classes) for _ in range(k - num_classes)]
            numbers = rng.sample(range(100, 1000), k + 1)
            demos = [(f"{prefixes[c]}_{numbers[i]}", labels[c], c) for i, c in enumerate(classes)]
            target = rng.randrange(num_classes)
            query_item = f"{prefixes[target]}_{numbers[k]}"
            for order in range(num_orders):
                shuffled = rng.sample(demos, k)
                lines = [demo_template.format(item=item, label=label) for item, label, _ in shuffled]
                last = max(i for i, (_, _, c) in enumerate(shuffled) if c == target)
                start = sum(map(len, lines[:last]))
                label_at = start + lines[last].rfind(labels[target])
                context = "".join(lines)
                prompt = context + query_template.format(item=query_item)
                rel = last / (k - 1) if k > 1 else 1.0
                examples.append(
                    ProbeExample(
                        probe="icl",
                        prompt=prompt,
                        answer=answer_template.format(label=labels[target]),
                        candidates=[answer_template.format(label=lab) for lab in labels],
                        context_length=k,
                        depth=min(depths, key=lambda d: abs(d - rel)),
                        n_tokens=_prompt_tokens(tokenizer, prompt),
                        evidence_span=(label_at, label_at + len(labels[target])),
                        question_start=len(context),
                        meta={"sample": s, "order": order, "query": query_item},
                    )
                )
    return examples


def make_probe(name: str, tokenizer, **kwargs) -> list[ProbeExample]:
    """Examples of the probe ``name`` (one of ``PROBES``); ``kwargs`` go to its generator."""
    generators = {"niah": needle_in_haystack, "mqar": associative_recall, "icl": icl_shuffled}
    if name not in generators:
        raise ValueError(f"probe must be one of {PROBES}, got {name!r}.")
    return generators[name](tokenizer, **kwargs)


# ----------------------------------------------------------------------------------------------- scoring


@torch.no_grad()
def candidate_logprobs(model, tokenizer, prompt: str, candidates: Sequence[str]) -> torch.Tensor:
    """Total log-probability of each candidate continuation after ``prompt``, float32 ``(len(candidates),)``.

    The prompt is tokenised with the tokenizer's special tokens (e.g. ``<s>``), each candidate without, and the
    ids concatenated (the lm-evaluation-harness convention, so a candidate's tokens do not depend on the prompt).
    The prompt runs once; its KV cache is repeated for the candidates, right-padded to a common length.
    """
    device = model.device
    prompt_ids = torch.tensor([tokenizer(prompt)["input_ids"]], device=device)
    cand_ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in candidates]
    if not cand_ids or any(not ids for ids in cand_ids):
        raise ValueError(f"every candidate must tokenise to at least one token, got {list(candidates)!r}.")
    out = model(input_ids=prompt_ids, use_cache=True)
    first = torch.log_softmax(out.logits[0, -1].float(), -1).cpu()
    scores = torch.stack([first[ids[0]] for ids in cand_ids])
    longest = max(len(ids) for ids in cand_ids)
    if longest == 1:
        return scores
    num, pad = len(cand_ids), tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rest = torch.full((num, longest - 1), pad, dtype=torch.long, device=device)
    valid = torch.zeros(num, longest - 1, dtype=torch.bool, device=device)
    for i, ids in enumerate(cand_ids):
        rest[i, : len(ids) - 1] = torch.tensor(ids[:-1], device=device)
        valid[i, : len(ids) - 1] = True
    mask = torch.cat([torch.ones(num, prompt_ids.shape[1], dtype=torch.long, device=device), valid.long()], 1)
    cache = getattr(out, CACHE_NAME, None)
    if hasattr(cache, "batch_repeat_interleave"):
        cache.batch_repeat_interleave(num)
        logits = model(input_ids=rest, attention_mask=mask, **{CACHE_NAME: cache}, use_cache=True).logits
    else:  # a model without a transformers Cache: run the full sequences (same numbers, more compute)
        full = torch.cat([prompt_ids.expand(num, -1), rest], 1)
        logits = model(input_ids=full, attention_mask=mask, use_cache=False).logits[:, prompt_ids.shape[1] :]
    logp = torch.log_softmax(logits.float(), -1)  # position j predicts candidate token j + 1
    for i, ids in enumerate(cand_ids):
        if len(ids) > 1:
            targets = torch.tensor(ids[1:], device=device)
            scores[i] += logp[i, : len(ids) - 1].gather(-1, targets[:, None]).sum().cpu()
    return scores


@torch.no_grad()
def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The greedy continuation of ``prompt`` (``generate(do_sample=False)``), decoded."""
    ids = torch.tensor([tokenizer(prompt)["input_ids"]], device=model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@dataclass
class ProbeRecord:
    """One scored example: the example's fields plus ``prediction`` and ``correct``."""

    probe: str
    context_length: int
    depth: float
    n_tokens: int
    answer: str
    prediction: str
    correct: bool
    meta: dict = field(default_factory=dict)


def evaluate(
    model, tokenizer, examples: Sequence[ProbeExample], scoring: str = "logits", progress: bool = False
) -> list[ProbeRecord]:
    """Score ``examples`` with ``model`` (any transformers causal LM); see the module docstring for the scorings."""
    if scoring not in SCORINGS:
        raise ValueError(f"`scoring` must be one of {SCORINGS}, got {scoring!r}.")
    was_training = model.training
    model.eval()
    records = []
    iterator = examples
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(examples, desc="probes", leave=False)
    try:
        for ex in iterator:
            if scoring == "logits":
                scores = candidate_logprobs(model, tokenizer, ex.prompt, ex.candidates)
                prediction = ex.candidates[int(scores.argmax())]
                correct = prediction == ex.answer
            else:
                longest = max(len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in ex.candidates)
                prediction = greedy_continuation(model, tokenizer, ex.prompt, longest)
                correct = prediction.lstrip().startswith(ex.answer.strip())
            records.append(
                ProbeRecord(
                    ex.probe,
                    ex.context_length,
                    ex.depth,
                    ex.n_tokens,
                    ex.answer,
                    prediction,
                    bool(correct),
                    dict(ex.meta),
                )
            )
    finally:
        model.train(was_training)
    return records


# ----------------------------------------------------------------------------------------------- reports


def accuracy(records: Sequence[ProbeRecord]) -> float:
    if not records:
        raise ValueError("no records to score.")
    return sum(r.correct for r in records) / len(records)


@dataclass
class AccuracyTable:
    """Accuracy by context length (rows) and depth (columns); ``cells[(length, depth)] = (accuracy, count)``."""

    probe: str
    lengths: list[int]
    depths: list[float]
    cells: dict[tuple[int, float], tuple[float, int]]
    mean_tokens: dict[int, float]
    overall: float

    def to_json(self) -> dict:
        return {
            "probe": self.probe,
            "overall": self.overall,
            "rows": [
                {
                    "context_length": L,
                    "mean_tokens": self.mean_tokens[L],
                    "depth": d,
                    "accuracy": self.cells[(L, d)][0],
                    "n": self.cells[(L, d)][1],
                }
                for L in self.lengths
                for d in self.depths
                if (L, d) in self.cells
            ],
        }


LENGTH_UNITS = {"niah": "tokens", "mqar": "pairs", "icl": "demos"}


def accuracy_table(records: Sequence[ProbeRecord]) -> AccuracyTable:
    """Group ``records`` (one probe) by (context length, depth) and average ``correct``."""
    probes = {r.probe for r in records}
    if len(probes) != 1:
        raise ValueError(f"accuracy_table() takes the records of one probe, got {sorted(probes)}.")
    groups: dict[tuple[int, float], list[bool]] = defaultdict(list)
    tokens: dict[int, list[int]] = defaultdict(list)
    for r in records:
        groups[(r.context_length, r.depth)].append(r.correct)
        tokens[r.context_length].append(r.n_tokens)
    return AccuracyTable(
        probe=probes.pop(),
        lengths=sorted({k[0] for k in groups}),
        depths=sorted({k[1] for k in groups}),
        cells={k: (sum(v) / len(v), len(v)) for k, v in groups.items()},
        mean_tokens={L: sum(v) / len(v) for L, v in tokens.items()},
        overall=accuracy(records),
    )


def format_table(table: AccuracyTable) -> str:
    """Markdown: one row per context length, one column per depth, plus the row mean; cells ``acc`` (0–1)."""
    unit = LENGTH_UNITS.get(table.probe, "length")
    head = (
        f"| {table.probe}: {unit} (mean prompt tokens) | "
        + " | ".join(f"depth {d:g}" for d in table.depths)
        + " | all |"
    )
    lines = [head, "|---" * (len(table.depths) + 2) + "|"]
    for L in table.lengths:
        cells = [table.cells.get((L, d)) for d in table.depths]
        row_n = sum(c[1] for c in cells if c)
        row_acc = sum(c[0] * c[1] for c in cells if c) / row_n
        lines.append(
            f"| {L} ({table.mean_tokens[L]:.0f}) | "
            + " | ".join("–" if c is None else f"{c[0]:.2f}" for c in cells)
            + f" | {row_acc:.2f} |"
        )
    lines.append(f"\noverall accuracy {table.overall:.3f} over {sum(c[1] for c in table.cells.values())} items")
    return "\n".join(lines)


def order_accuracies(records: Sequence[ProbeRecord]) -> dict[int, float]:
    """ICL: accuracy per demonstration order (``meta["order"]``), over all episodes; the spread is the paper's
    robustness-to-permutation measure."""
    groups: dict[int, list[bool]] = defaultdict(list)
    for r in records:
        if "order" not in r.meta:
            raise ValueError("order_accuracies() needs ICL records (meta['order']).")
        groups[r.meta["order"]].append(r.correct)
    return {o: sum(v) / len(v) for o, v in sorted(groups.items())}


def plot_accuracy_heatmap(table: AccuracyTable, path: str, title: str | None = None) -> str:
    """PNG heatmap of ``table``: context length (rows) × depth (columns), accuracy annotated in each cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.full((len(table.lengths), len(table.depths)), np.nan)
    for i, L in enumerate(table.lengths):
        for j, d in enumerate(table.depths):
            if (L, d) in table.cells:
                grid[i, j] = table.cells[(L, d)][0]
    fig, ax = plt.subplots(figsize=(1.1 * len(table.depths) + 2.5, 0.6 * len(table.lengths) + 1.8))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(table.depths)), [f"{d:g}" for d in table.depths])
    unit = LENGTH_UNITS.get(table.probe, "length")
    ax.set_yticks(range(len(table.lengths)), [f"{L} ({table.mean_tokens[L]:.0f} tok)" for L in table.lengths])
    ax.set_xlabel("depth of the evidence (0 = start of context, 1 = end)")
    ax.set_ylabel(f"context: {unit}")
    ax.set_title(title or f"{table.probe}: accuracy {table.overall:.2f}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def records_to_json(records: Sequence[ProbeRecord]) -> list[dict]:
    return [asdict(r) for r in records]


__all__ = [
    "PROBES",
    "SCORINGS",
    "AccuracyTable",
    "ProbeExample",
    "ProbeRecord",
    "accuracy",
    "accuracy_table",
    "associative_recall",
    "candidate_logprobs",
    "evaluate",
    "format_table",
    "greedy_continuation",
    "icl_shuffled",
    "make_probe",
    "mqar_sequences",
    "needle_in_haystack",
    "order_accuracies",
    "plot_accuracy_heatmap",
    "records_to_json",
]
