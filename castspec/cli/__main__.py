"""python -m castspec.cli: the same as the castspec command."""

import sys

from castspec.cli import main

sys.exit(main())
