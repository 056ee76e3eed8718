"""The verl engine's star with real separation (research/testbeds/pool_star*.py): the judge's reading
of pool logs, and (slow) one run of a learner and two pools, each in its own namespace and Ray
cluster behind a 100 Mbit/s link, with an SFTP server as the exchange and every fault of the
run's schedule: none of the pools' groups lost, none trained twice."""

import pytest

from research.testbeds import pool_star, pool_star_run
from research.testbeds.sftp_exchange import missing_requirements


def _log(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    return tmp_path / name


def test_the_judge_reads_what_each_launch_of_a_pool_sent(tmp_path):
    killed = _log(tmp_path, "pool1.1.log", (
        "[pool 33] up: exchange sftp://x, launch r33-a, starting at batch 0\n"
        "[pool 33] batch 0: 4 groups, version 0 (published 9.0 s before), mean reward 0.5\n"
        "[pool 33] batch 1: 4 groups, version 1 (published 2.5 s before), mean reward 0.5\n"
    ))  # fmt: skip
    restarted = _log(tmp_path, "pool1.2.log", (
        "[pool 33] up: exchange sftp://x, launch r33-b, starting at batch 2\n"
        "[pool 33] batch 2: 2 groups, version 1 (published 7.0 s before), mean reward 0.5\n"
        "[pool 33] batch 3: 2 groups, version 2 (published 1.5 s before), mean reward 0.5\n"
        '{"pool": 33, "batches": 2}\n'
    ))  # fmt: skip
    sure, maybe = pool_star_run.sent_groups([killed, restarted])
    # the killed launch's last batch line may have been printed with its groups half sent
    assert maybe == {f"r33-a-b1-{i}" for i in range(4)}
    assert sure == {f"r33-a-b0-{i}" for i in range(4)} | {f"r33-b-b{b}-{i}" for b in (2, 3) for i in range(2)}
    timing = pool_star_run.lag_per_version([killed, restarted])
    assert timing == {"versions": 2, "median": 2.0, "min": 1.5, "max": 2.5}  # versions 1 and 2, earliest batch each


def test_the_star_names_its_nodes_inside_one_private_subnet():
    addresses = {role: pool_star.address(role) for role in pool_star.ROLES}
    assert len(set(addresses.values())) == 4 and all(a.startswith("10.216.0.") for a in addresses.values())
    assert pool_star.exchange_url("r1") == f"sftp://root@{addresses['exchange']}:2222/tmp/heterorl-star/exchange/r1"
    assert pool_star.in_node("pool0", ["true"]) == ["ip", "netns", "exec", pool_star.netns("pool0"), "true"]


@pytest.mark.slow
@pytest.mark.skipif(bool(missing_requirements()), reason=f"needs {missing_requirements()}")
def test_a_learner_and_two_pools_over_real_links_lose_no_group_through_every_fault(tmp_path):
    try:
        report = pool_star_run.run(tmp_path / "star", steps=24, rate_mbit=100, faults=True)
    finally:
        pool_star.down()
    print(report)
    assert report["learner_rc"] == 0 and set(report["pools_rc"].values()) == {0}
    assert report["steps"] == list(range(1, 25))
    assert [f["fault"] for f in report["faults"] if "healed" not in f["fault"]] == list(pool_star_run.FAULTS)
    assert report["lost"] == 0 and report["trained_twice"] == 0 and report["trained_from_no_pool"] == 0
    # every step trains 4 pool groups, each in the audit (the first step after the resume too: verl's
    # restored slots are filled again by the new ingress). Honest groups can still be refused as copies
    # (report["refused_as_copies"], no blame; 5 on 2026-11-29, likely prompts given back answered alike)
    assert report["trained"] == 24 * 4 and report["refused"] == 0 and report["failed"] == 0
    assert report["exchange_reconnects"] >= 1  # the server restart was reconnected through, not waited out
    assert report["version_fetch_errors"] == 0


def test_the_judge_reads_when_each_version_reached_a_pool(tmp_path):
    log = _log(tmp_path, "pool0.1.log", (
        "[pool 32] version 0 loaded, 40.0 s after it was published\n"
        "[pool 32] version 1 loaded, 0.8 s after it was published\n"
        "[pool 32] version 3 loaded, 1.2 s after it was published\n"
    ))  # fmt: skip
    other = _log(tmp_path, "pool1.1.log", "[pool 33] version 1 loaded, 0.5 s after it was published\n")
    timing = pool_star_run.lag_per_version([log, other], pool_star_run.LOADED)
    assert timing == {"versions": 2, "median": 0.85, "min": 0.5, "max": 1.2}
