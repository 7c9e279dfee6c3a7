"""The decode step's kernel launches: one decode step of a DIFF V1 / V2 layer dispatches at most 4 / 2 more operations
than the same-shape transformers Llama layer (issue: a decode step on a GPU is bound by the host, every launch costs
about as much as a layer's arithmetic for one token). A test of operation counts, not of time.

What is counted: every ATen operation a decoder layer dispatches (a ``TorchDispatchMode``) that can launch a kernel —
not views, not ``empty`` allocations, not ``_unsafe_view`` — with one call each for what is one kernel on CUDA but
decomposes on a CPU: SDPA, ``rms_norm`` (both ``torch.nn.functional`` calls, fenced by a ``TorchFunctionMode``) and
the decode epilogues of difftransformer/kernels/triton/epilogue.py (one Triton launch each, run here through Triton's
interpreter). The models run CUDA's kernel choice (``set_differential_kernel(device_type="cuda")``; for V2 the same as
every device's), with λ kept between steps (V1) and the norm's scaled weight too.
"""

import collections
import contextlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel runs: Triton's CPU interpreter

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM  # noqa: E402
from difftransformer import modeling_difftransformer as mdt  # noqa: E402
from difftransformer.kernels import triton as triton_kernels  # noqa: E402
from difftransformer.kernels.triton import attention as triton_difftransformer  # noqa: E402

pytestmark = [
    pytest.mark.skipif(triton_difftransformer.triton is None, reason="triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="TRITON_INTERPRET was set to something else"),
]

SHAPE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
)
# Operations that launch no kernel: allocations without a fill, metadata-only reshapes, dtype arithmetic.
NO_KERNEL = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.promote_types.default,
    torch.ops.aten.result_type.Tensor,
    torch.ops.aten.result_type.Scalar,
}
ONE_KERNEL_ON_CUDA = {F.scaled_dot_product_attention, F.rms_norm, torch.rms_norm}
# The decode epilogues (one Triton launch each), where the model's files call them.
LAUNCHES = ((triton_kernels, "v1_combine_norm"), (triton_kernels, "v2_sigmoid_combine"))  # what the model calls


class LayerOps(TorchDispatchMode):
    """The operations each decoder layer dispatches (``layer`` is set by forward hooks; None outside layers)."""

    def __init__(self):
        super().__init__()
        self.layer, self.fenced, self.ops = None, 0, collections.defaultdict(list)

    def record(self, name):
        if self.layer is not None:
            self.ops[self.layer].append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.fenced and not func.is_view and func not in NO_KERNEL:
            self.record(str(func))
        return func(*args, **(kwargs or {}))


class OneCall(TorchFunctionMode):
    """Counts each call of ``ONE_KERNEL_ON_CUDA`` once, and nothing it dispatches."""

    def __init__(self, counter: LayerOps):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in ONE_KERNEL_ON_CUDA:
            return func(*args, **(kwargs or {}))
        return _fenced(self.counter, func.__name__, func, *args, **(kwargs or {}))


def _fenced(counter, name, func, *args, **kwargs):
    counter.record(name)
    counter.fenced += 1
    try:
        return func(*args, **kwargs)
    finally:
        counter.fenced -= 1


@pytest.fixture
def cuda_choices(monkeypatch):
    """The launch counters' monkeypatch; the models take CUDA's kernel choices on this CPU through the public setting
    (``set_differential_kernel(device_type="cuda")``: the decode epilogues run through Triton's interpreter)."""
    return monkeypatch


def _decode_step_ops(model, layers, dtype, cache_implementation, monkeypatch=None) -> list[list[str]]:
    """Per layer, the operations of one decode step after a left-padded prompt of 6 tokens."""
    counter = LayerOps()
    if monkeypatch is not None:
        for module, name in LAUNCHES:
            launch = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _f=launch, _n=name, **k: _fenced(counter, _n, _f, *a, **k))
    hooks = [
        h
        for i, layer in enumerate(layers)
        for h in (
            layer.register_forward_pre_hook(lambda m, a, i=i: setattr(counter, "layer", i)),
            layer.register_forward_hook(lambda m, a, o: setattr(counter, "layer", None)),
        )
    ]
    model = model.to(dtype).eval()
    ids = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0
    try:
        cache = (
            DynamicCache(config=model.config)
            if cache_implementation == "dynamic"
            else StaticCache(config=model.config, max_cache_len=8)
        )
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # generate() runs in fixed_parameters(); a Llama has no such block.
        block = getattr(model, "fixed_parameters", contextlib.nullcontext)
        with block(), torch.no_grad():
            model(ids[:, :6], attention_mask=mask[:, :6], position_ids=positions[:, :6], cache=cache, use_cache=True)
            with OneCall(counter), counter:
                model(ids[:, 6:], attention_mask=mask, position_ids=positions[:, 6:], cache=cache, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    return [counter.ops[i] for i in range(len(layers))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_decode_step_launches_at_most_a_few_more_kernels_than_a_llama(cuda_choices, dtype, cache):
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**SHAPE, attn_implementation="sdpa"))
    baseline = _decode_step_ops(llama, llama.model.layers, dtype, cache)
    assert baseline[0] == baseline[1] and baseline[0].count("scaled_dot_product_attention") == 1
    for version, budget in ((1, 4), (2, 2)):
        torch.manual_seed(0)
        model = DiffTransformerForCausalLM(
            DiffTransformerConfig(**SHAPE, diff_version=version, attn_implementation="sdpa")
        )
        model.set_differential_kernel(device_type="cuda")
        ops = _decode_step_ops(model, model.model.layers, dtype, cache, cuda_choices)
        extra = collections.Counter(ops[0]) - collections.Counter(baseline[0])
        assert ops[0] == ops[1], f"V{version}: the layers differ"
        assert len(ops[0]) - len(baseline[0]) <= budget, (
            f"V{version} ({dtype}, {cache} cache): {len(ops[0])} operations per layer against the Llama's "
            f"{len(baseline[0])}; beyond the Llama's: {dict(extra)}"
        )
        assert {m.last_kernel for m in model.modules() if isinstance(m, mdt.DiffTransformerAttention)} == {
            "sdpa_two_calls" if version == 1 else "rows_decode"
        }


def test_the_counter_sees_a_recomputed_lambda(cuda_choices):
    """The count can fail: V1's λ recomputed at every step (what the cache of computed_from_parameters saves) costs
    more than the budget."""
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**SHAPE, attn_implementation="sdpa"))
    baseline = _decode_step_ops(llama, llama.model.layers, torch.float32, "dynamic")
    model = DiffTransformerForCausalLM(DiffTransformerConfig(**SHAPE, diff_version=1, attn_implementation="sdpa"))
    model.set_differential_kernel(device_type="cuda")
    cuda_choices.setattr(
        mdt.DiffTransformerV1Attention,
        "lambda_full",
        lambda self: self._lambda_from(self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2),
    )
    ops = _decode_step_ops(model, model.model.layers, torch.float32, "dynamic", cuda_choices)
    assert len(ops[0]) - len(baseline[0]) > 4


@pytest.mark.parametrize(
    "layout",
    [
        dict(diff_version=1),
        dict(diff_version=1, num_noise_heads=2),
        dict(diff_version=2),
        dict(diff_version=2, num_noise_heads=2, num_key_value_heads=2),
    ],
    ids=["v1", "v1-gda", "v2", "v2-gda"],
)
def test_decode_with_the_epilogues_equals_uncached_greedy_decoding(cuda_choices, layout):
    """With CUDA's choices and the Triton epilogues, cached greedy decoding (dynamic and static cache, left padding)
    decodes what uncached decoding decodes, and the decode step's logits match eager's within float32 rounding."""
    torch.manual_seed(1)
    model = DiffTransformerForCausalLM(DiffTransformerConfig(**(SHAPE | layout), attn_implementation="sdpa")).eval()
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    model.set_attn_implementation("eager")
    ref = model.generate(ids, use_cache=False, **kwargs)
    model.set_attn_implementation("sdpa")
    model.set_differential_kernel(device_type="cuda")
    launches = []
    for module, name in LAUNCHES:
        launch = getattr(module, name)
        cuda_choices.setattr(module, name, lambda *a, _f=launch, _n=name, **k: launches.append(_n) or _f(*a, **k))
    for cache in ("dynamic", "static"):
        launches.clear()
        out = model.generate(ids, cache_implementation=cache, **kwargs)
        assert len(launches) == 3 * model.config.num_hidden_layers, launches  # every decode step of every layer
        assert torch.equal(out.sequences, ref.sequences), cache
        for got, want in zip(out.scores, ref.scores):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_cuda_choices_on_a_cpu_are_a_public_setting():
    """``set_differential_kernel(device_type="cuda")`` is how a CPU runs CUDA's choices (these tests' set-up): the plan
    is CUDA's table, and a device type the table does not know is an error naming the allowed values."""
    model = DiffTransformerForCausalLM(DiffTransformerConfig(**SHAPE, diff_version=1, attn_implementation="sdpa"))
    assert model.kernel_plan() == mdt.DEFAULT_KERNELS[(1, "cpu")]
    model.set_differential_kernel(device_type="cuda")
    assert model.kernel_plan() == mdt.DEFAULT_KERNELS[(1, "cuda")]
    with pytest.raises(ValueError, match="device_type must be None, 'cuda' or 'cpu', got 'tpu'"):
        model.set_differential_kernel(device_type="tpu")
    model.set_differential_kernel()
    assert model.kernel_plan() == mdt.DEFAULT_KERNELS[(1, "cpu")]
