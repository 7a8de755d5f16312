"""Round trip of one step's frame through the engine core's socket: encode + send + recv + decode.

    python scripts/bench_core_socket.py [--batch 256] [--iters 2000]

The frame is what a decode step at `batch` requests sends: a CoreOutputs with `batch` outputs of one token
each and its StepRecord with `batch` chunks. The frame goes over ipc:// PUSH/PULL between two threads of
this process (the same sockets the server uses; only the second process is missing), and comes back.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import zmq

from tokenloop.core import wire
from tokenloop.core.messages import CoreFrame, CoreOutput, CoreOutputs
from tokenloop.core.scheduler import SchedulerStats
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
    stats = SchedulerStats(batch, 0, 0, 0, 0.75, 1000, 10_000, 4_000, 0)
    return CoreFrame(CoreOutputs(outputs, now + 3, batch, record), [], stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    frame = step_frame(args.batch)
    context = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="tokenloop-bench-") as folder:
        there, back = f"ipc://{folder}/there", f"ipc://{folder}/back"
        out, inp = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        out.bind(there)
        inp.bind(back)

        def echo() -> None:  # the other end: receive, decode, re-encode, send back
            pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
            pull.connect(there)
            push.connect(back)
            for _ in range(args.iters + 100):
                push.send(wire.encode(wire.decode(pull.recv())))
            pull.close()
            push.close()

        thread = threading.Thread(target=echo, daemon=True)
        thread.start()
        size = len(wire.encode(frame))
        one_way: list[float] = []
        for i in range(args.iters + 100):
            begin = time.perf_counter()
            out.send(wire.encode(frame))
            got = wire.decode(inp.recv())
            if i >= 100:  # warm-up excluded
                one_way.append((time.perf_counter() - begin) / 2)
        assert got == frame
        thread.join()
        encode_s = min(_timed(lambda: wire.encode(frame)) for _ in range(200))
        data = wire.encode(frame)
        decode_s = min(_timed(lambda: wire.decode(data)) for _ in range(200))
        out.close()
        inp.close()
    context.term()
    one_way.sort()
    print(f"batch {args.batch}: frame {size} bytes; encode {encode_s * 1e6:.0f} us, "
          f"decode {decode_s * 1e6:.0f} us (best)")
    print(f"one way (encode + send + recv + decode): median {statistics.median(one_way) * 1e6:.0f} us, "
          f"p99 {one_way[int(len(one_way) * 0.99)] * 1e6:.0f} us over {len(one_way)} round trips")


def _timed(fn) -> float:  # noqa: ANN001
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


if __name__ == "__main__":
    main()
