"""`python -m coordinator ...` is the same as the `kvrc` console script."""

import sys

from coordinator.edges.cli import main

sys.exit(main())
