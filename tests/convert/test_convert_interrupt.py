"""A conversion interrupted by a signal (docs/convert.md): Ctrl-C (SIGINT) or SIGTERM (a cancelled job, ``timeout``,
``kill``) while the temporary folder is written, while it is swapped in for the previous output, or while the previous
output's backup is removed leaves no hidden folder beside ``--output``, and ``--output`` holds either the previous
model untouched or the new one complete; folders left by a run killed outright (SIGKILL) are removed by the next run.

Each case is a real process that converts a tiny Llama with the command line (``--overwrite``) over a previous
conversion and gets a real signal at the chosen point: a Python audit hook (``sys.addaudithook``, which observes and
changes nothing) sends the signal to its own process with ``os.kill`` at the first file opened in the temporary folder
(writing), at the rename of the temporary folder onto ``--output`` (swapping: the previous output is then already set
aside), or at the first file removed from the backup (removing). One driver process (this file run as a script) imports
the package once and forks a process per case, so the whole module costs one import and a few tiny conversions."""

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

PHASES = ("writing", "swapping", "removing")
SIGNALS = ("SIGINT", "SIGTERM")
INTERRUPTED = 130  # the command's exit status after Ctrl-C (as a shell reports a process that SIGINT ended)

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the interrupted processes are forked (POSIX only)")


def tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with the sha256 of its bytes; the remote-code files (``*.py``, copies of the
    package's source as it is on disk at the time) by name only."""
    return {
        str(p.relative_to(folder)): "" if p.suffix == ".py" else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------------------------------------------- the driver


def _interrupted_child(src: Path, out: Path, phase: str, signum: int) -> None:
    """Convert ``src`` over ``out`` with the command line and send ``signum`` to this process at ``phase``; exit with
    the command's status (never returns)."""
    from difftransformer.convert.cli import main

    fired, armed = [], []

    def hook(event, args):
        if fired:
            return
        path = str(args[0]) if args else ""
        at = (
            (phase == "writing" and event == "open" and f".{out.name}.converting-" in path)
            or (phase == "swapping" and event == "os.rename" and f".{out.name}.converting-" in path)
            or (phase == "removing" and armed and event == "os.remove")
        )
        if phase == "removing" and event == "shutil.rmtree" and f".{out.name}.old-" in path:
            armed.append(path)
        if at:
            fired.append(event)
            os.kill(os.getpid(), signum)

    sys.addaudithook(hook)
    argv = ["--from", "llama", "--diff-version", "2", "--input", str(src), "--output", str(out), "--overwrite"]
    try:
        status = main([*argv, "--no-progress"])
    except BaseException:  # e.g. a KeyboardInterrupt that escaped the command
        traceback.print_exc()
        os._exit(3)
    os._exit(status if fired else 4)  # 4: the chosen point was never reached


def _drive(work: Path) -> None:
    """Write a tiny Llama, its V2 conversion in bfloat16 ("previous") and in float32 ("new"), then run every case in a
    forked process over a copy of "previous"; write each case's exit status (negative: the signal that ended it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from difftransformer.convert import convert

    torch.set_num_threads(1)
    # The dispositions of an interactive program (a shell's background job starts with SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64)  # fmt: skip
    src = work / "llama"
    LlamaForCausalLM(cfg).save_pretrained(src)
    convert("llama", src, work / "previous", diff_version=2, dtype="bfloat16", progress=False)
    convert("llama", src, work / "new", diff_version=2, dtype="float32", progress=False)
    statuses = {}
    for case in [f"{phase}-{sig}" for phase in PHASES for sig in SIGNALS] + ["writing-SIGKILL"]:
        phase, sig = case.split("-")
        shutil.copytree(work / "previous", work / case / "out")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _interrupted_child(src, work / case / "out", phase, getattr(signal, sig))
        statuses[case] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    (work / "statuses.json").write_text(json.dumps(statuses))


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    work = tmp_path_factory.mktemp("interrupted")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, __file__, str(work)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return work, json.loads((work / "statuses.json").read_text()), run.stderr


# ---------------------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("phase", PHASES)
def test_an_interrupted_conversion_leaves_one_complete_output_and_nothing_else(interrupted, phase, sig):
    """Interrupted while writing, the previous output stays as it was; from the swap on, the swap and the backup's
    removal finish first and the signal takes effect after them: the new output is complete. Either way nothing else
    is left beside it, and the command still ends by the signal (SIGTERM) or says it was interrupted (SIGINT: exit
    status 130)."""
    work, statuses, stderr = interrupted
    case = work / f"{phase}-{sig}"
    expected_status = -signal.SIGTERM if sig == "SIGTERM" else INTERRUPTED
    assert statuses[case.name] == expected_status, (statuses, stderr)
    assert sorted(os.listdir(case)) == ["out"]  # no temporary folder, no backup, no partial copy of either
    expected = "previous" if phase == "writing" else "new"
    assert tree(work / "previous") != tree(work / "new")
    assert tree(case / "out") == tree(work / expected)


def test_a_later_run_removes_what_a_killed_run_left_and_says_so(interrupted, caplog):
    """SIGKILL cannot be caught: the killed run leaves its temporary folder, named with its host and process id. The
    next conversion to the same output removes it and logs its name; folders of a process still running (here the
    test's parent) or of another host, and other outputs' folders, are left alone."""
    from difftransformer.convert import convert

    work, statuses, _ = interrupted
    case = work / "writing-SIGKILL"
    assert statuses[case.name] == -signal.SIGKILL
    assert tree(case / "out") == tree(work / "previous")
    (left,) = [name for name in os.listdir(case) if name != "out"]
    assert re.fullmatch(r"\.out\.converting-.+", left)
    host = re.sub(r"[^A-Za-z0-9.]+", "_", socket.gethostname())
    kept = [
        f".out.converting-{host}-{os.getppid()}-abcdefgh",  # a live process's folder
        f".out.old-another.host-{os.getpid() + 1}-abcdefgh",  # another machine's
        f".other.converting-{host}-999999999-abcdefgh",  # another output's
    ]
    for name in kept:
        (case / name).mkdir()
    with caplog.at_level(logging.WARNING, logger="difftransformer.convert"):
        convert("llama", work / "llama", case / "out", diff_version=2, overwrite=True, progress=False)
    assert sorted(os.listdir(case)) == sorted(["out", *kept])
    assert tree(case / "out") == tree(work / "new")
    assert any(left in r.getMessage() and "earlier conversion" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]


if __name__ == "__main__":
    _drive(Path(sys.argv[1]))
