"""DIFF V1 and V2 (and grouped differential attention, and Motif-2 checkpoints) as a native vLLM model: vLLM's own
Llama layers plus differential attention.

vLLM imports this module only when it builds a ``DiffTransformerForCausalLM`` or ``MotifForCausalLM`` folder;
``vllm_plugin.register`` (the ``vllm.general_plugins`` entry point of pyproject.toml) tells it where the classes are.

The model is vLLM's ``LlamaForCausalLM`` with one layer changed, the attention. Both versions run ONE call of vLLM's
attention layer per layer (vLLM writes the KV cache inside that call, so prefix caching, chunked prefill and continuous
batching are vLLM's own), and both cache exactly the bytes of a Llama with the same ``num_key_value_heads`` (``Hkv``)
and ``head_dim`` (``d``):

**V2** (docs/model.md, "What it computes"; :class:`DiffTransformerV2Attention`): the fused ``qkv_proj`` holds the ``2H``
query heads and ``G`` KV heads; vLLM's attention layer runs over them (query head ``j`` reads KV head ``⌊j/2n⌋``, vLLM's
GQA rule); ``λ = sigmoid(x W_λᵀ)`` per token and head, ``o_h = a_2h − λ_h · a_2h+1``, and ``o_proj`` maps the ``H·d``
combined features back.

**V1** (docs/model.md, "What it computes"; :class:`DiffTransformerV1Attention`): the padded single call of the
transformers model. vLLM's attention layer is built with ``G = Hkv/2`` KV heads of width ``2d`` (each one KV group: keys
``[K1 | K2]``, values ``[V_g,0 | V_g,1]``, a free view of the ``Hkv`` rotated ``d``-wide key and value heads the
projection gives, so the cache holds a Llama's bytes), ``2H`` query heads of width ``2d`` (each map-1 query ``[q1 |
0]``, each map-2 query ``[0 | q2]``) and the scale ``1/√d``. Query half-head ``i = (2g + c)·n + r`` (the group-major
rows of docs/model.md) reads KV head ``⌊i / 2n⌋ = g`` by vLLM's GQA rule, and ``[q1 | 0]·[K1 | K2]ᵀ = q1·K1ᵀ``: the call
returns ``A_c·[V_g,0; V_g,1]`` for every map, exactly. Then ``(A1 − λA2)·V = A1·V − λ·A2·V`` (λ one float32 scalar per
layer from ``lambda_q1 … k2``), the per-head RMSNorm over ``2d`` (``subln.weight``, ``subln_eps``) times ``1 − λinit``,
and ``o_proj``. The padded call does twice the attention arithmetic of V1's math (the zero halves); docs/serving.md
measures what that costs.

**Grouped differential attention** (``num_noise_heads``, r signal maps per noise map; r = 1 is the paper's model):
the query rows of each KV group are its signal rows, then its noise rows (V1), or ``[signal × r, noise]`` per noise
map (V2), as in the transformers model (docs/model.md), so the single call computes each noise map once and
``differential_combine`` subtracts it from its r signal maps. **Motif-2** (:class:`MotifForCausalLM`): V1 with GDA,
``λinit`` from depth − 1 and the PolyNorm MLP (:class:`DiffTransformerPolyNormMLP`), read through the package's
``MotifConfig``; its query rows are permuted into ours at load where they differ.

Tensor parallelism shards every projection by whole KV groups: vLLM's ``QKVParallelLinear`` gives rank ``t`` of ``T``
the contiguous query rows ``[t·Hq/T, (t+1)·Hq/T)`` and key/value rows ``[t·Hkv/T, (t+1)·Hkv/T)``, and ``o_proj``
(row-parallel) the matching contiguous input columns; with the group-major row order these are the groups
``[t·G/T, (t+1)·G/T)`` with all their query, key and value half-heads (V1) or pairs (V2), so the two maps of a head
never split and λ (V1: a replicated scalar; V2: column-parallel ``lambda_proj``) needs no communication. ``G`` must be
a multiple of ``T`` (:func:`tensor_parallel_groups`; vLLM replicates KV heads when ``Hkv < T``, which would split V1's
groups, so that is refused).

Without the package installed in vLLM's environment, vLLM's Transformers backend (``model_impl="transformers"``
with the folder's remote code) serves V2 folders and refuses V1 ones (``VLLM_V1_ERROR``).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable

import torch
from vllm import _custom_ops as vllm_ops
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType

from .modeling_difftransformer import DiffTransformerHeadRMSNorm, differential_combine, lambda_init_fn
from .motif import motif_query_rows


def tensor_parallel_groups(config, tp_size: int) -> int:
    """KV groups per tensor-parallel rank (module docstring): ``G / tp_size``, refused unless whole."""
    groups = config.num_key_value_heads // 2 if config.diff_version == 1 else config.num_key_value_heads
    if groups % tp_size:
        raise ValueError(
            f"diff_version={config.diff_version}: tensor_parallel_size={tp_size} must divide the {groups} KV groups "
            f"(num_key_value_heads={config.num_key_value_heads}{' / 2' if config.diff_version == 1 else ''}): "
            "each rank must hold whole groups, so that the two maps of every differential head stay on one rank."
        )
    return groups // tp_size


SUPPORTED_ACTIVATIONS = ("silu", "poly_norm")


def _refuse_unsupported(config) -> None:
    """What the native model does not compute: refused at build time rather than served wrongly."""
    if config.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise NotImplementedError(
            f"hidden_act={config.hidden_act!r} is not supported by difftransformer's native vLLM model (supported: "
            f"{', '.join(SUPPORTED_ACTIVATIONS)}); run it with transformers (generate())."
        )


class DiffTransformerPolyNorm(torch.nn.Module):
    """Motif's PolyNorm (``hidden_act="poly_norm"``), as ``motif.MotifPolyNorm``:
    ``w0·N(x³) + w1·N(x²) + w2·N(x) + b``, ``N(z) = z / sqrt(mean(z²) + eps)`` over the intermediate features, in
    float32. Under tensor parallelism each rank holds ``1/T`` of those features (the gate's column shard), so the
    three means of squares are summed over the ranks (one all-reduce of ``(tokens, 3)`` sums)."""

    def __init__(self, intermediate_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((3,), 1.0 / 3.0), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.intermediate_size = intermediate_size  # all ranks' features
        self.tp_size = get_tensor_model_parallel_world_size()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf, w, b = x.to(dtype), self.weight.to(dtype), self.bias.to(dtype)
        powers = (xf.pow(3), xf.pow(2), xf)
        if self.tp_size == 1:
            means = [z.pow(2).mean(-1, keepdim=True) for z in powers]
        else:
            sums = tensor_model_parallel_all_reduce(torch.cat([z.pow(2).sum(-1, keepdim=True) for z in powers], dim=-1))
            means = (sums / self.intermediate_size).split(1, dim=-1)
        n3, n2, n1 = (z * torch.rsqrt(mean + self.eps) for z, mean in zip(powers, means))
        return (w[0] * n3 + w[1] * n2 + w[2] * n1 + b).to(x.dtype)


class DiffTransformerPolyNormMLP(LlamaMLP):
    """vLLM's Llama MLP (fused ``gate_up_proj``, ``down_proj``) with PolyNorm as the activation:
    ``down(PolyNorm(gate(x)) ⊙ up(x))``; ``act_fn.weight`` and ``act_fn.bias`` load by name (Motif's keys)."""

    @classmethod
    def from_llama_mlp(cls, mlp: LlamaMLP, intermediate_size: int) -> DiffTransformerPolyNormMLP:
        """The decoder layer's ``LlamaMLP`` (built with silu: Llama's MLP refuses other activations) turned into this
        class in place: its projections are kept, the activation replaced."""
        mlp.__class__ = cls
        mlp.act_fn = DiffTransformerPolyNorm(intermediate_size)
        return mlp

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        x, _ = self.down_proj(self.act_fn(gate) * up)
        return x


@CustomOp.register("difftransformer_head_rms_norm")
class DiffTransformerHeadRMSNormOp(CustomOp):
    """V1's per-head norm ``scale · RMSNorm_2d(O_h) ⊙ w`` (``subln.weight``; scale ``1 − λinit``), computed as the
    transformers model computes it: over the heads in float32, the weight times the scale in float32, one rounding
    to the model's dtype at the end.

    A vLLM custom op, so vLLM's dispatch picks the form: ``forward_native`` (the transformers module's own forward,
    :class:`DiffTransformerHeadRMSNorm`) where vLLM compiles the model (Inductor fuses it with the differential
    step); in eager mode on CPU, ``forward_cpu`` runs vLLM's fused ``rms_norm`` kernel on the same float32 operands
    (one pass instead of torch's five: the same products, summed in another order)."""

    def __init__(self, width: int, eps: float, scale: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width), requires_grad=False)
        self.eps = eps
        self.scale = scale

    # The transformers module's own forward and the scaled weight it reads (computed at every call here: vLLM's
    # model never runs inside fixed_parameters(); under vLLM's compilation Inductor folds it).
    scaled_weight = DiffTransformerHeadRMSNorm.scaled_weight

    def forward_native(self, heads: torch.Tensor) -> torch.Tensor:
        return DiffTransformerHeadRMSNorm.forward(self, heads, self.scale)

    def forward_cuda(self, heads: torch.Tensor) -> torch.Tensor:  # (CustomOp's own raises: GPUs run eager too)
        return self.forward_native(heads)

    def forward_cpu(self, heads: torch.Tensor) -> torch.Tensor:
        if heads.dtype == torch.float64:  # the kernel knows float32, float16 and bfloat16
            return self.forward_native(heads)
        x = heads.to(torch.float32).reshape(-1, heads.shape[-1])
        out = torch.empty_like(x)
        vllm_ops.rms_norm(out, x, self.weight.to(torch.float32) * self.scale, self.eps)
        return out.view(heads.shape).to(heads.dtype)


@CustomOp.register("difftransformer_query_pad")
class DiffTransformerQueryPadOp(CustomOp):
    """V1's padded queries: ``(tokens, G·rows·d)`` half-head queries in, ``(tokens, G·rows·2d)`` out, each signal
    (first-map) row ``[q | 0]`` and each noise (second-map) row ``[0 | q]`` (``signal_rows`` signal rows, then the
    noise rows, per KV group).

    ``forward_native`` (what vLLM's torch.compile fuses into the step before the attention call) multiplies by a
    broadcast 0/1 factor. In eager mode on CPU, ``forward_cpu`` writes the queries into a reused zero buffer, one per
    thread and layout, whose zero halves are never written: a 4096-token prefill's padded queries are 2·Hq·d floats
    per token (38 MB for SmolLM2's V1 upcycle in float32), and glibc's malloc serves blocks over its mmap threshold
    (adaptive, at most 32 MiB) with fresh mappings, so a new tensor of that size may be page-faulted in again on each
    layer. That cost is a hypothesis, not a measured cause: a compiled run with a larger threshold did not show the
    allocator to be the reason for V1's difference (docs/reports/2026-11-26-vllm-throughput.md, "The memory
    allocator"; no profile was taken). The buffer's rows past the step's tokens hold stale queries and are never
    returned. Other platforms run ``forward_native``."""

    _per_thread = threading.local()  # (not `_buffers`: nn.Module's registered buffers)

    def __init__(self, groups: int, rows: int, signal_rows: int, head_dim: int) -> None:
        super().__init__()
        self.groups, self.rows, self.signal_rows, self.head_dim = groups, rows, signal_rows, head_dim
        pad = torch.zeros(rows, 2, 1)
        pad[:signal_rows, 0] = 1.0
        pad[signal_rows:, 1] = 1.0
        self.register_buffer("query_pad", pad, persistent=False)

    def forward_native(self, q: torch.Tensor) -> torch.Tensor:
        padded = q.unflatten(-1, (self.groups, self.rows, 1, self.head_dim)) * self.query_pad.to(q.dtype)
        return padded.flatten(1)  # (tokens, G·rows·2·d)

    def forward_cuda(self, q: torch.Tensor) -> torch.Tensor:  # (CustomOp's own raises: GPUs run eager too)
        return self.forward_native(q)

    def forward_cpu(self, q: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a traced write into a buffer outside the graph would be copied whole
            return self.forward_native(q)
        tokens, n = q.shape[0], self.signal_rows
        key = (self.groups, self.rows, n, self.head_dim, q.dtype, q.device)
        cache = self._per_thread.__dict__.setdefault("by_layout", {})
        buffer = cache.get(key)
        if buffer is None or buffer.shape[0] < tokens:
            buffer = cache[key] = q.new_zeros(tokens, self.groups, self.rows, 2, self.head_dim)
        out, qv = buffer[:tokens], q.view(tokens, self.groups, self.rows, self.head_dim)
        out[:, :, :n, 0].copy_(qv[:, :, :n])
        out[:, :, n:, 1].copy_(qv[:, :, n:])
        return out.view(tokens, -1)


class DiffTransformerV1Attention(LlamaAttention):
    """DIFF V1 in one call of vLLM's attention layer (module docstring): ``G`` KV heads of width ``2d`` per rank,
    ``Hq`` zero-padded query heads of width ``2d``, scale ``1/√d``; then ``A1·V − λ·A2·V``, the per-head RMSNorm and
    ``(1 − λinit)``, and ``o_proj`` over the ``H·2d`` features.

    Grouped differential attention (``num_noise_heads``; r signal maps per noise map): each group's query rows are its
    ``n`` signal rows, then its ``m = n / r`` noise rows (docs/model.md), so the call computes each noise map once, and
    ``differential_combine`` subtracts it from its r signal maps. r = 1 is the paper's V1 (rows (g, c, r)).

    ``LlamaAttention.__init__`` is not called: it would build vLLM's attention layer with ``d``-wide heads under this
    layer's name (vLLM allows one attention layer per name, and allocates a cache for each). The projections,
    rotary embedding and forward contract are Llama's, with the head sizes above."""

    def __init__(
        self,
        config,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        max_position_embeddings: int = 8192,
        quant_config=None,
        bias: bool = False,
        bias_o_proj: bool = False,
        cache_config=None,
        prefix: str = "",
        attn_type: str = AttentionType.DECODER,
    ) -> None:
        torch.nn.Module.__init__(self)
        layer_idx = extract_layer_index(prefix)
        tp_size = get_tensor_model_parallel_world_size()
        self.hidden_size = hidden_size
        self.head_dim = d = config.head_dim
        self.total_num_heads = num_heads  # Hq query half-heads: H signal + N noise
        self.total_num_kv_heads = num_kv_heads  # Hkv = 2G key (and value) half-heads
        groups = tensor_parallel_groups(config, tp_size)  # G per rank
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = num_kv_heads // tp_size  # 2·groups
        self.num_diff_heads = config.num_diff_heads // tp_size  # H per rank (signal heads)
        self.noise_ratio = config.noise_ratio  # r
        self.pair_stride = self.num_diff_heads // groups  # n signal rows per group, then n / r noise rows
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d  # = groups · 2d
        self.scaling = d**-0.5  # 1/sqrt(d), not 1/sqrt(2d): each map is a d-wide dot product
        self.max_position_embeddings = max_position_embeddings

        self.qkv_proj = QKVParallelLinear(
            hidden_size=hidden_size,
            head_size=d,
            total_num_heads=num_heads,
            total_num_kv_heads=num_kv_heads,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            input_size=config.num_diff_heads * 2 * d,  # H heads of width 2d
            output_size=hidden_size,
            bias=bias_o_proj,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self._init_rotary_emb(config, quant_config=quant_config)  # d-wide, rotate-half, as every Llama's
        self.attn = Attention(
            self.num_heads,
            2 * d,
            self.scaling,
            num_kv_heads=groups,
            cache_config=cache_config,
            quant_config=quant_config,
            attn_type=attn_type,
            prefix=f"{prefix}.attn",
        )
        # λ: loaded by name, float32 whatever the model's dtype (as in the transformers model).
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, torch.nn.Parameter(torch.zeros(d, dtype=torch.float32), requires_grad=False))
        offset = getattr(config, "lambda_init_layer_offset", 0) or 0
        self.lambda_init = config.lambda_init if config.lambda_init is not None else lambda_init_fn(layer_idx + offset)
        self.subln = DiffTransformerHeadRMSNormOp(2 * d, config.subln_eps, 1.0 - self.lambda_init)  # subln.weight
        # Per query row of a group: [q | 0] for a signal (first-map) row, [0 | q] for a noise (second-map) row.
        self.query_pad = DiffTransformerQueryPadOp(groups, self.num_heads // groups, self.pair_stride, d)

    def lambda_full(self) -> torch.Tensor:
        """``λ = exp(λq1·λk1) − exp(λq2·λk2) + λinit``: a float32 scalar, as
        ``DiffTransformerV1Attention.lambda_full``."""
        return (
            torch.exp(torch.dot(self.lambda_q1, self.lambda_k1))
            - torch.exp(torch.dot(self.lambda_q2, self.lambda_k2))
            + self.lambda_init
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)  # every d-wide half-head rotated, as the transformers model does
        # k, v: (tokens, Hkv·d) = (tokens, G·2d) already: [K_g,0 | K_g,1] per group, in the (g, c) row order.
        padded = self.query_pad(q)  # (tokens, G·rows·2d): [q1 | 0] and [0 | q2] half-head rows
        maps = self.attn(padded, k, v).view(-1, self.num_heads, 2 * self.head_dim)  # (tokens, Hq, 2d): A·V
        combined = differential_combine(maps, self.lambda_full(), self.pair_stride, dim=1, noise_ratio=self.noise_ratio)
        combined = self.subln(combined)  # (tokens, H, 2d): (1 − λinit)·RMSNorm_2d(O_h)⊙w
        output, _ = self.o_proj(combined.flatten(1))
        return output


class DiffTransformerV2Attention(LlamaAttention):
    """vLLM's Llama attention over the ``Hq`` query heads (``2H`` per rank when r = 1), then DIFF V2's combine.

    Grouped differential attention: the query heads of each noise map are ``[signal × r, noise]`` (r = 1: the adjacent
    pairs), so every block of ``r + 1`` heads reads one KV head and its r signal outputs subtract its noise output, each
    with its own ``λ``."""

    def __init__(self, config, hidden_size: int, num_heads: int, *args, quant_config=None, prefix: str = "", **kwargs):
        tp_size = get_tensor_model_parallel_world_size()
        tensor_parallel_groups(config, tp_size)
        super().__init__(config, hidden_size, num_heads, *args, quant_config=quant_config, prefix=prefix, **kwargs)
        self.num_diff_heads = config.num_diff_heads // tp_size  # H (signal heads) per rank
        self.noise_ratio = config.noise_ratio  # r
        # Llama's o_proj reads Hq·d features; DIFF V2's reads the H·d combined ones.
        self.o_proj = RowParallelLinear(
            input_size=config.num_diff_heads * self.head_dim,
            output_size=hidden_size,
            bias=kwargs.get("bias_o_proj", False),
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.lambda_proj = ColumnParallelLinear(
            input_size=hidden_size,
            output_size=config.num_diff_heads,
            bias=False,
            gather_output=False,
            quant_config=None,  # H outputs: too few to quantize, and λ feeds a subtraction of two maps
            prefix=f"{prefix}.lambda_proj",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        maps = self.attn(q, k, v).view(-1, self.num_heads, self.head_dim)  # (tokens, Hq, d): one output per map
        lam, _ = self.lambda_proj(hidden_states)  # (tokens, H)
        r = self.noise_ratio
        lam = torch.sigmoid(lam).unflatten(-1, (-1, r))[..., None]  # against each block's r signal outputs
        combined = differential_combine(maps, lam, r, dim=1, noise_ratio=r)  # (tokens, H, d)
        output, _ = self.o_proj(combined.reshape(-1, self.num_diff_heads * self.head_dim))
        return output


class DiffTransformerDecoderLayer(LlamaDecoderLayer):
    """vLLM's Llama decoder layer with a DIFF attention and, for ``hidden_act="poly_norm"`` (Motif), PolyNorm MLP."""

    attention_class: type[LlamaAttention]

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None) -> None:
        config = config or vllm_config.model_config.hf_config
        poly_norm = config.hidden_act == "poly_norm"
        if poly_norm:  # vLLM's LlamaMLP refuses every activation but silu: built with silu, then converted
            config = copy.copy(config)
            config.hidden_act = "silu"
        super().__init__(vllm_config, prefix=prefix, config=config, attn_layer_type=self.attention_class)
        if poly_norm:
            self.mlp = DiffTransformerPolyNormMLP.from_llama_mlp(self.mlp, config.intermediate_size)


class DiffTransformerV1DecoderLayer(DiffTransformerDecoderLayer):
    attention_class = DiffTransformerV1Attention


class DiffTransformerV2DecoderLayer(DiffTransformerDecoderLayer):
    attention_class = DiffTransformerV2Attention


DECODER_LAYERS = {1: DiffTransformerV1DecoderLayer, 2: DiffTransformerV2DecoderLayer}


class DiffTransformerForCausalLM(LlamaForCausalLM):
    """vLLM's Llama with DIFF V1 or V2 attention (``diff_version`` of the config). Weight names are the checkpoint's:
    vLLM's loader stacks ``q_proj, k_proj, v_proj`` into ``qkv_proj`` as for a Llama and loads
    ``lambda_proj`` (V2), ``lambda_q1 … lambda_k2`` and ``subln.weight`` (V1) by name."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config
        version = getattr(config, "diff_version", None)
        if version not in DECODER_LAYERS:
            raise ValueError(f"diff_version={version!r}: difftransformer's native vLLM model serves 1 and 2.")
        _refuse_unsupported(config)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=DECODER_LAYERS[version])


class MotifForCausalLM(DiffTransformerForCausalLM):
    """A Motif-2 checkpoint folder (``model_type "Motif"``, ``MotifForCausalLM``; its config read by the package's
    ``MotifConfig``: DIFF V1, grouped differential attention, λinit from depth − 1, PolyNorm MLP) on the native model.
    Motif's key names are ours; its query rows are ``[signal × r, noise]`` per noise head, which is our row order
    whenever each KV group holds one noise head (both released models), and is permuted into ours here otherwise
    (``difftransformer.motif.motif_query_rows``).

    Weights pushed after that first load (an RL trainer's weight sync: TRL's GRPO calls ``load_weights`` with one
    tensor at a time, named as the training model's ``named_parameters()``) come from difftransformer's
    ``MotifForCausalLM`` in transformers, which holds its query rows in our order already (it permutes them at load):
    they are loaded as given. The first call is vLLM's checkpoint loader, reading the folder's files (Motif's order);
    a later reload from the files themselves (vLLM's ``reload_weights`` without weights) is not supported for the
    permuted layouts."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        # Set by the first load_weights (vLLM's checkpoint loader); dummy weights (load_format="dummy", a set-up that
        # pushes every weight itself) never read the files.
        self._checkpoint_loaded = str(getattr(vllm_config.load_config, "load_format", "")) == "dummy"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        rows = motif_query_rows(self.config)
        if torch.equal(rows, torch.arange(rows.numel())) or self._checkpoint_loaded:
            loaded = super().load_weights(weights)
            self._checkpoint_loaded = True
            return loaded

        def ours(weights):
            for name, tensor in weights:
                if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                    tensor = tensor.index_select(0, rows.to(tensor.device))
                yield name, tensor

        loaded = super().load_weights(ours(weights))
        self._checkpoint_loaded = True
        return loaded
