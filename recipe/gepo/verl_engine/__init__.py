"""The verl engine: HeteroRL's recipe on verl 0.9.1's v1 trainer for GPU clusters.

Learners on verl's FSDP or Megatron workers, samplers on verl's vLLM rollout replicas, all in one
Ray cluster (scripts/slurm/). Entry points for ``recipe/gepo/main_gepo.py``:

- :func:`run` (``hetero.engine=verl``): validates, then dry-runs when ``hetero.dry_run=true``
  or trains (GPUs required).
- :func:`dry_run` / :func:`build_plan`: validate and print / return the plan; CPU only.

Modules: ``plan`` (validation and plan), ``runner`` (run), ``trainer`` (the verl trainer subclass,
imported only on GPU runs: it needs verl's v1 trainer and TransferQueue), ``loss`` (worker-side
``ppo_loss`` bridge), ``denominator`` (driver-side GEPO denominators), ``delayed_sync``,
``staleness``, ``guard``, ``engine_config`` (the optional ``verl_engine:`` section).
"""

from recipe.gepo.verl_engine.plan import build_plan, dry_run
from recipe.gepo.verl_engine.runner import run

__all__ = ["build_plan", "dry_run", "run"]
