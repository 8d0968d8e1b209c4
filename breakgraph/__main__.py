"""``python -m breakgraph``: the ``breakgraph`` command."""

import sys

from breakgraph.cli.main import main

sys.exit(main())
