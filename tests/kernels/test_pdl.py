"""Programmatic dependent launch (kernels/pdl.py) on the CPU: off unless asked and never
on a CPU device; with PDL a kernel compiled for Hopper waits for its predecessor before
anything else and then lets its successor in (PTX from Triton's compiler, no GPU needed);
without it the kernel is the plain one."""

from __future__ import annotations

import inspect

import pytest
import torch

from breakgraph.common import envs
from breakgraph.kernels import pdl

triton = pytest.importorskip("triton")


def test_launch_arguments_only_when_enabled_on_cuda():
    with envs.PDL.override("0"), pdl.scope(1):
        assert pdl.launch(torch.device("cuda", 0)) == {}
    with envs.PDL.override("1"):
        assert pdl.launch(torch.device("cpu")) == {}


def test_auto_only_inside_small_decode_graphs():
    """``auto``: on inside scope() of a batch up to AUTO_MAX_BATCH, off outside it and for
    larger batches; scopes nest and restore. The mode is read at each launch."""
    with envs.PDL.override("auto"):
        assert not pdl.enabled()
        with pdl.scope(1):
            assert pdl.enabled()
            with pdl.scope(pdl.AUTO_MAX_BATCH + 1):
                assert not pdl.enabled()
            assert pdl.enabled()
        with pdl.scope(pdl.AUTO_MAX_BATCH):
            assert pdl.enabled()
        assert not pdl.enabled()
    with envs.PDL.override("1"):
        assert pdl.enabled()


def _kernel_ptx(
    kernel, consts: dict, types: dict[str, str], options: dict | None = None
) -> list[str]:
    """The PTX body lines of ``kernel`` compiled for sm_90 (with the launch's compile
    ``options``); parameters not in ``consts`` or ``types`` are i32."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = inspect.signature(kernel.fn).parameters
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in params}
    try:
        # compiled afresh, its IR kept: a cache entry may hold only the binary (the device
        # machine's carried cache, benchmarks/device_env.sh)
        with triton.knobs.compilation.scope():
            triton.knobs.compilation.always_compile = True
            triton.knobs.compilation.store_binary_only = False
            compiled = triton.compile(
                ASTSource(fn=kernel, signature=sig, constexprs=consts),
                target=GPUTarget("cuda", 90, 32),
                options=options,
            )
    except RuntimeError as e:  # a Triton without its CUDA toolchain
        pytest.skip(f"Triton cannot compile for sm_90 here: {e}")
    body = compiled.asm["ptx"].split("{", 1)[1]  # the kernel's body, after its parameters
    return [line.strip() for line in body.splitlines() if line.strip()]


def _ptx(use_pdl: bool) -> list[str]:
    from breakgraph.kernels.fused import _act_and_mul_kernel as kernel

    consts = {"BLOCK": 1024, "GELU": False, "PDL": use_pdl}
    return _kernel_ptx(kernel, consts, dict.fromkeys(("gate_ptr", "up_ptr", "out"), "*bf16"))


def test_dependent_kernel_waits_first_then_lets_its_successor_in():
    lines = _ptx(True)
    grid = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol")]
    assert [lines[i].split(";")[0] for i in grid] == [
        "griddepcontrol.wait",
        "griddepcontrol.launch_dependents",
    ]
    first_load = next(i for i, line in enumerate(lines) if "ld.global" in line)
    assert grid[0] < first_load  # nothing a predecessor writes is read before the wait
    assert not [line for line in _ptx(False) if "griddepcontrol" in line]


@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("use_pdl", [False, True])
def test_decode_attention_compiles_for_hopper(sliding, use_pdl):
    """Decode attention's split and merge kernels build for sm_90 (ptxas included) in each
    variant the decode graphs capture: the interpreter's CPU tests check what they compute,
    not that the compiler accepts them (the run detection of a verify step's rows: scalar
    and vector loads of the neighbours' metadata, a data-dependent branch)."""
    from breakgraph.kernels import decode_attention as dec

    ptrs = {"q": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "req_to_token": "*i32",
            "req_pool_indices": "*i64", "seq_lens": "*i32", "part_o": "*fp32",
            "part_lse": "*fp32", "qk_scale": "fp32", "o": "*bf16"}  # fmt: skip
    split = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_H=16, BLOCK_N=64, NUM_SPLITS=128,
                 DOT_PRECISION="tf32", SLIDING=sliding, PDL=use_pdl)  # fmt: skip
    lines = _kernel_ptx(dec._decode_split_kernel, split, ptrs)
    assert any(line.startswith("griddepcontrol.wait") for line in lines) == use_pdl
    merge = dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=128, BLOCK_S=128, PDL=use_pdl)
    assert _kernel_ptx(dec._decode_reduce_kernel, merge, ptrs)


def test_rope_tail_compiles_for_hopper():
    """DeepSeek V4's interleaved RoPE kernel (the tail's channels only, in place, a tile of
    rows a program) builds for sm_90 (ptxas included)."""
    from breakgraph.kernels import fused

    consts = {"HALF": 32, "INVERSE": True, "ROWS": 32, "PDL": True}
    types = {"x": "*bf16"} | dict.fromkeys(("cos", "sin"), "*fp32")
    lines = _kernel_ptx(fused._rope_tail_in_place_kernel, consts, types, {"num_warps": 4})
    assert any(line.startswith("griddepcontrol.wait") for line in lines)


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("config", [(64, 32, 8, 2), (16, 16, 4, 3)])
def test_sparse_attention_compiles_for_hopper(config, rope):
    """DeepSeek V4's sparse attention at its shapes (64 heads of 512; q normed and roped and
    the output's rope undone inside, or not) in its two default configs, and its
    merge build for sm_90: the interpreter runs the reshapes and splits of the pair
    rotation, not the compiler's layouts for them."""
    from breakgraph.kernels import compressed_attention as ca

    block_h, block_n, warps, stages = config
    types = dict.fromkeys(("q", "kv_cache", "comp_cache", "out"), "*bf16")
    types |= dict.fromkeys(("part_o", "part_lse", "sinks", "cos", "sin"), "*fp32")
    types |= dict.fromkeys(("positions", "token_rows", "picks"), "*i64")
    types |= {"req_to_token": "*i32", "scale": "fp32", "eps": "fp32"}
    splits = 1 if block_h == 64 else 4
    consts = dict(WINDOW=128, RATIO=4, MODE=2, D=512, BLOCK_H=block_h, BLOCK_N=block_n,
                  SPLITS=splits, IEEE=False, ROPE=rope, HALF=32)  # fmt: skip
    options = {"num_warps": warps, "num_stages": stages}
    assert _kernel_ptx(ca._sparse_attention_kernel, consts, types, options)
    merge = dict(D=512, SPLITS=4, ROPE=rope, HALF=32)
    types = dict.fromkeys(("part_o", "part_lse", "sinks", "cos", "sin"), "*fp32") | {"out": "*bf16"}
    assert _kernel_ptx(ca._sparse_merge_kernel, merge, types, {"num_warps": 4})


def test_clamped_swiglu_compiles_for_hopper():
    """The activation kernel with DeepSeek V4's clamps builds for sm_90 (ptxas included)."""
    from breakgraph.kernels.fused import _act_and_mul_kernel as kernel

    consts = {"BLOCK": 1024, "GELU": False, "CLAMP": True, "PDL": False}
    types = dict.fromkeys(("gate_ptr", "up_ptr", "out"), "*bf16") | {"limit": "fp32"}
    assert _kernel_ptx(kernel, consts, types)


def test_penalty_apply_compiles_for_hopper():
    """The penalty pool's one-pass apply builds for sm_90 (ptxas included), with IEEE
    division (``div.rn``, the twin's), and waits for its predecessor under PDL."""
    from breakgraph.kernels.penalties import _apply_penalties_kernel as kernel

    consts = {"BLOCK": 2048, "PDL": True}
    types = dict.fromkeys(("logits", "out", "counts", "bias", "row_params"), "*fp32")
    types |= dict.fromkeys(("prompt_seen", "banned"), "*i1") | {"rows": "*i64"}
    types |= dict.fromkeys(("min_new", "generated"), "*i32")
    lines = _kernel_ptx(kernel, consts, types, {"enable_fp_fusion": False})
    assert any(line.startswith("div.rn.f32") for line in lines)
    assert not any(line.startswith("fma.") for line in lines)
    assert lines[[i for i, s in enumerate(lines) if s.startswith("griddep")][0]].startswith(
        "griddepcontrol.wait"
    )


def test_no_kernel_parameter_shadows_tritons_argument_binder():
    """Triton binds a launch's arguments in a generated function whose locals are ``params``,
    ``specialization`` and ``options``: a kernel parameter of one of those names reaches the
    specializer as that local (``TypeError: failed to specialize argument of type: dict`` at
    the first launch on a GPU; the interpreter and the sm_90 compile tests do not bind)."""
    import importlib
    import pkgutil

    import breakgraph.kernels as pkg

    reserved = {"params", "specialization", "options"}
    kernels = 0
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"breakgraph.kernels.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.JITFunction):
                kernels += 1
                clash = reserved & set(inspect.signature(obj.fn).parameters)
                assert not clash, f"{info.name}.{name}: parameter {clash} shadows the binder"
    assert kernels > 20


def test_norm_rope_tail_compiles_for_hopper():
    """DeepSeek V4's norm + RoPE + store kernel builds for sm_90 (ptxas included), both
    norms, storing or not, a row or a tile of rows a program."""
    from breakgraph.kernels.fused import _norm_rope_tail_kernel as kernel

    types = dict.fromkeys(("x", "out"), "*bf16") | dict.fromkeys(("weight", "cos", "sin"), "*fp32")
    types |= {"loc": "*i64", "eps": "fp32"}
    for weighted, store, rows in ((False, False, 4), (True, True, 4), (True, True, 1)):
        consts = {"HALF": 32, "BLOCK": 512, "WEIGHTED": weighted, "STORE": store, "ROWS": rows,
                  "PDL": True}  # fmt: skip
        assert _kernel_ptx(kernel, consts, types, {"enable_fp_fusion": False})


def test_moe_gated_epilogues_compile_for_hopper():
    """The MoE GEMV path's gate/up kernel with DeepSeek V4's clamp, and the grouped GEMM's
    gated (fused activation) variant, both through ``_gated``, build for sm_90."""
    from breakgraph.kernels import fused_moe as fm

    types = dict.fromkeys(("x", "w", "h"), "*bf16") | {"topk_ids": "*i32", "limit": "fp32"}
    consts = {"TOP_K": 6, "BLOCK_N": 64, "BLOCK_K": 128, "K_CHUNKS": 4, "GELU": False,
              "CLAMP": True, "PDL": False}  # fmt: skip
    assert _kernel_ptx(fm._moe_gemv_gate_up_kernel, consts, types)
    types = dict.fromkeys(("a", "a_half", "b", "c"), "*bf16") | {"topk_weights": "*fp32"}
    types |= dict.fromkeys(("sorted_ids", "expert_ids", "num_post_padded"), "*i32")
    consts = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "A_PER_TOKEN": True,
              "A_SORTED": False, "C_SORTED": False, "GATED": True, "GELU": False,
              "MUL_WEIGHT": False, "IEEE": False, "B_TMA": False, "A_TMA": False,
              "PERSISTENT": False, "HALF_TAIL": False, "C_ATOMIC": False,
              "RED_V8": False}  # fmt: skip
    assert _kernel_ptx(fm._moe_gemm_kernel, consts, types)


@pytest.mark.parametrize("cols", [24, 4])
def test_hc_mixes_compiles_for_hopper(cols):
    """DeepSeek V4's hyper-connection mixes (bf16 rows against float32 weights, 3xTF32 on
    the tensor cores) build for sm_90 in its config, for the sites' 24 columns and the
    hyper head's 4 (a dot of 16 columns)."""
    from breakgraph.kernels import hyper_connection as hc

    block_t, block_k, warps, stages = hc.MIXES_CONFIG
    consts = dict(BLOCK_T=block_t, BLOCK_N=max(16, triton.next_power_of_2(cols)), BLOCK_K=block_k)
    types = {"x": "*bf16", "fn": "*fp32", "out": "*fp32"}
    options = {"num_warps": warps, "num_stages": stages}
    assert _kernel_ptx(hc._hc_mixes_kernel, consts, types, options)
