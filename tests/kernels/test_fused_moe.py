"""Fused MoE kernels against their torch twins (GPU), and the twins against HF (CPU).

The kernel tests also run on the CPU under Triton's interpreter, with narrower experts and
float32/float16 only (the interpreter cannot multiply bfloat16 tiles):

    PYTHONPATH=<dir with triton> TRITON_INTERPRET=1 python3 -m pytest -q tests/kernels/test_fused_moe.py
"""

from __future__ import annotations

import os

import pytest
import torch

from breakgraph.kernels import fused_moe as fm
from breakgraph.kernels import ops

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and fm.triton is not None and not HAS_CUDA
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.bfloat16, torch.float32]


def kernel_test(fn):
    """Marked ``gpu``: runs on CUDA with Triton, or on the CPU under Triton's interpreter."""
    fn = pytest.mark.skipif(fm.triton is None, reason="needs triton")(fn)
    fn = pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs a CUDA device")(fn)
    return pytest.mark.gpu(fn)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _grouped_path(knobs):
    """The grouped path at every M (steps of up to 4 tokens take the GEMV path by default); the
    GEMV tests turn theirs on themselves."""
    knobs(MOE_GEMV=0)


def _dims(hidden: int, inter: int) -> tuple[int, int]:
    """Expert shapes; narrowed under the interpreter (one program at a time, in numpy)."""
    return (min(hidden, 128), min(inter, 96)) if INTERPRET else (hidden, inter)


def make_experts(m, e, hidden, inter, dtype, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g)
    gate_up = torch.randn(e, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(e, hidden, inter, generator=g) * inter**-0.5
    logits = torch.randn(m, e, generator=g) * 2
    return [t.to(device=device, dtype=dtype) for t in (x, gate_up, down, logits)]


def assert_experts_close(x, gate_up, down, w, ids, activation="silu", limit=None):
    """The kernel's output against the twin: within bf16/fp16 noise of the float32 result,
    and no further from it than the twin in the same dtype (HF's own loop) is, up to 2x."""
    got = fm.fused_experts_triton(x, gate_up, down, w, ids, activation, limit)
    exact = fm.fused_experts_torch(
        x.float(), gate_up.float(), down.float(), w, ids, activation, limit
    )
    scale = exact.abs().max().item()
    err = (got.float() - exact).abs().max().item()
    if x.dtype == torch.float32:
        assert err <= 1e-4 * max(scale, 1.0), err
        return
    twin = fm.fused_experts_torch(x, gate_up, down, w, ids, activation, limit)
    twin_err = (twin.float() - exact).abs().max().item()
    assert err <= 2e-2 * scale, (err, scale)
    assert err <= 2 * twin_err + 1e-3 * scale, (err, twin_err)


# ----------------------------------------------------------------------------- kernels vs twins

ROUTE_CASES = [(1, 8, 2), (7, 64, 6), (256, 128, 8), (8192, 128, 8), (33, 256, 8), (5, 60, 4)]


@kernel_test
@pytest.mark.parametrize(("m", "e", "k"), ROUTE_CASES)
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_twin(m, e, k, scoring, renormalize):
    logits = (torch.randn(m, e) * 3).to(DEVICE)
    twin = fm.moe_route_torch(logits, k, scoring, renormalize)
    got = fm.moe_route_triton(logits, k, scoring, renormalize)
    assert_same_routing(logits, twin, got, scoring, renormalize)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_route_low_precision_logits_and_expert_scale(dtype):
    logits = (torch.randn(300, 128) * 3).to(DEVICE, dtype)
    scale = (0.5 + torch.rand(128)).to(DEVICE, dtype)
    twin = fm.moe_route_torch(logits, 8, expert_scale=scale)
    got = fm.moe_route_triton(logits, 8, expert_scale=scale)
    assert_same_routing(logits, twin, got, "softmax", True, scale)


def assert_same_routing(logits, twin, got, scoring, renormalize, scale=None):
    """The twin's experts in its order, but where scores tie (saturated sigmoids, bfloat16
    logits: either choice is HF's), and the weights of the experts chosen."""
    (w, ids), (wt, idt) = twin, got
    if scoring == "softmax":
        scores = torch.softmax(logits, -1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
    chosen = scores.gather(1, idt.long())
    assert torch.equal(chosen, scores.gather(1, ids.long()))
    assert bool((idt.sort(1).values.diff(dim=1) > 0).all())  # k distinct experts
    assert (idt != ids).float().mean() < 0.05
    if renormalize:
        chosen = chosen / chosen.sum(-1, keepdim=True)
    if scale is not None:
        chosen = chosen * scale[idt.long()].float()
    torch.testing.assert_close(wt, chosen, atol=1e-6, rtol=1e-5)
    same = (idt == ids).all(1)
    torch.testing.assert_close(wt[same], w[same], atol=1e-6, rtol=1e-5)


@kernel_test
@pytest.mark.parametrize(
    ("m", "e", "k", "skewed"),
    [(1, 8, 2, False), (300, 16, 4, False), (512, 128, 8, False), (600, 16, 8, False),
     (8192, 128, 8, False), (5, 3, 1, False), (100, 256, 8, False), (300, 16, 4, True),
     (2000, 16, 4, True)],
)  # fmt: skip
def test_align_groups_rows_by_expert_in_padded_blocks(m, e, k, skewed):
    """Every row once, at its expert's block-aligned region; blocks name their expert. Up to
    ``ALIGN_ONE_MAX_ROWS`` rows (512 x 8) in one program, above in a count and a place
    kernel (600 x 8: a last block part empty); skewed: every token to experts 0..k-1."""
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(m)]).int().to(DEVICE)
    if skewed:
        ids = torch.arange(k, dtype=torch.int32, device=DEVICE).repeat(m, 1)
    block_m = 16
    sorted_ids, expert_ids, total, inverse = fm.moe_align(ids, e, block_m, inverse=True)
    flat = ids.flatten().cpu()
    counts = torch.bincount(flat.long(), minlength=e)
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(total.item()) == int(padded.sum())
    assert sorted_ids.shape[0] == fm.max_padded_rows(m * k, e, block_m)
    s, blocks = sorted_ids.cpu(), expert_ids.cpu()
    start = 0
    for expert in range(e):
        region = s[start : start + padded[expert]]
        real = region[region < m * k]
        assert len(real) == counts[expert] and bool((flat[real.long()] == expert).all())
        assert bool((region[counts[expert] :] == m * k).all())  # padding names the sentinel
        nb = int(padded[expert]) // block_m
        assert bool((blocks[start // block_m : start // block_m + nb] == expert).all())
        start += int(padded[expert])
    assert bool((blocks[start // block_m :] == -1).all())
    assert sorted(s[s < m * k].tolist()) == list(range(m * k))
    inv = inverse.cpu().long()  # each row's sorted position
    assert bool((s[inv] == torch.arange(m * k, dtype=s.dtype)).all())


EXPERT_CASES = [  # (M, E, K, hidden, inter): decode, odd, prefill, 8K (Qwen3-30B-A3B shapes)
    (1, 128, 8, 2048, 768),
    (7, 128, 8, 2048, 768),
    (256, 128, 8, 2048, 768),
    (8192, 128, 8, 2048, 768),
    (1, 8, 2, 1024, 512),
    (256, 8, 2, 1024, 512),
    (100, 60, 4, 512, 352),  # E and inter not powers of two
    (64, 128, 8, 2816, 704),  # Gemma 4 26B-A4B shapes
    (2048, 128, 8, 2816, 704),  # ... on the 128-row tiles (a last gate/up tile half idle)
    (8192, 128, 8, 2816, 704),
]


@kernel_test
@pytest.mark.parametrize(("m", "e", "k", "hidden", "inter"), EXPERT_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_experts_match_twin(m, e, k, hidden, inter, dtype):
    hidden, inter = _dims(hidden, inter)
    x, gate_up, down, logits = make_experts(m, e, hidden, inter, dtype)
    w, ids = fm.moe_route_torch(logits, k)
    assert_experts_close(x, gate_up, down, w, ids)


@kernel_test
@pytest.mark.parametrize("m", [7, 300])
def test_fused_experts_gelu_and_expert_scale(m):
    """Gemma 4's experts: tanh GELU, weights times a per-expert scale (not summing to 1)."""
    hidden, inter = _dims(512, 192)
    x, gate_up, down, logits = make_experts(m, 32, hidden, inter, DTYPES[0])
    scale = (0.5 + torch.rand(32)).to(DEVICE)
    w, ids = fm.moe_route_torch(logits, 4, expert_scale=scale)
    assert_experts_close(x, gate_up, down, w, ids, "gelu_tanh")


@kernel_test
@pytest.mark.parametrize("m", [7, 256, 8192])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("fuse_act", "sorted_h", "tma", "sorted_y", "persistent", "half_tail"),
    [(False, False, False, False, False, False), (True, True, False, False, False, False),
     (False, True, False, False, False, False), (True, True, True, False, False, False),
     (False, False, True, False, False, False), (True, True, True, True, False, False),
     (True, False, False, True, False, False), (True, True, True, False, True, False),
     (False, False, False, False, True, False), (True, True, True, False, False, True),
     (False, False, False, False, False, True), (True, True, True, True, False, True),
     (True, False, True, False, False, True)],
    ids=["plain", "fused-sorted", "plain-sorted", "fused-sorted-tma", "plain-tma",
         "all-sorted-tma", "fused-sorted-y", "fused-sorted-tma-persistent", "plain-persistent",
         "fused-sorted-tma-half", "plain-half", "all-sorted-tma-half", "fused-tma-half"],
)  # fmt: skip
def test_fused_experts_config_variants(
    m, dtype, fuse_act, sorted_h, tma, sorted_y, persistent, half_tail, monkeypatch
):
    """The config table's other variants: gate/up as a plain GEMM then SiLU-and-mul, the
    intermediate rows kept in sorted order (the down GEMM reads them contiguously), the
    tiles loaded through TMA descriptors (weights; the sorted rows too), the down GEMM's
    rows sorted (the top-k sum gathers them), persistent programs looping over the tiles,
    blocks half padding run as tiles of half the rows."""
    hidden, inter = _dims(2048, 768)
    x, gate_up, down, logits = make_experts(m, 128, hidden, inter, dtype)
    cfg = fm.moe_config(m, 8, 128)._replace(
        fuse_act=fuse_act, sorted_h=sorted_h, tma=tma, sorted_y=sorted_y, persistent=persistent,
        half_tail=half_tail,
    )  # fmt: skip
    monkeypatch.setattr(fm, "moe_config", lambda *_: cfg)
    assert_experts_close(x, gate_up, down, *fm.moe_route_torch(logits, 8))


@kernel_test
@pytest.mark.parametrize("m", [7, 256, 8192])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "variant",
    [{}, {"sorted_y": True}, {"persistent": True, "half_tail": False},
     {"fuse_act": False, "sorted_h": False, "tma": False, "half_tail": False}],
    ids=["table", "sorted-y", "persistent", "plain"],
)  # fmt: skip
def test_fused_experts_atomic_sum(m, dtype, variant, monkeypatch):
    """``atomic_sum``: the down GEMM adds each row into its token's output row (in the
    output's dtype, in no fixed order) and no top-k sum runs, on the table's config at M and
    on other variants (``sorted_y`` is then unread)."""
    hidden, inter = _dims(2048, 768)
    x, gate_up, down, logits = make_experts(m, 128, hidden, inter, dtype)
    cfg = fm.moe_config(m, 8, 128)._replace(atomic_sum=True, **variant)
    monkeypatch.setattr(fm, "moe_config", lambda *_: cfg)
    assert_experts_close(x, gate_up, down, *fm.moe_route_torch(logits, 8))


@kernel_test
@pytest.mark.parametrize("m", [1, 256, 8192])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_experts_skewed_routing(m, dtype):
    """Every token to the same top-k experts (one expert holds all first choices); every
    other expert empty."""
    hidden, inter = _dims(1024, 256)
    e, k = 64, 4
    x, gate_up, down, _ = make_experts(m, e, hidden, inter, dtype)
    ids = torch.tensor([[5, 0, 63, 17]], dtype=torch.int32, device=DEVICE).repeat(m, 1)
    w = torch.softmax(torch.randn(m, k, device=DEVICE), -1)
    assert_experts_close(x, gate_up, down, w, ids)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_experts_with_an_empty_expert(dtype):
    hidden, inter = _dims(1024, 512)
    e, k, m = 16, 2, 500
    x, gate_up, down, logits = make_experts(m, e, hidden, inter, dtype)
    logits[:, 9] = -1e4  # expert 9 receives no token
    w, ids = fm.moe_route_torch(logits, k)
    assert not bool((ids == 9).any())
    assert_experts_close(x, gate_up, down, w, ids)


@kernel_test
def test_fused_experts_no_tokens():
    hidden, inter = _dims(256, 128)
    x, gate_up, down, logits = make_experts(0, 8, hidden, inter, DTYPES[0])
    w, ids = fm.moe_route_triton(logits, 2)
    assert fm.fused_experts_triton(x, gate_up, down, w, ids).shape == (0, hidden)


@kernel_test
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", fm.ACTIVATIONS)
def test_gemv_experts_of_a_few_tokens_match_twin(m, dtype, activation, knobs):
    """The GEMV path (two launches, no alignment) on Qwen3-30B-A3B's expert shapes, through
    ``fused_experts_triton``'s dispatch (``BREAKGRAPH_MOE_GEMV``); and a skewed step, every
    token to the same experts."""
    knobs(MOE_GEMV=8)
    hidden, inter = _dims(2048, 768)
    x, gate_up, down, logits = make_experts(m, 128, hidden, inter, dtype)
    assert_experts_close(x, gate_up, down, *fm.moe_route_torch(logits, 8), activation)
    ids = torch.arange(8, dtype=torch.int32, device=DEVICE).repeat(m, 1)
    w = torch.softmax(torch.randn(m, 8, device=DEVICE), -1)
    assert_experts_close(x, gate_up, down, w, ids, activation)


@kernel_test
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_experts_with_deepseek_v4s_clamp_match_twin(m, dtype, knobs):
    """DeepSeek V4's clamped SwiGLU on the GEMV path (its epilogue clamps gate and up): a
    limit that clamps (the inputs scaled past it), against the twin."""
    knobs(MOE_GEMV=8)
    hidden, inter = _dims(2048, 768)
    x, gate_up, down, logits = make_experts(m, 32, hidden, inter, dtype)
    x = x * 8
    assert_experts_close(x, gate_up, down, *fm.moe_route_torch(logits, 6), limit=2.0)


@kernel_test
@pytest.mark.parametrize("m", [7, 256, 8192])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "variant", [{}, {"persistent": True, "half_tail": False}, {"fuse_act": False}],
    ids=["table", "persistent", "unfused"],
)  # fmt: skip
def test_grouped_experts_with_deepseek_v4s_clamp_match_twin(m, dtype, variant, monkeypatch):
    """DeepSeek V4's clamped SwiGLU on the grouped path: the gate/up GEMM's epilogue clamps
    (the table's config and a persistent one), or with the activation unfused a kernel of its
    own does; a limit that clamps, against the twin."""
    hidden, inter = _dims(2048, 768)
    x, gate_up, down, logits = make_experts(m, 32, hidden, inter, dtype)
    cfg = fm.moe_config(m, 6, 32)._replace(**variant)
    monkeypatch.setattr(fm, "moe_config", lambda *_: cfg)
    assert_experts_close(x * 8, gate_up, down, *fm.moe_route_torch(logits, 6), limit=2.0)


# ----------------------------------------------------------------------------- capture (GPU only)

gpu_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@kernel_test
@gpu_only
@pytest.mark.parametrize("atomic", [False, True], ids=["sum-kernel", "atomic-sum"])
def test_moe_replays_in_a_cuda_graph_with_new_routing(atomic, knobs):
    """Captured once at 256 tokens; replays with other logits (other counts per expert, a
    skewed step) equal eager runs: nothing is sized or decided on the host. Bit for bit with
    the sum kernel (``BREAKGRAPH_MOE_ATOMIC_SUM=0``); with the table's ``atomic_sum`` (on at
    this M) each token's rows add in the order they land, so within a few bf16 roundings."""
    knobs(MOE_ATOMIC_SUM=atomic)
    assert fm.moe_config(256, 6, 64).atomic_sum == atomic
    m, e, k = 256, 64, 6
    x, gate_up, down, logits = make_experts(m, e, 1024, 384, torch.bfloat16)

    def step():
        w, ids = ops.moe_route(static_logits, k)
        return ops.fused_experts(static_x, gate_up, down, w, ids)

    static_x, static_logits = x.clone(), logits.clone()
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    skewed = logits.clone()
    skewed[:, :k] += 20  # every token to experts 0..k-1
    for new_logits in (torch.randn_like(logits) * 2, skewed):
        static_x.copy_(torch.randn_like(x))
        static_logits.copy_(new_logits)
        graph.replay()
        eager = step()
        if not atomic:
            torch.testing.assert_close(out, eager, atol=0, rtol=0)
            continue
        bound = 2**-6 * eager.abs().max().item()  # a few roundings of the largest output
        torch.testing.assert_close(out, eager, atol=bound, rtol=0)
        assert ((out.float() - eager.float()).norm() / eager.float().norm()).item() < 1e-2


@kernel_test
@gpu_only
def test_gemv_experts_replay_in_a_cuda_graph_with_new_routing(knobs):
    """The GEMV path captured at 4 tokens replays other routings as eager runs compute them."""
    knobs(MOE_GEMV=8)
    x, gate_up, down, logits = make_experts(4, 128, 2048, 768, torch.bfloat16)
    static_x, static_logits = x.clone(), logits.clone()

    def step():
        return ops.fused_experts(static_x, gate_up, down, *ops.moe_route(static_logits, 8))

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):
        static_x.copy_(torch.randn_like(x))
        static_logits.copy_(torch.randn_like(logits) * 2)
        graph.replay()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)


@kernel_test
@gpu_only
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_experts_under_pdl_equal_plain_launches(path, knobs):
    """The route kernel and the GEMV path's kernels (the grouped path's launch plainly after
    the route kernel) launched dependent on their predecessors (kernels/pdl.py), captured in
    a graph as a small decode graph captures them: bitwise the plain launches' output."""
    from breakgraph.kernels import pdl

    if not pdl._capable(torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs compute capability 9+")
    knobs(MOE_GEMV=8 if path == "gemv" else 0)
    x, gate_up, down, logits = make_experts(2 if path == "gemv" else 4, 128, 2048, 768,
                                            torch.bfloat16)  # fmt: skip

    def step():
        return ops.fused_experts(x, gate_up, down, *ops.moe_route(logits, 8))

    outs = {}
    for mode in ("0", "1"):
        knobs(PDL=mode)
        assert bool(pdl.launch(x.device)) == (mode == "1")
        step()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        graph.replay()
        outs[mode] = out.clone()
    torch.testing.assert_close(outs["1"], outs["0"], atol=0, rtol=0)


@kernel_test
@gpu_only
def test_moe_step_never_syncs_the_host():
    x, gate_up, down, logits = make_experts(300, 128, 512, 256, torch.bfloat16)
    ops.fused_experts(x, gate_up, down, *ops.moe_route(logits, 8))  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.fused_experts(x, gate_up, down, *ops.moe_route(logits, 8))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@kernel_test
@gpu_only
def test_ops_dispatch_moe_to_triton_on_cuda(monkeypatch):
    """ops.fused_experts takes the Triton path on CUDA: the grouped path's alignment runs."""
    x, gate_up, down, logits = make_experts(9, 8, 128, 64, torch.bfloat16)
    called = []
    align = fm.moe_align
    monkeypatch.setattr(fm, "moe_align", lambda *a, **k: called.append(1) or align(*a, **k))
    ops.fused_experts(x, gate_up, down, *ops.moe_route(logits, 2))
    assert called


# ----------------------------------------------------------------------------- twins vs HF (CPU)


def test_twins_equal_hf_qwen3_moe_block():
    """Router (softmax, top-k, norm_topk_prob on and off) and experts loop equal HF's block."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

    for norm in (True, False):
        cfg = transformers.Qwen3MoeConfig(
            hidden_size=64, moe_intermediate_size=40, num_experts=12, num_experts_per_tok=3,
            norm_topk_prob=norm,
        )  # fmt: skip
        block = hf.Qwen3MoeSparseMoeBlock(cfg).float()
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.3)
            x = torch.randn(1, 40, 64)
            ref = block(x)[0]
            w, ids = ops.moe_route(x[0] @ block.gate.weight.T, 3, renormalize=norm)
            got = ops.fused_experts(
                x[0], block.experts.gate_up_proj, block.experts.down_proj, w, ids
            )
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_twins_equal_hf_gemma4_router_and_experts():
    pytest.importorskip("transformers")
    from transformers.models.gemma4 import modeling_gemma4 as hf
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    from breakgraph.models.config import ModelConfig
    from breakgraph.models.gemma4 import Gemma4Router

    cfg = Gemma4TextConfig(
        hidden_size=64, num_experts=16, top_k_experts=4, moe_intermediate_size=24,
        enable_moe_block=True, num_hidden_layers=1,
    )  # fmt: skip
    router, experts = hf.Gemma4TextRouter(cfg).float(), hf.Gemma4TextExperts(cfg).float()
    with torch.no_grad():
        for p in (*router.parameters(), *experts.parameters()):
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
        x = torch.randn(30, 64)
        _, ref_w, ref_ids = router(x)
        ref = experts(x, ref_ids, ref_w)

        ours = Gemma4Router(
            ModelConfig.from_dict(
                {**cfg.to_dict(), "architectures": ["Gemma4ForCausalLM"], "vocab_size": 8}
            )
        )
        ours.load_state_dict(router.state_dict())
        w, ids = ours(x)
        assert torch.equal(ids, ref_ids.int())
        torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
        got = ops.fused_experts(x, experts.gate_up_proj, experts.down_proj, w, ids, "gelu_tanh")
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
