"""Engine settings, built once at the edge (offline API, CLI, worker flags) and passed down."""

from dataclasses import dataclass
from typing import Literal

from pdserve.settings.flags import setting


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a Hugging Face model directory
    dtype: Literal["auto", "float32", "bfloat16"] = setting("auto", "weights and activations (auto: float32 on CPU, "
                                                                     "bfloat16 on GPU)")
    device: str = setting("auto", "torch device (auto: cuda if available, else cpu)")
    page_size: int = setting(16, "tokens per KV page")
    num_pages: int | None = setting(None, "KV pages per rank (default: from --kv-cache-memory-gib on the CPU, "
                                          "--gpu-memory-fraction on a GPU)")
    kv_cache_memory_gib: float = setting(1.0, "KV pool per rank on the CPU, in GiB")
    gpu_memory_fraction: float = setting(0.9, "share of GPU memory for weights, activations and the KV pool")
    max_num_seqs: int = setting(256, "requests a rank runs at once")
    decode_reserve_tokens: int = setting(
        512, "a decode rank reserves pages for a new prompt only while the pool keeps room for up to this many more "
             "tokens of every sequence it already holds (fewer where a sequence's max_tokens ends sooner): otherwise "
             "its running requests outgrow the pool and are preempted, and their recompute stalls every decode. 0: "
             "reserve while the prompt's pages are free")
    max_num_batched_tokens: int = setting(2048, "per-step token budget shared by decodes and prefill chunks")
    mixed_prefill_tokens: int | None = setting(
        None, "prefill tokens a step may carry beside running decodes (default: all of --max-num-batched-tokens). "
              "Each such step is one inter-token gap for every running request: fewer bound ITL while long prompts "
              "arrive, at some prefill throughput (docs/benchmarks.md, mixed steps)")
    max_model_len: int | None = setting(None, "context length (default: the model's max_position_embeddings)")
    enable_prefix_cache: bool = setting(True, "reuse cached KV pages of shared prompt prefixes", flag="--prefix-cache")
    host_kv_cache_gib: float = setting(
        0.0, "host memory per rank for the prefix cache's second tier: pages evicted from the KV pool are copied "
             "there (pinned, on the step's stream) and copied back when a prompt continues their prefix, instead of "
             "being recomputed. 0: off")
    attention_backend: Literal["auto", "torch", "flashinfer"] = setting("auto", "attention kernels (auto: flashinfer "
                                                                                "on GPU where it runs)")
    moe_backend: Literal["auto", "torch", "grouped"] = setting("auto", "expert matmuls (auto: grouped on GPU)")
    fp8_weights: Literal["auto", "keep", "dequantize"] = setting(
        "auto", "an FP8 checkpoint's FP8 linears (also random weights of an FP8 config): keep them FP8, half of "
                "bf16's bytes, computed by FP8 GEMMs on CUDA; or dequantize them to --dtype at load. auto: keep on "
                "CUDA in bfloat16 with Triton installed, dequantize elsewhere (the CPU's reference would dequantize "
                "every weight on every call)")
    cuda_graphs: bool = setting(True, "decode under CUDA graphs where it can run (flashinfer attention; not on CPU)")
    compile_layers: Literal["auto", "on", "off"] = setting(
        "auto", "compile each decoder layer's tensor work between the attention and expert kernels (norms, RoPE, "
                "residuals, routing, the grouped experts' sort and gathers) with torch.compile into fused kernels "
                "inside the decode CUDA graphs; compiled at start-up (tens of seconds). auto: on for bf16 on CUDA "
                "unless FP8 linears are kept")
    compile_eager_steps: bool = setting(
        True, "where layers are compiled, steps outside the decode graphs (prefill chunks, mixed steps) run them "
              "compiled too: one graph for every token count, a few fused kernels a region instead of the ~85 "
              "launches a layer that made an eager step host-bound")
    piecewise_graphs: bool = setting(
        True, "where decode graphs run, steps outside them (prefill chunks, mixed steps) of up to 2,048 tokens "
              "replay CUDA graphs captured at start-up for a ladder of token counts, between their attention calls: "
              "the host launches a layer as one graph, not as its regions' kernels (larger steps are not host-bound; "
              "expert parallelism: off)")
    expert_exchange: Literal["auto", "fixed", "splits"] = setting(
        "auto", "expert parallelism's exchange in decode steps. fixed: C rows per peer, no host wait, so decode runs "
                "under CUDA graphs (a step where some rank's pairs overflow C runs again with split sizes); splits: "
                "split sizes exchanged first (eager steps). Prefill steps always exchange split sizes. auto: fixed "
                "where decode graphs run")
    expert_peer_writes: Literal["auto", "on", "off"] = setting(
        "auto", "fixed exchange on CUDA: each rank writes its peers' rows straight into their memory (NVLink, torch's "
                "symmetric memory) and meets them at a device barrier, instead of NCCL's all-to-all; needs every rank "
                "of the instance on one host, each seeing all of its GPUs. auto: on where the ranks report that")
    expert_capacity_factor: float = setting(
        2.0, "fixed exchange: C as a multiple of an even share of a step's (token, expert) pairs (at the number of "
             "ranks or more, C holds every pair and nothing can overflow)")
    redundant_experts: int = setting(
        0, "expert parallelism: spare slots each rank keeps in every MoE layer for replicas of the hottest experts "
           "(EPLB-style), re-planned from the measured load every expert_rebalance_steps steps; prefill steps (split "
           "sizes) spread a replicated expert's pairs over its holders, decode graphs keep them with the owner")
    expert_rebalance_steps: int = setting(1000, "redundant_experts: steps between two re-plans of the replicas")
    overlap_scheduling: Literal["auto", "on", "off"] = setting(
        "auto", "prepare step N+1 on the host while the device runs step N (sampled tokens stay on the device; ends "
                "are seen one step late and the extra token dropped; batches with grammars or penalties step "
                "synchronously). auto: on for GPU devices, where the host's work otherwise stalls the GPU")
    load_format: Literal["safetensors", "random"] = setting("safetensors", "random: the config's shape with random "
                                                                           "weights (benchmarks; no checkpoint needed)")
    seed: int = setting(0, "seed of random weights and of unseeded sampling")
    execution: Literal["model", "simulated"] = setting(
        "model", "simulated: no model; each step sleeps what --profile predicts and draws random tokens (real "
                 "scheduler, pages, prefix cache and KV events; docs/simulation.md)", flag="--engine")
    profile: str = setting("", "simulated engine: step-time profile JSON (default: DeepSeek-V2-Lite on one H100)")
    time_scale: float = setting(1.0, "simulated engine: sleep this multiple of each predicted step (above 1 when "
                                     "many ranks share few cores: every figure then scales by it)",
                                flag="--sim-time-scale")
    progress: bool = True  # progress bars while loading (off in workers, whose output is logs)

    def __post_init__(self) -> None:
        checks = [
            (self.dtype in ("auto", "float32", "bfloat16"), "dtype must be auto, float32 or bfloat16"),
            (self.page_size >= 1, "page_size must be >= 1"),
            (self.num_pages is None or self.num_pages >= 2, "num_pages must be >= 2"),
            (self.host_kv_cache_gib >= 0, "host_kv_cache_gib must be >= 0"),
            (not self.host_kv_cache_gib or self.enable_prefix_cache, "host_kv_cache_gib needs the prefix cache"),
            (not self.host_kv_cache_gib or self.execution == "model",
             "host_kv_cache_gib needs the model (a simulated engine holds no KV bytes)"),
            (0.0 < self.gpu_memory_fraction <= 1.0, "gpu_memory_fraction must be in (0, 1]"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.decode_reserve_tokens >= 0, "decode_reserve_tokens must be >= 0"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.mixed_prefill_tokens is None or self.mixed_prefill_tokens >= 1, "mixed_prefill_tokens must be >= 1"),
            (self.attention_backend in ("auto", "torch", "flashinfer"), "attention_backend: auto, torch or flashinfer"),
            (self.moe_backend in ("auto", "torch", "grouped"), "moe_backend: auto, torch or grouped"),
            (self.expert_exchange in ("auto", "fixed", "splits"), "expert_exchange: auto, fixed or splits"),
            (self.compile_layers in ("auto", "on", "off"), "compile_layers: auto, on or off"),
            (self.expert_capacity_factor > 0, "expert_capacity_factor must be > 0"),
            (self.redundant_experts >= 0, "redundant_experts must be >= 0"),
            (self.expert_rebalance_steps >= 1, "expert_rebalance_steps must be >= 1"),
            (self.fp8_weights in ("auto", "keep", "dequantize"), "fp8_weights: auto, keep or dequantize"),
            (self.load_format in ("safetensors", "random"), "load_format: safetensors or random"),
            (self.execution in ("model", "simulated"), "execution: model or simulated"),
            (self.time_scale > 0, "time_scale must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def reads_weights(self) -> bool:
        """Whether the model directory must hold weights: not for random weights nor for a simulated engine."""
        return self.load_format == "safetensors" and self.execution == "model"
