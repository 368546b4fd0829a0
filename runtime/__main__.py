"""``python -m runtime`` is the ``batchscope`` command."""

import sys

from runtime.cli import main

sys.exit(main())
