"""The delay sweep behind ``research/study/delay_sweep.py`` (its command line), by concern:

* :mod:`research.study.plan` -- what to run: algorithms, tasks, designs, staleness conditions, a run's
  directory and hydra overrides, the design id;
* :mod:`research.study.run` -- running it: warm starts, worker processes, stages, time estimates;
* :mod:`research.study.rows` -- the rows file (one row per finished run) and collecting finished runs;
* :mod:`research.study.analyse` -- the statistics, pure functions over per-run dicts;
* :mod:`research.study.render` -- markdown and CSV outputs, and the study blocks of a doc page;
* :mod:`research.study.figures` -- the figures.

Imported as ``research.study`` (run the entry script as ``python -m research.study.delay_sweep``
from the repository root; see ``scripts/__init__.py``).
"""
