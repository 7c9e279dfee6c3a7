"""difftransformer: the Differential Transformer (DIFF V1 and V2) as a transformers model.

Importing this package registers the config and model classes with transformers' Auto classes, so that
``AutoModelForCausalLM.from_pretrained(folder)`` works without ``trust_remote_code``, and marks them for the
Hub's remote-code format, so that every ``save_pretrained`` folder also loads where the package is absent.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_difftransformer import DiffTransformerConfig
from .integrations import register_integrations
from .modeling_difftransformer import (
    CACHE_NAME,
    DiffTransformerForCausalLM,
    DiffTransformerForQuestionAnswering,
    DiffTransformerForSequenceClassification,
    DiffTransformerForTokenClassification,
    DiffTransformerModel,
    DiffTransformerPreTrainedModel,
)

__version__ = "0.1.0"

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
register_integrations()  # PEFT default LoRA targets and Trainer's causal-LM table (see integrations.py)

__all__ = [
    "CACHE_NAME",
    "DiffTransformerConfig",
    "DiffTransformerPreTrainedModel",
    "DiffTransformerModel",
    "DiffTransformerForCausalLM",
    "DiffTransformerForSequenceClassification",
    "DiffTransformerForTokenClassification",
    "DiffTransformerForQuestionAnswering",
]
