"""`python -m server ARGS` is `rnnserve ARGS` (rnnserve_cli.py)."""

import sys

from rnnserve_cli import main

raise SystemExit(main(sys.argv[1:]))
