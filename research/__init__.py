"""Research and test-bed tooling: the study (``research.study``), the soak (``research.soak``), the
benchmarks behind docs/benchmarks.md and docs/reliability.md (``research.bench``), the slow-link
and SLURM test beds (``research.testbeds``) and the GPU lane (``research.gpu_lane``). What users
run is under ``scripts/`` (the sbatch files, ``make bench``); nothing under ``verl_ext/`` or
``recipe/`` imports this package, and it is not installed.

Run its tools from the repository root as modules, e.g. ``python -m research.study.delay_sweep ...``,
``python -m research.soak ...``, ``python -m research.testbeds.wan.cluster up``: ``-m`` puts the
working directory first on ``sys.path``, so this package is found without being installed (Ray's
workers get the driver's working directory first on their path too). A tool that imports a sibling
module refuses to run as a file (``python research/soak/__main__.py``) and says the ``-m`` command;
one that imports only the installed packages (``verl_ext``, ``recipe``) runs either way.
"""
