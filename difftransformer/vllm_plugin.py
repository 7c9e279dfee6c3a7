"""vLLM plugin (pyproject.toml's ``vllm.general_plugins`` entry point): registers the package's native vLLM models.

vLLM calls ``register`` in each of its processes before it resolves a model's architecture. Registration is by name
(``"module:Class"``), so vLLM imports ``vllm_model`` only when it builds one of these models. Importing this package
also registers its configs with transformers' ``AutoConfig`` (``model_type`` "difftransformer" and Motif's "Motif"), so
a folder's ``config.json`` loads without remote code.

* ``DiffTransformerForCausalLM``: the package's DIFF V1 and V2 folders (grouped differential attention included);
* ``MotifForCausalLM``: Motif-2 checkpoint folders (Motif-2.6B, Motif-2-12.7B), which vLLM itself served until
  v0.10.2 and lists as no longer supported; the registration here takes precedence over that notice.
"""

ARCHITECTURES = {
    "DiffTransformerForCausalLM": "difftransformer.vllm_model:DiffTransformerForCausalLM",
    "MotifForCausalLM": "difftransformer.vllm_model:MotifForCausalLM",
}


def register() -> None:
    from vllm import ModelRegistry

    supported = ModelRegistry.get_supported_archs()
    for architecture, model in ARCHITECTURES.items():
        if architecture not in supported:
            ModelRegistry.register_model(architecture, model)
