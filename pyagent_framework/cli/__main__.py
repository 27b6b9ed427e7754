"""``python -m pyagent_framework.cli``: the ``pyagent`` command."""

import sys

from pyagent_framework.cli import main

sys.exit(main())
