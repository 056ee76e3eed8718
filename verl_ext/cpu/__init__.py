"""A CPU backend for verl 0.9.1: its own trainer (``main_ppo``, the v1 trainers, this project's
``hetero_separate_async``) on a machine with no GPU.

Loaded by its own ``verl.plugins`` entry point (``heterorl_cpu``) in every process that imports
verl, Ray workers of verl's stock ``main_ppo`` included; the project's losses do not import it.
Each part goes through verl's own extension points: :mod:`.platform` (the ``cpu`` platform, torch
on the CPU with gloo, picked only when no accelerator is present), :mod:`.rollout`
(``rollout.name=hf_cpu``), :mod:`.checkpoint_engine` (``checkpoint_engine.backend=ray_mailbox``:
weight sync to a disaggregated rollout pool through Ray's object store), :mod:`.patches` (the few
verl internals fixed on the CPU, each naming its verl file:line, refused on a verl other than
0.9.1) and :mod:`.megatron` (verl's Megatron engine on the CPU, plus one fix for every device).
The settings a CPU run needs: ``configs/verl_preset/cpu_toy.yaml`` (``cpu_toy_megatron.yaml``);
docs/scale-out.md.
"""

from __future__ import annotations

import logging

# Each module registers on import. The patches of verl internals apply only when verl picks the
# CPU platform (no accelerator present). A failure must not break ``import verl`` or a GPU run
# (verl logs a failing plugin only at DEBUG level): warn instead.
try:
    from verl_ext.cpu import checkpoint_engine, platform, rollout  # noqa: F401
    from verl_ext.cpu.megatron import allow_float32_on_cpu, fix_tied_embeddings_with_pipeline

    fix_tied_embeddings_with_pipeline()  # not a CPU fix: on every device (GPU runs of tied models too)
    if not platform.accelerator_present():  # float32 Megatron weights; the driver validates configs early
        allow_float32_on_cpu()
except Exception as _exc:  # pragma: no cover - depends on the installed verl
    logging.getLogger(__name__).warning("HeteroRL's CPU backend for verl was not registered: %r", _exc)
