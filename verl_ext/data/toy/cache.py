"""A folder cache keyed by settings: built once, under a file lock, moved into place when complete.

``<cache_dir>/<name>-<first 12 hex of sha256(settings as sorted json)>``: other settings never
share a folder. The first caller builds it into a temporary folder next to it and renames that
into place, so a killed build never leaves a folder that looks finished; concurrent callers wait
on a lock file and then find the finished folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["settings_key", "cached_folder", "file_lock"]


def settings_key(settings: dict) -> str:
    """The first 12 hex digits of the sha256 of ``settings`` as JSON with sorted keys."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive ``flock`` on ``path`` (created if missing) for the block."""
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cached_folder(
    cache_dir: str | os.PathLike, name: str, settings: dict, build: Callable[[Path], None], done_file: str
) -> Path:
    """``<cache_dir>/<name>-<settings_key(settings)>``, built by ``build(folder)`` the first time.

    ``build`` fills the (empty, temporary) folder it is given and must write ``done_file`` in
    it; a folder holding ``done_file`` counts as finished and is returned without building."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = settings_key(settings)
    final = cache_dir / f"{name}-{key}"
    if (final / done_file).is_file():
        return final
    with file_lock(cache_dir / f".{name}-{key}.lock"):
        if (final / done_file).is_file():  # another process finished it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=cache_dir))
        try:
            build(tmp)
            if not (tmp / done_file).is_file():
                raise RuntimeError(f"building {final.name} wrote no {done_file}")
            if final.exists():  # a partial folder from a killed run (no done file): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
