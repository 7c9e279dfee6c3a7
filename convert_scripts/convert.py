"""``difftransformer-convert`` as a file of the checkout (the command line lives in
:mod:`difftransformer.convert.cli`; ``--help`` explains every option, docs/convert.md the conversions). It imports the
installed package (README's Install: ``pip install -e .``), like the console script.

    python convert_scripts/convert.py --from llama --to difftransformer --diff-version 2 \\
        --input ./my-llama --output ./my-llama-diff-v2 --verify
"""

import sys

from difftransformer.convert.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
