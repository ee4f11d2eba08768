"""Shared fixtures: tiny random checkpoints that pdserve generates itself (no downloads)."""

import pytest

from pdserve.model.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """make(arch, seed=0, **overrides) -> directory; cached per argument set for the whole session."""
    made: dict[tuple, str] = {}

    def make(arch: str = "v2", seed: int = 0, fp8: bool = False, **overrides) -> str:
        key = (arch, seed, fp8, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = str(make_tiny_model(out, arch=arch, seed=seed, overrides=overrides or None, fp8=fp8))
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_v2(tiny_model_factory) -> str:
    return tiny_model_factory("v2")


@pytest.fixture(scope="session")
def tiny_v3(tiny_model_factory) -> str:
    return tiny_model_factory("v3")
