"""The engine process: owns the Engine and runs the step loop, apart from the HTTP work.

Idle, it blocks on ZMQ. With work, each iteration drains the inbox without blocking, runs
one ``engine.step()`` and sends that step's outputs as one message. It exits on a shutdown
message or when the API process that spawned it is gone.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
from typing import Any

import zmq

from breakgraph.engine.args import EngineArgs
from breakgraph.engine.engine import Engine
from breakgraph.engine.request import SamplingParams
from breakgraph.server.ipc import IpcPaths, ModelInfo, encode_output, make_socket, pack, unpack

logger = logging.getLogger(__name__)

PARENT_CHECK_INTERVAL_S = 1.0
# SIGTERM sent to the whole process group (systemd, `timeout`, `kill -- -PGID`) reaches us too:
# keep serving while the API process shuts down gracefully, and stop on its word; stop anyway
# after this long (a SIGTERM meant for the engine alone).
SIGTERM_GRACE_S = 10.0


def run_engine_process(engine_args: EngineArgs, paths: IpcPaths, log_level: str) -> None:
    """Entry point of the spawned engine process."""
    # Ctrl-C reaches the whole foreground process group; the API process decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s",
    )
    ctx = zmq.Context()
    inbox = make_socket(ctx, zmq.PULL, paths.to_engine, bind=False)
    outbox = make_socket(ctx, zmq.PUSH, paths.from_engine, bind=False)
    code = 0
    try:
        try:
            engine = Engine(engine_args)
            report = engine.run_warmups()  # --warmups / --skip-server-warmup
            if report is not None:
                logger.info("warm-up: %s", report)
        except Exception as e:
            logger.exception("engine failed to start")
            outbox.send(pack({"type": "startup_error", "message": f"{type(e).__name__}: {e}"}))
            code = 1
            return
        signal.signal(signal.SIGTERM, _on_sigterm)  # while loading, SIGTERM just ends us
        engine.mark_ready()
        outbox.send(pack({"type": "ready", "info": model_info(engine).to_dict()}))
        EngineLoop(engine, inbox, outbox).run()
    except Exception:
        logger.exception("engine loop crashed")
        code = 1
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()
        if code:
            sys.exit(code)


_sigterm_at: float | None = None


def _on_sigterm(signum: int, frame: object) -> None:
    global _sigterm_at
    if _sigterm_at is None:
        _sigterm_at = time.monotonic()


def model_info(engine: Engine) -> ModelInfo:
    return ModelInfo(
        model_source=engine.model_source,
        architecture=engine.model_config.architecture,
        vocab_size=engine.vocab_size,
        context_length=engine.context_len,
        max_running_requests=engine.max_running_requests,
        kv_capacity_tokens=engine.allocator.capacity,
        dtype=str(engine.dtype).removeprefix("torch."),
        device=str(engine.device),
        engine_pid=os.getpid(),
    )


class EngineLoop:
    def __init__(self, engine: Engine, inbox: zmq.Socket, outbox: zmq.Socket):
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self._stop = False
        # produced between steps (aborts, rejected adds); sent with the next step's outputs
        self._outputs: list[dict[str, Any]] = []
        self._errors: list[dict[str, str]] = []
        self._parent = multiprocessing.parent_process()
        self._last_parent_check = time.monotonic()

    def run(self) -> None:
        while not self._stop:
            if not self.engine.has_work and not self.inbox.poll(
                timeout=int(PARENT_CHECK_INTERVAL_S * 1000)
            ):
                self._check_parent()
                continue
            self._drain()
            if self._stop:
                break
            step_ms = None
            if self.engine.has_work:
                start = time.perf_counter()
                outs = self.engine.step()
                step_ms = (time.perf_counter() - start) * 1000.0
                self._outputs.extend(encode_output(o) for o in outs)
            if step_ms is not None or self._outputs or self._errors:
                self._send_step(step_ms)
            self._check_parent()
        logger.info("engine loop stopped")

    def _send_step(self, step_ms: float | None) -> None:
        msg = {"type": "step", "step_ms": step_ms, "outputs": self._outputs, "errors": self._errors}
        self.outbox.send(pack(msg))
        self._outputs, self._errors = [], []

    def _check_parent(self) -> None:
        now = time.monotonic()
        if now - self._last_parent_check < PARENT_CHECK_INTERVAL_S:
            return
        self._last_parent_check = now
        if self._parent is not None and not self._parent.is_alive():
            logger.warning("the API process is gone; engine exiting")
            self._stop = True
        elif _sigterm_at is not None and now - _sigterm_at > SIGTERM_GRACE_S:
            logger.warning(
                "SIGTERM %.0f s ago and no shutdown message; engine exiting", SIGTERM_GRACE_S
            )
            self._stop = True

    def _drain(self) -> None:
        while not self._stop:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(unpack(data))

    def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "add":
            self._add(msg)
        elif kind == "abort":
            out = self.engine.abort(msg["rid"])
            if out is not None:
                self._outputs.append(encode_output(out))
        elif kind == "call":
            result = self._call(msg["method"])
            self.outbox.send(pack({"type": "reply", "call_id": msg["call_id"], "result": result}))
        elif kind == "shutdown":
            self._stop = True
        else:
            logger.error("unknown message type %r", kind)

    def _add(self, msg: dict[str, Any]) -> None:
        rid = msg["rid"]
        try:
            self.engine.add_request(
                msg["input_ids"],
                SamplingParams.from_dict(msg["sampling"]),
                rid=rid,
                return_logprob=msg.get("return_logprob", False),
            )
        except (ValueError, TypeError) as e:  # the API validates first; this is the backstop
            self._errors.append({"rid": rid, "message": str(e)})

    def _call(self, method: str) -> Any:
        if method == "stats":
            return self.engine.stats()
        if method == "flush_cache":
            return self.engine.flush_cache()
        return {"error": f"unknown method {method!r}"}
