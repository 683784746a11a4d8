"""`python -m lighthouse`: the same as the `torchft-lighthouse` command."""

import sys

from lighthouse.cli import main

sys.exit(main())
