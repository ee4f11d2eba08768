"""pdserve: disaggregated prefill/decode serving of DeepSeek-style MLA + MoE models."""

from typing import Any

__all__ = ["LLM", "SamplingParams", "GenerationResult"]


def __getattr__(name: str) -> Any:
    # Lazy, so light users (the router, the cache) do not import torch and the model code.
    if name in ("LLM", "GenerationResult"):
        from pdserve.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from pdserve.wire.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
