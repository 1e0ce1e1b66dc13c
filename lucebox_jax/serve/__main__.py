"""`python -m lucebox_jax.serve [--host ...] [--port ...] [--model ...] ...`: the same as `python run.py --serve`."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["--serve", *sys.argv[1:]]))
