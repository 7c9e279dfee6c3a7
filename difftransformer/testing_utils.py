"""The float64 reference of docs/model.md ("What it computes"), the bfloat16 rounding model and the tolerances that the
CPU tests and the GPU check (benchmarks/gpu_check.py) share, so that both judge a result by the same numbers.

The reference is deliberately written differently from the model: a Python loop over differential heads,
materialised softmaxes, and head indices computed from that row order (no repeat_kv, no packed cache, no
zero-padded queries), straight from the state dict. Grouped differential attention (``num_noise_heads``) uses the same
loop: each head recomputes its shared noise map from the row order of docs/model.md.

Not part of the modeling API: a test utility shipped with the package (as ``transformers.testing_utils``), imported by
tests/ and benchmarks/.
"""

import math

import torch

from .configuration_difftransformer import DiffTransformerConfig

# Float32 logits against the float64 reference (tiny models, initializer_range 0.1): the CPU tests' and the GPU check's
# bound on the max-abs difference.
FP32_LOGITS_ATOL = 2e-5
# generate(): scores of two runs that must decode the same sequence (cached vs uncached, batched vs alone) may differ
# by this much (float32, max-abs).
SCORES_ATOL = 1e-4
# float32 gradients of one attention backend against eager's: relative tolerance.
GRAD_RTOL = 1e-4
# The bf16 bounds from the rounding model: draws, and the factor on the largest drawn error (see RoundingModel).
ROUNDING_DRAWS, ROUNDING_FACTOR = 8, 3.0

# (diff_version, num_attention_heads, num_key_value_heads): MHA and GQA (n > 1) for both versions.
LAYOUTS = {
    "v1_mha": (1, 8, 8),  # H=4, G=4, n=1
    "v1_gqa": (1, 8, 4),  # H=4, G=2, n=2
    "v1_gqa4": (1, 8, 2),  # H=4, G=1, n=4
    "v2_mha": (2, 8, 4),  # H=4, G=4, n=1
    "v2_gqa": (2, 8, 2),  # H=4, G=2, n=2
}
# Grouped differential attention (docs/model.md): (diff_version, num_attention_heads, num_key_value_heads,
# num_noise_heads). r = H / N signal heads share a noise head; m = N / G noise heads per KV group.
GDA_LAYOUTS = {
    "v1_gda4": (1, 10, 4, 2),  # H=8, N=2, r=4, G=2, m=1 (Motif-2-12.7B's topology, scaled down)
    "v1_gda2_m2": (1, 12, 4, 4),  # H=8, N=4, r=2, G=2, m=2 (two noise heads per KV group)
    "v2_gda4": (2, 10, 2, 2),  # H=8, N=2, r=4, G=2, m=1
    "v2_gda2_m2": (2, 12, 2, 4),  # H=8, N=4, r=2, G=2, m=2
}


def tiny_config(layout="v1_gqa", **overrides) -> DiffTransformerConfig:
    if layout in GDA_LAYOUTS:
        version, hq, hkv, noise = GDA_LAYOUTS[layout]
        overrides = {"num_noise_heads": noise, **overrides}
    else:
        version, hq, hkv = LAYOUTS[layout]
    kwargs = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=8,
        diff_version=version,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    return DiffTransformerConfig(**kwargs)


def _exact(x):
    return x


def _rms(x, weight, eps, rnd=_exact):
    return rnd(rnd(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * weight)


def _poly_norm(x, weight, bias, eps=1e-6):
    """Motif's PolyNorm (docs/model.md): w0·N(x³) + w1·N(x²) + w2·N(x) + b, N(z) = z / sqrt(mean(z²) + eps)."""
    terms = [z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + eps) for z in (x**3, x**2, x)]
    return weight[0] * terms[0] + weight[1] * terms[1] + weight[2] * terms[2] + bias


def _rope(x, positions, theta):
    # x: (T, d) one head; rotate-half convention (transformers' Llama).
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    rot = torch.cat([-x[:, d // 2 :], x[:, : d // 2]], -1)
    return x * cos + rot * sin


def reference_attention(sd, prefix, cfg, x, positions, allowed, layer_idx, rnd=_exact):
    """V1 / V2 attention of docs/model.md for one sequence. x: (T, E) float64; allowed: (T, S=T) bool.

    ``rnd`` is applied to every intermediate a low-precision implementation rounds (identity by default; see
    :class:`RoundingModel`). Differentiable with respect to the tensors of ``sd``.
    Returns (output (T, E), differential maps (H, T, T), lambda (scalar or (T, H))).

    Grouped differential attention (``num_noise_heads`` N set, docs/model.md): H = Hq − N heads, r = H / N, each head
    subtracts the map of its noise head ``k = h // r``. V1: per KV group g, q_proj holds the group's n signal rows,
    then its m = N / G noise rows; V2: noise head k owns rows ``k(r+1) … k(r+1) + r``, the last one its noise map. With
    r = 1 these are the indices above (V1 ``(2g + c)·n + r``, V2 ``2h, 2h + 1``)."""
    d = cfg.head_dim
    N = getattr(cfg, "num_noise_heads", None) or cfg.num_attention_heads // 2
    H = cfg.num_attention_heads - N
    ratio = H // N
    G = cfg.num_key_value_heads // 2 if cfg.diff_version == 1 else cfg.num_key_value_heads
    n, m = H // G, N // G
    theta = cfg.rope_parameters["rope_theta"]
    W = lambda name: rnd(sd[prefix + name].double())  # noqa: E731  (rnd on a weight: rounds its gradient)
    q_all = rnd(x @ W("q_proj.weight").T).view(x.shape[0], -1, d)
    k_all = rnd(x @ W("k_proj.weight").T).view(x.shape[0], -1, d)
    v_all = rnd(x @ W("v_proj.weight").T).view(x.shape[0], -1, d)
    q_head = lambda i: rnd(_rope(q_all[:, i], positions, theta))  # noqa: E731
    k_head = lambda j: rnd(_rope(k_all[:, j], positions, theta))  # noqa: E731

    def softmax_map(qi, kj):
        s = rnd(q_head(qi) @ k_head(kj).T / math.sqrt(d))
        s = s.masked_fill(~allowed, float("-inf"))
        return rnd(torch.softmax(s, dim=-1))

    outs, maps = [], []
    if cfg.diff_version == 1:
        depth = layer_idx + getattr(cfg, "lambda_init_layer_offset", 0)
        lam_init = cfg.lambda_init if cfg.lambda_init is not None else 0.8 - 0.6 * math.exp(-0.3 * depth)
        lam = (
            torch.exp((W("lambda_q1") * W("lambda_k1")).sum())
            - torch.exp((W("lambda_q2") * W("lambda_k2")).sum())
            + lam_init
        )
        for h in range(H):
            g, j = divmod(h, n)
            a1 = softmax_map(g * (n + m) + j, 2 * g + 0)  # = (2g + 0)·n + j when r = 1
            a2 = softmax_map(g * (n + m) + n + j // ratio, 2 * g + 1)  # = (2g + 1)·n + j when r = 1
            value = torch.cat([v_all[:, 2 * g], v_all[:, 2 * g + 1]], dim=-1)  # (S, 2d), half 0 first
            diff = rnd(a1 - lam * a2)
            o = rnd(_rms(rnd(diff @ value), W("subln.weight"), cfg.subln_eps, rnd) * (1 - lam_init))
            outs.append(o)
            maps.append(diff)
    else:
        lam = rnd(torch.sigmoid(rnd(x @ W("lambda_proj.weight").T)))  # (T, H)
        for h in range(H):
            g = h // n
            k, j = divmod(h, ratio)  # noise head k, signal j of its block (r = 1: k = h, j = 0)
            m1, m2 = softmax_map(k * (ratio + 1) + j, g), softmax_map(k * (ratio + 1) + ratio, g)
            a1, a2 = rnd(m1 @ v_all[:, g]), rnd(m2 @ v_all[:, g])  # standard kernels: one output per map
            outs.append(rnd(a1 - lam[:, h : h + 1] * a2))
            maps.append(m1 - lam[:, h : h + 1] * m2)
    out = rnd(torch.cat(outs, dim=-1) @ W("o_proj.weight").T)
    return out, torch.stack(maps), lam


def reference_forward(
    model, input_ids, attention_mask=None, position_ids=None, rnd=_exact, state_dict=None, labels=None
):
    """Float64 logits (B, T, V) and per-layer differential maps of a DiffTransformerForCausalLM, from its state dict
    (or ``state_dict``, e.g. float64 leaves that require grad). With ``labels`` (-100 = ignored), also returns the
    mean cross-entropy of the next-token predictions, as transformers' loss."""
    cfg = model.config
    sd = state_dict if state_dict is not None else {k: v.detach() for k, v in model.state_dict().items()}
    B, T = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones(B, T, dtype=torch.long)
    if position_ids is None:
        position_ids = torch.arange(T).expand(B, T)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    W = lambda name: rnd(sd[name].double())  # noqa: E731
    logits, all_maps = [], []
    for b in range(B):
        allowed = causal & attention_mask[b].bool()[None, :]
        allowed = allowed | torch.eye(T, dtype=torch.bool)  # keep fully padded query rows finite (never compared)
        x = W("model.embed_tokens.weight")[input_ids[b]]
        maps_b = []
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            h = _rms(x, W(p + "input_layernorm.weight"), cfg.rms_norm_eps, rnd)
            attn, maps, _ = reference_attention(sd, p + "self_attn.", cfg, h, position_ids[b], allowed, layer, rnd)
            maps_b.append(maps)
            x = rnd(x + attn)
            h = _rms(x, W(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps, rnd)
            gate, up = rnd(h @ W(p + "mlp.gate_proj.weight").T), rnd(h @ W(p + "mlp.up_proj.weight").T)
            act = (
                _poly_norm(gate, W(p + "mlp.act_fn.weight"), W(p + "mlp.act_fn.bias"))
                if cfg.hidden_act == "poly_norm"
                else torch.nn.functional.silu(gate)
            )
            x = rnd(x + rnd(rnd(rnd(act) * up) @ W(p + "mlp.down_proj.weight").T))
        x = _rms(x, W("model.norm.weight"), cfg.rms_norm_eps, rnd)
        head = "lm_head.weight" if "lm_head.weight" in sd else "model.embed_tokens.weight"
        logits.append(rnd(x @ W(head).T))
        all_maps.append(maps_b)
    maps = [torch.stack([all_maps[b][layer] for b in range(B)]) for layer in range(cfg.num_hidden_layers)]
    logits = torch.stack(logits)
    if labels is None:
        return logits, maps
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    return logits, maps, loss


class _Round(torch.autograd.Function):
    """Multiplies by ``1 + δ`` in the forward pass and the gradient by ``1 + δ'`` in the backward pass."""

    @staticmethod
    def forward(ctx, x, forward_noise, backward_noise):
        ctx.backward_noise = backward_noise
        return x * (1 + forward_noise)

    @staticmethod
    def backward(ctx, grad):
        return grad * (1 + ctx.backward_noise), None, None


class RoundingModel:
    """The error model of bfloat16 arithmetic, used to derive every bf16 tolerance (it depends on no CPU).

    A bf16 operation returns its exact result (products accumulated in float32, whose error, ~2⁻²⁴ per term, is
    negligible here) rounded to the nearest bf16: a relative error of at most ``u = 2⁻⁸``. Which intermediates a kernel
    rounds, the order in which it accumulates, and whether it runs on AMX, AVX512-bf16 or plain AVX2 differ between
    CPUs; none of that is modelled individually. Instead, the float64 reference rounds *every* intermediate that some
    implementation may round (projections, rotary outputs, scores, softmax maps, the differential combination, norms,
    residual sums, logits) and every gradient flowing back through it, by an independent relative error drawn
    uniformly from ``[−u, u]`` — the first-order model of round-to-nearest with random data (Monte-Carlo arithmetic,
    Parker 1997). The spread over a few draws is the size of the error bf16 arithmetic makes *for this model and
    input*: small where the computation is well conditioned, large where it cancels (λ's gradient is a sum over every
    score of terms of both signs). A bf16 result then has to lie within ``factor ×`` the largest drawn error; a
    wrong kernel (a mis-paired map, a wrong λ or scale) moves results by far more
    (tests/kernels/test_kernels_difftransformer.py checks that the bounds catch one).
    """

    u = 2.0**-8

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, x):
        noise = [
            (torch.rand(x.shape, generator=self.generator, dtype=torch.float64) * 2 - 1) * self.u for _ in range(2)
        ]
        return _Round.apply(x, *noise)


def bf16_error_bound(draws, exact, factor: float = 4.0):
    """``factor`` × the largest error of the drawn results (see :class:`RoundingModel`) against the exact one; the
    error is the max-abs difference (max over elements)."""
    return factor * max((d - exact).abs().max().item() for d in draws)


def bf16_gradient_bounds(model, ids, mask, labels, draws: int, factor: float):
    """(exact, bounds): the float64 gradients of ``model``'s loss on the batch (:func:`reference_forward`), and per
    parameter ``factor`` × the largest error of ``draws`` runs under :class:`RoundingModel`
    (:func:`bf16_error_bound`)."""

    def reference_grads(rnd):
        sd = {k: v.detach().double().requires_grad_() for k, v in model.state_dict().items()}
        reference_forward(model, ids, mask, rnd=rnd, state_dict=sd, labels=labels)[2].backward()
        return {k: v.grad for k, v in sd.items()}

    exact = reference_grads(lambda x: x)
    runs = [reference_grads(RoundingModel(seed)) for seed in range(draws)]
    return exact, {k: bf16_error_bound([r[k] for r in runs], exact[k], factor) for k in exact}


def reference_differential_attention(
    query, key, value, lam, scaling, pair_stride, noise_ratio=1, allowed=None, rnd=_exact
):
    """DIFF V1 attention in float64, materialised, for checking a kernel of the same layout (kernels/triton/attention,
    kernels_difftransformer.py): ``query`` ``(B, T, Hq, d)`` in q_proj row order (per KV group its n signal rows, then
    its ``n / noise_ratio`` noise rows), ``key``/``value`` ``(B, 2G, S, d)`` (group g: heads 2g, 2g + 1), ``lam`` a
    scalar, ``allowed`` a boolean mask broadcastable to ``(B, 1, T, S)`` or None (causal, the queries at the last T of
    the S positions). Returns ``(B, T, G·n, 2d)``: ``O_h = (A1 − λ·A2)·[V0 | V1]``, a row that sees no key 0.

    ``rnd`` rounds what a low-precision kernel may round: the scores, both maps (before they meet the value) and the
    output (see :class:`RoundingModel`). Differentiable with respect to every input."""
    q, k, v = query.double(), key.double(), value.double()
    b, t, hq, d = q.shape
    s, g, n = k.shape[2], k.shape[1] // 2, pair_stride
    m = n // noise_ratio
    rows = q.reshape(b, t, g, n + m, d)
    if allowed is None:
        allowed = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    allowed = allowed.to(q.device).expand(b, 1, t, s)[:, :, None]  # (B, 1, 1, T, S) against (B, G, rows, T, S)
    maps = []
    for part, keys in ((rows[:, :, :, :n], k[:, 0::2]), (rows[:, :, :, n:], k[:, 1::2])):
        scores = rnd(torch.einsum("btgjd,bgsd->bgjts", part, keys) * scaling).masked_fill(~allowed, float("-inf"))
        maps.append(rnd(torch.nan_to_num(scores.softmax(-1), nan=0.0)))  # a row that sees nothing: zeros
    diff = maps[0] - lam.double() * maps[1].repeat_interleave(noise_ratio, dim=2)
    out = torch.einsum("bgjts,bgse->btgje", diff, torch.cat((v[:, 0::2], v[:, 1::2]), -1))
    return rnd(out).reshape(b, t, g * n, 2 * d)


def greedy_with_scores(model, ids, mask=None, max_new_tokens=10, **kwargs):
    """Greedy ``generate`` with a fixed pad token: the sequences and the stacked scores of every step ``(steps, B, V)``
    (what the cache tests compare between cached and uncached decoding, on a CPU and in the GPU check)."""
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        **kwargs,
    )
    return out.sequences, torch.stack(out.scores)


def left_padded_batch(vocab_size, lengths, seed=0, pad_token_id=0):
    """Random prompts of the given lengths, left padded: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, length in enumerate(lengths):
        ids[b, T - length :] = torch.randint(3, vocab_size, (length,), generator=g)
        mask[b, T - length :] = 1
    return ids, mask


def randomize_norms(model, seed=0):
    """Non-trivial RMSNorm / subln weights so that the reference test sees them (they initialise to ones)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight") or "subln" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return model
