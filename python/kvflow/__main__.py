"""python -m kvflow {generate, chat, serve, bench} ..."""

import sys

from kvflow.entrypoints.cli import main

sys.exit(main())
