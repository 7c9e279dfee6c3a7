"""vLLM plugin (setup.py's ``vllm.general_plugins`` entry point): registers the native DIFF V2 model with vLLM.

vLLM calls ``register`` in each of its processes before it resolves a model's architecture. Registration is by name
(``"module:Class"``), so vLLM imports ``vllm_model`` only when it builds a DIFF model. Importing this package also
registers the config with transformers' ``AutoConfig``, so a folder's ``config.json`` loads without remote code.
"""

ARCHITECTURE = "DiffTransformerForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "difftransformer.vllm_model:DiffTransformerForCausalLM")
