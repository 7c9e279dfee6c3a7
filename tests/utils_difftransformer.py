"""Test-only helpers that do not belong in the package: the "contract_sdpa" attention function, registered with
transformers when this module is imported.

The float64 reference of docs/model.md ("What it computes"), the bfloat16 rounding model, the tiny configs and the
tolerances live in one place, ``difftransformer.testing_utils``, which the tests and the GPU check
(benchmarks/gpu_check.py) import, so that both judge a result by the same numbers. They are re-exported here for the
tests that import them from this module.
"""

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from difftransformer.testing_utils import (  # noqa: F401 (re-exported)
    FP32_LOGITS_ATOL,
    GDA_LAYOUTS,
    GRAD_RTOL,
    LAYOUTS,
    ROUNDING_DRAWS,
    ROUNDING_FACTOR,
    SCORES_ATOL,
    RoundingModel,
    bf16_error_bound,
    bf16_gradient_bounds,
    greedy_with_scores,
    left_padded_batch,
    randomize_norms,
    reference_attention,
    reference_differential_attention,
    reference_forward,
    tiny_config,
)

# Shapes of every call the "contract_sdpa" attention function received: a test that selects it asserts that the
# model really went through it (so the contract checks below cannot pass by not running).
CONTRACT_CALLS: list[tuple] = []


def _contract_sdpa(module, query, key, value, attention_mask, **kwargs):
    """The flash-attention contract, asserted on every call: equal q/k/v head sizes, whole GQA groups, k/v alike;
    then transformers' sdpa does the work. Registered as ``attn_implementation="contract_sdpa"``."""
    assert query.shape[-1] == key.shape[-1] == value.shape[-1], (query.shape, key.shape, value.shape)
    assert key.shape == value.shape, (key.shape, value.shape)
    assert query.shape[1] % key.shape[1] == 0 and query.shape[1] // key.shape[1] == module.num_key_value_groups
    assert query.shape[-1] <= 256  # flash kernels' largest head size
    CONTRACT_CALLS.append((tuple(query.shape), tuple(key.shape)))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("contract_sdpa", _contract_sdpa)
AttentionMaskInterface.register("contract_sdpa", sdpa_mask)
