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


def _kernel_ptx(kernel, consts: dict, types: dict[str, str]) -> list[str]:
    """The PTX body lines of ``kernel`` compiled for sm_90; parameters not in ``consts`` or
    ``types`` are i32."""
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
