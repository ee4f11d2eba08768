import hashlib
import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.model.safetensors_shards import INDEX_FILE_NAME, read_safetensors_checkpoint
from pdserve.model.tiny import dequantized_twin, is_fp8_quantized_weight, make_tiny_model
from pdserve.model.tiny_corpus import TINY_CORPUS
from pdserve.ops.block_fp8 import FP8_DTYPE, dequantize_block_fp8

FP8_OVERRIDES = {"hidden_size": 160, "intermediate_size": 300, "moe_intermediate_size": 136, "num_hidden_layers": 2}


def _load(model_dir):
    model, loading_info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    return model.eval(), loading_info


def _assert_clean_load(loading_info):
    assert loading_info["missing_keys"] == set()
    assert loading_info["unexpected_keys"] == set()
    assert loading_info["mismatched_keys"] == set()


def _logits(model, token_ids):
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return {arch: make_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, seed=0) for arch in ("v2", "v3")}


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_transformers_loads_every_tensor_and_gives_finite_logits(tiny_dirs, arch):
    model, loading_info = _load(tiny_dirs[arch])
    _assert_clean_load(loading_info)
    assert type(model).__name__ == {"v2": "DeepseekV2ForCausalLM", "v3": "DeepseekV3ForCausalLM"}[arch]
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[arch])
    config = json.loads((tiny_dirs[arch] / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer)
    assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    token_ids = tokenizer("The harbor town woke slowly.").input_ids
    assert token_ids[0] == tokenizer.bos_token_id and token_ids.count(tokenizer.bos_token_id) == 1
    assert torch.isfinite(_logits(model, token_ids)).all()


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_greedy_argmax_margins_are_far_above_rounding_noise(tiny_dirs, arch):
    model, _ = _load(tiny_dirs[arch])
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[arch])
    logits = _logits(model, tokenizer(" ".join(TINY_CORPUS)).input_ids[:512])
    top_two = logits.topk(2, dim=-1).values
    margins = top_two[:, 0] - top_two[:, 1]
    assert margins.median() > 0.5
    assert margins.quantile(0.01) > 5e-3
    assert margins.min() > 1e-4
    # Different contexts must not all predict the same next token.
    assert logits.argmax(dim=-1).unique().numel() > 50


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_same_seed_gives_identical_bytes_and_other_seed_other_weights(tmp_path, arch):
    first = make_tiny_model(tmp_path / "a", arch=arch, seed=7)
    again = make_tiny_model(tmp_path / "b", arch=arch, seed=7)
    other = make_tiny_model(tmp_path / "c", arch=arch, seed=8)
    for file_name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert _sha256(first / file_name) == _sha256(again / file_name)
    assert _sha256(first / "tokenizer.json") == _sha256(other / "tokenizer.json")
    first_weights, other_weights = read_safetensors_checkpoint(first), read_safetensors_checkpoint(other)
    assert first_weights.keys() == other_weights.keys()
    assert not torch.equal(first_weights["model.embed_tokens.weight"], other_weights["model.embed_tokens.weight"])


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Bye"},
]
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
EXPECTED_CHAT = {
    "v2": f"{BOS}Be brief.\n\nUser: Hi\n\nAssistant: Hello{EOS}User: Bye\n\n",
    "v3": f"{BOS}Be brief.<｜User｜>Hi<｜Assistant｜>Hello{EOS}<｜User｜>Bye",
}
GENERATION_PROMPT = {"v2": "Assistant:", "v3": "<｜Assistant｜>"}


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_chat_template_renders_deepseek_turns(tiny_dirs, arch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[arch])
    assert tokenizer.apply_chat_template(CHAT, tokenize=False) == EXPECTED_CHAT[arch]
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt == EXPECTED_CHAT[arch] + GENERATION_PROMPT[arch]
    prompt_ids = tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert prompt_ids["input_ids"].count(tokenizer.bos_token_id) == 1
    if arch == "v3":  # role markers are single special tokens
        assert tokenizer.convert_tokens_to_ids("<｜Assistant｜>") == prompt_ids["input_ids"][-1]


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("v2", {"rope_scaling": None}),
        ("v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
        ("v3", {"num_hidden_layers": 4, "first_k_dense_replace": 2}),
        ("v3", {"q_lora_rank": None}),
    ],
)
def test_overrides_change_config_and_still_load(tmp_path, arch, overrides):
    model_dir = make_tiny_model(tmp_path, arch=arch, overrides=overrides)
    config = json.loads((model_dir / "config.json").read_text())
    assert {key: config[key] for key in overrides} == overrides
    model, loading_info = _load(model_dir)
    _assert_clean_load(loading_info)
    assert torch.isfinite(_logits(model, [0, 10, 20, 30])).all()


def test_vocab_size_cannot_be_overridden(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_model(tmp_path, overrides={"vocab_size": 1000})


def test_sharded_checkpoint_has_complete_index_and_same_logits(tmp_path, tiny_dirs):
    sharded = make_tiny_model(tmp_path, arch="v3", seed=0, num_shards=3)
    index = json.loads((sharded / INDEX_FILE_NAME).read_text())
    shard_names = sorted(set(index["weight_map"].values()))
    assert shard_names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    total_bytes = 0
    for shard_name in shard_names:
        with safe_open(str(sharded / shard_name), framework="pt") as shard:
            for name in shard.keys():
                assert index["weight_map"][name] == shard_name
                total_bytes += shard.get_tensor(name).nbytes
    assert index["metadata"]["total_size"] == total_bytes
    single_file_weights = read_safetensors_checkpoint(tiny_dirs["v3"])
    assert set(index["weight_map"]) == set(single_file_weights)
    model, loading_info = _load(sharded)
    _assert_clean_load(loading_info)
    reference, _ = _load(tiny_dirs["v3"])
    assert torch.equal(_logits(model, [0, 5, 9]), _logits(reference, [0, 5, 9]))


def test_fp8_checkpoint_has_block_scales_and_twin_matches_dequantization(tmp_path):
    fp8_dir = make_tiny_model(tmp_path / "fp8", arch="v3", fp8=True, dtype="bfloat16", overrides=FP8_OVERRIDES)
    reference_dir = make_tiny_model(tmp_path / "ref", arch="v3", overrides=FP8_OVERRIDES)
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    stored = read_safetensors_checkpoint(fp8_dir)
    reference = read_safetensors_checkpoint(reference_dir)
    assert stored["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == FP8_DTYPE
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"):
        assert stored[name].dtype == torch.bfloat16
    assert stored["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32

    twin_dir = dequantized_twin(fp8_dir, tmp_path / "twin", dtype="float32")
    twin = read_safetensors_checkpoint(twin_dir)
    quantized_names = [name for name in reference if is_fp8_quantized_weight(name)]
    assert quantized_names and set(twin) == set(reference)
    saw_partial_block = False
    for name in quantized_names:
        rows, cols = stored[name].shape
        assert stored[name].dtype == FP8_DTYPE
        assert stored[f"{name}_scale_inv"].dtype == torch.float32
        assert stored[f"{name}_scale_inv"].shape == (math.ceil(rows / 128), math.ceil(cols / 128))
        saw_partial_block |= rows % 128 != 0 and rows > 128 or cols % 128 != 0 and cols > 128
        assert torch.equal(twin[name], dequantize_block_fp8(stored[name], stored[f"{name}_scale_inv"]))
        relative_error = (twin[name] - reference[name]).norm() / reference[name].norm()
        assert relative_error < 0.05  # e4m3 keeps 3 mantissa bits
    assert saw_partial_block

    assert "quantization_config" not in json.loads((twin_dir / "config.json").read_text())
    model, loading_info = _load(twin_dir)
    _assert_clean_load(loading_info)
    assert torch.isfinite(_logits(model, [0, 3, 4, 5])).all()
