import argparse

import pytest

from pdserve_router.config import RouterConfig, add_router_arguments, router_config_from_args


def parse(argv: list[str]) -> RouterConfig:
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    return router_config_from_args(parser.parse_args(argv))


def test_flags_build_the_config_with_keys_from_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\nsk-one\n\nsk-two\n")
    config = parse(["--model", "/models/tiny", "--workers", "http://a:1/, http://b:2", "--routing", "least_load",
                    "--prefix-weight", "2", "--api-keys-file", str(keys)])
    assert config.worker_urls == ("http://a:1", "http://b:2")
    assert config.routing == "least_load" and config.prefix_weight == 2.0
    assert config.api_keys == frozenset({"sk-one", "sk-two"})
    assert config.model_name == "tiny"


def test_keys_off_by_default_and_served_name_overrides_directory_name():
    config = parse(["--model", "/models/tiny", "--served-model-name", "deepseek"])
    assert config.api_keys == frozenset() and config.model_name == "deepseek"


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="routing"):
        RouterConfig(model_dir="x", routing="random")
