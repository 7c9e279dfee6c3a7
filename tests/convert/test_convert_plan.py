"""A conversion in two steps (difftransformer/convert/api.py): ``plan_conversion`` reads and checks everything and
decides what will be written, writing nothing; ``write_conversion`` writes a plan atomically (a failure mid-write
leaves no output folder, or the previous one untouched, and no temporary folder) and never into its input.
``convert`` is their composition (its guarantees: tests/convert/test_convert_io.py)."""

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from difftransformer import DiffTransformerForCausalLM
from difftransformer.convert import ConversionError, V1Upcycling, convert, plan_conversion, write_conversion
from difftransformer.convert.engine import meta_shapes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Llama folder (GQA, 4 query heads over 2 KV heads) with a generation config."""
    folder = tmp_path_factory.mktemp("plan-src") / "llama"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def tree(folder: Path) -> dict:
    """Every file under ``folder`` with its bytes and modification time."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def tensors(folder: Path) -> dict:
    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        found.update(load_file(file))
    return found


def test_the_plan_decides_everything_and_writes_nothing(tmp_path, source):
    before = tree(source.parent)
    with plan_conversion("llama", source, diff_version=1, v1=V1Upcycling(init="pair", seed=3)) as plan:
        assert tree(source.parent) == before and list(tmp_path.iterdir()) == []
        assert plan.config.model_type == "difftransformer" and plan.config.diff_version == 1 and not plan.exact
        assert plan.info["v1_init"] == "pair" and plan.notes  # approximate upcycling says so
        dtypes = plan.tensor_dtypes()
        assert set(dtypes) == set(meta_shapes(DiffTransformerForCausalLM, plan.config))
        assert dtypes["model.layers.0.self_attn.lambda_q1"] == torch.float32 == dtypes["lm_head.weight"]
        assert plan.side_files() == ["generation_config.json"]
        layout = plan.weight_files(max_shard_size="20KB")
        assert len(layout) > 1 and sorted(name for names in layout.values() for name in names) == sorted(dtypes)

        # Written twice from the one plan: the same tensors as convert() with the same options; shards as planned.
        result = write_conversion(plan, tmp_path / "one", progress=False)
        write_conversion(plan, tmp_path / "sharded", max_shard_size="20KB", progress=False)
    reference = convert("llama", source, tmp_path / "convert", diff_version=1, v1_init="pair", seed=3, progress=False)
    assert result.config.to_dict() == reference.config.to_dict() and result.notes == reference.notes
    expected = tensors(tmp_path / "convert")
    for folder in ("one", "sharded"):
        got = tensors(tmp_path / folder)
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected), folder
    assert sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors")) == sorted(layout)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert (tmp_path / "one" / "generation_config.json").is_file()
    assert tree(source.parent) == before

    assert plan.closed
    with pytest.raises(ConversionError, match="plan is closed"):
        write_conversion(plan, tmp_path / "again", progress=False)
    assert not (tmp_path / "again").exists()


def test_a_failure_mid_write_leaves_no_output_folder(tmp_path, source):
    """One tensor of the last shard fails to compute, after the first shards were written into the temporary
    folder: no output appears, the temporary folder is gone; with overwrite, the previous output stays as it was."""
    seen = {}

    def fail(get):
        seen["written"] = [p.name for d in tmp_path.glob(".*.converting-*") for p in d.iterdir()]
        raise OSError("No space left on device (simulated)")

    with plan_conversion("llama", source, diff_version=2) as plan:
        last = list(plan.weight_files(max_shard_size="20KB").values())[-1][-1]
        step = next(s for s in plan.tensors.steps if s.target == last)
        step.fn, computes = fail, step.fn
        with pytest.raises(OSError, match="simulated"):
            write_conversion(plan, tmp_path / "out", max_shard_size="20KB", progress=False)
        assert "model-00001-of-" in " ".join(seen["written"])  # it failed mid-write...
        assert os.listdir(tmp_path) == []  # ...and left nothing: no output, no temporary folder

        previous = tmp_path / "previous"
        previous.mkdir()
        (previous / "config.json").write_text("{}")
        with pytest.raises(OSError, match="simulated"):
            write_conversion(plan, previous, overwrite=True, max_shard_size="20KB", progress=False)
        assert os.listdir(tmp_path) == ["previous"] and os.listdir(previous) == ["config.json"]

        step.fn = computes
        write_conversion(plan, previous, overwrite=True, max_shard_size="20KB", progress=False)
    assert os.listdir(tmp_path) == ["previous"] and (previous / "model.safetensors.index.json").is_file()


def test_a_plan_is_never_written_into_its_input(tmp_path, source, monkeypatch):
    """The input folder, its parent, a folder inside it and a link to it are refused as output, with or without
    overwrite, whatever the working directory is when the plan is written (the plan holds resolved paths); the input
    is unchanged, file by file."""
    before = tree(source.parent)
    monkeypatch.chdir(source.parent)
    with plan_conversion("llama", source.name, diff_version=2) as plan:  # a relative input path
        monkeypatch.chdir(tmp_path)
        link = tmp_path / "link-to-input"
        link.symlink_to(source, target_is_directory=True)
        for output in (source, source.parent, link, source / "."):
            with pytest.raises(ConversionError, match="would overwrite the input"):
                write_conversion(plan, output, overwrite=True, progress=False)
        with pytest.raises(ConversionError, match="lies inside the input folder"):
            write_conversion(plan, source / "converted", progress=False)
        write_conversion(plan, tmp_path / "out", progress=False)
    assert tree(source.parent) == before
    assert sorted(os.listdir(tmp_path)) == ["link-to-input", "out"]
