"""Engine settings, built once at the edge (offline API, CLI, worker flags) and passed down."""

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # auto: cuda if available, else cpu
    page_size: int = 16
    num_pages: int | None = None  # None: from kv_cache_memory_gib (CPU) or gpu_memory_fraction (GPU)
    kv_cache_memory_gib: float = 1.0
    gpu_memory_fraction: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # per-step token budget shared by decodes and prefill chunks
    max_model_len: int | None = None  # None: max_position_embeddings
    enable_prefix_cache: bool = True
    attention_backend: str = "auto"  # auto | torch | flashinfer
    moe_backend: str = "auto"  # auto | torch | grouped
    cuda_graphs: bool = True  # decode under CUDA graphs where it can run (flashinfer attention); ignored on CPU
    load_format: str = "safetensors"  # safetensors | random (the config's shape with random weights: benchmarks)
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        checks = [
            (self.dtype in ("auto", "float32", "bfloat16"), "dtype must be auto, float32 or bfloat16"),
            (self.page_size >= 1, "page_size must be >= 1"),
            (self.num_pages is None or self.num_pages >= 2, "num_pages must be >= 2"),
            (0.0 < self.gpu_memory_fraction <= 1.0, "gpu_memory_fraction must be in (0, 1]"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.attention_backend in ("auto", "torch", "flashinfer"), "attention_backend: auto, torch or flashinfer"),
            (self.moe_backend in ("auto", "torch", "grouped"), "moe_backend: auto, torch or grouped"),
            (self.load_format in ("safetensors", "random"), "load_format: safetensors or random"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message} (got {self})")
