"""The `pdserve` command reports flag values a configuration refuses as a usage error: one line naming the problem,
exit status 2, no traceback, before anything starts."""

import pytest

from pdserve.cli.main import main


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
