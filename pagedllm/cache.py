"""The per-user cache directory and the file-digest memo kept in it.

Floor one of the package: this module imports nothing from pagedllm, so any
room (models, kernels, bench) may use it without pulling in another.

The cache holds converted models (``gguf/<sha256>/``), joined GGUF files
(``gguf-joined/``), compiled CPU kernels (``kernels/``) and
``sha256-cache.json``, which memoises file digests by (path, size, mtime) so
that a multi-GB file is hashed once, not on every start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import pagedllm.envs as envs

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20  # 1 MiB
DIGEST_CACHE = "sha256-cache.json"


def cache_root() -> Path:
    """Return the pagedllm cache directory (not created here).

    ``$PAGEDLLM_CACHE`` when set and non-empty, else ``~/.cache/pagedllm``,
    following the XDG-style per-user cache convention. Raises nothing.
    """
    env = envs.PAGEDLLM_CACHE
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedllm"


def sha256_file(path: str | os.PathLike) -> str:
    """Return the lowercase hex SHA-256 of the file at ``path``.

    The file is streamed in 1 MiB chunks, so memory use is constant in the
    file size. Raises ``OSError`` (e.g. ``FileNotFoundError``) if the file
    cannot be read. Follows ``hashlib.sha256`` (FIPS 180-4).
    """
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cached_sha256(path: str | os.PathLike) -> str:
    """Return the lowercase hex SHA-256 of ``path``, memoised in ``<cache_root>/sha256-cache.json``.

    The memo is keyed by the resolved path and checked against the file's
    (size, mtime_ns), so a changed file is hashed again. Updating the memo is
    best effort: a read-only or corrupt memo only costs the re-hash.

    Raises:
        OSError: ``path`` cannot be read or stat'ed (``FileNotFoundError`` when missing).
    """
    path = Path(path).resolve()
    st = path.stat()
    key, stamp = str(path), [st.st_size, st.st_mtime_ns]
    store = cache_root() / DIGEST_CACHE
    try:
        table = json.loads(store.read_text())
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    entry = table.get(key)
    if isinstance(entry, dict) and entry.get("stat") == stamp and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    digest = sha256_file(path)
    table[key] = {"stat": stamp, "sha256": digest}
    try:  # best effort: a read-only cache only costs speed
        store.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=store.parent, prefix=".sha256-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(table, fh, indent=1, sort_keys=True)
        os.replace(tmp, store)
    except OSError as exc:
        logger.debug("could not update digest cache %s: %s", store, exc)
    return digest
