import json

import pytest
import torch

from pdserve.model.safetensors_shards import (
    INDEX_FILE_NAME,
    checkpoint_files,
    read_safetensors_checkpoint,
    write_safetensors_checkpoint,
)


def _tensors(count):
    return {f"t{i}": torch.full((i + 1, 4), float(i)) for i in range(count)}


@pytest.mark.parametrize("num_shards", [1, 2, 5])
def test_round_trip_keeps_every_tensor(tmp_path, num_shards):
    tensors = _tensors(5)
    paths = write_safetensors_checkpoint(tmp_path, tensors, num_shards)
    assert len(paths) == num_shards == len(checkpoint_files(tmp_path))
    read_back = read_safetensors_checkpoint(tmp_path)
    assert read_back.keys() == tensors.keys()
    assert all(torch.equal(read_back[name], tensors[name]) for name in tensors)
    assert (tmp_path / INDEX_FILE_NAME).exists() == (num_shards > 1)


def test_shards_are_balanced_by_bytes_and_never_empty(tmp_path):
    tensors = {"big": torch.zeros(1000), **{f"small{i}": torch.zeros(10) for i in range(3)}}
    write_safetensors_checkpoint(tmp_path, tensors, num_shards=3)
    weight_map = json.loads((tmp_path / INDEX_FILE_NAME).read_text())["weight_map"]
    shard_of = {name: weight_map[name] for name in tensors}
    assert len(set(shard_of.values())) == 3
    assert shard_of["big"] not in {shard_of["small1"], shard_of["small2"]}


def test_more_shards_than_tensors_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="num_shards"):
        write_safetensors_checkpoint(tmp_path, _tensors(2), num_shards=3)
