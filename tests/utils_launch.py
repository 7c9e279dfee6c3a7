"""Launching multi-process jobs from tests: torchrun on CPU processes under a timeout that kills every rank.

torchrun starts its ranks in sessions of their own, so killing torchrun (what `subprocess.run(timeout=...)` does)
leaves the ranks running and holding the output pipes, and the test then waits for them forever. `launch` kills the
whole process tree instead, and `check` fails with the ranks' output.
"""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil


def launch(script: Path, *args: str, cwd: Path, nproc: int = 2, timeout: int = 180) -> subprocess.CompletedProcess:
    """`torchrun --standalone` on `nproc` CPU processes; when `timeout` runs out, torchrun and every process under it
    are killed (its ranks run in sessions of their own, so killing torchrun's process group would not reach them).
    Returns the finished process (stdout, stderr; return code None when killed) whether it succeeded or not."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]
    proc = subprocess.Popen([*cmd, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        launcher = psutil.Process(proc.pid)
        for process in [*launcher.children(recursive=True), launcher]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        stdout, stderr = proc.communicate()
        returncode = None
    return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Fail with the ranks' output unless the job ended by itself with status 0."""
    what = "timed out (killed)" if proc.returncode is None else f"failed with status {proc.returncode}"
    assert proc.returncode == 0, f"{' '.join(proc.args)} {what}:\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    return proc


def last_json_line(text: str) -> dict:
    """The last line of a job's output that is a JSON object (what the example scripts print on rank 0)."""
    return json.loads(next(line for line in reversed(text.splitlines()) if line.startswith("{")))
