"""Flags derived from configuration dataclasses: each type's flag, defaults that round-trip, help on every flag."""

import argparse
import dataclasses
from dataclasses import MISSING, dataclass
from typing import Literal

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.settings.flags import add_flags, from_flags, setting
from pdserve.worker.config import WorkerConfig, add_worker_arguments, worker_config_from_args
from pdserve_router.config import RouterConfig, add_router_arguments, router_config_from_args


@dataclass(frozen=True)
class Sample:
    name: str = setting(MISSING, "required")
    count: int = setting(3, "an int")
    limit: float | None = setting(None, "an optional float")
    mode: Literal["fast", "slow"] = setting("fast", "a choice")
    enabled: bool = setting(True, "a switch", flag="--feature")
    tri: bool | None = setting(None, "auto/on/off")
    items: tuple[str, ...] = setting(("a",), "a list")
    upper: str = setting("X", "parsed", parse=str.upper)
    hook: float = setting(0.0, "hidden", hidden=True)
    not_a_flag: int = 7


def parse_sample(argv: list[str]) -> Sample:
    parser = argparse.ArgumentParser()
    add_flags(parser, Sample)
    return from_flags(Sample, parser.parse_args(argv))


def test_defaults_hold_when_no_flag_is_given():
    assert parse_sample(["--name", "n"]) == Sample(name="n")


def test_each_type_parses_its_flag():
    sample = parse_sample(["--name", "n", "--count", "5", "--limit", "2.5", "--mode", "slow", "--no-feature",
                           "--tri", "off", "--items", " x, y ,", "--upper", "abc", "--hook", "1"])
    assert sample == Sample(name="n", count=5, limit=2.5, mode="slow", enabled=False, tri=False, items=("x", "y"),
                            upper="ABC", hook=1.0)
    assert parse_sample(["--name", "n", "--tri", "on"]).tri is True


@pytest.mark.parametrize("argv", [[], ["--name", "n", "--mode", "medium"], ["--name", "n", "--count", "many"],
                                  ["--name", "n", "--not-a-flag", "1"]])
def test_missing_or_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse_sample(argv)
    assert "error" in capsys.readouterr().err


def test_hidden_setting_stays_out_of_help():
    parser = argparse.ArgumentParser()
    add_flags(parser, Sample)
    text = parser.format_help()
    assert "--count" in text and "(default: 3)" in text and "--hook" not in text


def test_a_type_with_no_flag_form_is_refused():
    @dataclass(frozen=True)
    class Odd:
        pairs: dict = setting(None, "no flag form")

    with pytest.raises(TypeError, match="pairs"):
        add_flags(argparse.ArgumentParser(), Odd)


def test_router_config_from_no_flags_is_the_dataclass_default(monkeypatch):
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "t0ken")
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    assert router_config_from_args(parser.parse_args(["--model", "/m"])) == RouterConfig(model_dir="/m",
                                                                                          internal_token="t0ken")


def test_worker_config_from_no_flags_is_the_dataclass_default(monkeypatch):
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "t0ken")
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    config = worker_config_from_args(parser.parse_args([]), "/m")
    assert config == WorkerConfig(engine=EngineConfig(model="/m", progress=False), internal_token="t0ken")


def test_worker_flags_that_were_spelled_by_hand_keep_their_names(monkeypatch):
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "t0ken")
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    argv = ["--ranks", "2", "--expert-parallel", "--no-prefix-cache", "--no-warmup", "--nixl-progress-thread", "on",
            "--peers", "http://a:1,http://b:2", "--num-pages", "64", "--role", "decode"]
    config = worker_config_from_args(parser.parse_args(argv), "/m")
    assert (config.num_ranks, config.expert_parallel, config.warmup, config.nixl_progress_thread) == (2, True, False, True)
    assert config.peers == ("http://a:1", "http://b:2") and config.role == "decode"
    assert config.engine.enable_prefix_cache is False and config.engine.num_pages == 64


@pytest.mark.parametrize("cls", [RouterConfig, WorkerConfig, EngineConfig])
def test_every_flag_has_help(cls):
    for f in dataclasses.fields(cls):
        if "help" in f.metadata:
            assert f.metadata["help"].strip(), f"{cls.__name__}.{f.name} has no help text"


@pytest.mark.parametrize("value", ["auto", "keep", "dequantize"])
def test_fp8_weights_flag_takes_its_three_values(monkeypatch, value):
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "t0ken")
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    assert worker_config_from_args(parser.parse_args(["--fp8-weights", value]), "/m").engine.fp8_weights == value


def test_fp8_weights_flag_refuses_another_value(capsys):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--fp8-weights", "fp4"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="fp8_weights"):
        EngineConfig(model="/m", fp8_weights="fp4")
