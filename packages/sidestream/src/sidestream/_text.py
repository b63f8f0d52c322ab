"""Text that goes to a tracker must be encodable: every backend writes UTF-8."""

from __future__ import annotations

__all__ = ["check_encodable"]


def check_encodable(what: str, text: str) -> None:
    """Raise ``ValueError`` naming ``what`` unless ``text`` can be encoded as UTF-8.

    A str can hold lone surrogates (U+D800 to U+DFFF: file names read with
    ``surrogateescape``, bytes decoded by hand), which no UTF-8 writer takes: a tracker would
    fail on it at every retry, long after the call that gave it.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{what}: expected text that UTF-8 can encode, got {text!r} (a lone surrogate at "
            f"index {error.start}; for a name made from raw bytes, decode them with "
            "errors='replace' or 'backslashreplace')"
        ) from None
