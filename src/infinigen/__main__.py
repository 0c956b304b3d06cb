"""`python -m infinigen ...`: the `infinigen` command, where its script is not on PATH."""

import sys

from infinigen.cli import main

if __name__ == "__main__":
    sys.exit(main())
