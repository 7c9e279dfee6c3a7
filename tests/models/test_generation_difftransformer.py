"""KV caches and generate(): every exact cache gives the uncached result, the quantized one within its error; sampling
draws from the model's own distribution; the cache holds a Llama's bytes."""

import pytest
import torch
from transformers import CompileConfig, DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from difftransformer import DiffTransformerForCausalLM
from difftransformer.compat_difftransformer import CACHE_NAME
from difftransformer.testing_utils import greedy_with_scores, left_padded_batch, tiny_config
from utils_difftransformer import CONTRACT_CALLS

LAYOUTS = ["v1_gqa", "v1_mha", "v2_gqa", "v2_mha"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(layout, attn="sdpa", seed=0, **overrides):
    torch.manual_seed(seed)
    model = DiffTransformerForCausalLM(tiny_config(layout, **overrides)).eval()
    model.set_attn_implementation(attn)
    model.generation_config.eos_token_id = None  # fixed-length outputs, comparable across batch layouts
    return model


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn", ["sdpa", "eager", "contract_sdpa"])
def test_dynamic_and_static_cache_equal_uncached_greedy(layout, attn):
    """contract_sdpa: the single standard call that flash/flex kernels receive, with a cache (its checks assert the
    flash contract on every call, prefill and decode)."""
    model = _model(layout, attn)
    ids, _ = left_padded_batch(model.config.vocab_size, [7], seed=5)
    ref_seq, ref_scores = greedy_with_scores(model, ids, use_cache=False)
    for kwargs in ({}, {"cache_implementation": "static"}):
        CONTRACT_CALLS.clear()
        seq, scores = greedy_with_scores(model, ids, **kwargs)
        assert torch.equal(seq, ref_seq), kwargs
        torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=0)
        if attn == "contract_sdpa":  # one call per layer per step; decode calls see one query token
            assert len(CONTRACT_CALLS) == 10 * model.config.num_hidden_layers
            assert sum(q[2] == 1 for q, _ in CONTRACT_CALLS) == 9 * model.config.num_hidden_layers


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_compiled_static_cache_decode(layout):
    model = _model(layout)
    ids, _ = left_padded_batch(model.config.vocab_size, [6], seed=6)
    ref_seq, ref_scores = greedy_with_scores(model, ids, use_cache=False)
    torch._dynamo.reset()
    compile_config = CompileConfig(fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True  # generate() compiles only on accelerators unless this is set
    seq, scores = greedy_with_scores(model, ids, cache_implementation="static", compile_config=compile_config)
    assert hasattr(model, "_compiled_call"), "generate() did not take the compiled decode path"
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=0)


def _confident_model(layout, period=11, steps=60):
    """A model trained (60 Adam steps, ~1 s) to continue a cycle of `period` tokens: greedy choices with clear
    margins, as a trained LM has on confident continuations (a random model's top-2 logits are near ties)."""
    model = _model(layout)
    cycle = torch.randperm(model.config.vocab_size - 3, generator=torch.Generator().manual_seed(0))[:period] + 3
    batch = torch.stack([cycle[(start + torch.arange(24)) % period] for start in range(8)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        model(batch, labels=batch).loss.backward()
        optimizer.step()
    return model.eval(), cycle


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_quantized_cache_greedy_equals_uncached_where_margins_exceed_the_quantization_error(
    layout, quanto_without_its_compiled_kernel
):
    """The quantized cache stores keys/values in 4 bits: decoding logits are off by their quantization error `err`.
    Greedy output equals the uncached greedy output at every step whose top-2 logit margin exceeds 2·err (then no
    perturbation of at most err per logit can change the argmax). On a model with clear margins, every step does."""
    model, cycle = _confident_model(layout)
    ids = cycle[torch.arange(3, 9) % len(cycle)][None]
    cache_config = {"backend": "quanto", "nbits": 4, "q_group_size": 8, "residual_length": 2}
    out = model.generate(
        ids,
        max_new_tokens=20,
        do_sample=False,
        cache_implementation="quantized",
        cache_config=cache_config,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert type(getattr(out, CACHE_NAME)).__name__ == "QuantizedCache"
    uncached, _ = greedy_with_scores(model, ids, use_cache=False, max_new_tokens=20)
    assert torch.equal(out.sequences, uncached)

    # Teacher-forced: the uncached model on the generated tokens gives the exact logits of every step.
    scores = torch.stack(out.scores)[:, 0]
    with torch.no_grad():
        exact = model(out.sequences).logits[0, ids.shape[1] - 1 : -1]
    err = (scores - exact).abs().amax(-1)
    top2 = exact.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    assert (margin > 2 * err).all(), (margin, err)  # why the equality above holds (not luck)
    assert err[0] < 1e-4  # the prompt's keys/values are used unquantized in the prefill step
    assert err[1:].max() > 1e-3  # later steps really read quantized keys/values

    # What the cache holds is each head's own keys and values, 4-bit rounded: dequantized, every layer's keys and
    # values equal the exact ones of the same tokens (a DynamicCache filled by one forward) within a few 4-bit steps
    # (a step is 1/15 of a group's range, about 2/15 of the largest value; the residual re-quantizes), and the same
    # tensors with their KV heads swapped, the mistake a wrong cache layout makes, are over 8 times farther off.
    exact_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(out.sequences[:, :-1], **{CACHE_NAME: exact_cache}, use_cache=True)
    stored_cache = getattr(out, CACHE_NAME)
    assert len(stored_cache.layers) == len(exact_cache.layers) == model.config.num_hidden_layers
    for layer, (stored_layer, exact_layer) in enumerate(zip(stored_cache.layers, exact_cache.layers)):
        for name in ("keys", "values"):
            residual = getattr(stored_layer, name)
            stored = getattr(stored_layer, f"_quantized_{name}").dequantize()
            stored = torch.cat([stored, residual], dim=-2) if residual.dim() == 4 else stored
            want = getattr(exact_layer, name)
            assert stored.shape == want.shape and want.shape[1] >= 2, (layer, name, stored.shape, want.shape)
            right = (stored - want).abs().max() / want.abs().max()
            swapped = (stored - want.flip(1)).abs().max() / want.abs().max()
            assert right < 0.12 and swapped > 8 * right, (layer, name, right.item(), swapped.item())


def test_the_quantized_cache_tests_unpack_equals_quantos_compiled_kernel():
    """The quantized-cache tests run quanto with a torch unpack (``utils_quanto.unpack_bits``, through conftest's
    ``quanto_without_its_compiled_kernel``); where quanto's C++ kernel is already built in this venv, both give the
    same bits (building it here would cost the minutes the stand-in saves)."""
    pytest.importorskip("optimum.quanto", reason="the quantized cache's quanto backend needs optimum-quanto")
    import os

    from optimum.quanto.library.extensions import get_extension

    from utils_quanto import unpack_bits

    ext = get_extension("quanto_cpp")
    if not os.path.exists(os.path.join(ext.build_directory, "pytorch_version.txt")):
        pytest.skip("quanto's C++ kernel is not built in this venv (the quantized-cache tests do not need it)")
    gen = torch.Generator().manual_seed(0)
    for shape in [(64, 33), (7, 5, 3)]:
        packed = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        for bits in (2, 4):
            assert torch.equal(ext.lib.unpack(packed, bits), unpack_bits(packed, bits)), (shape, bits)


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_batched_left_padding_equals_each_prompt_alone(layout, attn):
    model = _model(layout, attn)
    lengths = [8, 5, 3]
    ids, mask = left_padded_batch(model.config.vocab_size, lengths, seed=8)
    batch_seq, batch_scores = greedy_with_scores(model, ids, mask)
    for b, length in enumerate(lengths):
        alone_seq, alone_scores = greedy_with_scores(model, ids[b : b + 1, -length:])
        assert torch.equal(batch_seq[b, -(length + 10) :], alone_seq[0])
        torch.testing.assert_close(batch_scores[:, b], alone_scores[:, 0], atol=1e-4, rtol=0)


def _cache_bytes(cache):
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize("layout", ["v1_gqa", "v1_mha", "v2_gqa"])
def test_cache_holds_exactly_a_llamas_bytes(layout):
    model = _model(layout)
    cfg = model.config
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
        )
    ).eval()
    ids = torch.randint(3, cfg.vocab_size, (2, 9))
    ours, theirs = DynamicCache(config=cfg), DynamicCache(config=llama.config)
    with torch.no_grad():
        model(ids, **{CACHE_NAME: ours}, use_cache=True)
        llama(ids, **{CACHE_NAME: theirs}, use_cache=True)
    assert _cache_bytes(ours) == _cache_bytes(theirs) > 0
    # and one cache update per layer: the cache has exactly num_hidden_layers layers, each with 9 positions
    assert len(ours.layers) == cfg.num_hidden_layers and ours.get_seq_length() == 9
    ours_static = StaticCache(config=cfg, max_cache_len=16)
    theirs_static = StaticCache(config=llama.config, max_cache_len=16)
    with torch.no_grad():
        model(ids, **{CACHE_NAME: ours_static}, use_cache=True)
        llama(ids, **{CACHE_NAME: theirs_static}, use_cache=True)
    assert _cache_bytes(ours_static) == _cache_bytes(theirs_static) > 0
    # not only the bytes: the very tensor shapes (B, Hkv, S, d), which caches sized from the config allocate
    for mine, llamas in ((ours, theirs), (ours_static, theirs_static)):
        assert [tuple(x.keys.shape) for x in mine.layers] == [tuple(x.keys.shape) for x in llamas.layers]
        assert [tuple(x.values.shape) for x in mine.layers] == [tuple(x.values.shape) for x in llamas.layers]


@pytest.mark.parametrize("layout", ["v1_gqa", "v1_mha", "v2_gqa"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_caches_allocated_from_the_config_before_the_first_step(layout, attn):
    """transformers' export wrapper, chunked prefill and any `StaticCache(config=...)` followed by
    `early_initialization` allocate `(num_key_value_heads, head_dim)` per layer from the config (transformers'
    `get_head_shapes` reads those two fields) before the model writes anything: prefill plus cached steps must give
    the uncached logits."""
    model = _model(layout, attn)
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
        cache = StaticCache(config=cfg, max_cache_len=16)
        cache.early_initialization(
            batch_size=2, num_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=torch.float32, device="cpu"
        )
        steps = [model(ids[:, :6], **{CACHE_NAME: cache}, use_cache=True).logits]
        steps += [model(ids[:, t : t + 1], **{CACHE_NAME: cache}, use_cache=True).logits for t in range(6, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), ref, atol=1e-5, rtol=1e-5)


def _peaked_model(layout):
    """Logits spread 10 times wider than a random init's (whose next-token probabilities are nearly uniform)."""
    model = _model(layout)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    return model


SAMPLING = {"top_k": dict(top_k=5, temperature=0.7), "top_p": dict(top_k=0, top_p=0.8, temperature=0.7)}


def _allowed(logits, temperature=1.0, top_k=0, top_p=1.0):
    """By hand: the tokens that temperature + top-k or top-p sampling may draw, from raw logits (..., V)."""
    scaled = logits / temperature
    if top_k:
        return scaled >= scaled.topk(top_k, dim=-1).values[..., -1:]
    p = scaled.softmax(-1)
    more_probable_mass = (p[..., None, :] * (p[..., None, :] > p[..., :, None])).sum(-1)
    return more_probable_mass < top_p  # the smallest set of most probable tokens whose mass reaches top_p


@pytest.mark.parametrize("warper", sorted(SAMPLING))
@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_sampling_draws_every_token_from_the_models_top_k_or_top_p_set(layout, warper):
    model = _peaked_model(layout)
    ids, mask = left_padded_batch(model.config.vocab_size, [6, 4], seed=9)
    kwargs = dict(
        do_sample=True,
        max_new_tokens=8,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        **SAMPLING[warper],
    )
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=mask, **kwargs)
    torch.manual_seed(0)
    assert torch.equal(
        model.generate(ids, attention_mask=mask, **kwargs).sequences, out.sequences
    )  # seeded: reproducible
    prompt_len = ids.shape[1]
    new = out.sequences[:, prompt_len:]
    logits, scores = torch.stack(out.logits, 1), torch.stack(out.scores, 1)  # (B, steps, V): raw, after the warpers
    assert logits.shape == scores.shape == (2, 8, model.config.vocab_size)

    # The raw logits of every step are the uncached model's on the sampled sequence (the cache is right when sampling).
    full_mask = torch.cat([mask, torch.ones_like(new)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        exact = model(out.sequences, attention_mask=full_mask, position_ids=positions).logits[:, prompt_len - 1 : -1]
    torch.testing.assert_close(logits, exact, atol=1e-4, rtol=0)
    # The warpers keep exactly the hand-computed set, scaled by the temperature, and every draw comes from it.
    allowed = _allowed(logits, **SAMPLING[warper])
    assert torch.equal(scores.isfinite(), allowed)
    torch.testing.assert_close(scores[allowed], (logits / SAMPLING[warper]["temperature"])[allowed])
    assert allowed.gather(-1, new[..., None]).all()
    assert (allowed.sum(-1) >= 2).all() and (allowed.sum(-1) < model.config.vocab_size // 2).all()  # real restriction
    assert (new != logits.argmax(-1)).any()  # sampling, not greedy


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_sampled_token_frequencies_are_the_softmax_probabilities(layout):
    """4000 draws of the first new token: each token's frequency is its softmax(logits / T) probability, within five
    binomial standard deviations (a count is Binomial(n, p)); another temperature, or greedy, would not fit."""
    model = _peaked_model(layout)
    ids, _ = left_padded_batch(model.config.vocab_size, [6], seed=3)
    n, temperature = 4000, 0.8
    torch.manual_seed(0)
    out = model.generate(
        ids, do_sample=True, top_k=0, temperature=temperature, max_new_tokens=1, num_return_sequences=n, pad_token_id=0
    )
    freq = torch.bincount(out[:, -1], minlength=model.config.vocab_size).double() / n
    with torch.no_grad():
        logits = model(ids).logits[0, -1].double()

    def fits(p):
        return bool(((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1 / n).all())

    assert fits(torch.softmax(logits / temperature, -1))
    assert not fits(torch.softmax(logits, -1))  # the temperature is applied
    assert not fits(torch.nn.functional.one_hot(logits.argmax(), model.config.vocab_size).double())


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_beam_search_and_assisted_generation(layout):
    model = _model(layout)
    ids, mask = left_padded_batch(model.config.vocab_size, [6, 4], seed=9)

    # Beam search reorders the cache between steps: with and without cache it must agree.
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(
        model.generate(ids, attention_mask=mask, **beams),
        model.generate(ids, attention_mask=mask, use_cache=False, **beams),
    )

    # Assisted (speculative) decoding crops the cache on rejection; greedy output must be unchanged.
    assistant = _model(layout, seed=1, num_hidden_layers=1)
    single = ids[:1]
    greedy = model.generate(single, max_new_tokens=10, do_sample=False)
    assert torch.equal(model.generate(single, assistant_model=assistant, max_new_tokens=10, do_sample=False), greedy)
    assert torch.equal(model.generate(single, prompt_lookup_num_tokens=3, max_new_tokens=10, do_sample=False), greedy)


def test_flex_attention_generate_or_skip_with_the_upstream_reason():
    """flex_attention in generate(): compared with eager uncached greedy decoding where torch can compile it on CPU.

    torch 2.13's inductor fails to compile flex attention's one-token decode kernel on CPU (a C++ codegen error,
    `cur_kvSplitSize0` undeclared) for transformers' own Llama too; then this test is skipped with that reason.
    """
    from torch._inductor.exc import InductorError

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=97,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=8,
        )
    ).eval()
    llama.set_attn_implementation("flex_attention")
    ids, mask = left_padded_batch(97, [7, 4], seed=5)
    try:
        llama.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    except InductorError as err:
        torch._dynamo.reset()  # a failed compile leaves inductor state that breaks later flex compiles in this process
        pytest.skip(
            f"torch {torch.__version__} cannot compile flex-attention decoding on this CPU, for Llama too: "
            f"{str(err)[:200]}"
        )
    for layout in ("v1_gqa", "v2_gqa"):
        model = _model(layout, "flex_attention")
        seq, scores = greedy_with_scores(model, ids, mask)
        ref_seq, ref_scores = greedy_with_scores(_model(layout, "eager"), ids, mask, use_cache=False)
        assert torch.equal(seq, ref_seq)
        torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=0)
