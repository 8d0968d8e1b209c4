"""The GPU engine tests' shared pieces: a small dummy-weight Qwen3 (``QWEN3_SMALL``, written by
the ``small_dir`` fixture of tests/conftest.py), engines over it with graphs on or off, a
workload over every bucket, HF parity in float32 and bfloat16, a step that must not sync the
host, and the warm-up script that counts compilations after ready."""

from __future__ import annotations

import json

import torch

from breakgraph.engine.args import EngineArgs
from breakgraph.engine.engine import Engine
from breakgraph.engine.request import SamplingParams
from tests.support.hf import LogitsTap

QWEN3_SMALL = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
}
BUCKETS = [16, 32, 64, 128]


def engine(path, graphs: bool, dtype="float32", **kw) -> Engine:
    args = EngineArgs(
        model_path=str(path),
        load_format="dummy",
        dtype=dtype,
        device="cuda",
        max_total_tokens=8192,
        chunked_prefill_size=128,
        max_running_requests=32,
        cuda_graph_max_bs=16,
        cuda_graph_bs_prefill=BUCKETS,
        disable_cuda_graph=not graphs,
        cuda_graph_backend_prefill="breakable" if graphs else "disabled",
    )
    for k, v in kw.items():
        setattr(args, k, v)
    return Engine(args)


def workload(seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(5, 1000, (n,), generator=g).tolist()  # noqa: E731
    shared = rand(40)
    waves = [
        [rand(n) for n in (1, 16, 17, 31, 64, 100, 128)],  # every bucket, ragged in one step
        [shared + rand(3), shared + rand(1), rand(300)],  # prefix hits and a chunked prompt
        [rand(7) for _ in range(20)],  # decode batches from 20 down, over the graph max (16)
    ]
    return shared, waves


def run_workload(eng: Engine, seed=0):
    shared, waves = workload(seed)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    eng.generate([shared], sp)  # cache the shared prefix
    return [[r.output_ids for r in eng.generate(w, sp)] for w in waves]


def assert_hf_parity(hf, path, prompts, **engine_kw):
    """Last-token logits of ``prompts`` (one batch, graphs on) against HF on the GPU.

    float32: the engine within 2e-3 of HF in float32. bfloat16: both the engine and HF in
    bf16 are compared with HF's float32 logits; the engine's error may be at most twice HF's
    own bf16 error (plus 1% of the logit scale), since two correct bf16 paths differ by their
    rounding, not by a fixed tolerance (a router top-k near a tie moves both the same way).
    """
    assert sum(map(len, prompts)) <= max(BUCKETS), (
        "one prefill step in a graph: the tap reads step 0"
    )
    hf = hf.cuda().float()
    hf.save_pretrained(path)
    sp = SamplingParams(max_new_tokens=1, temperature=0.0)
    got = {}
    for dtype in ("float32", "bfloat16"):
        eng = engine(
            path, graphs=True, dtype=dtype, load_format="auto", max_total_tokens=2048, **engine_kw
        )
        tap = LogitsTap(eng)
        eng.generate(prompts, sp)
        got[dtype] = tap.steps[0]
        del eng
    with torch.no_grad():
        ref = torch.stack(
            [hf(input_ids=torch.tensor([p], device="cuda")).logits[0, -1] for p in prompts]
        )
        hf16 = hf.to(torch.bfloat16)
        ref16 = torch.stack(
            [hf16(input_ids=torch.tensor([p], device="cuda")).logits[0, -1] for p in prompts]
        )
    ref, ref16 = ref.float(), ref16.float()
    torch.testing.assert_close(got["float32"], ref, atol=2e-3, rtol=2e-3)
    scale = ref.abs().amax(dim=-1)
    err = (got["bfloat16"] - ref).abs().amax(dim=-1)
    hf_err = (ref16 - ref).abs().amax(dim=-1)
    assert bool((err <= 2 * hf_err + 1e-2 * scale).all()), (
        err.tolist(),
        hf_err.tolist(),
        scale.tolist(),
    )


def no_host_sync(fn):
    """``fn`` made to raise on any host sync (sync debug mode "error") while it runs."""

    def wrapped(*a, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return wrapped


def forbid_host_syncs_in_steps(eng: Engine) -> None:
    """Make ``schedule`` and ``launch`` raise on any host sync (sync debug mode "error")."""
    sched = eng.scheduler
    sched.schedule, sched.launch = no_host_sync(sched.schedule), no_host_sync(sched.launch)


WARMUP_SCRIPT = r"""
import json, logging, random, sys
from breakgraph.engine.args import EngineArgs
from breakgraph.engine.engine import Engine
from breakgraph.engine.request import SamplingParams
from breakgraph.kernels import jit_watch

class Keep(logging.Handler):  # the after-ready warnings name each argument's specialization
    seen = []
    def emit(self, record):
        self.seen.append(record.getMessage())
logging.getLogger("breakgraph.kernels.jit_watch").addHandler(Keep())
eng = Engine(EngineArgs(model_path=sys.argv[1], load_format="dummy", device="cuda",
    max_total_tokens=60000, chunked_prefill_size=1024, max_running_requests=48,
    cuda_graph_max_bs=32, context_length=20000, warmups=sys.argv[2]))
report = eng.run_warmups()
jit_watch.mark_ready()
rng = random.Random(7)
hi = min(1000, eng.vocab_size)
rand = lambda n: [rng.randrange(5, hi) for _ in range(n)]
base = rand(333)
sp = [SamplingParams(max_new_tokens=3, temperature=t, ignore_eos=True) for t in (0.0, 0.9)]
eng.generate([base], sp[0])
work = [[base + rand(e)] for e in (1, 32, 5, 700)] + [[rand(n)] for n in (2500, 900, 48, 3)]
work += [[rand(9) for _ in range(40)], [rand(20) for _ in range(12)]]
long = rand(12000)  # past DIRECT_MIN_KEYS: the split kernel split and unsplit (2K new tokens)
work += [[long], [long + rand(1)], [long + rand(77)], [long + rand(1000)], [long + rand(2000)]]
# bursts of every batch residue (mod 4 and 16) and both token-count parities, as serving
# traffic admits them; batched prefix hits; decode batches shrinking one by one
for burst in (2, 6, 10, 3, 5, 13, 14, 22, 30, 34, 46, 17):
    work.append([rand(rng.randrange(1, 160)) for _ in range(burst)])
    work.append([base + rand(rng.randrange(1, 60)) for _ in range(burst % 9 + 1)])
for prompts in work:
    eng.generate(prompts, [sp[i % 2] for i in range(len(prompts))])
varied = [SamplingParams(max_new_tokens=1 + i, temperature=0.0, ignore_eos=True) for i in range(46)]
eng.generate([rand(2 * i + 2) for i in range(46)], varied)
st = jit_watch.stats()
print(json.dumps({"warmup_requests": report.requests if report else 0,
                  "after_ready": st.after_ready, "names": Keep.seen or st.names_after_ready}))
"""


def run_script(script: str, *argv, timeout: float = 300) -> dict:
    """Run ``script`` in a fresh process (its own JIT counters) -> its last line as JSON."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", script, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
