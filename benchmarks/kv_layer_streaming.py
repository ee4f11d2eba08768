"""Does writing the KV layer by layer while the prefill still runs pay? A real engine prefills one prompt and its KV
goes to a reader process over NIXL (the transfer thread the service uses): either in one WRITE after the forward
(what the service does), or one WRITE per layer, posted from a forward hook as each layer finishes. The time is
prefill start -> every write complete on the writer (for UCX a completed WRITE has landed), median of --repeats.

    python benchmarks/kv_layer_streaming.py                          # CPU: a V2-Lite-like layer, 8 layers, float32
    python benchmarks/kv_layer_streaming.py --device cuda            # GPU: the V2-Lite shape, bf16 (27 layers)
    [--prompt-lengths 256,1024,2048] [--repeats 3] [--nixl-progress-thread on|off]

On CUDA a hook runs when the layer's kernels are queued, not done: each layer's write waits for a CUDA event first.
"""

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.model.tiny import make_config_only_model
from pdserve.ops.attention import new_kv_pool
from pdserve.transfer.backend import open_nixl_backend
from pdserve.wire.sampling import SamplingParams

V2_LITE_CONFIG = Path(__file__).resolve().parents[1] / "pdserve" / "model" / "configs" / "deepseek-v2-lite.json"
PAGE_SIZE = 16
WAIT_S = 120.0


def model_dir(device: str) -> str:
    config = json.loads(V2_LITE_CONFIG.read_text())
    if device == "cpu":  # the V2-Lite attention and KV shape (576 values per token and layer), smaller elsewhere
        config.update(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=8,
                      intermediate_size=2816, moe_intermediate_size=512, n_routed_experts=4, n_shared_experts=1,
                      num_experts_per_tok=2, vocab_size=32000)
    return str(make_config_only_model(tempfile.mkdtemp(), config))


def reader_main(conn: Connection, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: str,
                progress_thread: bool) -> None:
    """Holds a pool like the writer's, hands out its metadata, stays until told to go."""
    backend = open_nixl_backend(name, new_kv_pool(*shape, dtype, torch.device(device)), lambda *_: None,
                                progress_thread)
    backend.expect_notifications(1)  # listen closely the whole time
    conn.send(backend.metadata())
    conn.recv()
    backend.close()


def prefill_and_write(engine: Engine, backend, peer: str, prompt: list[int], per_layer: bool) -> float:
    request_id = uuid.uuid4().hex
    engine.add_prefill_only(request_id, prompt, SamplingParams(max_tokens=1))
    writes: list[Future] = []
    posters: list[threading.Thread] = []
    hooks = []
    if per_layer:
        def hook(layer: int):
            def after_layer(*_):
                pages = engine.requests[request_id].page_ids
                if engine.device.type == "cuda":  # the layer is queued, not done: post once its event has passed
                    event = torch.cuda.Event()
                    event.record()

                    def post():
                        event.synchronize()
                        writes.append(backend.write(peer, pages, pages, b"", WAIT_S, range(layer, layer + 1)))

                    posters.append(threading.Thread(target=post))
                    posters[-1].start()
                else:
                    writes.append(backend.write(peer, pages, pages, b"", WAIT_S, range(layer, layer + 1)))
            return after_layer

        hooks = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(engine.runner.model.model.layers)]
    started = time.perf_counter()
    try:
        while not engine.step():
            pass
    finally:
        for handle in hooks:
            handle.remove()
    if not per_layer:
        pages = engine.requests[request_id].page_ids
        writes.append(backend.write(peer, pages, pages, b"", WAIT_S))
    for poster in posters:
        poster.join()
    for write in writes:
        write.result(WAIT_S)
    elapsed = time.perf_counter() - started
    engine.release(request_id)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--prompt-lengths", default="256,1024,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nixl-progress-thread", choices=("on", "off"), help="default: on for cuda, off on cpu")
    args = parser.parse_args()
    progress_thread = (args.nixl_progress_thread or ("on" if args.device == "cuda" else "off")) == "on"
    lengths = [int(n) for n in args.prompt_lengths.split(",")]
    if args.device == "cpu":
        torch.set_num_threads(1)  # as a CPU rank runs; the other core is the reader's and the transfer's
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    num_pages = -(-max(lengths) // PAGE_SIZE) + 8
    engine = Engine(EngineConfig(model=model_dir(args.device), dtype=dtype, device=args.device, page_size=PAGE_SIZE,
                                 num_pages=num_pages, max_num_batched_tokens=max(lengths), enable_prefix_cache=False,
                                 load_format="random", progress=False))
    kv = engine.runner.kv_cache
    writer = open_nixl_backend(f"writer-{uuid.uuid4().hex[:8]}", kv, lambda *_: None, progress_thread)
    conn, child = mp.get_context("spawn").Pipe()
    reader = mp.get_context("spawn").Process(target=reader_main, args=(
        child, f"reader-{uuid.uuid4().hex[:8]}", tuple(kv.shape), kv.dtype, args.device, progress_thread))
    reader.start()
    try:
        peer = writer.add_peer(conn.recv()).result(WAIT_S)
        generator = torch.Generator().manual_seed(0)
        rows = []
        for n in lengths:
            times = {False: [], True: []}
            for repeat in range(args.repeats + 1):  # the first of each is a warm-up
                for per_layer in (False, True):
                    prompt = torch.randint(2, 30000, (n,), generator=generator).tolist()
                    seconds = prefill_and_write(engine, writer, peer, prompt, per_layer)
                    if repeat:
                        times[per_layer].append(seconds)
            kv_mb = -(-n // PAGE_SIZE) * kv[:, 0].numel() * kv.element_size() / 1e6
            after, streamed = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
            rows.append((n, kv_mb, after, streamed))
    finally:
        conn.send("done")
        reader.join(30)
        writer.close()
    print(f"{args.device}, {kv.shape[0]} layers, KV {kv.shape[-1]} values per token and layer, {dtype}, NIXL progress "
          f"thread {'on' if progress_thread else 'off'}; prefill start -> all KV written, median of {args.repeats}")
    print(f"{'prompt':>7} {'KV MB':>7} {'write after (ms)':>17} {'per layer (ms)':>15} {'saved (ms)':>11}")
    for n, kv_mb, after, streamed in rows:
        print(f"{n:7d} {kv_mb:7.1f} {after:17.1f} {streamed:15.1f} {after - streamed:11.1f}")


if __name__ == "__main__":
    main()
