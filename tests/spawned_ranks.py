"""Running one function in R spawned processes (the ranks of a torch.distributed group) and collecting what each
puts on its queue, with every process joined or killed however the test ends."""

import torch.multiprocessing as mp


def run_spawned_ranks(target, args_per_rank: list[tuple], timeout_s: float) -> dict:
    """`target(*args, results)` per rank; each puts `(rank, *rest)` on `results`: returns {rank: rest}."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, results)) for args in args_per_rank]
    for proc in procs:
        proc.start()
    try:
        got = {}
        for _ in procs:
            rank, *rest = results.get(timeout=timeout_s)
            got[rank] = rest
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return got
