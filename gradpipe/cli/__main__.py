"""``python -m gradpipe.cli``: the ``gradpipe`` command."""

import sys

from gradpipe.cli._app import main

sys.exit(main())
