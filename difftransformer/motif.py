"""Motif Technologies' Motif-2.6B and Motif-2-12.7B checkpoints (``model_type: "Motif"``) as a configuration of
``DiffTransformerForCausalLM``: no fork of the model, no remote code.

What Motif's published forward computes (docs/reports/2026-11-26-motif-sources.md, tests/motif_reference.py) and the
option of ours that expresses it:

==========================================  ===========================================================================
Motif                                       ours
==========================================  ===========================================================================
half-head counts (``num_attention_heads``   the same fields, the same meaning
= query half-heads of width ``head_dim``)
``num_noise_heads`` (absent: Hq / 2)        ``num_noise_heads`` (grouped differential attention, docs/model.md)
query rows ``[signal × r, noise]`` per      our rows: per KV group its signal rows, then its noise rows. The same order
noise head                                  when a KV group has one noise head (both released models); otherwise the
                                            rows are permuted at load (:class:`MotifQueryRows`)
keys/values: even half-heads K1/V1, odd     our ``(g, c)`` order: unchanged
ones K2/V2
``λinit = 0.8 − 0.6·exp(−0.3·(l − 1))``     ``lambda_init_layer_offset = −1``
``attn_rms_norm_eps`` (per-head RMSNorm)    ``subln_eps``
``hidden_act: "poly_norm"``                 ``hidden_act="poly_norm"`` (``mlp.act_fn.weight`` [3], ``mlp.act_fn.bias``
                                            [1]: Motif's key names)
``use_bias`` / ``attention_bias``           ``attention_bias`` (q/k/v/o), ``mlp_bias``
NeoX (rotate-half) RoPE, ``rope_theta``     transformers' rotary embeddings (rotate-half)
==========================================  ===========================================================================

How a Motif folder loads (docs/models.md, "Motif-2 checkpoints: which call does what"):

* ``MotifForCausalLM.from_pretrained(folder)``: always, with no registration and no remote code. The class carries its
  own load-time conversion (the query-row order, :class:`MotifQueryRows`) and records it for ``save_pretrained``, which
  writes Motif's layout back.
* ``AutoModelForCausalLM.from_pretrained(folder)``: after :func:`register_motif` (opt-in). ``"Motif"`` is Motif
  Technologies' name, not this package's: ``import difftransformer`` does not register it, and :func:`register_motif`
  refuses to replace a ``"Motif"`` that transformers or another package registered (``force=True`` replaces it).
  Without it, transformers follows the folder's own ``auto_map`` to Motif's remote code (``trust_remote_code=True``
  runs Motif's code from the Hub, not this package's).
* ``difftransformer-convert --from motif`` writes the same model as a difftransformer folder (our ``model_type``,
  remote code included); it needs no registration either.
* ``Trainer(label_smoothing_factor=...)`` shifts labels only for class names in transformers' causal-LM names:
  building a :class:`MotifForCausalLM` adds its own there (never replacing an entry; not at import).
"""

from __future__ import annotations

import dataclasses

import torch
from huggingface_hub.dataclasses import strict
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .configuration_difftransformer import DiffTransformerConfig
from .modeling_difftransformer import DiffTransformerForCausalLM
from .motif_layers_difftransformer import MotifPolyNorm, MotifPolyNormMLP  # noqa: F401 (re-exported)
from .registration import register_model_type

MOTIF_MODEL_TYPE = "Motif"
# λinit(l) = 0.8 − 0.6·exp(−0.3·(l − 1)) with 0-based l in Motif's code: one layer off the paper's schedule.
MOTIF_LAMBDA_INIT_LAYER_OFFSET = -1


@strict
class MotifConfig(DiffTransformerConfig):
    r"""
    A Motif ``config.json`` (``model_type: "Motif"``) read as a [`DiffTransformerConfig`]: Motif's fields are kept as
    they are and ours are derived from them in ``__post_init__`` (``diff_version=1``, ``subln_eps`` =
    ``attn_rms_norm_eps``, ``lambda_init_layer_offset=-1``, ``attention_bias`` = ``attention_bias or use_bias``,
    ``mlp_bias`` = ``use_bias``; ``num_noise_heads``, ``head_dim``, ``rope_theta`` / ``rope_scaling`` keep their
    meaning). What our model cannot compute exactly is refused with the field's name: ``k_ratio`` other than 1 (Motif's
    own code ignores it), a ``qkv_bias`` that differs from the output projection's bias, and a sliding window
    (``use_sliding_window``; Motif's vLLM ports run without one).

    attn_rms_norm_eps (`float`, defaults to 1e-5): epsilon of the per-head RMSNorm (our `subln_eps`).
    use_bias (`bool`, defaults to False): biases in q/k/v/o and in the MLP projections.
    qkv_bias (`bool`, *optional*): Motif's override of the q/k/v biases; must equal the o_proj bias here.
    k_ratio (`int`, *optional*): must be None or 1.
    use_sliding_window (`bool`, defaults to False): must be False.
    """

    model_type = MOTIF_MODEL_TYPE
    _auto_class = None  # saved as Motif's own config.json, without difftransformer's remote code

    hidden_act: str = "poly_norm"
    attn_rms_norm_eps: float = 1e-5
    use_bias: bool = False
    qkv_bias: bool | None = None
    k_ratio: int | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = None

    def __post_init__(self, **kwargs):
        if self.k_ratio not in (None, 1):
            raise ValueError(
                f"`k_ratio` must be 1 or absent, got {self.k_ratio!r}: only k_ratio = 1 is published, and Motif's own "
                "code splits keys into equal K1/K2 halves whatever it says."
            )
        if self.use_sliding_window:
            raise ValueError(
                f"`use_sliding_window` must be false, got true (sliding_window={self.sliding_window!r}): "
                "difftransformer attends to the whole context (as Motif's vLLM ports do), so outputs would differ "
                "beyond the window."
            )
        attention_bias = bool(self.attention_bias or self.use_bias)
        if self.qkv_bias is not None and bool(self.qkv_bias) != attention_bias:
            raise ValueError(
                f"`qkv_bias` ({self.qkv_bias}) must equal the o_proj bias (attention_bias or use_bias = "
                f"{attention_bias}): difftransformer's attention_bias switches q/k/v/o biases together."
            )
        self.diff_version = 1
        self.attention_bias = attention_bias
        self.mlp_bias = bool(self.mlp_bias or self.use_bias)
        self.subln_eps = self.attn_rms_norm_eps
        self.lambda_init_layer_offset = MOTIF_LAMBDA_INIT_LAYER_OFFSET
        super().__post_init__(**kwargs)


def motif_query_heads(config) -> torch.Tensor:
    """For every query half-head of ours, the Motif half-head it is (a permutation of ``range(Hq)``).

    Motif: noise head ``k`` owns half-heads ``k(r+1) … k(r+1) + r``, its r signal heads then itself; signal head ``h``
    is signal ``h mod r`` of noise head ``h // r``. Ours (docs/model.md): per KV group ``g`` its ``n`` signal heads
    ``h = g·n + j``, then its ``m = N / G`` noise heads ``g·m + l``. Identical when ``m = 1`` (Motif-2.6B: MHA;
    Motif-2-12.7B: 8 noise heads over 8 KV pairs)."""
    r, groups = config.noise_ratio, config.num_kv_groups
    n, m = config.num_diff_heads // groups, config.noise_heads // groups
    index = []
    for g in range(groups):
        index += [(h // r) * (r + 1) + h % r for h in range(g * n, (g + 1) * n)]
        index += [k * (r + 1) + r for k in range(g * m, (g + 1) * m)]
    return torch.tensor(index)


def motif_query_rows(config) -> torch.Tensor:
    """``motif_query_heads`` as row indices of ``q_proj`` (``head_dim`` rows per half-head)."""
    d = config.head_dim
    return (motif_query_heads(config)[:, None] * d + torch.arange(d)).reshape(-1)


class MotifQueryRows(ConversionOps):
    """Load-time permutation of ``q_proj`` rows (weight and bias) from Motif's order into ours, and back when saving
    (transformers' weight-conversion format; :class:`MotifForCausalLM` applies it). The identity when every KV group
    holds one noise head."""

    def __init__(self, inverse: bool = False):
        self.inverse = inverse

    def _rows(self, config) -> torch.Tensor | None:
        rows = motif_query_rows(config)
        if torch.equal(rows, torch.arange(rows.numel())):
            return None
        return torch.argsort(rows) if self.inverse else rows

    @torch.no_grad()
    def convert(self, input_dict, source_patterns=None, target_patterns=None, config=None, **kwargs):
        output = {}
        for key, tensors in input_dict.items():
            tensor = tensors[0] if isinstance(tensors, list) else tensors
            rows = self._rows(config)
            output[key] = tensor if rows is None else tensor.index_select(0, rows.to(tensor.device))
        return output

    @property
    def reverse_op(self) -> ConversionOps:
        return MotifQueryRows(inverse=not self.inverse)


def motif_weight_conversions() -> list:
    """The load-time conversion of a Motif checkpoint (transformers' weight-conversion format): Motif's key names are
    ours; only the query rows may need reordering. :class:`MotifForCausalLM` applies it itself."""
    return [
        WeightConverter(f"self_attn.q_proj.{kind}", f"self_attn.q_proj.{kind}", operations=[MotifQueryRows()])
        for kind in ("weight", "bias")
    ]


def _has_motif_rows(conversions) -> bool:
    return any(isinstance(op, MotifQueryRows) for c in conversions or () for op in getattr(c, "operations", ()))


class MotifForCausalLM(DiffTransformerForCausalLM):
    """A Motif checkpoint folder loaded as our model (:class:`MotifConfig` maps its fields). ``save_pretrained``
    writes a Motif folder again (Motif's row order, ``model_type "Motif"``); ``difftransformer-convert --from motif``
    writes a difftransformer folder with remote code instead.

    The query-row conversion travels with the class, not in transformers' process-wide table of conversions (which is
    keyed by ``model_type`` or class name, both Motif's names): transformers 5.19-5.24 offer no public per-class
    hook, so the class adds :func:`motif_weight_conversions` to the load configuration of its own
    ``from_pretrained`` (``_load_pretrained_model``) and records it as the conversion ``save_pretrained`` reverts
    (``_weight_conversions``, what transformers records after a load) for a model built from a config.
    tests/models/test_motif.py checks both directions where the rows really move."""

    config_class = MotifConfig
    _auto_class = None  # saved as Motif's format, not with difftransformer's remote code (save_pretrained)

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        # What save_pretrained reverts for a model not loaded from a folder (a load replaces it by what it used).
        self._weight_conversions = motif_weight_conversions()
        _add_to_trainers_causal_lm_names()

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        mapping = list(load_config.weight_mapping or [])
        if not _has_motif_rows(mapping):  # not already there (a conversion registered for "Motif" by the user)
            load_config = dataclasses.replace(load_config, weight_mapping=mapping + motif_weight_conversions())
        return DiffTransformerForCausalLM._load_pretrained_model(
            model, state_dict, checkpoint_files, load_config, *args, **kwargs
        )


def _add_to_trainers_causal_lm_names() -> None:
    """``Trainer`` with ``label_smoothing_factor > 0`` shifts the labels (next-token targets) only for class names in
    ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; without ours it would smooth a loss of each position against its own token,
    silently. Added when a model of the class is built (not at import), as a ``setdefault`` that never replaces an
    entry, and only where no entry names the class already."""
    if MotifForCausalLM.__name__ not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(MOTIF_MODEL_TYPE, MotifForCausalLM.__name__)


def register_motif(force: bool = False) -> None:
    """Opt-in: ``AutoConfig`` maps ``model_type "Motif"`` to :class:`MotifConfig` and ``AutoModelForCausalLM`` maps it
    to :class:`MotifForCausalLM`, so that ``AutoModelForCausalLM.from_pretrained(folder)`` (and tools that load through
    the Auto classes: vLLM's config reading, pipelines) load a Motif folder as this package's model instead of Motif's
    remote code. ``MotifForCausalLM.from_pretrained`` needs none of it.

    Idempotent. Refuses, with :class:`~difftransformer.registration.RegistrationConflict` naming each entry and
    registering nothing, where transformers or another package already registered ``"Motif"`` (or a model for
    :class:`MotifConfig`), unless ``force=True``, which replaces it in this process."""
    register_model_type(MotifConfig, {AutoModelForCausalLM: MotifForCausalLM}, force=force)
    _add_to_trainers_causal_lm_names()


__all__ = [
    "MOTIF_MODEL_TYPE",
    "MotifConfig",
    "MotifForCausalLM",
    "MotifPolyNorm",
    "MotifPolyNormMLP",
    "MotifQueryRows",
    "motif_query_heads",
    "motif_query_rows",
    "motif_weight_conversions",
    "register_motif",
]
