"""`python -m crosscheck`: see crosscheck._cli.main (and `python -m crosscheck --help`)."""

import sys

from crosscheck._cli.main import main

if __name__ == "__main__":
    sys.exit(main())
