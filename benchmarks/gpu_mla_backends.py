"""MLA decode attention alone, by flashinfer backend: device time per call (kernels only, from the profiler) at the
decode graphs' shapes, against the time to read the step's latent cache once at the measured HBM bandwidth.

    python3 benchmarks/gpu_mla_backends.py --batches 1,4,16,64,256 --context 4096 --backends fa2,fa3
"""

import argparse

import torch
from gpu_decode_prefill import hbm_read_bytes_per_s
from torch.profiler import ProfilerActivity, profile

HEADS, CKV, KPE, PAGE = 16, 512, 64, 64


def mla_call(backend: str, batch: int, context: int, device: torch.device):
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    pages_per_seq = -(-context // PAGE)
    kv_cache = torch.randn(batch * pages_per_seq, PAGE, CKV + KPE, dtype=torch.bfloat16, device=device)
    wrapper = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=device), backend=backend)
    metadata = MLAPlanMetadata.csr(
        qo_indptr=torch.arange(batch + 1, dtype=torch.int32),
        kv_indptr=torch.arange(batch + 1, dtype=torch.int32) * pages_per_seq,
        kv_indices=torch.arange(batch * pages_per_seq, dtype=torch.int32, device=device),
        kv_len_arr=torch.full((batch,), context, dtype=torch.int32),
    )
    wrapper.plan(metadata=metadata, num_heads=HEADS, head_dim_ckv=CKV, head_dim_kpe=KPE, page_size=PAGE, causal=True,
                 sm_scale=0.1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, query_layout="split",
                 kv_cache_layout="packed")
    q_latent = torch.randn(batch, HEADS, CKV, dtype=torch.bfloat16, device=device)
    q_pe = torch.randn(batch, HEADS, KPE, dtype=torch.bfloat16, device=device)
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
    print("| batch | latent read at HBM speed (us) | " + " | ".join(f"{b} (us)" for b in backends) + " |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in backends) + " |")
    for batch in (int(b) for b in args.batches.split(",")):
        floor_us = batch * args.context * (CKV + KPE) * 2 / bytes_per_s * 1e6
        cells = []
        for backend in backends:
            try:
                cells.append(f"{device_us_per_call(mla_call(backend, batch, args.context, device)):.1f}")
            except Exception as error:  # a backend that refuses the shape: say so and go on
                cells.append(f"{type(error).__name__}")
        print(f"| {batch} | {floor_us:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
