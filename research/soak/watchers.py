"""Threads that record every committed rollout message (key -> {sha256}) while the soak runs, so
that a group the learner never saw is still accounted for."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path

from verl_ext.hetero.protocol import ROLLOUT_TOPIC
from verl_ext.hetero.transport import COMMIT_SUFFIX, TEMP_PREFIX, Transport


class _Watcher(threading.Thread):
    """Calls ``scan()`` every ``interval`` s until stopped, and once more after (the last messages)."""

    def __init__(self, interval: float):
        super().__init__(daemon=True, name="soak-watcher")
        self.interval = interval
        self.seen: dict[str, set[str]] = defaultdict(set)
        self._halt = threading.Event()
        self.lock = threading.Lock()

    def scan(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        while not self._halt.is_set():
            self.scan()
            time.sleep(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self.scan()


class TransportWatcher(_Watcher):
    """Records every committed rollout message of any transport (one listing with checksums,
    ``Transport.infos``): key -> {sha256}; every ``interval`` s. Used with --wan (Ray transport)."""

    def __init__(self, transport: Transport, interval: float = 0.05):
        super().__init__(interval)
        self.transport = transport

    def scan(self) -> None:
        try:
            infos = self.transport.infos(ROLLOUT_TOPIC)
        except Exception:  # noqa: BLE001 - the mailbox busy or restarting: the next scan sees it
            return
        with self.lock:
            for info in infos:
                self.seen[info.key].add(info.sha256)


class Watcher(_Watcher):
    """Records every committed rollout message of the fs transport: key -> {sha256}; scans every
    ``interval`` s (a commit marker is re-read only when it changes)."""

    def __init__(self, folder: Path, interval: float = 0.05):
        super().__init__(interval)
        self.folder = folder
        self._markers: dict[str, tuple[int, int]] = {}

    def scan(self) -> None:
        try:
            entries = list(os.scandir(self.folder))
        except FileNotFoundError:
            return
        for entry in entries:
            name = entry.name
            if name.endswith(COMMIT_SUFFIX) and not name.startswith(TEMP_PREFIX):
                self._read_marker(entry, name[: -len(COMMIT_SUFFIX)])

    def _read_marker(self, entry: os.DirEntry, key: str) -> None:
        try:
            stat = entry.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            if self._markers.get(key) == stamp:
                return
            sha = json.loads(Path(entry.path).read_bytes())["sha256"]
        except (FileNotFoundError, ValueError, KeyError):
            return  # deleted or being replaced: the next scan sees the new marker
        self._markers[key] = stamp
        with self.lock:
            self.seen[key].add(sha)
