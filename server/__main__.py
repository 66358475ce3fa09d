"""`python -m server ARGS` is `rnnserve ARGS` (rnnserve_cli.py)."""

import sys

from rnnserve_cli import main

if __name__ == "__main__":  # not when an engine process (spawned) imports this module as its parent's main
    raise SystemExit(main(sys.argv[1:]))
