"""The verl engine: HeteroRL's recipe on verl 0.9.1's v1 trainer for GPU clusters.

Learners on verl's FSDP or Megatron workers, samplers on verl's vLLM rollout replicas, all in one
Ray cluster (scripts/slurm/). Entry points for ``recipe/gepo/main_gepo.py``:

- :func:`.runner.run` (``hetero.engine=verl``): validates, then dry-runs when ``hetero.dry_run=true``
  or trains (GPUs required).
- :func:`.launch_plan.dry_run` / :func:`.launch_plan.build_plan`: validate and print / return the plan; CPU only.

Modules: ``plan`` (the bypass guard, validation and the plan),
``runner`` (run), ``trainer`` (the verl trainer subclass, imported only when it trains: it needs
verl's v1 trainer and TransferQueue), ``batch_rules`` (driver-side: the exact staleness bound and
GEPO's denominators over whole groups), ``loss`` (worker-side ``ppo_loss`` bridge),
``delayed_sync`` (when each weight version reaches the samplers).
"""
