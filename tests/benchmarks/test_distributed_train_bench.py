"""benchmarks/distributed_train.py counts what each engine holds per rank, and its report renders from its JSON.

One smoke run (tiny models, 2 CPU ranks, one round of two steps) under one process, FSDP2 and, where DeepSpeed is
installed, ZeRO-3: the memory it reports is the arithmetic of each engine (FSDP2 and ZeRO-3 hold half of every
parameter per rank, up to the padding of a shard to whole rows; AdamW keeps two moments per parameter; ZeRO-3 adds a
float32 master copy of the rank's partition), equal across the three parameter-matched models' own counts. No timing
is asserted: step times are the benchmark's output.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is unavailable",
)

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed_train") / "result.json"
    engines = "single,fsdp2" + (",zero3" if HAS_DEEPSPEED else "")
    cmd = [sys.executable, "-m", "benchmarks.distributed_train", "--smoke", "--engines", engines, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_per_rank_memory_of_one_process_and_fsdp2_is_their_arithmetic(smoke):
    engines = smoke["engines"]
    for name, count in smoke["meta"]["parameters"].items():
        one = engines["single"]["summary"][name]["memory"]
        assert one == {"parameters": 4 * count, "gradients": 4 * count, "optimizer": 8 * count}, name
        sharded = engines["fsdp2"]["summary"][name]["memory"]
        # half of every tensor, a shard padded to whole rows (at most one row of each parameter more)
        assert 2 * count <= sharded["parameters"] <= 2 * count + 4 * 1024, name
        assert sharded["optimizer"] == 2 * sharded["parameters"] and sharded["gradients"] == sharded["parameters"]
    assert len(engines["single"]["ranks"]) == 1 and len(engines["fsdp2"]["ranks"]) == 2


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (pip install deepspeed)")
def test_per_rank_memory_of_zero3_is_its_arithmetic(smoke):
    for name, count in smoke["meta"]["parameters"].items():
        zero = smoke["engines"]["zero3"]["summary"][name]["memory"]
        assert 2 * count <= zero["parameters"] <= 2 * count + 4 * 1024, name  # its partition
        assert zero["gradients"] is None  # freed in ZeRO-3's step: nothing held between steps
        assert zero["optimizer"] == 3 * zero["parameters"], name  # two moments and the float32 master copy
    assert len(smoke["engines"]["zero3"]["ranks"]) == 2


def test_report_renders_a_row_per_engine_and_model(smoke):
    from benchmarks.distributed_train import doc_table

    lines = doc_table([smoke], {})
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| engine")]
    assert len(rows) == len(smoke["engines"]) * 3
    assert all(row.count("|") == 8 for row in rows)
    assert sum("(the reference)" in row for row in rows) == len(smoke["engines"])
