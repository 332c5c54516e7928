"""`python -m coordinator ...` is the same as the `kvrc` console script."""

import sys

from coordinator.cli import main

sys.exit(main())
