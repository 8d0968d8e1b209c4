"""DeepSeek V4 through the CPU graph banks (tests/support/cpu_graphs.py) with its
compressed-attention Triton kernels run by Triton's interpreter, against the same engine
eager on the same kernels (float32): the breaks' kernels on the live rows of bucket-sized tensors (their outputs
written in place), and the decode graphs' indexer scoring every entry the request table can
hold. Run as ``TRITON_INTERPRET=1 python -m tests.kernels.interpret_deepseek_v4_graphs``
(started so by tests/models/test_deepseek_v4_graphs.py)."""

from __future__ import annotations

import os
import sys
import tempfile

from breakgraph.engine.graphs.key import DECODE, PREFILL
from breakgraph.kernels import compressed_attention as ca
from breakgraph.kernels import ops
from tests.support.cpu_graphs import GraphPair
from tests.support.deepseek_v4 import make_hf_deepseek_v4
from tests.support.hf import prompts

ATOL = 1e-5


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1"
    # the compressed-attention kernels (what the breaks and decode graphs launch) on Triton,
    # the rest on the torch twins (tests/kernels/interpret_models.py runs those)
    ops.pool_windows = ca.pool_windows_triton
    ops.indexer_scores = ca.indexer_scores_triton
    ops.sparse_attention = ca.sparse_attention_triton
    path = tempfile.mkdtemp(prefix="interp-v4-graphs-")
    make_hf_deepseek_v4().save_pretrained(path)
    pair = GraphPair(path, [16, 64], 4, chunked_prefill_size=64)
    (base,) = prompts(1, [16], seed=1)
    pair.generate([base], max_new_tokens=2)  # bucket 16, a decode step of one row
    # ragged over a cached prefix (resumed at 16) and two fresh prompts: bucket 64; then
    # decode steps of three rows padded to four
    pair.generate([base + [7, 8, 9], *prompts(2, [30, 9], seed=2)], max_new_tokens=3)
    diff = pair.max_logit_diff()
    used = pair.buckets(PREFILL) == [16, 64] and pair.buckets(DECODE) == [1, 4]
    ok = diff <= ATOL and used
    print(f"{'ok' if ok else 'FAIL'} deepseek_v4 graphs: max logit diff {diff:.1e}")
    return int(not ok)


if __name__ == "__main__":
    sys.exit(main())
