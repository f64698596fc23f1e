"""Fixtures of the integration tier: a fault-injecting proxy in front of the S3 server."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.integration.s3_proxy import FaultProxy


@pytest.fixture
def s3_proxy(s3_endpoint: str) -> Iterator[Callable[..., FaultProxy]]:
    """Starts FaultProxy(s3_endpoint, **options) for this test; stopped at its end."""
    started: list[FaultProxy] = []

    def start(**options: object) -> FaultProxy:
        proxy = FaultProxy(s3_endpoint, **options).start()  # type: ignore[arg-type]
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()
