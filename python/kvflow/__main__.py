"""python -m kvflow {generate, chat, serve, bench, env} ..."""

import sys

from kvflow.entrypoints.cli import main

sys.exit(main())
