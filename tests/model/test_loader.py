"""Checkpoint loading: FP8 block-quantized weights, sharded files, and clear errors for a broken checkpoint."""

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.model.config import ModelConfig
from pdserve.model.loader import CheckpointError, build_model, load_model
from pdserve.model.tiny import dequantized_twin, is_fp8_quantized_weight, make_tiny_model
from pdserve.ops.block_fp8 import FP8_DTYPE, dequantize_block_fp8
from pdserve.ops.select import select_backends

FP8_SHAPES = {"hidden_size": 160, "intermediate_size": 300, "moe_intermediate_size": 136}


def prefill_logits(model_dir: str, prompt: list[int], dtype: str, **options) -> torch.Tensor:
    return prefill(Engine(EngineConfig(model=model_dir, dtype=dtype, progress=False, **options)), prompt)


def prefill(engine: Engine, prompt: list[int]) -> torch.Tensor:
    request = engine.add_request("r", prompt, __import__("pdserve").SamplingParams(max_tokens=1))
    scheduled = engine.scheduler.schedule()
    assert scheduled[0].request is request
    return engine.runner.execute(scheduled)[0]


def test_fp8_checkpoint_matches_its_dequantized_twin(tmp_path, caplog):
    fp8_dir = make_tiny_model(tmp_path / "fp8", arch="v3", overrides=FP8_SHAPES, fp8=True)
    twin = dequantized_twin(fp8_dir, tmp_path / "twin", dtype="bfloat16")
    prompt = list(range(2, 40))
    with caplog.at_level(logging.INFO, logger="pdserve.model.loader"):
        a = prefill_logits(str(fp8_dir), prompt, "bfloat16", fp8_weights="dequantize")
    notes = [r.getMessage() for r in caplog.records if "FP8" in r.getMessage()]
    assert len(notes) == 1 and "dequantized to bfloat16" in notes[0]  # what the dequantization costs is said once
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pdserve.model.loader"):
        b = prefill_logits(str(twin), prompt, "bfloat16")
    assert not [r for r in caplog.records if "FP8" in r.getMessage()]
    assert torch.equal(a, b)


def fp8_parameter_names(model: torch.nn.Module) -> set[str]:
    return {name for name, param in model.named_parameters() if param.dtype == FP8_DTYPE}


@pytest.mark.parametrize("moe_intermediate_size", [128, 136])  # routed experts in whole blocks (kept FP8) or not
def test_fp8_kept_gives_the_logits_of_fp8_dequantized_at_load(tmp_path, moe_intermediate_size):
    shapes = FP8_SHAPES | {"moe_intermediate_size": moe_intermediate_size}
    fp8_dir = str(make_tiny_model(tmp_path / "fp8", arch="v3", overrides=shapes, fp8=True))
    prompt = list(range(2, 40))
    kept = Engine(EngineConfig(model=fp8_dir, device="cpu", dtype="float32", progress=False, fp8_weights="keep"))
    assert "model.layers.0.self_attn.o_proj.weight" in fp8_parameter_names(kept.runner.model)
    assert ("model.layers.1.mlp.experts.w13" in fp8_parameter_names(kept.runner.model)) == (moe_intermediate_size == 128)
    auto_on_cpu = Engine(EngineConfig(model=fp8_dir, device="cpu", dtype="float32", progress=False))
    assert not fp8_parameter_names(auto_on_cpu.runner.model)
    # float32 on the CPU: the reference product dequantizes each FP8 weight to the very values loading would store.
    torch.testing.assert_close(prefill(kept, prompt), prefill(auto_on_cpu, prompt), rtol=1e-5, atol=1e-5)


def test_kept_fp8_weights_keep_their_dtypes_at_half_the_bf16_bytes(tmp_path):
    fp8_dir = make_tiny_model(tmp_path / "fp8", arch="v3", overrides=FP8_SHAPES | {"moe_intermediate_size": 128},
                              fp8=True)
    cfg = ModelConfig.from_dir(fp8_dir)
    cpu = torch.device("cpu")
    backends = select_backends("torch", "torch", cpu, torch.bfloat16)
    kept = load_model(fp8_dir, cfg, backends, cpu, torch.bfloat16, progress=False, keep_fp8=True)
    dense = load_model(fp8_dir, cfg, backends, cpu, torch.bfloat16, progress=False, keep_fp8=False)
    kept_params = dict(kept.named_parameters())
    # The checkpoint's layout: a loaded dense model stacks its shared experts with the routed ones.
    layout = build_model(cfg, backends, cpu, torch.bfloat16)
    shipped_in_fp8 = {name for name, _ in layout.named_parameters()
                      if is_fp8_quantized_weight(name) or name.endswith(("w13", "w2"))}
    dequantized = (".kv_b_proj.", ".kv_a_proj_with_mqa.")  # absorbed by MLA; a shape FP8 runs slower than bf16
    assert fp8_parameter_names(kept) == {name for name in shipped_in_fp8 if not any(d in name for d in dequantized)}
    assert kept_params["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
    assert kept_params["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.bfloat16
    assert not fp8_parameter_names(dense)

    def size(param: torch.Tensor) -> int:
        return param.numel() * param.element_size()

    kept_bytes = 0
    for name in fp8_parameter_names(kept):
        assert kept_params[name + "_scale_inv"].dtype == torch.float32
        kept_bytes += size(kept_params[name]) + size(kept_params[name + "_scale_inv"])
    dense_bytes = sum(kept_params[name].numel() * torch.bfloat16.itemsize for name in fp8_parameter_names(kept))
    assert 0.5 < kept_bytes / dense_bytes < 0.51  # one byte per value, plus one float32 per 128 x 128 block
    assert 0.5 < kept.routed_expert_bytes() / dense.routed_expert_bytes() < 0.51


def test_weight_stored_dense_where_fp8_is_kept_is_named(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", arch="v3", overrides=FP8_SHAPES, fp8=True)
    name = "model.layers.0.self_attn.o_proj.weight"

    def store_dense(tensors):
        tensors[name] = dequantize_block_fp8(tensors[name], tensors.pop(name + "_scale_inv"), dtype=torch.bfloat16)

    _rewrite(model_dir, store_dense)
    with pytest.raises(CheckpointError, match=rf"{name}.*dequantize"):
        Engine(EngineConfig(model=str(model_dir), progress=False, fp8_weights="keep"))


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
