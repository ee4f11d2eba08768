"""The `pdserve` command reports flag values a configuration refuses as a usage error: one line naming the problem,
exit status 2, no traceback, before anything starts."""

import json
import shutil
import socket

import pytest

from pdserve.cli.generate import require_servable
from pdserve.cli.main import main
from pdserve.engine.config import EngineConfig
from pdserve.http.ports import free_port


@pytest.mark.parametrize(("argv", "message"), [
    (["worker", "--model", "/nonexistent", "--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["worker", "--model", "/nonexistent", "--gil-switch-interval-ms", "0"], "gil_switch_interval_ms must be > 0"),
    (["router", "--model", "/nonexistent", "--max-attempts", "0"], "max_attempts must be >= 1"),
])
def test_a_refused_flag_value_is_a_one_line_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve {argv[0]}: error: ") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["up", "worker", "generate"])
@pytest.mark.parametrize(("prepare", "message"), [
    ("config only", "holds no weights (*.safetensors files)"),
    ("no directory", "has no config.json"),
    ("llama config", "config.json field 'model_type': expected one of"),
])
def test_a_model_directory_that_cannot_be_served_is_refused_before_anything_starts(
        command, prepare, message, tiny_v2, tmp_path, capsys):
    """A user pointing --model at a config without weights (the repository's real DeepSeek configs), at nothing, or at
    a model pdserve does not serve gets one line naming it at once, not a worker's traceback a few seconds later."""
    model = tmp_path / "model"
    if prepare != "no directory":
        model.mkdir()
        shutil.copy(f"{tiny_v2}/config.json", model / "config.json")
    if prepare == "llama config":
        (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit) as exited:
        main([command, "--model", str(model)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve {command}: error: --model: ") and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_random_weights_and_the_simulated_engine_need_only_a_config(tiny_v2, tmp_path):
    shutil.copy(f"{tiny_v2}/config.json", tmp_path / "config.json")
    assert EngineConfig(model=str(tmp_path)).reads_weights
    assert not EngineConfig(model=str(tmp_path), load_format="random").reads_weights
    assert not EngineConfig(model=str(tmp_path), execution="simulated").reads_weights
    require_servable(str(tmp_path), needs_weights=False)
    with pytest.raises(ValueError, match="holds no weights"):
        require_servable(str(tmp_path))
    require_servable(tiny_v2)


def test_up_on_a_port_in_use_is_refused_before_anything_starts(capsys):
    """Another server on the router's port (8000 by default) is named at once, not after the cluster has started."""
    port = free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        with pytest.raises(SystemExit) as exited:
            main(["up", "--port", str(port)])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"pdserve up: error: --port: {port} is in use on this machine\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["--prefill", "0", "--decode", "0"], "a cluster needs at least one worker"),
    (["--prefill", "1", "--decode", "0"], "so a cluster has both or neither: 1 prefill, 0 decode, 0 colocated"),
    (["--prefill", "0", "--decode", "2", "--colocated", "1"], "so a cluster has both or neither"),
    (["--prefill", "-1"], "worker counts must be >= 0"),
    (["--ranks-per-worker", "0"], "ranks_per_worker must be >= 1"),
])
def test_up_refuses_a_cluster_that_could_not_serve(argv, message, tiny_v2, capsys):
    """No worker at all, or prefill workers with no decode worker to hand their KV to (or the reverse): refused at
    once. Before, the cluster started and every request failed (or Ray refused an empty placement group)."""
    with pytest.raises(SystemExit) as exited:
        main(["up", "--model", tiny_v2, "--port", "0", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve up: error: ") and message in err and len(err.strip().splitlines()) == 1, err
