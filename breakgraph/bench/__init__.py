"""The benchmarks behind ``breakgraph bench BENCH`` (args.py lists them and their flags): each
prints its table with ratios against a reference measured in the same run, and writes its
results with ``--json`` (and ``--plot``) wherever the user asks, not into the tree."""
