"""The flash-attention path, run on a CPU through transformers' real flash integration.

flash-attn needs a GPU, so its kernel is replaced by a stand-in with the *signatures* of FlashAttention-3's public
functions (``flash_attn_interface.flash_attn_func``, ``flash_attn_varlen_func``; no ``**kwargs``, so an argument
the real kernel would reject raises here too), computing with SDPA. Everything else is transformers' own code:
``flash_attention_forward``, ``_flash_attention_forward`` (un-padding a padded batch into the varlen call and
padding back), the keyword processing that keeps only what the kernel's signature accepts, and the flash mask
function. What this checks: every keyword the attention module passes reaches a kernel that accepts it, V1's
zero-padded single call and V2's call give eager's logits, gradients and generations, with and without padding.
"""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from difftransformer import DiffTransformerForCausalLM
from difftransformer.testing_utils import left_padded_batch, randomize_norms, tiny_config

CALLS: list[str] = []


def _attend(q, k, v, softmax_scale, causal):
    """One sequence: q (T, H, D), k/v (S, Hk, D); FlashAttention's causal mask is aligned to the bottom right."""
    t, s = q.shape[0], k.shape[0]
    mask = torch.ones(t, s, dtype=torch.bool).tril(s - t) if causal else None
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=softmax_scale, enable_gqa=True)  # fmt: skip
    return out.transpose(0, 1)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
                    window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False):  # fmt: skip
    assert window_size == (-1, -1) and softcap == 0.0 and qv is None
    CALLS.append("dense")
    return torch.stack([_attend(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):  # fmt: skip
    assert window_size == (-1, -1) and softcap == 0.0 and qv is None
    CALLS.append("varlen")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return torch.cat([_attend(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], softmax_scale, causal)
                      for i in range(len(cq) - 1)])  # fmt: skip


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, page_table=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), softcap=0.0, num_splits=1,
):  # fmt: skip
    raise AssertionError("the paged kernel is only used by continuous batching")


@pytest.fixture
def fake_flash(monkeypatch):
    """Makes ``attn_implementation="flash_attention_3"`` load the stand-in kernel (transformers imports it from
    ``flash_attn_interface`` lazily, on the first call)."""
    import transformers.modeling_flash_attention_utils as fa_utils

    module = types.ModuleType("flash_attn_interface")
    module.flash_attn_func, module.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn_interface", module)
    monkeypatch.setattr(fa_utils, "_loaded_implementation", None)
    CALLS.clear()
    yield
    fa_utils._loaded_implementation = None  # the next user of the flash path imports the real kernel again


def _pair(layout):
    torch.manual_seed(0)
    model = randomize_norms(DiffTransformerForCausalLM(tiny_config(layout, initializer_range=0.1)))
    flash = DiffTransformerForCausalLM(model.config.__class__(**model.config.to_dict()))
    flash.load_state_dict(model.state_dict())
    model.set_attn_implementation("eager")
    # set_attn_implementation would refuse (flash-attn 3 is not installed): set the config field it sets.
    flash.config._attn_implementation = "flash_attention_3"
    return model, flash


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "no-padding"])
@pytest.mark.parametrize("layout", ["v1_gqa", "v1_mha", "v2_gqa"])
def test_flash_path_equals_eager_forward_backward_and_generate(fake_flash, layout, padded):
    eager, flash = _pair(layout)
    ids, mask = left_padded_batch(eager.config.vocab_size, [12, 9] if padded else [12, 12], seed=3)
    labels = ids.masked_fill(mask == 0, -100)
    if padded:
        labels[1, 3] = -100  # predicted from a padding row, which each kernel fills differently
    results = {}
    for name, model in (("eager", eager), ("flash", flash)):
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        results[name] = (out.logits.detach(), {k: p.grad for k, p in model.named_parameters()}, generated)
    assert "varlen" in CALLS if padded else "dense" in CALLS  # prefill: un-padded varlen call, or the dense one
    valid = mask.bool()
    torch.testing.assert_close(results["flash"][0][valid], results["eager"][0][valid], rtol=1e-5, atol=1e-5)
    assert results["flash"][1].keys() == results["eager"][1].keys()
    for name, grad in results["eager"][1].items():
        torch.testing.assert_close(results["flash"][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert torch.equal(results["flash"][2], results["eager"][2])


def test_flash_kernel_signature_rejects_unknown_keywords(fake_flash):
    """The stand-in is as strict as the real kernel: the check above would catch a stray keyword."""
    q = torch.randn(1, 3, 2, 8)
    with pytest.raises(TypeError, match="diff_lambda"):
        flash_attn_func(q, q, q, diff_lambda=0.5)
