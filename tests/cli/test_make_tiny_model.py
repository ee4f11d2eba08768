import argparse
import json
import os
import subprocess
import sys

from pdserve.cli.generate import default_model_dir
from pdserve.cli.make_tiny_model import add_make_tiny_model_parser


def test_make_tiny_model_command_writes_requested_arch(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="pdserve")
    add_make_tiny_model_parser(parser.add_subparsers())
    args = parser.parse_args(["make-tiny-model", str(tmp_path / "m"), "--arch", "v3", "--seed", "3"])
    assert args.func(args) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "deepseek_v3"
    assert (tmp_path / "m" / "model.safetensors").exists()
    assert str(tmp_path / "m") in capsys.readouterr().out


def test_the_default_model_replaces_a_half_written_one_and_is_then_reused_without_torch(tmp_path, monkeypatch):
    """A first start stopped while the weights were written left a config and no weights: the next start makes the
    model again (beside the cache, renamed into place) instead of serving a model without weights. A finished one is
    reused without importing torch, which `pdserve up` does not otherwise need."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    half = tmp_path / "tiny-v2"
    half.mkdir()
    (half / "config.json").write_text("{}")
    model = default_model_dir()
    assert model == half and (model / "model.safetensors").is_file()
    assert json.loads((model / "config.json").read_text())["model_type"] == "deepseek_v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-v2"]  # no partial directory left
    made = (model / "model.safetensors").stat().st_mtime_ns
    reuse = subprocess.run([sys.executable, "-c", "import sys; from pdserve.cli.generate import default_model_dir; "
                            "print(default_model_dir(), 'torch' in sys.modules)"],
                           env={**os.environ, "PDSERVE_CACHE": str(tmp_path)}, capture_output=True, text=True,
                           timeout=60)
    assert reuse.stdout.split() == [str(model), "False"], reuse.stderr
    assert (model / "model.safetensors").stat().st_mtime_ns == made
