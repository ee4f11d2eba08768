import pytest
import torch

from pdserve.ops.attention import TorchAttention
from pdserve.ops.moe import TorchMoE
from pdserve.ops.moe_grouped import GroupedMoE
from pdserve.ops.select import flashinfer_takes, select_backends


def test_auto_picks_torch_references_on_cpu():
    backends = select_backends("auto", "auto", torch.device("cpu"), torch.float32)
    assert isinstance(backends.attention, TorchAttention)
    assert isinstance(backends.moe, TorchMoE)


def test_grouped_moe_can_be_chosen_explicitly_for_bfloat16():
    assert isinstance(select_backends("torch", "grouped", torch.device("cpu"), torch.bfloat16).moe, GroupedMoE)


def test_grouped_moe_refuses_float32():
    with pytest.raises(ValueError, match="bfloat16"):
        select_backends("torch", "grouped", torch.device("cpu"), torch.float32)


def test_flashinfer_refuses_cpu():
    with pytest.raises(ValueError, match="flashinfer needs CUDA"):
        select_backends("flashinfer", "torch", torch.device("cpu"), torch.bfloat16)


def test_unknown_backend_names_are_rejected():
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backends("fast", "torch", torch.device("cpu"))


@pytest.mark.gpu
def test_auto_picks_gpu_kernels_on_cuda_in_bfloat16():
    backends = select_backends("auto", "auto", torch.device("cuda"), torch.bfloat16)
    assert isinstance(backends.moe, GroupedMoE)
    assert type(backends.attention).__name__ == "FlashInferMLA"


def test_flashinfer_takes_deepseeks_mla_widths_and_not_a_tiny_models():
    assert flashinfer_takes((512, 64)) and flashinfer_takes(None)
    assert not flashinfer_takes((32, 8)) and not flashinfer_takes((512, 32))


@pytest.mark.gpu
def test_auto_leaves_widths_flashinfer_cannot_take_to_the_torch_reference():
    """A tiny model on a GPU (`pdserve up` there) runs, eagerly, instead of failing in flashinfer's planner."""
    backends = select_backends("auto", "auto", torch.device("cuda"), torch.bfloat16, mla_widths=(32, 8))
    assert isinstance(backends.attention, TorchAttention)
    with pytest.raises(ValueError, match="widths"):
        select_backends("flashinfer", "auto", torch.device("cuda"), torch.bfloat16, mla_widths=(32, 8))
