"""transformers' own common model tests (ModelTesterMixin, TrainingTesterMixin) against tiny DIFF V1 and V2 models.

The mixins come from the ``tests/`` folder of the transformers sdist of the installed version (fetched once into
``.cache/transformers-tests/<version>/`` by ``tests/fetch_transformers_tests.py``); this module only supplies what a
model's own test file supplies in transformers: a model tester that builds a tiny config and inputs, the list of
model classes, and the skips that apply to this architecture, each with its reason.

Three layouts: V1 and V2 with grouped KV heads (n = 2 differential heads per KV group) and Motif's grouped
differential attention. The MHA layouts (n = 1) are not repeated here: what the common tests check (saving, loading,
outputs, embeddings, training steps, the attention interface) does not depend on n, and the package's own tests
(modeling, generation, caches, conversions) run every layout.
"""

import importlib
import os
import sys
import types
import unittest
import warnings
from unittest import mock

import pytest

from fetch_transformers_tests import FetchError, fetch

pytest.importorskip(
    "parameterized", reason="transformers' test_modeling_common imports `parameterized` (pip install parameterized)"
)

try:
    TESTS_DIR = fetch()
except FetchError as err:
    if os.environ.get("DIFFTRANSFORMER_CI"):  # CI reaches PyPI: there the missing tests are a failure, not a skip
        raise
    pytest.skip(f"transformers' common tests could not be downloaded: {err}", allow_module_level=True)

import torch  # noqa: E402

from difftransformer import (  # noqa: E402
    DiffTransformerConfig,
    DiffTransformerForCausalLM,
    DiffTransformerForQuestionAnswering,
    DiffTransformerForSequenceClassification,
    DiffTransformerForTokenClassification,
    DiffTransformerModel,
)

# The sdist's tests/ is imported as a package of its own name (it has relative imports, and "tests" would clash).
PACKAGE = "transformers_sdist_tests"
_package = types.ModuleType(PACKAGE)
_package.__path__ = [str(TESTS_DIR)]
sys.modules[PACKAGE] = _package

# test_modeling_common imports two modules that the sdist does not ship: tests/generation/test_utils.py
# (GenerationTesterMixin) and tests/exporters/test_export.py (ExportTesterMixin, a base class of ModelTesterMixin).
# Where one is absent, an empty stand-in lets the module import: the tests it holds do not run (none is counted), and
# the one common test that asks for GenerationTesterMixin is skipped below with that reason. Where present, the real
# mixin is used (and GenerationTesterMixin joins the test classes).
MISSING_FROM_SDIST = {}
for _module, _class in (
    ("generation.test_utils", "GenerationTesterMixin"),
    ("exporters.test_export", "ExportTesterMixin"),
):
    if not (TESTS_DIR / (_module.replace(".", "/") + ".py")).is_file():
        MISSING_FROM_SDIST[_class] = f"tests/{_module.replace('.', '/')}.py"
        _parent = f"{PACKAGE}.{_module.split('.')[0]}"
        sys.modules.setdefault(_parent, types.ModuleType(_parent))
        _stand_in = types.ModuleType(f"{PACKAGE}.{_module}")
        setattr(_stand_in, _class, type(_class, (), {"__doc__": "stand-in: not shipped in the transformers sdist"}))
        sys.modules[f"{PACKAGE}.{_module}"] = _stand_in

with warnings.catch_warnings():  # markers of transformers' own CI (flash_attn_test, torch_compile_test, ...)
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    _common = importlib.import_module(f"{PACKAGE}.test_modeling_common")
    TrainingTesterMixin = importlib.import_module(f"{PACKAGE}.test_training_mixin").TrainingTesterMixin
ModelTesterMixin, ids_tensor = _common.ModelTesterMixin, _common.ids_tensor

if "GenerationTesterMixin" in MISSING_FROM_SDIST:
    MIXINS = (ModelTesterMixin, TrainingTesterMixin)
else:
    MIXINS = (
        ModelTesterMixin,
        sys.modules[f"{PACKAGE}.generation.test_utils"].GenerationTesterMixin,
        TrainingTesterMixin,
    )


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class DiffTransformerModelTester:
    """Tiny configs and inputs, as a model's tester in transformers provides them (cf. its DiffLlama tester).

    ``num_attention_heads`` here is what the common tests compare ``output_attentions`` against: our model returns one
    differential map (A1 − λ·A2) per differential head, i.e. ``config.num_attention_heads / 2`` maps per layer.
    """

    base_model_class = DiffTransformerModel
    causal_lm_class = DiffTransformerForCausalLM
    sequence_classification_class = DiffTransformerForSequenceClassification
    token_classification_class = DiffTransformerForTokenClassification
    question_answering_class = DiffTransformerForQuestionAnswering

    def __init__(
        self,
        parent,
        diff_version,
        query_heads,
        kv_heads,
        batch_size=13,
        seq_length=7,
        vocab_size=99,
        hidden_size=32,
        head_dim=8,
        intermediate_size=37,
        num_hidden_layers=2,
        num_labels=3,
        num_choices=4,
        type_sequence_label_size=2,
        is_training=True,
        config_overrides=None,
    ):
        self.parent = parent
        self.diff_version, self.query_heads, self.kv_heads = diff_version, query_heads, kv_heads
        self.batch_size, self.seq_length, self.vocab_size = batch_size, seq_length, vocab_size
        self.hidden_size, self.head_dim, self.intermediate_size = hidden_size, head_dim, intermediate_size
        self.num_hidden_layers, self.num_labels, self.num_choices = num_hidden_layers, num_labels, num_choices
        self.type_sequence_label_size, self.is_training = type_sequence_label_size, is_training
        self.config_overrides = dict(config_overrides or {})
        noise = self.config_overrides.get("num_noise_heads") or query_heads // 2
        self.num_attention_heads = query_heads - noise  # maps returned per layer (see the class docstring)

    def get_config(self):
        return DiffTransformerConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.query_heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            diff_version=self.diff_version,
            max_position_embeddings=512,
            num_labels=self.num_labels,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            **self.config_overrides,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))  # rows with padding, as transformers' testers use
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class _DiffTransformerCommonTests(*MIXINS):
    all_model_classes = (
        DiffTransformerModel,
        DiffTransformerForCausalLM,
        DiffTransformerForSequenceClassification,
        DiffTransformerForQuestionAnswering,
        DiffTransformerForTokenClassification,
    )
    layout: tuple[int, int, int]  # (diff_version, num_attention_heads, num_key_value_heads)
    config_overrides: dict = {}  # further config fields of the layout
    model_tester = None
    # test_can_init_all_missing_weights dates a model by the "# Copyright YYYY" line of its config file and skips
    # models from before 2023 unless this is set; our config file has no such line, and _init_weights covers every
    # tensor (λ vectors, subln, lambda_proj), which is what the test checks.
    test_can_init_all_missing_weights_before_2023 = True

    # The common tests pick labels and skips by looking class names up in transformers' auto-class tables, where
    # transformers' own models are listed; ours is registered with the Auto classes instead, so it is listed here too
    # for the duration of the class (the causal-LM entry is set by the modeling file itself).
    _AUTO_TABLES = {
        "MODEL_MAPPING_NAMES": DiffTransformerModel,
        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": DiffTransformerForCausalLM,
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": DiffTransformerForSequenceClassification,
        "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES": DiffTransformerForQuestionAnswering,
        "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": DiffTransformerForTokenClassification,
    }

    @classmethod
    def setUpClass(cls):
        from transformers.models.auto import modeling_auto

        cls._table_patches = [
            mock.patch.dict(getattr(modeling_auto, table), {DiffTransformerConfig.model_type: model_class.__name__})
            for table, model_class in cls._AUTO_TABLES.items()
        ]
        for patch in cls._table_patches:
            patch.start()

    @classmethod
    def tearDownClass(cls):
        for patch in cls._table_patches:
            patch.stop()

    def setUp(self):
        self.model_tester = DiffTransformerModelTester(self, *self.layout, config_overrides=self.config_overrides)

    if "GenerationTesterMixin" in MISSING_FROM_SDIST:

        def test_generation_tester_mixin_inheritance(self):
            self.skipTest(
                "GenerationTesterMixin is not in the transformers sdist "
                f"({MISSING_FROM_SDIST['GenerationTesterMixin']} "
                "is missing); generate() is covered by tests/models/test_generation_difftransformer.py"
            )


class DiffTransformerV1GQACommonTest(_DiffTransformerCommonTests, unittest.TestCase):
    layout = (1, 8, 4)  # H=4 differential heads over G=2 KV groups (n=2)


class DiffTransformerV1GroupedMotifCommonTest(_DiffTransformerCommonTests, unittest.TestCase):
    """Grouped differential attention with Motif's options (docs/model.md): 8 signal heads share 2 noise heads (r = 4),
    PolyNorm MLP (weights under mlp.act_fn), λinit offset −1."""

    layout = (1, 10, 4)
    config_overrides = {"num_noise_heads": 2, "hidden_act": "poly_norm", "lambda_init_layer_offset": -1}


class DiffTransformerV2GQACommonTest(_DiffTransformerCommonTests, unittest.TestCase):
    layout = (2, 8, 2)  # H=4 differential heads over G=2 KV heads (n=2)
