"""`python -m specjax.cli`."""

import sys

from specjax.cli import main

sys.exit(main())
