"""The model's shape and numerics, read once from a Hugging Face DeepSeek-V2/V3 config.json."""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
TOPK_METHODS = {"deepseek_v2": ("greedy", "group_limited_greedy"), "deepseek_v3": ("noaux_tc",)}


class UnsupportedConfigError(ValueError):
    """A config.json field holds a value pdserve cannot serve; the message names the field."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    dim: int  # qk_rope_head_dim
    kind: str  # "default" | "yarn"
    interleave: bool  # rotate (x0, x1), (x2, x3) pairs (DeepSeek layout) rather than the two halves
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    @property
    def softmax_mscale(self) -> float:
        """YaRN's extra factor on the attention softmax scale (applied squared)."""
        if self.kind != "yarn" or not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim)

    @property
    def attention_factor(self) -> float:
        """YaRN's factor on cos/sin (1.0 for the released DeepSeek configs, where mscale == mscale_all_dim)."""
        if self.kind != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor, 1.0)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope: RopeConfig
    fp8_block_size: tuple[int, int] | None  # set for FP8 block-quantized checkpoints
    checkpoint_dtype: str

    @property
    def kv_dim(self) -> int:
        """Values cached per token per layer: the compressed latent and the shared rope key (576 for the real models)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale**2

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type")
        _require(model_type in SUPPORTED_MODEL_TYPES, "model_type", model_type, f"one of {SUPPORTED_MODEL_TYPES}")
        _require(raw.get("hidden_act", "silu") == "silu", "hidden_act", raw.get("hidden_act"), "silu")
        _require(raw.get("moe_layer_freq", 1) == 1, "moe_layer_freq", raw.get("moe_layer_freq"), "1")
        _require(not raw.get("attention_bias", False), "attention_bias", raw.get("attention_bias"), "false")
        _require(not raw.get("mlp_bias", False), "mlp_bias", raw.get("mlp_bias"), "false")
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads", heads)
        _require(kv_heads == heads, "num_key_value_heads", kv_heads, f"num_attention_heads ({heads}) for MLA")
        scoring = raw.get("scoring_func", "softmax" if model_type == "deepseek_v2" else "sigmoid")
        expected_scoring = "softmax" if model_type == "deepseek_v2" else "sigmoid"
        _require(scoring == expected_scoring, "scoring_func", scoring, expected_scoring)
        topk_method = raw.get("topk_method", TOPK_METHODS[model_type][0])
        _require(topk_method in TOPK_METHODS[model_type], "topk_method", topk_method, TOPK_METHODS[model_type])
        n_routed = raw.get("n_routed_experts") or 0
        n_group = raw.get("n_group") or 1
        if n_routed:
            _require(n_routed % n_group == 0, "n_group", n_group, f"a divisor of n_routed_experts ({n_routed})")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            moe_intermediate_size=raw.get("moe_intermediate_size", 0),
            num_hidden_layers=raw["num_hidden_layers"],
            first_k_dense_replace=raw.get("first_k_dense_replace", 0),
            num_attention_heads=heads,
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            n_routed_experts=n_routed,
            n_shared_experts=raw.get("n_shared_experts") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
            n_group=n_group,
            topk_group=raw.get("topk_group") or 1,
            topk_method=topk_method,
            scoring_func=scoring,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope=_rope_from_dict(raw),
            fp8_block_size=_fp8_block_size(raw.get("quantization_config")),
            checkpoint_dtype=raw.get("torch_dtype") or raw.get("dtype") or "bfloat16",
        )


def _rope_from_dict(raw: dict[str, Any]) -> RopeConfig:
    """Both styles: the original `rope_theta` + `rope_scaling: {type: yarn}` and transformers 5's `rope_parameters`."""
    if raw.get("rope_parameters") is not None:
        params, where = dict(raw["rope_parameters"]), "rope_parameters"
        kind = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        params, where = dict(raw.get("rope_scaling") or {}), "rope_scaling"
        kind = params.get("type", params.get("rope_type", "default")) if params else "default"
        theta = raw.get("rope_theta", 10000.0)
    _require(kind in ("default", "yarn"), f"{where}.type", kind, "yarn or none")
    # V2 checkpoints always use interleaved pairs; V3 says so with rope_interleave (default true).
    interleave = raw["model_type"] == "deepseek_v2" or bool(raw.get("rope_interleave", True))
    base = RopeConfig(theta=float(theta), dim=raw["qk_rope_head_dim"], kind=kind, interleave=interleave)
    if kind == "default":
        return base
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings")
    _require(factor is not None, f"{where}.factor", factor, "a number")
    _require(original is not None, f"{where}.original_max_position_embeddings", original, "an integer")
    return RopeConfig(
        theta=base.theta,
        dim=base.dim,
        kind=kind,
        interleave=interleave,
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        truncate=bool(params.get("truncate", True)),
    )


def _fp8_block_size(quant: dict[str, Any] | None) -> tuple[int, int] | None:
    if not quant:
        return None
    method = quant.get("quant_method")
    _require(method == "fp8", "quantization_config.quant_method", method, "fp8")
    fmt = quant.get("fmt", "e4m3")
    _require(fmt == "e4m3", "quantization_config.fmt", fmt, "e4m3")
    block = quant.get("weight_block_size")
    _require(isinstance(block, list) and len(block) == 2, "quantization_config.weight_block_size", block, "[rows, cols]")
    return (int(block[0]), int(block[1]))


def model_dir_problem(model_dir: str | Path, needs_weights: bool = True) -> str | None:
    """What keeps `model_dir` from being served, in words, or None: it needs a config.json pdserve supports and,
    unless the weights are to be random, safetensors files. Reads no tensor, so a command checks it before it starts
    any process."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        return f"{model_dir} has no config.json (a Hugging Face model directory is expected)"
    try:
        ModelConfig.from_dir(path)
    except (ValueError, KeyError, TypeError) as error:  # JSONDecodeError is a ValueError
        return f"{path / 'config.json'}: {error}"
    if needs_weights and not (path / "model.safetensors.index.json").is_file() and not any(path.glob("*.safetensors")):
        return f"{model_dir} holds no weights (*.safetensors files)"
    return None


def _require(ok: bool, field: str, found: Any, expected: Any) -> None:
    if not ok:
        raise UnsupportedConfigError(f"config.json field '{field}': expected {expected}, found {found!r}")
