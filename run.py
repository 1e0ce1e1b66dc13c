"""CLI entry point: `python run.py --prompt "What is the capital of France?"` (see `--help`)."""

import sys

from lucebox_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
