"""difftransformer: the Differential Transformer (DIFF V1 and V2) as a transformers model.

Importing this package registers its own ``model_type "difftransformer"`` (config and model classes) with
transformers' Auto classes, so that ``AutoModelForCausalLM.from_pretrained(folder)`` works without
``trust_remote_code``, and marks the classes for the Hub's remote-code format, so that every ``save_pretrained`` folder
also loads where the package is absent (:mod:`difftransformer.registration`; a ``"difftransformer"`` that transformers
or another package registered first is kept, with a warning). Nothing else is registered at import: Motif's
``model_type "Motif"`` is opt-in (:func:`difftransformer.motif.register_motif`), and PEFT's and Liger Kernel's tables
are changed only by explicit calls (:func:`difftransformer.integrations.register_peft`,
:func:`~difftransformer.integrations.register_liger`). docs/ecosystem.md, "Registration".
"""

from .configuration_difftransformer import DiffTransformerConfig
from .modeling_difftransformer import (
    DiffTransformerForCausalLM,
    DiffTransformerForQuestionAnswering,
    DiffTransformerForSequenceClassification,
    DiffTransformerForTokenClassification,
    DiffTransformerModel,
    DiffTransformerPreTrainedModel,
)
from .motif import MotifConfig, MotifForCausalLM
from .registration import register_difftransformer

__version__ = "0.3.0.dev0"

register_difftransformer()

__all__ = [
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
