"""`python -m floe.cli`: the `floe` command."""

import sys

try:
    from floe.cli import run
except KeyboardInterrupt:  # a Ctrl-C while the command's own modules load: as one later (floe.cli.run)
    print("floe: interrupted", file=sys.stderr)
    sys.exit(130)

run()
