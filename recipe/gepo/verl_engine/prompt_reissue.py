"""Prompts given back: a group that went stale before the learner could train it returns its prompt
to the sampler pools (``hetero.reissue_stale_prompts``), so the prompts that slow pools and long
answers make stale are not dropped from training, and the data does not drift towards easy, fast
prompts. The learner writes ``reissue/<pool>.<group uid>`` (:class:`verl_ext.hetero.protocol.Reissue`)
for the pool that filled the most slots; that pool puts the prompt first in its next batch
(recipe/gepo/pool.py). A prompt given back that many times and still stale is reported as never
admitted (``pool/prompts_never_admitted``).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from typing import Any, Iterable

from .pool_groups import group_prompt
from verl_ext.hetero.protocol import REISSUE_TOPIC, Reissue
from verl_ext.hetero.transport import Transport


class StalePrompts:
    """The learner's books of stale prompts: which went stale, which were trained, how often each
    was given back, and who fills slots. Thread-safe; :meth:`dropped` is cheap (the buffer calls it
    under its lock), :meth:`give_back` writes to the exchange.

    Args:
        limit: times a prompt is given back (0: never; stale prompts are only counted).
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        self._lock = threading.Lock()
        self._pending: deque[Any] = deque()  # stale groups not yet handled
        self._tries: dict[tuple[int, ...], int] = {}  # prompt -> times it went stale (past limit: given up)
        self._stale: set[tuple[int, ...]] = set()
        self._trained: set[tuple[int, ...]] = set()
        self._fills: Counter[str] = Counter()  # pool -> slots it filled
        self.given_back = 0

    @classmethod
    def of(cls, hetero: Any) -> "StalePrompts":
        """The books for a run's ``hetero`` section (``HeteroConfig``): its ``reissue_stale_prompts``."""
        return cls(hetero.reissue_stale_prompts)

    def dropped(self, group: Any) -> None:
        """The buffer dropped ``group`` as stale (``RolloutBuffer.on_stale``)."""
        self._pending.append(group)

    def filled(self, pool: str) -> None:
        with self._lock:
            self._fills[pool] += 1

    def trained(self, prompts: Iterable[tuple[int, ...]]) -> None:
        with self._lock:
            self._trained.update(prompts)

    def give_back(self, transport: Transport, quarantined: Iterable[str] = ()) -> int:
        """Write a re-issue for each prompt of the stale groups since the last call, unless it was
        trained meanwhile or already given back ``limit`` times; to the pool with the most filled
        slots that is not ``quarantined`` (else to the group's own pool). Returns how many."""
        written = 0
        while self._pending:
            group = self._pending.popleft()
            prompt = group_prompt(group)
            with self._lock:
                self._stale.add(prompt)
                if prompt in self._trained:
                    continue
                tries = self._tries.get(prompt, 0)
                self._tries[prompt] = tries + 1
                if tries >= self.limit:
                    continue  # given up: never admitted, unless a group of it is trained later
                barred = set(quarantined)
                fills = [(n, pool) for pool, n in self._fills.items() if pool not in barred]
            target = max(fills)[1] if fills else str(group.sampler_id)
            record = Reissue(prompt_ids=list(prompt), tries=tries + 1)
            transport.put(REISSUE_TOPIC, f"{target}.{group.group_uid}", record.to_bytes())
            written += 1
        self.given_back += written
        return written

    def metrics(self) -> dict[str, float]:
        """``pool/prompts_*``: distinct prompts trained, gone stale, and gone stale but trained later
        this run; re-issues written; prompts still stale after ``limit`` re-issues and never trained."""
        with self._lock:
            given_up = {p for p, tries in self._tries.items() if tries > self.limit}
            return {
                "pool/prompts_trained": float(len(self._trained)),
                "pool/prompts_dropped_stale": float(len(self._stale)),
                "pool/prompts_stale_then_trained": float(len(self._stale & self._trained)),
                "pool/prompts_reissued": float(self.given_back),
                "pool/prompts_never_admitted": float(len(given_up - self._trained)),
            }
