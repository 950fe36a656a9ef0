"""python -m kvflow {generate, chat} ..."""

import sys

from kvflow.entrypoints.cli import main

sys.exit(main())
