"""One hop from the engine process to the API process's event loop, as a token takes it:
a sender process pushes a small message every 2 ms through the server's ZMQ PUSH/PULL pair
(``server.ipc.make_socket``, ``zmq.asyncio`` on the receiving side), and the receiver's
coroutine stamps its arrival; under asyncio's loop and under uvloop's (``serve --loop``).
A plain Unix socket read through ``loop.add_reader`` is the reference arm: what the hop
costs without ZMQ's I/O threads. Prints each arm's one-way latency p50 / p90 (µs).

    python benchmarks/ipc_hop.py [--messages 300]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import struct
import tempfile
import time

import zmq
import zmq.asyncio

from breakgraph.server.ipc import make_socket
from breakgraph.server.launch import event_loop_factory

PAYLOAD = b"x" * 200  # about one step's message for one request


def _zmq_sender(endpoint: str, n: int) -> None:
    sock = make_socket(zmq.Context(), zmq.PUSH, endpoint, bind=False)
    time.sleep(0.5)
    for _ in range(n):
        sock.send(struct.pack("d", time.time()) + PAYLOAD)
        time.sleep(0.002)


def _unix_sender(path: str, n: int) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(path)
    time.sleep(0.5)
    for _ in range(n):
        body = struct.pack("d", time.time()) + PAYLOAD
        sock.sendall(struct.pack("I", len(body)) + body)
        time.sleep(0.002)


async def _via_zmq(tmp: str, n: int) -> list[float]:
    endpoint = f"ipc://{tmp}/hop"
    sock = make_socket(zmq.asyncio.Context(), zmq.PULL, endpoint, bind=True)
    proc = mp.get_context("spawn").Process(target=_zmq_sender, args=(endpoint, n))
    proc.start()
    lat = []
    for _ in range(n):
        data = await sock.recv()
        lat.append(time.time() - struct.unpack("d", data[:8])[0])
    proc.join()
    return lat


async def _via_unix(tmp: str, n: int) -> list[float]:
    path = os.path.join(tmp, "hop.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    proc = mp.get_context("spawn").Process(target=_unix_sender, args=(path, n))
    proc.start()
    conn, _ = listener.accept()
    conn.setblocking(False)
    queue: asyncio.Queue = asyncio.Queue()
    buf = bytearray()

    def on_readable() -> None:
        buf.extend(conn.recv(1 << 20))
        while len(buf) >= 4 and len(buf) >= 4 + (size := struct.unpack_from("I", buf)[0]):
            queue.put_nowait(bytes(buf[4 : 4 + size]))
            del buf[: 4 + size]

    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), on_readable)
    lat = []
    for _ in range(n):
        data = await queue.get()
        lat.append(time.time() - struct.unpack("d", data[:8])[0])
    loop.remove_reader(conn.fileno())
    proc.join()
    return lat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300)
    args = parser.parse_args()
    for loop in ("asyncio", "uvloop"):
        for name, arm in (("zmq", _via_zmq), ("unix socket", _via_unix)):
            with tempfile.TemporaryDirectory() as tmp:
                with asyncio.Runner(loop_factory=event_loop_factory(loop)) as runner:
                    lat = sorted(runner.run(arm(tmp, args.messages))[20:])  # after a warm-up
            p50, p90 = lat[len(lat) // 2], lat[int(len(lat) * 0.9)]
            print(f"{loop:<8} {name:<12} one-way p50 {p50 * 1e6:5.0f} us  p90 {p90 * 1e6:5.0f} us")


if __name__ == "__main__":
    main()
