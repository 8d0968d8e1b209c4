"""Every ``BREAKGRAPH_*`` environment variable: one typed declaration each, read when asked.

A knob is declared once below (name, type, default, one line on what it does and why it
stays) and read where the decision is made, ``envs.MOE_ATOMIC_SUM.get()``: a change of the
environment takes effect at the next call, and a bad value raises a ValueError that names the
variable. Tests set knobs with ``envs.PDL.override("1")`` or ``envs.override(PDL="1")``, which
set the variable itself (child processes inherit it) and restore it on exit.
``python -m breakgraph.common.envs`` writes docs/env.md from these declarations
(tests/common/test_envs.py checks that it is current). Torch-free: both processes import it.

A knob whose experiment lost is deleted, not kept as an opt-in; git keeps its history.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")

PREFIX = "BREAKGRAPH_"
KINDS = ("debug", "escape hatch", "tuning", "timeout", "opt-in", "setting")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

# os.environ keeps its values encoded in the dict ``_data``: a read from it takes ~20 ns, where
# os.environ.get takes ~0.8 µs for an unset name (a KeyError inside), and some knobs are read
# at every kernel launch (kernels/pdl.py). os.environ's own setters keep that dict current.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENCODE_KEY = getattr(os.environ, "encodekey", None)


class EnvVar(Generic[T]):
    """One environment knob: ``get()`` parses its current value (the default when unset or
    empty); the parse is cached per raw value, so an unchanged variable costs a dict read."""

    def __init__(
        self,
        name: str,
        default: T,
        doc: str,
        kind: str,
        parse: Callable[[str], T],
        type_name: str,
        unparse: Callable[[T], str] = str,
    ):
        if not name.startswith(PREFIX) or kind not in KINDS:
            raise ValueError(f"{name}: a knob is named {PREFIX}* and is one of {KINDS}")
        self.name = name
        self.default = default
        self.doc = doc
        self.kind = kind
        self.type_name = type_name
        self._parse = parse
        self._unparse = unparse
        self._key = _ENCODE_KEY(name) if _ENCODE_KEY is not None else name
        self._cached: tuple[Any, T] = (None, default)  # (raw value, parsed); None: unset

    def _raw(self) -> Any:
        environ = os.environ
        if _ENV_DATA is not None and getattr(environ, "_data", None) is _ENV_DATA:
            return _ENV_DATA.get(self._key)
        return environ.get(self.name)

    def get(self) -> T:
        """The value now: the variable parsed, or the default if it is unset or empty."""
        raw = self._raw()
        cached_raw, value = self._cached
        if raw == cached_raw:
            return value
        text = os.environ.get(self.name)
        value = self.default if not text else self.parse(text)
        self._cached = (raw, value)
        return value

    def parse(self, text: str) -> T:
        """``text`` as this knob's type; a ValueError naming the variable if it is not one."""
        try:
            return self._parse(text.strip())
        except ValueError:
            raise ValueError(f"{self.name}={text!r}: expected {self.type_name}") from None

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))

    @contextlib.contextmanager
    def override(self, value: T | None) -> Iterator[None]:
        """Set the variable to ``value`` (None: unset it) inside the block, then restore it;
        a value this knob would not accept raises before anything is set."""
        with override(**{self.name[len(PREFIX) :]: value}):
            yield

    def _text(self, value: T | None) -> str | None:
        if value is None:
            return None
        text = self._unparse(value)
        self.parse(text)  # refuse what get() would refuse
        return text

    def __repr__(self) -> str:
        return f"<{self.name} {self.type_name} = {self.get()!r}>"


def _bool(text: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(text)


def Bool(name: str, default: bool, doc: str, kind: str) -> EnvVar[bool]:
    return EnvVar(name, default, doc, kind, _bool, "bool (1/0)", lambda v: "1" if v else "0")


def Int(name: str, default: int, doc: str, kind: str) -> EnvVar[int]:
    return EnvVar(name, default, doc, kind, int, "int")


def Float(name: str, default: float, doc: str, kind: str) -> EnvVar[float]:
    return EnvVar(name, default, doc, kind, float, "float")


def Str(name: str, default: str, doc: str, kind: str) -> EnvVar[str]:
    return EnvVar(name, default, doc, kind, str, "str")


def Choice(name: str, default: str, choices: tuple[str, ...], doc: str, kind: str) -> EnvVar[str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(text)
        return text

    return EnvVar(name, default, doc, kind, parse, "choice: " + ", ".join(choices))


# ---------------------------------------------------------------------------------- the knobs

GRAPH_GUARD = Bool(
    "BREAKGRAPH_GRAPH_GUARD", False, kind="debug",
    doc="Graph banks check at every replay that the tensors their captures read are still at "
    "their capture-time addresses, and raise if one moved (graph/bank.py).",
)  # fmt: skip
GRAPH_DEBUG = Bool(
    "BREAKGRAPH_GRAPH_DEBUG", False, kind="debug",
    doc="Breakable graphs replay piece by piece with a sync after each, so an error or a "
    "device fault names the break it happened in (graph/breakable.py).",
)  # fmt: skip
DISABLE_TRITON = Bool(
    "BREAKGRAPH_DISABLE_TRITON", False, kind="debug",
    doc="Every op runs its torch twin instead of its Triton kernel (kernels/ops.py).",
)  # fmt: skip
PDL = Choice(
    "BREAKGRAPH_PDL", "auto", ("auto", "0", "1"), kind="escape hatch",
    doc="Programmatic dependent launch of the Triton kernels: auto inside decode graphs of at "
    "most 4 rows (where an H200 measured it faster), 1 at every launch, 0 never "
    "(kernels/pdl.py).",
)  # fmt: skip
EXTEND_ATTENTION = Choice(
    "BREAKGRAPH_EXTEND_ATTENTION", "auto", ("auto", "triton", "flashinfer"), kind="tuning",
    doc="Prefill (extend) attention on CUDA: auto (FlashInfer's batch prefill, FA3's kernels, "
    "where it is installed and serves the step: Hopper, bf16 or fp16, head sizes 64-256, and "
    "a step whose keys the Triton kernel would not split; else Triton), triton "
    "(kernels/extend_attention.py) or flashinfer (as auto, saying so when it does not "
    "import; kernels/flashinfer_extend.py).",
)  # fmt: skip
SKINNY = Str(
    "BREAKGRAPH_SKINNY", "table", kind="tuning",
    doc="Which projections of a few rows take the skinny GEMM: table (the measured "
    "SKINNY_TABLE), PATH.json (another GPU's table, from bench gemm --table-out), all (every "
    "one on a generic config, to measure a step before its table exists) or off (cuBLAS) "
    "(kernels/skinny_gemm.py).",
)  # fmt: skip
MOE_ATOMIC_SUM = Bool(
    "BREAKGRAPH_MOE_ATOMIC_SUM", True, kind="escape hatch",
    doc="The MoE down GEMM adds each row into its token's output with atomics where the "
    "config table says so; 0 sums each token's rows in a fixed order instead, so a prefill "
    "gives the same bits from run to run (kernels/fused_moe.py).",
)  # fmt: skip
MOE_GEMV = Int(
    "BREAKGRAPH_MOE_GEMV", 4, kind="tuning",
    doc="MoE steps of up to this many tokens take the GEMV path (two launches, no "
    "alignment); 0 never. 4 is an H200's crossover (kernels/fused_moe.py).",
)  # fmt: skip
AR_NORM = Bool(
    "BREAKGRAPH_AR_NORM", False, kind="opt-in",
    doc="Under TP the Llama family's o and down projections hand their partial sums to the "
    "norm after them, which all-reduces them in one kernel; off until it has run on two GPUs "
    "(distributed/group.py).",
)  # fmt: skip
TP_TIMEOUT_S = Float(
    "BREAKGRAPH_TP_TIMEOUT_S", 300.0, kind="timeout",
    doc="A TP collective that waits longer than this raises instead of hanging (generous: a "
    "rank's first step may JIT-compile while the others wait) (distributed/group.py).",
)  # fmt: skip
TP_SPIN_MS = Float(
    "BREAKGRAPH_TP_SPIN_MS", 50.0, kind="tuning",
    doc="After a step a TP worker polls its pipe this long without sleeping before it "
    "blocks: a blocked process's wake-up is on every step's critical path (CUDA only) "
    "(engine/tp/worker.py).",
)  # fmt: skip
TP_TRACE = Bool(
    "BREAKGRAPH_TP_TRACE", False, kind="debug",
    doc="At shutdown rank 0 logs its sends' host time and each TP worker where its steps' "
    "time went (receive, batch build, launch), as percentiles (engine/tp/worker.py).",
)  # fmt: skip
API_KEY = Str(
    "BREAKGRAPH_API_KEY", "", kind="setting",
    doc="The key `serve` asks of every request but the health probes, when --api-key is not "
    "given (out of the command line, where other users' `ps` would see it) "
    "(server/launch.py).",
)  # fmt: skip

TORCH_PROFILER_DIR = Str(
    "BREAKGRAPH_TORCH_PROFILER_DIR", "", kind="setting",
    doc="Where /stop_profile writes the engine's trace when /start_profile names no "
    "output_dir (default: breakgraph-profiles in the temp folder) (server/http.py).",
)  # fmt: skip
SPEC_CHAIN = Bool(
    "BREAKGRAPH_SPEC_CHAIN", True, kind="setting",
    doc="Under overlap scheduling, a draft model's speculative verify steps run back to back, "
    "each built on the device from what the one in flight keeps; 0: each is read back before "
    "the next is scheduled (engine/spec_chain.py).",
)  # fmt: skip
BENCH = Bool(
    "BREAKGRAPH_BENCH", False, kind="setting",
    doc="This engine serves a benchmark: benchmark aids that change outputs "
    "(--bench-synthetic-accept-length) are refused without it. `breakgraph bench` sets it "
    "for the engines it starts (engine/speculative.py).",
)  # fmt: skip


def registry() -> dict[str, EnvVar]:
    """Every knob by its attribute name here (``MOE_GEMV``), in declaration order."""
    return {k: v for k, v in globals().items() if isinstance(v, EnvVar)}


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Set knobs by attribute name (``override(PDL="1", MOE_GEMV=0)``; None unsets one)
    inside the block, in os.environ itself, and restore them after."""
    knobs = registry()
    unknown = sorted(set(values) - set(knobs))
    if unknown:
        raise KeyError(f"no such knob: {', '.join(unknown)} (breakgraph/common/envs.py)")
    texts = {knobs[k].name: knobs[k]._text(v) for k, v in values.items()}
    saved = {name: os.environ.get(name) for name in texts}
    try:
        for name, text in texts.items():
            _put(name, text)
        yield
    finally:
        for name, text in saved.items():
            _put(name, text)


def _put(name: str, text: str | None) -> None:
    if text is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = text


def describe() -> str:
    """docs/env.md: a table of every knob (name, type, default, kind, what it does)."""
    lines = [
        "# Environment variables",
        "",
        "Generated from `breakgraph/common/envs.py` by `python -m breakgraph.common.envs`;",
        "edit the declarations there, not this file. Each is read when its decision is made,",
        "so a test may change one with `envs.NAME.override(value)`. Booleans take 1/0",
        "(or true/false, yes/no, on/off); an empty value means the default.",
        "",
        "| variable | type | default | kind | what it does |",
        "|---|---|---|---|---|",
    ]
    for var in registry().values():
        default = var._unparse(var.default)
        lines.append(f"| `{var.name}` | {var.type_name} | `{default}` | {var.kind} | {var.doc} |")
    lines += [
        "",
        "Kinds: *debug* aids that slow or log; *escape hatch*es that turn off a default a user",
        "may not want (nondeterministic atomics, dependent launches); *tuning* values measured",
        "on one GPU that another may set; *timeout*s; *opt-in* paths not yet measured;",
        "*setting*s of a deployment kept out of the command line (a secret).",
        "",
    ]
    return "\n".join(lines)


DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "env.md"


def main(argv: list[str] | None = None) -> int:
    """Write docs/env.md (or the path given)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("-"):  # --help, or a flag it does not take: no file
        print("usage: python -m breakgraph.common.envs [PATH]  (default: docs/env.md)")
        return 0 if argv[0] in ("-h", "--help") else 2
    path = Path(argv[0]) if argv else DOC_PATH
    path.write_text(describe())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
