"""Never silent: a request the model cannot serve as asked warns, naming what serves it.

* ``output_attentions=True`` under the default ``attn_implementation="sdpa"``, where a call runs one of the package's
  own kernels (which bypass transformers' sdpa function and the warning it logs there), warns once naming
  ``attn_implementation="eager"``; following that advice gives the differential maps.
"""

import logging

import pytest
import torch
from transformers.utils import logging as hf_logging

from difftransformer import DiffTransformerForCausalLM
from difftransformer.testing_utils import tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EAGER_ADVICE = 'attn_implementation="eager"'


@pytest.fixture
def fresh_warnings(caplog):
    """transformers' ``warning_once`` remembers every message it logged in this process: forget them, so that a warning
    an earlier test triggered is logged again here."""
    hf_logging.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING):
        yield caplog
    hf_logging.warning_once.cache_clear()


def advice(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if EAGER_ADVICE in r.getMessage()]


def tiny_model(layout: str) -> DiffTransformerForCausalLM:
    torch.manual_seed(0)
    model = DiffTransformerForCausalLM(tiny_config(layout, max_position_embeddings=512)).eval()
    assert model.config._attn_implementation == "sdpa"
    return model


@pytest.mark.parametrize(
    "layout,length,kernel",
    [("v1_gqa", 12, "blocked"), ("v2_gqa", 256, "causal_blocks")],  # V2: a float32 CPU prompt of 256+ tokens
)
def test_output_attentions_under_sdpa_warns_once_naming_eager(fresh_warnings, layout, length, kernel):
    model = tiny_model(layout)
    ids = torch.randint(3, 97, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(2):
            out = model(ids, output_attentions=True, use_cache=False)
    assert model.model.layers[0].self_attn.last_kernel == kernel  # one of the package's own kernels ran
    assert out.attentions == ()
    warned = advice(fresh_warnings)
    assert len(warned) == 1 and "output_attentions" in warned[0], warned

    fresh_warnings.clear()
    model.set_attn_implementation("eager")  # the advice, followed
    with torch.no_grad():
        out = model(ids, output_attentions=True, use_cache=False)
    assert len(out.attentions) == model.config.num_hidden_layers
    assert out.attentions[0].shape == (2, model.config.num_diff_heads, length, length)
    assert not advice(fresh_warnings)


def test_generate_with_output_attentions_under_sdpa_warns_naming_eager(fresh_warnings):
    """V1's prefill (the blocked kernel) and its decode steps (the decode kernel) under generate()."""
    model = tiny_model("v1_gqa")
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    out = model.generate(ids, max_new_tokens=3, do_sample=False, output_attentions=True, return_dict_in_generate=True)
    assert all(step == () for step in out.attentions)
    assert len(advice(fresh_warnings)) == 1


def test_output_attentions_false_under_sdpa_does_not_warn(fresh_warnings):
    model = tiny_model("v1_gqa")
    with torch.no_grad():
        model(torch.randint(3, 97, (1, 8)), use_cache=False)
    assert not advice(fresh_warnings)
