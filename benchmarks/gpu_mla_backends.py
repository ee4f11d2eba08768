"""MLA decode attention alone, by flashinfer backend: device time per call (kernels only, from the profiler) at the
decode graphs' shapes, against the time to read the step's latent cache once at the measured HBM bandwidth.

    python3 benchmarks/gpu_mla_backends.py --batches 1,4,16,64,256 --context 4096 --backends fa2,fa3,triton

"triton" is pdserve's split-KV kernels (pdserve/ops/mla_decode_triton.py); the last column is the largest relative
difference of any backend's output from the first's, on the same inputs.
"""

import argparse
import itertools

import torch
from gpu_decode_prefill import hbm_read_bytes_per_s
from torch.profiler import ProfilerActivity, profile

HEADS, CKV, KPE, PAGE = 16, 512, 64, 64
SCALE = 0.1


def mla_inputs(batch: int, context: int, device: torch.device):
    pages_per_seq = -(-context // PAGE)
    kv_cache = torch.randn(batch * pages_per_seq, PAGE, CKV + KPE, dtype=torch.bfloat16, device=device)
    q_latent = torch.randn(batch, HEADS, CKV, dtype=torch.bfloat16, device=device)
    q_pe = torch.randn(batch, HEADS, KPE, dtype=torch.bfloat16, device=device)
    page_ids = [list(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(batch)]
    return q_latent, q_pe, kv_cache, page_ids


def mla_call(backend: str, q_latent, q_pe, kv_cache, page_ids: list[list[int]], context: int):
    """A decode call by flashinfer's MLA backend (fa2, fa3), or pdserve's split-KV kernels ("triton") as a decode
    graph slot of this batch size makes it."""
    batch, device = q_latent.shape[0], q_latent.device
    if backend.startswith("triton"):  # "triton:N": N chunks a sequence instead of the slot's
        from pdserve.ops.mla_decode_triton import TritonMLAGraphSlot, mla_decode

        slot = TritonMLAGraphSlot(batch, sum(map(len, page_ids)), PAGE, HEADS, CKV, device)
        slot.plan([context] * batch, page_ids)
        part_out, part_lse = slot.partials
        if ":" in backend:
            splits = int(backend.split(":")[1])
            part_out, part_lse = part_out.new_empty(batch, splits, HEADS, CKV), part_lse.new_empty(batch, splits, HEADS)
        return lambda: mla_decode(q_latent, q_pe, kv_cache, slot.meta, part_out, part_lse, PAGE, SCALE)
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    wrapper = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=device), backend=backend)
    metadata = MLAPlanMetadata.csr(
        qo_indptr=torch.arange(batch + 1, dtype=torch.int32),
        kv_indptr=torch.tensor([0, *itertools.accumulate(map(len, page_ids))], dtype=torch.int32),
        kv_indices=torch.tensor(list(itertools.chain(*page_ids)), dtype=torch.int32, device=device),
        kv_len_arr=torch.full((batch,), context, dtype=torch.int32),
    )
    wrapper.plan(metadata=metadata, num_heads=HEADS, head_dim_ckv=CKV, head_dim_kpe=KPE, page_size=PAGE, causal=True,
                 sm_scale=SCALE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, query_layout="split",
                 kv_cache_layout="packed")
    return lambda: wrapper.run(query=(q_latent, q_pe), kv_cache=kv_cache)


def device_us_per_call(call, calls: int = 50) -> float:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time_total for e in kernels if "memcpy" not in e.name.lower()) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--backends", default="fa2,fa3")
    args = parser.parse_args()
    device = torch.device("cuda")
    bytes_per_s = hbm_read_bytes_per_s(device, 4.0)
    backends = args.backends.split(",")
    print(f"{torch.cuda.get_device_name()}; HBM read {bytes_per_s / 1e12:.2f} TB/s; context {args.context}")
    print("| batch | latent read at HBM speed (us) | " + " | ".join(f"{b} (us)" for b in backends)
          + " | outputs' largest relative difference |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in backends) + " | ---: |")
    for batch in (int(b) for b in args.batches.split(",")):
        floor_us = batch * args.context * (CKV + KPE) * 2 / bytes_per_s * 1e6
        inputs = mla_inputs(batch, args.context, device)
        cells, outputs = [], {}
        for backend in backends:
            try:
                call = mla_call(backend, *inputs, args.context)
                outputs[backend] = call().float()
                cells.append(f"{device_us_per_call(call):.1f}")
            except Exception as error:  # a backend that refuses the shape: say so and go on
                cells.append(f"{type(error).__name__}")
        first, *others = outputs.values()
        diff = max((((o - first).norm() / first.norm()).item() for o in others), default=0.0)
        print(f"| {batch} | {floor_us:.1f} | " + " | ".join(cells) + f" | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
