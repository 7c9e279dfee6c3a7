"""Checkpoint conversions into (and out of) the ``difftransformer`` format (docs/convert.md).

Sources (``--from``) and what each becomes (``--to difftransformer`` unless noted):

==================  ===============================================================================  ============
source              what it is                                                                        result
==================  ===============================================================================  ============
``diffllama``       transformers' ``DiffLlamaForCausalLM`` folder (``model_type: diffllama``)         V1, exact
``microsoft-v1``    a full-model state dict whose attention modules are Microsoft's                   V1, exact
                    ``MultiheadDiffAttn`` / ``MultiheadFlashDiff1`` / ``MultiheadFlashDiff2``
                    (microsoft/unilm ``Diff-Transformer/``), Llama names elsewhere
``microsoft-v2``    the same with ``MultiheadFlashDiffV2`` (``Diff-Transformer/Diff-Transformer-V2/``) V2, exact
``llama``           any Llama / Mistral / Qwen2 causal LM folder, or a Llama-family ``.gguf`` file    V2 exact, V1
                    (read through transformers' GGUF loader, de-quantised to float32)                 approximate
``motif``           a Motif-2.6B / Motif-2-12.7B folder (``model_type: Motif``)                       V1 (GDA), exact
``difftransformer`` our own format: re-save (dtype, sharding) or ``--to diffllama``                  (V1 only to
                                                                                                      DiffLlama)
==================  ===============================================================================  ============

Every source can also be written as a DiffLlama folder (``--to diffllama``) when the result is V1 and not grouped; a
grouped (GDA, ``num_noise_heads``) result as the equivalent plain model (``--to duplicated``), and a plain result whose
noise heads come in identical copies as GDA (``--to gda --num-noise-heads N``); both exact (:mod:`.gda`).

How a conversion runs (its guarantees). :func:`convert` is :func:`plan_conversion` (steps 1-2: reads and checks
everything, decides what will be written, writes nothing; a :class:`ConversionPlan`), then :func:`write_conversion`
(step 3):

1. The source config is read and turned into ours (``rope_parameters``, tied embeddings, ``rms_norm_eps``,
   dtype, biases are carried over).
2. A *plan* lists, for every tensor of the result, the source tensors it is computed from and how (docs/convert.md index
   maps). Before anything is written the plan is checked against the source's key list and shapes: unknown,
   missing and mis-shaped tensors stop the conversion with an error naming them.
3. The result is written into a temporary folder beside the output, one safetensors shard at a time, each tensor
   computed from tensors read lazily (memory-mapped) from the source, so the model is never held twice in memory;
   sharding and the index follow ``huggingface_hub.split_torch_state_dict_into_shards`` as in ``save_pretrained``.
   The folder is renamed into place only at the end, so an interrupted run leaves no half-written model; an output
   that is, holds or lies inside the input is refused.

Modules (one per source format over the shared engine): :mod:`.engine` (checkpoints, plans, index maps, checks,
atomic writing), :mod:`.llama` (Llama-style → V2 / V1 ``pair`` / V1 ``duplicate`` and its calibration),
:mod:`.gguf_source` (``.gguf`` input), :mod:`.diffllama`, :mod:`.microsoft`, :mod:`.motif`, :mod:`.ours`, :mod:`.gda`
(GDA ↔ duplicated plans), :mod:`.api` (:func:`convert`, :func:`plan_conversion`, :func:`write_conversion`,
:func:`build_plan`, :func:`verify_conversion`, :func:`gda_to_duplicated`, :func:`duplicated_to_gda`) and :mod:`.cli`
(``difftransformer-convert``). Each imports only the ones before it in this list (the engine first, the command line
last).

Microsoft full-model state dicts: Microsoft released modules, not models, so the rest of the model is named as in
Llama (``model.embed_tokens.weight``, ``model.layers.{l}.input_layernorm.weight``, ...), the attention module at
``model.layers.{l}.self_attn.`` with Microsoft's own parameter names (``q_proj``, ``k_proj``, ``v_proj``,
``out_proj`` (V1) / ``o_proj`` (V2), ``lambda_q1`` ..., ``subln.weight``, ``lambda_proj``). A JSON key map (see
:func:`load_key_map`) renames other layouts into that one. The head counts follow Microsoft's convention: its
``num_heads`` is our ``H`` (half the query heads), its ``num_kv_heads`` our ``G``; its ``depth`` is our 0-based
layer index.
"""

from .api import (
    SOURCES,
    TARGETS,
    ConversionPlan,
    ConversionResult,
    MicrosoftSource,
    V1Upcycling,
    build_plan,
    convert,
    duplicated_to_gda,
    gda_to_duplicated,
    plan_conversion,
    verify_conversion,
    write_conversion,
)
from .diffllama import config_from_diffllama, diffllama_config_from, plan_from_diffllama, to_diffllama
from .engine import (
    DEFAULT_MAX_SHARD_SIZE,
    DTYPES,
    GENERATION_CONFIG_FILE,
    TOKENIZER_FILES,
    Checkpoint,
    ConversionError,
    Plan,
    Step,
    check_source,
    expand_heads,
    interleaved_to_rotate_half,
    invert,
    is_lambda_vector,
    v1_kv_heads_from,
    v1_query_heads_from,
    verify_prompt,
    write_plan,
)
from .gda import gda_query_heads, to_duplicated, to_gda
from .gguf_source import GGUF_ARCHITECTURES, load_gguf, read_gguf_header
from .llama import (
    LLAMA_STYLE_MODEL_TYPES,
    V1_CALIBRATIONS,
    V1_INITS,
    calibrate_v1_output_scales,
    calibration_input_ids,
    config_from_llama,
    plan_from_llama,
    resolve_v1_init,
    v1_output_scales,
)
from .microsoft import (
    MICROSOFT_CONFIG_FIELDS,
    MICROSOFT_V1_MODULES,
    config_from_microsoft,
    load_key_map,
    plan_from_microsoft,
    rename_checkpoint,
)
from .motif import config_from_motif, plan_from_motif
from .ours import plan_from_difftransformer

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "DTYPES",
    "GENERATION_CONFIG_FILE",
    "GGUF_ARCHITECTURES",
    "LLAMA_STYLE_MODEL_TYPES",
    "MICROSOFT_CONFIG_FIELDS",
    "MICROSOFT_V1_MODULES",
    "SOURCES",
    "TARGETS",
    "TOKENIZER_FILES",
    "V1_CALIBRATIONS",
    "V1_INITS",
    "V1Upcycling",
    "Checkpoint",
    "ConversionError",
    "ConversionPlan",
    "ConversionResult",
    "MicrosoftSource",
    "Plan",
    "Step",
    "build_plan",
    "calibrate_v1_output_scales",
    "calibration_input_ids",
    "check_source",
    "config_from_diffllama",
    "config_from_llama",
    "config_from_microsoft",
    "config_from_motif",
    "convert",
    "diffllama_config_from",
    "duplicated_to_gda",
    "expand_heads",
    "gda_query_heads",
    "gda_to_duplicated",
    "interleaved_to_rotate_half",
    "invert",
    "is_lambda_vector",
    "load_gguf",
    "load_key_map",
    "plan_from_diffllama",
    "plan_from_difftransformer",
    "plan_from_llama",
    "plan_from_microsoft",
    "plan_conversion",
    "plan_from_motif",
    "read_gguf_header",
    "rename_checkpoint",
    "resolve_v1_init",
    "to_diffllama",
    "to_duplicated",
    "to_gda",
    "v1_kv_heads_from",
    "v1_output_scales",
    "v1_query_heads_from",
    "verify_conversion",
    "verify_prompt",
    "write_conversion",
    "write_plan",
]
