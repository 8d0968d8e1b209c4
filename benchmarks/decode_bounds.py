"""Upper bounds of launch fusions in the batch-1 decode graph (#19), timing only: the outputs of
these variants are wrong. decode_ab.py's variants plus: nopostnorm (gate/up without the
RMSNorm in front of it, as if o_proj's epilogue did it), nonorm (no RMSNorm in front of any
projection), noqk (no q/k norm + RoPE + KV-store kernel). What a fusion can save at most is
its variant's gain over base.
Usage: python benchmarks/decode_bounds.py --models qwen3-0.6b --batch-sizes 1 2 \
    --variants base nopostnorm nonorm noqk --rounds 9 [--profile]"""

import sys

sys.path.insert(0, "benchmarks")  # run from the repo root
import decode_ab as ab

from breakgraph.kernels import ops

_norm_linear, _qk = ops.norm_linear, ops.qk_norm_rope


def no_post_norm(x, residual, nw, eps, weight, bias=None, activation=None):
    if x.shape[0] == 1 and activation is not None:
        return ops.linear_act_and_mul(x, weight, activation), x
    return _norm_linear(x, residual, nw, eps, weight, bias, activation)


def no_norm(x, residual, nw, eps, weight, bias=None, activation=None):
    if x.shape[0] == 1:
        if activation is not None:
            return ops.linear_act_and_mul(x, weight, activation), x
        return ops.linear(x, weight, bias), x
    return _norm_linear(x, residual, nw, eps, weight, bias, activation)


def no_qk(q, k, qw, kw, eps, cos, sin, store=None):
    if q.shape[0] == 1:
        return q, k
    return _qk(q, k, qw, kw, eps, cos, sin, store)


ab.VARIANTS["nopostnorm"] = [(ops, "norm_linear", no_post_norm)]
ab.VARIANTS["nonorm"] = [(ops, "norm_linear", no_norm)]
ab.VARIANTS["noqk"] = [(ops, "qk_norm_rope", no_qk)]

if __name__ == "__main__":
    ab.main()
