"""`python -m kvrc ...` is the `kvrc` console script."""

import sys

from kvrc.cli import main

sys.exit(main())
