"""Tensor parallelism across processes: rank 0 (the engine) drives ranks 1..N-1 (workers).

Rank 0 runs the scheduler. Before each forward its ModelRunner sends every worker one small
message (``wire.StepMessage``: the step's lengths, slots, table rows, the request-table
writes made since the last step and the step's graph key; a fixed binary layout, not a
pickle), broadcasts the step's input ids over the TP group (they may be a device tensor from
overlap scheduling: never read on the host), and every rank runs the same forward through
the same key on its shard; only rank 0 samples. Every rank is built by the same
``engine.rank.build_rank``.

driver.py is rank 0's side (spawn, send, watch, stop), worker.py a worker's loop, wire.py
what travels between them, teardown.py how a rank leaves the group and exits.
"""
