"""The research benchmarks behind docs/benchmarks.md and docs/reliability.md: async mode
(``bench_async``), the trust checks (``bench_trust``, ``bench_token_check``), sampler/learner
precision (``bench_precision``), weight publication (``bench_publish``), the two engines
(``bench_engines``) and the warm start's kernels (``warm_start_kernels``). The loss benchmark users
run (``make bench``) is ``scripts/bench/``."""
