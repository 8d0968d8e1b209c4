"""The bucket rule the engine's dispatcher applies to every bank (graph/bank.py)."""

from breakgraph.graph import smallest_bucket


def test_smallest_bucket_within_the_pad_factor():
    sizes = [16, 32, 64]
    assert [smallest_bucket(sizes, n) for n in (1, 16, 17, 40, 64, 65, 0)] == [
        16, 16, 32, 64, 64, None, None,
    ]  # fmt: skip
    # 40 rows pad to 64 (1.6x), 20 rows to 32 (1.6x)
    assert smallest_bucket(sizes, 40, 1.5) is None and smallest_bucket(sizes, 20, 1.6) == 32
    assert smallest_bucket(sizes, 1, 2.0) == 16  # the smallest bucket takes any smaller count
