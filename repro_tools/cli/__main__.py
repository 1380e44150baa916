"""``python -m repro_tools.cli``: the same as the ``repro-tools`` command."""

import sys

from repro_tools.cli import main

sys.exit(main())
