"""DeepSeek V4's hyper-connection mixes (kernels/hyper_connection.py) on the GPU at V4-Flash's
shapes: the Triton kernel (bf16 streams read as they are, 3xTF32 on the tensor cores, the
reduction split over programs for short batches) against torch's float32 GEMM. The CPU
checks the same kernel under Triton's interpreter (``interpret_hyper``)."""

from __future__ import annotations

import pytest
import torch

from breakgraph.kernels import hyper_connection as hc


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 16, 17, 300, 8000])
@pytest.mark.parametrize("cols", [24, 4])
def test_hc_mixes_equal_float32_gemm(rows, cols):
    torch.manual_seed(0)
    x = torch.randn(rows, 4 * 4096, device="cuda").to(torch.bfloat16)
    fn = torch.randn(cols, 4 * 4096, device="cuda") / 128
    got = hc.hc_mixes_triton(x, fn)
    want = hc.hc_mixes_torch(x, fn)
    assert got.shape == want.shape == (rows, cols) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
