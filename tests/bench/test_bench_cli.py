"""``breakgraph bench``'s one entry point: every bench a subcommand, the parser free of the
benches' own dependencies, the CUDA benches' clear refusal on the CPU, and the pure parts of
the GPU-only options (the decode variants' tables, the MoE A/B's arms, the GEMV sweep's
table, ``bench step --profile``'s report)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from breakgraph.bench.args import BENCHES

CUDA_ONLY = {  # a bench or option that needs CUDA -> the arguments of a short run of it
    "moe": ["moe", "--tokens", "1"],
    "gemm": ["gemm", "--m", "1"],
    "kernels": ["kernels"],
    "allreduce": ["allreduce"],
    "decode --variants": ["decode", "--variants", "base", "nogemv", "--batch-sizes", "1"],
}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "breakgraph.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_the_parser_imports_neither_torch_nor_the_benches_dependencies():
    """``breakgraph serve --help`` and every bench's flags build without torch, aiohttp or
    matplotlib: those load only when a bench runs (aiohttp and matplotlib are the ``bench``
    extra's); and no bench's flag shadows the subcommand's name."""
    code = (
        "import sys; from breakgraph.cli import build_parser; p = build_parser(); "
        "assert all(p.parse_args(['bench', b, *a]).bench == b for b, a in "
        "[('step', []), ('decode', []), ('prefill', ['cold', '8', '1']), ('serving', []), "
        "('host', ['decode']), ('moe', []), ('gemm', []), ('kernels', []), ('allreduce', []), "
        "('plot', ['step', 'x.json', '-o', 'x.png'])]); "
        "print(sorted(m for m in ('torch', 'aiohttp', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_bench_is_a_subcommand():
    out = run_cli("bench", "--help")
    assert out.returncode == 0, out.stderr
    for name, (_, _, target) in BENCHES.items():
        assert re.search(rf"^    {name}\b", out.stdout, re.M), (name, out.stdout)
        module, _, func = target.partition(":")
        assert callable(getattr(__import__(module, fromlist=[func]), func)), target


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="the CPU's answer to a CUDA-only bench"
)
@pytest.mark.parametrize("bench", sorted(CUDA_ONLY))
def test_cuda_only_benches_say_so_on_the_cpu(bench):
    """A CUDA-only bench or option on a machine without one exits non-zero with one line
    saying why, not a traceback."""
    out = run_cli("bench", *CUDA_ONLY[bench])
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: bench {bench} needs"), out.stderr
    assert "Traceback" not in out.stderr


def test_decode_variants_set_the_tables_they_name(tmp_path):
    """``bench decode --variants``: ``nogemv`` keeps every skinny-table entry but the GEMV
    kernel's (batch 1 back on the tensor-core kernel or cuBLAS); ``skinny=PATH`` serves the
    table a sweep wrote; ``moegemv<N>`` bounds the MoE GEMV path; ``a+b`` both; and the
    shipped tables and knobs are back after the capture."""
    from breakgraph.bench.decode_variants import switches, variant
    from breakgraph.common import envs
    from breakgraph.kernels import skinny_gemm as sg

    shipped = sg.SKINNY_TABLE
    rows = sum(len(e) for e in shipped.values())
    gemv_rows = sum(1 for e in shipped.values() for _, c in e if c is not None and c.gemv)
    with variant("nogemv", "qwen3-0.6b"):
        assert sg.SKINNY_TABLE.keys() == shipped.keys()
        assert sum(len(e) for e in sg.SKINNY_TABLE.values()) == rows - gemv_rows > 0
        assert not any(c is not None and c.gemv for e in sg.SKINNY_TABLE.values() for _, c in e)
    assert sg.SKINNY_TABLE is shipped

    gemv = sg.SkinnyConfig(4, 1024, 1, 2, 2, fuse_norm=False, gemv=True)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(sg.table_to_json({(4096, 1024): [(1, gemv)]})))
    default_gemv = envs.MOE_GEMV.get()
    with variant(f"skinny={path}+moegemv0", "qwen3-0.6b"):
        assert sg.table_config(1, 4096, 1024) == gemv and sg.table_config(2, 4096, 1024) is None
        assert envs.MOE_GEMV.get() == 0
    assert envs.MOE_GEMV.get() == default_gemv > 0
    assert sg.table_config(1, 4096, 1024) == next(c for m, c in shipped[(4096, 1024)] if m >= 1)
    with pytest.raises(SystemExit, match="unknown decode variant 'merge'"):
        switches("merge", "qwen3-0.6b")


def test_moe_ab_arms():
    """``bench moe --ab``: a variant flag off (A) and on (B) at the table's config, or the
    table's tile (A) against one GEMM's tile replaced (B); anything else is a usage error."""
    from breakgraph.bench.moe_tune import ab_configs, parse_ab
    from breakgraph.kernels import fused_moe as fm

    table = fm.moe_config(4096, 8, 128)
    name, tile = parse_ab("half_tail")
    arms = ab_configs(table, name, tile)
    assert (arms["A"].half_tail, arms["B"].half_tail) == (False, True)
    assert arms["A"]._replace(half_tail=True) == arms["B"]
    name, tile = parse_ab("gate_up=64,64,8,4")
    arms = ab_configs(table, name, tile)
    assert arms["A"] == table and arms["B"].gate_up == (64, 64, 8, 4)
    assert arms["B"].down == table.down
    for bad in ("gate_up=64,64,8", "up=64,64,8,4", "no_such_flag"):
        with pytest.raises(SystemExit, match="--ab"):
            parse_ab(bad)


def test_gemv_sweep_table_takes_each_shapes_best_at_one_row():
    """``bench gemm --gemv --table-out``: each swept shape's one-row entry is the sweep's best
    config, its entries for more rows as the shipped table has them."""
    from breakgraph.bench.gemv import swept_table
    from breakgraph.kernels import skinny_gemm as sg

    shape = next(s for s, e in sg.SKINNY_TABLE.items() if len(e) > 1)
    best = sg.SkinnyConfig(8, 512, 1, 1, 3, fuse_norm=False, gemv=True)
    table = swept_table([{"n": shape[0], "k": shape[1], "best": best._asdict()}])
    assert table[shape][0] == (1, best)
    assert table[shape][1:] == [(m, c) for m, c in sg.SKINNY_TABLE[shape] if m > 1]
    assert {s: e for s, e in table.items() if s != shape} == {
        s: e for s, e in sg.SKINNY_TABLE.items() if s != shape
    }


def test_step_profile_report_sets_each_arm_against_the_floor(monkeypatch):
    """``bench step --profile``'s report: a row per profiled arm (wall, span, busy, delay),
    then each graph arm's kernels beside the floor's time for the same kernel, and the
    kernels the floor does not run."""
    from breakgraph.bench import step

    profiles = {
        "graphs": {"wall": 2.0, "span": 1.5, "busy": 1.2, "delay": 0.3,
                   "kernels": [("gemm", 800.0), ("attention", 300.0), ("copy", 100.0)]},
        "floor": {"wall": 1.6, "span": 1.4, "busy": 1.3, "delay": 0.1,
                  "kernels": [("gemm", 790.0), ("attention", 310.0)]},
    }  # fmt: skip
    monkeypatch.setattr(step, "profile_arm", lambda fn, calls: profiles[fn])
    report = step.format_profile({"graphs": "graphs", "floor": "floor"}, "floor")
    lines = report.splitlines()
    assert lines[1].split() == ["graphs", "2.000", "1.500", "1.200", "0.300"]
    assert lines[2].split() == ["floor", "1.600", "1.400", "1.300", "0.100"]
    assert lines[3].startswith("  graphs: kernels by time")
    assert lines[4].split() == ["800.0", "790.0", "gemm"]
    assert lines[6].split() == ["100.0", "0.0", "copy"]
    assert lines[7].split() == ["100.0", "not", "in", "floor", "copy"]
    assert not any(line.startswith("  floor:") for line in lines)


def test_busy_time_merges_overlapping_kernels():
    """The GPU's busy time counts two overlapping kernels once and an idle gap not at all."""
    from breakgraph.bench.timing import busy_us

    assert busy_us([(0, 10, "a"), (5, 12, "b"), (20, 25, "c"), (21, 22, "d")]) == 17
    assert busy_us([]) == 0


def test_missing_bench_dependencies_say_how_to_install_them(monkeypatch):
    """The ``bench`` extra's packages load only when a bench needs them, and a missing one
    names the extra instead of failing with a bare import error."""
    from breakgraph.bench import http_client
    from breakgraph.bench.hf import HFArms

    monkeypatch.setattr(http_client, "aiohttp", None)
    with pytest.raises(SystemExit, match=r"need aiohttp: pip install 'breakgraph\[bench\]'"):
        http_client.ServerClient("http://127.0.0.1:1")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"need transformers: pip install 'breakgraph\[bench\]'"):
        HFArms(None, compile_timeout_s=1)
