"""The fsspec transport over a real SFTP server (OpenSSH's sshd on loopback, its own keys and
config): messages round-trip, a server restart is reconnected through without losing or doubling a
message, and a server that never answers ends in one error naming the URL."""

import threading
import time

import fsspec
import pytest

from research.testbeds.sftp_exchange import SftpServer, missing_requirements
from verl_ext.hetero.transport import ExchangeUnreachable, FsspecTransport, connection_lost

pytestmark = pytest.mark.skipif(bool(missing_requirements()), reason=f"needs {missing_requirements()}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path, monkeypatch):
    srv = SftpServer(tmp_path / "sshd", port=_free_port())
    srv.start()
    monkeypatch.setitem(fsspec.config.conf, "sftp", srv.client_options())  # as FSSPEC_SFTP would
    yield srv
    srv.remove()


def test_messages_round_trip_over_sftp_and_survive_a_server_restart(server, tmp_path):
    transport = FsspecTransport(server.url(str(tmp_path / "exchange")), reconnect_s=60)
    transport.put("rollouts", "g0", b"group zero" * 1000)
    assert transport.get("rollouts", "g0") == b"group zero" * 1000
    server.stop()  # every connection dropped, as a restarted server does
    back = threading.Timer(2.0, server.start)
    back.start()
    started = time.monotonic()
    transport.put("rollouts", "g1", b"group one")  # issued while the server is down
    back.join()
    assert time.monotonic() - started >= 1.5 and transport.stats["reconnects"] >= 1
    assert transport.keys("rollouts") == ["g0", "g1"]
    assert transport.get("rollouts", "g1") == b"group one"
    assert transport.incomplete("rollouts") == []  # nothing half-written left visible or behind
    transport.delete("rollouts", "g0")
    assert transport.keys("rollouts") == ["g1"]
    listed, reads = transport.infos("rollouts"), transport.stats["marker_reads"]
    assert transport.infos("rollouts") == listed and transport.stats["marker_reads"] == reads  # one round trip


def test_a_server_that_never_answers_ends_in_one_error_naming_the_url(server, tmp_path):
    transport = FsspecTransport(server.url(str(tmp_path / "exchange")), reconnect_s=2)
    server.stop()
    with pytest.raises(ExchangeUnreachable, match=rf"exchange sftp://root@127.0.0.1:{server.port}.*failed for 2 s"):
        transport.keys("rollouts")


def test_a_missing_file_is_not_a_lost_connection(server, tmp_path):
    transport = FsspecTransport(server.url(str(tmp_path / "exchange")), reconnect_s=60)
    started = time.monotonic()
    with pytest.raises(KeyError, match="not committed"):
        transport.get("rollouts", "absent")  # answered at once, no reconnecting
    assert time.monotonic() - started < 5 and transport.stats["reconnects"] == 0
    assert not connection_lost(FileNotFoundError(2, "no such file"))
    assert connection_lost(OSError("Socket is closed")) and connection_lost(EOFError())


def test_threads_sharing_an_sftp_exchange_each_get_their_own_answers(server, tmp_path):
    # the verl engine's ingress reads groups on one thread while another fetches a weight version;
    # on one paramiko client, unguarded, a thread took the other's reply and waited forever
    url = server.url(str(tmp_path / "exchange"))
    shared, other = FsspecTransport(url, reconnect_s=60), FsspecTransport(url, reconnect_s=60)
    for k in range(8):
        shared.put("rollouts", f"g{k}", bytes([k]) * (50_000 + k))
    errors, done = [], []

    def reader(transport, k):
        try:
            for _ in range(20):
                assert transport.get("rollouts", f"g{k}") == bytes([k]) * (50_000 + k)
                assert len(transport.keys("rollouts")) == 8
            done.append(k)
        except Exception as err:  # noqa: BLE001 -- reported below
            errors.append(repr(err))

    threads = [threading.Thread(target=reader, args=(shared if k % 2 else other, k), daemon=True) for k in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert errors == [] and sorted(done) == list(range(8))
