"""Configuration of the Differential Transformer (DIFF V1, arXiv 2410.05258; DIFF V2, 2026).

Config fields keep Llama's meaning so that every transformers utility (caches, masks, memory estimates,
tensor-parallel plans) sees standard shapes:

* ``num_attention_heads`` (``Hq``) counts *query heads of width* ``head_dim`` (``d``): one per softmax map.
  A model has ``H = Hq / 2`` differential (output) heads.
* ``num_key_value_heads`` (``Hkv``) counts cached key heads = cached value heads, width ``d``.
* V1: ``G = Hkv / 2`` key/value groups, each holding ``K1, K2`` and a ``2d``-wide value; ``n = H / G``.
* V2: ``G = Hkv`` groups; the two query heads of a pair share one KV head; ``n = H / G``.
* Grouped differential attention (GDA, arXiv 2510.06949): ``num_noise_heads`` (``N``) of the ``Hq`` query heads are
  noise maps, each shared by ``r = H / N`` signal maps; ``H = Hq − N``. ``N = Hq / 2`` (the default) is ``r = 1``.

A field's own type and range are checked whenever it is set, by huggingface_hub's ``@strict`` with transformers'
field validators (its exception names the field); every invariant between fields is checked at construction, a bad
combination raising ``ValueError`` naming the fields.
"""

import dataclasses
import difflib
import functools

from huggingface_hub.dataclasses import as_validated_field, strict
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.generation.configuration_utils import GenerationConfig
from transformers.modeling_rope_utils import RopeParameters
from transformers.utils import logging
from transformers.utils.type_validators import interval, positive_int_field

logger = logging.get_logger(__name__)

SUPPORTED_DIFF_VERSIONS = (1, 2)
# Fields that only one version reads, with their default: set to anything else on the other version, they warn (once
# per field and value, naming it): the model does not read them. A warning, not an error, because transformers' own
# helpers set such fields wholesale (its common tests' `_config_zero_init` sets every `*_std` field).
VERSION_ONLY_FIELDS = {
    1: {"lambda_init": None, "lambda_std": 0.1, "subln_eps": 1e-5, "lambda_init_layer_offset": 0},
    2: {},
}
# MLP activations with weights of their own (a module under ``mlp.act_fn``), beside transformers' ``ACT2FN``:
# Motif's PolyNorm, ``w0·N(x³) + w1·N(x²) + w2·N(x) + b`` (modeling_difftransformer.py).
PARAMETRIZED_ACTIVATIONS = ("poly_norm",)
# The classes a saved folder's `auto_map` names, so that it loads as remote code through every Auto class
# (transformers records only the class being saved and AutoConfig): completed when the config is written (to_dict).
AUTO_MAP = {
    "AutoModel": "DiffTransformerModel",
    "AutoModelForCausalLM": "DiffTransformerForCausalLM",
    "AutoModelForSequenceClassification": "DiffTransformerForSequenceClassification",
    "AutoModelForTokenClassification": "DiffTransformerForTokenClassification",
    "AutoModelForQuestionAnswering": "DiffTransformerForQuestionAnswering",
}
_CONFIG_ENTRY = "configuration_difftransformer.DiffTransformerConfig"
# Keyword arguments that are not fields of this config yet are no misspelling (DiffTransformerConfig warns for the
# others): what a saved config.json carries beside the fields, what transformers' `PreTrainedConfig.__post_init__` reads
# itself (the rope keys before `rope_parameters`, the implementation choices), and what configs written by older
# transformers releases hold. Beside these: `PreTrainedConfig`'s own attributes and properties (`model_type`,
# `num_labels`, `torch_dtype`, ...), generation parameters (configs saved them before generation_config.json;
# transformers drops them), and names with a leading underscore (transformers' internal keys, e.g. `_name_or_path`).
TRANSFORMERS_CONFIG_KEYS = frozenset(
    {
        "auto_map",
        "quantization_config",
        "custom_pipelines",
        "attn_implementation",
        "experts_implementation",
        "rope_theta",
        "partial_rotary_factor",
        "is_decoder",
        "add_cross_attention",
        "cross_attention_hidden_size",
        "tie_encoder_decoder",
        "torchscript",
        "use_bfloat16",
        "tf_legacy_loss",
        "pruned_heads",
        "finetuning_task",
        "tokenizer_class",
        "prefix",
        "sep_token_id",
        "task_specific_params",
    }
)
_WARNED_UNKNOWN: set[str] = set()


@functools.cache
def _known_keywords(config_class) -> frozenset:
    """The keyword arguments ``config_class`` takes without a warning: its fields and those of
    :data:`TRANSFORMERS_CONFIG_KEYS`' kinds."""
    fields = (f.name for f in dataclasses.fields(config_class))
    return frozenset({*fields, *TRANSFORMERS_CONFIG_KEYS, *dir(PreTrainedConfig), *GenerationConfig().to_dict()})


POSITIVE_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)

# Per-field checks, run by huggingface_hub's @strict whenever a field is set (at construction, and on assignment): its
# error names the field, wrapping the message below. Cross-field checks are `validate_architecture`'s.
positive_number = interval(min=0.0, exclude_min=True)  # a norm's epsilon
non_negative = interval(min=0.0)  # a standard deviation


@as_validated_field
def supported_diff_version(value: int):
    if value not in SUPPORTED_DIFF_VERSIONS:
        raise ValueError(
            f"Value must be one of {SUPPORTED_DIFF_VERSIONS} (1 = DIFF V1 paper, 2 = DIFF V2), got {value!r}."
        )


@as_validated_field
def no_attention_dropout(value):
    if value not in (None, 0, 0.0):
        raise ValueError(f"Value must be 0: the Differential Transformer defines no attention dropout; got {value!r}.")


@as_validated_field
def lambda_init_value(value: float | None):
    if value is not None and not 0.0 <= value < 1.0:
        raise ValueError(f"Value must be None (depth schedule) or in [0, 1); got {value!r}.")


@strict
class DiffTransformerConfig(PreTrainedConfig):
    r"""
    Configuration of a [`DiffTransformerModel`]. Llama's fields plus:

    diff_version (`int`, defaults to 1):
        1: the paper's differential attention, `(softmax(Q1K1ᵀ/√d) − λ softmax(Q2K2ᵀ/√d)) [V1;V2]` with a
        per-layer scalar λ, per-head RMSNorm and `(1 − λinit)` scaling. 2: DIFF V2, adjacent query heads
        over one shared KV head, `o_h = a_2h − sigmoid(x W_λ)_h · a_2h+1`, no per-head norm.
    lambda_init (`float`, *optional*):
        V1 only. Constant `λinit` for every layer; `None` (default) uses the paper's depth schedule
        `0.8 − 0.6·exp(−0.3·l)` with 0-based layer index `l`.
    lambda_std (`float`, defaults to 0.1):
        V1 only. Standard deviation of the normal initialisation of `λq1, λk1, λq2, λk2`.
    subln_eps (`float`, defaults to 1e-5):
        V1 only. Epsilon of the per-head RMSNorm over the `2·head_dim` features of a differential head.
    num_noise_heads (`int`, *optional*):
        Grouped differential attention (arXiv 2510.06949): how many of the `num_attention_heads` query heads are
        noise maps (the second softmax of a head), each shared by `r = (num_attention_heads − num_noise_heads) /
        num_noise_heads` signal maps: `O_h = (A_h − λ A_noise(h)) V`. `None` (default): `num_attention_heads / 2`,
        i.e. `r = 1`, one noise map per head (the paper's DIFF V1 / DIFF V2). Row order: docs/model.md.
    lambda_init_layer_offset (`int`, defaults to 0):
        V1 only. The depth schedule reads `λinit = 0.8 − 0.6·exp(−0.3·(l + lambda_init_layer_offset))`; Motif's
        checkpoints use −1 (layer 0 gets `λinit ≈ −0.0099`).

    Example:

    ```python
    >>> from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
    >>> config = DiffTransformerConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
    ...                                num_hidden_layers=4, intermediate_size=688, diff_version=1)
    >>> model = DiffTransformerForCausalLM(config)
    ```
    """

    model_type = "difftransformer"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the output field before and from transformers 5.24
    # Same layout as Llama: with the group-major row order (docs/model.md, "What it computes") a contiguous column shard
    # of q/k/v (and of lambda_proj in V2) holds whole KV groups, so every shard computes whole heads.
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.lambda_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        # V1's λ vectors (the attention module's own parameters) and per-head norm are replicated but each rank's use
        # covers only its heads: "replicated_grad_sum" (modeling_difftransformer.py) sums their gradients over the
        # tensor-parallel group in every backward pass.
        "layers.*.self_attn": "replicated_grad_sum",
        "layers.*.self_attn.subln": "replicated_grad_sum",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = positive_int_field(default=32000)
    hidden_size: int = positive_int_field(default=2048)
    intermediate_size: int = positive_int_field(default=5632)
    num_hidden_layers: int = positive_int_field(default=16)
    num_attention_heads: int = positive_int_field(default=32)
    num_key_value_heads: int | None = positive_int_field(default=None)
    head_dim: int | None = positive_int_field(default=None)
    hidden_act: str = "silu"
    max_position_embeddings: int = positive_int_field(default=2048)
    initializer_range: float = non_negative(default=0.02)
    rms_norm_eps: float = positive_number(default=1e-5)
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int | None = no_attention_dropout(default=0.0)
    mlp_bias: bool = False
    diff_version: int = supported_diff_version(default=1)
    lambda_init: float | None = lambda_init_value(default=None)
    lambda_std: float = non_negative(default=0.1)
    subln_eps: float = positive_number(default=1e-5)
    num_noise_heads: int | None = positive_int_field(default=None)
    lambda_init_layer_offset: int = 0

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            # An explicit head_dim may differ from hidden_size // Hq (as in Llama); a derived one must divide exactly.
            hq = self.num_attention_heads
            if self.hidden_size % hq:
                raise ValueError(
                    f"`hidden_size` ({self.hidden_size}) is not divisible by `num_attention_heads` "
                    f"({hq}); set `head_dim` explicitly or choose sizes that divide."
                )
            self.head_dim = self.hidden_size // hq
        # Checked here, not only in `validate_architecture`, so that users get a plain ValueError
        # (``@strict`` wraps validator errors in its own exception type).
        self.validate_architecture()
        self._warn_unknown_fields(kwargs)
        super().__post_init__(**kwargs)

    @classmethod
    def _warn_unknown_fields(cls, kwargs: dict) -> None:
        """Warn once per name for a keyword argument that is neither a field of this config nor a key transformers
        passes (:data:`TRANSFORMERS_CONFIG_KEYS`): transformers keeps it as an attribute (and saves it), but no model
        reads it, which is what a misspelt field looks like. Names the nearest field."""
        known = _known_keywords(cls)
        for name in kwargs:
            if name.startswith("_") or name in known or name in _WARNED_UNKNOWN:
                continue
            _WARNED_UNKNOWN.add(name)
            nearest = difflib.get_close_matches(name, [f.name for f in dataclasses.fields(cls)], n=1)
            hint = f"did you mean `{nearest[0]}`?" if nearest else 'the fields: docs/model.md, "Configuration"'
            logger.warning(
                f"{cls.__name__} got the keyword argument {name!r}, which is not one of its fields ({hint}): it is "
                "kept as an attribute and saved, but no model reads it. (Warned once per name.)"
            )

    def validate_architecture(self):
        """Every invariant between fields (docs/model.md, "Configuration"); runs at construction and from
        ``config.validate()``. Each field's own type and range are checked by its validator when it is set.

        ``hidden_act`` is checked here rather than by a field validator: a subclass that redefines the field with its
        own default (``MotifConfig``: ``"poly_norm"``) would drop that validator."""
        v, hq, hkv, d = self.diff_version, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        if self.hidden_act not in ACT2FN and self.hidden_act not in PARAMETRIZED_ACTIVATIONS:
            raise ValueError(
                f"`hidden_act` must be one of transformers' activations ({', '.join(sorted(ACT2FN))}) or "
                f"{', '.join(PARAMETRIZED_ACTIVATIONS)}, got {self.hidden_act!r}."
            )
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"`pad_token_id` must be None or a token id in [0, vocab_size = {self.vocab_size}) (the embedding's "
                f"padding row), got {self.pad_token_id!r}."
            )
        theta = (self.rope_parameters or {}).get("rope_theta") if isinstance(self.rope_parameters, dict) else None
        if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0):
            raise ValueError(f"`rope_parameters['rope_theta']` must be a positive number, got {theta!r}.")
        noise = self.num_noise_heads
        if noise is None and hq % 2:
            raise ValueError(
                "`num_attention_heads` must be even: it counts query heads, two (one pair) per differential head; got "
                f"{hq}. (With grouped differential attention set `num_noise_heads`.)"
            )
        if d % 2:
            raise ValueError(f"`head_dim` must be even (rotary embeddings rotate pairs of features); got {d}.")
        num_heads = hq // 2
        if v == 1:
            if hkv % 2:
                raise ValueError(
                    "`num_key_value_heads` must be even for diff_version=1: each KV group holds two key heads (K1, "
                    f"K2) and two value halves; got {hkv}."
                )
            groups = hkv // 2
        else:
            groups = hkv
        if noise is not None:
            self._validate_noise_heads(v, hq, hkv, groups, noise)
        elif num_heads % groups:
            allowed = sorted({2 * g if v == 1 else g for g in range(1, num_heads + 1) if num_heads % g == 0})
            raise ValueError(
                f"diff_version={v}: the {num_heads} differential heads (num_attention_heads / 2) must split evenly "
                f"into the {groups} KV groups (num_key_value_heads{' / 2' if v == 1 else ''}) so that both maps of a "
                f"pair read the same group; num_key_value_heads must be one of {allowed}, got {hkv}."
            )
        for version, fields in VERSION_ONLY_FIELDS.items():
            for name, unused in fields.items():
                if version != v and getattr(self, name) != unused:
                    logger.warning_once(
                        f"`{name}` = {getattr(self, name)!r} is not read by a diff_version={v} model (it applies to "
                        f"diff_version={version} only); it has no effect."
                    )

    @staticmethod
    def _validate_noise_heads(v: int, hq: int, hkv: int, groups: int, noise) -> None:
        """Grouped differential attention: ``N = num_noise_heads`` noise maps, ``H = Hq − N`` signal maps, ``r = H / N``
        an integer, and the KV groups ``G`` dividing ``N`` (so each noise head and its ``r`` signal heads read one
        group)."""
        kv = f"num_key_value_heads{' / 2' if v == 1 else ''}"
        fitting = [k for k in range(1, hq) if hq % k == 0 and k % groups == 0]
        if noise >= hq or hq % noise:
            raise ValueError(
                f"`num_noise_heads` ({noise}) must divide num_attention_heads ({hq}) and be smaller: the "
                f"num_attention_heads - num_noise_heads signal heads are r per noise head, r a positive integer. With "
                f"{groups} KV groups ({kv}) it must be one of {fitting} or None (= num_attention_heads / 2)."
            )
        if noise % groups:
            kv_allowed = sorted({2 * g if v == 1 else g for g in range(1, noise + 1) if noise % g == 0})
            raise ValueError(
                f"diff_version={v}: the {noise} noise heads (num_noise_heads) must split evenly into the {groups} KV "
                f"groups ({kv}) so that every noise head and its signal heads read one group; num_key_value_heads "
                f"must be one of {kv_allowed}, got {hkv} (or num_noise_heads one of {fitting})."
            )

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """As transformers' (the one read of ``config.json`` or GGUF metadata that ``from_pretrained`` makes), refusing
        a checkpoint of another architecture, e.g. a Llama folder loaded as a DiffTransformer: V1 has a Llama's shapes,
        so its weights would load into differently wired heads."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        found = config_dict.get("model_type")
        if found not in (None, cls.model_type):
            raise ValueError(
                f"{pretrained_model_name_or_path} holds a {found!r} checkpoint, not a {cls.model_type!r} one. Convert "
                "it first, e.g. `difftransformer-convert --from llama --diff-version 2 --input "
                f"{pretrained_model_name_or_path} --output OUT` (exact for Llama-family models; see docs/convert.md "
                "for every source format)."
            )
        return config_dict, kwargs

    def to_dict(self) -> dict:
        """As transformers', with an ``auto_map`` that names this config's class (a folder saved with remote code)
        naming every Auto class of :data:`AUTO_MAP` too, in the same repository (the config itself is not changed)."""
        output = super().to_dict()
        auto_map = output.get("auto_map") or {}
        entry = auto_map.get("AutoConfig")
        if isinstance(entry, str) and entry.endswith(_CONFIG_ENTRY):
            where = entry[: -len(_CONFIG_ENTRY)]  # "" or "owner/repo--" for code kept in another repository
            output["auto_map"] = {
                **{auto: f"{where}modeling_difftransformer.{name}" for auto, name in AUTO_MAP.items()},
                **auto_map,
            }
        return output

    # Derived sizes (docs/model.md, "Configuration"); not serialised.
    @property
    def noise_heads(self) -> int:
        """N: noise maps (query heads whose softmax is subtracted); ``Hq / 2`` unless ``num_noise_heads`` is set."""
        return self.num_noise_heads if self.num_noise_heads is not None else self.num_attention_heads // 2

    @property
    def noise_ratio(self) -> int:
        """r: signal maps per noise map (1 for the paper's DIFF V1 / V2)."""
        return self.num_diff_heads // self.noise_heads

    @property
    def num_diff_heads(self) -> int:
        """H: differential (output) heads = signal maps, ``Hq − N``."""
        return self.num_attention_heads - self.noise_heads

    @property
    def num_kv_groups(self) -> int:
        """G: KV groups; every differential head reads exactly one."""
        return self.num_key_value_heads // 2 if self.diff_version == 1 else self.num_key_value_heads


__all__ = ["DiffTransformerConfig"]
