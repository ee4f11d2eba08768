"""The released DeepSeek configs parse, in the original and the transformers-5 (rope_parameters) style."""

import json
from pathlib import Path

import pytest

from pdserve.model.config import ModelConfig, UnsupportedConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "pdserve" / "model" / "configs"


def released(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def test_v2_lite_and_v3_configs_give_576_cached_values_and_yarn_scale():
    v2, v3 = ModelConfig.from_dict(released("deepseek-v2-lite")), ModelConfig.from_dict(released("deepseek-v3"))
    assert v2.kv_dim == v3.kv_dim == 576
    assert v2.q_lora_rank is None and v3.q_lora_rank == 1536
    assert v3.fp8_block_size == (128, 128) and v2.fp8_block_size is None
    assert v2.rope.kind == v3.rope.kind == "yarn"
    assert v3.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 1.0 * __import__("math").log(40) + 1) ** 2)


def test_rope_parameters_style_equals_rope_scaling_style():
    raw = released("deepseek-v3")
    new_style = {k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_theta")}
    new_style["rope_parameters"] = {"rope_type": "yarn", "rope_theta": raw["rope_theta"], **{
        k: v for k, v in raw["rope_scaling"].items() if k != "type"}}
    new_style["rope_interleave"] = True
    assert ModelConfig.from_dict(new_style).rope == ModelConfig.from_dict(raw).rope


@pytest.mark.parametrize("field, value", [("scoring_func", "softmax"), ("topk_method", "greedy"),
                                          ("hidden_act", "gelu"), ("moe_layer_freq", 2)])
def test_unsupported_values_name_their_field(field, value):
    raw = released("deepseek-v3") | {field: value}
    with pytest.raises(UnsupportedConfigError, match=field):
        ModelConfig.from_dict(raw)
