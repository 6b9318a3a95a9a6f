"""Paths that are URLs (s3://, gs://, http://...) and how to show them without their secrets."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def is_url(path: str) -> bool:
    """A remote URL for fsspec; file:// and plain paths are local."""
    return "://" in str(path) and not str(path).startswith("file://")


def redact(url: str) -> str:
    """The URL without any user:password@ part, for messages and logs."""
    parts = urlsplit(str(url))
    if parts.username or parts.password:
        return urlunsplit(parts._replace(netloc=parts.hostname or ""))
    return str(url)
