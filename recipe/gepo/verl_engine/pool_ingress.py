"""The verl engine's learner side of remote sampler pools (``hetero.transport=fs``).

:class:`PoolAgentLoopManager` takes verl's place as the trainer's agent loop manager
(``actor_rollout_ref.rollout.agent.agent_loop_manager_class``): the trainer's training prompts
become slots that :class:`PoolIngress` (a Ray actor in the learner's cluster) fills with groups
the pools sent through the exchange, after the trust package's checks (signature, enrolment,
replay, the learner's own rewards, a sampled re-score of q) and the exact staleness bound; validation prompts go to
verl's local replica. :class:`ExchangePublisher` publishes every weight version the trainer syncs
to the exchange (bf16 / XOR deltas, SHA-256, ``hetero.weights_bf16`` / ``weight_sync``) from the
actor's rank 0 in a background thread. Trained groups are deleted from the exchange only once a
checkpoint that holds them can no longer be resumed past (:meth:`PoolIngress.checkpoint`), so a
learner that crashes reads the rest again. The pool program is ``recipe/gepo/pool.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import queue
import threading
import time
from pathlib import Path
from typing import Any, Optional

import ray
from tensordict import NonTensorData, NonTensorStack
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

from ..sections import HeteroConfig
from .pool_groups import chat_prompt_ids, group_prompt, trajectory_fields
from .prompt_reissue import StalePrompts
from verl_ext.hetero.buffer import CONSUMED, BufferTimeout, RolloutBuffer
from verl_ext.hetero.exchange import RolloutInbox
from verl_ext.hetero.protocol import (
    REISSUE_TOPIC,
    ROLLOUT_TOPIC,
    LearnerStatus,
    TransportSpec,
    clear_stop,
    clear_topic,
    publish_status,
)
from verl_ext.hetero.records import RecordSpec
from verl_ext.hetero.weights import WeightStore
from verl_ext.rundir import append_event, describe_event, truncate_metrics, write_text_atomically

INGRESS_NAME = "heterorl_pool_ingress"
STATE_FILE = "pool_ingress.json"
"""In each checkpoint folder: the uids of the groups trained up to it (never admitted again)."""
AUDIT_FILE = "pool_trained.jsonl"
"""In the run directory: which pool groups each step trained (:meth:`PoolIngress.mark_trained`)."""


class PoolPrompts:
    """The learner's own copy of the training prompts (``data.train_files``), tokenized as verl's
    agent loop does: the answer the trust verifier recomputes rewards against
    (:class:`~verl_ext.trust.verifier.RewardTask`, keyed by the prompt's text) and the row's data
    fields (keyed by its token ids). A pool cannot name the answer it is scored against."""

    def __init__(self, train_files: Any, tokenizer: Any, prompt_key: str = "prompt"):
        import pandas as pd

        files = [train_files] if isinstance(train_files, str) else list(train_files)
        self.source_files = [str(f) for f in files]
        frame = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
        self.by_text: dict[str, dict] = {}
        self.by_ids: dict[tuple[int, ...], dict] = {}
        for record in frame.to_dict("records"):
            ids = chat_prompt_ids(tokenizer, record[prompt_key])
            text = tokenizer.decode(ids, skip_special_tokens=False)
            bos = tokenizer.bos_token
            if bos and text.startswith(bos) and ids and ids[0] == tokenizer.bos_token_id:
                text = text[len(bos) :]  # as GroupVerifier decodes a group's prompt
            self.by_text[text] = self.by_ids[tuple(ids)] = {k: v for k, v in record.items() if k != prompt_key}

    def __len__(self) -> int:
        return len(self.by_ids)

    def answer_for(self, prompt: str) -> Optional[str]:
        row = self.by_text.get(prompt)
        return None if row is None else str(row["reward_model"]["ground_truth"])

    def score(self, response: str, item: dict) -> float:
        from verl_ext.rewards.dispatch import compute_score

        row = self.by_text[item["prompt"]]
        result = compute_score(row["data_source"], response, item["answer"], row.get("extra_info"))
        return float(result["score"] if isinstance(result, dict) else result)

    def data_fields(self, prompt_ids: Any) -> dict:
        """The dataset row of these prompt token ids ({} when the prompt is not the learner's)."""
        return dict(self.by_ids.get(tuple(int(t) for t in prompt_ids), {}))


def pool_precision(config: Any) -> Optional[str]:
    """The precision pools compute q in: their rollout servers' dtype (``actor_rollout_ref.rollout.dtype``)."""
    from .pool_groups import PRECISION_OF_DTYPE

    return PRECISION_OF_DTYPE.get(str(config.actor_rollout_ref.rollout.dtype))


def load_scorer(model_path: str) -> Any:
    """The re-scoring model: the policy's architecture from ``model_path`` in fp32 on the CPU, its
    weights replaced per claimed version by those the learner published (HF names, as pools load)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # the ingress shares the learner's node: one core's worth at most
    scorer = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    return scorer.eval()


def admission(
    hetero: HeteroConfig, config: Any, tokenizer: Any, prompts: PoolPrompts, scorer: Any = None
) -> tuple[RolloutBuffer, Any]:
    """The buffer (exact staleness bound, ``hetero.order``, per-pool quota
    ``hetero.max_buffered_per_sampler``) and the trust gate in front of it: signatures of
    enrolled keys, replays, with ``hetero.trust.check_rewards`` every group's rewards recomputed
    against the learner's own answers (:class:`PoolPrompts`), and with a ``scorer``
    (:func:`load_scorer`) q re-scored on probation and ``hetero.trust.verify_fraction`` of groups
    under the version each claims (its weights handed over by :meth:`PoolIngress.published`); no
    scorer: ``verify_fraction`` 0. No advantage check: the learner computes its own advantages."""
    from verl_ext.trust import build_gate, build_verifier

    rollout = config.actor_rollout_ref.rollout
    spec = RecordSpec(
        group_size=int(rollout.n),
        vocab_size=len(tokenizer),
        max_prompt_length=int(config.data.max_prompt_length),
        max_response_length=int(config.data.max_response_length),
    )
    quota = hetero.max_buffered_per_sampler or (hetero.max_delay + 1) * int(config.data.train_batch_size)
    buffer = RolloutBuffer(hetero.max_delay, "drop", hetero.order, spec=spec, sampler_capacity=quota)
    trust = hetero.trust if scorer is not None else dataclasses.replace(hetero.trust, verify_fraction=0.0)
    verifier = None
    if trust.check_rewards or trust.verify_fraction > 0:
        no_advantages = {"adv_estimator": "computed_by_the_learner"}
        verifier = build_verifier(
            trust,
            tokenizer,
            prompts,
            float(rollout.temperature),
            no_advantages,
            keep_versions=hetero.max_delay + 1,  # every version a group inside the bound can claim
            scorer=scorer,
        )
    # the precision the pools' servers run in, and any a calibration names: a pool cannot widen its bounds
    precisions = tuple(sorted({p for p in (pool_precision(config), *trust.bounds().calibrated) if p}))
    return buffer, build_gate(trust, buffer, verifier, precisions=precisions or None)


def fetch_published(transport: Any, version: int, sha256: str) -> bytes:
    """The full message of weight ``version`` from the exchange, held to the SHA-256 the learner
    published it with (anyone who can write to the exchange could have replaced it). ValueError
    when absent or different."""
    import hashlib

    from verl_ext.hetero.protocol import WEIGHTS_TOPIC, version_key

    try:
        message = transport.get(WEIGHTS_TOPIC, version_key(int(version)))
    except KeyError:
        raise ValueError(f"weight version {version} is not on the exchange (pruned already?)") from None
    found = hashlib.sha256(message).hexdigest()
    if found != sha256:
        raise ValueError(
            f"weight version {version} on the exchange has SHA-256 {found[:16]}..., published {sha256[:16]}..."
        )
    return message


def reopen_restored_slots(tq: Any, partition: str = "train") -> int:
    """verl restores the slots filled before its checkpoint as finished, and would train their
    groups from its own copy, unseen by the ingress (no audit; and read again from the exchange,
    where they stay until trained, trained twice). They become pending: verl issues them again
    (``_reissue_inflight_prompts``) and the ingress fills them from the exchange. Returns how many."""
    items = (tq.kv_list(partition) or {}).get(partition, {})
    keys = [k for k, tag in items.items() if tag.get("is_prompt") and tag.get("status") in ("finished", "failure")]
    if keys:
        tq.kv_batch_put(keys=keys, partition_id=partition, tags=[{**items[k], "status": "pending"} for k in keys])
    return len(keys)


class RefusalNotes:
    """The first refusal of each (pool, reason) as one line for the learner's log: a pool that is
    not enrolled, runs another model or sends another run's groups is named once, not per group
    (every refusal still counts in ``hetero/rejected/<reason>``)."""

    def __init__(self):
        self.pending: "collections.deque[Any]" = collections.deque()  # RolloutBuffer.on_reject appends
        self.named: set[tuple[str, str]] = set()

    def lines(self) -> list[str]:
        out = []
        while self.pending:
            err = self.pending.popleft()
            key = (str(err.sampler_id), str(err.reason))
            if key not in self.named:
                self.named.add(key)
                out.append(f"refused {key[0]}'s groups ({key[1]}; its next ones are only counted): {err}")
        return out


def report_trust(refusals: RefusalNotes, gate: Any, run_dir: Path, version: int) -> list[str]:
    """The learner's log lines for the first refusal of each kind per pool and for each trust event
    (a pool quarantined, over its divergence bound); the events also go to the run's events.jsonl,
    as in the embedded engine."""
    lines = refusals.lines()
    for event in gate.drain_events():
        append_event(run_dir, {"step": int(version), **event})
        lines.append(f"version {version}: {describe_event(event)}")
    return lines


def next_poll_wait(current_s: float, busy: bool, fastest_s: float, slowest_s: float) -> float:
    """The wait before the next read of the exchange: the fastest after a read that found or filled
    something, else twice the last, up to ``slowest_s`` (an idle exchange is not listed 20 times a second)."""
    return fastest_s if busy else min(2 * current_s, slowest_s)


@ray.remote(num_cpus=0)
class PoolIngress:
    """Groups from the exchange into the trainer's prompt slots, one thread (the only
    TransferQueue client of its process). See the module docstring."""

    POLL_S = 0.05
    IDLE_POLL_S = 1.0
    """The longest wait between two reads of an idle exchange (each read lists it: on S3 a request)."""
    STATUS_REFRESH_S = 5.0
    """The learner's status is rewritten at least this often; pools pause when it is overdue."""

    def __init__(self, config: Any):
        import transfer_queue as tq
        from verl.utils import hf_tokenizer

        self.tq = tq
        tq.init()
        self.hetero = hetero = HeteroConfig.from_omegaconf(config.hetero)
        self.transport = TransportSpec("fsspec", url=hetero.exchange_url(config.trainer.default_local_dir)).open()
        self.audit_file = Path(config.trainer.default_local_dir) / AUDIT_FILE
        self.audit_file.parent.mkdir(parents=True, exist_ok=True)
        tokenizer = hf_tokenizer(config.actor_rollout_ref.model.path)
        self.prompts = PoolPrompts(config.data.train_files, tokenizer, config.data.get("prompt_key", "prompt"))
        scorer = load_scorer(config.actor_rollout_ref.model.path) if hetero.trust.verify_fraction > 0 else None
        self.buffer, self.gate = admission(hetero, config, tokenizer, self.prompts, scorer)
        self.versions_fetched, self.version_errors = 0, 0
        self.watch = PoolWatch(hetero.wait_timeout_s)
        self.inbox = RolloutInbox(self.transport, self.buffer, enrolment=self.gate.enrolment, gate=self.gate)
        self._lock = threading.Lock()
        self._slots: list[dict] = []
        self._slot_group: dict[str, tuple[str, tuple[int, ...]]] = {}  # slot uid -> (group uid, its prompt)
        self._trained: set[str] = set()  # group uids trained (this run, resumes included)
        self._checkpointed: set[str] = set()  # those the last checkpoint holds
        self._version = 0
        self._stop = threading.Event()
        self._error: Optional[str] = None
        self.filled = 0
        self.stale_prompts = StalePrompts.of(hetero)  # given back to the pools
        self.buffer.on_stale = self.stale_prompts.dropped
        self.refusals = RefusalNotes()
        self._enrolment_error = ""
        self.buffer.on_reject = self.refusals.pending.append
        self._status: Optional[tuple[int, int]] = None  # (version, queue depth) last written
        self._status_at = 0.0
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self, resume_dir: Optional[str], learner_version: int) -> int:
        """Start reading; ``resume_dir``: the checkpoint folder the trainer resumed from (its
        trained uids are refused as replays), None on a fresh start (the exchange's old groups
        are dropped: they are another run's). Weight versions newer than ``learner_version`` are
        a crashed branch's: deleted, and groups claiming them not held against their pool.
        Returns how many trained uids it restored."""
        store = WeightStore(self.transport)
        lost = range(learner_version + 1, max(store.versions(), default=learner_version) + 1)
        store.delete_newer_than(learner_version)
        self.gate.lose_versions(lost)
        self._version = int(learner_version)
        restored = 0
        if resume_dir is not None:  # the steps after the checkpoint are trained again
            truncate_metrics(self.audit_file, learner_version)
            reopen_restored_slots(self.tq)
        elif self.audit_file.exists():  # a fresh start in a used run directory
            self.audit_file.rename(self.audit_file.with_suffix(f".{int(time.time())}.jsonl"))
        if resume_dir is not None and (Path(resume_dir) / STATE_FILE).is_file():
            state = json.loads((Path(resume_dir) / STATE_FILE).read_text())
            self._trained = set(state["trained"])
            self._checkpointed = set(self._trained)
            for uid in self._trained:
                self.buffer.ledger.mark(uid, CONSUMED)
            if "trust" in state:
                self.gate.load_state_dict(state["trust"])
            restored = len(state["trained"])
        elif resume_dir is None:
            clear_topic(self.transport, ROLLOUT_TOPIC)
            clear_topic(self.transport, REISSUE_TOPIC)
        clear_stop(self.transport)  # a previous run's marker is not for this one
        self.gate.reload_enrolment()
        self._thread.start()
        return restored

    # ---- called by the trainer ------------------------------------------------------------
    def add_slots(self, prompts: list[dict]) -> None:
        with self._lock:
            self._slots.extend(prompts)

    def set_learner_version(self, version: int) -> None:
        self._version = max(self._version, int(version))

    def published(self, version: int, sha256: str) -> None:
        """The learner published weight ``version`` with this SHA-256 (its actor's rank 0, once the
        write is done): read it back for the re-scores of groups that claim it (``verify_fraction``).
        A version that cannot be read so is not held: groups drawn for a check of it are refused
        without blame (``unverifiable_version``)."""
        if not self.gate.rescoring:
            return
        try:
            self.gate.remember(int(version), fetch_published(self.transport, version, sha256))
            self.versions_fetched += 1
        except ValueError as err:
            self.version_errors += 1
            print(f"[pool ingress] not re-scoring against version {version}: {err}", flush=True)

    def mark_trained(self, step: int, slot_uids: list[str]) -> list[str]:
        """The groups in these slots were trained at ``step``: remembered for the next checkpoint,
        and appended to ``<run dir>/pool_trained.jsonl`` (``{"step": s, "groups": [uid, ...]}``,
        the audit that no group is trained twice). Returns their uids."""
        with self._lock:
            missing = [slot for slot in slot_uids if slot not in self._slot_group]
            filled = [self._slot_group.pop(slot) for slot in slot_uids if slot in self._slot_group]
            groups = [group for group, _ in filled]
            self._trained.update(groups)
        if missing:  # the audit would miss them (after a resume verl's restored slots are refilled: never seen since)
            print(f"[pool ingress] step {step}: {len(missing)} of {len(slot_uids)} trained slots hold no "
                  f"group this ingress filled, e.g. {missing[:2]}", flush=True)  # fmt: skip
        self.stale_prompts.trained(prompt for _, prompt in filled)
        with self.audit_file.open("a") as f:
            f.write(json.dumps({"step": int(step), "groups": sorted(groups)}) + "\n")
        return groups

    def checkpoint(self, folder: str) -> int:
        """Write the uids trained so far into the checkpoint ``folder``, then delete from the
        exchange the groups the previous checkpoint held: a resume may still start from that one
        until this step's metrics line is written (``MetricsTee``), never from an older one.
        Returns how many were deleted."""
        with self._lock:
            trained = sorted(self._trained)
        state = {"trained": trained, "trust": self.gate.state_dict()}
        path = Path(folder) / STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(state, default=_jsonable))
        done, self._checkpointed = self._checkpointed, set(trained)
        keys = [k for k in self.transport.keys(ROLLOUT_TOPIC) if k in done]
        self.transport.delete_many(ROLLOUT_TOPIC, keys)
        return len(keys)

    def health(self) -> None:
        """Raise what stops the learner: the reading thread's error, or no pool group for
        ``hetero.wait_timeout_s`` while training prompts wait (the trainer asks while it waits)."""
        if self._error is not None:
            raise RuntimeError(f"the pool ingress stopped: {self._error}")

    def metrics(self) -> dict[str, float]:
        self.health()
        out = {**self.inbox.metrics(), **self.gate.metrics()}  # hetero/inbox_*, trust/*: the embedded engine's names
        # the buffer's drops, refusals and totals; staleness is the trainer's, over the batch it trained on
        skip = ("hetero/staleness", "hetero/wait_s", "hetero/expected")
        out.update({k: v for k, v in self.buffer.metrics(reset=True).items() if not k.startswith(skip)})
        out["pool/buffered"] = float(len(self.buffer))
        out["pool/slots_waiting"] = float(len(self._slots))
        out["pool/groups_filled"] = float(self.filled)
        out["pool/versions_fetched"] = float(self.versions_fetched)  # for re-scoring, digest-checked
        out["pool/version_fetch_errors"] = float(self.version_errors)
        out.update(self.stale_prompts.metrics())
        return out

    def stop(self) -> None:
        self._stop.set()

    # ---- the thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            wait_s = self.POLL_S
            while not self._stop.is_set():
                with self._lock:
                    # the learner waits while its slots are unfilled: withheld groups are vouched for
                    # sooner then (TrustGate.WAITING_FRACTION), as in the embedded engine's take()
                    self.buffer.set_demand(len(self._slots))
                self._reload_enrolment()
                busy = self.inbox.poll() > 0
                self._report()
                self.stale_prompts.give_back(self.transport, self._quarantined())
                self._publish_status()
                while self._slots and not self._stop.is_set():
                    try:
                        (group,) = self.buffer.take(1, self._version, timeout_s=self.POLL_S)
                    except BufferTimeout:
                        break
                    with self._lock:
                        slot = self._slots.pop(0)
                    self._fill(slot, group)
                    busy = True
                with self._lock:
                    waiting = len(self._slots)
                starved = self.watch.tick(waiting, time.monotonic(), self._quarantined())
                if starved is not None and self._error is None:
                    self._error = starved  # the trainer stops with it (health(), metrics()); reading goes on
                wait_s = next_poll_wait(wait_s, busy, self.POLL_S, self.IDLE_POLL_S)
                self._stop.wait(wait_s)
        except Exception as err:  # surfaced by metrics(), which the trainer calls every step
            self._error = f"{type(err).__name__}: {err}"
            raise

    def _reload_enrolment(self) -> None:
        """``hetero.trust.enrolment_file`` again when it changed (a stat): pools enrolled while the
        learner runs are let in. A file that does not parse (an edit gone wrong) is named once and
        the enrolment so far stands."""
        try:
            self.gate.reload_enrolment()
        except ValueError as err:
            if str(err) != self._enrolment_error:
                self._enrolment_error = str(err)
                print(f"[pool ingress] keeping the enrolment read before: {err}", flush=True)

    def _report(self) -> None:
        for line in report_trust(self.refusals, self.gate, self.audit_file.parent, self._version):
            print(f"[pool ingress] {line}", flush=True)

    def _quarantined(self) -> list[str]:
        return [p for p, books in self.gate.ledger.samplers.items() if books.quarantined_at is not None]

    def _publish_status(self) -> None:
        """Back-pressure (``hetero.max_queued_groups``): the learner's queue depth, which pools read
        before each batch; written when it changes."""
        if self.hetero.max_queued_groups <= 0:
            return
        # takeable groups only: withheld ones wait for a later group's check (hold_unchecked), and
        # pools that paused on them would never send it. Rewritten at least every STATUS_REFRESH_S:
        # pools pause when it is overdue (the learner crashed), instead of filling the exchange
        now = time.time()
        state = (int(self._version), self.buffer.takeable())
        if state != self._status or now - self._status_at >= self.STATUS_REFRESH_S:
            status = LearnerStatus(*state, refresh_s=self.STATUS_REFRESH_S, written_at=now)
            publish_status(self.transport, status)
            self._status, self._status_at = state, now

    def _fill(self, slot: dict, group: Any) -> None:
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        prompt = group_prompt(group)
        keys, fields, tags = trajectory_fields(group, slot, self.prompts.data_fields(prompt))
        self.tq.kv_batch_put(keys=keys, fields=list_of_dict_to_tensordict(fields), tags=tags, partition_id="train")
        self.tq.kv_put(key=slot["uid"], partition_id="train", tag={"status": "finished"})
        with self._lock:
            self._slot_group[slot["uid"]] = (group.group_uid, prompt)
        self.stale_prompts.filled(str(group.sampler_id))
        self.filled += 1
        self.watch.filled(str(group.sampler_id), time.monotonic())


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def unpack_rows(batch: Any) -> list[dict]:
    """The rows of the trainer's prompt batch (a TensorDict) as dicts, as ``AgentLoopWorkerTQ``
    unpacks them."""
    import torch

    rows = []
    for i in range(len(batch)):
        row = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                row[key] = value[i]
            elif isinstance(value, NonTensorStack):
                row[key] = value[i].data
            elif isinstance(value, NonTensorData):
                row[key] = value.data
        rows.append(row)
    return rows


class PoolAgentLoopManager(AgentLoopManagerTQ):
    """verl's agent loop manager whose training prompts are filled from the pools (see the
    module docstring); validation runs on verl's own replica as before."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.ingress = ray.get_actor(INGRESS_NAME)  # the trainer's (HeteroSeparateAsyncTrainer.on_init_end)

    def generate_sequences(self, prompts) -> None:
        validate = prompts["validate"] if "validate" in prompts.keys() else False
        if bool(getattr(validate, "data", validate)):  # evaluation: verl's own replica, newest weights
            return super().generate_sequences(prompts)
        ray.get(self.ingress.add_slots.remote(unpack_rows(prompts)))


class BackgroundPublisher:
    """Publishes versions to the exchange's weight store in one background thread, in the order
    submitted; :meth:`submit` returns at once unless the previous version is still being
    written (then it waits: at most one version queued). A failed write raises at the next
    :meth:`submit` or :meth:`flush`."""

    def __init__(self, url: str, options: dict, on_published: Optional[Any] = None):
        """``on_published(version, sha256)``: called in the thread after each version is written."""
        self.store = WeightStore(TransportSpec("fsspec", url=url).open(), **options)
        self.on_published = on_published
        self._queue: "queue.Queue[tuple[int, dict] | None]" = queue.Queue(maxsize=1)
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is not None and self._error is None:
                    self.store.publish(*item)
                    if self.on_published is not None:
                        self.on_published(item[0], self.store.published_sha256(item[0]))
            except BaseException as err:  # raised in the caller's thread
                self._error = err
            finally:
                self._queue.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"publishing weights to the exchange failed: {self._error}") from self._error

    def submit(self, version: int, state: dict) -> None:
        self._raise()
        self._queue.put((version, state))

    def flush(self) -> None:
        self._queue.join()
        self._raise()


class PoolWatch:
    """How long training prompts have waited with no pool group to fill them, and who was heard
    from: after ``timeout_s`` (``hetero.wait_timeout_s``) of it, :meth:`tick` returns the error the
    learner stops with. A pool that dies costs the learner nothing while others fill its slots."""

    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self.waiting_since: Optional[float] = None
        self.last_filled: dict[str, float] = {}  # pool id -> when a group of it last filled a slot

    def filled(self, pool: str, now: float) -> None:
        self.last_filled[pool] = now
        self.waiting_since = None

    def tick(self, waiting: int, now: float, quarantined: list[str] = ()) -> Optional[str]:
        """``waiting``: training prompts with no group; the timeout's message, or None."""
        if not waiting:
            self.waiting_since = None
            return None
        if self.waiting_since is None:
            self.waiting_since = now
        if now - self.waiting_since < self.timeout_s:
            return None
        heard = ", ".join(f"{p} {now - t:.0f} s ago" for p, t in sorted(self.last_filled.items())) or "none"
        banned = f"; quarantined: {', '.join(sorted(quarantined))}" if quarantined else ""
        return (
            f"no pool group admitted for {now - self.waiting_since:.0f} s while {waiting} training prompts wait "
            f"(hetero.wait_timeout_s={self.timeout_s:g}); last group from each pool: {heard}{banned}. Start a pool "
            '(python -m recipe.gepo.pool, README "Samplers in another data centre"), check the exchange URL, '
            "or raise hetero.wait_timeout_s"
        )


class IngressTeller:
    """From the publishing rank (``BackgroundPublisher.on_published``): tells the ingress each
    version it may read back for its re-scores (:meth:`PoolIngress.published`; not waited for),
    in order. Versions published before the ingress exists (the trainer's first sync) are told
    once it does, before the next one."""

    def __init__(self):
        self.untold: list[tuple[int, str]] = []

    def __call__(self, version: int, sha256: Optional[str]) -> None:
        if sha256 is not None:
            self.untold.append((int(version), sha256))
        try:
            ingress = ray.get_actor(INGRESS_NAME)
        except ValueError:  # not started yet
            return
        for told in self.untold:
            ingress.published.remote(*told)
        self.untold.clear()


class ExchangePublisher:
    """The trainer's checkpoint manager, which also publishes each version it syncs to the
    exchange (from the actor's rank 0, in the background: :meth:`HeteroActorWorker.publish_weights`)
    and tells the ingress the learner's version."""

    def __init__(self, inner: Any, actor_wg: Any, hetero: HeteroConfig, url: str):
        self.inner, self.actor_wg, self.url, self.options = inner, actor_wg, url, hetero.weight_store_options()

    def update_weights(self, global_steps: int) -> dict[str, float]:
        start = time.perf_counter()
        self.actor_wg.publish_weights(self.url, int(global_steps), self.options)
        ray.get(ray.get_actor(INGRESS_NAME).set_learner_version.remote(int(global_steps)))
        metrics = dict(self.inner.update_weights(global_steps) or {})
        metrics["pool/publish_gather_s"] = time.perf_counter() - start
        return metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
