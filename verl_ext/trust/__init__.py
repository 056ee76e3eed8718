"""Trust in samplers you do not control: everything that decides whether a group is admitted.

- :mod:`.signing` -- Ed25519 keys, signed records and the enrolment of sampler keys;
- :mod:`.ledger` -- per-sampler trust, probation, the seeded draw of groups to re-score, quarantine;
- :mod:`.bounds` -- the per-precision bounds of a re-score, their calibration, the mismatch CUSUM;
- :mod:`.gumbel` -- checkable sampling: seeded Gumbel-max draws and the token check;
- :mod:`.assignment` -- the prompts and Gumbel seeds the learner assigns each sampler's slots;
- :mod:`.verifier` -- :class:`~.verifier.GroupVerifier`, re-deriving a group's rewards, q and tokens;
- :mod:`.gate` -- :class:`~.gate.TrustGate`, the books and the verdict on each arriving group.

Engine-neutral: no Ray and no engine imports. :func:`build_gate` is the one factory; the caller
supplies the config (``hetero.trust``), the buffer and, for checks in its own thread, the model.
Importing the package imports none of the modules.
"""

from __future__ import annotations

from typing import Any, Optional


def build_verifier(
    config: Any,
    tokenizer: Any,
    task: Any,
    temperature: float,
    algorithm_config: Any,
    keep_versions: int,
    scorer: Optional[Any] = None,
    bounds: Optional[Any] = None,
):
    """A :class:`~.verifier.GroupVerifier` for ``config`` (``hetero.trust``): ``scorer`` the model it
    re-scores with (None: rewards only), ``bounds`` the gate's (default: ``config.bounds()``)."""
    from .verifier import GroupVerifier

    return GroupVerifier(
        scorer,
        tokenizer,
        task,
        temperature,
        algorithm_config,
        keep_versions=keep_versions,
        bounds=bounds if bounds is not None else config.bounds(),
        check_rewards=config.check_rewards,
        checkable_sampling=config.checkable_sampling,
    )


def build_gate(
    config: Any,
    buffer: Any,
    verifier: Optional[Any] = None,
    secret: Optional[bytes] = None,
    precisions: Optional[tuple[str, ...]] = None,
):
    """The :class:`~.gate.TrustGate` for ``config`` (``hetero.trust``) in front of ``buffer``;
    ``verifier`` runs its checks in :meth:`~.gate.TrustGate.admit` (None: they run elsewhere,
    between :meth:`~.gate.TrustGate.begin` and :meth:`~.gate.TrustGate.finish`); ``secret``: the
    key of the draw of groups to re-score (None: a fresh random one); ``precisions``: the sampler
    precisions the run accepts (None: any known)."""
    from .gate import TrustGate

    return TrustGate(config, buffer, verifier, secret, precisions)
