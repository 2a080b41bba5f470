"""`python -m qurl ...`: the same command line as the `qurl` script (qurl/cli.py)."""
import sys

from qurl.cli import main

sys.exit(main())
