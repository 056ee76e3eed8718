"""Every seed the embedded engine derives from ``hetero.seed``, in one place.

Each random draw of a run is a pure function of the root seed and where it happens (learner
step, sampler and batch index, delay key), so a replay run is reproducible bit for bit and a
resumed run continues exactly where the interrupted one was. The numbers are arbitrary but
fixed: changing one changes every run that uses it.
"""

from __future__ import annotations

# seed * STRIDE + index keeps the sampling seeds of different root seeds apart for any index
# below STRIDE (a prime, so no two (seed, index) pairs of a sweep collide)
STRIDE = 1_000_003
# the diagnostics' fresh samples must not reuse a training batch's seed
DIAGNOSTICS_OFFSET = 500_000_000
# async samplers: room for this many samplers per batch index
MAX_SAMPLERS = 64

# delay streams (verl_ext.hetero.delay.DelaySchedule): who receives the delayed thing
LEARNER_STREAM = 0
"""The learner receiving rollouts (``hetero.delay_rollouts``)."""


def sampler_stream(index: int) -> int:
    """Delay stream of sampler ``index`` (0-based). Replay mode's one emulated sampler is
    sampler 0; the verl engine's rollout replicas, which receive each version together, too."""
    if index < 0:
        raise ValueError(f"sampler index={index} must be >= 0")
    return index + 1


def replay_sampling_seed(seed: int, step: int) -> int:
    """Token sampling of replay step ``step``'s batch."""
    return seed * STRIDE + step


def sampler_sampling_seed(seed: int, batch_index: int, sampler_index: int) -> int:
    """Token sampling of batch ``batch_index`` of async sampler ``sampler_index``."""
    if not 0 <= sampler_index < MAX_SAMPLERS:
        raise ValueError(f"sampler index={sampler_index} must be in [0, {MAX_SAMPLERS})")
    return (seed * STRIDE + batch_index) * MAX_SAMPLERS + sampler_index


def diagnostics_seed(seed: int, step: int) -> int:
    """The fresh learner samples of the E[A] diagnostics at step ``step``."""
    return seed * STRIDE + step + DIAGNOSTICS_OFFSET


def seed_process(seed: int) -> None:
    """The driver process's global torch generator (anything not drawn from a per-use seed above)."""
    import torch

    torch.manual_seed(seed)
