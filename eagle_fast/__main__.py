"""`python -m eagle_fast ...` is `eagle-fast ...`."""

import sys

from eagle_fast.cli import main

if __name__ == "__main__":
    sys.exit(main())
