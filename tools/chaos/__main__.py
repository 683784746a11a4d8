"""Entry point of `python -m tools.chaos`."""

import sys

from tools.chaos.cli import main

sys.exit(main())
