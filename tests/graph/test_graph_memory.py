"""What a captured graph reads by address survives other users of the process: a break
returning several tensors is refused, captures allocate only in their pool (no compile),
poisoned free memory and torch.compile's CUDA-graph trees change no replay."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from breakgraph.graph import BreakableGraph, GraphBank, StaticInput, eager_break, smallest_bucket
from tests.support.gpu_memory import poison_free_memory

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@eager_break
def two_outputs(x: torch.Tensor):
    return x * 2, x + 1


def test_break_returning_a_tuple_raises_at_capture():
    x = torch.randn(8, 8, device="cuda")
    graph = BreakableGraph()
    with pytest.raises(TypeError, match="must return None or one tensor"):
        graph.capture(lambda: two_outputs(x)[0] + 1)
    assert not torch.cuda.is_current_stream_capturing()
    ok = BreakableGraph()  # the failed capture left nothing half-open
    out = ok.capture(lambda: x @ x)
    ok.replay()
    torch.testing.assert_close(out, x @ x)


LIVE = {}


@eager_break
def scaled(h: torch.Tensor) -> torch.Tensor:
    """Returns a new tensor (kept by the graph) computed from live state."""
    return h * LIVE["scale"][: h.shape[0], None]


class Mlp(nn.Module):
    """bf16 GEMMs large enough, and small-M with a long K, that cuBLAS uses its workspace."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(1024, 8192)
        self.b = nn.Linear(8192, 1024)

    def forward(self, x):
        return self.b(scaled(torch.relu(self.a(x))))


def test_replay_survives_poisoned_free_memory_and_workspace_clears():
    torch.manual_seed(0)
    net = Mlp().cuda().to(torch.bfloat16)
    sizes = [16, 64, 256, 1024, 8192]
    bank = GraphBank(
        lambda x: net(x), [StaticInput("x", torch.bfloat16, (1024,))], sizes, "cuda",
        guard_tensors=lambda: net.parameters(), check_addresses=True,
    )  # fmt: skip
    LIVE["scale"] = torch.ones(8192, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        bank.capture(progress=False)
        rows = (5, 64, 200, 1000, 8000)
        inputs = {n: torch.randn(n, 1024, device="cuda", dtype=torch.bfloat16) for n in rows}
        LIVE["scale"] = torch.rand(8192, device="cuda", dtype=torch.bfloat16)
        bucket = {n: smallest_bucket(sizes, n) for n in rows}
        ref = {n: bank.replay(bucket[n], n, x=x)[:n].clone() for n, x in inputs.items()}
        for n, x in inputs.items():  # the graph computes what eager computes
            torch.testing.assert_close(ref[n], net(x), rtol=2e-2, atol=2e-2)
        poison = poison_free_memory()
        for n, x in inputs.items():
            out = bank.replay(bucket[n], n, x=x)[:n]
            assert torch.equal(out, ref[n]), f"replay of {n} rows changed after poisoning"
        # nor did the replays write into memory they do not own (e.g. a freed workspace)
        assert all(bool((t == 255).all()) for t in poison), "a replay wrote into freed memory"
        del poison


COMPILE_SCRIPT = r"""
import json, sys, torch
from breakgraph.engine.args import EngineArgs
from breakgraph.engine.engine import Engine
from breakgraph.engine.request import SamplingParams
sys.path.insert(0, sys.argv[2])
from tests.support.gpu_memory import poison_free_memory

mode = sys.argv[3]
eng = Engine(EngineArgs(model_path=sys.argv[1], load_format="dummy", dtype="float32",
    device="cuda", max_total_tokens=8192, chunked_prefill_size=128, max_running_requests=32,
    cuda_graph_max_bs=16, cuda_graph_bs_prefill=[16, 32, 64, 128]))
logits = []
inner = eng.scheduler.forward
def tap(batch):
    out = inner(batch)
    logits.append(out.float().cpu())
    return out
eng.scheduler.forward = tap
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (3, 17, 60, 100, 128)]
sp = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
if mode == "compile":
    # another CUDA-graph user in the process: inductor's graph trees record and replay
    # (clearing cuBLAS workspaces and emptying the cache) between our captures and replays
    torch.manual_seed(1)
    mlp = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                              torch.nn.Linear(2048, 512)).cuda()
    fn = torch.compile(mlp, mode="reduce-overhead")
    with torch.no_grad():
        for rows in (8, 64, 512, 8, 64):
            for _ in range(3):
                fn(torch.randn(rows, 512, device="cuda"))
    torch.cuda.synchronize()
    poison = poison_free_memory()
tokens = [r.output_ids for r in eng.generate(prompts, sp)]
tokens += [r.output_ids for r in eng.generate([p[:9] for p in prompts], sp)]
runner = eng.runner
counts = {"prefill": runner.count("prefill", "prefill_whole"),
          "decode": runner.count("decode", "decode_long", "decode_penalized")}
pool = eng.runner.kv_pool
slot0 = all(bool(torch.isfinite(b[0]).all()) for b in pool.k_buffers + pool.v_buffers)
torch.save(logits, sys.argv[4])
print(json.dumps({"tokens": tokens, "counts": counts, "slot0_finite": slot0}))
"""


def test_torch_compile_graph_trees_beside_breakgraph(tmp_path):
    """Same engine workload in two processes, one running a module under
    torch.compile(mode="reduce-overhead") after breakgraph captured: identical results."""
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 64, "vocab_size": 1000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": True,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    root = str(Path(__file__).resolve().parents[2])  # the repository: tests.support imports
    results = {}
    for mode in ("plain", "compile"):
        out = subprocess.run(
            [sys.executable, "-c", COMPILE_SCRIPT, str(tmp_path), root, mode,
             str(tmp_path / f"{mode}.pt")],
            capture_output=True, text=True, timeout=400,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-4000:]
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["compile"]["tokens"] == results["plain"]["tokens"]
    assert results["compile"]["slot0_finite"], "padding rows wrote NaN/Inf into KV slot 0"
    counts = results["compile"]["counts"]
    assert counts["prefill"] > 0 and counts["decode"] > 0
    plain = torch.load(tmp_path / "plain.pt")
    compiled = torch.load(tmp_path / "compile.pt")
    assert len(plain) == len(compiled)
    for a, b in zip(plain, compiled, strict=True):
        assert torch.equal(a, b)
