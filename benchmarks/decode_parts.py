"""What each part of a V2 decode step costs against its source Llama's, timed without a profiler.

A profiler adds time to every operator, and a decode step is hundreds of small ones; this script times the parts
themselves. It builds the Llama and its V2 upcycle as ``bench.py`` does (random weights, SmolLM2's shape by default),
prefills a ``DynamicCache`` for each with a ``--prompt-len`` prompt, and then, for ``--reps`` rounds (each round
times every part of both models, the model order alternating), takes the process CPU time of:

* ``step``: the model's forward of one new token (``logits_to_keep=1``): one greedy decode step of ``generate``;
* ``attention``: every layer's attention module on one token (projections, rotary embeddings, cache, kernel, λ);
* ``q_proj``, ``k_proj + v_proj``, ``o_proj``: every layer's projections;
* ``λ``: every layer's ``sigmoid(lambda_proj(x))`` (V2 only);
* ``kernel``: every layer's attention over its cached keys and values: transformers' sdpa function for the Llama
  (what its attention calls), ``pair_decode_attention`` for the V2 (with V2's pair combine: docs/model.md, "What it
  computes").

Every call that appends a token to the cache is followed, untimed, by cropping it off again, so every round sees the
same cache. Reports per part the median per step (all layers) of each model and the median of the per-round
differences (V2 − Llama) as a share of the Llama's step, with their quartiles. ``--smoke`` runs tiny sizes (CI).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict

import torch
from tqdm.auto import tqdm

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import bench, harness  # noqa: E402

MODELS = ("llama", "upcycle_v2")
PARTS = ("step", "attention", "q_proj", "k_proj + v_proj", "o_proj", "λ", "kernel")


def part_runs(name: str, model, batch: int, prompt_len: int) -> dict[str, Callable[[], float] | None]:
    """The parts of one model's decode step, each a callable timing all layers once (seconds); None where the model
    has no such part (the Llama's λ)."""
    from transformers import DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from difftransformer import CACHE_NAME
    from difftransformer.kernels_difftransformer import pair_decode_attention

    config = model.config
    gen = torch.Generator().manual_seed(0)
    ids = bench._ids(batch, prompt_len, config.vocab_size)
    token = bench._ids(batch, 1, config.vocab_size, seed=2)
    hidden = torch.randn(batch, 1, config.hidden_size, generator=gen)
    position_ids = torch.full((batch, 1), prompt_len)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        model(ids, **{CACHE_NAME: cache}, use_cache=True)
    position_embeddings = model.model.rotary_emb(hidden, position_ids=position_ids)
    attns = [layer.self_attn for layer in model.model.layers]
    kv = [(layer.keys, layer.values) for layer in cache.layers]  # the prompt's, untouched by the cropping below
    query = torch.randn(batch, 1, config.num_attention_heads, config.head_dim, generator=gen)
    lam = torch.rand(batch, 1, config.num_attention_heads // 2, generator=gen)
    combined = torch.randn(batch, 1, attns[0].o_proj.in_features, generator=gen)

    def timed(body, crop: bool = False):
        def run() -> float:
            with torch.no_grad():
                start = harness.now()
                body()
                seconds = harness.now() - start
                if crop:
                    cache.crop(-1)  # back to the prompt
            return seconds
        return run

    def step():
        model(token, **{CACHE_NAME: cache}, use_cache=True, position_ids=position_ids, logits_to_keep=1)

    def attention():
        for a in attns:
            a(hidden_states=hidden, position_embeddings=position_embeddings, attention_mask=None, **{CACHE_NAME: cache})

    if name == "llama":
        heads = query.transpose(1, 2)

        def kernel():
            for a, (k, v) in zip(attns, kv):
                sdpa_attention_forward(a, heads, k, v, None, dropout=0.0, scaling=a.scaling)
        lam_part = None
    else:
        def kernel():
            for a, (k, v) in zip(attns, kv):
                pair_decode_attention(query, k, v, lam, a.scaling)

        def lam_part():
            for a in attns:
                torch.sigmoid(a.lambda_proj(hidden))

    return {
        "step": timed(step, crop=True),
        "attention": timed(attention, crop=True),
        "q_proj": timed(lambda: [a.q_proj(hidden) for a in attns]),
        "k_proj + v_proj": timed(lambda: [(a.k_proj(hidden), a.v_proj(hidden)) for a in attns]),
        "o_proj": timed(lambda: [a.o_proj(combined) for a in attns]),
        "λ": None if lam_part is None else timed(lam_part),
        "kernel": timed(kernel),
    }


def measure(shape: bench.Shape, batch: int, prompt_len: int, reps: int, warmup: int) -> dict:
    """Per part: each model's samples and median (s), and the per-round V2 − Llama differences as a share of the
    Llama's median step."""
    models = {name: bench.build_model(name, shape) for name in MODELS}
    runs = {name: part_runs(name, model, batch, prompt_len) for name, model in models.items()}
    samples = {name: {part: [] for part in PARTS} for name in MODELS}
    with tqdm(total=(reps + warmup) * len(PARTS), desc="decode parts", unit="part") as progress:
        for rnd in range(warmup + reps):
            for part in PARTS:
                for name in (MODELS if rnd % 2 == 0 else MODELS[::-1]):
                    run = runs[name][part]
                    seconds = run() if run is not None else 0.0
                    if rnd >= warmup:
                        samples[name][part].append(seconds)
                progress.update(1)
    base_step = statistics.median(samples["llama"]["step"])
    parts = {}
    for part in PARTS:
        llama, v2 = samples["llama"][part], samples["upcycle_v2"][part]
        extra = [(b - a) / base_step for a, b in zip(llama, v2)]
        q1, q3 = harness.quartiles(extra)
        parts[part] = {"llama_s": statistics.median(llama), "upcycle_v2_s": statistics.median(v2),
                       "extra_share": statistics.median(extra), "extra_quartiles": [q1, q3],
                       "samples": {"llama": llama, "upcycle_v2": v2}}
    step_ratio, _ = harness.paired(samples["upcycle_v2"]["step"], samples["llama"]["step"])
    return {"parts": parts, "step_ratio": step_ratio}


def format_table(result: dict) -> str:
    rows = ["| part (all layers, one token) | llama ms | upcycle_v2 ms | V2 − Llama, % of the Llama's step "
            "[quartiles] |", "|---|---|---|---|"]
    for part, r in result["parts"].items():
        llama = f"{r['llama_s'] * 1e3:.2f}" if r["llama_s"] else "–"
        q1, q3 = r["extra_quartiles"]
        rows.append(f"| {part} | {llama} | {r['upcycle_v2_s'] * 1e3:.2f} | {100 * r['extra_share']:+.1f} "
                    f"[{100 * q1:+.1f} to {100 * q3:+.1f}] |")
    rows.append(f"\nstep ratio (median of the per-round ratios): {result['step_ratio']:.3f}")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " Shape: SmolLM2-135M's.")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded at once (default 1)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens in the cache (default 128)")
    p.add_argument("--reps", type=int, default=200, help="timed rounds (default 200)")
    p.add_argument("--warmup", type=int, default=10, help="untimed rounds first (default 10)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 2 rounds: every path runs in seconds (CI)")
    p.add_argument("--json", default="benchmarks/results/decode_parts_smollm2_t1.json",
                   help="where to write the result ('' for nowhere)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    harness.set_clock("cpu")  # process CPU time
    shape, prompt_len, reps, warmup = bench.SMOLLM2, args.prompt_len, args.reps, args.warmup
    if args.smoke:
        shape, prompt_len, reps, warmup = bench.smoke_plan_and_shape()[1], 8, 2, 1
    result = {"machine": harness.machine_info(args.threads), "shape": asdict(shape), "batch": args.batch,
              "prompt_len": prompt_len, "reps": reps, **measure(shape, args.batch, prompt_len, reps, warmup)}
    table = format_table(result)
    result |= {"table": table, "provenance": harness.provenance("decode_parts.py", argv)}
    print(table)
    if args.json:
        harness.write_json(args.json, result, "decode_parts.py", argv)
    return result


if __name__ == "__main__":
    main()
