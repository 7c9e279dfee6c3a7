"""V1 inside the model through the one-pass Triton kernel (``model.set_differential_kernel("triton")``; on CUDA the
default is stock SDPA, docs/model.md "Kernels"), on the CPU through Triton's interpreter: the modeling file's dispatch,
its sdpa-convention adapter and the kernel together, against the float64 reference, uncached greedy decoding and eager's
gradients.

The kernel's own tests (every gradient, masks, GQA factors, GDA, decode, dtypes) are
tests/kernels/test_triton_difftransformer.py.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel runs: Triton's CPU interpreter

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import CompileConfig  # noqa: E402

from difftransformer import DiffTransformerForCausalLM  # noqa: E402
from difftransformer import modeling_difftransformer as mdt  # noqa: E402
from difftransformer.kernels.triton import attention as triton_difftransformer  # noqa: E402
from difftransformer.testing_utils import (  # noqa: E402
    FP32_LOGITS_ATOL,
    GRAD_RTOL,
    SCORES_ATOL,
    left_padded_batch,
    randomize_norms,
    reference_forward,
    tiny_config,
)

pytestmark = [
    pytest.mark.skipif(triton_difftransformer.triton is None, reason="triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="TRITON_INTERPRET was set to something else"),
    pytest.mark.usefixtures("one_torch_thread"),
]


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Every V1 layer built here runs the Triton kernel (``model.set_differential_kernel("triton")``'s choice, as a
    class default), counting its calls."""
    calls = []
    kernel = mdt.differential_attention_triton

    def counted(query, *args, **kwargs):
        calls.append(tuple(query.shape))
        return kernel(query, *args, **kwargs)

    monkeypatch.setattr(mdt.DiffTransformerAttention, "kernel", "triton")
    monkeypatch.setattr(mdt, "differential_attention_triton", counted)
    return calls


def _model(layout, seed=0):
    torch.manual_seed(seed)
    model = DiffTransformerForCausalLM(tiny_config(layout)).eval()
    randomize_norms(model, seed)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("layout", ["v1_gqa", "v1_gda4"])
def test_left_padded_logits_equal_the_float64_reference(layout, triton_on_cpu):
    model = _model(layout)
    ids, mask = left_padded_batch(model.config.vocab_size, [7, 4], seed=3)
    logits = model(ids, attention_mask=mask).logits
    assert len(triton_on_cpu) == model.config.num_hidden_layers  # one kernel call per layer
    ref, _ = reference_forward(model, ids, mask)
    rows = mask.bool()
    torch.testing.assert_close(logits[rows].double(), ref[rows], atol=FP32_LOGITS_ATOL, rtol=0)


def test_cached_greedy_decoding_equals_uncached(triton_on_cpu):
    """Prefill and every decode step through the kernel (dynamic and static cache; the static cache's prefill has no
    mask, transformers' top-left causal convention) against uncached greedy decoding on the CPU kernels."""
    model = _model("v1_gqa")
    ids, mask = left_padded_batch(model.config.vocab_size, [6, 4], seed=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.set_differential_kernel("auto")  # the CPU kernels
    ref = model.generate(ids, use_cache=False, **kwargs)
    model.set_differential_kernel("triton")
    for cache in ({}, {"cache_implementation": "static"}):
        triton_on_cpu.clear()
        assert torch.equal(model.generate(ids, **cache, **kwargs), ref), cache
        assert sum(shape[1] == 1 for shape in triton_on_cpu) == 3 * model.config.num_hidden_layers  # decode steps


def test_training_gradients_equal_eagers(triton_on_cpu):
    """A left-padded batch whose loss reads no padding row (a padding query sees no key: eager's additive mask gives it
    a uniform row, SDPA-style kernels zeros; neither may reach the loss)."""
    model = _model("v1_gqa").train()
    ids, mask = left_padded_batch(model.config.vocab_size, [6, 4], seed=7)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)  # the label a padding row would predict
    grads = {}
    for attn in ("eager", "sdpa"):
        model.zero_grad()
        model.set_attn_implementation(attn)
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads[attn] = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert triton_on_cpu, "the sdpa step did not run the Triton kernel"
    assert grads["sdpa"].keys() == grads["eager"].keys()
    for name, grad in grads["eager"].items():
        torch.testing.assert_close(
            grads["sdpa"][name], grad, rtol=GRAD_RTOL, atol=GRAD_RTOL * grad.abs().max().item(), msg=name
        )


def _recording_backend(graphs: list, backend: str):
    """A torch.compile backend that keeps each graph dynamo traces, then compiles it with ``backend``. A function (not
    a counter object): generate() deep-copies its CompileConfig, and functions are copied by reference."""

    def compile_graph(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    return compile_graph


def _kernel_ops(graphs: list) -> list[str]:
    """The calls of this package's custom ops (torch.ops.difftransformer) in the traced graphs."""
    return [
        str(node.target)
        for gm in graphs
        for node in gm.graph.nodes
        if node.op == "call_function" and str(node.target).startswith("difftransformer.")
    ]


def test_compiled_model_runs_the_kernel(monkeypatch):
    """Under torch.compile(fullgraph=True) V1 takes the one-pass kernel, as a custom op in the compiled graph (one
    ``difftransformer::diff_attn_v1_inference`` call per layer; the padded call, whose query padding would fail here,
    never runs): a left-padded prompt's logits equal eager's, and generate()'s compiled static-cache decode steps
    decode eager's sequence with its scores. Both compile with ``aot_eager`` (AOT autograd's graphs, run as eager runs
    their ops) for CI time: inductor's C++ for a whole decode step takes ~45 s on two cold CPU cores (it passes the same
    checks); tests/kernels/test_triton_difftransformer.py compiles the kernel's ops with inductor, gradients
    included."""
    monkeypatch.setattr(mdt.DiffTransformerAttention, "kernel", "triton")

    def no_padded_call(*args, **kwargs):
        raise AssertionError("V1 took the padded call instead of the Triton kernel")

    monkeypatch.setattr(mdt, "query_padding", no_padded_call)
    model = _model("v1_gqa")
    layers = model.config.num_hidden_layers
    ids, mask = left_padded_batch(model.config.vocab_size, [7, 4], seed=3)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(model, fullgraph=True, backend=_recording_backend(graphs, "aot_eager"))
    with torch.no_grad():
        logits = compiled(ids, attention_mask=mask).logits
    assert _kernel_ops(graphs) == ["difftransformer.diff_attn_v1_inference.default"] * layers
    rows = mask.bool()
    torch.testing.assert_close(logits[rows], ref[rows], atol=FP32_LOGITS_ATOL, rtol=0)

    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=3,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    ref = model.generate(ids, **kwargs)
    torch._dynamo.reset()
    graphs.clear()
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=_recording_backend(graphs, "aot_eager"))
    compile_config._compile_all_devices = True  # generate() compiles only on accelerators unless this is set
    out = model.generate(ids, cache_implementation="static", compile_config=compile_config, **kwargs)
    torch._dynamo.reset()
    assert hasattr(model, "_compiled_call"), "generate() did not take the compiled decode path"
    ops = _kernel_ops(graphs)  # one call per layer in each compiled decode graph (one graph: static shapes)
    assert ops and set(ops) == {"difftransformer.diff_attn_v1_inference.default"} and len(ops) % layers == 0
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=SCORES_ATOL, rtol=0)
