"""One sampler that joins a running embedded-engine run through its fsspec exchange.

    python -m recipe.gepo.remote_sampler --index 32 --key sampler-32.key hetero.transport_url=URL [...]

It composes the learner's config (give it the learner's overrides: task, algorithm, delay, seed),
builds a :class:`~recipe.gepo.embedded.sampler.SamplerWorker` on the same URL and generates until
the learner writes its stop marker: weights in (each version after its own delay draw), rollout
groups out, checksummed and exactly-once. No Ray: any machine that reaches the URL can add samplers
(``scripts/slurm/remote_samplers.sbatch``: one per array task). ``--index`` picks its prompt stream,
seeds and delay stream: in [``hetero.num_samplers``, 64) and not another remote sampler's; its
group uids carry ``r<index>-<random>``, so a restart never reuses one.
With signed records (the default) ``--key`` is a key made on its machine, whose public half the
learner's operator enrols in ``hetero.trust.enrolment_file`` (``python -m verl_ext.trust.signing
keygen`` / ``enrol``; docs/reliability.md, "Remote samplers and a learner that fails").
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig

from verl_ext.hetero.seeding import MAX_SAMPLERS

ROOT = Path(__file__).resolve().parents[2]


def compose_config(overrides: Sequence[str]) -> DictConfig:
    """``gepo_trainer.yaml`` with ``overrides``, as ``main_gepo --config-dir configs`` composes it."""
    from hydra import compose, initialize_config_dir

    searchpath = f"hydra.searchpath=[pkg://verl.trainer.config,file://{ROOT / 'configs'}]"
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent / "config"), version_base=None):
        return compose(config_name="gepo_trainer", overrides=[searchpath, *overrides])


def check_remote_config(cfg: DictConfig, index: int, key_file: Optional[str] = None) -> None:
    """The settings a remote sampler needs; ValueError naming the key (or flag) otherwise."""
    hetero = cfg.hetero
    if hetero.engine != "embedded" or hetero.mode != "async":
        raise ValueError(
            f"hetero.engine={hetero.engine!r}, hetero.mode={hetero.mode!r}: remote samplers join the embedded "
            "engine's async mode (hetero.engine=embedded hetero.mode=async)"
        )
    if hetero.transport != "fs":
        raise ValueError(
            f"hetero.transport={hetero.transport!r}: a remote sampler reaches the learner through hetero.transport=fs"
        )
    if not hetero.transport_url:
        raise ValueError(
            "hetero.transport_url is empty: give the exchange URL the learner uses (s3://..., /shared/folder)"
        )
    if not hetero.num_samplers <= index < MAX_SAMPLERS:
        raise ValueError(
            f"--index {index}: must be in [{hetero.num_samplers}, {MAX_SAMPLERS}): at least hetero.num_samplers "
            f"(the learner's own samplers use 0..{hetero.num_samplers - 1}) and below {MAX_SAMPLERS}, the "
            "sampler slots of the seed layout (verl_ext.hetero.seeding)"
        )
    if hetero.trust.sign_records and not key_file:
        raise ValueError(
            f"hetero.trust.sign_records=true: the learner accepts only signed records; give --key <file> "
            f"(python -m verl_ext.trust.signing keygen <file> sampler-{index}, then enrol its public key in the "
            "learner's hetero.trust.enrolment_file)"
        )
    if key_file and not hetero.trust.sign_records:
        raise ValueError(f"--key {key_file}: hetero.trust.sign_records=false, so nothing would be signed")


def run_remote_sampler(
    cfg: DictConfig, index: int, max_batches: Optional[int] = None, key_file: Optional[str] = None
) -> dict[str, float]:
    """Generate for the run at ``hetero.transport_url`` until its stop marker (or ``max_batches``
    batches), signing with the key in ``key_file``; returns the sampler's counters."""
    from .embedded.async_shared import transport_spec
    from .embedded.sampler import SamplerWorker
    from .embedded.engine_config import EngineConfig
    from .embedded.tasks import resolve_model_path
    from verl_ext.trust.signing import SamplerKey
    from verl_ext.hetero.seeding import seed_process

    check_remote_config(cfg, index, key_file)
    key = None
    if key_file:
        try:
            key = SamplerKey.load(key_file)
        except (OSError, ValueError) as err:
            raise ValueError(f"--key {key_file}: {err}") from None
        if key.sampler_id != f"sampler-{index}":
            raise ValueError(f"--key {key_file} is {key.sampler_id!r}'s key; this is sampler-{index}")
    engine = EngineConfig.from_omegaconf(cfg)
    if engine.hetero.dry_run:  # validated, nothing started
        print(f"[heterorl] remote sampler-{index}: config ok (dry run)", flush=True)
        return {}
    seed_process(engine.hetero.seed + index)
    model_path = resolve_model_path(engine.settings.model_path, engine.task, engine.hetero.seed)
    spec = transport_spec(engine.hetero, engine.settings)
    speed = engine.hetero.speed_factors()
    worker = SamplerWorker(
        index,
        engine,
        model_path,
        spec,
        speed[index] if index < len(speed) else 1.0,
        uid_namespace=f"r{index}-{uuid.uuid4().hex[:8]}",
        key=key,
    )
    print(f"[heterorl] remote sampler-{index} -> {spec.url}", flush=True)
    return worker.run(max_batches=max_batches)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--index",
        type=int,
        required=True,
        help=f"this sampler's index (>= the learner's hetero.num_samplers, < {MAX_SAMPLERS})",
    )
    parser.add_argument(
        "--key", default=None, help="this sampler's signing key (python -m verl_ext.trust.signing keygen)"
    )
    parser.add_argument(
        "--max-batches", type=int, default=None, help="stop after this many batches (default: at the learner's stop)"
    )
    parser.add_argument(
        "overrides", nargs="*", help="hydra overrides, the learner's (hetero.transport_url=... required)"
    )
    args = parser.parse_args(argv)
    overrides = ["hetero.engine=embedded", "hetero.mode=async", "hetero.transport=fs", *args.overrides]
    try:
        cfg = compose_config(overrides)
        counters = run_remote_sampler(cfg, args.index, args.max_batches, key_file=args.key)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"sampler": args.index, **counters}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
