"""DrainGate: when a draining worker may exit (nothing in flight, or the grace period is over)."""

from pdserve.worker.drain import DrainGate


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_a_worker_that_is_not_draining_never_counts_as_drained() -> None:
    gate = DrainGate(FakeClock())
    assert not gate.draining and not gate.drained(timeout_s=0.0)


def test_draining_ends_when_the_last_request_finishes() -> None:
    gate = DrainGate(FakeClock())
    gate.in_flight = 2
    gate.start_draining()
    assert gate.draining and not gate.drained(timeout_s=30.0)
    gate.in_flight = 0
    assert gate.drained(timeout_s=30.0)


def test_draining_ends_at_the_timeout_even_with_requests_in_flight() -> None:
    clock = FakeClock()
    gate = DrainGate(clock)
    gate.in_flight = 1
    gate.start_draining()
    clock.now_s += 29.9
    assert not gate.drained(timeout_s=30.0)
    clock.now_s += 0.2
    assert gate.drained(timeout_s=30.0)


def test_a_second_signal_does_not_restart_the_grace_period() -> None:
    clock = FakeClock()
    gate = DrainGate(clock)
    gate.in_flight = 1
    gate.start_draining()
    clock.now_s += 20
    gate.start_draining()
    clock.now_s += 11
    assert gate.drained(timeout_s=30.0)
