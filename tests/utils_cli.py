"""What a command-line process prints itself, apart from what importing its libraries prints.

Some installed packages warn on import (torchao, whose quantizer transformers' ``modeling_utils`` probes, cannot load
its CUDA extensions on a CPU machine; torch's pytree registry; bitsandbytes' optional kernels): lines that any
transformers program in the same environment prints first, whatever it does. A test of a command's own output (one
error line, no traceback) compares what the command printed beyond them: the lines that importing the command's
module alone prints in the same environment, once per session.
"""

import functools
import os
import re
import subprocess
import sys

# torch's and absl's log prefix: level letter, MMDD, time, process id (they differ between processes); and paths up to
# site-packages/ (absolute or relative to the working directory, as the logger prints them)
_LOG_PREFIX = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")
_SITE_PACKAGES = re.compile(r"\S*site-packages/")


def _normalised(line: str) -> str:
    return _SITE_PACKAGES.sub("", _LOG_PREFIX.sub("", line.strip()))


@functools.lru_cache(maxsize=None)
def import_noise(module: str) -> frozenset[str]:
    """The stderr lines (log prefixes removed) of ``python -c "import <module>"`` in this environment."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return frozenset(_normalised(line) for line in out.stderr.splitlines() if line.strip())


def own_stderr_lines(stderr: str, module: str = "difftransformer.convert.cli") -> list[str]:
    """The non-empty lines of ``stderr`` that importing ``module`` alone does not print."""
    noise = import_noise(module)
    return [line for line in stderr.strip().splitlines() if line.strip() and _normalised(line) not in noise]
