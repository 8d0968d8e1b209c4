"""Decode attention's Triton kernel under Triton's interpreter on CPU tensors, against its
torch twin (float32): the merge by each kv head's last split (one launch) and the merge
kernel (two launches), plain and with a sliding window, the arrival counters back at zero.
Run as ``TRITON_INTERPRET=1 python -m tests.interpret_kernels`` (started so by
``test_triton_interpret.py``)."""

from __future__ import annotations

import os
import sys

import torch

from breakgraph.kernels import decode_attention as dec
from breakgraph.kernels.attention_meta import AttentionMeta

SEQ_LENS = [0, 1, 2, 63, 64, 65, 300, 777]


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1"
    torch.manual_seed(0)
    kv_heads, group, head_dim = 2, 3, 32
    batch, slots = len(SEQ_LENS), sum(SEQ_LENS) + 1
    kc = torch.randn(slots, kv_heads, head_dim)
    vc = torch.randn(slots, kv_heads, head_dim)
    table = torch.zeros(batch, max(SEQ_LENS), dtype=torch.int32)
    perm = torch.randperm(slots - 1) + 1  # slot 0 is the padding slot
    at = 0
    for b, n in enumerate(SEQ_LENS):
        table[b, :n] = perm[at : at + n].to(torch.int32)
        at += n
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    meta = AttentionMeta.decode(table, torch.arange(batch), seq_lens)
    q = torch.randn(batch, kv_heads * group, head_dim)
    failed = 0
    for window in (None, 50):
        ref = torch.zeros_like(q)
        dec.decode_attention_torch(q, ref, kc, vc, meta, 0.3, sliding_window=window)
        for merge in (True, False):
            for splits in (2, 5):
                ws = dec.DecodeWorkspace()
                o = torch.full_like(q, 7.0)
                dec.decode_attention_triton(
                    q, o, kc, vc, meta, 0.3, num_kv_splits=splits, workspace=ws,
                    sliding_window=window, merge_in_split=merge,
                )  # fmt: skip
                diff = (o - ref).abs().max().item()
                zero = not ws.counters(batch * kv_heads, q.device).any()
                ok = diff <= 1e-5 and zero
                failed += not ok
                print(
                    f"{'ok' if ok else 'FAIL'} window={window} merge_in_split={merge} "
                    f"splits={splits}: max diff {diff:.1e}, counters zero {zero}"
                )
    return failed


if __name__ == "__main__":
    sys.exit(main())
