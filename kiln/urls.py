"""Paths that are URLs (s3://, gs://, http://...) and how to show them without their secrets."""

from __future__ import annotations

import re

# scheme://user[:password]@ -> scheme://  (the userinfo of any URL in a text)
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]+@")


def is_url(path: str) -> bool:
    """A remote URL for fsspec; file:// and plain paths are local."""
    return "://" in str(path) and not str(path).startswith("file://")


def scrub_credentials(text: str) -> str:
    """`text` with the user:password@ part of every URL in it removed (a message, a log line)."""
    return _USERINFO.sub(r"\1", str(text))


def redact(url: str) -> str:
    """The URL without any user:password@ part, for messages and logs."""
    return scrub_credentials(url)
