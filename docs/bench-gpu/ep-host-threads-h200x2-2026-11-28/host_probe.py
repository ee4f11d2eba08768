"""Scratch probe (run from the repository root as `python3 <this file> <gpu_expert_parallel.py's arguments>`): where
EP ranks' host time goes in graph decode steps (the replay call, with the device busy and idle, the plan, the waits for
a replay), and what the captured graphs hold (node counts by type, through the driver API). Prints per rank process
every 32 steps; host-probe-default-threads.txt is its output with `--ranks 1,2 --batches 256 --graphs --iters 64
--variants peer,no-transfer`."""
import collections
import ctypes
import functools
import os
import sys
import time

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402

from pdserve.engine import cuda_graphs  # noqa: E402

T = {}
IDLE_EVERY = 4  # every 4th run starts on an idle device: its replay time is the launch alone


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            d = T.setdefault(name, [0, 0.0])
            d[0] += 1
            d[1] += time.perf_counter() - t
    return wrapper


_replay = torch.cuda.CUDAGraph.replay
_state = {"idle": False, "runs": 0}


def replay(self):
    t = time.perf_counter()
    _replay(self)
    d = T.setdefault("replay_idle" if _state["idle"] else "replay_busy", [0, 0.0])
    d[0] += 1
    d[1] += time.perf_counter() - t


_run = cuda_graphs.DecodeGraphs.run


def run(self, *a, **k):
    _state["runs"] += 1
    _state["idle"] = _state["runs"] % IDLE_EVERY == 0
    if _state["idle"]:
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = _run(self, *a, **k)
    d = T.setdefault("run_idle" if _state["idle"] else "run_busy", [0, 0.0])
    d[0] += 1
    d[1] += time.perf_counter() - t
    if _state["runs"] % 32 == 0:
        print(f"pid {os.getpid()} dev {torch.cuda.current_device()} " + " ".join(
            f"{n}={v[1] / v[0] * 1e3:.2f}ms/{v[0]}" for n, v in sorted(T.items())), flush=True)
        T.clear()
    return out


NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "sem_signal", 9: "sem_wait", 10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op",
              13: "conditional"}


def node_counts(graph: torch.cuda.CUDAGraph) -> dict:
    cuda = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    assert cuda.cuGraphGetNodes(handle, None, ctypes.byref(count)) == 0
    nodes = (ctypes.c_void_p * count.value)()
    assert cuda.cuGraphGetNodes(handle, nodes, ctypes.byref(count)) == 0
    kinds = collections.Counter()
    for node in nodes:
        kind = ctypes.c_int(0)
        cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        kinds[NODE_TYPES.get(kind.value, kind.value)] += 1
    return dict(kinds, total=count.value)


def capture(fn, pool):  # cuda_graphs.capture, keeping the graph to count its nodes
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    print(f"pid {os.getpid()} dev {torch.cuda.current_device()} graph nodes {node_counts(graph)}", flush=True)
    graph.instantiate()
    return graph, output


torch.cuda.CUDAGraph.replay = replay
cuda_graphs.DecodeGraphs.run = run
cuda_graphs.DecodeGraphs._plan = timed("plan", cuda_graphs.DecodeGraphs._plan)
cuda_graphs.DecodeGraphs._plan_ahead = timed("plan_ahead", cuda_graphs.DecodeGraphs._plan_ahead)
torch.cuda.Event.synchronize = timed("event_sync", torch.cuda.Event.synchronize)
cuda_graphs.capture = capture

if __name__ == "__main__":
    import gpu_expert_parallel
    gpu_expert_parallel.main()
