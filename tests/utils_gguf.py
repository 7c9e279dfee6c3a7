"""Tiny GGUF files for the converter's tests, written with the ``gguf`` package as llama.cpp lays one out, and the
reference they are compared with (the file as transformers' GGUF loader gives it)."""

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_gguf(
    path, arch="llama", layers=2, hidden=48, ffn=96, hq=3, hkv=1, head_dim=16, vocab=300, tied=True, bias=False, seed=0
):
    """A small float32 GGUF as llama.cpp lays one out: metadata, a byte-level BPE tokenizer with a chat template and
    ChatML special tokens (ids 0-2, eos = ``<|im_end|>``), random tensors under GGUF names."""
    from gguf import GGUFWriter
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(hq)
    writer.add_head_count_kv(hkv)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(head_dim)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), "Ġt"]
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def tensor(name, *shape, near_one=False):
        values = 1 + 0.1 * rng.standard_normal(shape) if near_one else 0.05 * rng.standard_normal(shape)
        writer.add_tensor(name, values.astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    for layer in range(layers):
        tensor(f"blk.{layer}.attn_norm.weight", hidden, near_one=True)
        for name, rows in (("attn_q", hq * head_dim), ("attn_k", hkv * head_dim), ("attn_v", hkv * head_dim)):
            tensor(f"blk.{layer}.{name}.weight", rows, hidden)
            if bias:
                tensor(f"blk.{layer}.{name}.bias", rows)
        tensor(f"blk.{layer}.attn_output.weight", hidden, hq * head_dim)
        tensor(f"blk.{layer}.ffn_norm.weight", hidden, near_one=True)
        tensor(f"blk.{layer}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{layer}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{layer}.ffn_down.weight", hidden, ffn)
    tensor("output_norm.weight", hidden, near_one=True)
    if not tied:
        tensor("output.weight", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def gguf_llama(path: Path):
    """The reference: the file as transformers' GGUF loader gives it (float32)."""
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
