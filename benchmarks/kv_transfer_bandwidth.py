"""KV page write bandwidth between two processes with KVTransferAgent, next to a local torch copy of the
same pages. Two page patterns: one consecutive run (one descriptor) and every other page
(one descriptor per page).

    python benchmarks/kv_transfer_bandwidth.py [--ucx-tls tcp,self] [--device cpu|cuda] [--reader-device cuda:1]
                                               [--no-progress-thread]

With --reader-device another GPU, NIXL writes GPU to GPU and the torch copy is a peer copy between the same GPUs.
"""

import argparse
import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from pdserve.ops.attention import new_kv_pool
from pdserve.transfer.agent import KVTransferAgent
from pdserve.transfer.layout import page_runs

MiB = 1 << 20


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    page_size: int
    kv_dim: int
    dtype: torch.dtype

    def pool(self, num_pages: int, device: str) -> torch.Tensor:
        pool = new_kv_pool(self.num_layers, num_pages, self.page_size, self.kv_dim, self.dtype, torch.device(device))
        return pool.normal_()

    @property
    def page_bytes_all_layers(self) -> int:
        return self.num_layers * self.page_size * self.kv_dim * self.dtype.itemsize


def _reader_main(
    conn: Connection, name: str, shape: PoolShape, num_pages: int, device: str, progress_thread: bool
) -> None:
    with KVTransferAgent(name, shape.pool(num_pages, device), progress_thread) as agent:
        conn.send(agent.metadata())
        while not conn.poll(0.001):
            # Also drives UCX here when there is no progress thread: a write completes on the writer
            # only after this side acknowledges it, so this cadence bounds small-write latency.
            agent.take_notifications()


def _seconds_per_call(call: Callable[[], None], min_repeats: int = 5, min_total_s: float = 0.5) -> float:
    call()  # warm-up: connection setup, page faults
    repeats, started = 0, time.perf_counter()
    while repeats < min_repeats or time.perf_counter() - started < min_total_s:
        call()
        repeats += 1
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ucx-tls", help="UCX_TLS for both processes (default: UCX's own choice)")
    parser.add_argument("--device", default="cpu", help="writer's pool device: cpu (DRAM) or cuda (VRAM)")
    parser.add_argument("--reader-device", help="reader's pool device (default: --device)")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--kv-dim", type=int, default=512)
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--no-progress-thread", action="store_true", help="agents without NIXL's progress thread")
    args = parser.parse_args()
    reader_device = args.reader_device or args.device
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls  # set before any UCX context exists, inherited by the reader

    # One copy stream, like UCX's cma put; torch's 2-thread strided copies are erratic on small VMs.
    torch.set_num_threads(1)
    shape = PoolShape(args.num_layers, args.page_size, args.kv_dim, torch.bfloat16)
    sizes_mib = [1 << k for k in range(args.max_mib.bit_length()) if 1 << k <= args.max_mib]
    max_pages = args.max_mib * MiB // shape.page_bytes_all_layers
    writer_pages, reader_pages = 2 * max_pages, 2 * max_pages + 37  # pools of different sizes, as in service

    progress_thread = not args.no_progress_thread
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    reader = ctx.Process(
        target=_reader_main, args=(child_conn, f"bench-reader-{uuid.uuid4().hex[:8]}", shape, reader_pages, reader_device, progress_thread),
    )
    reader.start()
    src_kv, local_dst_kv = shape.pool(writer_pages, args.device), shape.pool(reader_pages, reader_device)
    cuda_devices = {d for d in (args.device, reader_device) if d.startswith("cuda")}

    def sync() -> None:
        for device in cuda_devices:
            torch.cuda.synchronize(device)

    try:
        with KVTransferAgent(f"bench-writer-{uuid.uuid4().hex[:8]}", src_kv, progress_thread) as writer:
            if not conn.poll(60):
                raise TimeoutError("reader process sent no metadata within 60 s")
            peer = writer.add_peer(conn.recv())
            print(f"pool: {shape.num_layers} layers x page {shape.page_size} x kv_dim {shape.kv_dim} bf16 "
                  f"= {shape.page_bytes_all_layers // 1024} KiB per page (all layers); {args.device} -> {reader_device}; "
                  f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}; progress thread {progress_thread}")
            print(f"{'MiB':>5} {'pages':>6} | {'NIXL run':>9} {'NIXL scat':>9} {'descs':>6} | "
                  f"{'torch run':>9} {'torch scat':>10}   (GB/s)")
            for size_mib in sizes_mib:
                num_pages = max(1, size_mib * MiB // shape.page_bytes_all_layers)
                num_bytes = num_pages * shape.page_bytes_all_layers
                run_src, run_dst = list(range(num_pages)), list(range(5, 5 + num_pages))
                scat_src, scat_dst = list(range(0, 2 * num_pages, 2)), list(range(1, 2 * num_pages, 2))

                def nixl_write(src: list[int], dst: list[int]) -> None:
                    writer.wait(writer.write_pages(peer, src, dst, b"bench"), timeout_s=60)

                def torch_copy(src: list[int], dst: list[int]) -> None:
                    # Same run scheme as the descriptors; slice copies run at memcpy speed, fancy indexing does not.
                    for run in page_runs(src, dst):
                        pages = slice(run.dst_start, run.dst_start + run.num_pages)
                        local_dst_kv[:, pages].copy_(src_kv[:, run.src_start : run.src_start + run.num_pages])
                    sync()

                gbps = [
                    num_bytes / _seconds_per_call(lambda: fn(src, dst)) / 1e9
                    for fn, src, dst in [
                        (nixl_write, run_src, run_dst),
                        (nixl_write, scat_src, scat_dst),
                        (torch_copy, run_src, run_dst),
                        (torch_copy, scat_src, scat_dst),
                    ]
                ]
                print(f"{num_bytes / MiB:5.0f} {num_pages:6d} | {gbps[0]:9.2f} {gbps[1]:9.2f} "
                      f"{num_pages:6d} | {gbps[2]:9.2f} {gbps[3]:10.2f}")  # scattered: a descriptor a page
    finally:
        conn.send("stop")
        reader.join(10)
        if reader.is_alive():
            reader.kill()


if __name__ == "__main__":
    main()
