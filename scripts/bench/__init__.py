"""Benchmarks: losses, engines, async mode, weight publication, trust checks, and the delay sweep's command line."""
