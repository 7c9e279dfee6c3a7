"""vLLM plugin (pyproject.toml's ``vllm.general_plugins`` entry point): registers the package's native vLLM models.

vLLM calls ``register`` in each of its processes before it resolves a model's architecture. Registration is by name
(``"module:Class"``), so vLLM imports ``vllm_model`` only when it builds one of these models. Importing this package
registers its config with transformers' ``AutoConfig`` (``model_type`` "difftransformer"), and ``register`` also
registers Motif's "Motif" (:func:`difftransformer.motif.register_motif`: installing the plugin in vLLM's environment is
the opt-in), so a folder's ``config.json`` loads without remote code. Where another package already holds "Motif",
that registration is kept and a warning says so.

* ``DiffTransformerForCausalLM``: the package's DIFF V1 and V2 folders (grouped differential attention included);
* ``MotifForCausalLM``: Motif-2 checkpoint folders (Motif-2.6B, Motif-2-12.7B), which vLLM itself served until
  v0.10.2 and lists as no longer supported; the registration here takes precedence over that notice.
"""

ARCHITECTURES = {
    "DiffTransformerForCausalLM": "difftransformer.vllm_model:DiffTransformerForCausalLM",
    "MotifForCausalLM": "difftransformer.vllm_model:MotifForCausalLM",
}


def register() -> None:
    import logging

    from vllm import ModelRegistry

    from .motif import register_motif
    from .registration import RegistrationConflict

    try:
        register_motif()
    except RegistrationConflict as err:
        logging.getLogger(__name__).warning("%s", err)

    supported = ModelRegistry.get_supported_archs()
    for architecture, model in ARCHITECTURES.items():
        if architecture not in supported:
            ModelRegistry.register_model(architecture, model)
