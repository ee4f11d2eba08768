import argparse
import json

from pdserve.cli.make_tiny_model import add_make_tiny_model_parser


def test_make_tiny_model_command_writes_requested_arch(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="pdserve")
    add_make_tiny_model_parser(parser.add_subparsers())
    args = parser.parse_args(["make-tiny-model", str(tmp_path / "m"), "--arch", "v3", "--seed", "3"])
    assert args.func(args) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "deepseek_v3"
    assert (tmp_path / "m" / "model.safetensors").exists()
    assert str(tmp_path / "m") in capsys.readouterr().out
