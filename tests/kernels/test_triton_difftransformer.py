"""The fused DIFF V1 Triton kernel (difftransformer/kernels/triton/attention.py) against a float64 formula.

Runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set by a module fixture and restored after: the
kernel module decorates its kernels on first use, so the switch only has to be on when they first run). Sizes are tiny
and the launch tiles are shrunk to 16 rows/keys (the module's ``_TUNING`` override) so that every case crosses several
tiles: blocks below the causal diagonal (no masks), blocks on it, partial blocks at the end. The GPU's own launch
configurations (LAUNCH_CONFIGS, which a GPU autotunes) each run too, on problems sized to their tiles. Nothing is
autotuned here: the interpreter never times configurations.

Error model (what every bound below is derived from). The reference is computed in float64 from the very inputs the
kernel receives (for bf16/fp16 the rounded values), so the inputs' own rounding is not an error of the kernel; its
errors are the roundings it performs:

* float32 accumulation (unit roundoff u32 = 2^-24): a sum of L terms is off by at most γ_L·Σ|terms| with
  γ_L ≈ L·u32 (worst case, any summation order). Scores are sums of d products; a score error δ moves every softmax
  probability by a factor within e^(±2δ), so the maps carry a relative error ≤ 2·d·u32·σ, with σ the largest
  scale·Σ_k|q_k||k_k| over the scores. Every later sum (over keys S, over the 2d value columns, the key/value
  gradients over every query row of a group B·G·(n+m)·T at most, exp2/log2 evaluations a few ulps each) adds its
  length: L = 4d + S + B·G·(n+m)·T + 32.
* 16-bit inputs (unit roundoff u_p = 2^-8 bf16, 2^-11 fp16; u_p = u32 for float32): the probabilities are rounded to
  the input type before the value product (relative u_p per element), the saved outputs O and O2 are rounded
  (δ = rowsum(dO ∘ O1) inherits their error), and the backward rounds dS, λ·P2 and the summed dO' of a noise row
  before its products: at most 2 such roundings in any forward chain and 4 in any backward chain.
* the stored result is rounded to its dtype once more: u_out·|result|.

Each quantity's error is bounded by coef·magnitude + u_out·|reference|, where the magnitude is the same formula
evaluated with absolute values everywhere (so every rounding's absolute contribution is at most its relative size
times the magnitude): forward coef = 2·u_p + u32·(2·d·σ + L), backward coef = 4·u_p + u32·(2·d·σ + L).
Nothing here depends on the CPU the tests run on.
"""

import importlib.util
import json
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernel needs triton (pip install triton)")

from difftransformer.kernels.triton import attention as tdt  # noqa: E402

# On a CUDA machine the same checks run the compiled kernels on the GPU (the reference stays float64 on the CPU).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
U32 = 2.0**-24
UNIT = {torch.float32: U32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SMALL_TILES = {
    "forward": dict(BLOCK_T=16, BLOCK_N=16),
    "dq": dict(BLOCK_T=16, BLOCK_N=16),
    "dkdv": dict(BLOCK_T=16, BLOCK_N=16),
    "preprocess": dict(BLOCK_T=16),
    "decode": dict(BLOCK_N=16),
}


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE.type == "cpu":
            mp.setenv("TRITON_INTERPRET", "1")
        mp.setattr(tdt, "_TUNING", dict(SMALL_TILES))
        yield


# ----------------------------------------------------------------------------------------------------------------------
# float64 reference: A1, A2 materialised with repeat-free indexing (a group's heads read its keys through a view)
# ----------------------------------------------------------------------------------------------------------------------


def visibility(b, t, s, mask, is_causal):
    """(B, 1, T, S): query t sits at position S − T + t; causal and/or the boolean mask."""
    vis = torch.ones(b, 1, t, s, dtype=torch.bool)
    if is_causal:
        vis = vis & (torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t))
    if mask is not None:
        vis = vis & mask.expand(b, 1, t, s)
    return vis


def softmax_maps(query, key, scaling, n, r, mask=None, is_causal=True):
    """A1 (B, G, n, T, S) of the signal rows and A2 (B, G, m, T, S) of the noise rows; a row that sees no key is 0."""
    b, t, _, d = query.shape
    g, s = key.shape[1] // 2, key.shape[2]
    q = query.reshape(b, t, g, n + n // r, d)
    k = key.reshape(b, g, 2, s, d)
    s1 = torch.einsum("btgjd,bgsd->bgjts", q[:, :, :, :n], k[:, :, 0]) * scaling
    s2 = torch.einsum("btgud,bgsd->bguts", q[:, :, :, n:], k[:, :, 1]) * scaling
    vis = visibility(b, t, s, mask, is_causal)[:, None]  # (B, 1, 1, T, S)
    return tuple(torch.softmax(x.masked_fill(~vis, -1e300), -1) * vis for x in (s1, s2))


def wide_value(value):
    """[V0 | V1] per group: (B, G, S, 2d)."""
    b, hkv, s, d = value.shape
    v = value.reshape(b, hkv // 2, 2, s, d)
    return torch.cat([v[:, :, 0], v[:, :, 1]], -1)


def reference(query, key, value, lam, scaling, n, r, mask=None, is_causal=True):
    """O_h = (A1 − λ·A2)·[V0 | V1], (B, T, G·n, 2d); signal row j of a group subtracts noise row j // r."""
    b, t, _, d = query.shape
    g, s = key.shape[1] // 2, key.shape[2]
    a1, a2 = softmax_maps(query, key, scaling, n, r, mask, is_causal)
    diff = a1.reshape(b, g, n // r, r, t, s) - lam * a2[:, :, :, None]
    return torch.einsum("bgurts,bgse->btgure", diff, wide_value(value)).reshape(b, t, g * n, 2 * d)


def magnitudes(query, key, value, lam, dout, scaling, n, r, mask=None, is_causal=True):
    """Every quantity evaluated with absolute values (the error model's Σ|terms|), and σ (largest |score| bound)."""
    b, t, _, d = query.shape
    g, s = key.shape[1] // 2, key.shape[2]
    m = n // r
    a1, a2 = softmax_maps(query, key, scaling, n, r, mask, is_causal)
    lam = abs(float(lam))
    vv = wide_value(value).abs()
    qa = query.abs().reshape(b, t, g, n + m, d)
    ka = key.abs().reshape(b, g, 2, s, d)
    o1 = torch.einsum("bgjts,bgse->bgjte", a1, vv)
    o2 = torch.einsum("bguts,bgse->bgute", a2, vv)
    o2_rows = o2.repeat_interleave(r, dim=2)  # each signal row's noise output
    mags = {"out": (o1 + lam * o2_rows).permute(0, 3, 1, 2, 4).reshape(b, t, g * n, 2 * d)}
    if dout is not None:
        do = dout.abs().reshape(b, t, g, n, 2 * d).permute(0, 2, 3, 1, 4)  # (B, G, n, T, 2d)
        dsum = do.reshape(b, g, m, r, t, 2 * d).sum(3)
        delta1 = (do * (o1 + 2 * lam * o2_rows)).sum(-1)
        delta2 = (dsum * o2).sum(-1)
        w1 = a1 * (torch.einsum("bgjte,bgse->bgjts", do, vv) + delta1[..., None])
        w2 = lam * a2 * (torch.einsum("bgute,bgse->bguts", dsum, vv) + delta2[..., None])
        dq1 = torch.einsum("bgjts,bgsd->btgjd", w1, ka[:, :, 0])
        dq2 = torch.einsum("bguts,bgsd->btgud", w2, ka[:, :, 1])
        mags["query"] = scaling * torch.cat([dq1, dq2], 3).reshape(b, t, g * (n + m), d)
        dk1 = torch.einsum("bgjts,btgjd->bgsd", w1, qa[:, :, :, :n])
        dk2 = torch.einsum("bguts,btgud->bgsd", w2, qa[:, :, :, n:])
        mags["key"] = scaling * torch.stack([dk1, dk2], 2).reshape(b, 2 * g, s, d)
        dv = torch.einsum("bgjts,bgjte->bgse", a1, do) + lam * torch.einsum("bguts,bgute->bgse", a2, dsum)
        mags["value"] = dv.reshape(b, g, s, 2, d).transpose(2, 3).reshape(b, 2 * g, s, d)
        mags["lam"] = (dsum * o2).sum()
    sigma = scaling * max(
        torch.einsum("btgjd,bgsd->bgjts", qa[:, :, :, :n], ka[:, :, 0]).max().item(),
        torch.einsum("btgud,bgsd->bguts", qa[:, :, :, n:], ka[:, :, 1]).max().item(),
    )
    return mags, sigma


def assert_within(name, got, ref, bound):
    err = (got.detach().cpu().double() - ref).abs()
    bad = err > bound
    if bad.any():
        ratio = (err / bound.clamp_min(1e-300)).max().item()
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{name}: error {err[idx].item():.3g} exceeds its bound {bound[idx].item():.3g} at {idx} "
            f"(worst error/bound ratio {ratio:.3g})"
        )


def coefficients(dtype, d, s, t, b, g, n, m, sigma):
    u_p = UNIT[dtype]
    length = 4 * d + s + b * g * (n + m) * t + 32
    fp32_part = U32 * (2 * d * sigma + length)
    return 2 * u_p + fp32_part, 4 * u_p + fp32_part, u_p


def make_inputs(b, t, s, g, n, r, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = n // r
    query = torch.randn(b, t, g * (n + m), d, generator=gen).to(DEVICE, dtype)
    key = torch.randn(b, 2 * g, s, d, generator=gen).to(DEVICE, dtype)
    value = torch.randn(b, 2 * g, s, d, generator=gen).to(DEVICE, dtype)
    return query, key, value, torch.tensor(0.6, device=DEVICE)


def f64(x):
    """A float64 CPU copy for the reference (None stays None)."""
    return None if x is None else x.detach().cpu().double() if x.is_floating_point() else x.detach().cpu()


def check_forward_backward(
    query, key, value, lam, n, r, mask=None, is_causal=True, attention=tdt.differential_attention_triton
):
    """Forward and every gradient (of query, key, value and λ; ``.grad`` must be retained) against the float64
    reference, within the error model. ``attention``: the function that runs the kernel (a compiled one, say). Returns
    the kernel's and the reference's outputs."""
    b, t, _, d = query.shape
    g, s = key.shape[1] // 2, key.shape[2]
    scaling = d**-0.5
    out = attention(query, key, value, lam, scaling, n, r, attention_mask=mask, is_causal=is_causal)
    assert out.shape == (b, t, g * n, 2 * d) and out.dtype == query.dtype
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    out.backward(dout)

    q64, k64, v64, lam64 = (f64(x).requires_grad_() for x in (query, key, value, lam))
    mask = f64(mask)
    ref = reference(q64, k64, v64, lam64, scaling, n, r, mask, is_causal)
    ref.backward(f64(dout))
    mags, sigma = magnitudes(
        q64.detach(), k64.detach(), v64.detach(), lam64.detach(), f64(dout), scaling, n, r, mask, is_causal
    )
    coef_f, coef_b, u_out = coefficients(query.dtype, d, s, t, b, g, n, n // r, sigma)
    assert_within("output", out.detach(), ref.detach(), coef_f * mags["out"] + u_out * ref.detach().abs())
    grads = {"query": query.grad, "key": key.grad, "value": value.grad}
    refs = {"query": q64.grad, "key": k64.grad, "value": v64.grad}
    for name, got in grads.items():
        assert_within(f"d{name}", got, refs[name], coef_b * mags[name] + u_out * refs[name].abs())
    # dλ is a float32 sum (no 16-bit rounding of the result itself).
    assert_within("dlam", lam.grad, lam64.grad, coef_b * mags["lam"] + U32 * lam64.grad.abs())
    return out, ref


def leaf_inputs(b, t, s, g, n, r, d, dtype=torch.float32):
    return tuple(x.requires_grad_() for x in make_inputs(b, t, s, g, n, r, d, dtype))


# ----------------------------------------------------------------------------------------------------------------------
# Forward and gradients
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "b, g, n, r, t, s",
    [
        pytest.param(2, 2, 1, 1, 24, 24, id="causal-n1-two-groups"),  # the paper's layout, several batches and groups
        pytest.param(1, 1, 2, 1, 24, 24, id="gqa-n2"),
        pytest.param(1, 1, 4, 1, 24, 24, id="gqa-n4"),
        pytest.param(1, 2, 2, 2, 24, 24, id="gda-r2"),  # one noise row shared by two signal rows, two groups
        pytest.param(1, 1, 4, 2, 24, 24, id="gda-n4-r2"),  # two noise rows per group
        pytest.param(1, 1, 2, 1, 10, 24, id="chunked-T<S"),  # the 10 queries are the last 10 of 24 positions
    ],
)
def test_forward_and_gradients_float32(b, g, n, r, t, s):
    query, key, value, lam = leaf_inputs(b, t, s, g, n, r, 16)
    check_forward_backward(query, key, value, lam, n, r)


@pytest.mark.parametrize("n, r", [pytest.param(4, 1, id="gqa-n4"), pytest.param(4, 2, id="gda-n4-r2")])
def test_several_noise_rows_per_program(monkeypatch, n, r):
    """The tuning knob that packs several noise rows of a group (with their signal rows) into one program's tiles, so
    that they share each K/V tile: the same function (rows ordered (signal, noise row, position))."""
    monkeypatch.setitem(tdt._TUNING, "forward", dict(BLOCK_T=16, BLOCK_N=16, UNITS=2))
    monkeypatch.setitem(tdt._TUNING, "dq", dict(BLOCK_T=16, BLOCK_N=16, UNITS=2))
    query, key, value, lam = leaf_inputs(1, 24, 24, 1, n, r, 16)
    check_forward_backward(query, key, value, lam, n, r)


@pytest.mark.parametrize("mask_shape", ["full", "keys-only"])
def test_left_padding(mask_shape):
    """transformers' sdpa mask for a left-padded batch: padded rows see no key, output exactly 0, get no gradient."""
    b, t, g, n, r, d = 2, 24, 1, 2, 1, 16
    query, key, value, lam = leaf_inputs(b, t, t, g, n, r, d)
    pad = torch.tensor([0, 9])  # sequence 1 starts at position 9
    keys_ok = torch.arange(t)[None, :] >= pad[:, None]  # (B, S)
    if mask_shape == "full":
        mask = keys_ok[:, None, None, :] & (torch.arange(t)[None, :] <= torch.arange(t)[:, None])
    else:  # (B, 1, 1, S): the causal part comes from is_causal
        mask = keys_ok[:, None, None, :]
    out, _ = check_forward_backward(query, key, value, lam, n, r, mask=mask.to(DEVICE))
    assert (out[1, :9] == 0).all() and (out[0] != 0).all()
    assert (query.grad[1, :9] == 0).all()
    assert (key.grad[1, :, :9] == 0).all() and (value.grad[1, :, :9] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_inputs(dtype):
    """bf16/fp16 inputs, float32 accumulation: within the 16-bit roundings of the error model; GDA so that the summed
    dO' of a noise row is rounded too."""
    query, key, value, lam = leaf_inputs(1, 10, 24, 1, 2, 2, 16, dtype)
    out, _ = check_forward_backward(query, key, value, lam, 2, 2)
    assert query.grad.dtype == key.grad.dtype == value.grad.dtype == dtype


def test_noncontiguous_inputs():
    """Strided views: a query permuted from (B, Hq, T, d), a key transposed from a (B, S, 2G, d) projection, a value
    sliced from a longer static cache."""
    b, t, s, g, n, r, d = 1, 24, 24, 1, 2, 1, 16
    gen = torch.Generator().manual_seed(3)
    q_base = torch.randn(b, g * (n + n // r), t, d, generator=gen).to(DEVICE).requires_grad_()
    k_base = torch.randn(b, s, 2 * g, d, generator=gen).to(DEVICE).requires_grad_()
    v_base = torch.randn(b, 2 * g, s + 8, d, generator=gen).to(DEVICE).requires_grad_()  # a static cache longer than S
    lam = torch.tensor(0.6, device=DEVICE, requires_grad=True)
    query, key, value = q_base.transpose(1, 2), k_base.transpose(1, 2), v_base[:, :, :s]
    for x in (query, key, value):
        x.retain_grad()
    assert not any(x.is_contiguous() for x in (query, key, value))
    check_forward_backward(query, key, value, lam, n, r)


def test_single_token_with_grad():
    """One query token under autograd (not the decode path): gradients of everything."""
    query, key, value, lam = leaf_inputs(1, 1, 24, 1, 2, 1, 16)
    check_forward_backward(query, key, value, lam, 2, 1)


def test_head_dim_not_a_power_of_two():
    query, key, value, lam = leaf_inputs(1, 24, 24, 1, 2, 1, 20)
    check_forward_backward(query, key, value, lam, 2, 1)


@pytest.mark.parametrize("with_mask", [False, True])
def test_bidirectional(with_mask):
    """is_causal=False: every key (or the mask alone) decides, e.g. an encoder."""
    query, key, value, lam = leaf_inputs(1, 24, 24, 1, 2, 1, 16)
    mask = None
    if with_mask:
        mask = (torch.rand(1, 1, 24, 24, generator=torch.Generator().manual_seed(5)) < 0.7).to(DEVICE)
    check_forward_backward(query, key, value, lam, 2, 1, mask=mask, is_causal=False)


def test_default_launch_configuration(monkeypatch):
    """The configuration a launch gets where nothing overrides it (each kernel's first entry of LAUNCH_CONFIGS that
    suits the problem; on this tiny problem the smaller tiles) computes the same function."""
    monkeypatch.setattr(tdt, "_TUNING", {})
    query, key, value, lam = leaf_inputs(1, 20, 20, 1, 2, 1, 16)
    check_forward_backward(query, key, value, lam, 2, 1)


# ----------------------------------------------------------------------------------------------------------------------
# Every launch configuration the GPU may autotune or pin: forward, dK/dV and dQ, in float32 and bfloat16
# ----------------------------------------------------------------------------------------------------------------------


def tilings(kind):
    """LAUNCH_CONFIGS[kind] grouped by tiling (num_warps and num_stages change nothing the interpreter runs), smallest
    tiles first: [[configurations sharing a tiling], ...]."""
    groups = {}
    for cfg in tdt.LAUNCH_CONFIGS[kind]:
        tiles = tuple((k, v) for k, v in cfg.items() if k not in ("num_warps", "num_stages"))
        groups.setdefault(tiles, []).append(cfg)
    return sorted(groups.values(), key=lambda g: (g[0]["BLOCK_T"] * g[0].get("UNITS", 1), g[0]["BLOCK_N"]))


def config_runs():
    """Runs that together launch every tiling of the three lists: run i takes the tiling at the same relative place
    in each size-sorted list, so that the tiles of one run are of similar size (a run's problem is sized to its
    largest tile, and small tiles on a large problem are what makes the interpreter slow)."""
    lists = {kind: tilings(kind) for kind in ("forward", "dkdv", "dq")}
    count = max(len(v) for v in lists.values())
    return [{kind: v[round(i * (len(v) - 1) / (count - 1))][0] for kind, v in lists.items()} for i in range(count)]


CONFIG_RUNS = config_runs()
# (n, r): GQA factors 1, 2 and 4 with one noise row per signal row, and grouped noise heads (r = 2) with 2 and 4
# signal rows per group; each run takes a different one per dtype.
HEAD_LAYOUTS = [(1, 1), (2, 1), (4, 1), (4, 2), (2, 2)]


def test_config_runs_cover_every_configuration():
    """The runs below launch every tiling of every configuration in the autotuned lists."""
    for kind in ("forward", "dkdv", "dq"):
        launched = {tuple(run[kind].items()) for run in CONFIG_RUNS}
        for cfg in tdt.LAUNCH_CONFIGS[kind]:
            tiles = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
            assert any(tiles.items() <= dict(run).items() for run in launched), (kind, cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("run", range(len(CONFIG_RUNS)))
def test_every_launch_configuration(monkeypatch, run, dtype):
    """Each tiling of the forward, dK/dV and dQ lists (as the GPU would launch it, but on the interpreter), on a problem
    of one and a half of its largest tile (so every kernel crosses tiles: blocks below the causal diagonal, on it and a
    partial one), against the float64 reference within the error model: output and the gradients of q, k, v and λ.
    Runs alternate a left-padding mask and queries that are the last T of S keys, and cycle through GQA factors 1, 2, 4
    and grouped noise heads."""
    configs = CONFIG_RUNS[run]
    j = 0 if dtype == torch.float32 else 1
    n, r = HEAD_LAYOUTS[(run + 2 * j) % len(HEAD_LAYOUTS)]
    largest = max(max(c["BLOCK_T"], c["BLOCK_N"]) for c in configs.values())
    s = largest + largest // 2
    t = s - 7 if run % 3 == 1 else s
    monkeypatch.setattr(tdt, "_TUNING", {**configs, "preprocess": dict(BLOCK_T=16)})
    query, key, value, lam = leaf_inputs(1, t, s, 1, n, r, 16, dtype)
    mask = None
    if (run + j) % 2:
        mask = (torch.arange(s) >= 5)[None, None, None, :].to(DEVICE)  # the first 5 keys are padding
    check_forward_backward(query, key, value, lam, n, r, mask=mask)


@pytest.mark.parametrize("index", range(len(tdt.LAUNCH_CONFIGS["decode"])))
def test_every_decode_configuration(monkeypatch, index):
    """Each decode configuration over a cache just long enough for its keys to be split in two or more (as the GPU
    splits them for one sequence, the last split partial), GQA or grouped noise heads and a padding mask in turn,
    against the reference."""
    cfg = tdt.LAUNCH_CONFIGS["decode"][index]
    monkeypatch.setattr(tdt, "_TUNING", {"decode": dict(cfg)})
    n, r = HEAD_LAYOUTS[index % len(HEAD_LAYOUTS)]
    b, g, d, s = 1, 1, 16, max(3, cfg["min_split_blocks"] + 1) * cfg["BLOCK_N"] - 5
    query, key, value, lam = make_inputs(b, 1, s, g, n, r, d, torch.bfloat16 if index % 2 else torch.float32)
    mask = (torch.arange(s) >= 3)[None, None, None, :].to(DEVICE) if index % 2 else None
    plan = tdt._decode_plan(b, g, n // r, s, 1, cfg, DEVICE)
    assert plan["splits"] > 1, "the problem should split its keys"
    with torch.no_grad():
        out = tdt.differential_attention_triton(query, key, value, lam, d**-0.5, n, r, attention_mask=mask)
    q64, k64, v64, lam64, mask = f64(query), f64(key), f64(value), f64(lam), f64(mask)
    ref = reference(q64, k64, v64, lam64, d**-0.5, n, r, mask)
    mags, sigma = magnitudes(q64, k64, v64, lam64, None, d**-0.5, n, r, mask)
    coef_f, _, u_out = coefficients(query.dtype, d, s, 1, b, g, n, n // r, sigma)
    assert_within("decode", out, ref, coef_f * mags["out"] + u_out * ref.abs())


def test_no_grad_forward_matches():
    """Without autograd the forward saves nothing and gives the same output as under autograd."""
    query, key, value, lam = make_inputs(1, 24, 24, 1, 2, 1, 16)
    with torch.no_grad():
        plain = tdt.differential_attention_triton(query, key, value, lam, 0.25, 2)
    tracked = tdt.differential_attention_triton(query, key, value, lam.clone().requires_grad_(), 0.25, 2)
    torch.testing.assert_close(plain, tracked.detach(), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------------
# Decode: one token per sequence over a cache
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, r, splits, padded, dtype",
    [
        pytest.param(2, 1, 1, False, torch.float32, id="one-split"),
        pytest.param(2, 1, 3, False, torch.float32, id="three-splits"),
        pytest.param(4, 2, 2, True, torch.float32, id="gda-left-padding"),
        pytest.param(2, 1, 3, False, torch.bfloat16, id="bf16-three-splits"),
    ],
)
def test_decode_steps(monkeypatch, n, r, splits, padded, dtype):
    """Three decode steps over a static cache (a strided slice of a longer buffer), against the reference."""
    monkeypatch.setitem(tdt._TUNING, "decode", dict(BLOCK_N=16, splits=splits))
    b, g, d, s_max, prompt = 2, 1, 16, 56, 40  # 40 keys in 16-key blocks: three splits of 16, 16, 8+
    gen = torch.Generator().manual_seed(7)
    m = n // r
    k_cache = torch.randn(b, 2 * g, s_max, d, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(b, 2 * g, s_max, d, generator=gen).to(DEVICE, dtype)
    lam = torch.tensor(0.6, device=DEVICE)
    pad = torch.tensor([0, 5], device=DEVICE) if padded else torch.zeros(2, dtype=torch.long, device=DEVICE)
    for step in range(3):
        s = prompt + step
        query = torch.randn(b, 1, g * (n + m), d, generator=gen).to(DEVICE, dtype)
        key, value = k_cache[:, :, :s], v_cache[:, :, :s]
        mask = (torch.arange(s, device=DEVICE)[None, :] >= pad[:, None])[:, None, None, :] if padded else None
        with torch.no_grad():
            out = tdt.differential_attention_triton(query, key, value, lam, d**-0.5, n, r, attention_mask=mask)
        q64, k64, v64, lam64, mask = f64(query), f64(key), f64(value), f64(lam), f64(mask)
        ref = reference(q64, k64, v64, lam64, d**-0.5, n, r, mask)
        mags, sigma = magnitudes(q64, k64, v64, lam64, None, d**-0.5, n, r, mask)
        coef_f, _, u_out = coefficients(dtype, d, s, 1, b, g, n, m, sigma)
        assert_within(f"decode step {step}", out, ref, coef_f * mags["out"] + u_out * ref.abs())


def test_decode_reads_each_group_once():
    """The decode launch puts all n + m rows of a KV group in one program (per key split): the cache is read once."""
    for m, r_pad in ((1, 1), (4, 1), (3, 2), (16, 1)):
        plan = tdt._decode_plan(b=1, g=4, m=m, s=4096, r_pad=r_pad, cfg=tdt.LAUNCH_CONFIGS["decode"][0], device="cpu")
        assert plan["unit_blocks"] == 1 and plan["units"] >= m
        assert plan["splits"] * plan["split_len"] >= 4096 > (plan["splits"] - 1) * plan["split_len"]


# ----------------------------------------------------------------------------------------------------------------------
# Choosing a configuration: pruning, autotuning, pinning, the sweep; the eager path's caches
# ----------------------------------------------------------------------------------------------------------------------

CPU = torch.device("cpu")  # _prune answers for a CPU device as for an H100 (the configurations are the GPU's)
LLAMA_1B_TRAIN = tdt._Shape(8, 2048, 2048, 4, 4, 1, 64, torch.bfloat16, True, False, CPU)  # V1 layout of its heads
H100 = 227 * 1024  # shared memory per block


def cfg(warps, stages, **blocks):
    return {**blocks, "num_warps": warps, "num_stages": stages}


@pytest.fixture
def unpinned():
    tdt.set_configs(None)  # whatever an earlier test module of this process pinned (the GPU check's smoke run pins)
    yield
    tdt.set_configs(None)


def test_hopper_defaults_use_wgmma_tiles():
    """At Llama-3.2-1B's shape in bf16 on an H100 every listed configuration fits (the sweep times them all), and each
    tuned kernel's default gives its dots an M that is a multiple of 64, which Hopper's wgmma needs: 64 keys for
    dK/dV, 64 or more rows per tile for the forward and dQ."""
    for kind in ("forward", "dkdv", "dq", "decode"):
        assert all(tdt._keep(kind, c, LLAMA_1B_TRAIN, H100, heuristics=False) for c in tdt.LAUNCH_CONFIGS[kind])
    for kind in ("forward", "dkdv", "dq"):
        kept = tdt._prune(kind, tdt.LAUNCH_CONFIGS[kind], LLAMA_1B_TRAIN)
        rows = kept[0]["BLOCK_N"] if kind == "dkdv" else kept[0]["BLOCK_T"] * kept[0]["UNITS"]
        assert rows % 64 == 0, (kind, kept[0])
    assert tdt._prune("dkdv", tdt.LAUNCH_CONFIGS["dkdv"], LLAMA_1B_TRAIN)[0]["BLOCK_N"] == 64


@pytest.mark.parametrize(
    "kind, config, change, kept",
    [
        pytest.param("dkdv", cfg(8, 2, BLOCK_T=32, BLOCK_N=64), {}, True, id="dkdv-64-keys-8-warps"),
        pytest.param("dkdv", cfg(8, 2, BLOCK_T=16, BLOCK_N=32), {}, False, id="8-warps-for-a-small-tile"),
        pytest.param("dkdv", cfg(4, 2, BLOCK_T=16, BLOCK_N=32), {}, True, id="4-warps-for-a-small-tile"),
        pytest.param("forward", cfg(4, 3, BLOCK_T=128, BLOCK_N=32, UNITS=1), {}, False, id="accumulators-too-many"),
        pytest.param("forward", cfg(8, 3, BLOCK_T=128, BLOCK_N=32, UNITS=1), {"r": 2}, False, id="r2-triples-rows"),
        pytest.param(
            "forward",
            cfg(8, 3, BLOCK_T=128, BLOCK_N=32, UNITS=1),
            {"dtype": torch.float32},
            False,
            id="float32-counts-double",
        ),
        pytest.param("forward", cfg(8, 3, BLOCK_T=128, BLOCK_N=32, UNITS=1), {"t": 40}, False, id="tile-over-queries"),
        pytest.param("dkdv", cfg(8, 2, BLOCK_T=32, BLOCK_N=128), {"s": 100}, True, id="key-tile-within-bucket"),
        pytest.param("dkdv", cfg(8, 2, BLOCK_T=32, BLOCK_N=128), {"s": 60}, False, id="key-tile-over-keys"),
        pytest.param("forward", cfg(4, 3, BLOCK_T=32, BLOCK_N=32, UNITS=2), {"n": 1}, False, id="units-over-rows"),
        pytest.param("decode", tdt.LAUNCH_CONFIGS["decode"][2], {}, True, id="decode-8-warps"),
    ],
)
def test_pruning_rules(kind, config, change, kept):
    """_keep's rules (see its docstring) on the 1B training shape: tiles within the problem, fp32 accumulators per
    thread within _ACC_LIMIT (doubled for float32 inputs, tripled rows for r = 2), 8 warps only for tiles that need
    them (decode exempt)."""
    assert tdt._keep(kind, config, LLAMA_1B_TRAIN._replace(**change), H100) is kept


def test_pruning_shared_memory_and_fallbacks():
    """Pipelined stages must fit shared memory (an sm_86 part has 99 KiB, an H100 227); the tile rules alone
    are what the sweep times; _prune never returns nothing (the smallest entry stays) and keeps one entry for a
    problem too small for timing to matter."""
    three_stages = cfg(8, 3, BLOCK_T=128, BLOCK_N=64, UNITS=1)  # 32 KiB of Q tiles, 3 × 32 KiB of K1, K2, V
    assert tdt._keep("forward", three_stages, LLAMA_1B_TRAIN, H100)
    assert not tdt._keep("forward", three_stages, LLAMA_1B_TRAIN, 99 * 1024)
    small_tile_8_warps = cfg(8, 2, BLOCK_T=16, BLOCK_N=32)
    assert tdt._keep("dkdv", small_tile_8_warps, LLAMA_1B_TRAIN, H100, heuristics=False)
    tiny = LLAMA_1B_TRAIN._replace(b=1, t=8, s=8)
    assert tdt._prune("dkdv", tdt.LAUNCH_CONFIGS["dkdv"], tiny) == [small_tile_8_warps]
    small = LLAMA_1B_TRAIN._replace(b=1, t=256, s=256)
    assert len(tdt._prune("forward", tdt.LAUNCH_CONFIGS["forward"], small)) == 1


def test_autotuner_prunes_as_the_host_does(monkeypatch):
    """triton.autotune wraps each tuned kernel with its key (_TUNE_KEYS_OF: every name a kernel argument, so the key
    really varies) and an early prune that applies _prune to the launch's own arguments: on a recorded launch at the 1B
    shape (meta tensors: nothing runs) it keeps what the host keeps, and it keys on the length buckets."""
    tuners = {kind: tdt._autotuner(kind) for kind in ("forward", "dkdv", "dq")}
    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, args, kwargs))

    monkeypatch.setattr(tdt, "_TUNING", {})
    monkeypatch.setattr(tdt, "_jitted", lambda: {name: Recorder(name) for name in tdt._JIT_NAMES})
    shape = LLAMA_1B_TRAIN._replace(b=6)
    b, t, s, g, n, r, d = shape[:7]
    meta = dict(device="meta", dtype=torch.bfloat16)
    query, key = torch.empty(b, t, g * 2 * n, d, **meta), torch.empty(b, 2 * g, s, d, **meta)
    lam = torch.empty((), device="meta")
    out, o2, lse1, lse2 = tdt._forward(query, key, key, lam, d**-0.5, n, r, None, True, save_stats=True)
    tdt._backward(out, query, key, key, lam, out, o2, lse1, lse2, d**-0.5, n, r, None, True)
    recorded = {name: (args, kwargs) for name, args, kwargs in launches}
    for kind, tuner in tuners.items():
        args, kwargs = recorded[tdt._KERNELS[kind]]
        assert set(tdt._TUNE_KEYS) <= set(tuner.keys) <= set(tuner.arg_names)
        named = dict(zip(tuner.arg_names, args))
        assert (named["t_bucket"], named["s_bucket"], named["b_bucket"]) == (2048, 2048, 8)
        fixed = {k: v for k, v in kwargs.items() if k not in tdt._CONFIG_KEYS[kind] + ("num_warps", "num_stages")}
        pruned = tuner.early_config_prune(tuner.configs, named, **fixed)
        host = tdt._prune(kind, tdt.LAUNCH_CONFIGS[kind], shape._replace(device=query.device, b=8))
        assert [tdt._config_dict(c) for c in pruned] == host


def test_when_autotuning_happens(monkeypatch, unpinned):
    """On a GPU (the interpreter switched off here) a problem big enough is autotuned unless a configuration is pinned
    for it, autotuning is switched off (set_configs(..., autotune=False)), the tests' override applies, or the kernel
    is decode's; tiny problems and the interpreter take the default."""
    monkeypatch.setattr(tdt, "_TUNING", {})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    default = tdt._prune("dq", tdt.LAUNCH_CONFIGS["dq"], LLAMA_1B_TRAIN)[0]
    assert tdt._pick("dq", LLAMA_1B_TRAIN) == (default, True, True)
    assert tdt._pick("decode", LLAMA_1B_TRAIN._replace(t=1))[1] is False
    assert tdt._pick("dq", LLAMA_1B_TRAIN._replace(t=64, s=64))[1] is False
    pinned = cfg(4, 2, BLOCK_T=32, BLOCK_N=32, UNITS=1)
    tdt.set_configs({"dq": [{"when": {"t_bucket": 2048, "dtype": "bfloat16"}, "config": pinned}]})
    assert tdt._pick("dq", LLAMA_1B_TRAIN) == (pinned, False, True)
    assert tdt._pick("dq", LLAMA_1B_TRAIN._replace(t=4096, s=4096))[1] is True  # the rule does not match
    tdt.set_configs({}, autotune=False)
    assert tdt._pick("dq", LLAMA_1B_TRAIN) == (default, False, True)
    tdt.set_configs(None)
    monkeypatch.setitem(tdt._TUNING, "dq", {"BLOCK_N": 16})
    assert tdt._pick("dq", LLAMA_1B_TRAIN) == ({**default, "BLOCK_N": 16}, False, False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tdt, "_TUNING", {})
    assert tdt._pick("dq", LLAMA_1B_TRAIN)[1] is False


def test_pinned_configurations_are_launched(monkeypatch, unpinned):
    """set_configs' rules, first match winning, decide each kernel's launch (the shape's plan records it) and the
    result is the function's; unpinning drops the plans."""
    monkeypatch.setattr(tdt, "_TUNING", {"preprocess": dict(BLOCK_T=16)})  # no tile override: the rules decide
    small = cfg(4, 2, BLOCK_T=16, BLOCK_N=16, UNITS=1)
    never = cfg(8, 3, BLOCK_T=128, BLOCK_N=128, UNITS=1)
    tdt.set_configs(
        {
            "forward": [{"when": {"head_dim": 64}, "config": never}, {"when": {"head_dim": 16}, "config": small}],
            "dq": small,
            "dkdv": {k: v for k, v in small.items() if k != "UNITS"},
            "decode": dict(tdt.LAUNCH_CONFIGS["decode"][0], BLOCK_N=16),
        }
    )
    monkeypatch.setattr(tdt, "_TUNING", {})  # plans are cached only without an override
    query, key, value, lam = leaf_inputs(1, 40, 40, 1, 2, 1, 16)
    check_forward_backward(query, key, value, lam, 2, 1)
    with torch.no_grad():
        tdt.differential_attention_triton(query[:, -1:], key, value, lam, 0.25, 2)
    plans = {k[0]: v for k, v in tdt._PLANS.items()}
    assert plans["forward"][0] == small and plans["dq"][0] == small and plans["dkdv"][0]["BLOCK_N"] == 16
    assert plans["decode"]["config"]["BLOCK_N"] == 16
    tdt.set_configs(None)
    assert not tdt._PLANS


@pytest.mark.parametrize(
    "configs, match",
    [
        ({"fwd": {}}, "unknown kernel 'fwd'; kernels: forward, dkdv, dq, decode"),
        ({"dq": {"BLOCK_T": 16}}, r"missing \['BLOCK_N', 'UNITS', 'num_warps', 'num_stages'\]"),
        ({"dkdv": cfg(4, 2, BLOCK_T=16, BLOCK_N=16, UNITS=1)}, r"unknown \['UNITS'\]"),
        ({"dq": cfg(4, 2, BLOCK_T=24, BLOCK_N=16, UNITS=1)}, r"\['BLOCK_T'\] must be an int >= 16 and a power of two"),
        ({"dq": cfg(4, 2, BLOCK_T=8, BLOCK_N=16, UNITS=1)}, r"\['BLOCK_T'\] must be an int >= 16"),
        ({"dq": [{"when": {"seq": 1}, "config": cfg(4, 2, BLOCK_T=16, BLOCK_N=16, UNITS=1)}]}, "'when'] may name"),
        ({"dq": [{"config": cfg(4, 2, BLOCK_T=16, BLOCK_N=16, UNITS=1), "if": {}}]}, "must be {'when'"),
        ({"dq": "fast"}, "must map to a configuration dict or a list of rules"),
    ],
)
def test_set_configs_errors(configs, match, unpinned):
    with pytest.raises(ValueError, match=match):
        tdt.set_configs(configs)
    assert tdt._PINNED["rules"] == {}


def test_tuning_sweep_on_the_interpreter(monkeypatch, unpinned, tmp_path):
    """The sweep's logic (its timings mean nothing here): every configuration that fits is launched, checked against
    the first and timed; one that fails is recorded, not raised; the result is JSON, renders as a table, and its
    "pinned" is a set_configs mapping (load_configs reads it back). A spent budget skips, and pins nothing."""
    small = cfg(4, 2, BLOCK_T=16, BLOCK_N=16, UNITS=1)
    broken = dict(small, UNITS=3)  # three noise rows per tile: tl.arange refuses a length that is not a power of two
    monkeypatch.setitem(tdt.LAUNCH_CONFIGS, "forward", (small, dict(small, BLOCK_N=32), broken))
    monkeypatch.setitem(tdt.LAUNCH_CONFIGS, "dkdv", (cfg(4, 2, BLOCK_T=16, BLOCK_N=16),))
    monkeypatch.setitem(tdt.LAUNCH_CONFIGS, "dq", (small,))
    problem = {"batch": 1, "queries": 20, "keys": 20, "groups": 1, "n": 3, "head_dim": 16}
    shapes = [
        {"name": "prefill", "kernels": ["forward"], **problem},
        {"name": "train", "kernels": ["dkdv", "dq"], **problem},
    ]
    result = json.loads(json.dumps(tdt.tuning_sweep(shapes, torch.float32, DEVICE, rep_ms=1.0, workers=0)))
    forward = result["results"][0]
    assert [row["error"] is None for row in forward["timings"]] == [True, True, False]
    assert all(row["ms"] > 0 and row["agrees"] for row in forward["timings"][:2])
    assert forward["best"] in (small, dict(small, BLOCK_N=32)) and forward["default"] == small
    assert [e["kernel"] for e in result["results"]] == ["forward", "dkdv", "dq"]
    table = tdt.format_sweep(result, every=True)
    assert "prefill" in table and "train" in table and "ValueError" in table.split("forward")[1]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(result))
    assert tdt.load_configs(path) == result["pinned"]
    assert tdt._PINNED["rules"]["forward"][-1] == {"when": {}, "config": forward["best"]}
    assert tdt._PINNED["autotune"] is False
    spent = tdt.tuning_sweep(shapes[:1], torch.float32, DEVICE, budget_s=0.0, workers=0)
    assert all(row["skipped"] for row in spent["results"][0]["timings"]) and spent["pinned"] == {}


def test_tuning_sweep_smoke_shapes():
    """SWEEP_SMOKE_SHAPES (what a smoke run of the GPU check can sweep on the interpreter): every configuration that
    fits them runs, agrees with the first, and no kernel is left without a best configuration."""
    result = tdt.tuning_sweep(tdt.SWEEP_SMOKE_SHAPES, torch.float32, DEVICE, rep_ms=1.0, workers=0)
    assert [e["kernel"] for e in result["results"]] == ["forward", "dkdv", "dq", "decode"]
    for entry in result["results"]:
        assert entry["timings"] and entry["best"] is not None, entry["kernel"]
        assert all(row["agrees"] and row["error"] is None for row in entry["timings"]), entry["kernel"]


def test_validation_runs_once_per_signature(monkeypatch):
    """The checks run once per input signature (shapes, strides, dtypes, devices, scalars, mask shape); an input that
    fails them is never remembered (it fails every time); the memory is bounded."""
    calls = []
    validate = tdt._validate
    monkeypatch.setattr(tdt, "_validate", lambda *args: calls.append(args[0].shape) or validate(*args))
    monkeypatch.setattr(tdt, "_VALIDATED", {})
    monkeypatch.setattr(tdt, "_VALIDATED_MAX", 2)
    query, key, value, lam = make_inputs(1, 20, 20, 1, 2, 1, 16)
    mask = (torch.arange(20) >= 3)[None, None, None, :].to(DEVICE)
    with torch.no_grad():
        first = tdt.differential_attention_triton(query, key, value, lam, 0.25, 2, attention_mask=mask)
        again = tdt.differential_attention_triton(query, key, value, lam, 0.25, 2, attention_mask=mask)
        assert len(calls) == 1
        torch.testing.assert_close(first, again, rtol=0, atol=0)
        tdt.differential_attention_triton(query, key, value, lam, 0.25, 2)  # no mask: another signature
        assert len(calls) == 2
        for _ in range(2):
            with pytest.raises(ValueError, match="pair_stride"):
                tdt.differential_attention_triton(query, key, value, lam, 0.25, 0)
        assert len(calls) == 4 and len(tdt._VALIDATED) == 2
        tdt.differential_attention_triton(query[:, :10], key, value, lam, 0.25, 2)
        assert len(calls) == 5 and len(tdt._VALIDATED) == 2


def test_eager_inference_skips_the_dispatcher(monkeypatch):
    """Without autograd, outside torch.compile and with no dispatch mode, a call runs the inference op's implementation
    directly; under a dispatch mode (what FakeTensorMode and FlopCounterMode are) it goes through the op, which the
    mode sees; both give the same output. With autograd the forward op (and its registered backward) runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    calls = []
    for name in ("_OP_INFERENCE", "_OP_FORWARD"):
        op = getattr(tdt, name)
        monkeypatch.setattr(tdt, name, lambda *args, op=op, name=name: calls.append(name) or op(*args))
    query, key, value, lam = make_inputs(1, 20, 20, 1, 2, 1, 16)
    with torch.no_grad():
        direct = tdt.differential_attention_triton(query, key, value, lam, 0.25, 2)
        assert calls == []
        with Spy():
            dispatched = tdt.differential_attention_triton(query, key, value, lam, 0.25, 2)
    assert calls == ["_OP_INFERENCE"] and torch.ops.difftransformer.diff_attn_v1_inference.default in ops
    torch.testing.assert_close(direct, dispatched, rtol=0, atol=0)
    tracked = tdt.differential_attention_triton(query, key, value, lam.clone().requires_grad_(), 0.25, 2)
    assert calls == ["_OP_INFERENCE", "_OP_FORWARD"] and tracked.grad_fn is not None
    torch.testing.assert_close(direct, tracked.detach(), rtol=0, atol=0)


def test_launch_plans_are_cached_per_shape(monkeypatch):
    """A shape's configuration is picked once (then its cached plan launches), again for another shape."""
    monkeypatch.setattr(tdt, "_TUNING", {})
    monkeypatch.setattr(tdt, "_PLANS", {})
    picks = []
    pick = tdt._pick
    monkeypatch.setattr(tdt, "_pick", lambda kind, shape: picks.append(kind) or pick(kind, shape))
    query, key, value, lam = make_inputs(1, 20, 20, 1, 2, 1, 16)
    with torch.no_grad():
        first = tdt.differential_attention_triton(query, key, value, lam, 0.25, 2)
        again = tdt.differential_attention_triton(query, key, value, lam, 0.25, 2)
        assert picks == ["forward"]
        tdt.differential_attention_triton(query[:, :12], key[:, :, :12], value[:, :, :12], lam, 0.25, 2)
        assert picks == ["forward", "forward"] and len(tdt._PLANS) == 2
    torch.testing.assert_close(first, again, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------------
# Errors and availability
# ----------------------------------------------------------------------------------------------------------------------


def _good():
    query, key, value, lam = make_inputs(1, 4, 6, 1, 2, 1, 16)
    return dict(query=query, key=key, value=value, lam=lam, scaling=0.25, pair_stride=2)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: a.update(query=a["query"][0]), ValueError, "query must be a 4-dimensional tensor"),
        (lambda a: a.update(query=a["query"].double()), TypeError, "query.dtype must be one of"),
        (lambda a: a.update(key=a["key"].half()), TypeError, "must share one dtype"),
        (lambda a: a.update(value=a["value"][:, :, :5]), ValueError, "key and value must have the same shape"),
        (
            lambda a: a.update(key=a["key"][:1], value=a["value"][:1], query=a["query"].expand(2, -1, -1, -1)),
            ValueError,
            "does not match query shape",
        ),
        (lambda a: a.update(key=a["key"][:, :1], value=a["value"][:, :1]), ValueError, "even count"),
        (lambda a: a.update(pair_stride=3), ValueError, r"must have 1 × \(3 \+ 3\) = 6"),
        (lambda a: a.update(pair_stride=0), ValueError, "pair_stride"),
        (lambda a: a.update(noise_ratio=3), ValueError, "noise_ratio must be a positive int dividing"),
        (lambda a: a.update(key=a["key"][:, :, :3], value=a["value"][:, :, :3]), ValueError, "exceeds the key length"),
        (lambda a: a.update(lam=a["lam"].reshape(1)), ValueError, "lam must be a 0-dimensional"),
        (lambda a: a.update(scaling=float("nan")), ValueError, "scaling must be a finite float"),
        (lambda a: a.update(attention_mask=torch.zeros(1, 1, 4, 6)), TypeError, "attention_mask must be a boolean"),
        (lambda a: a.update(attention_mask=torch.ones(1, 2, 4, 6, dtype=torch.bool)), ValueError, r"\(B or 1, 1, T"),
        (lambda a: a.update(attention_mask=torch.ones(1, 1, 3, 6, dtype=torch.bool)), ValueError, "does not broadcast"),
        (lambda a: a.update(is_causal=None), ValueError, "is_causal must be a bool"),
    ],
)
def test_bad_input_errors(change, error, match):
    args = _good()
    change(args)
    with pytest.raises(error, match=match):
        tdt.differential_attention_triton(**args)


def test_is_available(monkeypatch):
    if DEVICE.type == "cuda":
        assert tdt.is_available("cuda") and tdt.is_available(DEVICE)
        return
    assert tdt.is_available("cpu")  # the interpreter is on in this module
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not tdt.is_available("cpu") and not tdt.is_available(torch.device("cpu"))


def test_module_imports_without_triton(monkeypatch):
    """`import difftransformer` must not need triton: without it the module loads, is_available is False and a call
    says what is missing."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("_tdt_without_triton", tdt.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.triton is None and not module.is_available("cpu")
    with pytest.raises(RuntimeError, match="needs triton"):
        module.differential_attention_triton(**_good())


# ----------------------------------------------------------------------------------------------------------------------
# The GPU build: the interpreter runs the kernels' Python, it does not compile them
# ----------------------------------------------------------------------------------------------------------------------


def test_kernels_compile_for_h100(monkeypatch):
    """Every kernel, launched exactly as the host code launches it in the GPU's tile configuration (bf16, grouped
    differential attention with a mask: the most code paths; decode with key splits), compiles for an H100 (sm_90)
    through Triton's front end, LLVM and its bundled ptxas. No GPU is needed; this catches what the interpreter cannot
    (tl.dot's tile minimums, layouts, types). The default tiles of the forward, dK/dV (64 keys) and dQ give Hopper's
    wgmma the 64-row operands it needs: their PTX uses it."""
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend to compile for")
    if DEVICE.type == "cuda":
        pytest.skip("on a GPU the other tests compile and run every kernel")
    from triton.runtime.jit import JITFunction

    if not isinstance(tdt.tl.standard.cdiv, JITFunction):  # triton.language's own jit functions, made at its import
        pytest.skip(
            "triton was imported with TRITON_INTERPRET=1 set, so its language functions are the interpreter's and "
            "nothing compiles for a GPU in this process (run without TRITON_INTERPRET in the environment: this module "
            "sets it itself)"
        )

    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, args, kwargs))

    jitted = tdt._jitted
    monkeypatch.setattr(tdt, "_TUNING", {})
    monkeypatch.setattr(tdt, "_jitted", lambda: {name: Recorder(name) for name in tdt._JIT_NAMES})
    b, t, s, g, n, r, d = 1, 128, 128, 2, 2, 2, 64
    query, key, value, lam = make_inputs(b, t, s, g, n, r, d, torch.bfloat16)
    mask = torch.ones(b, 1, t, s, dtype=torch.bool).view(torch.uint8)
    out, o2, lse1, lse2 = tdt._forward(query, key, value, lam, d**-0.5, n, r, mask, True, save_stats=True)
    tdt._backward(torch.ones_like(out), query, key, value, lam, out, o2, lse1, lse2, d**-0.5, n, r, mask, True)
    query, key, value, lam = make_inputs(b, 1, 512, g, n, r, d, torch.bfloat16)
    tdt._decode(query, key, value, lam, d**-0.5, n, r, None, True)
    assert [name for name, _, _ in launches] == [
        "_diff_attn_fwd",
        "_diff_attn_bwd_preprocess",
        "_diff_attn_bwd_dkdv",
        "_diff_attn_bwd_dq",
        "_diff_attn_fwd",
        "_diff_attn_decode_combine",
    ]
    assert launches[4][2]["SPLIT"], "the decode launch should split 512 keys over programs"

    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default; set to silence 3.9's notice about it
    kernels = jitted()  # the GPU's decoration (the next interpreted call decorates for the interpreter again)
    types = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.uint8: "*u8"}
    wgmma = set()
    for index, (name, args, kwargs) in enumerate(launches):
        fn = kernels[name]
        values = dict(zip(fn.arg_names, args), **kwargs)
        signature, constexprs = {}, {}
        for param in fn.params:
            value = values[param.name]
            if param.is_constexpr:
                signature[param.name], constexprs[param.name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = types[value.dtype]
            else:
                signature[param.name] = "fp32" if isinstance(value, float) else "i32"
        options = {key: kwargs[key] for key in ("num_warps", "num_stages") if key in kwargs}
        source = ASTSource(fn, signature, constexprs)
        compiled = triton_compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        assert compiled.asm.get("cubin"), name
        if "wgmma.mma_async" in compiled.asm["ptx"]:
            wgmma.add(index)
    assert {0, 2, 3} <= wgmma, "the forward, dK/dV and dQ defaults should use wgmma on sm_90"


def test_decode_epilogues_compile_for_h100(monkeypatch):
    """The decode step's epilogues (difftransformer/kernels/triton/epilogue.py), which the tests otherwise run on the
    interpreter, compile for an H100 (sm_90) in the decoration the GPU gets: ``tl.sum`` for the row sum."""
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import JITFunction

    from difftransformer.kernels.triton import epilogue

    if "nvidia" not in backends or DEVICE.type == "cuda":
        pytest.skip("no NVIDIA backend to compile for, or a GPU (where the decode tests run them compiled)")
    if not isinstance(tdt.tl.standard.cdiv, JITFunction):
        pytest.skip("triton was imported with TRITON_INTERPRET=1 set: nothing compiles for a GPU in this process")
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    kernels = epilogue._jitted()
    assert kernels["interpret"] is False and isinstance(epilogue._row_sum, JITFunction)
    strides = {name: "i32" for name in ("s1_b", "s1_g", "s1_r", "s2_b", "s2_g", "s2_r", "groups", "rows")}
    v1 = dict(o1="*bf16", o2="*bf16", w="*fp32", lam="*fp32", out="*bf16", **strides, eps="fp32")
    strides = {name: "i32" for name in ("s_b", "s_g", "s_r", "sz_b", "groups", "blocks")}
    v2 = dict(a="*bf16", z="*fp32", out="*bf16", lam="*fp32", **strides)
    for name, signature, constexprs in (("v1", v1, dict(R=2, WIDTH=128)), ("v2", v2, dict(R=1, WIDTH=64))):
        constexprs["BLOCK"] = constexprs["WIDTH"]
        signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
        compiled = triton_compile(
            ASTSource(kernels[name], signature, constexprs), target=GPUTarget("cuda", 90, 32), options={}
        )
        assert compiled.asm.get("cubin"), name


def test_double_backward_is_refused():
    """The kernels' backward is not differentiable: a second-order gradient raises instead of coming out silently
    wrong."""
    query, key, value, lam = leaf_inputs(1, 16, 16, 1, 1, 1, 16)
    out = tdt.differential_attention_triton(query, key, value, lam, 0.25, 1)
    (grad_q,) = torch.autograd.grad(out.square().sum(), query, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_q.sum().backward()


# ----------------------------------------------------------------------------------------------------------------------
# The kernels as PyTorch custom ops (torch.ops.difftransformer): torch.library's checks and
# torch.compile(fullgraph=True)
# ----------------------------------------------------------------------------------------------------------------------

# GQA factor 2 without a mask; grouped noise heads (r = 2) with a left-padding mask.
OP_CASES = [pytest.param(2, 1, False, id="gqa-n2"), pytest.param(2, 2, True, id="gda-r2-masked")]


def _left_padding_mask(b, t, s):
    """(B, 1, T, S): sequence i starts at key 3·i (a padding query sees no key)."""
    keys_ok = torch.arange(s)[None, :] >= 3 * torch.arange(b)[:, None]
    return keys_ok[:, None, None, :].expand(b, 1, t, s).to(DEVICE)


@pytest.mark.parametrize("n, r, masked", OP_CASES)
def test_opcheck(monkeypatch, n, r, masked):
    """torch.library.opcheck on the three ops, tiny float32 problems (keys crossing two tiles): the schema (no
    mutation, no output aliasing an input), the fake implementations against the real outputs, the autograd
    registration and AOT autograd with dynamic shapes. The forward with statistics takes inputs that require grad;
    the inference op runs a prompt and one decode token (split over two key ranges); the backward op gets the forward's
    statistics."""
    monkeypatch.setitem(tdt._TUNING, "decode", dict(BLOCK_N=16, splits=2))
    b, t, s, g, d = 2, 8, 20, 1, 16
    query, key, value, lam = make_inputs(b, t, s, g, n, r, d)
    mask = _left_padding_mask(b, t, s) if masked else None
    scalars = (d**-0.5, n, r, True)
    grads = tuple(x.clone().requires_grad_() for x in (query, key, value, lam))
    torch.library.opcheck(tdt._OP_FORWARD, (*grads, mask, *scalars))
    torch.library.opcheck(tdt._OP_INFERENCE, (query, key, value, lam, mask, *scalars))
    decode_mask = None if mask is None else mask[:, :, -1:]
    torch.library.opcheck(tdt._OP_INFERENCE, (query[:, -1:], key, value, lam, decode_mask, *scalars))
    out, o2, lse1, lse2 = tdt._OP_FORWARD(query, key, value, lam, mask, *scalars)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    torch.library.opcheck(tdt._OP_BACKWARD, (dout, query, key, value, lam, out, o2, lse1, lse2, mask, *scalars))


@pytest.mark.parametrize("n, r, masked", OP_CASES)
def test_compiled_forward_and_gradients(n, r, masked):
    """differential_attention_triton under torch.compile(fullgraph=True) with inductor (the ops are opaque calls in
    its graph; on a CPU they run the interpreter as eager does): output and gradients of q, k, v and λ within the error
    model against float64, and equal to eager's (the same kernels on the same inputs)."""
    torch._dynamo.reset()
    compiled = torch.compile(tdt.differential_attention_triton, fullgraph=True)
    b, t, s, g, d = 2, 20, 20, 1, 16
    mask = _left_padding_mask(b, t, s) if masked else None
    results = {}
    for name, attention in (("compiled", compiled), ("eager", tdt.differential_attention_triton)):
        query, key, value, lam = leaf_inputs(b, t, s, g, n, r, d)
        out, _ = check_forward_backward(query, key, value, lam, n, r, mask=mask, attention=attention)
        results[name] = (out.detach(), query.grad, key.grad, value.grad, lam.grad)
    torch._dynamo.reset()
    for what, got, ref in zip(("output", "dquery", "dkey", "dvalue", "dlam"), results["compiled"], results["eager"]):
        torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=what)
