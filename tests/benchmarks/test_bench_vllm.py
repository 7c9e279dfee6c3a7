"""The FLOP floors benchmarks/bench_vllm.py reports for DIFF V1 in vLLM (docs/serving.md states the arithmetic): V1's
math costs what a Llama with the same query heads and head width costs in attention, and the padded single call of the
native vLLM model adds exactly ``4·Hq·d`` FLOPs per layer, query token and visible key, counted here token by token.
(bench_vllm.py itself needs vLLM: it runs in .venv-vllm; this file imports only its arithmetic.)"""

from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]

from benchmarks.bench import forward_flops, generation_flops  # noqa: E402
from benchmarks.bench_vllm import padded_call_extra_flops  # noqa: E402

SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, vocab_size=49152, head_dim=64)


def config(hq: int, hkv: int, version: int | None, **overrides) -> SimpleNamespace:
    return SimpleNamespace(
        **{**SMOLLM2, **overrides}, num_attention_heads=hq, num_key_value_heads=hkv, diff_version=version
    )


def padded_attention_flops_counted(cfg, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """(V1's math, the padded call): attention matmul FLOPs of one request, every query token and layer counted."""
    hq, d, layers = cfg.num_attention_heads, cfg.head_dim, cfg.num_hidden_layers
    math_flops = padded = 0.0
    positions = list(range(prompt_len)) + [prompt_len + j for j in range(new_tokens - 1)]
    for position in positions:  # the prompt's tokens, then one decoding step per further token
        keys = position + 1
        math_flops += 2 * hq * d * keys + 2 * (hq // 2) * (2 * d) * keys  # Hq d-wide scores; H products (A1-λA2)·V
        padded += 2 * hq * (2 * d) * keys + 2 * hq * (2 * d) * keys  # Hq 2d-wide scores; Hq products A_c·[V1; V2]
    return layers * math_flops, layers * padded


def test_padded_call_extra_flops_counted_token_by_token():
    for hq, hkv, prompt_len, new_tokens in ((18, 6, 128, 64), (8, 8, 5, 1), (12, 4, 7, 9)):
        cfg = config(hq, hkv, 1)
        math_flops, padded = padded_attention_flops_counted(cfg, prompt_len, new_tokens)
        assert padded == 2 * math_flops  # the zero halves double the attention arithmetic, nothing else
        extra = padded_call_extra_flops(cfg, prompt_len, new_tokens)
        assert abs(extra - (padded - math_flops)) <= 1e-9 * padded, (hq, hkv, prompt_len, new_tokens)


def test_v1_math_attention_costs_a_llama_with_the_same_query_heads():
    """forward_flops (bench.py) of V1 minus its projections equals a Llama's with the same Hq, Hkv, d, o_proj width:
    the floor that bench_vllm.py calls V1's math."""
    v1, llama = config(18, 6, 1), config(18, 6, None)
    assert forward_flops(v1, 128, 1) == forward_flops(llama, 128, 1)
    assert generation_flops(v1, 128, 64) == generation_flops(llama, 128, 64)


def test_smollm2_floors_quoted_in_docs():
    """The SmolLM2 floors docs/serving.md quotes for 128 + 64 tokens: V2 upcycle 1.113, V1 upcycle (duplicated: 18
    query and 6 KV half-heads) 1.251, its padded call 1.307."""
    llama, v2, v1 = config(9, 3, None), config(18, 3, 2), config(18, 6, 1)
    base = generation_flops(llama, 128, 64)
    assert round(generation_flops(v2, 128, 64) / base, 3) == 1.113
    assert round(generation_flops(v1, 128, 64) / base, 3) == 1.251
    assert round((generation_flops(v1, 128, 64) + padded_call_extra_flops(v1, 128, 64)) / base, 3) == 1.307


def test_recorded_command_names_the_allocator_settings(monkeypatch):
    """A run under glibc's malloc tunables (docs/serving.md measures V1 with and without them) records them in its
    command, so the line under its table re-runs it as it ran; unset, the command is plain. What counts is the
    environment the benchmark started in, not what a library set later (vLLM's CPU platform sets LD_PRELOAD)."""
    from benchmarks import harness

    plain = harness.command_line(["--compile"], "benchmarks/bench_vllm.py", env={})
    assert plain == "python benchmarks/bench_vllm.py --compile"
    started = harness.measured_env(
        {
            "MALLOC_MMAP_THRESHOLD_": "268435456",
            "MALLOC_TRIM_THRESHOLD_": "1073741824",
            "HOME": "/root",
            "GLIBC_TUNABLES": "",
        }
    )
    assert harness.command_line(["--compile"], "benchmarks/bench_vllm.py", env=started) == (
        "MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824 " + plain
    )
    monkeypatch.setattr(harness, "STARTUP_ENV", {})
    monkeypatch.setenv("LD_PRELOAD", "/somewhere/libgomp.so.1")  # set after start: not part of the command
    assert harness.command_line(["--compile"], "benchmarks/bench_vllm.py") == plain
