import sys

from pyagent_framework.cli import main

sys.exit(main())
