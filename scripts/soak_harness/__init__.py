"""The soak behind ``scripts/soak.py`` (its command line and what it checks), by concern:

* :mod:`soak_harness.config` -- the composed trainer config of a soak run;
* :mod:`soak_harness.faults` -- the fault kinds, their weights, and how each damages a message;
* :mod:`soak_harness.injector` -- the thread that injects one random fault every few seconds;
* :mod:`soak_harness.watchers` -- the threads that record every committed rollout message;
* :mod:`soak_harness.wan_link` -- the real rate-limited link of research/testbeds/wan and its faults (``--wan``);
* :mod:`soak_harness.run` -- the soak itself: set-up, the run under its time limit, the result;
* :mod:`soak_harness.checks` -- after the run: the final ledger, the accounting by uid, each fault judged;
* :mod:`soak_harness.report` -- the result and its summary lines.

Imported as ``scripts.soak_harness`` (run the soak as ``python -m scripts.soak`` from the
repository root; see ``scripts/__init__.py``). Nothing here imports Ray
at module level except :mod:`~soak_harness.run` and :mod:`~soak_harness.injector` (``--wan`` sets
the cluster's auth environment before Ray is imported).
"""
