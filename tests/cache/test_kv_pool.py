"""KV pool, slot allocator and req->token table: sizes, no double hand-out, no leak."""

import random

import pytest
import torch

from breakgraph.cache import KVPool, ReqToTokenPool, SlotAllocator


def test_kv_pool_shapes_zeroed_and_size():
    pool = KVPool(16, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, device="cpu")
    assert len(pool.k_buffers) == len(pool.v_buffers) == 3
    for buf in pool.k_buffers + pool.v_buffers:
        assert buf.shape == (16, 2, 8) and buf.dtype == torch.bfloat16
        assert not buf.any()
    assert pool.size_bytes == 16 * KVPool.bytes_per_slot(3, 2, 8, torch.bfloat16)
    assert KVPool.bytes_per_slot(3, 2, 8, torch.bfloat16) == 2 * 3 * 2 * 8 * 2


def test_allocator_hands_out_every_slot_but_zero_once():
    alloc = SlotAllocator(8192, debug=True)
    assert alloc.capacity == alloc.available == 8191
    slots = alloc.alloc(8191)
    assert slots.dtype == torch.int64
    assert sorted(slots.tolist()) == list(range(1, 8192))
    assert alloc.available == 0
    assert alloc.alloc(1) is None
    alloc.free(slots)
    assert alloc.available == 8191
    alloc.check_no_leak(0)


def test_alloc_is_all_or_nothing():
    alloc = SlotAllocator(10)
    held = alloc.alloc(6)
    assert alloc.alloc(4) is None
    assert alloc.available == 3
    assert alloc.alloc(0).numel() == 0
    alloc.free(held)
    assert alloc.alloc(9).numel() == 9


def test_debug_allocator_catches_bad_frees():
    alloc = SlotAllocator(10, debug=True)
    slots = alloc.alloc(3)
    alloc.free(slots[:1])
    with pytest.raises(RuntimeError):
        alloc.free(slots[:1])
    with pytest.raises(RuntimeError):
        alloc.free(torch.tensor([0]))
    with pytest.raises(RuntimeError):
        alloc.free(torch.tensor([slots[1].item(), slots[1].item()]))


def test_freeing_more_than_allocated_raises_without_debug():
    alloc = SlotAllocator(10)
    slots = alloc.alloc(2)
    alloc.free(slots)
    with pytest.raises(RuntimeError):
        alloc.free(slots)


def test_random_alloc_free_never_duplicates():
    rng = random.Random(0)
    alloc = SlotAllocator(257, debug=True)
    held: list[torch.Tensor] = []
    for _ in range(500):  # ~5K slots through a 256-slot ring: wraps around many times
        if held and rng.random() < 0.45:
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            slots = alloc.alloc(rng.randint(0, 40))
            if slots is not None:
                held.append(slots)
        flat = torch.cat(held).tolist() if held else []
        assert 0 not in flat
        assert len(set(flat)) == len(flat)
        alloc.check_no_leak(len(flat))
    alloc.clear()
    alloc.check_no_leak(0)


def test_req_to_token_alloc_free():
    pool = ReqToTokenPool(3, 32, "cpu")
    assert pool.table.shape == (3, 32) and pool.table.dtype == torch.int32
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]
    assert pool.alloc() is None and pool.available == 0
    pool.free(rows[1])
    assert pool.available == 1
    with pytest.raises(RuntimeError):
        pool.free(rows[1])
    assert pool.alloc() == rows[1]


def _check_write_read(device: str) -> None:
    pool = ReqToTokenPool(4, 16, device)
    idx = pool.alloc()
    pool.write(idx, 0, torch.tensor([5, 6, 7], dtype=torch.int64))
    pool.write(idx, 3, torch.tensor([9, 10], dtype=torch.int64))
    pool.write(idx, 5, torch.empty(0, dtype=torch.int64))
    if device == "cuda":
        torch.cuda.synchronize()
    assert pool.table[idx, :5].cpu().tolist() == [5, 6, 7, 9, 10]
    assert not pool.table[idx, 5:].any()
    with pytest.raises(ValueError):
        pool.write(idx, 15, torch.tensor([1, 2]))


def test_req_to_token_write_many_scatters_rows_and_cols():
    pool = ReqToTokenPool(3, 8, "cpu")
    pool.write_many([0, 2, 2, 1], [5, 0, 7, 3], torch.tensor([11, 12, 13, 14]))
    pool.write_many([], [], torch.empty(0, dtype=torch.int64))
    want = torch.zeros(3, 8, dtype=torch.int32)
    want[0, 5], want[2, 0], want[2, 7], want[1, 3] = 11, 12, 13, 14
    assert torch.equal(pool.table, want)


def test_req_to_token_write_batch_from_the_steps_upload():
    """A step's table write from the cells and slots its batch uploaded (``build(table_width)``):
    a decode step's is not logged for the TP workers (they write it from their copy of the
    step); an extend step's is, as its host rows, columns and slots."""
    from breakgraph.forward_batch import ForwardBatch, ForwardMode

    pool = ReqToTokenPool(3, 8, "cpu")
    pool.write_log = []  # TP rank 0
    decode = ForwardBatch.build(
        ForwardMode.DECODE, [7, 7], [11, 12], [2, 0], [5, 0], [1, 1], "cpu", table_width=8
    )
    pool.write_batch(decode)
    want = torch.zeros(3, 8, dtype=torch.int32)
    want[2, 5], want[0, 0] = 11, 12
    assert torch.equal(pool.table, want)
    assert pool.drain_writes() is None
    extend = ForwardBatch.build(
        ForwardMode.EXTEND, [1, 2, 3], [21, 22, 23], [1, 0], [2, 6], [2, 1], "cpu", table_width=8
    )
    pool.write_batch(extend, log=([1, 1, 0], [2, 3, 6], torch.tensor([21, 22, 23])))
    want[1, 2], want[1, 3], want[0, 6] = 21, 22, 23
    assert torch.equal(pool.table, want)
    rows, cols, slots = pool.drain_writes()
    assert (
        rows.tolist() == [1, 1, 0] and cols.tolist() == [2, 3, 6] and slots.tolist() == [21, 22, 23]
    )


def test_req_to_token_write_read_cpu():
    _check_write_read("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_req_to_token_write_read_cuda():
    _check_write_read("cuda")
