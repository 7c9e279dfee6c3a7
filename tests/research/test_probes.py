"""Synthetic probes (difftransformer.research.probes): generation, determinism, scoring, tables and heatmaps."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from difftransformer.compat_difftransformer import CACHE_NAME
from difftransformer.research import probes
from difftransformer.research.data import corpus_texts, train_tokenizer


@pytest.fixture(scope="module")
def tok():
    # A small BPE trained on a slice of the embedded corpus: fast, and real (multi-token numbers and words).
    return train_tokenizer(corpus_texts("train", max_chars=60_000), vocab_size=400)


@pytest.fixture(scope="module")
def filler():
    return corpus_texts("validation", max_chars=40_000)


def tiny(kind, vocab, seed=0):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
    )
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    return DiffTransformerForCausalLM(DiffTransformerConfig(diff_version=int(kind[1]), **common)).eval()


def test_needle_in_haystack_structure(tok, filler):
    examples = probes.needle_in_haystack(
        tok, context_lengths=(128, 256), depths=(0.0, 0.5, 1.0), num_needles=3, samples=2, seed=0, filler_texts=filler
    )
    assert len(examples) == 2 * 3 * 2
    for ex in examples:
        value = ex.answer.strip()
        assert ex.prompt[slice(*ex.evidence_span)] == value  # the evidence span is the queried needle's value
        assert ex.prompt[ex.question_start :] == f"assert {ex.meta['key']} =="
        assert f"{ex.meta['key']} = {value}\n" in ex.prompt
        assert ex.answer in ex.candidates and len(set(ex.candidates)) == len(ex.candidates) == 3
        # every needle is in the context exactly once
        assert sum(ex.prompt.count(f" = {c.strip()}\n") >= 1 for c in ex.candidates) == 3
        assert abs(ex.n_tokens - ex.context_length) <= 0.25 * ex.context_length
        assert ex.n_tokens == len(tok(ex.prompt)["input_ids"])
        # the queried needle sits at the requested depth of the context (in tokens), up to line granularity
        before = len(tok(ex.prompt[: ex.evidence_span[0]])["input_ids"])
        context = len(tok(ex.prompt[: ex.question_start])["input_ids"])
        longest_line = max(len(tok(line)["input_ids"]) for line in ex.prompt[: ex.question_start].splitlines())
        assert abs(before - ex.depth * context) <= 2 * longest_line, (before, context, ex.depth, longest_line)


def test_probes_are_deterministic_per_seed(tok, filler):
    kwargs = dict(filler_texts=filler, context_lengths=(96,), samples=2)
    a = probes.needle_in_haystack(tok, seed=5, **kwargs)
    b = probes.needle_in_haystack(tok, seed=5, **kwargs)
    c = probes.needle_in_haystack(tok, seed=6, **kwargs)
    assert [x.prompt for x in a] == [x.prompt for x in b] and [x.answer for x in a] == [x.answer for x in b]
    assert [x.prompt for x in a] != [x.prompt for x in c]
    # a cell does not depend on which other cells are generated
    only = probes.needle_in_haystack(tok, seed=5, depths=(0.5,), **kwargs)
    assert [x.prompt for x in only] == [x.prompt for x in a if x.depth == 0.5]
    for gen in (probes.associative_recall, probes.icl_shuffled):
        assert [x.prompt for x in gen(tok, seed=1, samples=2)] == [x.prompt for x in gen(tok, seed=1, samples=2)]
        assert [x.prompt for x in gen(tok, seed=1, samples=2)] != [x.prompt for x in gen(tok, seed=2, samples=2)]


def test_associative_recall_multi_query_teacher_forcing(tok):
    examples = probes.associative_recall(
        tok, num_pairs=(8,), depths=(0.0, 0.5, 1.0), samples=1, seed=0, num_candidates=4
    )
    assert len(examples) == 3
    for i, ex in enumerate(examples):
        assert ex.prompt[slice(*ex.evidence_span)] == ex.answer.strip()
        assert ex.meta["pair_index"] == round(ex.depth * 7)
        assert ex.answer in ex.candidates and len(ex.candidates) == 4
        # later queries see the earlier queries answered correctly
        for earlier in examples[:i]:
            assert f"assert {earlier.meta['key']} =={earlier.answer}\n" in ex.prompt
    (sequence,) = probes.mqar_sequences(examples)
    assert sequence == examples[-1].text + "\n"


def test_icl_shuffled_orders_share_demonstrations(tok):
    examples = probes.icl_shuffled(tok, num_demos=(8,), num_classes=3, num_orders=3, samples=2, seed=0)
    assert len(examples) == 2 * 3
    by_episode = {}
    for ex in examples:
        by_episode.setdefault(ex.meta["sample"], []).append(ex)
        demos = ex.prompt[: ex.question_start].splitlines()
        assert len(demos) == 8
        prefix = ex.meta["query"].rsplit("_", 1)[0]
        labels = {d.split('"')[3] for d in demos if d.startswith(f'assert label("{prefix}_')}
        assert labels == {ex.answer.strip().strip('"')}  # the query's class label is defined by the demos
        assert ex.meta["query"] not in ex.prompt[: ex.question_start]  # a new item: generalise, not look up
        assert ex.prompt[slice(*ex.evidence_span)] == ex.answer.strip().strip('"')
        assert ex.depth in (0.0, 0.25, 0.5, 0.75, 1.0)
    for orders in by_episode.values():
        contexts = [o.prompt[: o.question_start] for o in orders]
        assert len({tuple(sorted(c.splitlines())) for c in contexts}) == 1  # same demonstrations ...
        assert len(set(contexts)) > 1  # ... in different orders
        assert len({o.answer for o in orders}) == 1


def test_bad_arguments_are_named(tok, filler):
    with pytest.raises(ValueError, match="depths"):
        probes.needle_in_haystack(tok, depths=(1.5,), filler_texts=filler)
    with pytest.raises(ValueError, match="num_needles"):
        probes.needle_in_haystack(tok, num_needles=0, filler_texts=filler)
    with pytest.raises(ValueError, match="num_classes"):
        probes.icl_shuffled(tok, num_demos=(2,), num_classes=3)
    with pytest.raises(ValueError, match="probe must be one of"):
        probes.make_probe("nope", tok)
    with pytest.raises(ValueError, match="scoring"):
        probes.evaluate(tiny("llama", len(tok)), tok, [], scoring="beam")


@pytest.mark.parametrize("kind", ["llama", "v1", "v2"])
def test_candidate_logprobs_match_full_sequence_scoring(tok, kind):
    """The cached, batched scorer equals scoring each full sequence prompt + candidate from scratch."""
    model = tiny(kind, len(tok))
    prompt = 'assert label("maple_417") == "ember"\nassert label("maple_902") =='
    candidates = [' "ember"', ' "quartz"', ' "x"', " 7"]
    got = probes.candidate_logprobs(model, tok, prompt, candidates)
    p = tok(prompt)["input_ids"]
    for cand, score in zip(candidates, got, strict=True):
        c = tok(cand, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), -1)
        expected = sum(logp[len(p) - 1 + j, t] for j, t in enumerate(c))
        torch.testing.assert_close(score, expected, atol=1e-4, rtol=1e-4)
    assert any(len(tok(c, add_special_tokens=False)["input_ids"]) > 2 for c in candidates)  # multi-token path used

    class NoCache(torch.nn.Module):  # a causal LM that returns no transformers Cache: the full-sequence fallback
        def __init__(self, inner):
            super().__init__()
            self.inner, self.device = inner, inner.device

        def forward(self, **kwargs):
            kwargs.pop(CACHE_NAME, None)
            out = self.inner(**{**kwargs, "use_cache": False})
            setattr(out, CACHE_NAME, None)
            return out

    torch.testing.assert_close(
        probes.candidate_logprobs(NoCache(model), tok, prompt, candidates), got, atol=1e-4, rtol=1e-4
    )


def _bigram_model(vocab, table):
    """Hand-set 1-layer Llama that predicts ``table[current token]`` (and nothing in particular elsewhere):
    one-hot embeddings (hidden size = vocab), attention and MLP outputs zeroed, lm_head = the bigram table."""
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=vocab,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
        )
    ).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(torch.eye(vocab))
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for current, nxt in table.items():
            model.lm_head.weight[nxt, current] = 5.0  # RMSNorm of a one-hot row is sqrt(vocab) = 20: logit 100
    return model


def test_a_model_that_always_gives_the_answer_scores_100_percent(tok):
    """A model hand-set to continue every prompt with one value scores 1.0 on the examples whose answer is that
    value and 0.0 on those where it is a wrong candidate, with both scorings (multi-token answers)."""
    examples = probes.associative_recall(tok, num_pairs=(6,), samples=4, seed=0, num_candidates=4, value_range=(1, 9))
    target = examples[0].answer
    answer_ids = tok(target, add_special_tokens=False)["input_ids"]
    assert len(answer_ids) == 2  # " 1" -> "Ġ", "1" with this small vocabulary: the multi-token path is exercised
    table = {tok(e.prompt)["input_ids"][-1]: answer_ids[0] for e in examples}
    table[answer_ids[0]] = answer_ids[1]
    model = _bigram_model(len(tok), table)
    right = [e for e in examples if e.answer == target]
    wrong = [e for e in examples if e.answer != target and target in e.candidates]
    assert right and wrong
    for scoring in probes.SCORINGS:
        assert probes.accuracy(probes.evaluate(model, tok, right, scoring=scoring)) == 1.0
        assert probes.accuracy(probes.evaluate(model, tok, wrong, scoring=scoring)) == 0.0
    assert all(r.prediction == target for r in probes.evaluate(model, tok, wrong))


def test_accuracy_table_markdown_and_heatmap(tok, filler, tmp_path):
    examples = probes.needle_in_haystack(
        tok, context_lengths=(64, 96), depths=(0.0, 1.0), num_needles=2, samples=2, seed=0, filler_texts=filler
    )
    model = tiny("v2", len(tok))
    records = probes.evaluate(model, tok, examples)
    assert len(records) == len(examples)
    assert records == probes.evaluate(model, tok, examples)  # deterministic
    table = probes.accuracy_table(records)
    assert table.lengths == [64, 96] and table.depths == [0.0, 1.0]
    assert all(n == 2 for _, n in table.cells.values())
    manual = sum(r.correct for r in records) / len(records)
    assert table.overall == manual
    assert table.cells[(64, 0.0)][0] == sum(r.correct for r in records if (r.context_length, r.depth) == (64, 0.0)) / 2
    md = probes.format_table(table)
    assert md.splitlines()[0].startswith("| niah: tokens") and len(md.splitlines()) >= 4
    png = probes.plot_accuracy_heatmap(table, str(tmp_path / "acc.png"))
    assert open(png, "rb").read(4) == b"\x89PNG"
    with pytest.raises(ValueError, match="one probe"):
        probes.accuracy_table(
            records + probes.evaluate(model, tok, probes.associative_recall(tok, num_pairs=(4,), samples=1))
        )
    icl = probes.evaluate(model, tok, probes.icl_shuffled(tok, num_demos=(4,), num_orders=3, samples=2))
    orders = probes.order_accuracies(icl)
    assert sorted(orders) == [0, 1, 2] and all(0.0 <= v <= 1.0 for v in orders.values())
