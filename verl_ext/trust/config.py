"""``hetero.trust``: the trust options as a typed dataclass (:class:`TrustConfig`), mirrored by
``gepo_trainer.yaml``'s ``hetero.trust`` block. Validated before any work starts; builds the
run's ledger and bounds."""

from __future__ import annotations

from dataclasses import dataclass

from verl_ext.option_fields import ASYNC, REPLAY, VERL, option

NO_PUBLISHING_SAMPLERS = {
    REPLAY: "replay mode's one sampler is the learner's own process: no record crosses a trust boundary",
    VERL: "the verl engine's own replicas are actors of its Ray job; its remote pools (hetero.transport=fs) get "
    "signatures, replays, rewards and a sampled re-score of q checked (docs/reliability.md)",
}
TABLE_BOUNDS = "table"
"""``hetero.trust.bounds_file`` naming the built-in table (SmolLM2-135M's bf16 spread) on purpose."""


@dataclass
class TrustConfig:
    """The ``hetero.trust:`` section: samplers you do not control (async mode, every record crosses a transport).
    Signed records, checks of what a sampler claims, trust and quarantine, a divergence bound (``verl_ext.trust``;
    docs/reliability.md "Samplers you do not control", where the checks' costs are measured)."""

    sign_records: bool = option(True, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Samplers sign their records (Ed25519); the learner accepts only records of enrolled, unrevoked samplers.
    Refused ones count in hetero/rejected/{unsigned, unenrolled, revoked, bad_signature, sampler_mismatch}. The
    learner enrols the samplers it launches; others through ``enrolment_file``."""
    enrolment_file: str = option("", honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """JSON enrolment of samplers outside the learner's Ray job (python -m verl_ext.trust.signing enrol).
    Re-read when it changes; "" = none. Requires ``sign_records``."""
    verify_fraction: float = option(0.1, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Fraction of groups whose q the learner re-scores under the weights of the claimed version; 0 = none.
    A seeded draw per group; every group on probation is checked. Each re-score costs one forward pass; a sampler
    turning liar after its probation gets about (1 - f) / f groups in (docs/reliability.md "Numbers")."""
    probation_groups: int = option(4, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """A sampler's first this-many checks are made on every group it sends."""
    hold_unchecked: bool = option(True, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Unchecked groups wait in the buffer until a re-score of a later group of their sampler passes.
    Not taken before (hetero/withheld, trust/vouched); dropped on quarantine or at the staleness bound
    (hetero/dropped/stale_unvouched). A liar lying on every group after probation gets none trained on.
    Inert with verify_fraction=0; bound and cost: docs/reliability.md "Against a patient attacker"."""
    logprob_tolerance: float = option(1e-3, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Largest |log q reported - log q re-scored| over a checked group's tokens that passes (fp32's bound).
    Set from the honest spread measured on the CPU engine (docs/reliability.md "Numbers"); a sampler on other
    kernels (vLLM, bf16) needs its own measurement."""
    check_rewards: bool = option(True, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Recompute every group's rewards from its tokens and the learner's own copy of the prompt's answer.
    The prompt must be the one the learner assigned the group's slot (prompt_not_assigned: no sampler picks its
    prompts). Also group-local estimators' advantages (grpo) and bnpo's proportions; a mismatch fails the check."""
    trust_penalty: float = option(1.0, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Trust (1 at the start) lost per failed check."""
    trust_recovery: float = option(0.05, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Trust regained per passed check (capped at 1)."""
    quarantine_below: float = option(0.5, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Below this trust a sampler is quarantined: its records are refused for the rest of the run.
    Refused as hetero/rejected/quarantined; its groups accepted since its last passed check are dropped from the
    buffer (hetero/dropped/quarantined). With the defaults one failed check quarantines."""
    max_divergence: float = option(0.0, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Per-sampler bound (0 = off) on the mean k3 KL(sampler || learner) of its last divergence_window groups.
    Each consumed group's KL is estimated in the learner's step as the ``is/kl_sampler_learner`` metric is (k3 per
    token, token-mean per sequence, mean over the group); over the bound, its groups are refused
    (hetero/rejected/divergent): a slow-but-close sampler keeps contributing, a fast-but-divergent one does not."""
    divergence_window: int = option(8, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Consumed groups per sampler the divergence bound averages over."""
    checkable_sampling: bool = option(False, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Samplers draw each group by seeded Gumbel-max, with the seed the learner assigns its slot (signed).
    A re-scored group's tokens are re-derived from the same logits and noise: a token further below the noised
    best than its precision's near-tie margin fails (token_mismatch), as does another seed (seed_not_assigned).
    Catches other weights, temperatures or truncation even when q matches. Unseeded: refused without blame."""
    check_process: bool = option(True, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """true: checks run in a checker process on the system cores at nice 10; false: in the learner's poll thread.
    The checker (``recipe.gepo.embedded.checker``, on ``hetero.system_cpus``) holds its own model copy; a group awaits
    its verdict outside the buffer (in its sampler's quota) and no group is admitted before its checks. A waiting
    learner judges rewards-only groups itself and lends its cores. Costs: docs/reliability.md "Where the checks run"."""

    bounds_file: str = option("", honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """bf16's bounds calibrated on the run's own model (python -m recipe.gepo.calibrate); "" or "table" = the table's.
    The table's are SmolLM2-135M's: a run whose learner re-scores in bf16 (sampler_precision=bf16) is refused at
    start with "" (and starts with "table", said knowingly), as is a file unreadable or measured for another model,
    scorer precision or temperature (``bounds.calibrate``). Used for every group held to bf16's bounds."""

    # TrustLedger's constructor argument -> the field (hetero.trust.<field>) that sets it
    _LEDGER_FIELDS = {
        "verify_fraction": "verify_fraction",
        "probation_groups": "probation_groups",
        "penalty": "trust_penalty",
        "recovery": "trust_recovery",
        "quarantine_below": "quarantine_below",
        "max_divergence": "max_divergence",
        "divergence_window": "divergence_window",
    }

    def _ledger_arguments(self) -> dict:
        return {argument: getattr(self, name) for argument, name in self._LEDGER_FIELDS.items()}

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (the ledger's ranges are
        :meth:`TrustLedger.check_arguments`'s, checked under the hydra keys)."""
        from verl_ext.trust.ledger import TrustLedger

        TrustLedger.check_arguments(
            self._ledger_arguments(), names={a: f"hetero.trust.{name}" for a, name in self._LEDGER_FIELDS.items()}
        )
        if not self.logprob_tolerance > 0:
            raise ValueError(f"hetero.trust.logprob_tolerance={self.logprob_tolerance!r} must be > 0")
        if self.enrolment_file and not self.sign_records:
            raise ValueError(
                "hetero.trust.enrolment_file is set but hetero.trust.sign_records=false: "
                "the learner would not check signatures"
            )
        self._calibration = None  # (precision -> Tolerance, measured facts), read once here: actors get it pickled
        if self.bounds_file and self.bounds_file != TABLE_BOUNDS:
            from verl_ext.trust.bounds import read_bounds_file

            self._calibration = read_bounds_file(self.bounds_file)

    def bounds(self):
        """The run's :class:`~verl_ext.trust.bounds.TrustBounds`: the table, ``logprob_tolerance``
        as fp32's bound on one token, ``bounds_file``'s calibration in place of the table's bf16."""
        from verl_ext.trust.bounds import TrustBounds

        calibration = getattr(self, "_calibration", None)
        return TrustBounds(self.logprob_tolerance, dict(calibration[0]) if calibration else {})

    def check_calibration(self, model: str, scorer_precision: str, temperature: float, rescores: bool = True) -> None:
        """Refuse a ``bounds_file`` measured for another model, scorer precision or temperature
        than the run's, and a run that re-scores in bf16 without one: bf16's honest spread depends
        on the model, and the table's bf16 bounds (SmolLM2's) let a lie on a quieter model through.
        ``rescores``: the run's mode re-scores groups (async). ValueError naming the key, the fact and both values."""
        calibration = getattr(self, "_calibration", None)
        if not calibration:
            if rescores and scorer_precision == "bf16" and self.verify_fraction > 0 and not self.bounds_file:
                raise ValueError(
                    f"hetero.sampler_precision=bf16 with hetero.trust.verify_fraction={self.verify_fraction}: "
                    "bf16 groups are judged by bounds measured on the run's own model, and "
                    "hetero.trust.bounds_file is empty (python -m recipe.gepo.calibrate --out bounds_bf16.json "
                    "<the run's overrides>, then hetero.trust.bounds_file=bounds_bf16.json; "
                    f"hetero.trust.bounds_file={TABLE_BOUNDS} takes SmolLM2-135M's table knowingly)"
                )
            return
        measured = calibration[1]
        for fact, run in (("model", model), ("scorer_precision", scorer_precision), ("temperature", temperature)):
            if measured[fact] != run:
                raise ValueError(
                    f"hetero.trust.bounds_file={self.bounds_file!r} was measured with {fact}={measured[fact]!r}; "
                    f"this run has {run!r} (python -m recipe.gepo.calibrate with the run's overrides measures it)"
                )

    def ledger(self, secret: bytes | None = None):
        """The run's :class:`~verl_ext.trust.ledger.TrustLedger` (``secret``: the key of its draw of
        groups to re-score; None: a fresh random one, as a run's learner makes at start)."""
        from verl_ext.trust.ledger import TrustLedger

        return TrustLedger(secret=secret, **self._ledger_arguments())
