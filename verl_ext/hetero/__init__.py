"""Heterogeneity core, engine-agnostic: delay models and the one delay schedule, rollout records,
the staleness rule and the staleness-bounded buffer, versioned weights, transports, the delay
channel, the async wire protocol and the run's seeds. See docs/heterogeneity.md.
Importing the package imports none of them.
"""
