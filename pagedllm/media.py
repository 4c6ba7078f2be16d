"""Where images come from in API requests: ``data:`` URLs, and as the server's flags allow
``file://`` paths and http(s) hosts (vLLM's ``--allowed-local-media-path`` and
``--allowed-media-domains``), each read with a size cap and decoded by Pillow under a pixel cap
(a decompression bomb is refused, not decoded).

Every refusal is a ``ValueError`` naming the request field, which the servers answer as a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MAX_IMAGE_PIXELS = 64 * 2**20  # an image of more pixels is refused (a decompression bomb)
MAX_IMAGE_BYTES = 32 * 2**20  # a data URL's decoded bytes at most


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from besides ``data:`` URLs (vLLM's flags).

    Attributes:
        local_path: ``--allowed-local-media-path``: ``file://`` URLs under this directory are read.
        domains: ``--allowed-media-domains``: http(s) URLs of these hosts are fetched (none without
            the flag: unlike vLLM, which fetches any host unless the flag restricts it).
        timeout_s: seconds a fetch may take.
    """

    local_path: Path | None = None
    domains: tuple[str, ...] = ()
    timeout_s: float = 10.0


def _url_bytes(url: str, where: str, policy: MediaPolicy | None) -> bytes:
    """The bytes a ``data:``, ``file://`` or http(s) URL names (``image_from_url``'s first half)."""
    import base64
    import binascii
    from urllib.parse import unquote, urlparse
    if not isinstance(url, str):
        raise ValueError(f"{where}: expected a URL string")
    if url.startswith("data:"):
        head, _, payload = url.partition(",")
        if not head.endswith(";base64"):
            raise ValueError(f"{where}: a data URL of an image must be base64 (data:image/png;base64,...)")
        if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise ValueError(f"{where}: the image is larger than {MAX_IMAGE_BYTES // 2**20} MiB")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: the data URL is not valid base64") from None
    policy = policy or MediaPolicy()
    u = urlparse(url)
    if u.scheme == "file":
        if policy.local_path is None:
            raise ValueError(f"{where}: file URLs are read only under --allowed-local-media-path (not set)")
        path = Path(unquote(u.path)).resolve()
        if not path.is_relative_to(Path(policy.local_path).resolve()) or not path.is_file():
            raise ValueError(f"{where}: not a file under --allowed-local-media-path")
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise ValueError(f"{where}: the image is larger than {MAX_IMAGE_BYTES // 2**20} MiB")
        return path.read_bytes()
    if u.scheme in ("http", "https"):
        if u.hostname not in policy.domains:
            raise ValueError(f"{where}: host {u.hostname!r} is not in --allowed-media-domains")
        return _fetch(url, where, policy.timeout_s)
    raise ValueError(f"{where}: {u.scheme or 'no'} URLs are not read (data:, file:// and http(s) are)")


def _fetch(url: str, where: str, timeout_s: float) -> bytes:
    """GET ``url`` (no redirects: they could leave the allowed hosts), at most ``MAX_IMAGE_BYTES``."""
    import httpx
    out = bytearray()
    try:
        with httpx.stream("GET", url, timeout=timeout_s, follow_redirects=False) as r:
            if r.status_code != 200:
                raise ValueError(f"{where}: fetching the image answered HTTP {r.status_code}")
            for chunk in r.iter_bytes():
                out += chunk
                if len(out) > MAX_IMAGE_BYTES:
                    raise ValueError(f"{where}: the image is larger than {MAX_IMAGE_BYTES // 2**20} MiB")
    except httpx.HTTPError as exc:
        raise ValueError(f"{where}: fetching the image failed ({type(exc).__name__})") from None
    return bytes(out)


def image_from_url(url: str, where: str, policy: MediaPolicy | None = None):
    """The image a URL names, decoded and loaded (RGB): a ``data:image/...;base64,...`` URL, or as
    ``policy`` allows a ``file://`` path or an http(s) URL.

    Raises:
        ValueError: a URL the policy does not allow, undecodable base64, bytes that are no image
            Pillow reads, more than ``MAX_IMAGE_BYTES`` or ``MAX_IMAGE_PIXELS``, a failed fetch
            (``where`` named in each message).
    """
    import io
    import warnings

    from PIL import Image
    raw = _url_bytes(url, where, policy)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
            if image.size[0] * image.size[1] > MAX_IMAGE_PIXELS:
                raise ValueError(f"{where}: the image has {image.size[0]} x {image.size[1]} pixels, more than "
                                 f"{MAX_IMAGE_PIXELS} allowed")
            return image.convert("RGB")
    except (OSError, Image.DecompressionBombWarning, Image.DecompressionBombError, SyntaxError):
        raise ValueError(f"{where}: not an image this server can read") from None
