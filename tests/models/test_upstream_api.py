"""The model follows the installed transformers' API and refuses what it would otherwise silently ignore.

transformers 5.24 renamed the cache argument ``past_key_values`` to ``cache``; a model whose ``**kwargs`` swallowed the
new name decoded every step without its past. These tests hold on every release the package supports (CI runs them on
the lowest, the pinned and the newest): greedy decoding with each cache equals a plain loop over full forwards, the
deprecated name works exactly while transformers accepts it, and the next rename (simulated here by passing the cache
under another name) or a decoding step that lost its cache raises an error naming the argument and the version.
"""

import warnings

import pytest
import torch
import transformers
from transformers import DynamicCache

from difftransformer import DiffTransformerForCausalLM
from difftransformer.compat_difftransformer import CACHE_NAME, CACHE_RENAMED
from difftransformer.testing_utils import left_padded_batch, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LAYOUTS = ["v1_gqa", "v2_gqa", "v1_mha", "v2_mha"]
NEW_TOKENS = 8


def _model(layout, attn="sdpa", seed=0):
    torch.manual_seed(seed)
    model = DiffTransformerForCausalLM(tiny_config(layout)).eval()
    model.set_attn_implementation(attn)
    model.generation_config.eos_token_id = None
    return model


def _greedy_loop(model, ids):
    """Greedy decoding by full forwards over the whole sequence, no cache and no generate(): the ground truth."""
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            next_token = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_token], dim=1)
    return ids


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_generate_with_its_default_cache_equals_a_loop_of_full_forwards(layout, attn):
    model = _model(layout, attn)
    ids, _ = left_padded_batch(model.config.vocab_size, [9], seed=3)
    expected = _greedy_loop(model, ids)
    for kwargs in ({}, {"use_cache": False}, {"cache_implementation": "static"}):
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **kwargs)
        assert torch.equal(out, expected), (kwargs, out, expected)


def test_outputs_carry_the_cache_under_the_installed_releases_field():
    model = _model("v2_gqa")
    ids = torch.randint(3, 97, (1, 5))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = getattr(out, CACHE_NAME)
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 5
    assert CACHE_NAME == ("cache" if CACHE_RENAMED else "past_key_values")
    # generate() reads the field of its own release: the same field name as transformers' own outputs
    assert CACHE_NAME in transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_both_cache_names_decode_identically_and_the_old_one_warns_only_where_deprecated(layout):
    model = _model(layout)
    ids = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[:, -1]
        for name in ("cache", "past_key_values"):
            cache = DynamicCache(config=model.config)
            model(ids[:, :-1], **{name: cache}, use_cache=True)
            assert cache.get_seq_length() == 6, name  # the forward wrote into the cache it was given
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step = model(ids[:, -1:], **{name: cache}, use_cache=True).logits[:, -1]
            torch.testing.assert_close(step, full, atol=1e-5, rtol=0)
            deprecation = [w for w in caught if "past_key_values" in str(w.message)]
            assert bool(deprecation) == (name == "past_key_values" and CACHE_RENAMED), (name, caught)


def test_passing_the_cache_under_both_names_is_an_error():
    model = _model("v2_gqa")
    ids = torch.randint(3, 97, (1, 4))
    with pytest.raises(ValueError, match="both `cache` and `past_key_values`"):
        model(ids, cache=DynamicCache(config=model.config), past_key_values=DynamicCache(config=model.config))


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_a_cache_under_a_name_the_model_does_not_read_raises(layout):
    """The next rename, simulated: the cache arrives under a name this release does not use."""
    model = _model(layout)
    ids = torch.randint(3, 97, (1, 4))
    with pytest.raises(TypeError, match=rf"DynamicCache as `kv_cache`.*transformers {transformers.__version__}"):
        model(ids, kv_cache=DynamicCache(config=model.config))


def test_generate_passing_its_cache_under_a_renamed_argument_raises(monkeypatch):
    """generate() itself renames the cache argument (as 5.24 did): the first forward raises instead of decoding every
    step without its past."""
    model = _model("v2_gqa")
    prepare = type(model).prepare_inputs_for_generation

    def renamed(self, *args, **kwargs):
        inputs = prepare(self, *args, **kwargs)
        for old in ("cache", "past_key_values"):
            if old in inputs:
                inputs["kv_cache"] = inputs.pop(old)
        return inputs

    monkeypatch.setattr(type(model), "prepare_inputs_for_generation", renamed)
    with pytest.raises(TypeError, match="`kv_cache`"):
        model.generate(torch.randint(3, 97, (1, 4)), max_new_tokens=3, do_sample=False)


def test_an_unknown_keyword_argument_warns_once_with_its_name_and_the_version():
    """Saved folders carry the modeling code frozen: a harmless keyword a later transformers passes must not break
    them, so an unknown keyword warns (once per name) instead of raising; the output is the one without it."""
    from transformers.testing_utils import CaptureLogger

    from difftransformer import compat_difftransformer

    compat_difftransformer._WARNED_UNKNOWN.clear()
    model = _model("v1_gqa")
    ids = torch.randint(3, 97, (1, 4))
    expected = model(ids).logits
    with CaptureLogger(compat_difftransformer.logger) as captured:
        logits = model(ids, token_type_ids=torch.zeros_like(ids)).logits
        model(ids, token_type_ids=torch.zeros_like(ids))
        model(ids, output_lambda=True)  # a typo of a real flag
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    warned = [line for line in captured.out.splitlines() if "ignores the keyword argument" in line]
    assert len(warned) == 2, captured.out
    assert "'token_type_ids'" in warned[0] and f"transformers {transformers.__version__}" in warned[0]
    assert "'output_lambda'" in warned[1]


def test_known_passed_on_arguments_are_accepted():
    """Flags, the loss's arguments and the packed-sequence lengths that transformers' layers read pass."""
    model = _model("v2_gqa")
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        out = model(
            ids,
            labels=ids,
            output_attentions=False,
            output_hidden_states=True,
            output_lambdas=True,
            num_items_in_batch=torch.tensor(10),
            ignore_index=-100,
            return_dict=True,
        )
    assert out.loss is not None and len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert len(out.lambdas) == model.config.num_hidden_layers


@pytest.mark.parametrize("layout", ["v1_gqa", "v2_gqa"])
def test_a_decoding_step_without_its_cache_raises(layout):
    """A lost cache: the next token at position T with no cache (or an empty one) holding the T earlier tokens."""
    model = _model(layout)
    ids = torch.randint(3, 97, (2, 6))
    position = torch.full((2, 1), 6)
    with torch.no_grad():
        model(ids, use_cache=True)  # the prefill whose cache gets lost
        with pytest.raises(
            ValueError, match=rf"position_ids starting at 6 but no cache.*transformers {transformers.__version__}"
        ):
            model(ids[:, -1:], position_ids=position, use_cache=False)
        with pytest.raises(ValueError, match="an empty cache"):
            model(ids[:, -1:], position_ids=position, cache=DynamicCache(config=model.config), use_cache=True)


def test_left_padded_full_forwards_without_a_cache_are_not_mistaken_for_lost_caches():
    model = _model("v2_gqa")
    ids, mask = left_padded_batch(model.config.vocab_size, [7, 3], seed=2)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    position_ids = position_ids.masked_fill(mask == 0, 1)  # what generate() passes for padding
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, use_cache=False, pad_token_id=0)
    assert out.shape == (2, 10)
