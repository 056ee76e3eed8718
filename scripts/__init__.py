"""The project's command-line tools (benchmarks, the study's sweep, the soak, the slow-link and
SLURM tools), one package so that they import each other without touching ``sys.path``.

Run them from the repository root as modules, e.g. ``python -m research.study.delay_sweep ...``,
``python -m research.soak ...``, ``python -m research.testbeds.wan.cluster up``: ``-m`` puts the working
directory first on ``sys.path``, so this package is found before the unrelated top-level
``scripts`` package that verl and TransferQueue install (nothing imports that one at run time;
Ray's workers get the driver's working directory first on their path too). A tool that imports a
sibling module refuses to run as a file (``python research/soak/__main__.py``) and says the ``-m`` command;
one that imports only the installed packages (``verl_ext``, ``recipe``) runs either way.
"""
