"""The delay sweep behind ``scripts/bench/delay_sweep.py`` (its command line), by concern:

* :mod:`sweep.plan` -- what to run: algorithms, tasks, designs, staleness conditions, a run's
  directory and hydra overrides, the design id;
* :mod:`sweep.run` -- running it: warm starts, worker processes, stages, time estimates;
* :mod:`sweep.rows` -- the rows file (one row per finished run) and collecting finished runs;
* :mod:`sweep.analyse` -- the statistics, pure functions over per-run dicts;
* :mod:`sweep.render` -- markdown and CSV outputs, and the study blocks of a doc page;
* :mod:`sweep.figures` -- the figures.

Imported as ``scripts.sweep`` (run the entry script as ``python -m scripts.bench.delay_sweep``
from the repository root; see ``scripts/__init__.py``).
"""
