"""``breakgraph bench allreduce``: all-reduce per message size on the GPUs of one host, NCCL
against the one-shot all-reduce over symmetric memory (the engine's default on CUDA; also
with a copy kernel staging its input, the path before torch's fused-copy op), same run, both
as the decode graphs run them: ``--ops`` consecutive all-reduces captured in one CUDA graph,
replayed; µs per op. ``--norm-rows`` adds the fused all-reduce + residual add + RMSNorm.

bf16 messages (a decode step's hidden states: batch x hidden x 2 bytes; 8 KB is one row of
a 4096-wide model). Prints a row per size and whether the two paths agree; the crossing is
``ONE_SHOT_MAX_BYTES`` in ``distributed/group.py``. Keep NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 where the host's GPUs are shared: neither path needs
NVLink multicast.
"""

from __future__ import annotations

import copy
import os

import torch

from breakgraph.bench.timing import replay_us


def _time_us(fn, ops: int) -> float:
    """µs per op: ``ops`` calls of ``fn`` captured in one CUDA graph (bench.gemm's
    ``replay_us``: a fixed number of replays, issued alike on every rank)."""
    return replay_us([fn] * ops)


def _rank(rank: int, size: int, port: int, args) -> None:
    import torch.distributed as dist

    from breakgraph.distributed.group import OneShotAllReduce, init_tp_group

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_tp_group(rank, size, f"tcp://127.0.0.1:{port}", device)
    one_shot = OneShotAllReduce(device, max(args.kib) << 10)  # room for the largest size
    staged = copy.copy(one_shot)  # its buffer, a copy kernel in front (a group registers once)
    staged.fused_copy = False
    if rank == 0:
        print(f"{torch.cuda.get_device_name()} x{size}  torch {torch.__version__}  "
              f"{args.ops} all-reduces per graph replay, bf16", flush=True)  # fmt: skip
        print(f"{'KiB':>6} {'NCCL us':>9} {'one-shot us':>12} {'ratio':>6} "
              f"{'copy kernel + one-shot us':>26}  equal")  # fmt: skip
    for kib in args.kib:
        n = (kib << 10) // 2
        x = torch.randn(n, dtype=torch.bfloat16, device=device) * (rank + 1)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a)
        same = torch.equal(a, one_shot(b)) and torch.equal(a, staged(x.clone()))
        nccl = _time_us(lambda x=x: dist.all_reduce(x), args.ops)
        mine = _time_us(lambda x=x: one_shot(x), args.ops)
        two = _time_us(lambda x=x: staged(x), args.ops)
        if rank == 0:
            print(f"{kib:>6} {nccl:>9.2f} {mine:>12.2f} {mine / nccl:>5.2f}x {two:>26.2f}  {same}",
                  flush=True)  # fmt: skip
    if args.norm_rows:
        one_shot.enable_add_rms_norm()
        dist.barrier()  # every rank's flags zeroed before any signals
        _add_rms_norm_rows(rank, size, one_shot, args, device)
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def _add_rms_norm_rows(rank: int, size: int, one_shot, args, device) -> None:
    """The all-reduce + residual add + RMSNorm of a row-parallel layer's output, fused
    (kernels/allreduce_norm.py) against the one-shot all-reduce then the norm kernel, per row
    count: µs per op from graph replays; "ok" if the fused rows match a float32 reference,
    carry the same bits on every rank, and still do after the replays."""
    import torch.distributed as dist

    from breakgraph.kernels import ops

    h, eps, bf16 = args.hidden, 1e-6, torch.bfloat16
    if rank == 0:
        print(f"\n{'rows':>6} {'all-reduce + norm us':>21} {'fused us':>9} {'ratio':>6}  ok"
              f"  (hidden {h}, {args.ops} per graph replay)", flush=True)  # fmt: skip
    same_on_all = torch.Generator(device=device).manual_seed(1234)
    w = torch.randn(h, device=device, dtype=bf16, generator=same_on_all)
    for m in args.norm_rows:
        res = torch.randn(m, h, device=device, dtype=bf16, generator=same_on_all)
        x = torch.randn(m, h, device=device, dtype=bf16) * (rank + 1)
        total = x.float()
        dist.all_reduce(total)
        ref_res = (total.to(bf16).float() + res.float()).to(bf16)
        hf = ref_res.float()
        ref = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(
            bf16
        ).float() * w.float()
        out, new_res = one_shot.norm(x, res, w, eps)
        ok = torch.allclose(out.float(), ref, atol=3e-2, rtol=3e-2) and torch.allclose(
            new_res.float(), ref_res.float(), atol=3e-2, rtol=3e-2
        )
        everyone = [torch.empty_like(out) for _ in range(size)]
        dist.all_gather(everyone, out)
        ok = ok and all(torch.equal(o, everyone[0]) for o in everyone)
        apart = _time_us(
            lambda x=x, r=res: ops.fused_add_rms_norm(one_shot(x), r, w, eps), args.ops
        )
        fused = _time_us(lambda x=x, r=res: one_shot.norm(x, r, w, eps), args.ops)
        ok = ok and torch.equal(one_shot.norm(x, res, w, eps)[0], out)  # after the replays
        if rank == 0:
            print(f"{m:>6} {apart:>21.2f} {fused:>9.2f} {fused / apart:>5.2f}x  {ok}", flush=True)


def run_allreduce_bench(args) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.tp:
        raise SystemExit(f"error: bench allreduce needs {args.tp} CUDA devices")
    import torch.multiprocessing as mp

    from breakgraph.engine.tp.driver import free_port

    port = free_port()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    mp.spawn(_rank, args=(args.tp, port, args), nprocs=args.tp)
