"""Skinny GEMM, decode's few rows: ``y = x W^T (+ bias)`` for x [M, K] with small M.

At decode's M = 1..64 a projection reads its weight once and does little else: its time is
the weight bytes over the memory bandwidth plus the launch's ramp and tail. This kernel tiles
N (``BLOCK_N`` weight rows per program) and splits K (``SPLIT_K`` programs per N tile), so a
1024-wide output still puts enough loads in flight on every SM. A split's fp32 partial goes
to a workspace; the N tile's last split to finish sums them (arrival counters:
kernels/workspace.py), adds the bias and stores y in x's dtype: one launch.

Which shapes take it is measured, not guessed: :data:`SKINNY_TABLE` maps a weight shape
``(N, K)`` to ``(max_m, config)`` classes that beat cuBLAS on the H200, as printed by
``breakgraph bench gemm`` (which regenerates it). A shape not in the table stays on
cuBLAS (``F.linear``); the torch twin is ``F.linear`` itself.
"""

from __future__ import annotations

import functools
import json
from typing import NamedTuple

import torch
import torch.nn.functional as F

from breakgraph.common import envs
from breakgraph.kernels import fused, pdl
from breakgraph.kernels.fused import act_and_mul
from breakgraph.kernels.workspace import Workspace, last_to_arrive

try:  # Triton is optional: the CPU-only install runs the torch twin
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    fuse_norm: bool = True  # take the RMSNorm in front as the prologue (where one precedes)
    gemv: bool = False  # the GEMV kernel (no tensor cores, no split; M <= GEMV_MAX_M) instead


# (N, K) -> [(max_m, config or None), ...] ascending max_m: rows m <= max_m (and above the
# previous entry's) take the config, None meaning cuBLAS. Measured on one H200 (torch 2.11,
# CUDA 13, Triton 3.6; 2026-11-30) by ``breakgraph bench gemm`` (M = 1, 4, 16, 64;
# kept where the kernel beats cuBLAS by >= 3%, both timed as CUDA-graph replays), which
# regenerates it; ``fuse_norm`` where the RMSNorm as the prologue beat the norm kernel in front
# (it never did for qkv / gate_up: each program re-reads the rows). A shape not here stays on
# cuBLAS; another GPU's table serves without an edit: BREAKGRAPH_SKINNY=PATH (below).
#
# M = 1 takes the GEMV kernel, with each shape's best config of a sweep (BLOCK_N weight rows
# per program, BLOCK_K, warps, stages: ``_v``) timed as one CUDA graph of launches on
# distinct weight copies (DRAM reads, one launch after another, as in the decode graph):
# ``breakgraph bench gemm --gemv --models ...`` regenerates them (2026-12-02, one H200;
# gate/up timed with its SiLU epilogue, Gemma's GELU runs the same config), kept where they
# beat cuBLAS by >= 3%. Against the one
# config every shape had before (BLOCK_N 2, BLOCK_K 2048, 2 warps, chosen in the Qwen3-0.6B
# decode graph), the batch-1 decode graph step took 0.94-0.95x on Qwen3-0.6B and Llama-3.1-8B
# (1K and 8K context); the families that were on cuBLAS at M = 1 before, 0.90x (Qwen3-8B)
# and 0.73x (Gemma 4 E2B) (``bench decode --variants base skinny=PATH``, PATH the sweep's
# ``--table-out``). GEMV at 2 to 8 rows lost in the decode graph, so M >= 2 keeps the
# tensor-core kernel's classes or cuBLAS.
_C = SkinnyConfig


def _v(block_n: int, block_k: int, num_warps: int, num_stages: int) -> SkinnyConfig:
    return SkinnyConfig(block_n, block_k, 1, num_warps, num_stages, fuse_norm=False, gemv=True)


SKINNY_TABLE: dict[tuple[int, int], list[tuple[int, SkinnyConfig | None]]] = {
    (4096, 1024): [  # qwen3-0.6b:qkv
        (1, _v(2, 1024, 2, 2)),
        (16, None),
        (64, _C(32, 128, 1, fuse_norm=False)),
    ],
    (1024, 2048): [(1, _v(2, 2048, 4, 1)), (16, _C(32, 128, 4)), (64, None)],  # qwen3-0.6b:o
    (6144, 1024): [(1, _v(2, 1024, 2, 3)), (64, None)],  # qwen3-0.6b:gate_up
    (1024, 3072): [  # qwen3-0.6b:down
        (1, _v(2, 4096, 8, 1)),
        (16, _C(32, 128, 8)),
        (64, _C(32, 128, 4)),
    ],
    (151936, 1024): [  # qwen3-0.6b:lm_head
        (1, _v(2, 512, 1, 3)),
        (4, _C(64, 256, 1)),
        (16, _C(64, 128, 1)),
        (64, None),
    ],
    (6144, 4096): [  # llama-3.1-8b:qkv
        (1, _v(2, 4096, 8, 3)),
        (4, _C(64, 128, 4, fuse_norm=False)),
        (64, None),
    ],
    (4096, 4096): [(1, _v(1, 4096, 4, 2)), (16, _C(64, 128, 4)), (64, None)],  # llama-3.1-8b:o
    (28672, 4096): [  # llama-3.1-8b:gate_up
        (1, _v(2, 2048, 8, 1)),
        (4, _C(64, 256, 1, fuse_norm=False)),
        (64, None),
    ],
    (4096, 14336): [  # llama-3.1-8b:down
        (1, _v(2, 2048, 1, 1)),
        (16, _C(32, 128, 4)),
        (64, _C(64, 256, 2)),
    ],
    (128256, 4096): [  # llama-3.1-8b:lm_head
        (1, _v(4, 4096, 4, 3)),
        (16, _C(64, 256, 1)),
        (64, _C(64, 128, 1)),
    ],
    (24576, 4096): [(1, _v(2, 4096, 4, 2))],  # qwen3-8b:gate_up
    (4096, 12288): [(1, _v(2, 4096, 1, 1))],  # qwen3-8b:down
    (151936, 4096): [(1, _v(1, 4096, 4, 3))],  # qwen3-8b:lm_head
    (2560, 1536): [(1, _v(2, 2048, 4, 1))],  # gemma-4-e2b:qkv
    (1536, 2048): [(1, _v(2, 2048, 4, 3))],  # gemma-4-e2b:o
    (12288, 1536): [(1, _v(1, 512, 1, 1))],  # gemma-4-e2b:gate_up
    (1536, 6144): [(1, _v(2, 2048, 4, 2))],  # gemma-4-e2b:down
    (256, 1536): [(1, _v(2, 2048, 4, 2))],  # gemma-4-e2b:per_layer_input_gate
    (1536, 256): [(1, _v(2, 512, 1, 1))],  # gemma-4-e2b:per_layer_projection
    (5120, 1536): [(1, _v(2, 2048, 4, 1))],  # gemma-4-e2b:qkv
    (1536, 4096): [(1, _v(2, 4096, 8, 3))],  # gemma-4-e2b:o
    (2048, 1536): [(1, _v(2, 2048, 4, 3))],  # gemma-4-e2b:q
    (24576, 1536): [(1, _v(1, 512, 1, 1))],  # gemma-4-e2b:gate_up
    (1536, 12288): [(1, _v(2, 4096, 8, 1))],  # gemma-4-e2b:down
    (4096, 1536): [(1, _v(2, 2048, 4, 2))],  # gemma-4-e2b:q
    (8960, 1536): [(1, _v(4, 512, 1, 2))],  # gemma-4-e2b:per_layer_model_projection
    (262144, 1536): [(1, _v(2, 512, 2, 1))],  # gemma-4-e2b:lm_head
    (3072, 2560): [(1, _v(2, 4096, 8, 3))],  # gemma-4-e4b:qkv
    (2560, 2048): [(1, _v(2, 2048, 4, 2))],  # gemma-4-e4b:o
    (20480, 2560): [(1, _v(1, 512, 1, 1))],  # gemma-4-e4b:gate_up
    (2560, 10240): [(1, _v(2, 2048, 4, 3))],  # gemma-4-e4b:down
    (256, 2560): [(1, _v(2, 4096, 8, 1))],  # gemma-4-e4b:per_layer_input_gate
    (2560, 256): [(1, _v(4, 512, 1, 3))],  # gemma-4-e4b:per_layer_projection
    (6144, 2560): [(1, _v(2, 512, 1, 1))],  # gemma-4-e4b:qkv
    (2560, 4096): [(1, _v(2, 2048, 4, 3))],  # gemma-4-e4b:o
    (2048, 2560): [(1, _v(2, 4096, 4, 1))],  # gemma-4-e4b:q
    (4096, 2560): [(1, _v(2, 4096, 4, 1))],  # gemma-4-e4b:q
    (10752, 2560): [(1, _v(4, 512, 1, 1))],  # gemma-4-e4b:per_layer_model_projection
    (262144, 2560): [(1, _v(1, 1024, 1, 2))],  # gemma-4-e4b:lm_head
    (5120, 2048): [(1, _v(2, 1024, 1, 2))],  # qwen3-30b-a3b:qkv
    (2048, 4096): [(1, _v(2, 4096, 2, 1))],  # qwen3-30b-a3b:o
    (151936, 2048): [(1, _v(2, 1024, 4, 1))],  # qwen3-30b-a3b:lm_head
    (128, 2048): [(1, _v(2, 2048, 4, 3))],  # qwen3-30b-a3b:router (cuBLAS 5.31 -> 2.08 us)
    (8192, 2816): [(1, _v(2, 4096, 4, 1))],  # gemma-4-26b-a4b:qkv
    (2816, 4096): [(1, _v(2, 4096, 8, 3))],  # gemma-4-26b-a4b:o
    (4224, 2816): [(1, _v(4, 4096, 4, 3))],  # gemma-4-26b-a4b:gate_up
    (2816, 2112): [(1, _v(8, 4096, 8, 2))],  # gemma-4-26b-a4b:down
    (128, 2816): [(1, _v(2, 4096, 8, 2))],  # gemma-4-26b-a4b:router
    (9216, 2816): [(1, _v(2, 4096, 4, 1))],  # gemma-4-26b-a4b:qkv
    (2816, 8192): [(1, _v(2, 4096, 8, 1))],  # gemma-4-26b-a4b:o
    (262144, 2816): [(1, _v(1, 1024, 1, 1))],  # gemma-4-26b-a4b:lm_head
    (960, 576): [(1, _v(2, 1024, 2, 3))],  # smollm2-135m:qkv
    (576, 576): [(1, _v(2, 1024, 2, 3))],  # smollm2-135m:o
    (3072, 576): [(1, _v(2, 1024, 2, 2))],  # smollm2-135m:gate_up
    (576, 1536): [(1, _v(2, 2048, 4, 1))],  # smollm2-135m:down
    # smollm2-135m:lm_head (49152, 576): cuBLAS at M = 1 (17.71 against 18.81 us)
    # deepseek-v4-flash (and -e32: the same projections), M = 1, measured on one H100
    # (2026-12-06, `bench gemm --gemv --models deepseek-v4-flash`; cuBLAS -> GEMV us); its
    # shared expert's gate/up (4096, 4096) and down (4096, 2048) take the rows above; the
    # 10-layer cut's batch-1 decode graph over 8K: 0.925x (`bench decode --variants`, H100)
    (1024, 4096): [(1, _v(2, 4096, 8, 2))],  # q_a; a CSA compressor's kv, gate (7.90 -> 4.87)
    (32768, 1024): [(1, _v(2, 1024, 4, 1))],  # q_b (27.26 -> 24.30)
    (512, 4096): [(1, _v(2, 4096, 8, 2))],  # kv; an HCA compressor's kv, gate (7.23 -> 3.50)
    (4096, 8192): [(1, _v(2, 4096, 8, 1))],  # o_b (28.34 -> 24.61)
    (256, 4096): [(1, _v(2, 4096, 8, 3))],  # the indexer's compressor kv, gate (7.02 -> 2.76)
    (8192, 1024): [(1, _v(2, 512, 1, 2))],  # the indexer's q_b (8.42 -> 7.57)
    (64, 4096): [(1, _v(2, 4096, 8, 2))],  # the indexer's weights (6.78 -> 2.16)
    (129280, 4096): [(1, _v(1, 4096, 2, 1))],  # lm_head (374.37 -> 332.96)
    # one rank of TP2, measured on an nvidia-h200-x2 (2026-12-01, same stack):
    # `breakgraph bench gemm --models llama-3.1-8b --tp 2` (o and gate/up: cuBLAS);
    # M = 1 on the GEMV kernel since (below)
    (3072, 4096): [
        (1, _v(1, 4096, 4, 3)),  # 10.46 -> 8.41 us
        (4, _C(64, 128, 8, fuse_norm=False)),
        (16, _C(32, 128, 4, fuse_norm=False)),
        (64, None),
    ],  # llama-3.1-8b/tp2:qkv (9.35 -> 6.68 us at M=1)
    (4096, 7168): [  # llama/tp2:down
        (1, _v(1, 1024, 1, 2)),  # 18.46 -> 16.68 us
        (16, _C(32, 128, 4)),
        (64, None),
    ],
    (64128, 4096): [  # llama/tp2:lm_head
        (1, _v(1, 4096, 4, 2)),  # 122.65 -> 117.83 us
        (4, _C(64, 256, 1)),
        (16, None),
        (64, _C(64, 128, 1)),
    ],
    # one rank's batch-1 projections at TP 2, 4 and 8 (a rank's projection runs alone on its
    # GPU, so one H200 measures any size's): `breakgraph bench gemm --gemv --models
    # llama-3.1-8b qwen3-30b-a3b qwen3-8b --tp 2 4 8` (2026-12-02, one H200; 1.1-2.7x
    # faster than cuBLAS; the shapes above and the single-GPU ones keep their entries)
    (4096, 2048): [(1, _v(2, 1024, 2, 3))],  # llama-3.1-8b/tp2:o
    (14336, 4096): [(1, _v(4, 1024, 1, 2))],  # llama-3.1-8b/tp2:gate_up
    (7168, 4096): [(1, _v(1, 1024, 1, 1))],  # llama-3.1-8b/tp4:gate_up
    (4096, 3584): [(1, _v(1, 4096, 4, 2))],  # llama-3.1-8b/tp4:down
    (32064, 4096): [(1, _v(1, 4096, 4, 1))],  # llama-3.1-8b/tp4:lm_head
    (768, 4096): [(1, _v(2, 4096, 8, 1))],  # llama-3.1-8b/tp8:qkv
    (4096, 512): [(1, _v(4, 512, 1, 2))],  # llama-3.1-8b/tp8:o
    (3584, 4096): [(1, _v(4, 4096, 4, 1))],  # llama-3.1-8b/tp8:gate_up
    (4096, 1792): [(1, _v(2, 2048, 4, 3))],  # llama-3.1-8b/tp8:down
    (16032, 4096): [(1, _v(1, 4096, 4, 3))],  # llama-3.1-8b/tp8:lm_head
    (2048, 2048): [(1, _v(2, 2048, 4, 2))],  # qwen3-30b-a3b/tp2:o
    (75968, 2048): [(1, _v(1, 1024, 1, 3))],  # qwen3-30b-a3b/tp2:lm_head
    (1280, 2048): [(1, _v(2, 2048, 4, 3))],  # qwen3-30b-a3b/tp4:qkv
    (2048, 1024): [(1, _v(2, 1024, 2, 2))],  # qwen3-30b-a3b/tp4:o
    (37984, 2048): [(1, _v(2, 2048, 4, 1))],  # qwen3-30b-a3b/tp4:lm_head
    (768, 2048): [(1, _v(2, 2048, 4, 1))],  # qwen3-30b-a3b/tp8:qkv
    (2048, 512): [(1, _v(2, 512, 1, 1))],  # qwen3-30b-a3b/tp8:o
    (18992, 2048): [(1, _v(1, 2048, 2, 2))],  # qwen3-30b-a3b/tp8:lm_head
    (12288, 4096): [(1, _v(2, 2048, 8, 2))],  # qwen3-8b/tp2:gate_up
    (4096, 6144): [(1, _v(1, 1024, 1, 2))],  # qwen3-8b/tp2:down
    (75968, 4096): [(1, _v(2, 4096, 8, 3))],  # qwen3-8b/tp2:lm_head
    (4096, 3072): [(1, _v(2, 1024, 2, 1))],  # qwen3-8b/tp4:down
    (37984, 4096): [(1, _v(1, 4096, 4, 3))],  # qwen3-8b/tp4:lm_head
    (18992, 4096): [(1, _v(2, 4096, 8, 1))],  # qwen3-8b/tp8:lm_head
}
del _C, _v

MAX_M = 64  # the kernel's largest row tile
GEMV_MAX_M = 8  # the GEMV kernel's: it unrolls over the rows


def skinny_gemm_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference twin: ``F.linear``."""
    return F.linear(x, weight, bias)


def table_to_json(table: dict[tuple[int, int], list[tuple[int, SkinnyConfig | None]]]) -> list:
    """A table as JSON rows (what ``bench gemm --table-out`` writes for another GPU)."""
    return [
        {"n": n, "k": k, "entries": [[m, None if c is None else c._asdict()] for m, c in entries]}
        for (n, k), entries in table.items()
    ]


def load_table(path: str) -> dict[tuple[int, int], list[tuple[int, SkinnyConfig | None]]]:
    """A table written by ``breakgraph bench gemm --table-out PATH``."""
    with open(path) as f:
        rows = json.load(f)
    return {
        (row["n"], row["k"]): [
            (m, None if c is None else SkinnyConfig(**c)) for m, c in row["entries"]
        ]
        for row in rows
    }


# BREAKGRAPH_SKINNY (common/envs.py, read at each lookup) picks the table: "table" (the default)
# SKINNY_TABLE, a PATH.json the table that file holds (measured on this GPU by bench gemm
# --table-out), "all" every projection of at most MAX_M rows on a generic config (to measure a
# whole step before the table is filled), "off" none at all
_table_file = functools.cache(load_table)  # a file is read once per path


def active_table() -> dict[tuple[int, int], list[tuple[int, SkinnyConfig | None]]]:
    """The table lookups use now: SKINNY_TABLE, or the file ``BREAKGRAPH_SKINNY`` names
    (empty under "all" and "off")."""
    mode = envs.SKINNY.get()
    if mode == "table":
        return SKINNY_TABLE
    return {} if mode in ("all", "off") else _table_file(mode)


def table_config(m: int, n: int, k: int) -> SkinnyConfig | None:
    """The measured config for ``m`` rows of an (n, k) weight, or None (cuBLAS)."""
    mode = envs.SKINNY.get()
    if mode in ("all", "off"):
        return generic_config(n, k) if mode == "all" and m <= MAX_M else None
    for max_m, cfg in active_table().get((n, k), ()):
        if m <= max_m:
            return cfg
    return None  # more rows than any entry, or a shape never measured


@functools.cache
def generic_config(n: int, k: int, block_n: int = 32, block_k: int = 128) -> SkinnyConfig:
    """About two programs per SM of an H200 (132): K split as far as that needs, each split
    keeping at least two chunks."""
    tiles = -(-n // block_n)
    split = 1
    while split < 8 and tiles * split < 264 and k // (2 * split) >= 2 * block_k:
        split *= 2
    return SkinnyConfig(block_n, block_k, split)


class SkinnyWorkspace(Workspace):
    """fp32 split partials and per-N-tile arrival counters (zero between launches), grown
    lazily (kernels/workspace.py: an outgrown buffer stays alive for captured graphs)."""

    def partials(self, n: int, device: torch.device) -> torch.Tensor:
        return self.buffer("partials", n, torch.float32, device)


_DEFAULT_WORKSPACE = SkinnyWorkspace(graph_held=True)


@_jit
def _skinny_gemm_kernel(
    x,
    w,
    bias,
    y,
    part,  # SPLIT_K > 1: [SPLIT_K, PARTS, M, N] fp32 partials
    counters,  # SPLIT_K > 1: [cdiv(N, BLOCK_N)] int32 arrivals, zero between launches
    res,  # NORM with HAS_RES: the residual [M, K] added to x before the norm
    res_out,  # NORM with HAS_RES: x + res [M, K], written by the first N tile's programs
    norm_w,  # NORM: the RMSNorm weight [K]
    eps,
    M,
    N,  # output columns (with ACT: half the weight's rows)
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,  # 0: y = x W^T; 1 / 2: W = [gate; up], y = silu / gelu_tanh(gate) * up
    NORM: tl.constexpr,  # x is first (x + res, with HAS_RES) and Llama's RMSNorm of it
    HAS_RES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl.py
):
    """One (N tile, K split): acc [BLOCK_M, BLOCK_N] over this split's whole BLOCK_K chunks
    (and with ACT the up rows' acc beside the gate rows'). With NORM each program first
    finds its rows' RMS over the whole K (cheap at decode's few rows), then normalizes each
    chunk as it loads it."""
    pdl.enter(PDL)
    PARTS: tl.constexpr = 2 if ACT else 1
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    x_rows = x + offs_m[:, None].to(tl.int64) * stride_xm
    res_rows = offs_m[:, None].to(tl.int64) * K  # res and res_out: contiguous [M, K]
    w_rows = w + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = w + (offs_n[:, None] + N).to(tl.int64) * stride_wn  # ACT: the weight's up half
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            h = _normed_input(
                x_rows, res, res_rows, ks, mask_m[:, None] & (ks < K)[None, :], HAS_RES
            )
            hf = h.to(tl.float32)
            sum_sq += tl.sum(hf * hf, 1)
        rstd = tl.rsqrt(sum_sq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < k_hi
        mask_w = mask_n[:, None] & mask_k[None, :]
        mask_x = mask_m[:, None] & mask_k[None, :]
        if NORM:
            h = _normed_input(x_rows, res, res_rows, ks, mask_x, HAS_RES)
            if HAS_RES:
                if pid_n == 0:  # the new residual, each K range by its split
                    tl.store(res_out + res_rows + ks[None, :], h, mask=mask_x)
            # Llama's RMSNorm: normalized in fp32, rounded, then times the weight, rounded
            hn = (h.to(tl.float32) * rstd[:, None]).to(h.dtype)
            nw = tl.load(norm_w + ks, mask=mask_k, other=0.0)
            xt = (nw.to(tl.float32)[None, :] * hn.to(tl.float32)).to(h.dtype)
        else:
            xt = tl.load(x_rows + ks[None, :], mask=mask_x, other=0.0)
        wt = tl.load(w_rows + ks[None, :], mask=mask_w, other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PRECISION)
        if ACT:
            ut = tl.load(up_rows + ks[None, :], mask=mask_w, other=0.0)
            acc_up = tl.dot(xt, tl.trans(ut), acc_up, input_precision=DOT_PRECISION)
    mask = mask_m[:, None] & mask_n[None, :]
    y_ptrs = y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        _skinny_epilogue(acc, acc_up, bias, y_ptrs, offs_n, mask_n, mask, HAS_BIAS, ACT)
    else:
        cells = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        part_k = part + pid_k.to(tl.int64) * PARTS * M * N
        tl.store(part_k + cells, acc, mask=mask)
        if ACT:
            tl.store(part_k + M * N + cells, acc_up, mask=mask)
        if last_to_arrive(counters + pid_n, SPLIT_K):
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            total_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):  # in split order: the sum does not depend on arrival
                part_s = part + s * PARTS * M * N + cells
                total += tl.load(part_s, mask=mask, other=0.0, cache_modifier=".cg")
                if ACT:
                    total_up += tl.load(part_s + M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _skinny_epilogue(total, total_up, bias, y_ptrs, offs_n, mask_n, mask, HAS_BIAS, ACT)


@_jit
def _normed_input(x_rows, res, res_rows, ks, mask, HAS_RES: tl.constexpr):
    """A chunk of the norm's input: x, or x + res rounded to x's dtype as torch's add."""
    h = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res + res_rows + ks[None, :], mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
    return h


@_jit
def _skinny_epilogue(
    acc, acc_up, bias, y_ptrs, offs_n, mask_n, mask, HAS_BIAS: tl.constexpr, ACT: tl.constexpr
):
    """y from the fp32 sums: plus the bias, or (ACT) gate and up rounded to y's dtype as the
    GEMM's output would be, then ``act(gate) * up`` rounded as torch does."""
    dtype = y_ptrs.dtype.element_ty
    if ACT:
        out = act_and_mul(acc.to(dtype), acc_up.to(dtype), ACT == 2)
    else:
        out = acc
        if HAS_BIAS:
            out += tl.load(bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptrs, out.to(dtype), mask=mask)


ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}


def skinny_act_and_mul_torch(x: torch.Tensor, gate_up: torch.Tensor, activation: str):
    """Reference twin of the gate/up projection and its activation: ``act(x G^T) * (x U^T)``
    for ``gate_up = [G; U]``, each rounded as the two ops round."""
    act = fused.silu_and_mul_torch if activation == "silu" else fused.gelu_tanh_and_mul_torch
    return act(F.linear(x, gate_up))


def skinny_norm_gemm_torch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    activation: str | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference twin of the norm in front of a projection: Llama's RMSNorm of x (of
    ``x + residual``, also returned), then the projection (and gate/up's activation)."""
    if residual is None:
        h, new_residual = fused.rms_norm_torch(x, norm_weight, eps), None
    else:
        h, new_residual = fused.fused_add_rms_norm_torch(x, residual, norm_weight, eps)
    if activation is not None:
        return skinny_act_and_mul_torch(h, weight, activation), new_residual
    return F.linear(h, weight, bias), new_residual


def skinny_norm_gemm_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    config: SkinnyConfig | None = None,
    workspace: SkinnyWorkspace | None = None,
    activation: str | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton twin of :func:`skinny_norm_gemm_torch`: the (residual add and) RMSNorm as the
    GEMM's prologue, one launch; x and residual contiguous [M <= 64, K]."""
    assert x.is_contiguous() and norm_weight.is_contiguous() and norm_weight.dtype == x.dtype
    new_residual = None
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous()
        new_residual = torch.empty_like(x)
    norm = (residual, new_residual, norm_weight, eps)
    return _launch(x, weight, bias, config, workspace, activation, norm), new_residual


def skinny_gemm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    workspace: SkinnyWorkspace | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`skinny_gemm_torch` for x [M <= 64, K] (rows may be strided),
    weight [N, K] contiguous; with ``activation`` ("silu", "gelu_tanh") the twin of
    :func:`skinny_act_and_mul_torch` instead (weight = [gate; up], y [M, N / 2], no bias).
    ``config`` defaults to the table's (for the weight's shape), else a generic one.
    CUDA-graph capturable: the grid depends on the shapes only; the workspace keeps its
    addresses once grown."""
    return _launch(x, weight, bias, config, workspace, activation, None)


@_jit
def _gemv_kernel(
    x,
    w,
    bias,
    y,
    M,
    N,  # output columns (with ACT: half the weight's rows)
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,  # as _skinny_gemm_kernel's
    PDL: tl.constexpr = False,  # kernels/pdl.py
):
    """One N tile: its BLOCK_N weight rows (and with ACT their up rows) against each of the
    M <= BLOCK_M rows of x, multiplied and summed over K in fp32 on the CUDA cores. No
    tensor-core tile, no split of K through memory: a program loads its whole slice in
    BLOCK_K chunks (all in flight when K <= BLOCK_K) and reduces it across its threads, so a
    decode projection is one round trip to DRAM and a reduction, not a pipeline's ramp and
    a cross-program merge."""
    pdl.enter(PDL)
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_rows = w + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = w + (offs_n[:, None] + N).to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        mask_w = mask_n[:, None] & mask_k[None, :]
        wt = tl.load(w_rows + ks[None, :], mask=mask_w, other=0.0).to(tl.float32)
        if ACT:
            ut = tl.load(up_rows + ks[None, :], mask=mask_w, other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            xm = tl.load(x + m * stride_xm + ks, mask=mask_k & (m < M), other=0.0)
            xm = xm.to(tl.float32)[None, :]
            row = offs_m[:, None] == m
            acc += tl.where(row, tl.sum(wt * xm, 1)[None, :], 0.0)
            if ACT:
                acc_up += tl.where(row, tl.sum(ut * xm, 1)[None, :], 0.0)
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    y_ptrs = y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    _skinny_epilogue(acc, acc_up, bias, y_ptrs, offs_n, mask_n, mask, HAS_BIAS, ACT)


def _launch_gemv(x, weight, bias, cfg, act, y) -> torch.Tensor:
    m, k = x.shape
    n = y.shape[1]
    assert m <= GEMV_MAX_M and cfg.split_k == 1
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, weight if bias is None else bias, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        HAS_BIAS=bias is not None, ACT=act,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
        **pdl.launch(x.device),
    )  # fmt: skip
    return y


def _launch(x, weight, bias, config, workspace, activation, norm) -> torch.Tensor:
    """The kernel's one launch; ``norm``: (residual, new residual, norm weight, eps) or None."""
    m, k = x.shape
    rows = weight.shape[0]
    assert m <= MAX_M and weight.shape[1] == k and weight.is_contiguous() and x.stride(-1) == 1
    act = ACTIVATIONS[activation] if activation is not None else 0
    assert not act or (bias is None and rows % 2 == 0)
    n = rows // 2 if act else rows
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or table_config(m, rows, k) or SkinnyConfig(64, 128, 1)
    if cfg.gemv:
        if norm is None and m <= GEMV_MAX_M:
            return _launch_gemv(x, weight, bias, cfg, act, y)
        cfg = generic_config(n, k)  # a norm in front, or more rows: the tensor-core kernel
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    ws = workspace if workspace is not None else _DEFAULT_WORKSPACE
    part, counters = y, y  # unused with one split
    if cfg.split_k > 1:
        part = ws.partials(cfg.split_k * (2 if act else 1) * m * n, x.device)
        counters = ws.counters(grid[0], x.device)
    residual, new_residual, norm_weight, eps = norm or (None, None, None, 0.0)
    _skinny_gemm_kernel[grid](
        x, weight, weight if bias is None else bias, y, part, counters,
        x if residual is None else residual, y if new_residual is None else new_residual,
        weight if norm_weight is None else norm_weight, eps, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None, ACT=act, NORM=norm is not None,
        HAS_RES=residual is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
        **pdl.launch(x.device),
    )  # fmt: skip
    return y
