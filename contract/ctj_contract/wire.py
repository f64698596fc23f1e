"""Reading a message that comes off the network or a shared volume: bounded, one JSON
object, or a ValueError that says which message and why (never anything else)."""

from __future__ import annotations

import json
from typing import Any


def json_object(raw: bytes, what: str, limit: int) -> dict[str, Any]:
    """``raw`` as a JSON object; refused past ``limit`` bytes, as not JSON, or as JSON that
    is not an object."""
    if len(raw) > limit:
        raise ValueError(f"{what}: {len(raw)} bytes, over {limit}")
    try:
        found = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what}: not JSON ({exc})") from None
    if not isinstance(found, dict):
        raise ValueError(f"{what}: not a JSON object")
    return found
