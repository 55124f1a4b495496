"""The ``gradpipe`` command: one module per command group, assembled in :mod:`._app`.

Every command has ``--help``; ``--json`` prints one JSON object on stdout.
Exit status: 0 success, 1 when some input or stored object failed, 2 for
usage errors (bad arguments, URLs, names or paths, a store that is not there).

Importing this package loads no numpy, dask or distributed: each command
imports what it needs when it runs.
"""

from gradpipe.cli._app import COMMAND_GROUPS, build_parser, main

__all__ = ["COMMAND_GROUPS", "build_parser", "main"]
