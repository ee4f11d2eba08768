"""Writes and reads Hugging Face style safetensors checkpoints, single-file or sharded with an index."""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"


def _split_evenly_by_bytes(names: list[str], tensors: dict[str, torch.Tensor], num_shards: int) -> list[list[str]]:
    """Contiguous, non-empty groups of names (order kept), each closed once it holds its share of the bytes."""
    target_bytes = sum(tensors[name].nbytes for name in names) / num_shards
    groups: list[list[str]] = [[]]
    group_bytes = 0
    for position, name in enumerate(names):
        names_left = len(names) - position
        shards_to_open = num_shards - len(groups)
        if groups[-1] and shards_to_open > 0 and (group_bytes >= target_bytes or names_left <= shards_to_open):
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += tensors[name].nbytes
    return groups


def write_safetensors_checkpoint(out_dir: Path, tensors: dict[str, torch.Tensor], num_shards: int = 1) -> list[Path]:
    """Writes `tensors` (dict order kept within shards) and, when sharded, the index json; returns the files."""
    if not 1 <= num_shards <= len(tensors):
        raise ValueError(f"num_shards must be between 1 and the tensor count {len(tensors)}, got {num_shards}")
    metadata = {"format": "pt"}
    if num_shards == 1:
        path = out_dir / SINGLE_FILE_NAME
        save_file(tensors, str(path), metadata=metadata)
        return [path]
    groups = _split_evenly_by_bytes(list(tensors), tensors, num_shards)
    paths, weight_map = [], {}
    for shard_index, group in enumerate(groups):
        file_name = f"model-{shard_index + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({name: tensors[name] for name in group}, str(out_dir / file_name), metadata=metadata)
        paths.append(out_dir / file_name)
        weight_map.update({name: file_name for name in group})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (out_dir / INDEX_FILE_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return paths


def checkpoint_files(model_dir: Path) -> list[Path]:
    index_path = model_dir / INDEX_FILE_NAME
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / SINGLE_FILE_NAME
    if not single.exists():
        raise FileNotFoundError(f"no {SINGLE_FILE_NAME} or {INDEX_FILE_NAME} in {model_dir}")
    return [single]


def read_safetensors_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, in file then header order; for small models only."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors
