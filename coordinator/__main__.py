"""`python -m coordinator ...` is the same as the `kvrc` console script (both sides:
`serve`, `status`, ... and `engine`, `demo`, `route`)."""

import sys

from kvrc.cli import main

sys.exit(main())
