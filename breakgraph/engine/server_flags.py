"""``breakgraph serve``'s own flags (``EngineArgs``'s serving fields): request limits,
streaming, the API key, idle polling, shutdown; the engine's flags are flags.py's."""

from __future__ import annotations

import argparse

from breakgraph.engine.args import IDLE_SPIN_MS_CUDA, EngineArgs
from breakgraph.engine.flag_types import non_negative_float, positive_int
from breakgraph.engine.flags import LOGGING, SERVER, argument_group


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """``breakgraph serve``'s request limits, streaming, idle and shutdown flags (into the
    server group, after the listening flags ``cli.py`` puts there)."""
    d = EngineArgs()
    g = argument_group(parser, SERVER)
    g.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help="every route but /health and /health_generate needs the header 'Authorization: "
        "Bearer KEY' (401 otherwise); default: the variable BREAKGRAPH_API_KEY (which `ps` "
        "does not show), else no key (SGLang's and vLLM's flag)",
    )
    g.add_argument(
        "--max-request-bytes",
        metavar="BYTES",
        type=positive_int,
        default=d.max_request_bytes,
        help="a larger request body is refused (413) before it is parsed",
    )
    g.add_argument(
        "--stream-interval",
        metavar="TOKENS",
        type=positive_int,
        default=d.stream_interval,
        help="a stream sends an event once this many new tokens are in (and its first token "
        "and its end at once): fewer, larger events, less API-process time per token at high "
        "concurrency (SGLang's flag)",
    )
    g.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="/generate streams: each event carries only what is new since the last one "
        "(text, output_ids, output logprobs; input logprobs in the first event only) instead "
        "of everything so far (SGLang's flag)",
    )
    g.add_argument(
        "--idle-spin-ms",
        metavar="MS",
        type=non_negative_float,
        default=d.idle_spin_ms,
        help="after its last work the engine polls for new requests this long before it "
        f"sleeps (default {IDLE_SPIN_MS_CUDA:g} on CUDA, 0 on the CPU): a request arriving "
        "meanwhile runs its host path on a hot core; 0 always sleeps (SGLang's "
        "--sleep-on-idle), SGLang's default never does",
    )
    g.add_argument(
        "--sleep-on-idle",
        dest="idle_spin_ms",
        action="store_const",
        const=0.0,
        help="never poll when idle: --idle-spin-ms 0 (SGLang's flag)",
    )
    g.add_argument(
        "--shutdown-timeout",
        metavar="SECONDS",
        type=non_negative_float,
        default=d.shutdown_timeout,
        help="seconds in-flight requests may finish after SIGTERM/Ctrl-C (no new ones are "
        "admitted); then they end with an error (503, or an error event and [DONE] in a stream)",
    )
    argument_group(parser, LOGGING).add_argument(
        "--log-requests",
        action="store_true",
        help="log each request received and finished, and the HTTP access log",
    )
