"""Tensor-parallel process group: rank, size and the collectives the sharded layers use.

Knows nothing about models. With a group of size 1 every op returns its input untouched
and no process group exists.
"""

from breakgraph.distributed.group import (
    TPGroup,
    abort_tp_group,
    destroy_tp_group,
    get_tp_group,
    init_tp_group,
    reduce_in_norms,
    tp_group_scope,
)

__all__ = [
    "TPGroup",
    "abort_tp_group",
    "destroy_tp_group",
    "get_tp_group",
    "init_tp_group",
    "reduce_in_norms",
    "tp_group_scope",
]
