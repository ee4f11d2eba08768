"""The package list, which pyproject.toml cannot express: pdserve's packages, and the router's code from the
top-level folder router/ installed under the import name `pdserve_router` (a name no other distribution takes)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["pdserve", "pdserve.*"]) + ["pdserve_router"],
    package_dir={"pdserve_router": "router"},
)
