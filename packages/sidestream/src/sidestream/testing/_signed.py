"""Messages signed with a per-pool key, so nothing unpickles data a network peer wrote."""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["KEY_ENV", "sign", "verify"]

#: The environment variable that hands the pool's key (hex) to its ranks.
KEY_ENV = "SIDESTREAM_POOL_KEY"

_TAG_BYTES = hashlib.sha256().digest_size


def sign(key: bytes, payload: bytes) -> bytes:
    """``payload`` with its HMAC-SHA256 tag in front."""
    return hmac.new(key, payload, hashlib.sha256).digest() + payload


def verify(key: bytes, message: bytes) -> bytes:
    """The payload of a ``sign``-ed message.

    Raises:
        ValueError: If the tag does not match: someone without the key wrote the message.
    """
    tag, payload = message[:_TAG_BYTES], message[_TAG_BYTES:]
    if not hmac.compare_digest(tag, hmac.new(key, payload, hashlib.sha256).digest()):
        raise ValueError("a message in the pool's store is not signed with the pool's key")
    return payload
