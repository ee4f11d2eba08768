"""How long a KV write takes to be seen complete when the rank's step thread is busy running Python: the transfer
thread needs the GIL for every check, and by default a thread waiting for it gets it only every 5 ms. Two NIXL
backends in one process (CPU pools, no NIXL progress thread), one write of 16 pages x 8 layers of V2-Lite-sized
pages at a time (one run of pages, or every other page), with the step thread idle or spinning in Python, at two GIL
switch intervals; the part of each write before NIXL had it is shown apart.

    python benchmarks/kv_write_gil.py [--writes 60] [--busy-intervals-ms 5,0.5,0.1]
"""

import argparse
import statistics
import sys
import threading
import time
import uuid

import torch

from pdserve.ops.attention import new_kv_pool
from pdserve.transfer.backend import open_nixl_backend


def write_seconds(switch_interval_s: float, busy: bool, writes: int, pages: list[int]) -> list[tuple[float, float]]:
    """(seconds, of them before posting) of each write of `pages`, after a first that connects."""
    sys.setswitchinterval(switch_interval_s)
    writer_kv, reader_kv = (new_kv_pool(8, 64, 16, 576, torch.float32, torch.device("cpu")) for _ in range(2))
    writer_kv.normal_()
    writer = open_nixl_backend(f"w-{uuid.uuid4().hex[:8]}", writer_kv, lambda *_: None, False)
    reader = open_nixl_backend(f"r-{uuid.uuid4().hex[:8]}", reader_kv, lambda *_: None, False)
    stop = threading.Event()

    def python_step_loop() -> None:
        total = 0
        while not stop.is_set():
            for i in range(1000):
                total += i * i

    step = threading.Thread(target=python_step_loop)
    if busy:
        step.start()
    try:
        peer = writer.add_peer(reader.metadata()).result(10)
        reader.expect_notifications(1)
        seconds = []
        for index in range(writes + 1):
            result = writer.write(peer, pages, pages, b"n", 10).result(10)
            if index:  # the first connects
                seconds.append((result.seconds, result.posting_seconds))
            time.sleep(0.005)
        return seconds
    finally:
        stop.set()
        if busy:
            step.join()
        writer.close()
        reader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writes", type=int, default=60)
    parser.add_argument("--busy-intervals-ms", default="5,0.5", help="GIL switch intervals to try with the step "
                        "thread busy (rank processes run at 0.05)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("writes of 16 pages x 8 layers x 16 tokens x 576 float32 (4.7 MB), asked -> seen complete; pages in one "
          "run (1 byte range) or every other page (16)")
    print(f"{'GIL switch interval':>20} {'step thread':>12} {'pages':>10} {'p50 ms':>8} {'p90 ms':>8} "
          f"{'before posting p50 ms':>22}")
    busy_intervals_s = [float(ms) / 1e3 for ms in args.busy_intervals_ms.split(",")]
    for interval_s, busy in ((0.005, False), *((i, True) for i in busy_intervals_s)):
        for name, pages in (("one run", list(range(16))), ("scattered", list(range(0, 32, 2)))):
            results = write_seconds(interval_s, busy, args.writes, pages)
            seconds = sorted(s for s, _ in results)
            posting = statistics.median(p for _, p in results)
            print(f"{interval_s * 1e3:17g} ms {'busy Python' if busy else 'idle':>12} {name:>10} "
                  f"{statistics.median(seconds) * 1e3:8.2f} {seconds[int(0.9 * len(seconds))] * 1e3:8.2f} "
                  f"{posting * 1e3:22.2f}")


if __name__ == "__main__":
    main()
