"""How the package names its classes to transformers' Auto classes, as a guest: a ``model_type`` is registered only
where it is free or already ours, and another project's registration of the same name is never replaced unless the
caller asks for that (``force=True``).

* ``import difftransformer`` runs :func:`register_difftransformer`: ``model_type "difftransformer"`` (our config and
  the five model heads) with ``AutoConfig`` and the ``AutoModel*`` classes, and marks the classes for the Hub's
  remote-code format (``register_for_auto_class``: every ``save_pretrained`` folder carries the code and its
  ``auto_map``, so it loads where the package is absent). Where transformers or another package already maps
  ``"difftransformer"`` to other classes, it registers nothing, keeps theirs and warns; the classes still load their
  folders directly (``DiffTransformerForCausalLM.from_pretrained``).
* Motif's ``model_type "Motif"`` is a name of Motif Technologies': it is registered only by an explicit
  :func:`difftransformer.motif.register_motif`, through :func:`register_model_type`.
* Other libraries' tables (PEFT's default adapter targets, Liger Kernel's patch functions) are changed only by the
  explicit calls of :mod:`difftransformer.integrations`; nothing here imports PEFT or Liger.

docs/ecosystem.md, "Registration".
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from .configuration_difftransformer import DiffTransformerConfig
from .modeling_difftransformer import (
    DiffTransformerForCausalLM,
    DiffTransformerForQuestionAnswering,
    DiffTransformerForSequenceClassification,
    DiffTransformerForTokenClassification,
    DiffTransformerModel,
)

MODEL_TYPE = DiffTransformerConfig.model_type

AUTO_CLASSES = {
    AutoModel: DiffTransformerModel,
    AutoModelForCausalLM: DiffTransformerForCausalLM,
    AutoModelForSequenceClassification: DiffTransformerForSequenceClassification,
    AutoModelForTokenClassification: DiffTransformerForTokenClassification,
    AutoModelForQuestionAnswering: DiffTransformerForQuestionAnswering,
}


class RegistrationConflict(ValueError):
    """A ``model_type`` (or an Auto class's entry for a config class) is already registered to another class."""


def _name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_ours(found, ours) -> bool:
    """The class itself, or the same class of a re-imported module (``importlib.reload``, a test that re-imports the
    package): same module and qualified name."""
    return found is ours or (getattr(found, "__module__", None), getattr(found, "__qualname__", None)) == (
        ours.__module__,
        ours.__qualname__,
    )


def registration_conflicts(config_class, models: Mapping[type, type]) -> list[str]:
    """What registering ``config_class`` (under its ``model_type``) and ``models`` (``{AutoModelFor...: model class}``)
    would replace: one line per entry that transformers or another package holds with another class."""
    model_type = config_class.model_type
    conflicts = []
    if model_type in CONFIG_MAPPING:
        found = CONFIG_MAPPING[model_type]
        if not _is_ours(found, config_class):
            conflicts.append(f"AutoConfig maps model_type {model_type!r} to {_name(found)}")
    for auto_class, model_class in models.items():
        # The Auto class's own lookup (registered entries, then transformers' tables by the config class's name).
        found = auto_class._model_mapping.get(config_class, None)
        if found is not None and not _is_ours(found, model_class):
            conflicts.append(f"{auto_class.__name__} maps {config_class.__name__} to {_name(found)}")
    return conflicts


def register_model_type(config_class, models: Mapping[type, type], *, force: bool = False) -> None:
    """Register ``config_class`` with ``AutoConfig`` under its ``model_type``, and each model class of ``models`` with
    its Auto class (transformers' ``AutoConfig.register`` / ``AutoModel*.register``).

    Registering our own classes again is a no-op (a re-imported module's classes replace their earlier selves).
    Where transformers or another package holds the name with other classes, nothing is registered and
    :class:`RegistrationConflict` names every entry, unless ``force=True``, which replaces them (for this process).
    transformers' own ``exist_ok=False`` does not do this: it only protects transformers' built-in names."""
    conflicts = registration_conflicts(config_class, models)
    if conflicts and not force:
        raise RegistrationConflict(
            f"model_type {config_class.model_type!r} is already registered by someone else: "
            + "; ".join(conflicts)
            + ". Nothing was replaced; pass force=True to replace it in this process."
        )
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    for auto_class, model_class in models.items():
        auto_class.register(config_class, model_class, exist_ok=True)


def register_difftransformer() -> bool:
    """``model_type "difftransformer"`` with the Auto classes (what ``import difftransformer`` runs); True where it
    is registered to this package's classes. Where another package or transformers holds the name, theirs stays and
    a warning says how to load our folders instead (False). Either way our classes are marked for the remote-code
    format, so that their saved folders carry the code."""
    DiffTransformerConfig.register_for_auto_class()
    for auto_class, model_class in AUTO_CLASSES.items():
        model_class.register_for_auto_class(auto_class.__name__)
    try:
        register_model_type(DiffTransformerConfig, AUTO_CLASSES)
    except RegistrationConflict as err:
        warnings.warn(
            f"difftransformer did not register its classes with transformers' Auto classes: {err} The Auto classes "
            "keep loading the other classes; load difftransformer folders with "
            "difftransformer.DiffTransformerForCausalLM.from_pretrained(folder) (or the other heads) instead.",
            stacklevel=2,
        )
        return False
    return True


__all__ = [
    "AUTO_CLASSES",
    "MODEL_TYPE",
    "RegistrationConflict",
    "register_difftransformer",
    "register_model_type",
    "registration_conflicts",
]
