"""DiffTransformerConfig: derived sizes, strict validation with field-naming errors, serialisation, Auto
registration."""

import ast
import logging
import re
from pathlib import Path

import pytest
import torch
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers import AutoConfig

from difftransformer import DiffTransformerConfig

BASE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2, intermediate_size=96)


@pytest.mark.parametrize(
    "version,hkv,groups,n", [(1, 8, 4, 1), (1, 4, 2, 2), (1, 2, 1, 4), (2, 4, 4, 1), (2, 2, 2, 2), (2, 1, 1, 4)]
)
def test_derived_sizes(version, hkv, groups, n):
    cfg = DiffTransformerConfig(**{**BASE, "num_key_value_heads": hkv, "diff_version": version})
    assert cfg.head_dim == 8 and cfg.num_diff_heads == 4
    assert cfg.num_kv_groups == groups and cfg.num_diff_heads // cfg.num_kv_groups == n


@pytest.mark.parametrize(
    "overrides,fields",
    [
        (dict(num_attention_heads=7, head_dim=8), ["num_attention_heads", "even"]),
        (dict(num_key_value_heads=3), ["num_key_value_heads", "even"]),
        (dict(num_attention_heads=12, num_key_value_heads=8, head_dim=8), ["num_key_value_heads", "one of"]),
        (dict(diff_version=2, num_key_value_heads=8), ["num_key_value_heads", "one of [1, 2, 4]"]),
        (
            dict(diff_version=2, num_attention_heads=12, num_key_value_heads=4, head_dim=8),
            ["num_key_value_heads", "[1, 2, 3, 6]"],
        ),
        (dict(diff_version=3), ["diff_version", "(1, 2)"]),
        (dict(attention_dropout=0.1), ["attention_dropout", "must be 0"]),
        (dict(hidden_size=60), ["hidden_size", "num_attention_heads", "head_dim"]),
        (dict(head_dim=7), ["head_dim", "even"]),
        (dict(num_key_value_heads=0), ["num_key_value_heads", "positive"]),
        (dict(lambda_init=1.5), ["lambda_init", "[0, 1)"]),
        (dict(subln_eps=0.0), ["subln_eps"]),
        (dict(num_key_value_heads=-2), ["num_key_value_heads", "positive integer", "-2"]),
        (dict(num_attention_heads=-8), ["num_attention_heads", "positive integer"]),
        (dict(num_hidden_layers=0), ["num_hidden_layers", "positive integer"]),
        (dict(vocab_size=0), ["vocab_size", "positive integer"]),
        (dict(intermediate_size=-1), ["intermediate_size", "positive integer"]),
        (dict(max_position_embeddings=0), ["max_position_embeddings", "positive integer"]),
        (dict(rms_norm_eps=0.0), ["rms_norm_eps", "greater than 0"]),
        (dict(rms_norm_eps=-1e-5), ["rms_norm_eps", "greater than 0"]),
        (dict(initializer_range=-0.02), ["initializer_range", "greater or equal to 0"]),
        (dict(lambda_std=-0.1), ["lambda_std", "greater or equal to 0"]),
        (dict(hidden_act="swishy"), ["hidden_act", "silu", "'swishy'"]),
        (dict(vocab_size=32, pad_token_id=40), ["pad_token_id", "vocab_size = 32"]),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), ["rope_theta", "positive"]),
    ],
)
def test_invalid_configs_raise_value_error_naming_fields(overrides, fields):
    """A field's own range is refused by its validator (huggingface_hub's @strict raises its own exception type, whose
    message names the field and wraps the ValueError), an invariant between fields by a plain ValueError."""
    with pytest.raises((ValueError, StrictDataclassFieldValidationError)) as err:
        DiffTransformerConfig(**{**BASE, **overrides})
    for text in fields:
        assert text in str(err.value)


@pytest.mark.parametrize(
    "field,value,text",
    [
        ("num_key_value_heads", 0, "positive integer"),
        ("subln_eps", 0.0, "greater than 0"),
        ("diff_version", 3, "(1, 2)"),
    ],
)
def test_assigning_an_invalid_value_is_refused_naming_the_field(field, value, text):
    """The field validators run whenever a field is set, not only at construction."""
    cfg = DiffTransformerConfig(**BASE)
    with pytest.raises(StrictDataclassFieldValidationError, match=field) as err:
        setattr(cfg, field, value)
    assert text in str(err.value) and getattr(cfg, field) != value


@pytest.mark.parametrize(
    "field,value",
    [("hidden_size", "64"), ("num_attention_heads", 8.0), ("attention_bias", "yes"), ("num_key_value_heads", True)],
)
def test_wrong_types_raise_naming_the_field(field, value):
    """huggingface_hub's @strict checks the declared types (its own exception type, whose message names the field);
    a bool where a count is expected is refused by our validation."""
    with pytest.raises(Exception, match=rf"{field}") as err:
        DiffTransformerConfig(**{**BASE, field: value})
    assert type(err.value).__name__ in ("StrictDataclassFieldValidationError", "ValueError")


@pytest.mark.parametrize("value", ["v1", "2", 2.0, True])
def test_diff_version_must_be_an_int(value):
    """``diff_version`` is saved as an int and read as one: a string or float is refused naming the field."""
    with pytest.raises(Exception, match="diff_version") as err:
        DiffTransformerConfig(**{**BASE, "num_key_value_heads": 4, "diff_version": value})
    assert type(err.value).__name__ in ("StrictDataclassFieldValidationError", "ValueError")


@pytest.mark.parametrize(
    "field,value", [("lambda_init", 0.5), ("lambda_std", 0.2), ("subln_eps", 1e-6), ("lambda_init_layer_offset", -1)]
)
def test_v1_only_fields_warn_once_on_v2(field, value, caplog):
    """A V2 config that sets a field only V1 reads warns, once, naming the field (the model does not read it; an error
    would refuse what transformers' own helpers do, e.g. the common tests' zeroing of every `*_std` field)."""
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            cfg = DiffTransformerConfig(**{**BASE, "num_key_value_heads": 4, "diff_version": 2, field: value})
    warned = [r.getMessage() for r in caplog.records if f"`{field}`" in r.getMessage()]
    assert len(warned) == 1 and "diff_version=2" in warned[0] and "no effect" in warned[0], warned
    assert getattr(cfg, field) == value  # kept as given (saved and reloaded as it is)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        DiffTransformerConfig(**{**BASE, "num_key_value_heads": 4, "diff_version": 1, field: value})  # read by V1
    assert not [r for r in caplog.records if f"`{field}`" in r.getMessage()]


def test_docs_diff_version_row_matches_the_config():
    """docs/model.md's `diff_version` row: every value it gives before the word "refused" builds a config, and every
    value after it is refused naming the field."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "model.md"
    row = next(line for line in doc.read_text().splitlines() if line.startswith("| `diff_version` |"))
    accepted, said, refused = row.split("|")[3].partition("refused")
    accepted, refused = ([ast.literal_eval(v) for v in re.findall(r"`([^`]+)`", part)] for part in (accepted, refused))
    assert accepted and said and refused, row
    for value in accepted:
        assert DiffTransformerConfig(**{**BASE, "diff_version": value}).diff_version == value
    for value in refused:
        with pytest.raises(Exception, match="diff_version"):
            DiffTransformerConfig(**{**BASE, "diff_version": value})


def test_validation_also_applies_when_loading(tmp_path):
    cfg = DiffTransformerConfig(**BASE)
    cfg.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text().replace('"num_key_value_heads": 4', '"num_key_value_heads": 3')
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        AutoConfig.from_pretrained(tmp_path)


def test_round_trip_and_auto_config(tmp_path):
    cfg = DiffTransformerConfig(
        **{**BASE, "num_key_value_heads": 2},
        diff_version=2,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
    )
    cfg.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is DiffTransformerConfig and loaded.model_type == "difftransformer"
    assert loaded.to_diff_dict() == cfg.to_diff_dict()
    assert loaded.rope_parameters["factor"] == 2.0 and loaded.diff_version == 2
    assert AutoConfig.for_model("difftransformer", **BASE).num_diff_heads == 4


def test_defaults_are_the_paper_v1():
    cfg = DiffTransformerConfig()
    assert cfg.diff_version == 1 and cfg.lambda_init is None and cfg.lambda_std == 0.1 and cfg.subln_eps == 1e-5
    assert cfg.num_key_value_heads == cfg.num_attention_heads and cfg.attention_dropout == 0.0


UNKNOWN_FIELD = "is not one of its fields"


def unknown_field_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if UNKNOWN_FIELD in r.getMessage()]


def test_misspelt_fields_warn_once_naming_the_nearest_field(caplog):
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            cfg = DiffTransformerConfig(**BASE, hiden_sise=64, num_atention_heads=4, zzqx_frobnicate=1)
    warned = unknown_field_warnings(caplog)
    assert len(warned) == 3, warned  # once per name, not per construction
    by_name = {name: [w for w in warned if f"{name!r}" in w] for name in ("hiden_sise", "num_atention_heads")}
    assert "`hidden_size`" in by_name["hiden_sise"][0] and "`num_attention_heads`" in by_name["num_atention_heads"][0]
    assert "docs/model.md" in next(w for w in warned if "'zzqx_frobnicate'" in w)  # nothing near: where fields are
    assert cfg.hidden_size == BASE["hidden_size"] and cfg.hiden_sise == 64  # kept as given, as transformers does


def test_keys_transformers_passes_do_not_warn(tmp_path, caplog):
    """Saving and loading (config and model, through the Auto classes and from_dict), transformers' own keyword
    arguments, generation parameters and fields older releases saved: no unknown-field warning."""
    from transformers import AutoModelForCausalLM

    from difftransformer import DiffTransformerForCausalLM

    with caplog.at_level(logging.WARNING):
        cfg = DiffTransformerConfig(
            **BASE,
            vocab_size=64,
            torch_dtype="float32",
            attn_implementation="eager",
            output_attentions=False,
            num_labels=3,
            max_length=20,
            do_sample=False,
            is_decoder=True,
            tokenizer_class="LlamaTokenizer",
            rope_theta=5e5,
            _name_or_path="somewhere",
        )
        DiffTransformerConfig.from_dict(cfg.to_dict())
        DiffTransformerConfig(**cfg.to_dict())
        cfg.save_pretrained(tmp_path / "config")
        AutoConfig.from_pretrained(tmp_path / "config")
        DiffTransformerConfig.from_pretrained(tmp_path / "config", dtype="bfloat16", attn_implementation="eager")
        DiffTransformerForCausalLM(DiffTransformerConfig(**BASE, vocab_size=64)).save_pretrained(tmp_path / "model")
        AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.bfloat16)
        AutoConfig.from_pretrained(tmp_path / "model", trust_remote_code=True)  # the folder's copy of this code
    assert not unknown_field_warnings(caplog)


def test_motif_config_does_not_warn(caplog):
    from difftransformer.motif import MotifConfig
    from motif_reference import motif_config

    with caplog.at_level(logging.WARNING):
        for kind in ("tiny", "tiny-gda", "12.7b"):
            MotifConfig(**{k: v for k, v in motif_config(kind).items() if k != "model_type"})
            MotifConfig(**motif_config(kind))
    assert not unknown_field_warnings(caplog)
