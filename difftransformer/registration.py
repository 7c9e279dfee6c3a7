"""What ``import difftransformer`` tells the libraries that key behaviour off static tables of architectures, without
importing them: PEFT (default adapter targets by ``model_type``) and Liger Kernel (its patch function by
``model_type``). Each table is filled at once where its module is loaded already, else the moment it is imported
(an import hook that runs once): importing PEFT pulls in bitsandbytes and torchao where installed, and importing
Liger loads Triton, so that ``import difftransformer`` (and the converter's command line) costs neither, nor prints
their import-time warnings. docs/ecosystem.md, "Tools"; the helpers themselves are in :mod:`difftransformer.integrations`.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable

MODEL_TYPE = "difftransformer"
PEFT_CONSTANTS = "peft.utils.constants"
LIGER_MONKEY_PATCH = "liger_kernel.transformers.monkey_patch"


class _RunOnImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after the module ``fullname`` is first executed (then leaves ``sys.meta_path``)."""

    def __init__(self, fullname: str, callback: Callable[[object], None]):
        self.fullname, self.callback = fullname, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.fullname:
            return None
        sys.meta_path.remove(self)  # one registration; and the real finders locate the module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute, callback = spec.loader.exec_module, self.callback

        class Loader(importlib.abc.Loader):
            def create_module(self, spec_):
                return None

            def exec_module(self, module):
                execute(module)
                callback(module)

        spec.loader = Loader()
        return spec


def run_when_imported(fullname: str, callback: Callable[[object], None], package: str) -> bool:
    """``callback(module)`` for the module ``fullname``: now where it is loaded, else when it is first imported.
    Returns False (and does nothing) where ``package`` is not installed. Idempotent per module name."""
    if fullname in sys.modules:
        callback(sys.modules[fullname])
        return True
    if importlib.util.find_spec(package) is None:
        return False
    if not any(isinstance(f, _RunOnImport) and f.fullname == fullname for f in sys.meta_path):
        sys.meta_path.insert(0, _RunOnImport(fullname, callback))
    return True


def _add_to_peft_tables(constants) -> None:
    """Give ``model_type="difftransformer"`` PEFT's Llama defaults for every adapter method: our module names are
    Llama's (``q_proj``, ``v_proj``, ``down_proj``, ...). The tables are mutated in place: PEFT's tuner classes hold
    references to these very dicts (``LoraModel.target_module_mapping`` is
    ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``)."""
    for name in dir(constants):
        table = getattr(constants, name)
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and "llama" in table:
            table.setdefault(MODEL_TYPE, table["llama"])


def _add_to_liger_table(monkey_patch) -> None:
    from .integrations import apply_liger_kernel_to_difftransformer

    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN.setdefault(MODEL_TYPE, apply_liger_kernel_to_difftransformer)


def register_peft() -> bool:
    """PEFT's default adapter targets for our ``model_type`` (see :func:`_add_to_peft_tables`), at once or when PEFT
    is imported. False where PEFT is not installed."""
    return run_when_imported(PEFT_CONSTANTS, _add_to_peft_tables, "peft")


def register_liger() -> bool:
    """Our patch function in Liger Kernel's table (``integrations.apply_liger_kernel_to_difftransformer``), at once
    or when Liger's ``monkey_patch`` module is imported. False where Liger is not installed."""
    return run_when_imported(LIGER_MONKEY_PATCH, _add_to_liger_table, "liger_kernel")


def register_integrations() -> None:
    """:func:`register_peft` and :func:`register_liger`; runs at ``import difftransformer``."""
    register_peft()
    register_liger()


__all__ = ["register_integrations", "register_liger", "register_peft", "run_when_imported"]
