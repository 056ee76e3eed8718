"""The loss benchmark users run: every registered loss on the CPU (``bench_losses``, ``make bench``)
and on a GPU (``bench_losses_gpu``). The research benchmarks are ``research/bench/``."""
