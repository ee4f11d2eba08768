"""How long a KV write takes to be seen complete when the rank's step thread is busy running Python: the transfer
thread needs the GIL for every check, and by default a thread waiting for it gets it only every 5 ms. Two NIXL
backends in one process (CPU pools, no NIXL progress thread), one write of 16 pages x 8 layers of V2-Lite-sized
pages at a time, with the step thread idle or spinning in Python, at two GIL switch intervals.

    python benchmarks/kv_write_gil.py [--writes 60]
"""

import argparse
import statistics
import sys
import threading
import time
import uuid

import torch

from pdserve.transfer.backend import open_nixl_backend


def write_seconds(switch_interval_s: float, busy: bool, writes: int) -> list[float]:
    sys.setswitchinterval(switch_interval_s)
    writer_kv, reader_kv = torch.randn(8, 64, 16, 576), torch.zeros(8, 64, 16, 576)
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
            result = writer.write(peer, list(range(16)), list(range(16)), b"n", 10).result(10)
            if index:  # the first connects
                seconds.append(result.seconds)
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("write of 4.7 MB (16 pages x 8 layers x 16 tokens x 576 float32), asked -> seen complete")
    print(f"{'GIL switch interval':>20} {'step thread':>12} {'p50 ms':>8} {'p90 ms':>8}")
    for interval_s, busy in ((0.005, False), (0.005, True), (0.0005, True)):
        seconds = sorted(write_seconds(interval_s, busy, args.writes))
        print(f"{interval_s * 1e3:17.1f} ms {'busy Python' if busy else 'idle':>12} "
              f"{statistics.median(seconds) * 1e3:8.2f} {seconds[int(0.9 * len(seconds))] * 1e3:8.2f}")


if __name__ == "__main__":
    main()
