"""The references of ``hicache bench capacity``: a bare ZeroMQ round trip, and CPU time.

``bare_round_trips`` measures what a round trip costs with nothing but ZeroMQ and a Python
loop on the other side: a DEALER in this process and a ROUTER in a process of its own that
answers each frame at once with a frame of the answer's size, over the same transport as the
engines (an ``ipc://`` socket). The daemon's answer latency is reported against it, frame
sizes matched per message kind.

``process_cpu_s`` reads a process's user + system CPU seconds from ``/proc`` (Linux).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import zmq

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (its threads included); None when gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _echo(address: str, ready: Any, stop: Any) -> None:
    """The bare server: each frame ``[answer size: 4 bytes][payload]`` is answered with a frame
    of that size."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    ready.set()
    answers: dict[int, bytes] = {}
    while not stop.is_set():
        if not sock.poll(50):
            continue
        peer, frame = sock.recv_multipart()
        size = int.from_bytes(frame[:4], "little")
        answer = answers.get(size)
        if answer is None:
            answer = answers[size] = bytes(size)
        sock.send_multipart([peer, answer])
    sock.close(0)
    ctx.term()


def bare_round_trips(address: str, sizes: dict[str, tuple[int, int]], count: int) -> dict[str, list[float]]:
    """Round trips in µs per kind: ``sizes[kind] = (request bytes, answer bytes)``, ``count`` each,
    the kinds interleaved."""
    spawn = mp.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    proc = spawn.Process(target=_echo, args=(address, ready, stop), daemon=True)
    proc.start()
    out: dict[str, list[float]] = {kind: [] for kind in sizes}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if not ready.wait(60):
            raise RuntimeError("the bare ZeroMQ echo server did not start")
        sock.connect(address)
        frames = {kind: answer.to_bytes(4, "little") + bytes(max(0, ask - 4)) for kind, (ask, answer) in sizes.items()}
        for frame in frames.values():  # warm the connection and the echo's answers
            for _ in range(20):
                sock.send(frame)
                sock.recv()
        for _ in range(count):
            for kind, frame in frames.items():
                t0 = time.perf_counter()
                sock.send(frame)
                if not sock.poll(5000):
                    raise RuntimeError("the bare ZeroMQ echo server did not answer")
                sock.recv()
                out[kind].append((time.perf_counter() - t0) * 1e6)
    finally:
        sock.close(0)
        ctx.term()
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return out
