"""The S3 store on the failure path: a real S3 server behind a proxy that misbehaves.

Conditional writes are probed (a server that ignores If-None-Match is refused
unless opted into), transient failures of every kind are retried until the
bytes are exact, and a store that stays down raises StoreUnavailable in bounded time.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import random
import time
from collections.abc import Callable

import pytest
from ctj_devcluster.local_s3 import free_port

from tests.integration.s3_proxy import DEFAULT_FAULTS, FaultProxy
from trainer_sidecar.errors import CheckpointError, ObjectExists, StoreUnavailable
from trainer_sidecar.store.base import Location
from trainer_sidecar.store.s3 import ALLOW_UNCONDITIONAL_ENV, PROBE_PREFIX, S3Settings, S3Store

pytestmark = pytest.mark.integration

MIB = 1 << 20
Proxy = Callable[..., FaultProxy]


def store_at(endpoint: str, uri: str, **settings: object) -> S3Store:
    """A store whose retries wait milliseconds, not seconds: the faults are not real load."""
    options: dict[str, object] = {"backoff_base_s": 0.005, "backoff_cap_s": 0.05}
    options.update(settings)
    return S3Store(Location.parse(uri), S3Settings(endpoint_url=endpoint, **options))  # type: ignore[arg-type]


# -- conditional writes, probed ---------------------------------------------------------


def test_a_server_that_honours_if_none_match_passes_the_probe(
    s3_uri: str, s3_endpoint: str
) -> None:
    store = store_at(s3_endpoint, s3_uri)
    store.check_conditional_writes()
    store.put("manifests/1", b"first", if_absent=True)
    with pytest.raises(ObjectExists):
        store.put("manifests/1", b"second", if_absent=True)
    assert store.get("manifests/1") == b"first"
    assert list(store.list(PROBE_PREFIX)) == []  # the probe cleans up after itself


def test_a_server_that_ignores_if_none_match_refuses_the_first_create_only_put(
    s3_uri: str, s3_proxy: Proxy
) -> None:
    proxy = s3_proxy(drop_if_none_match=True)
    store = store_at(proxy.endpoint, s3_uri)
    store.put("chunks/aa/1", b"plain puts never probe")
    assert proxy.requests == 1
    with pytest.raises(CheckpointError) as info:
        store.put("manifests/1", b"commit", if_absent=True)
    message = str(info.value)
    assert type(info.value) is CheckpointError
    assert "\n" not in message
    assert proxy.endpoint in message and f"{ALLOW_UNCONDITIONAL_ENV}=1" in message
    with pytest.raises(CheckpointError, match=ALLOW_UNCONDITIONAL_ENV):  # the verdict is cached
        store.put("manifests/2", b"commit", if_absent=True)
    assert [o.key for o in store.list("")] == ["chunks/aa/1"]  # no commit, no probe left


def test_with_the_opt_in_a_create_only_put_still_never_overwrites(
    s3_uri: str, s3_proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = s3_proxy(drop_if_none_match=True)
    store = store_at(proxy.endpoint, s3_uri, allow_unconditional_writes=True)
    with caplog.at_level(logging.WARNING, logger="trainer_sidecar.store.s3"):
        store.put("manifests/1", b"first", if_absent=True)
        with pytest.raises(ObjectExists):
            store.put("manifests/1", b"second", if_absent=True)
        store.put("manifests/2", b"other", if_absent=True)
    assert store.get("manifests/1") == b"first"
    warnings = [r for r in caplog.records if ALLOW_UNCONDITIONAL_ENV in r.getMessage()]
    assert len(warnings) == 1 and "not excluded" in warnings[0].getMessage()


# -- one fault at a time ------------------------------------------------------------


def test_a_conditional_conflict_is_retried_and_a_later_412_still_means_exists(
    s3_uri: str, s3_proxy: Proxy
) -> None:
    proxy = s3_proxy()
    store = store_at(proxy.endpoint, s3_uri)
    store.check_conditional_writes()
    before = proxy.requests
    proxy.inject_next("conflict")
    store.put("manifests/1", b"first", if_absent=True)
    assert proxy.requests - before == 2
    proxy.inject_next("conflict")
    with pytest.raises(ObjectExists):
        store.put("manifests/1", b"second", if_absent=True)
    assert proxy.injected == {"conflict": 2}
    assert store.get("manifests/1") == b"first"


@pytest.mark.parametrize("byte_range", [None, (MIB + 3, 3 * MIB - 1)])
def test_a_body_cut_short_is_read_again(
    s3_uri: str, s3_proxy: Proxy, byte_range: tuple[int, int] | None
) -> None:
    proxy = s3_proxy()
    store = store_at(proxy.endpoint, s3_uri)
    data = os.urandom(4 * MIB)
    store.put("chunks/ab/c", data)
    proxy.inject_next("short_body", "short_body")
    before = proxy.requests
    want = data if byte_range is None else data[byte_range[0] : byte_range[1]]
    assert store.get("chunks/ab/c", byte_range=byte_range) == want
    assert proxy.requests - before == 3 and proxy.injected == {"short_body": 2}


def test_a_create_only_put_whose_reply_was_lost_finds_its_own_object(
    s3_uri: str, s3_proxy: Proxy
) -> None:
    """The ambiguous case: the server wrote, the reply never came, the retry gets 412.
    The store says ObjectExists; the committer must read the object to tell it is its own."""
    proxy = s3_proxy()
    store = store_at(proxy.endpoint, s3_uri)
    store.check_conditional_writes()
    proxy.inject_next("lost_reply")
    with pytest.raises(ObjectExists):
        store.put("manifests/7", b"ours", if_absent=True)
    assert proxy.injected == {"lost_reply": 1}
    assert store.get("manifests/7") == b"ours"


# -- many faults ----------------------------------------------------------------------


def test_every_operation_survives_five_percent_faults_of_every_kind_with_exact_bytes(
    s3_uri: str, s3_proxy: Proxy
) -> None:
    kinds = (*DEFAULT_FAULTS, "conflict")
    proxy = s3_proxy(fault_rate=0.05, faults=kinds, seed=20240901)
    store = store_at(proxy.endpoint, s3_uri)
    rng = random.Random(5)
    pool = concurrent.futures.ThreadPoolExecutor(8)

    def round_trip(n: int) -> None:
        prefix = f"round{n}/"
        objects = {
            f"{prefix}chunks/{i:03d}": rng.randbytes(rng.randrange(MIB // 4, 2 * MIB))
            for i in range(24)
        }
        list(pool.map(
            lambda kv: store.put(kv[0], kv[1], if_absent=int(kv[0][-1]) % 2 == 0),
            objects.items(),
        ))  # fmt: skip
        assert [o.key for o in store.list(prefix)] == sorted(objects)
        assert [o.size for o in store.list(prefix)] == [len(objects[k]) for k in sorted(objects)]

        def read_back(key: str) -> None:
            data = objects[key]
            assert store.get(key) == data
            for start in (0, len(data) // 3, len(data) - 100):
                end = min(len(data), start + 256 * 1024)
                assert store.get(key, byte_range=(start, end)) == data[start:end]

        list(pool.map(read_back, objects))
        store.delete(objects)
        assert list(store.list(prefix)) == []

    with pool:
        for n in range(12):  # until each kind has been injected; at most 12 rounds
            round_trip(n)
            if set(proxy.injected) == set(kinds):
                break
    assert set(proxy.injected) == set(kinds), proxy.injected
    injected = sum(proxy.injected.values())
    assert 0.02 < injected / proxy.requests < 0.08, (injected, proxy.requests)


# -- a store that stays down -----------------------------------------------------------


def test_persistent_5xx_raise_store_unavailable_after_max_attempts(
    s3_uri: str, s3_proxy: Proxy
) -> None:
    proxy = s3_proxy(fault_rate=1.0, faults=("slowdown",))
    store = store_at(proxy.endpoint, s3_uri, max_attempts=3)
    with pytest.raises(StoreUnavailable) as info:
        store.get("chunks/ab/c")
    assert proxy.requests == 3
    message = str(info.value)
    assert message.startswith(f"the S3 endpoint {proxy.endpoint} kept failing after 3 attempts")
    assert "(last: 503 SlowDown)" in message and "\n" not in message


def test_a_closed_port_raises_store_unavailable_in_bounded_time(s3_uri: str) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    secret = "never-in-a-message-0123456789"
    store = S3Store(
        Location.parse(s3_uri),
        S3Settings(
            endpoint_url=endpoint, max_attempts=3, connect_timeout_s=1, read_timeout_s=1,
            backoff_base_s=0.05, backoff_cap_s=0.2,
        ),
        credentials={"AWS_ACCESS_KEY_ID": "AKIDCLOSEDPORT", "AWS_SECRET_ACCESS_KEY": secret},
    )  # fmt: skip
    operations: list[Callable[[], object]] = [
        lambda: store.get("chunks/ab/c"),
        lambda: store.put("chunks/ab/c", b"x"),
        lambda: store.put("manifests/1", b"x", if_absent=True),  # the probe's first PUT fails
        lambda: list(store.list("manifests/")),
        lambda: store.delete(["chunks/ab/c"]),
    ]
    for operation in operations:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            operation()
        assert time.monotonic() - started < 5
        message = str(info.value)
        assert "\n" not in message and secret not in message and "AKIDCLOSEDPORT" not in message
        assert message.startswith(f"the S3 endpoint {endpoint} is unreachable after 3 attempts")
        assert "connection refused" in message
