"""Reference attention for ``bench kernels``, measured beside the Triton kernels in the same
run: torch's varlen flash attention, SDPA's flash backend (causal top-left, and bottom-right
for a cached prefix), and FlashInfer's batch prefill over the same paged KV where it imports.
Each returns a closure that computes the reference (or None, printed why). Also the cases'
one-request extend metadata (``one_request_extend``)."""

from __future__ import annotations

import inspect
from dataclasses import replace

import torch


def one_request_extend(meta, n: int):
    """One request's last ``n`` tokens as the query rows (``meta``: an ``AttentionMeta`` of
    one request)."""
    device = meta.seq_lens.device
    return replace(
        meta,
        extend_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
        extend_lens=torch.tensor([n], dtype=torch.int32, device=device),
        max_extend_len=n,
    )


def varlen_reference(q, k, v, n: int, n_k: int | None = None):
    """A closure running torch's varlen flash attention (causal, GQA), or None.

    With ``n_k`` keys (> ``n`` queries) flash's causal mask is bottom-right aligned: query
    i sees keys ``0 .. n_k - n + i``, the extend layout (the bench checks the output).
    """
    n_k = n if n_k is None else n_k
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        return None
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:  # older API: same head count for q and kv
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu_q = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, n_k], dtype=torch.int32, device="cuda")
    fn = lambda: varlen_attn(q, k, v, cu_q, cu_k, n, n_k, **kwargs)  # noqa: E731
    try:
        fn()
    except Exception as e:  # report, and the SDPA reference still runs
        print(f"varlen_attn unavailable here: {type(e).__name__}: {str(e).splitlines()[0]}")
        return None
    return fn


def sdpa_flash_reference(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    qt = q.transpose(0, 1)[None]
    kt = k.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    vt = v.repeat_interleave(group, dim=1).transpose(0, 1)[None]

    def fn():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    return fn


def flashinfer_reference(q, k_cache, v_cache, meta, seq: int):
    """FlashInfer's batch prefill over the same paged KV, as the engine runs it under
    ``BREAKGRAPH_EXTEND_ATTENTION=flashinfer`` (``FlashInferPlan``: its fa3 backend, one slot
    a page, causal), for one request of ``seq`` keys; or None (printed why) where FlashInfer
    does not import or build (on the GPU machine: ``benchmarks/flashinfer_bundle.py``).
    Planned once, as a step's attention break is for all its layers; the closure runs it.
    Its first plan builds the kernel variant (a minute or more, then cached on the machine)."""
    import time
    from dataclasses import replace

    from breakgraph.kernels import flashinfer_extend as fi

    if fi.load() is None:
        print("flashinfer: not importable here")
        return None
    meta = replace(meta, extend_lens_cpu=[q.shape[0]], seq_lens_cpu=[seq])
    out = torch.empty_like(q)
    t = time.perf_counter()
    try:
        plan = fi.FlashInferPlan(q, k_cache, meta, q.shape[2] ** -0.5)
        plan(q, out, k_cache, v_cache)
        torch.cuda.synchronize()
    except Exception as e:  # a build or an unsupported shape: reported, the bench goes on
        print(f"flashinfer: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        return None
    print(f"flashinfer: first plan + run (its build included) {time.perf_counter() - t:.1f} s")

    def fn():
        plan(q, out, k_cache, v_cache)
        return out

    return fn


def sdpa_flash_lower_right_reference(q, k, v):
    """SDPA's flash backend with a bottom-right causal mask (``causal_lower_right``): for
    more keys than queries torch calls flash with causal=True, which is bottom-right."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    group = q.shape[1] // k.shape[1]
    qt = q.transpose(0, 1)[None]
    kt = k.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    vt = v.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    mask = causal_lower_right(q.shape[0], k.shape[0])

    def fn():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
        return out[0].transpose(0, 1)

    return fn
