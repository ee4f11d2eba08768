"""Parameter counts of a DeepSeek-style checkpoint from its config.json, split the way expert parallelism splits
them: routed experts are sharded over an instance's ranks, everything else (embeddings, MLA attention, dense and
shared-expert MLPs, norms, router gates) is held by every rank. The chart's fit check reads the two numbers from
its values (`model.size`); this prints them for a config:

    python -m deploy.model_size pdserve/model/configs/deepseek-v3.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSize:
    replicated_params: int  # every rank holds these
    routed_expert_params: int  # sharded over the ranks of an expert-parallel instance

    @property
    def total_params(self) -> int:
        return self.replicated_params + self.routed_expert_params

    def weight_gib_per_rank(self, expert_parallel_ranks: int, bytes_per_param: float) -> float:
        params = self.replicated_params + self.routed_expert_params / expert_parallel_ranks
        return params * bytes_per_param / 2**30


def model_size(config: dict) -> ModelSize:
    """The served model's parameters (multi-token-prediction layers, which pdserve does not load, excluded)."""
    hidden, layers, heads = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_lora, kv_lora = config.get("q_lora_rank"), config["kv_lora_rank"]
    q_proj = hidden * q_lora + q_lora + q_lora * heads * (nope + rope) if q_lora else hidden * heads * (nope + rope)
    attention = q_proj + hidden * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim) + heads * v_dim * hidden
    dense_layers = min(config.get("first_k_dense_replace", 0), layers)
    moe_layers = layers - dense_layers if config.get("n_routed_experts") else 0
    expert = 3 * hidden * config.get("moe_intermediate_size", 0)
    gate = config.get("n_routed_experts", 0) * hidden + (config["n_routed_experts"] if config.get("topk_method") == "noaux_tc" else 0)
    embeddings = config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2)
    replicated = (embeddings + hidden  # final norm
                  + layers * (attention + 2 * hidden)
                  + (layers - moe_layers) * 3 * hidden * config["intermediate_size"]
                  + moe_layers * (config.get("n_shared_experts", 0) * expert + gate))
    return ModelSize(replicated_params=replicated, routed_expert_params=moe_layers * config.get("n_routed_experts", 0) * expert)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a checkpoint's config.json")
    size = model_size(json.loads(Path(parser.parse_args().config).read_text()))
    print("model:\n  size:")
    print(f"    replicatedParamsB: {size.replicated_params / 1e9:.2f}")
    print(f"    routedExpertParamsB: {size.routed_expert_params / 1e9:.2f}")
    print(f"# {size.total_params / 1e9:.1f}B parameters in all")


if __name__ == "__main__":
    main()
