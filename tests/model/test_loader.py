"""Checkpoint loading: FP8 block-quantized weights, sharded files, and clear errors for a broken checkpoint."""

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.engine import Engine
from pdserve.engine.config import EngineConfig
from pdserve.model.loader import CheckpointError
from pdserve.model.tiny import dequantized_twin, make_tiny_model

FP8_SHAPES = {"hidden_size": 160, "intermediate_size": 300, "moe_intermediate_size": 136}


def prefill_logits(model_dir: str, prompt: list[int], dtype: str) -> torch.Tensor:
    engine = Engine(EngineConfig(model=model_dir, dtype=dtype, progress=False))
    request = engine.add_request("r", prompt, __import__("pdserve").SamplingParams(max_tokens=1))
    scheduled = engine.scheduler.schedule()
    assert scheduled[0].request is request
    return engine.runner.execute(scheduled)[0]


def test_fp8_checkpoint_matches_its_dequantized_twin(tmp_path, caplog):
    fp8_dir = make_tiny_model(tmp_path / "fp8", arch="v3", overrides=FP8_SHAPES, fp8=True)
    twin = dequantized_twin(fp8_dir, tmp_path / "twin", dtype="bfloat16")
    prompt = list(range(2, 40))
    with caplog.at_level(logging.INFO, logger="pdserve.model.loader"):
        a = prefill_logits(str(fp8_dir), prompt, "bfloat16")
    notes = [r.getMessage() for r in caplog.records if "FP8" in r.getMessage()]
    assert len(notes) == 1 and "dequantized to bfloat16" in notes[0]  # what the dequantization costs is said once
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pdserve.model.loader"):
        b = prefill_logits(str(twin), prompt, "bfloat16")
    assert not [r for r in caplog.records if "FP8" in r.getMessage()]
    assert torch.equal(a, b)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    single = make_tiny_model(tmp_path / "one", arch="v2", seed=3)
    sharded = make_tiny_model(tmp_path / "many", arch="v2", seed=3, num_shards=3)
    assert (Path(sharded) / "model.safetensors.index.json").is_file()
    prompt = list(range(2, 30))
    assert torch.equal(prefill_logits(str(single), prompt, "float32"), prefill_logits(str(sharded), prompt, "float32"))


def _rewrite(model_dir: Path, edit) -> None:
    path = next(model_dir.glob("*.safetensors"))
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_tensor_is_named(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", arch="v2")
    _rewrite(model_dir, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        Engine(EngineConfig(model=str(model_dir), progress=False))


def test_extra_tensor_is_named(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", arch="v2")
    _rewrite(model_dir, lambda t: t.__setitem__("model.layers.0.self_attn.bogus.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="bogus"):
        Engine(EngineConfig(model=str(model_dir), progress=False))


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", arch="v2")
    _rewrite(model_dir, lambda t: t.__setitem__("model.norm.weight", torch.ones(7)))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\(64,\).*\(7,\)"):
        Engine(EngineConfig(model=str(model_dir), progress=False))


def test_unsupported_config_value_names_the_field(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", arch="v2")
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_scaling.type"):
        Engine(EngineConfig(model=str(model_dir), progress=False))
