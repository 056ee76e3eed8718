"""A CPU backend for verl 0.9.1: its own trainer (``main_ppo``, the v1 trainers, this project's
``hetero_separate_async``) on a machine with no GPU.

Loaded by the project's ``verl.plugins`` entry point (:mod:`verl_ext.verl_plugin`) in every process
that imports verl; nothing to set. What it adds, each through verl's own extension points:

- :mod:`.platform` -- the ``cpu`` platform (torch on the CPU, gloo), picked by verl only when no
  accelerator is present;
- :mod:`.rollout` -- ``actor_rollout_ref.rollout.name=hf_cpu`` (HF transformers generation);
- :mod:`.checkpoint_engine` -- ``actor_rollout_ref.rollout.checkpoint_engine.backend=ray_mailbox``
  (weight sync to a disaggregated rollout pool through Ray's object store);
- :mod:`.patches` -- the few verl internals fixed on the CPU, each named with its verl file:line,
  refused on a verl other than 0.9.1.

The settings a CPU run needs (logical Ray GPUs, fsdp2, sdpa, ...) are in
``configs/verl_preset/cpu_toy.yaml``; see docs/scale-out.md.
"""

from __future__ import annotations


def register() -> None:
    """Register the CPU platform, the hf_cpu rollout and the ray_mailbox weight sync with verl."""
    from verl_ext.cpu import checkpoint_engine, platform, rollout  # noqa: F401  (each registers on import)


__all__ = ["register"]
