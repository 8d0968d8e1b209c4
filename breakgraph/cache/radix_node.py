"""The radix tree's node (a run of tokens and their KV slots) and a prefix match's result."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class TreeNode:
    """One edge of the radix tree: a run of tokens (int32 array) and their KV slots."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id", "in_heap")

    def __init__(self, node_id: int, key: np.ndarray, value: torch.Tensor, parent: TreeNode | None):
        self.id = node_id
        self.children: dict[int, TreeNode] = {}  # first token of the child's key -> child
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = 0
        self.in_heap = False  # has an entry in the tree's eviction heap

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass
class MatchResult:
    """The longest cached prefix: its KV slots (owned by the tree) and the node it ends at."""

    slots: torch.Tensor  # CPU int64 [prefix_len]
    node: TreeNode

    @property
    def prefix_len(self) -> int:
        return self.slots.numel()
