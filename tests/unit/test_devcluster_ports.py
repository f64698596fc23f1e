"""The harness never hands out a port a job's rendezvous may bind.

Pods on simulated nodes share the host's network namespace and torch's TCPStore binds its
port on every address, so a port ``free_port`` gave a test's server or rank would fail the
rank 0 of a job running in the cluster tier beside it (or be failed by it)."""

from __future__ import annotations

import pytest
from ctj_devcluster import ports
from ctj_operator.builders import master_port


def test_every_attempts_rendezvous_port_is_reserved() -> None:
    assert all(master_port(attempt) in ports.RENDEZVOUS_PORTS for attempt in range(3000))


def test_free_port_skips_the_reserved_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    wanted = [29400, 29501, 30499, 12345]  # three reserved draws, then a free one
    draws = iter(port - ports._LOW_PORT for port in wanted)
    monkeypatch.setattr(ports.secrets, "randbelow", lambda _n: next(draws))
    monkeypatch.setattr(ports, "_bindable", lambda _port: True)
    assert ports.free_port() == 12345
