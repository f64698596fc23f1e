"""Per-job tokens, derived from one cluster key: what the operator, a job's pods and the
node agents agree on without any of them reading a Secret from the API.

The chart makes the key once (a Secret in the operator's namespace, mounted as a file into
the operator and the node agents). For each job the operator derives its token and writes
it into the job's own Secret, which only the job's pods read (secretKeyRef); a node agent
recomputes it from the job's namespace, name and uid to check a request, and the
operator to authenticate itself to the job's sidecars (the heartbeat channel). A token
opens one job, and only that job: a new job of the same name has another uid.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

MIN_KEY_BYTES = 32


def job_token(key: bytes, namespace: str, name: str, uid: str) -> str:
    """HMAC-SHA256 of ``<namespace>/<name>/<uid>`` under the cluster key, hex."""
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the cluster key has {len(key)} bytes; at least {MIN_KEY_BYTES} needed")
    message = f"{namespace}/{name}/{uid}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def tokens_match(expected: str, given: str) -> bool:
    """Constant-time comparison (a byte-by-byte early exit would leak the token)."""
    return hmac.compare_digest(expected.encode(), given.encode())


def read_key(path: str | Path) -> bytes:
    """The key file's bytes, surrounding whitespace stripped (a Secret's value as written
    by hand often ends in a newline). Raises ValueError naming the file when unusable."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the cluster key file {path}: {exc.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"the cluster key file {path} holds {len(key)} bytes; at least {MIN_KEY_BYTES} "
            "are needed (e.g. `head -c 48 /dev/urandom | base64`)"
        )
    return key
