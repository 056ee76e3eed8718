"""``hetero.trust``: the trust options as a typed dataclass (:class:`TrustConfig`), mirrored by
``gepo_trainer.yaml``'s ``hetero.trust`` block. Validated before any work starts; builds the
run's ledger and bounds."""

from __future__ import annotations

from dataclasses import dataclass

from verl_ext.option_fields import ASYNC, REPLAY, VERL, option

NO_PUBLISHING_SAMPLERS = {
    REPLAY: "replay mode's one sampler is the learner's own process: no record crosses a trust boundary",
    VERL: "verl's rollout workers are actors of the trainer's own Ray job and publish no records; samplers "
    "outside it join through hetero.engine=embedded's fs transport (docs/reliability.md)",
}


@dataclass
class TrustConfig:
    """Samplers you do not control (async mode: every record crosses a transport). Signed records,
    checks of what a sampler claims, trust and quarantine, a divergence bound
    (``verl_ext.trust.signing``, ``verl_ext.trust.ledger``, ``verl_ext.trust.verifier``;
    docs/reliability.md, "Samplers you do not control")."""

    sign_records: bool = option(True, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Every sampler signs its records (Ed25519, a key made where it runs); the learner accepts
    only records of enrolled, unrevoked samplers (refused: hetero/rejected/{unsigned,
    unenrolled, revoked, bad_signature, sampler_mismatch}). The learner enrols the samplers it
    launches; others through ``enrolment_file``."""
    enrolment_file: str = option("", honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """sign_records: a JSON enrolment file of samplers outside the learner's Ray job (remote
    samplers, ``python -m verl_ext.trust.signing enrol``), re-read when it changes; "" = none."""
    verify_fraction: float = option(0.1, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Fraction of groups whose log-probs q the learner re-scores under the weights of the version
    the sampler claims (a seeded draw per group); 0 = none. Every group on probation is checked.
    Cost: one forward pass per re-scored group (SmolLM2-135M: 2.1% of the learner's training CPU
    at 0.1; a sampler that turns liar after its probation gets 9 lying groups in on average before
    it is caught; docs/reliability.md)."""
    probation_groups: int = option(4, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """A sampler's first this-many checks are made on every group it sends."""
    logprob_tolerance: float = option(1e-3, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Largest |log q reported - log q re-scored| over a checked group's tokens that passes. The
    default is 9x the largest honest difference measured on the CPU engine (1.1e-4 over 320
    groups, docs/reliability.md); a sampler on other kernels (vLLM, bf16) needs its own measurement."""
    check_rewards: bool = option(True, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Recompute every group's rewards (and, for group-local estimators such as grpo, its
    advantages; for bnpo, whose advantages depend on the sampler's whole batch, their proportions)
    from its tokens and the learner's own copy of the prompt's answer; a mismatch, or a prompt the
    learner's task does not have, fails the check."""
    trust_penalty: float = option(1.0, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Trust (1 at the start) lost per failed check."""
    trust_recovery: float = option(0.05, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Trust regained per passed check (capped at 1)."""
    quarantine_below: float = option(0.5, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Below this trust a sampler is quarantined for the rest of the run: its later records are
    refused (hetero/rejected/quarantined) and its groups accepted since its last passed check are
    dropped from the buffer (hetero/dropped/quarantined). Defaults: one failed check quarantines."""
    max_divergence: float = option(0.0, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """A per-sampler bound set by measurement (0 = off), in the units of the ``is/kl_sampler_learner``
    metric: each consumed group's KL(sampler || learner) is estimated as that metric estimates a
    batch's (k3 per token, token-mean per sequence, mean over the group's sequences; measured in
    the learner's step), and while the mean over a sampler's last ``divergence_window`` groups is
    above the bound, that sampler's groups are refused (hetero/rejected/divergent). Beside
    max_delay: a slow-but-close sampler keeps contributing, a fast-but-divergent one does not."""
    divergence_window: int = option(8, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Consumed groups per sampler the divergence bound averages over."""
    checkable_sampling: bool = option(False, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Samplers draw each group by seeded Gumbel-max (``verl_ext.trust.gumbel``), its seed in the
    signed record; each group the learner re-scores (``verify_fraction``, probation) also has its
    tokens re-derived from the same forward's logits and that noise: a token further below the
    noised best than its declared precision's near-tie margin refuses the group (token_mismatch,
    a failed check), so a sampler drawing from other weights, another temperature or a truncated
    distribution is caught even when its q matches its tokens. A group without a seed is refused
    (unseeded, without blame). Cost: the noise, V Philox draws a token (SmolLM2-135M on the CPU:
    +9% on each re-score; the sampler's draw about as fast as ordinary sampling; docs/reliability.md)."""
    check_process: bool = option(True, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Where the checks (re-scoring, token check, rewards) run. true: in a checker process of their
    own on the learner's node (``recipe.gepo.embedded.checker``), on the system cores
    (``hetero.system_cpus``: by default the cores not in ``hetero.learner_cpus``) at nice 10, with
    its own copy of the policy; a group awaits its verdict out of the buffer (counted against its
    sampler's quota). false: in the learner process's poll thread, where they take the learner's
    core from training; the learner then holds the model copy. Either way no group is admitted
    before its checks ran. While the learner waits for groups (its core idle), a group due only
    its rewards check is judged in the learner at once, and the learner's cores are lent to the
    checker while it waits on verdicts (``perf/learner_verdict_block_s_total``); re-scores run
    only in the checker. Measured on the toy (``python -m research.bench.bench_async --steps 40
    --delays 0 --compare-trust 5``, docs/reliability.md "Where the checks run"), two comparisons:
    async wall per second of training CPU +0.5% and +4.2% over protections off with true, +8.1%
    and +10.4% with false; the learner's own cost (poll-thread CPU and waits on verdicts per second
    of train_step) +4.1% and +3.5% with true, +9.3% and +8.9% with false. The liar soak kept its
    liars out and its honest groups in with either."""

    bounds_file: str = option("", honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """A calibration of bf16's bounds on the run's own model (``python -m recipe.gepo.calibrate``
    writes it: honest bf16 groups re-scored as the gate re-scores them, bounds from their spread:
    ``verl_ext.trust.bounds.calibrate``) in place of the table's, which come from
    SmolLM2-135M's spread and are too wide to catch small lies on a model whose bf16 arithmetic
    moves log q less, and may be too narrow for one that moves it more. Used for every group held
    to bf16's bounds (a sampler declaring bf16, or any sampler when ``hetero.sampler_precision=bf16``),
    near-tie margin of the token check included; a calibration measured with checkable sampling on
    also sets a near-tie test (a sampler whose tokens are near ties more often than honest bf16
    arithmetic makes them fails: tokens from slightly other weights). Read at start; refused at start
    when unreadable or when it was measured for another model, scorer precision or temperature.
    "" = the table's."""

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
        if self.bounds_file:
            from verl_ext.trust.bounds import read_bounds_file

            self._calibration = read_bounds_file(self.bounds_file)

    def bounds(self):
        """The run's :class:`~verl_ext.trust.bounds.TrustBounds`: the table, ``logprob_tolerance``
        as fp32's bound on one token, ``bounds_file``'s calibration in place of the table's bf16."""
        from verl_ext.trust.bounds import TrustBounds

        calibration = getattr(self, "_calibration", None)
        return TrustBounds(self.logprob_tolerance, dict(calibration[0]) if calibration else {})

    def check_calibration(self, model: str, scorer_precision: str, temperature: float) -> None:
        """Refuse a ``bounds_file`` measured for another model, scorer precision or temperature
        than the run's (ValueError naming the key, the fact and both values)."""
        calibration = getattr(self, "_calibration", None)
        if not calibration:
            return
        measured = calibration[1]
        for fact, run in (("model", model), ("scorer_precision", scorer_precision), ("temperature", temperature)):
            if measured[fact] != run:
                raise ValueError(
                    f"hetero.trust.bounds_file={self.bounds_file!r} was measured with {fact}={measured[fact]!r}; "
                    f"this run has {run!r} (python -m recipe.gepo.calibrate with the run's overrides measures it)"
                )

    def ledger(self, seed: int):
        """The run's :class:`~verl_ext.hetero.trust.TrustLedger`."""
        from verl_ext.trust.ledger import TrustLedger

        return TrustLedger(seed=seed, **self._ledger_arguments())
