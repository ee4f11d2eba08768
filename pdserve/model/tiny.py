"""Small random DeepSeek-V2/V3 checkpoints in the official Hugging Face layout, made on the CPU from a seed.

They exist so tests can compare pdserve with transformers on a model that loads in seconds. The random init is
scaled so that greedy decoding has clear argmax margins (see TINY_LOGIT_STD) and MoE routing clear expert gaps.
"""

import json
import math
import shutil
from pathlib import Path

import torch

from pdserve.model.safetensors_shards import read_safetensors_checkpoint, write_safetensors_checkpoint
from pdserve.model.tiny_deepseek_tokenizer import write_deepseek_tokenizer
from pdserve.model.tiny_tokenizer import write_tiny_tokenizer
from pdserve.ops.block_fp8 import DEFAULT_BLOCK_SIZE, FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8

# Target std of the final logits: wide enough that top-1 and top-2 rarely come within rounding noise.
TINY_LOGIT_STD = 8.0
# Target std of the router logits, so expert choice is rarely a near-tie.
TINY_ROUTER_LOGIT_STD = 2.0
EMBED_STD = 1.0
NORM_WEIGHT_JITTER = 0.1

LINEAR_MODULE_NAMES = frozenset(
    {"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
)
# Files besides the weights that describe the model; the dequantized twin copies them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_KEYS = ("vocab_size", "bos_token_id", "eos_token_id")


def tiny_config(arch: str, overrides: dict | None = None, dtype: str = "float32") -> dict:
    """config.json contents (without the tokenizer-derived ids), with the original DeepSeek field names."""
    if arch not in ("v2", "v3"):
        raise ValueError(f"arch must be 'v2' or 'v3', got {arch!r}")
    is_v3 = arch == "v3"
    config = {
        "architectures": ["DeepseekV3ForCausalLM" if is_v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if is_v3 else "deepseek_v2",
        "attention_bias": False,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "kv_lora_rank": 32,
        "max_position_embeddings": 4096,
        "moe_intermediate_size": 32,
        "moe_layer_freq": 1,
        "n_group": 4 if is_v3 else 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "norm_topk_prob": is_v3,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "q_lora_rank": 24 if is_v3 else None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            # factor = max_position_embeddings / original_max_position_embeddings, as in the real configs.
            "factor": 4,
            "mscale": 1.0 if is_v3 else 0.707,
            "mscale_all_dim": 1.0 if is_v3 else 0.707,
            "original_max_position_embeddings": 1024,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5 if is_v3 else 1.0,
        "scoring_func": "sigmoid" if is_v3 else "softmax",
        "tie_word_embeddings": False,
        "topk_group": 2 if is_v3 else 1,
        "topk_method": "noaux_tc" if is_v3 else "greedy",
        "torch_dtype": dtype,
        "v_head_dim": 16,
    }
    if is_v3:
        config["num_nextn_predict_layers"] = 0  # no MTP weights are written
    overrides = dict(overrides or {})
    fixed_by_tokenizer = [key for key in _TOKENIZER_KEYS if key in overrides]
    if fixed_by_tokenizer:
        raise ValueError(f"{fixed_by_tokenizer} come from the trained tokenizer and cannot be overridden")
    config.update(overrides)
    return config


def _is_moe_layer(config: dict, layer_index: int) -> bool:
    return layer_index >= config["first_k_dense_replace"] and layer_index % config["moe_layer_freq"] == 0


def _layer_shapes(config: dict, layer_index: int) -> dict[str, tuple[int, ...]]:
    """Parameter name suffix -> shape for one decoder layer, in the order the weights are drawn."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    qk_head_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (hidden,)}
    if config["q_lora_rank"] is None:
        shapes["self_attn.q_proj.weight"] = (heads * qk_head_dim, hidden)
    else:
        shapes["self_attn.q_a_proj.weight"] = (config["q_lora_rank"], hidden)
        shapes["self_attn.q_a_layernorm.weight"] = (config["q_lora_rank"],)
        shapes["self_attn.q_b_proj.weight"] = (heads * qk_head_dim, config["q_lora_rank"])
    shapes["self_attn.kv_a_proj_with_mqa.weight"] = (config["kv_lora_rank"] + config["qk_rope_head_dim"], hidden)
    shapes["self_attn.kv_a_layernorm.weight"] = (config["kv_lora_rank"],)
    shapes["self_attn.kv_b_proj.weight"] = (
        heads * (config["qk_nope_head_dim"] + config["v_head_dim"]),
        config["kv_lora_rank"],
    )
    shapes["self_attn.o_proj.weight"] = (hidden, heads * config["v_head_dim"])
    shapes["post_attention_layernorm.weight"] = (hidden,)

    def add_mlp(prefix: str, intermediate: int) -> None:
        shapes[f"{prefix}.gate_proj.weight"] = (intermediate, hidden)
        shapes[f"{prefix}.up_proj.weight"] = (intermediate, hidden)
        shapes[f"{prefix}.down_proj.weight"] = (hidden, intermediate)

    if not _is_moe_layer(config, layer_index):
        add_mlp("mlp", config["intermediate_size"])
        return shapes
    shapes["mlp.gate.weight"] = (config["n_routed_experts"], hidden)
    # The V3 router always owns the bias (zero-cost when another topk_method ignores it), as in transformers.
    if config["model_type"] == "deepseek_v3":
        shapes["mlp.gate.e_score_correction_bias"] = (config["n_routed_experts"],)
    for expert in range(config["n_routed_experts"]):
        add_mlp(f"mlp.experts.{expert}", config["moe_intermediate_size"])
    if config["n_shared_experts"]:
        add_mlp("mlp.shared_experts", config["moe_intermediate_size"] * config["n_shared_experts"])
    return shapes


def _random_tensor(name: str, shape: tuple[int, ...], config: dict, generator: torch.Generator) -> torch.Tensor:
    """float32 draw whose scale depends on the role the name gives the tensor."""
    normal = torch.randn(shape, generator=generator, dtype=torch.float32)
    hidden = config["hidden_size"]
    if name.endswith("norm.weight"):
        return 1.0 + NORM_WEIGHT_JITTER * normal
    if name == "model.embed_tokens.weight":
        return EMBED_STD * normal
    if name == "lm_head.weight":
        return normal * (TINY_LOGIT_STD / math.sqrt(hidden))
    if name.endswith("mlp.gate.weight"):
        return normal * (TINY_ROUTER_LOGIT_STD / math.sqrt(hidden))
    if name.endswith("e_score_correction_bias"):
        return 0.1 * normal
    return normal / math.sqrt(shape[1])  # linear: unit-variance outputs for unit-variance inputs


def tiny_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """All checkpoint tensors in float32, drawn in a fixed order from one generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], config["hidden_size"])}
    for layer_index in range(config["num_hidden_layers"]):
        for suffix, shape in _layer_shapes(config, layer_index).items():
            shapes[f"model.layers.{layer_index}.{suffix}"] = shape
    shapes["model.norm.weight"] = (config["hidden_size"],)
    shapes["lm_head.weight"] = (config["vocab_size"], config["hidden_size"])
    return {name: _random_tensor(name, shape, config, generator) for name, shape in shapes.items()}


def is_fp8_quantized_weight(name: str) -> bool:
    """Linear weights inside decoder layers, which DeepSeek-V3 ships in fp8; never embeddings, norms, router."""
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in LINEAR_MODULE_NAMES


def _stored_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    # transformers keeps the V3 routing bias in float32 whatever the model dtype; store it that way too.
    return torch.float32 if name.endswith("e_score_correction_bias") else dtype


def _to_checkpoint_tensors(weights: dict[str, torch.Tensor], dtype: torch.dtype, fp8: bool) -> dict[str, torch.Tensor]:
    stored: dict[str, torch.Tensor] = {}
    for name, weight in weights.items():
        if fp8 and is_fp8_quantized_weight(name):
            stored[name], stored[f"{name}_scale_inv"] = quantize_block_fp8(weight, DEFAULT_BLOCK_SIZE)
        else:
            stored[name] = weight.to(_stored_dtype(name, dtype)).contiguous()
    return stored


def _torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n")


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "v2",
    seed: int = 0,
    overrides: dict | None = None,
    fp8: bool = False,
    dtype: str = "float32",
    num_shards: int = 1,
    tokenizer: str = "tiny",
    generation_defaults: dict | None = None,
) -> Path:
    """Writes config, tokenizer, generation config and random weights to `out_dir`; same arguments, same bytes.
    `tokenizer`: "tiny" (a 512-token BPE trained here) or "deepseek" (DeepSeek's real tokenizer and a V3-format chat
    template with tools; the vocabulary is then V3's 129,280 rows). `generation_defaults`: sampling defaults for
    generation_config.json (temperature, top_p, max_new_tokens...)."""
    torch_dtype = _torch_dtype(dtype)
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, overrides, dtype)
    if tokenizer == "deepseek":
        tokenizer_ids = write_deepseek_tokenizer(out_path, model_max_length=config["max_position_embeddings"])
    elif tokenizer == "tiny":
        tokenizer_ids = write_tiny_tokenizer(out_path, arch, model_max_length=config["max_position_embeddings"])
    else:
        raise ValueError(f"tokenizer must be 'tiny' or 'deepseek', got {tokenizer!r}")
    config.update(
        vocab_size=tokenizer_ids.vocab_size,
        bos_token_id=tokenizer_ids.bos_token_id,
        eos_token_id=tokenizer_ids.eos_token_id,
    )
    if fp8:
        config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(DEFAULT_BLOCK_SIZE),
        }
    _write_json(out_path / "config.json", config)
    _write_json(
        out_path / "generation_config.json",
        {"bos_token_id": tokenizer_ids.bos_token_id, "eos_token_id": tokenizer_ids.eos_token_id,
         **(generation_defaults or {})},
    )
    tensors = _to_checkpoint_tensors(tiny_weights(config, seed), torch_dtype, fp8)
    write_safetensors_checkpoint(out_path, tensors, num_shards)
    return out_path


def make_config_only_model(out_dir: str | Path, config: dict) -> Path:
    """A model directory without weights, for workers started with `--load-format random` (benchmarks of real
    shapes): `config` as given, plus the tiny tokenizer so the router can serve text (its ids are a small subset
    of any real vocabulary)."""
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    _write_json(out_path / "config.json", config)
    arch = "v3" if config["model_type"] == "deepseek_v3" else "v2"
    write_tiny_tokenizer(out_path, arch, model_max_length=config["max_position_embeddings"])
    return out_path


def dequantized_twin(fp8_dir: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Writes the fp8 checkpoint at `fp8_dir` again with every fp8 weight dequantized and no quantization_config."""
    torch_dtype = _torch_dtype(dtype)
    source, out_path = Path(fp8_dir), Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    block_size = tuple(config.pop("quantization_config")["weight_block_size"])
    config["torch_dtype"] = dtype
    _write_json(out_path / "config.json", config)
    for file_name in TOKENIZER_FILES:
        shutil.copyfile(source / file_name, out_path / file_name)

    stored = read_safetensors_checkpoint(source)
    twin: dict[str, torch.Tensor] = {}
    for name, tensor in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype == FP8_DTYPE:
            twin[name] = dequantize_block_fp8(tensor, stored[f"{name}_scale_inv"], block_size, torch_dtype)
        else:
            twin[name] = tensor.to(_stored_dtype(name, torch_dtype))
    write_safetensors_checkpoint(out_path, twin)
    return out_path
