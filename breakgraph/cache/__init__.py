"""KV slot pool, request -> token table, radix prefix cache."""

from breakgraph.cache.kv_pool import PADDING_SLOT, KVPool, SlotAllocator
from breakgraph.cache.radix_cache import RadixCache
from breakgraph.cache.radix_node import MatchResult, TreeNode
from breakgraph.cache.req_to_token import ReqToTokenPool

__all__ = [
    "PADDING_SLOT",
    "KVPool",
    "MatchResult",
    "RadixCache",
    "ReqToTokenPool",
    "SlotAllocator",
    "TreeNode",
]
