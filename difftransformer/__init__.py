"""difftransformer: the Differential Transformer (DIFF V1 and V2) as a transformers model.

Importing this package registers the config and model classes with transformers' Auto classes, so that
``AutoModelForCausalLM.from_pretrained(folder)`` works without ``trust_remote_code``, and marks them for the
Hub's remote-code format, so that every ``save_pretrained`` folder also loads where the package is absent. It also
registers Motif's checkpoints (``model_type "Motif"``, :mod:`difftransformer.motif`) as a configuration of our model.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)
from transformers.conversion_mapping import register_checkpoint_conversion_mapping

from .configuration_difftransformer import DiffTransformerConfig
from .modeling_difftransformer import (
    CACHE_NAME,
    DiffTransformerForCausalLM,
    DiffTransformerForQuestionAnswering,
    DiffTransformerForSequenceClassification,
    DiffTransformerForTokenClassification,
    DiffTransformerModel,
    DiffTransformerPreTrainedModel,
)
from .motif import MOTIF_MODEL_TYPE, MotifConfig, MotifForCausalLM, motif_weight_conversions
from .registration import register_integrations

__version__ = "0.2.0"

_AUTO_CLASSES = {
    AutoModel: DiffTransformerModel,
    AutoModelForCausalLM: DiffTransformerForCausalLM,
    AutoModelForSequenceClassification: DiffTransformerForSequenceClassification,
    AutoModelForTokenClassification: DiffTransformerForTokenClassification,
    AutoModelForQuestionAnswering: DiffTransformerForQuestionAnswering,
}

AutoConfig.register(DiffTransformerConfig.model_type, DiffTransformerConfig, exist_ok=True)
DiffTransformerConfig.register_for_auto_class()
for _auto_class, _model_class in _AUTO_CLASSES.items():
    _auto_class.register(DiffTransformerConfig, _model_class, exist_ok=True)
    _model_class.register_for_auto_class(_auto_class.__name__)
register_integrations()  # PEFT default adapter targets and Liger's table, when they are imported (registration.py)
# Motif-2 checkpoints: their config class and model class (ours, configured), and the load-time query-row order.
AutoConfig.register(MOTIF_MODEL_TYPE, MotifConfig, exist_ok=True)
AutoModelForCausalLM.register(MotifConfig, MotifForCausalLM, exist_ok=True)
register_checkpoint_conversion_mapping(MOTIF_MODEL_TYPE, motif_weight_conversions(), overwrite=True)

__all__ = [
    "CACHE_NAME",
    "DiffTransformerConfig",
    "DiffTransformerPreTrainedModel",
    "DiffTransformerModel",
    "DiffTransformerForCausalLM",
    "DiffTransformerForSequenceClassification",
    "DiffTransformerForTokenClassification",
    "DiffTransformerForQuestionAnswering",
    "MotifConfig",
    "MotifForCausalLM",
]
