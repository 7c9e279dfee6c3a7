"""The embedded default data: stdlib corpus (split by file), cached byte-level BPE tokenizer, LM blocks."""

import zlib

import pytest
import torch

from difftransformer.research import data
from difftransformer.research.data import (
    LMBlockDataset,
    build_blocks,
    corpus_files,
    corpus_texts,
    get_tokenizer,
    lm_datasets,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return get_tokenizer(vocab_size=512, cache_dir=tmp_path_factory.mktemp("tokenizer-cache"))


def test_corpus_is_the_stdlib_split_by_file_deterministically():
    train, valid = corpus_files("train"), corpus_files("validation")
    assert train == sorted(train) and valid == sorted(valid)
    assert not set(train) & set(valid), "a file may belong to one split only"
    every_module = sorted(p for p in data.stdlib_dir().glob("*.py") if p.is_file())
    assert sorted(train + valid) == every_module
    # ~10% of the files, chosen from the file name alone (stable when other files come and go).
    assert 0.03 < len(valid) / len(every_module) < 0.25
    assert all(zlib.crc32(p.name.encode()) % data.VALIDATION_MODULO == 0 for p in valid)
    assert corpus_texts("validation") == corpus_texts("validation")


def test_corpus_texts_are_the_file_contents():
    files = [p for p in corpus_files("validation") if p.read_text(encoding="utf-8").strip()]
    texts = corpus_texts("validation")
    assert len(texts) == len(files)
    assert texts[0] == files[0].read_text(encoding="utf-8").replace("\r\n", "\n")
    assert sum(map(len, corpus_texts("train"))) > 1_000_000  # big enough for a few minutes of training


def test_max_chars_caps_the_corpus_at_a_line_boundary():
    texts = corpus_texts("train", max_chars=10_000)
    total = sum(map(len, texts))
    assert 5_000 < total <= 10_000
    assert texts[-1].endswith("\n")
    full = corpus_texts("train")
    assert texts[:-1] == full[: len(texts) - 1] and full[len(texts) - 1].startswith(texts[-1])


@pytest.mark.parametrize(
    "kwargs, field",
    [({"split": "test"}, "split"), ({"split": "train", "max_chars": 0}, "max_chars")],
)
def test_bad_corpus_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        corpus_texts(**kwargs)


def test_tokenizer_has_special_tokens_and_round_trips_unseen_text(tokenizer):
    assert len(tokenizer) == 512
    assert (tokenizer.unk_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == tuple(
        data.SPECIAL_TOKENS
    )
    assert [tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id] == [
        0,
        1,
        2,
        3,
    ]
    text = corpus_texts("validation")[0][:5000] + "\nnon-ASCII: λ → ∂ 😀\n"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id  # documents start with <s>, as in training blocks
    assert tokenizer.decode(ids, skip_special_tokens=True) == text  # byte-level BPE is lossless
    assert tokenizer.unk_token_id not in ids
    # BPE learned merges: clearly fewer tokens than bytes on held-out code.
    assert len(ids) < 0.7 * len(text.encode())


def test_get_tokenizer_trains_once_then_loads_from_cache(tmp_path, monkeypatch):
    first = get_tokenizer(vocab_size=300, cache_dir=tmp_path)
    folders = list(tmp_path.iterdir())
    assert len(folders) == 1 and (folders[0] / "tokenizer.json").is_file()
    assert folders[0].name == f"tokenizer-300-{data.corpus_fingerprint()}"

    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been loaded")

    monkeypatch.setattr(data, "train_tokenizer", no_training)
    second = get_tokenizer(vocab_size=300, cache_dir=tmp_path)
    sample = "def f(x):\n    return x ** 2\n"
    assert second(sample)["input_ids"] == first(sample)["input_ids"]


def test_tokenizer_training_is_deterministic_and_loads_with_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    texts = corpus_texts("train", max_chars=100_000)
    a, b = train_tokenizer(texts, 300), train_tokenizer(texts, 300)
    assert a.get_vocab() == b.get_vocab()
    a.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    sample = corpus_texts("validation", max_chars=2000)[0]
    assert loaded(sample)["input_ids"] == a(sample)["input_ids"]
    assert loaded.pad_token == "<pad>" and loaded.bos_token == "<s>"


def test_vocab_size_below_the_byte_alphabet_is_rejected():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["x = 1\n"], vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size"):
        get_tokenizer(vocab_size=10)


def test_build_blocks_packs_framed_documents(tokenizer):
    texts = corpus_texts("validation", max_chars=6000)
    blocks = build_blocks(tokenizer, texts, block_size=32)
    stream = []
    for text in texts:
        stream += [
            tokenizer.bos_token_id,
            *tokenizer(text, add_special_tokens=False)["input_ids"],
            tokenizer.eos_token_id,
        ]
    assert blocks.dtype == torch.long and blocks.shape == (len(stream) // 32, 32)
    assert blocks.flatten().tolist() == stream[: blocks.numel()]
    assert build_blocks(tokenizer, texts, block_size=32, max_blocks=3).equal(blocks[:3])


def test_build_blocks_rejects_bad_sizes(tokenizer):
    with pytest.raises(ValueError, match="block_size"):
        build_blocks(tokenizer, ["x = 1\n"], block_size=1)
    with pytest.raises(ValueError, match="block_size"):
        build_blocks(tokenizer, ["x = 1\n"], block_size=4096)  # fewer tokens than one block
    with pytest.raises(ValueError, match="max_blocks"):
        build_blocks(tokenizer, ["x = 1\n"], block_size=2, max_blocks=0)


def test_lm_datasets_feed_trainer_collator(tokenizer):
    from transformers import default_data_collator

    train, valid = lm_datasets(tokenizer, 16, train_max_chars=5000, validation_max_chars=3000, max_validation_blocks=4)
    assert isinstance(train, LMBlockDataset) and len(valid) == 4
    batch = default_data_collator([train[0], train[1]])
    assert batch["input_ids"].shape == (2, 16) and batch["labels"].equal(batch["input_ids"])
    # Validation blocks come only from validation files.
    valid_stream = build_blocks(tokenizer, corpus_texts("validation", 3000), 16)
    assert valid.blocks.equal(valid_stream[:4])
