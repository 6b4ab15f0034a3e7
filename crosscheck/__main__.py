"""`python -m crosscheck`: see crosscheck._cli (and `python -m crosscheck --help`)."""

import sys

from crosscheck._cli import main

if __name__ == "__main__":
    sys.exit(main())
