"""Saved folders run as remote code, in a fresh interpreter where ``import difftransformer`` fails: the folder's own
code is all there is (greedy tokens with and without the cache)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

NEW_TOKENS = 8

# Runs in a fresh interpreter where `import difftransformer` fails: the folder's own code is all there is. Its argument
# is a JSON list of [folder, prompt ids] pairs (one interpreter for all of a test's folders: each start costs seconds).
REMOTE_GENERATE = textwrap.dedent(
    """
    import json, sys, torch
    sys.modules["difftransformer"] = None
    from transformers import AutoModelForCausalLM
    results = []
    for folder, ids in json.loads(open(sys.argv[1]).read()):
        ids = torch.tensor(ids)
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        model.generation_config.eos_token_id = None
        out = {}
        for name, kwargs in {"cached": {}, "uncached": {"use_cache": False}}.items():
            seq = model.generate(ids, max_new_tokens=%d, do_sample=False, pad_token_id=0, **kwargs)
            out[name] = seq[:, ids.shape[1]:].tolist()
        results.append(out)
    print("RESULT " + json.dumps(results))
    """
    % NEW_TOKENS
)


def remote_generate_all(jobs: list[tuple[Path, torch.Tensor]], tmp_path: Path) -> list[dict]:
    """Greedy tokens of each folder loaded as remote code, in one process without the package: cached and
    uncached, per (folder, ids) job."""
    script, job_file = tmp_path / "remote_generate.py", tmp_path / "remote_generate_jobs.json"
    script.write_text(REMOTE_GENERATE)
    job_file.write_text(json.dumps([[str(folder), ids.tolist()] for folder, ids in jobs]))
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(script), str(job_file)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stdout + result.stderr
    return json.loads(lines[-1].removeprefix("RESULT "))


def remote_generate(folder: Path, ids: torch.Tensor, tmp_path: Path) -> dict:
    """:func:`remote_generate_all` for one folder."""
    return remote_generate_all([(folder, ids)], tmp_path)[0]
