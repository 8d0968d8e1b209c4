"""The engine process's loop (``EngineLoop``) driven in-process over a socket double: what it
publishes between steps is what /metrics and /get_server_info fall back on, so an idle
snapshot must not show KV that the loop is about to release."""

from __future__ import annotations

from breakgraph.common.messages import (
    STATS_PUBLISHED,
    AbortReq,
    GenerateReq,
    StatsReply,
    StepResult,
    decode,
    encode,
)
from breakgraph.common.sampling_params import SamplingParams
from breakgraph.server.engine_process import EngineLoop
from tests.support.engines import assert_no_leak, make_engine


class LoopSocket:
    """The loop's side of the engine socket: frames put in by the test, messages it sent."""

    def __init__(self):
        self.inbox: list[bytes] = []
        self.sent: list = []
        self.closed = False

    def put(self, msg) -> None:
        self.inbox.append(encode(msg))

    def wait(self, timeout_s: float, spin_s: float = 0.0) -> bool:
        return bool(self.inbox)

    def read(self) -> list[bytes]:
        frames, self.inbox = self.inbox, []
        return frames

    def send(self, data: bytes) -> None:
        self.sent.append(decode(data))

    def published(self) -> list[dict]:
        return [
            m.stats for m in self.sent if isinstance(m, StatsReply) and m.call_id == STATS_PUBLISHED
        ]


def test_an_abort_going_idle_publishes_its_kv_released(tiny_llama_dir):
    """A request aborted mid-decode: the loop's idle snapshot (published as it goes idle)
    shows no running request and no KV held; every snapshot that shows no running request
    holds none."""
    engine = make_engine(tiny_llama_dir)
    sock = LoopSocket()
    loop = EngineLoop(engine, sock)
    sp = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    sock.put(GenerateReq("r", list(range(1, 40)), sp))
    tokens = 0
    while tokens < 3:  # prefill, then a few decode steps
        loop.turn()
        tokens = sum(len(m.plain_tokens()) for m in sock.sent if isinstance(m, StepResult))
    first = sock.published()[-1]  # as it started work: the request waiting for its prefill
    assert (first["num_queued_reqs"], engine.stats()["num_running_reqs"]) == (1, 1)
    sock.put(AbortReq("r"))
    loop.turn()
    assert not engine.has_work
    last = sock.published()[-1]
    assert (last["num_running_reqs"], last["kv_tokens_used"]) == (0, 0), last
    for stats in sock.published():
        if stats["num_running_reqs"] == 0 and stats["num_queued_reqs"] == 0:
            assert stats["kv_tokens_used"] == 0, sock.published()
    finished = [o for m in sock.sent if isinstance(m, StepResult) for o in m.outputs if o.finished]
    assert [o.rid for o in finished] == ["r"]
    assert_no_leak(engine)
