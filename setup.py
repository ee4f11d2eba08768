"""The package list, which pyproject.toml cannot express: pdserve's packages, and the router's code from the
top-level folder router/ installed under the import name `pdserve_router` (a name no other distribution takes)."""

from setuptools import find_namespace_packages, setup

setup(
    # namespace packages: the data folders (model configs, engine profiles, CUDA sources) count as packages too, which
    # setuptools otherwise warns of at length on every install
    packages=find_namespace_packages(include=["pdserve", "pdserve.*"], exclude=["*.__pycache__"])
    + ["pdserve_router"],
    package_dir={"pdserve_router": "router"},
)
