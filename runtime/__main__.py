"""``python -m runtime`` is the ``batchscope`` command."""

import sys

from runtime.tools.cli import main

sys.exit(main())
