"""V2's prompt attention on CPU: transformers' sdpa call against the modeling file's causal block path.

    python benchmarks/v2_prompt_attention.py --threads 1 --clock cpu          # SmolLM2's V2 shape, 128-2048 tokens
    python benchmarks/v2_prompt_attention.py --smoke                          # tiny sizes, one repetition

A DIFF V2 layer is standard causal attention over its 2H query heads (then the λ combine). For one square float32
prompt (prefill, and the forward + backward of training) this times, per call:

* ``sdpa``   transformers' ``sdpa_attention_forward`` (what a Llama runs: the KV heads repeated to the query heads, one
  causal ``scaled_dot_product_attention`` call);
* ``blocks<b>`` ``causal_block_attention`` of kernels_difftransformer.py with blocks of ``b`` query rows (per block one
  causal flash call on the diagonal square and one unmasked call on the keys before it, merged by log-sum-exp),
  whatever the length, for each ``b`` of ``--blocks`` (default: the modeling file's block size). The modeling file
  takes it from ``CAUSAL_BLOCK_MIN_LENGTH`` tokens on; these rows justify both numbers.

Both are first checked against float64 causal attention (output, and the query/key/value gradients for ``train``).
Timing, medians and spread from benchmarks/harness.py, as in attention_micro.py (strategies interleaved, order rotated
every repetition).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from tqdm.auto import tqdm
from transformers.integrations.sdpa_attention import sdpa_attention_forward

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness  # noqa: E402
from benchmarks.attention_micro import _KernelModule, set_clock  # noqa: E402
from difftransformer import kernels_difftransformer as kernels  # noqa: E402

TOLERANCE = 1e-5  # largest error relative to max |float64 reference|: float32 rounding of softmax sums over ≤ 2048 keys


def make_inputs(batch, length, heads, kv_heads, head_dim, seed=0):
    """``query`` ``(B, Hq, T, d)`` as a view of the ``(B, T, Hq, d)`` projection (the module's layout), ``key`` and
    ``value`` ``(B, G, T, d)``; N(0, 1), so the scores ``q·k/√d`` are N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, length, heads, head_dim, generator=gen).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, length, head_dim, generator=gen) for _ in range(2))
    return query, key, value


def strategies(heads, kv_heads, scaling, blocks=(None,)):
    """``sdpa`` and one ``blocks<b>`` per block size ``b`` (None: the modeling file's)."""
    module = _KernelModule(heads // kv_heads)
    fns = {"sdpa": lambda q, k, v: sdpa_attention_forward(module, q, k, v, None, scaling=scaling)[0].transpose(1, 2)}
    for block in blocks:
        block = block or kernels._CAUSAL_BLOCK
        fns[f"blocks{block}"] = lambda q, k, v, block=block: kernels.causal_block_attention(q, k, v, scaling, block)
    return fns


def check(fn, inputs, train: bool) -> float:
    """Largest error of ``fn`` (output, and gradients when ``train``) relative to the float64 reference's largest value."""
    q, k, v = (x.detach().clone().requires_grad_(train) for x in inputs)
    q64, k64, v64 = (x.detach().double().requires_grad_(train) for x in inputs)
    reps = q.shape[1] // k.shape[1]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q64, k64.repeat_interleave(reps, 1), v64.repeat_interleave(reps, 1), is_causal=True, scale=q.shape[-1] ** -0.5)
    out = fn(q, k, v)
    errors = [(out.double() - ref).abs().max() / ref.abs().max()]
    if train:
        grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        out.backward(grad.float())
        ref.backward(grad)
        errors += [(x.grad.double() - x64.grad).abs().max() / x64.grad.abs().max() for x, x64 in ((q, q64), (k, k64), (v, v64))]
    return max(e.item() for e in errors)


def call(fn, inputs, train: bool):
    if not train:
        def forward():
            with torch.no_grad():
                fn(*inputs)
        return forward
    q, k, v = (x.detach().clone().requires_grad_() for x in inputs)
    grad = torch.ones(q.shape)

    def step():
        fn(q, k, v).backward(grad)
        q.grad = k.grad = v.grad = None
    return step


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    set_clock(args.clock)
    rows = []
    cases = [(phase, t) for phase in args.phase.split(",") for t in args.lengths]
    with tqdm(total=len(cases) * args.reps, desc="v2 prompt attention", disable=args.smoke) as bar:
        for phase, length in cases:
            train = phase == "train"
            inputs = make_inputs(args.batch, length, args.heads, args.kv_heads, args.head_dim)
            fns = strategies(args.heads, args.kv_heads, args.head_dim**-0.5, args.blocks)
            errors = {name: check(fn, inputs, train) for name, fn in fns.items()}
            bad = {name: e for name, e in errors.items() if not e <= TOLERANCE}
            if bad:
                raise SystemExit(f"{phase} T={length}: error against float64 above {TOLERANCE}: {bad}")
            samples = harness.time_interleaved({name: call(fn, inputs, train) for name, fn in fns.items()}, args.reps,
                                               min_seconds=args.min_time, progress=bar)
            stats = {name: harness.call_stats(s) for name, s in samples.items()}
            ratios = {name: stats[name]["median_s"] / stats["sdpa"]["median_s"] for name in fns if name != "sdpa"}
            rows.append({"phase": phase, "length": length, "rel_err": errors, "stats": stats, "over_sdpa": ratios,
                         "modeling_file_uses_blocks": length >= kernels.CAUSAL_BLOCK_MIN_LENGTH})
    return {"benchmark": "v2_prompt_attention", "machine": harness.machine_info(torch.get_num_threads()),
            "shape": {"batch": args.batch, "query_heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
            "settings": {"reps": args.reps, "clock": args.clock, "threads": args.threads, "dtype": "float32",
                         "modeling_file_block": kernels._CAUSAL_BLOCK,
                         "modeling_file_min_length": kernels.CAUSAL_BLOCK_MIN_LENGTH},
            "results": rows}


def format_table(report: dict) -> str:
    names = [n for n in report["results"][0]["stats"] if n != "sdpa"]
    head = "| phase | tokens | sdpa ms | " + " | ".join(f"{n} ms | {n} / sdpa" for n in names) + " | modeling file uses blocks |"
    lines = [head, "|" + "---|" * (4 + 2 * len(names))]
    for r in report["results"]:
        s = r["stats"]
        cells = [f"{s[n]['median_s'] * 1e3:.2f} ±{s[n]['iqr']:.0%} | {r['over_sdpa'][n]:.2f}" for n in names]
        lines.append(f"| {r['phase']} | {r['length']} | {s['sdpa']['median_s'] * 1e3:.2f} ±{s['sdpa']['iqr']:.0%} | "
                     + " | ".join(cells) + f" | {'yes' if r['modeling_file_uses_blocks'] else 'no'} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 256, 384, 512, 768, 1024, 2048],
                   help="comma-separated prompt lengths (default 128,256,384,512,768,1024,2048)")
    p.add_argument("--phase", default="prefill,train", help="comma-separated: prefill (forward), train (forward + backward)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=18, help="query heads, 2H (default 18: SmolLM2's V2 upcycle)")
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads (default 3)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")], default=[None],
                   help=f"comma-separated query rows per block, one strategy each (default: the modeling file's, "
                        f"{kernels._CAUSAL_BLOCK})")
    p.add_argument("--reps", type=int, default=11, help="timed repetitions; medians reported (default 11)")
    p.add_argument("--min-time", type=float, default=0.02, help="seconds per timing sample (default 0.02)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"), help="wall (default) or this thread's CPU time")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition (CI)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    if args.smoke:
        args.lengths, args.heads, args.kv_heads, args.head_dim, args.blocks, args.reps, args.min_time = [40], 4, 2, 16, [16], 1, 0.0
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = run(args) | {"provenance": harness.provenance("v2_prompt_attention.py", argv)}
    print(format_table(report))
    print("machine:", report["machine"])
    if args.json:
        harness.write_json(args.json, report, "v2_prompt_attention.py", argv)
    return report


if __name__ == "__main__":
    main()
