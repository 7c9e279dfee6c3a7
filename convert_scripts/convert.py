"""``difftransformer-convert`` from a checkout, without installing the package (the command line lives in
:mod:`difftransformer.convert.cli`; ``--help`` explains every option, docs/convert.md the conversions).

    python convert_scripts/convert.py --from llama --to difftransformer --diff-version 2 \\
        --input ./my-llama --output ./my-llama-diff-v2 --verify
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from difftransformer.convert.cli import build_parser, main  # noqa: E402

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
