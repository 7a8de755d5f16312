"""Round trip of one step's frame through the engine core's socket: encode, send, decode at the other end.

    python scripts/bench_core_socket.py [--batch 256] [--iters 2000]

The frame is what a decode step at `batch` requests sends: a CoreOutputs with `batch` outputs of one token
each and its StepRecord with `batch` chunks. It goes over ipc:// PUSH/PULL (the sockets the server uses) to
a second process, which decodes it and answers with a small ack, as a step frame and the next input do.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time

import zmq

from tokenloop.core import wire
from tokenloop.core.messages import CoreFrame, CoreOutput, CoreOutputs
from tokenloop.observe.records import ScheduledChunk, StepGauges, StepRecord


def step_frame(batch: int) -> CoreFrame:
    ids = [f"cmpl-{i:08x}-0" for i in range(batch)]
    outputs = [CoreOutput(rid, [1000 + i], first_scheduled_ns=123_456_789 + i, num_cached_tokens=16)
               for i, rid in enumerate(ids)]
    chunks = [ScheduledChunk(rid, 100 + i, 1, 64, True, [], 0, 0, False, 12) for i, rid in enumerate(ids)]
    gauges = StepGauges(batch, 0, 0, 4096, 16, 1000, 200, 10_000, 4_000, 0, 0)
    now = time.monotonic_ns()
    record = StepRecord(7, now, now + 1, now + 2, now + 3, now + 4, 1, 1, 0, batch, chunks, [], ids,
                        [1000 + i for i in range(batch)], [], gauges, "int4")
    return CoreFrame(CoreOutputs(outputs, now + 3, batch, record), [])


def _echo(there: str, back: str, batch: int, iters: int) -> None:
    """The other process: receive a frame, decode it, answer with a small ack (what a reply costs)."""
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.connect(there)
    push.connect(back)
    ack = wire.encode(CoreFrame(None, []))
    for _ in range(iters):
        frame = wire.decode(pull.recv())
        assert len(frame.outputs.outputs) == batch
        push.send(ack)
    pull.close()
    push.close()
    context.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    frame = step_frame(args.batch)
    warmup = 100
    context = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="tokenloop-bench-") as folder:
        there, back = f"ipc://{folder}/there", f"ipc://{folder}/back"
        out, inp = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        out.bind(there)
        inp.bind(back)
        # A process of its own, as the engine core is: the two ends do not share one interpreter's GIL.
        other = multiprocessing.get_context("spawn").Process(
            target=_echo, args=(there, back, args.batch, args.iters + warmup), daemon=True)
        other.start()
        size = len(wire.encode(frame))
        round_trips: list[float] = []
        for i in range(args.iters + warmup):
            begin = time.perf_counter()
            out.send(wire.encode(frame))
            inp.recv()
            if i >= warmup:
                round_trips.append(time.perf_counter() - begin)
        other.join(10)
        encode_s = min(_timed(lambda: wire.encode(frame)) for _ in range(200))
        data = wire.encode(frame)
        decode_s = min(_timed(lambda: wire.decode(data)) for _ in range(200))
        assert wire.decode(data) == frame
        out.close()
        inp.close()
    context.term()
    round_trips.sort()
    print(f"batch {args.batch}: frame {size} bytes; encode {encode_s * 1e6:.0f} us, "
          f"decode {decode_s * 1e6:.0f} us (best of 200)")
    print(f"round trip (encode, send, decode in the other process, small ack back): median "
          f"{statistics.median(round_trips) * 1e6:.0f} us, "
          f"p90 {round_trips[int(len(round_trips) * 0.9)] * 1e6:.0f} us, "
          f"p99 {round_trips[int(len(round_trips) * 0.99)] * 1e6:.0f} us over {len(round_trips)} round trips")


def _timed(fn) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


if __name__ == "__main__":
    main()
