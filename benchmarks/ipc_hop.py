"""One hop from the engine process to the API process's event loop, as a token takes it: a
sender process sends a small message every 2 ms and the receiver's coroutine stamps its
arrival, through the server's Unix socket (``server.ipc``: ``EngineSocket`` sending,
``EngineConnection`` receiving on the loop) and, where pyzmq is installed, through the ZMQ
PUSH/PULL pair it replaced (``zmq.asyncio`` receiving); under asyncio's loop and uvloop's
(``serve --loop``). Prints each arm's one-way latency p50 / p90 (µs).

    python benchmarks/ipc_hop.py [--messages 300]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing as mp
import struct
import tempfile
import time

from breakgraph.server.ipc import EngineConnection, EngineSocket, IpcPaths, accept_engine
from breakgraph.server.launch import event_loop_factory

PAYLOAD = b"x" * 200  # about one step's message for one request


def _stamp() -> bytes:
    return struct.pack("d", time.time()) + PAYLOAD


def _zmq_sender(endpoint: str, n: int) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PUSH)
    sock.connect(endpoint)
    time.sleep(0.5)
    for _ in range(n):
        sock.send(_stamp())
        time.sleep(0.002)


def _socket_sender(path: str, n: int) -> None:
    sock = EngineSocket.connect(path)
    time.sleep(0.5)
    for _ in range(n):
        sock.send(_stamp())
        time.sleep(0.002)
    sock.flush(1.0)


async def _via_zmq(tmp: str, n: int) -> list[float]:
    import zmq
    import zmq.asyncio

    endpoint = f"ipc://{tmp}/hop"
    sock = zmq.asyncio.Context().socket(zmq.PULL)
    sock.bind(endpoint)
    proc = mp.get_context("spawn").Process(target=_zmq_sender, args=(endpoint, n))
    proc.start()
    lat = []
    for _ in range(n):
        data = await sock.recv()
        lat.append(time.time() - struct.unpack("d", data[:8])[0])
    proc.join()
    return lat


async def _via_socket(tmp: str, n: int) -> list[float]:
    paths = IpcPaths(f"{tmp}/hop.sock", tmp)
    listener = paths.listen()
    proc = mp.get_context("spawn").Process(target=_socket_sender, args=(paths.socket_path, n))
    proc.start()
    queue: asyncio.Queue = asyncio.Queue()
    conn = EngineConnection(await accept_engine(listener, proc.is_alive), queue.put_nowait, print)
    lat = []
    for _ in range(n):
        data = await queue.get()
        lat.append(time.time() - struct.unpack("d", data[:8])[0])
    proc.join()
    conn.close()
    return lat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300)
    args = parser.parse_args()
    arms = [("unix socket", _via_socket)]
    if importlib.util.find_spec("zmq") is not None:
        arms.append(("zmq (former)", _via_zmq))
    for loop in ("asyncio", "uvloop"):
        for name, arm in arms:
            with tempfile.TemporaryDirectory() as tmp:
                with asyncio.Runner(loop_factory=event_loop_factory(loop)) as runner:
                    lat = sorted(runner.run(arm(tmp, args.messages))[20:])  # after a warm-up
            p50, p90 = lat[len(lat) // 2], lat[int(len(lat) * 0.9)]
            print(f"{loop:<8} {name:<13} one-way p50 {p50 * 1e6:5.0f} us  p90 {p90 * 1e6:5.0f} us")


if __name__ == "__main__":
    main()
