"""Messages of any size through a ``TCPStore``, whose server refuses a value over 8 MiB."""

from __future__ import annotations

from typing import Any

__all__ = ["CHUNK_BYTES", "STOP", "delete_message", "get_message", "has_message", "put_message"]

#: The task that tells a TorchrunPool's rank to leave its loop.
STOP = b"stop"

#: Bytes per stored value: well under the 8 MiB a libuv ``TCPStore`` server takes in one value
#: (a larger one closed the connection and left the store unusable).
CHUNK_BYTES = 4 * 1024 * 1024
_MAX_CHUNKS = 1 << 20  # 4 TiB: a count past this was not written by a pool


def _chunk_key(key: str, index: int) -> str:
    return f"{key}/chunk/{index}"


def put_message(store: Any, key: str, message: bytes) -> None:
    """Store ``message`` under ``key`` as chunks, then their count under ``key`` itself.

    The count goes last, so a reader that finds ``key`` finds every chunk too.
    """
    count = max(1, -(-len(message) // CHUNK_BYTES))
    for index in range(count):
        chunk = message[index * CHUNK_BYTES : (index + 1) * CHUNK_BYTES]
        store.set(_chunk_key(key, index), chunk)
    store.set(key, str(count))


def has_message(store: Any, key: str) -> bool:
    """Whether ``put_message`` finished writing ``key``."""
    return bool(store.check([key]))


def _count(store: Any, key: str) -> int:
    """The number of chunks ``key`` says it has (waits for ``key`` as ``store.get`` does).

    Raises:
        ValueError: If the count is not one ``put_message`` writes, or a chunk is missing.
    """
    text = bytes(store.get(key)).decode(errors="replace")
    if not text.isdigit() or not 1 <= int(text) <= _MAX_CHUNKS:
        raise ValueError(f"{key!r} holds {text[:40]!r}, not a chunk count")
    count = int(text)
    # Checked, not waited for: a count written by someone else must not block the reader.
    if not store.check([_chunk_key(key, index) for index in range(count)]):
        raise ValueError(f"{key!r} names {count} chunks and some are missing")
    return count


def get_message(store: Any, key: str) -> bytes:
    """The message ``put_message`` stored under ``key`` (waits for it as ``store.get`` does).

    Raises:
        ValueError: If ``key`` was not written by ``put_message``.
    """
    count = _count(store, key)
    return b"".join(bytes(store.get(_chunk_key(key, index))) for index in range(count))


def delete_message(store: Any, key: str) -> None:
    """Remove ``key`` and its chunks, so the store does not keep every message ever sent."""
    if not store.check([key]):
        return
    try:
        count = _count(store, key)
    except ValueError:
        count = 0
    store.delete_key(key)
    for index in range(count):
        store.delete_key(_chunk_key(key, index))
