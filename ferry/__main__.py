"""`python -m ferry ...`, the same as the `ferry` script (tests and `ferry bench serve` start servers this way)."""

import sys

from ferry.cli import main

# Guarded like any main module: importing it must not run the command line.
if __name__ == "__main__":
    sys.exit(main())
