"""`python -m specfire ...` runs the `specfire` command line (for machines without the console script)."""
import sys

from .cli import main

sys.exit(main())
