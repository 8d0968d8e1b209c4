"""CPU prefill time of the embedded model (SmolLM2-135M) at N tokens: one request, nothing
cached. Usage: python3 benchmarks/cpu_prefill.py 1024 2048 4096 8000"""

import sys
import time

import torch

from breakgraph.engine.args import EngineArgs
from breakgraph.engine.engine import Engine
from breakgraph.engine.request import SamplingParams

engine = Engine(
    EngineArgs(
        device="cpu", max_total_tokens=9000, chunked_prefill_size=8192, disable_radix_cache=True
    )
)
greedy = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
gen = torch.Generator().manual_seed(0)
for n in map(int, sys.argv[1:]):
    ids = torch.randint(100, 20000, (n,), generator=gen).tolist()
    t0 = time.perf_counter()
    engine.generate([ids], greedy)
    print(f"{n} tokens: {time.perf_counter() - t0:.2f} s", flush=True)
