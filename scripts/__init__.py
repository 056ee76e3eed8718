"""What users run: ``bench/`` (``make bench``: every registered loss on the CPU, ``bench_losses``,
and on a GPU, ``bench_losses_gpu``), ``slurm/`` (the sbatch files) and ``dev/`` (developer tooling).
Research and test-bed tooling (the study, the soak, the other benchmarks, the test beds, the GPU
lane) is the package ``research/``.

One package, so that its tools run from the repository root as modules, e.g.
``python -m scripts.bench.bench_losses``: ``-m`` puts the working directory first on ``sys.path``,
so this package is found before the unrelated top-level ``scripts`` package that verl and
TransferQueue install (nothing imports that one at run time; Ray's workers get the driver's working
directory first on their path too).
"""
