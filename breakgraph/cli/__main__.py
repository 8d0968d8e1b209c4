"""``python -m breakgraph.cli``: the ``breakgraph`` command."""

import sys

from breakgraph.cli import main

sys.exit(main())
