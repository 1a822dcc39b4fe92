"""Fetching an image named by an http(s) URL in a chat request, for the domains the
operator allowed (``--allowed-media-domains``; none: fetching is off): no redirects, a
deadline over the whole download, and a cap on its size read as it streams. Errors are
ValueErrors that name the URL's host and the reason, never the data."""

from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Collection

__all__ = ["fetch_image_bytes"]

_CHUNK = 64 * 1024


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201
        raise urllib.error.HTTPError(req.full_url, code, "redirects are not followed", headers, fp)


def fetch_image_bytes(
    url: str, *, allowed_domains: Collection[str], timeout: float, max_bytes: int
) -> bytes:
    """The bytes at ``url`` (http or https, its host one of ``allowed_domains``, exactly),
    read within ``timeout`` seconds in all and at most ``max_bytes`` long."""
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError("image_url: only http(s) URLs with a host are fetched")
    if host not in {d.lower() for d in allowed_domains}:
        raise ValueError(f"image_url: {host} is not one of the allowed media domains")
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(_NoRedirects)
    request = urllib.request.Request(url, headers={"User-Agent": "jaxpaged"})
    try:
        with opener.open(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise ValueError(f"image_url: the image is larger than {max_bytes} bytes")
            data = bytearray()
            while chunk := response.read(_CHUNK):
                data += chunk
                if len(data) > max_bytes:
                    raise ValueError(f"image_url: the image is larger than {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise ValueError(f"image_url: fetching from {host} took over {timeout} s")
    except urllib.error.HTTPError as e:
        raise ValueError(f"image_url: {host} answered HTTP {e.code} ({e.reason})") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ValueError(f"image_url: could not fetch from {host} ({reason})") from None
    return bytes(data)
