"""``python -m runtime.tools.cli``: the ``batchscope`` command."""

import sys

from runtime.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
