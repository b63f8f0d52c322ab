"""Text that goes to a tracker must be encodable: every backend writes UTF-8."""

from __future__ import annotations

__all__ = ["check_encodable", "printable"]


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


def printable(text: str) -> str:
    """``text`` with the characters a terminal would act on instead of show escaped.

    A name may hold a newline, a tab, an escape sequence (ESC) or a right-to-left override:
    printed as they are, a report's line broke in two, the console changed colour, or the rest
    of the line was shown reversed. ``str.isprintable`` tells them (and spaces other than " ")
    apart; they are written as Python escapes, as ``repr`` shows them.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
