"""What a full garbage collection costs a process once it has imported what one of pdserve's processes imports, before
and after `gc.freeze()`. A collection holds the GIL, so an event loop, and every stream it serves or reads, waits it
out: the benchmark client (torch through the model generator, ray through the local cluster, matplotlib through the
plots), a worker's HTTP edge (`pdserve.worker.process`), the router (`pdserve_router.app`).

    python benchmarks/gc_pause.py [--imports pdserve.worker.process] [--repeats 5]
"""

import argparse
import gc
import importlib
import statistics
import time

CLIENT_IMPORTS = "pdserve.bench.plot,pdserve.cluster.local,pdserve.model.tiny"


def full_collection_ms(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--imports", default=CLIENT_IMPORTS, help="modules to import first, comma-separated "
                                                                  "(default: the benchmark client's)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for module in args.imports.split(","):
        importlib.import_module(module)
    tracked = len(gc.get_objects())
    before = full_collection_ms(args.repeats)
    gc.freeze()
    after = full_collection_ms(args.repeats)
    print("| imports | objects tracked | full collection, ms (median) | after gc.freeze(), ms |")
    print("|---|---:|---:|---:|")
    print(f"| {args.imports} | {tracked:,} | {before:.1f} | {after:.3f} |")


if __name__ == "__main__":
    main()
