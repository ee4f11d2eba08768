"""Decode and prefill speed of a random-weight model of a real shape, against limits measured in the same run.

One table: decode step time (batch x context) next to its memory roofline (bytes the step must read / HBM read
bandwidth), prefill tokens/s next to the bf16 matmul peak, and full-model bf16 logits against a float32 reference.

    python benchmarks/gpu_decode_prefill.py                      # V2-Lite shape on CUDA (flashinfer + grouped MoE)
    python benchmarks/gpu_decode_prefill.py --device cpu --attention torch --moe torch --layers 2 \
        --batches 1,2 --contexts 64 --prefill 64 --dtype float32 # smoke run of the script itself
"""

import argparse
import json
import time
from dataclasses import replace
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.model_steps import contiguous_batch, float32_reference_logits, step_inputs
from benchmarks.trace_gaps import summarize
from pdserve.engine.cuda_graphs import DecodeGraphConfig, DecodeGraphs
from pdserve.engine.piecewise_graphs import PiecewiseGraphConfig, PiecewiseGraphs
from pdserve.model.config import ModelConfig
from pdserve.model.compiled_layers import CompiledLayers, compile_layers
from pdserve.model.deepseek import DeepseekForCausalLM
from pdserve.model.loader import build_model
from pdserve.model.random_init import init_random_weights
from pdserve.ops.attention import AttentionBatch, new_kv_pool
from pdserve.ops.select import Backends, select_backends

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "pdserve" / "model" / "configs" / "deepseek-v2-lite.json"


def timed_ms(fn: Callable[[], object], device: torch.device, warmup: int = 2, iters: int = 10) -> float:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters


def hbm_read_bytes_per_s(device: torch.device, gib: float) -> float:
    """A large reduction reads every byte once and writes almost nothing: the read bandwidth a decode step sees."""
    data = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    ms = timed_ms(lambda: data.sum(), device)
    return data.numel() * 2 / (ms / 1e3)


def matmul_flop_per_s(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / (timed_ms(lambda: a @ b, device) / 1e3)


class ExpertCounter:
    """Wraps a MoE backend and records, per call (= per MoE layer), how many distinct routed experts were chosen (the
    shared experts' stacked copies, in a few tokens' slots, read what the dense MLP's weights count for)."""

    def __init__(self, inner, routed_experts: int):
        self.inner, self.routed, self.distinct = inner, routed_experts, []

    def forward(self, x, topk_ids, topk_weights, w13, w2, first_expert):
        self.distinct.append(torch.unique(topk_ids[topk_ids < self.routed]).numel())
        return self.inner.forward(x, topk_ids, topk_weights, w13, w2, first_expert)


def decode_bytes_read(model: DeepseekForCausalLM, distinct_experts: list[int], batch: AttentionBatch) -> int:
    """Weights the step touches (routed experts only where chosen, embedding rows only) plus the KV it attends to."""
    cfg, total, moe_layer = model.cfg, 0, 0
    for layer in model.model.layers:
        for name, param in layer.named_parameters():
            if "experts.w" in name:
                continue
            total += param.numel() * param.element_size()
        if layer.is_moe:
            experts = layer.mlp.experts
            per_expert = (experts.w13[0].numel() + experts.w2[0].numel()) * experts.w13.element_size()
            total += per_expert * distinct_experts[moe_layer]
            moe_layer += 1
    elem = model.lm_head.weight.element_size()
    total += model.lm_head.weight.numel() * elem + model.model.norm.weight.numel() * elem
    total += len(batch.query_lens) * cfg.hidden_size * elem  # embedding rows
    total += sum(batch.kv_lens) * cfg.num_hidden_layers * cfg.kv_dim * elem
    return total


def prefill_flop(model: DeepseekForCausalLM, num_tokens: int, attention_width: int) -> float:
    """Matmul FLOPs of one prefill from an empty cache; attention does `attention_width` multiply-adds per head per
    (query, key) pair: qk_head_dim + v_head_dim (192 + 128) for the model's own multi-head attention, the usual
    count, or 2 * kv_lora_rank + rope_dim (576 + 512) for the weight-absorbed form."""
    cfg = model.cfg
    per_token = 0
    for layer in model.model.layers:
        for name, param in layer.named_parameters():
            if param.dim() == 2 and "norm" not in name and "gate.weight" not in name:
                per_token += param.numel()
        if layer.is_moe:
            per_token += cfg.num_experts_per_tok * (layer.mlp.experts.w13[0].numel() + layer.mlp.experts.w2[0].numel())
            per_token += layer.mlp.gate.weight.numel()
    pairs = num_tokens * (num_tokens + 1) / 2
    attention = 2 * cfg.num_attention_heads * attention_width * pairs * cfg.num_hidden_layers
    return 2 * per_token * num_tokens + attention + 2 * model.lm_head.weight.numel()


def decode_row(model, kv_cache, scratch_page, batch_size, context, page_size, bytes_per_s, use_graph, compile_too,
               log) -> dict:
    cfg, device = model.cfg, kv_cache.device
    query_lens, kv_lens = [1] * batch_size, [context] * batch_size
    ids, positions, last_rows = step_inputs(query_lens, kv_lens, cfg.vocab_size, device)
    counter = ExpertCounter(model.backends.moe, cfg.n_routed_experts)
    counted = DeepseekForCausalLM.__new__(DeepseekForCausalLM)  # a view of the model with the counting backend
    counted.__dict__.update(model.__dict__)
    counted.backends = Backends(attention=model.backends.attention, moe=counter)
    batch = contiguous_batch(query_lens, kv_lens, page_size, device)
    with torch.inference_mode():
        counted(ids, positions, kv_cache, batch)
    roofline_bytes = decode_bytes_read(model, counter.distinct, batch)

    def eager_step():  # as the engine runs it: a new batch, so a new attention plan, every step
        step_batch = contiguous_batch(query_lens, kv_lens, page_size, device)
        return model.compute_logits(model(ids, positions, kv_cache, step_batch)[last_rows])

    with torch.inference_mode():
        eager_ms = timed_ms(eager_step, device)
    graph_ms = regions_ms = compiled_ms = overlapped_ms = host_ms = logits_diff = float("nan")
    if use_graph:
        try:
            graph_ms, logits, _ = engine_graph_step_ms(model, kv_cache, scratch_page, query_lens, kv_lens, page_size)
            if compile_too:
                regions_ms, _, _ = engine_graph_step_ms(model, kv_cache, scratch_page, query_lens, kv_lens, page_size,
                                                        compiled=(True, False))
                compiled_ms, compiled_logits, _ = engine_graph_step_ms(model, kv_cache, scratch_page, query_lens,
                                                                       kv_lens, page_size, compiled=(True, True))
                logits_diff = relative_diff(compiled_logits, logits)
                overlapped_ms, _, host_ms = engine_graph_step_ms(model, kv_cache, scratch_page, query_lens, kv_lens,
                                                                 page_size, compiled=(True, True), overlapped=True)
        except Exception as error:  # report and go on: the eager figure still stands
            log(f"cuda graph capture failed at batch {batch_size}: {type(error).__name__}: {error}")
    roofline_ms = roofline_bytes / bytes_per_s * 1e3
    best = min(t for t in (eager_ms, graph_ms, regions_ms, compiled_ms, overlapped_ms) if t == t)
    return dict(batch=batch_size, context=context, gb=roofline_bytes / 1e9, roofline_ms=roofline_ms,
                eager_ms=eager_ms, graph_ms=graph_ms, regions_ms=regions_ms, compiled_ms=compiled_ms,
                overlapped_ms=overlapped_ms, host_ms=host_ms,
                logits_diff=logits_diff,
                ratio=roofline_ms / best)


def engine_graph_step_ms(model, kv_cache, scratch_page, query_lens, kv_lens, page_size, iters: int = 20,
                         compiled: tuple[bool, bool] = (False, False),
                         profile_log: Callable[[str], None] | None = None, overlapped: bool = False,
                         trace: Path | None = None) -> tuple[float, torch.Tensor, float]:
    """The engine's decode path: DecodeGraphs.run (host plan + input copy + replay), synchronised every step as the
    engine's sampler did before overlapped scheduling, every sequence one token longer each step as in real decoding
    (the context grows by at most warm-up + iters tokens); sequences own contiguous pages, one spare each for the
    growth. `compiled`: the layers' regions, and the routed experts' glue, compiled by inductor inside the graphs;
    `profile_log`: also print three steps' hot spots (and write their timeline to `trace`). `overlapped`: no wait for the device between steps, as
    the engine runs them under overlapped scheduling (the host plans and launches a step while the last one runs).
    Returns the step time, the first step's logits and, overlapped, the host's busy time a step (a step's wall time
    less the waits for the device: above the step time's device share, the host is what sets the pace)."""
    batch_size, context = len(kv_lens), kv_lens[0]
    pages = -(-context // page_size) + 1
    graphs = DecodeGraphs(model, kv_cache, page_size, DecodeGraphConfig((batch_size,), pages), scratch_page,
                          compiled=_compiled(model, *compiled))
    page_ids = [list(range(i * pages, (i + 1) * pages)) for i in range(batch_size)]
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.cfg.vocab_size, (batch_size,), generator=gen).tolist()
    steps_taken = [0]

    def step():
        length = context + steps_taken[0] % page_size  # stays within the spare page however often it is called
        pos = length - 1
        slots = [ids[pos // page_size] * page_size + pos % page_size for ids in page_ids]
        graphs.run(input_ids, [pos] * batch_size, slots, [length] * batch_size, page_ids)
        if not overlapped:
            torch.cuda.synchronize()
        steps_taken[0] += 1

    pos = context - 1
    first_logits = graphs.run(input_ids, [pos] * batch_size, [ids[pos // page_size] * page_size + pos % page_size
                                                              for ids in page_ids], [context] * batch_size, page_ids)
    first_logits = first_logits.clone()
    ms = timed_ms(step, kv_cache.device, iters=iters)
    host_ms = host_busy_ms(step, iters) if overlapped else float("nan")
    if profile_log is not None:
        profile_step(step, profile_log, steps=3, trace=trace)
    del graphs
    return ms, first_logits, host_ms


def host_busy_ms(step: Callable[[], object], iters: int) -> float:
    """Mean host time of `step` less what it spends waiting in CUDA event syncs (where the overlapped engine waits for
    the step before last)."""
    waited = [0.0]
    sync = torch.cuda.Event.synchronize

    def timed_sync(event):
        start = time.perf_counter()
        sync(event)
        waited[0] += time.perf_counter() - start

    torch.cuda.synchronize()
    torch.cuda.Event.synchronize = timed_sync
    try:
        start = time.perf_counter()
        for _ in range(iters):
            step()
        busy = time.perf_counter() - start - waited[0]
    finally:
        torch.cuda.Event.synchronize = sync
    torch.cuda.synchronize()
    return busy * 1e3 / iters


def _compiled(model, regions: bool, experts: bool) -> CompiledLayers | None:
    if not regions:
        return None
    compiled = compile_layers(model)
    return compiled if experts else replace(compiled, moe=model.backends.moe)


def relative_diff(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return ((logits - reference).norm() / reference.norm()).item()


def profile_step(step: Callable[[], object], log, steps: int = 1, trace: Path | None = None) -> None:
    """Host and device hot spots of `steps` calls of `step` (after a warm-up call); `trace`: the timeline is written
    there and the GPU's idle gaps printed (benchmarks/trace_gaps.py)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if trace:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        log(f"{steps} steps\n" + summarize(trace))
    log(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))


def profile_decode_step(model, kv_cache, batch_size, context, page_size, log) -> None:
    device = kv_cache.device
    query_lens, kv_lens = [1] * batch_size, [context] * batch_size
    ids, positions, last_rows = step_inputs(query_lens, kv_lens, model.cfg.vocab_size, device)

    def eager_step():
        step_batch = contiguous_batch(query_lens, kv_lens, page_size, device)
        return model.compute_logits(model(ids, positions, kv_cache, step_batch)[last_rows])

    with torch.inference_mode():
        profile_step(eager_step, log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--moe", default="auto")
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (smoke runs)")
    parser.add_argument("--fp8", action="store_true", help="the config's linears block-quantized to FP8 and kept "
                        "FP8 (as DeepSeek-V3's checkpoint ships them), random weights as with bf16")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--prefill", default="1024,4096,16384")
    parser.add_argument("--check-tokens", type=int, default=512, help="tokens per sequence (2 seqs) for the logits check")
    parser.add_argument("--no-graph", action="store_true")
    parser.add_argument("--no-compile", action="store_true", help="skip the graphs with compiled layer regions")
    parser.add_argument("--unfused", action="store_true", help="separate GEMMs for the linears that read the same "
                        "input (q and kv_a; gate and up), as before they were fused")
    parser.add_argument("--profile-graph", type=int, default=0, help="print the device hot spots of the engine's "
                        "graph steps (compiled regions, overlapped) at this batch size, 4k context, and stop")
    parser.add_argument("--trace-dir", help="--profile-graph also writes the steps' timeline here and prints the "
                        "GPU's idle gaps")
    parser.add_argument("--check-only", action="store_true", help="only the logits check")
    parser.add_argument("--profile-decode", type=int, default=0, help="print host/device hot spots of one eager "
                        "decode step at this batch size (4k context) after the logits check, then stop")
    parser.add_argument("--profile-prefill", type=int, default=0, help="also print the hot spots of the prefill of "
                        "this many tokens (one of --prefill)")
    parser.add_argument("--log", default=None)
    args = parser.parse_args()
    log_file = open(args.log, "w") if args.log else None

    def log(line: str) -> None:
        print(line, flush=True)
        if log_file:
            print(line, file=log_file, flush=True)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    raw = json.loads(Path(args.config).read_text())
    if args.layers:
        raw["num_hidden_layers"] = args.layers
    if args.fp8:
        from benchmarks.gpu_logits_error import FP8_QUANTIZATION

        raw["quantization_config"] = FP8_QUANTIZATION
    cfg = ModelConfig.from_dict(raw)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    prefills = [int(p) for p in args.prefill.split(",")]
    if args.check_only or args.profile_decode or args.profile_graph:
        batches, contexts, prefills = [max(args.profile_decode, args.profile_graph, 1)], [4096], [1]
    on_cuda = device.type == "cuda"

    bytes_per_s = hbm_read_bytes_per_s(device, 4.0 if on_cuda else 0.25)
    flop_per_s = matmul_flop_per_s(device, dtype, 8192 if on_cuda else 1024)
    log(f"device: {torch.cuda.get_device_name(device) if on_cuda else 'cpu'}; HBM read {bytes_per_s / 1e12:.2f} TB/s; "
        f"{args.dtype} matmul {flop_per_s / 1e12:.0f} TFLOP/s")

    backends = select_backends(args.attention, args.moe, device, dtype)
    model = init_random_weights(build_model(cfg, backends, device, dtype, keep_fp8=args.fp8, fuse=not args.unfused),
                                seed=0)
    params = sum(p.numel() for p in model.parameters())
    log(f"model: {params / 1e9:.2f}B params, {cfg.num_hidden_layers} layers; backends "
        f"{type(backends.attention).__name__} + {type(backends.moe).__name__}")

    max_tokens = max(max(batches) * max(contexts), max(prefills), 2 * args.check_tokens)
    num_pages = -(-max_tokens // args.page_size) + max(batches)
    scratch_page = num_pages  # one page past the rest for the graphs' padding rows, as the engine's ModelRunner does
    kv_cache = new_kv_pool(cfg.num_hidden_layers, num_pages + 1, args.page_size, cfg.kv_dim, dtype, device)  # as served
    for layer_cache in kv_cache:
        layer_cache.normal_()
    log(f"kv pool: {num_pages} pages of {args.page_size}, {kv_cache.numel() * kv_cache.element_size() / 1e9:.1f} GB")

    # Correctness first: full-model logits against float32 on the same device.
    query_lens = [args.check_tokens] * 2
    ids, positions, last_rows = step_inputs(query_lens, query_lens, cfg.vocab_size, device, seed=1)
    batch = contiguous_batch(query_lens, query_lens, args.page_size, device)
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, kv_cache, batch)[last_rows])
    reference = float32_reference_logits(model, ids, positions, batch, last_rows)
    logits_err = relative_diff(logits, reference)
    log(f"logits rel err vs float32: {logits_err:.2e} (nan: {bool(torch.isnan(logits).any())})")
    # (backends, regions) of the layers' regions compiled with the grouped experts, as the engine's eager steps run
    # them; None where nothing is compiled.
    compiled_args = None
    if on_cuda and not args.no_compile:  # the same prefill with the layers' regions compiled (expanded form)
        with torch.inference_mode():
            layers = compile_layers(model)
            compiled_args = (replace(model.backends, moe=layers.moe), layers.regions)
            hidden = model(ids, positions, kv_cache, batch, *compiled_args)
            compiled = model.compute_logits(hidden[last_rows])
        log(f"logits rel err vs float32, compiled regions: {relative_diff(compiled, reference):.2e}")

    if args.check_only:
        return
    if args.profile_decode:
        profile_decode_step(model, kv_cache, args.profile_decode, 4096, args.page_size, log)
        return
    if args.profile_graph:
        lens = [4096] * args.profile_graph
        ms, _, host_ms = engine_graph_step_ms(
            model, kv_cache, scratch_page, [1] * args.profile_graph, lens, args.page_size,
            iters=200, compiled=(not args.no_compile,) * 2, profile_log=log, overlapped=True,
            trace=Path(args.trace_dir) / f"decode-batch{args.profile_graph}.json.gz" if args.trace_dir else None)
        log(f"decode batch {args.profile_graph} x 4096, overlapped graph steps: {ms:.3f} ms a step, host busy "
            f"{host_ms:.2f} ms")
        return

    # The engine's steps outside the decode graphs: pieces between the attention calls replayed as CUDA graphs,
    # captured at exactly the prefill sizes timed (the engine pads to its ladder of sizes); the CPU runs them directly.
    pieces = None
    if not args.no_graph:
        started = time.perf_counter()
        backends_and_regions = compiled_args or (model.backends, None)
        pieces = PiecewiseGraphs(model, PiecewiseGraphConfig(tuple(sorted(set(prefills)))), *backends_and_regions,
                                 device, dtype)
        log(f"piecewise graphs captured for {sorted(set(prefills))} tokens in {time.perf_counter() - started:.1f} s")

    prefill_rows = []
    for n in prefills:
        ids, positions, last_rows = step_inputs([n], [n], cfg.vocab_size, device)

        def prefill_step(backends_and_regions: tuple = (None, None)):
            step_batch = contiguous_batch([n], [n], args.page_size, device)
            return model.compute_logits(model(ids, positions, kv_cache, step_batch, *backends_and_regions)[last_rows])

        def piecewise_step():
            step_batch = contiguous_batch([n], [n], args.page_size, device)
            return model.compute_logits(pieces.forward(ids, positions, kv_cache, step_batch)[last_rows])

        with torch.inference_mode():
            ms = timed_ms(prefill_step, device, warmup=1, iters=3)
            compiled_ms = (timed_ms(lambda: prefill_step(compiled_args), device, warmup=1, iters=3) if compiled_args
                           else float("nan"))
            piecewise_ms = timed_ms(piecewise_step, device, warmup=1, iters=3) if pieces else float("nan")
            if pieces:
                diff = relative_diff(piecewise_step(), prefill_step(compiled_args or (None, None)))
                log(f"prefill {n}: piecewise graphs vs the same steps without them, logits differ by {diff:.1e}")
        model_width = cfg.qk_head_dim + cfg.v_head_dim
        fraction = prefill_flop(model, n, model_width) / (ms / 1e3) / flop_per_s
        absorbed_fraction = prefill_flop(model, n, 2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim) / (ms / 1e3) / flop_per_s
        prefill_rows.append((n, ms, compiled_ms, piecewise_ms, n / (ms / 1e3), fraction, absorbed_fraction))
        log(f"prefill {n}: {ms:.1f} ms eager, {compiled_ms:.1f} ms compiled regions, {piecewise_ms:.1f} ms piecewise "
            f"graphs, {n / (ms / 1e3):,.0f} tok/s, "
            f"{fraction:.0%} of matmul peak ({absorbed_fraction:.0%} counting absorbed-form attention)")
        if args.profile_prefill == n:
            with torch.inference_mode():
                profile_step(prefill_step, log)
                if compiled_args:
                    log(f"prefill {n} with compiled regions:")
                    profile_step(lambda: prefill_step(compiled_args), log)
                if pieces:
                    log(f"prefill {n} under piecewise graphs:")
                    profile_step(piecewise_step, log)

    decode_rows = []
    for context in contexts:
        for batch_size in batches:
            row = decode_row(model, kv_cache, scratch_page, batch_size, context, args.page_size, bytes_per_s,
                             on_cuda and not args.no_graph, not args.no_compile, log)
            decode_rows.append(row)
            log(f"decode {row}")

    log("")
    log("| decode batch | context | bytes read (GB) | roofline (ms) | eager (ms) | engine CUDA graph (ms) | "
        "graph, layer regions compiled (ms) | graph, regions + experts compiled (ms) | same, overlapped (ms) | "
        "host busy a step, overlapped (ms) | compiled vs graph logits | roofline/best |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in decode_rows:
        log(f"| {r['batch']} | {r['context']} | {r['gb']:.1f} | {r['roofline_ms']:.2f} | {r['eager_ms']:.2f} | "
            f"{r['graph_ms']:.2f} | {r['regions_ms']:.2f} | {r['compiled_ms']:.2f} | {r['overlapped_ms']:.2f} | "
            f"{r['host_ms']:.2f} | {r['logits_diff']:.1e} | "
            f"{r['ratio']:.0%} |")
    log("")
    log("| prefill tokens | eager (ms) | compiled regions (ms) | piecewise graphs (ms) | eager tokens/s | "
        "eager fraction of bf16 matmul peak | same, absorbed-form attention FLOPs |")
    log("|---|---|---|---|---|---|---|")
    for n, ms, compiled_ms, piecewise_ms, tps, fraction, absorbed_fraction in prefill_rows:
        log(f"| {n} | {ms:.1f} | {compiled_ms:.1f} | {piecewise_ms:.1f} | {tps:,.0f} | {fraction:.0%} | "
            f"{absorbed_fraction:.0%} |")
    log("")
    log(f"HBM read {bytes_per_s / 1e12:.2f} TB/s, matmul {flop_per_s / 1e12:.0f} TFLOP/s, "
        f"full-model logits rel err vs float32 {logits_err:.2e}")


if __name__ == "__main__":
    main()
