"""Low-bit attention (difftransformer.research.lowbit): the unquantised path is eager's arithmetic, quantisation moves
each logit by at most half its grid step, V1's padded queries and packed keys quantise as their unpadded heads,
statistics."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from difftransformer.research import lowbit

KINDS = ("llama", "v1", "v2")


def tiny(kind, seed=0, dtype=torch.float64):
    common = dict(
        vocab_size=53,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        version = int(kind[1])  # a V2 config refuses V1's fields (lambda_std)
        model = DiffTransformerForCausalLM(
            DiffTransformerConfig(diff_version=version, **common, **({"lambda_std": 0.3} if version == 1 else {}))
        )
    return model.to(dtype).eval()


def batch():
    torch.manual_seed(1)
    ids = torch.randint(0, 53, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding in the second row: the mask must reach the logits path too
    return ids, mask


@pytest.mark.parametrize("kind", KINDS)
def test_unquantised_paths_reproduce_eager(kind):
    """float64: the delegating path (target=None, no recorder) is eager itself; the logits path (with a recorder)
    recomputes eager's arithmetic in another order of a few float64 operations: agreement to 1e-12."""
    model = tiny(kind)
    ids, mask = batch()
    model.set_attn_implementation("eager")
    ref = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    with lowbit.low_bit_attention(model, target=None):
        same = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    recorder = lowbit.LogitRecorder()
    with lowbit.low_bit_attention(model, target=None, recorder=recorder):
        recomputed = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert model.config._attn_implementation == "eager"  # restored
    torch.testing.assert_close(same.logits, ref.logits, rtol=0, atol=0)
    torch.testing.assert_close(recomputed.logits, ref.logits, rtol=1e-12, atol=1e-12)
    for got, want in zip(recomputed.attentions, ref.attentions):  # differential maps (ours), softmax maps (Llama)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # Every valid query-key pair of every map was recorded once per layer: 2 maps per differential head.
    maps = 4  # Llama's 4 heads; V1/V2: 2 differential heads x 2 maps
    valid_pairs = 11 * 12 // 2 + (8 * 9 // 2 + 3 * 8)  # row 2: keys 8..10 are padding
    assert sorted(recorder.logits) == [0, 1]
    assert all(sum(t.numel() for t in recorder.logits[layer]) == maps * valid_pairs for layer in (0, 1))


def test_sixteen_bits_barely_moves_the_output_and_four_bits_does():
    model = tiny("v1", dtype=torch.float32)
    ids, _ = batch()
    model.set_attn_implementation("eager")
    ref = model(input_ids=ids).logits
    with lowbit.low_bit_attention(model, target="logits", bits=16):
        fine = model(input_ids=ids).logits
    with lowbit.low_bit_attention(model, target="logits", bits=4):
        coarse = model(input_ids=ids).logits
    assert (fine - ref).abs().max() < 0.01 * (coarse - ref).abs().max()
    assert (coarse - ref).abs().max() > 1e-3


@pytest.mark.parametrize("granularity", lowbit.GRANULARITIES)
@pytest.mark.parametrize("kind", KINDS)
def test_logit_quantisation_step_matches_the_grid(kind, granularity):
    """Each valid logit moves by at most half a step s = max|valid logits| / (2^(b-1) - 1) of its slice (per sequence,
    or per sequence and map), lands on an integer multiple of s, and the largest keeps its value."""
    bits = 4
    qmax = 2 ** (bits - 1) - 1
    model = tiny(kind)
    ids, mask = batch()
    recorder = lowbit.LogitRecorder(keep=True)
    with lowbit.low_bit_attention(model, target="logits", bits=bits, granularity=granularity, recorder=recorder):
        model(input_ids=ids, attention_mask=mask)
    for layer in (0, 1):
        ((raw, quantized),) = recorder.kept[layer]
        assert raw.shape[1] == 4  # one row per softmax map
        for b in range(2):
            valid = torch.ones(11, 11, dtype=torch.bool).tril() & mask[b].bool()[None, :]
            slices = [raw[b]] if granularity == "tensor" else list(raw[b])
            outs = [quantized[b]] if granularity == "tensor" else list(quantized[b])
            for r, q in zip(slices, outs):
                v = valid.expand_as(r)
                step = r[v].abs().max() / qmax
                err = (q[v] - r[v]).abs()
                assert err.max() <= step / 2 * (1 + 1e-12)
                levels = q[v] / step
                torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-9)
                assert levels.abs().max() <= qmax + 1e-9
                top = r[v].abs().argmax()
                torch.testing.assert_close(q[v][top], r[v][top], rtol=1e-12, atol=0)
        if granularity == "head":  # every map has its own scale: their largest valid logits differ
            causal = torch.ones(11, 11, dtype=torch.bool).tril()
            assert len({float(raw[0, h][causal].abs().max()) for h in range(4)}) == 4


def test_quantize_symmetric_against_the_float64_formula():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 7, dtype=torch.float64) * torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)[:, None, None]
    for bits in (2, 4, 6, 8, 16):
        qmax = 2 ** (bits - 1) - 1
        q = lowbit.quantize_symmetric(x, bits, (1, 2))
        scale = x.abs().amax((1, 2), keepdim=True) / qmax
        want = torch.clamp(torch.round(x / scale), -qmax, qmax) * scale
        torch.testing.assert_close(q, want, rtol=0, atol=0)
        assert ((q - x).abs() <= scale / 2 * (1 + 1e-12)).all()
        assert all(len(q[i].unique()) <= 2 * qmax + 1 for i in range(3))
    # masked entries do not set the scale; zeros stay zero; float32 input stays float32
    valid = torch.ones_like(x, dtype=torch.bool)
    valid[:, 0, 0] = False
    x_big, x_zero = x.clone(), x.clone()
    x_big[:, 0, 0], x_zero[:, 0, 0] = 1e6, 0.0
    torch.testing.assert_close(
        lowbit.quantize_symmetric(x_big, 8, (1, 2), valid)[valid],
        lowbit.quantize_symmetric(x_zero, 8, (1, 2))[valid],
        rtol=0,
        atol=0,
    )
    assert lowbit.quantize_symmetric(torch.zeros(2, 3), 4, (1,)).eq(0).all()
    assert lowbit.quantize_symmetric(x.float(), 4, (1, 2)).dtype == torch.float32


@pytest.mark.parametrize("granularity", lowbit.GRANULARITIES)
def test_v1_padded_queries_and_packed_keys_quantise_as_their_unpadded_heads(granularity):
    """V1's kernel inputs: query heads [Q1 | 0], [0 | Q2] (B, 2H, T, 2d); key groups [K1 | K2] (B, G, S, 2d). Quantising
    them must equal quantising the unpadded (B, 2H, T, d) queries and (B, 2G, S, d) key heads."""
    torch.manual_seed(0)
    d, B, T = 4, 2, 5
    q = (
        torch.randn(B, 4, T, d, dtype=torch.float64)
        * torch.tensor([1.0, 3.0, 9.0, 27.0], dtype=torch.float64)[:, None, None]
    )
    k = (
        torch.randn(B, 4, T, d, dtype=torch.float64)
        * torch.tensor([1.0, 50.0, 2.0, 7.0], dtype=torch.float64)[:, None, None]
    )
    padded_q = torch.zeros(B, 4, T, 2 * d, dtype=torch.float64)
    padded_q[:, 0::2, :, :d] = q[:, 0::2]  # map c = 0 of each pair on the first half
    padded_q[:, 1::2, :, d:] = q[:, 1::2]
    packed_k = k.unflatten(1, (2, 2)).transpose(2, 3).flatten(-2)  # (B, G=2, T, 2d): [K_g0 | K_g1]
    spec = lowbit.QuantSpec("qk", 4, granularity)
    dims = (1, 2, 3) if granularity == "tensor" else (2, 3)
    want_q = lowbit.quantize_symmetric(q, 4, dims)
    got_q = lowbit.quantize_symmetric(padded_q, 4, dims)
    torch.testing.assert_close(got_q[:, 0::2, :, :d], want_q[:, 0::2], rtol=0, atol=0)
    torch.testing.assert_close(got_q[:, 1::2, :, d:], want_q[:, 1::2], rtol=0, atol=0)
    assert got_q[:, 0::2, :, d:].eq(0).all() and got_q[:, 1::2, :, :d].eq(0).all()

    class V1Module:
        diff_version = 1

    want_k = lowbit.quantize_symmetric(k, 4, dims)
    got_k = lowbit._quantize_keys(packed_k, spec, V1Module())
    torch.testing.assert_close(got_k, want_k.unflatten(1, (2, 2)).transpose(2, 3).flatten(-2), rtol=0, atol=0)


def test_qk_quantisation_runs_through_eager_with_quantised_inputs():
    """target="qk" changes q and k before eager's arithmetic: on a 24-bit grid (steps of 2^-23 of the largest entry)
    the output moves, but by little more than that relative step."""
    model = tiny("llama")
    ids, mask = batch()
    model.set_attn_implementation("eager")
    ref = model(input_ids=ids, attention_mask=mask).logits
    with lowbit.low_bit_attention(model, target="qk", bits=24, granularity="head"):
        got = model(input_ids=ids, attention_mask=mask).logits
    assert 0 < (got - ref).abs().max() < 1e-4


def test_bad_arguments_are_named_and_the_implementation_is_restored_on_error():
    model = tiny("v2")
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="target"):
        lowbit.QuantSpec("weights", 4)
    with pytest.raises(ValueError, match="granularity"):
        lowbit.QuantSpec("logits", 4, "channel")
    with pytest.raises(ValueError, match="bits"):
        lowbit.QuantSpec("logits", 1)
    with pytest.raises(ValueError, match="bits"):
        lowbit.QuantSpec(None, 4)
    with pytest.raises(RuntimeError, match="inside"):
        with lowbit.low_bit_attention(model, target="logits", bits=4):
            assert model.config._attn_implementation == lowbit.ATTN_IMPLEMENTATION
            raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"


def test_tensor_statistics_and_activation_statistics():
    x = torch.tensor([1.0, -2.0, 3.0, -4.0, 100.0])
    s = lowbit.tensor_statistics(x)
    xd = x.double()
    c = xd - xd.mean()
    assert s["max"] == 100.0 and s["median"] == 3.0 and s["count"] == 5 and s["top10"] == 1.0
    assert s["kurtosis"] == pytest.approx(float((c**4).mean() / (c**2).mean() ** 2), rel=1e-12)
    model = tiny("v2")
    ids, _ = batch()
    stats = lowbit.activation_statistics(model, ids)
    assert [r["layer"] for r in stats["logits"]] == [0, 1] and [r["layer"] for r in stats["hidden"]] == [0, 1]
    assert all(r["count"] == 2 * 4 * 66 for r in stats["logits"])
    model.set_attn_implementation("eager")
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert stats["hidden"][0]["max"] == pytest.approx(float(hidden[1].abs().max()), rel=1e-12)
    assert all(r["count"] == 2 * 11 * 32 for r in stats["hidden"])
    summary = lowbit.summarize_statistics(stats)
    assert summary["logits"]["max"] == max(r["max"] for r in stats["logits"])


def test_a_model_whose_attention_bypasses_the_interface_is_refused_loudly():
    """A model that runs inside the block without one call of the low-bit attention function (its attention does not
    dispatch through transformers' AttentionInterface) must not pass unquantised results off as quantised: leaving the
    block raises, naming the model. A block in which the model does not run, or runs through the function, is fine;
    so is a transformers Llama (the pretrained-model benchmark's source)."""
    model = tiny("llama")
    ids, _ = batch()

    class PlainAttention(torch.nn.Module):
        """Softmax attention computed here, without the attention interface."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
            a = self.inner
            shape = (*hidden_states.shape[:-1], -1, a.head_dim)
            q = a.q_proj(hidden_states).view(shape).transpose(1, 2)
            k = a.k_proj(hidden_states).view(shape).transpose(1, 2).repeat_interleave(a.num_key_value_groups, 1)
            v = a.v_proj(hidden_states).view(shape).transpose(1, 2).repeat_interleave(a.num_key_value_groups, 1)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return a.o_proj(out.transpose(1, 2).flatten(2)), None

    with lowbit.low_bit_attention(model, target="logits", bits=4):
        model(input_ids=ids)  # a transformers Llama goes through the function
    with lowbit.low_bit_attention(model, target="logits", bits=4):
        pass  # nothing ran: nothing to say
    for layer in model.model.layers:
        layer.self_attn = PlainAttention(layer.self_attn)
    with pytest.raises(RuntimeError, match="LlamaForCausalLM ran 1 time.*never called"):
        with lowbit.low_bit_attention(model, target="logits", bits=4):
            model(input_ids=ids)
    assert model.config._attn_implementation != lowbit.ATTN_IMPLEMENTATION  # restored before raising
