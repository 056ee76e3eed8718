"""Transports: move opaque byte messages between the learner and samplers.

One interface, two backends, chosen by config (:func:`make_transport`): :class:`FsspecTransport`
over any fsspec URL (a plain path, NFS, ``memory://`` for tests, ``s3://`` with s3fs, ``sftp://``
with paramiko; a dropped server is reconnected to), for samplers in separate jobs or data
centres; :class:`RayTransport` over Ray's object store, for one Ray cluster. A message is addressed by ``(topic, key)`` and carries a SHA-256 and
the sender's timestamp (:class:`MessageInfo`). Writes are atomic: payload to a temporary name,
renamed, then a small commit marker (size, checksum). Readers list committed keys only, so a writer
killed at any point leaves nothing visible; a committed payload that no longer matches its
checksum raises :class:`CorruptMessage` (counted in ``stats["corrupt"]``), never returned.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Callable

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=-]{0,199}$")
DATA_SUFFIX, COMMIT_SUFFIX, TEMP_PREFIX = ".msg", ".ok", ".tmp."


class CorruptMessage(ValueError):
    """A committed message failed its checksum or size check; its bytes were not returned."""


class ExchangeUnreachable(ConnectionError):
    """The exchange's server did not answer for :attr:`FsspecTransport.reconnect_s` seconds."""


def connection_lost(err: BaseException) -> bool:
    """Whether ``err`` says the link to the exchange's server broke (worth reconnecting), rather
    than something about a file: errno-less OSErrors are paramiko's "Socket is closed"; a missing
    or forbidden file carries its errno."""
    if isinstance(err, (ConnectionError, EOFError, TimeoutError)):
        return True
    if type(err).__name__ in ("SSHException", "NoValidConnectionsError", "ChannelException"):
        return True  # paramiko's, checked by name: paramiko is only imported for sftp:// URLs
    return type(err) is OSError and err.errno is None


@dataclass(frozen=True)
class MessageInfo:
    """Metadata of a committed message.

    Attributes:
        topic, key: the address.
        size: payload length in bytes.
        sha256: hex digest of the payload.
        sent_at: sender's clock (seconds; wall clock ``time.time`` unless injected) at commit.
    """

    topic: str
    key: str
    size: int
    sha256: str
    sent_at: float


def check_name(kind: str, name: str) -> str:
    """Topics and keys become file names: letters, digits and ``_ . = -``, not starting with a
    dot or dash (dot-names are reserved for temporaries), at most 200 characters."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"{kind}={name!r} is not a valid name: use letters, digits, '_', '.', '=', '-' "
            f"(not first), at most 200 characters"
        )
    return name


def checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Transport(ABC):
    """Interface every transport implements.

    Attributes:
        clock: seconds, stamped into ``MessageInfo.sent_at`` on put; injectable for tests.
        stats: counters: ``put``, ``get``, ``corrupt`` (checksum or size mismatches seen on get);
            fsspec also ``marker_reads`` (commit markers read) and ``reconnects``.
    """

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.stats: Counter[str] = Counter()

    @abstractmethod
    def put(self, topic: str, key: str, data: bytes) -> MessageInfo:
        """Store ``data`` under (topic, key) atomically; an existing key is replaced (the key is
        invisible while it is rewritten)."""

    @abstractmethod
    def keys(self, topic: str) -> list[str]:
        """Committed keys of ``topic``, sorted; empty if the topic does not exist."""

    @abstractmethod
    def info(self, topic: str, key: str) -> MessageInfo:
        """Metadata of a committed message; KeyError if not committed."""

    @abstractmethod
    def _read(self, topic: str, key: str) -> tuple[MessageInfo, bytes]:
        """Raw payload and its commit metadata; KeyError if not committed."""

    @abstractmethod
    def delete(self, topic: str, key: str) -> None:
        """Remove a message (no error if absent). The commit marker goes first, so a reader
        never sees a committed key without its payload."""

    def infos(self, topic: str) -> list[MessageInfo]:
        """Metadata of every committed message of ``topic``, sorted by key (a key deleted while
        listing is left out). Backends override it with one round trip (the learner's inbox
        lists its topic many times a second)."""
        out = []
        for key in self.keys(topic):
            try:
                out.append(self.info(topic, key))
            except KeyError:
                continue
        return out

    def delete_many(self, topic: str, keys: list[str]) -> None:
        """:meth:`delete` each of ``keys`` (one round trip where the backend can)."""
        for key in keys:
            self.delete(topic, key)

    # Pipelined writes: the learner publishes a weight version every step, and waiting for the
    # store to confirm each one was most of the publish time (docs/benchmarks.md). A backend that
    # can (Ray) returns at once; one sender's writes still apply in the order it made them and
    # before its own later reads. Others write synchronously.

    def put_nowait(self, topic: str, key: str, data: bytes) -> MessageInfo:
        """:meth:`put`, without waiting for the store to confirm where the backend can. A failed
        write raises at a later ``*_nowait`` call or at :meth:`flush`."""
        return self.put(topic, key, data)

    def delete_many_nowait(self, topic: str, keys: list[str]) -> None:
        """:meth:`delete_many`, without waiting where the backend can (see :meth:`put_nowait`)."""
        self.delete_many(topic, keys)

    def flush(self) -> None:
        """Wait for this sender's pending writes; raise the first one's error."""

    def get(self, topic: str, key: str) -> bytes:
        """Payload of a committed message, verified against its checksum.

        Raises KeyError if (topic, key) is not committed, :class:`CorruptMessage` if the bytes do
        not match the committed size and checksum.
        """
        info, data = self._read(check_name("topic", topic), check_name("key", key))
        return self._verified(info, data)

    def get_with_sha256(self, topic: str, key: str) -> tuple[bytes, str]:
        """:meth:`get`, and the SHA-256 the payload was just verified against: a caller holding it
        to a digest of its own compares digests instead of hashing the payload a second time."""
        info, data = self._read(check_name("topic", topic), check_name("key", key))
        return self._verified(info, data), info.sha256

    def get_many(self, topic: str, keys: list[str]) -> dict[str, bytes | Exception]:
        """:meth:`get` of each key: key -> its payload, or the KeyError / :class:`CorruptMessage`
        :meth:`get` would have raised. One round trip where the backend can (the learner's inbox
        reads every new group this way)."""
        out: dict[str, bytes | Exception] = {}
        for key in keys:
            try:
                out[key] = self.get(topic, key)
            except (KeyError, CorruptMessage) as err:
                out[key] = err
        return out

    def _verified(self, info: MessageInfo, data: bytes) -> bytes:
        self.stats["get"] += 1
        if len(data) != info.size or checksum(data) != info.sha256:
            self.stats["corrupt"] += 1
            raise CorruptMessage(
                f"message {info.topic}/{info.key}: {len(data)} bytes with sha256 "
                f"{checksum(data)[:12]}..., committed {info.size} bytes with sha256 {info.sha256[:12]}..."
            )
        return data

    def _new_info(self, topic: str, key: str, data: bytes) -> MessageInfo:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"put {topic}/{key}: data must be bytes, got {type(data).__name__}")
        return MessageInfo(
            topic=topic, key=key, size=len(data), sha256=checksum(bytes(data)), sent_at=float(self.clock())
        )


class FsspecTransport(Transport):
    """Messages as files under an fsspec URL: ``<root>/<topic>/<key>.msg`` plus the commit
    marker ``<key>.ok`` (JSON MessageInfo). Temporaries are ``.tmp.<key>.<random>``.

    A server that drops the connection (an SFTP server restarted, a link cut) is reconnected to:
    each operation is retried on a fresh filesystem object, waiting 0.5 s doubling to 8 s, for up
    to ``reconnect_s`` seconds, then raises :class:`ExchangeUnreachable` naming the URL. Every
    operation is idempotent, so a retried one cannot commit a message twice.

    Args:
        url: fsspec URL or local path of the root folder (created if missing).
        clock: see :class:`Transport`.
        reconnect_s: how long an operation keeps reconnecting before it gives up.
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...). Also read
            from the environment as fsspec does: ``FSSPEC_SFTP='{"key_filename": "..."}'``.
    """

    def __init__(self, url: str, clock: Callable[[], float] = time.time, reconnect_s: float = 300.0, **storage_options):
        super().__init__(clock)
        import fsspec

        self.url, self.storage_options, self.reconnect_s = url, storage_options, reconnect_s
        # one connection per transport, used by one thread at a time, where the client is not
        # thread-safe: two threads on one paramiko SFTP client read each other's replies and hang
        self._serial = fsspec.core.split_protocol(url)[0] in ("sftp", "ssh", "ftp")
        self._lock = threading.RLock()
        self._info_cache: dict[tuple[str, str], tuple[Any, MessageInfo]] = {}  # see infos()
        own = {"skip_instance_cache": True} if self._serial else {}
        self.fs, self.root = fsspec.core.url_to_fs(url, **own, **storage_options)
        self._retrying("makedirs", lambda: self.fs.makedirs(self.root, exist_ok=True))

    def _retrying(self, what: str, operation: Callable[[], Any]) -> Any:
        """``operation()``, reconnecting while the server is unreachable (see the class docstring)."""
        deadline, pause = None, 0.5
        while True:
            try:
                if not self._serial:
                    return operation()
                with self._lock:
                    return operation()
            except Exception as err:
                if not connection_lost(err):
                    raise
                now = time.monotonic()
                deadline = deadline or now + self.reconnect_s
                if now >= deadline:
                    raise ExchangeUnreachable(
                        f"exchange {self.url}: {what} failed for {self.reconnect_s:.0f} s, last with {err!r}"
                    ) from err
                if not self.stats["reconnects"] or pause == 0.5:
                    print(f"[exchange] {self.url}: {what} lost the server ({err!r}); reconnecting", flush=True)
                self.stats["reconnects"] += 1
                time.sleep(min(pause, max(0.0, deadline - now)))
                pause = min(2 * pause, 8.0)
                self._reconnect()

    def _reconnect(self) -> None:
        import fsspec

        try:  # a new filesystem object: fsspec caches instances, and the cached one holds the dead link
            self.fs, _ = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **self.storage_options)
        except Exception as err:
            if not connection_lost(err):
                raise  # e.g. authentication refused: no retry helps

    def __reduce__(self):
        # fsspec filesystems pickle, but rebuilding from the URL keeps Ray/multiprocessing happy
        # across backends; clock and counters are per process by design.
        return (_rebuild_fsspec, (self.url, self.reconnect_s, self.storage_options))

    def _dir(self, topic: str) -> str:
        return posixpath.join(self.root, topic)

    def _paths(self, topic: str, key: str) -> tuple[str, str]:
        base = posixpath.join(self._dir(topic), key)
        return base + DATA_SUFFIX, base + COMMIT_SUFFIX

    def _write_atomic(self, path: str, data: bytes) -> None:
        directory, name = posixpath.split(path)
        temp = posixpath.join(directory, f"{TEMP_PREFIX}{name}.{uuid.uuid4().hex}")
        self.fs.pipe_file(temp, data)
        self.fs.mv(temp, path)

    def put(self, topic: str, key: str, data: bytes) -> MessageInfo:
        check_name("topic", topic), check_name("key", key)
        info = self._new_info(topic, key, data)
        data_path, commit_path = self._paths(topic, key)
        payload, marker = bytes(data), json.dumps(asdict(info)).encode()

        def put_once() -> None:
            self.fs.makedirs(self._dir(topic), exist_ok=True)
            if self.fs.exists(commit_path):
                self.fs.rm_file(commit_path)  # uncommit first: the key is invisible while rewritten
            self._write_atomic(data_path, payload)
            self._write_atomic(commit_path, marker)

        self._retrying(f"put {topic}/{key}", put_once)
        self.stats["put"] += 1
        return info

    def _listing(self, topic: str, detail: bool) -> list:
        """``ls`` of ``topic``'s folder (empty if there is none): base names, or with ``detail``
        fsspec's entries with ``name`` set to the base name (sizes and times cost local folders
        a stat per file, so only :meth:`infos` asks)."""
        directory = self._dir(check_name("topic", topic))

        def list_once() -> list:
            try:
                return self.fs.ls(directory, detail=detail)
            except FileNotFoundError:
                return []

        entries = self._retrying(f"list {topic}", list_once)
        if not detail:
            return [posixpath.basename(str(path).rstrip("/")) for path in entries]
        return [dict(e, name=posixpath.basename(str(e["name"]).rstrip("/"))) for e in entries]

    @staticmethod
    def _committed_key(name: str) -> str | None:
        """The key whose commit marker ``name`` is, or None (a payload, a temporary)."""
        if name.endswith(COMMIT_SUFFIX) and not name.startswith(TEMP_PREFIX):
            return name[: -len(COMMIT_SUFFIX)]
        return None

    def keys(self, topic: str) -> list[str]:
        return sorted(key for key in map(self._committed_key, self._listing(topic, detail=False)) if key is not None)

    def infos(self, topic: str) -> list[MessageInfo]:
        """One listing with sizes and times; a commit marker read once while its size and time
        stay the same (the learner's inbox lists thousands of groups many times a second, and on
        a remote server each read is a round trip). A marker rewritten within the server's time
        resolution at the same size may be listed with its old digest; :meth:`get` always reads
        the marker afresh, so no bytes are ever returned against a stale digest."""
        seen, out = {}, []
        for entry in self._listing(topic, detail=True):
            key = self._committed_key(entry["name"])
            if key is None:
                continue
            stamp = entry.get("mtime", entry.get("created"))
            signature = None if stamp is None else (entry.get("size"), stamp)
            cached = self._info_cache.get((topic, key))
            if signature is not None and cached is not None and cached[0] == signature:
                info = cached[1]
            else:
                try:
                    info = self.info(topic, key)
                except KeyError:
                    continue  # deleted while listing
            seen[(topic, key)] = (signature, info)
            out.append(info)
        self._info_cache = {k: v for k, v in self._info_cache.items() if k[0] != topic} | seen
        return sorted(out, key=lambda i: i.key)

    def _cat(self, what: str, path: str) -> bytes:
        """A file's bytes (FileNotFoundError if it is not there), reconnecting as needed."""
        return self._retrying(what, lambda: self._cat_once(path))

    def _cat_once(self, path: str) -> bytes:
        sftp = getattr(self.fs, "ftp", None)
        if sftp is not None and hasattr(sftp, "open"):  # paramiko: read ahead, or each 32 KiB waits a round trip
            with sftp.open(path, "rb") as f:  # (20 MB at 100 Mbit/s: 1.8 s with prefetch, 7.4 s without)
                f.prefetch()
                return f.read()
        return self.fs.cat_file(path)

    def info(self, topic: str, key: str) -> MessageInfo:
        _, commit_path = self._paths(check_name("topic", topic), check_name("key", key))
        try:
            raw = self._cat(f"read {topic}/{key}", commit_path)
        except FileNotFoundError:
            raise KeyError(f"{topic}/{key} is not committed") from None
        self.stats["marker_reads"] += 1
        try:
            return MessageInfo(**json.loads(raw))
        except (ValueError, TypeError) as err:
            self.stats["corrupt"] += 1
            raise CorruptMessage(f"commit marker of {topic}/{key} is unreadable: {err}") from None

    def _read(self, topic: str, key: str) -> tuple[MessageInfo, bytes]:
        info = self.info(topic, key)
        data_path, _ = self._paths(topic, key)
        try:
            return info, self._cat(f"read {topic}/{key}", data_path)
        except FileNotFoundError:
            raise KeyError(f"{topic}/{key}: payload vanished (deleted while reading)") from None

    def delete(self, topic: str, key: str) -> None:
        paths = list(reversed(self._paths(check_name("topic", topic), check_name("key", key))))

        def delete_once() -> None:
            for path in paths:
                try:
                    self.fs.rm_file(path)
                except FileNotFoundError:
                    pass

        self._retrying(f"delete {topic}/{key}", delete_once)

    def incomplete(self, topic: str) -> list[str]:
        """Names of leftovers from interrupted writes: temporaries and payloads without a
        commit marker."""
        names = self._listing(topic, detail=False)
        committed = set(map(self._committed_key, names))
        return sorted(
            n
            for n in names
            if n.startswith(TEMP_PREFIX) or (n.endswith(DATA_SUFFIX) and n[: -len(DATA_SUFFIX)] not in committed)
        )


def _rebuild_fsspec(url: str, reconnect_s: float, storage_options: dict) -> FsspecTransport:
    return FsspecTransport(url, reconnect_s=reconnect_s, **storage_options)


class _Mailbox:
    """Ray actor state for RayTransport: (topic, key) -> (MessageInfo, [ObjectRef]). The actor
    ``ray.put``s each payload itself, so the mailbox owns it and it outlives the sender. The ref
    is wrapped in a list so Ray does not resolve it when it is returned."""

    def __init__(self):
        self._messages: dict[tuple[str, str], tuple[MessageInfo, list]] = {}

    def put(self, info: MessageInfo, data: bytes) -> None:
        import ray

        self._messages[(info.topic, info.key)] = (info, [ray.put(data)])

    def put_ref(self, info: MessageInfo, wrapped_ref: list) -> None:
        """Store an existing reference (tests use it to plant inconsistent entries)."""
        self._messages[(info.topic, info.key)] = (info, wrapped_ref)

    def get(self, topic: str, key: str):
        return self._messages.get((topic, key))

    def get_many(self, topic: str, keys: list[str]) -> list:
        return [self._messages.get((topic, key)) for key in keys]

    def keys(self, topic: str) -> list[str]:
        return sorted(key for t, key in self._messages if t == topic)

    def infos(self, topic: str) -> list[MessageInfo]:
        return [info for (t, key), (info, _) in sorted(self._messages.items()) if t == topic]

    def delete(self, topic: str, key: str) -> None:
        self._messages.pop((topic, key), None)

    def delete_many(self, topic: str, keys: list[str]) -> None:
        for key in keys:
            self._messages.pop((topic, key), None)


class RayTransport(Transport):
    """Messages in Ray's object store, indexed by a named mailbox actor.

    Payloads are stored by the mailbox actor (it owns the objects), so a message outlives the
    sampler or learner process that sent it; the mailbox is detached, so it also outlives the
    driver until :meth:`shutdown`. Requires an initialised Ray; every process that builds a
    RayTransport with the same ``name`` (and namespace) shares the mailbox; the object pickles,
    so it can also be passed to actors.

    Args:
        name: name of the mailbox actor (created on first use).
        namespace: Ray namespace of the actor; None = the current job's namespace.
        clock: see :class:`Transport`.
        resources: Ray custom resources of the mailbox actor (where it is created decides which
            node holds every message: the learner's, ``hetero.learner_ray_resources``); None = anywhere.
    """

    def __init__(
        self,
        name: str = "heterorl-mailbox",
        namespace: str | None = None,
        clock: Callable[[], float] = time.time,
        resources: dict[str, float] | None = None,
    ):
        super().__init__(clock)
        import ray

        self.name, self.namespace, self.resources = name, namespace, dict(resources or {})
        self._pending: list = []  # refs of writes not yet confirmed (``*_nowait``), oldest first
        self._pending_lock = threading.Lock()
        options = dict(name=name, namespace=namespace, get_if_exists=True, lifetime="detached", num_cpus=0)
        if self.resources:
            options["resources"] = self.resources
        self._mailbox = ray.remote(_Mailbox).options(**options).remote()

    def __reduce__(self):
        return (_rebuild_ray, (self.name, self.namespace, self.resources))

    def put(self, topic: str, key: str, data: bytes) -> MessageInfo:
        import ray

        info, ref = self._send(topic, key, data)
        ray.get(ref)
        return info

    def _send(self, topic: str, key: str, data: bytes):
        """Hand ``data`` to the mailbox: (its MessageInfo, the ref of the mailbox's put call)."""
        check_name("topic", topic), check_name("key", key)
        info = self._new_info(topic, key, data)
        ref = self._mailbox.put.remote(info, bytes(data))
        self.stats["put"] += 1
        return info, ref

    #: unconfirmed writes a sender may have in flight; the next one waits for the oldest
    MAX_PENDING = 4

    def put_nowait(self, topic: str, key: str, data: bytes) -> MessageInfo:
        info, ref = self._send(topic, key, data)
        self._submit(ref)
        return info

    def delete_many_nowait(self, topic: str, keys: list[str]) -> None:
        if keys:
            self._submit(
                self._mailbox.delete_many.remote(check_name("topic", topic), [check_name("key", k) for k in keys])
            )

    def flush(self) -> None:
        import ray

        with self._pending_lock:
            pending, self._pending = self._pending, []
        ray.get(pending)

    def _submit(self, ref) -> None:
        # the mailbox runs one call at a time in each caller's submission order, so a pending
        # write is applied before any later call of this process
        import ray

        with self._pending_lock:
            self._pending.append(ref)
            oldest = self._pending.pop(0) if len(self._pending) > self.MAX_PENDING else None
        if oldest is not None:
            ray.get(oldest)

    def keys(self, topic: str) -> list[str]:
        import ray

        return ray.get(self._mailbox.keys.remote(check_name("topic", topic)))

    def infos(self, topic: str) -> list[MessageInfo]:
        import ray

        return ray.get(self._mailbox.infos.remote(check_name("topic", topic)))

    def delete_many(self, topic: str, keys: list[str]) -> None:
        import ray

        if keys:
            ray.get(self._mailbox.delete_many.remote(check_name("topic", topic), [check_name("key", k) for k in keys]))

    def get_many(self, topic: str, keys: list[str]) -> dict[str, bytes | Exception]:
        import ray

        topic = check_name("topic", topic)
        entries = ray.get(self._mailbox.get_many.remote(topic, [check_name("key", k) for k in keys])) if keys else []
        present = [(key, entry) for key, entry in zip(keys, entries) if entry is not None]
        payloads = ray.get([entry[1][0] for _, entry in present]) if present else []
        out: dict[str, bytes | Exception] = {key: KeyError(f"{topic}/{key} is not committed") for key in keys}
        for (key, (info, _)), data in zip(present, payloads):
            try:
                out[key] = self._verified(info, data)
            except CorruptMessage as err:
                out[key] = err
        return out

    def _entry(self, topic: str, key: str):
        import ray

        entry = ray.get(self._mailbox.get.remote(check_name("topic", topic), check_name("key", key)))
        if entry is None:
            raise KeyError(f"{topic}/{key} is not committed")
        return entry

    def info(self, topic: str, key: str) -> MessageInfo:
        return self._entry(topic, key)[0]

    def _read(self, topic: str, key: str) -> tuple[MessageInfo, bytes]:
        import ray

        info, wrapped_ref = self._entry(topic, key)
        return info, ray.get(wrapped_ref[0])

    def delete(self, topic: str, key: str) -> None:
        import ray

        ray.get(self._mailbox.delete.remote(check_name("topic", topic), check_name("key", key)))

    def shutdown(self) -> None:
        """Kill the (detached) mailbox actor and with it every stored message."""
        import ray

        ray.kill(self._mailbox)


def _rebuild_ray(name: str, namespace: str | None, resources: dict) -> RayTransport:
    return RayTransport(name, namespace, resources=resources)


def make_transport(kind: str, **kwargs) -> Transport:
    """Build a transport by name: ``"fsspec"`` (kwargs: url, storage options) or ``"ray"``
    (kwargs: name, namespace, resources)."""
    if kind == "fsspec":
        if "url" not in kwargs:
            raise ValueError("fsspec transport needs url= (e.g. file:///shared/run1 or memory://run1)")
        return FsspecTransport(**kwargs)
    if kind == "ray":
        return RayTransport(**kwargs)
    raise ValueError(f"unknown transport kind={kind!r}; expected 'fsspec' or 'ray'")
