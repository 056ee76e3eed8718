"""The soak behind ``research/soak/__main__.py`` (its command line and what it checks), by concern:

* :mod:`research.soak.config` -- the composed trainer config of a soak run;
* :mod:`research.soak.faults` -- the fault kinds, their weights, and how each damages a message;
* :mod:`research.soak.injector` -- the thread that injects one random fault every few seconds;
* :mod:`research.soak.watchers` -- the threads that record every committed rollout message;
* :mod:`research.soak.wan_link` -- the real rate-limited link of research/testbeds/wan and its faults (``--wan``);
* :mod:`research.soak.run` -- the soak itself: set-up, the run under its time limit, the result;
* :mod:`research.soak.checks` -- after the run: the final ledger, the accounting by uid, each fault judged;
* :mod:`research.soak.report` -- the result and its summary lines.

Imported as ``research.soak`` (run the soak as ``python -m research.soak`` from the
repository root; see ``scripts/__init__.py``). Nothing here imports Ray
at module level except :mod:`~research.soak.run` and :mod:`~research.soak.injector` (``--wan`` sets
the cluster's auth environment before Ray is imported)."""
