"""``rollout.name=hf_cpu``: verl rollout replicas that generate with HF transformers (on the CPU, or
on the CUDA device of the replica's workers).

verl 0.9.1 ships rollouts for vLLM, SGLang and TensorRT-LLM only; this backend has the same three
parts, registered through verl's own registries: :class:`HFCPUReplica` (a ``RolloutReplica``: one
server actor per replica node, in hybrid, colocated and standalone modes); :class:`HFCPUServer` (a
Ray actor, no HTTP: token ids in, token ids + log-probs out, tagged with the weight version
generated from, ``extra_fields["global_steps"]``; concurrent requests batched into one
``generate``); :class:`HFCPUServerAdapter` (a ``BaseRollout`` in verl's worker that loads each
weight update into the server's model). The server's model lives on the device of the replica's
own workers, as verl's vLLM replica places its engine (:func:`worker_placement`): the CPU on the
``cpu`` platform; on ``cuda`` the server gets Ray's ``NOSET`` variable and the worker's
``CUDA_VISIBLE_DEVICES``, and a CUDA placement where no CUDA device is seen is refused when the
server starts (:func:`server_device`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from typing import Any, Generator, Optional

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator

from verl_ext.sampling import sample_continuations

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "hf_cpu"
BATCH_WINDOW_S = 0.005
"""How long the server waits after a request for others to batch with it."""


def server_name(replica_rank: int, node_rank: int, name_suffix: str = "") -> str:
    """Ray actor name of a replica's server (the adapter finds it by name, as vLLM's does)."""
    return f"{ROLLOUT_NAME}_server_{replica_rank}_{node_rank}{name_suffix}"


def worker_placement() -> dict[str, Any]:
    """Where the calling process (a replica's worker) computes, by verl's platform: ``device``
    (``cpu``, or ``cuda:<index>`` as this process numbers its devices), the name and value of its
    visible-devices variable, and the Ray variables that keep Ray from overwriting it."""
    from verl.plugin.platform import get_platform
    from verl.utils.device import get_device_id, get_device_name

    name = get_device_name()
    if name == "cpu":
        return {"device": "cpu", "visible_key": None, "visible_devices": None, "ray_noset": []}
    platform = get_platform()
    key = platform.visible_devices_envvar()
    return {
        "device": f"{name}:{int(get_device_id())}",
        "visible_key": key,
        "visible_devices": os.environ.get(key),
        "ray_noset": list(platform.ray_noset_envvars()),
    }


def server_device(
    device: str, visible_key: Optional[str] = None, visible_devices: Optional[str] = None
) -> torch.device:
    """The rollout server's device for ``device`` (:func:`worker_placement`'s): the CPU, or a CUDA
    device this process must see (``visible_devices``, the worker's, is made this process's
    ``visible_key`` first, before CUDA starts here). Anything else is refused, naming it."""
    kind = str(device).split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(
            f"rollout.name=hf_cpu: the replica's workers are on {device!r}; its server runs on cpu or cuda only"
        )
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if visible_key and visible_devices is not None:
        os.environ[visible_key] = visible_devices
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = 0 if dev.index is None else dev.index
    if index >= count:
        raise RuntimeError(
            f"rollout.name=hf_cpu: the replica's workers are on {device!r} but the rollout server's process sees "
            f"{count} CUDA device(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    return torch.device("cuda", index)


def state_checksum(named: dict[str, torch.Tensor]) -> str:
    """sha256 over names and bytes of a state dict (sorted by name): equal weights, equal digest."""
    digest = hashlib.sha256()
    for name in sorted(named):
        digest.update(name.encode())
        digest.update(named[name].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


class HFCPUServer:
    """One rollout server: a HF causal LM answering verl's token-in-token-out calls.

    Args:
        config: verl ``RolloutConfig`` (``response_length``, ``prompt_length``, ``dtype``,
            ``max_num_seqs``, ``seed``).
        model_config: verl ``HFModelConfig`` (``local_path``, ``tokenizer``).
        replica_rank, node_rank: this server's place (for the seed and the logs).
        device, visible_key, visible_devices: where the model goes (:func:`server_device`; the
            replica passes its workers' :func:`worker_placement`); ``cpu`` by default.
    """

    def __init__(
        self,
        config: Any,
        model_config: Any,
        replica_rank: int = 0,
        node_rank: int = 0,
        device: str = "cpu",
        visible_key: Optional[str] = None,
        visible_devices: Optional[str] = None,
        **_: Any,
    ):
        from transformers import AutoModelForCausalLM
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig, RolloutConfig

        config = omega_conf_to_dataclass(config, dataclass_type=RolloutConfig)
        model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.config, self.model_config = config, model_config
        self.replica_rank, self.node_rank = replica_rank, node_rank
        self.device = server_device(device, visible_key, visible_devices)  # before the model: refused early
        dtype = getattr(torch, str(config.dtype)) if isinstance(config.dtype, str) else config.dtype
        self.model = AutoModelForCausalLM.from_pretrained(
            model_config.local_path, dtype=dtype, attn_implementation="sdpa"
        ).eval()
        if self.device.type != "cpu":
            self.model.to(self.device)  # sample_continuations sends the prompts where the model is
        tokenizer = model_config.tokenizer
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        generation_eos = getattr(self.model.generation_config, "eos_token_id", None)
        for extra in generation_eos if isinstance(generation_eos, list) else [generation_eos]:
            if extra is not None and extra not in eos:
                eos.append(extra)
        if not eos:
            raise ValueError(f"model {model_config.local_path} has no EOS token id (tokenizer or generation_config)")
        self.eos_token_ids = eos
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        self.global_steps: Optional[int] = None
        self.weight_updates = 0
        self._queue: list[tuple[list[int], dict, asyncio.Future]] = []
        self._queue_event: Optional[asyncio.Event] = None
        self._worker: Optional[asyncio.Task] = None
        self._model_lock: Optional[asyncio.Lock] = None
        self._seed = int(getattr(config, "seed", 0) or 0) + 1000 * replica_rank + node_rank
        torch.manual_seed(self._seed)

    # ---- generation ----------------------------------------------------------------------------
    def _max_new_tokens(self, prompt_len: int, sampling_params: dict) -> int:
        budget = self.config.prompt_length + self.config.response_length - prompt_len
        wanted = sampling_params.pop("max_tokens", sampling_params.pop("max_new_tokens", self.config.response_length))
        return max(1, min(int(wanted), int(self.config.response_length), budget))

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **kwargs: Any
    ) -> TokenOutput:
        """Sample one continuation of ``prompt_ids`` (verl's ``generate`` contract)."""
        if kwargs.get("image_data") or kwargs.get("video_data") or kwargs.get("audio_data"):
            raise NotImplementedError("rollout.name=hf_cpu generates text only (multimodal input given)")
        params = dict(sampling_params)
        params["max_new_tokens"] = self._max_new_tokens(len(prompt_ids), params)
        if self._worker is None:
            self._queue_event, self._model_lock = asyncio.Event(), asyncio.Lock()
            self._worker = asyncio.get_running_loop().create_task(self._serve())
        future = asyncio.get_running_loop().create_future()
        self._queue.append((list(prompt_ids), params, future))
        self._queue_event.set()
        return await future

    @staticmethod
    def _batch_key(params: dict) -> tuple:
        return (
            params["max_new_tokens"],
            float(params.get("temperature", 1.0)),
            float(params.get("top_p", 1.0)),
            int(params.get("top_k", -1)),
            bool(params.get("logprobs", False)),
        )

    async def _serve(self) -> None:
        """Collect requests for a moment, then generate every batch of equal sampling settings."""
        while True:
            await self._queue_event.wait()
            await asyncio.sleep(BATCH_WINDOW_S)
            pending, self._queue = self._queue, []
            self._queue_event.clear()
            batches: dict[tuple, list] = {}
            for item in pending:
                try:
                    key = self._batch_key(item[1])
                except Exception as exc:  # a malformed request fails alone; the loop keeps serving
                    item[2].set_exception(exc)
                    continue
                batches.setdefault(key, []).append(item)
            for key, items in batches.items():
                limit = max(1, int(self.config.max_num_seqs))
                for start in range(0, len(items), limit):
                    await self._run_batch(key, items[start : start + limit])

    async def _run_batch(self, key: tuple, items: list) -> None:
        max_new, temperature, top_p, top_k, want_log_probs = key
        try:
            async with self._model_lock:
                steps = self.global_steps
                outs = await asyncio.to_thread(
                    sample_continuations,
                    self.model,
                    [p for p, _, _ in items],
                    max_new,
                    self.eos_token_ids,
                    self.pad_token_id,
                    temperature,
                    top_p,
                    top_k,
                )
        except Exception as exc:  # every waiting request learns why
            for _, _, future in items:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, _, future), out in zip(items, outs):
            if not future.done():
                future.set_result(
                    TokenOutput(
                        token_ids=out.token_ids,
                        log_probs=out.log_probs if want_log_probs else None,
                        stop_reason="completed",
                        extra_fields={"global_steps": steps},
                    )
                )

    # ---- weights -------------------------------------------------------------------------------
    async def update_weights(self, named_tensors: dict[str, torch.Tensor], global_steps: Optional[int] = None) -> str:
        """Load new weights (every parameter of the model, by HF name); returns their checksum."""
        own = dict(self.model.named_parameters(remove_duplicate=False))  # tied weights under both names
        unknown = sorted(set(named_tensors) - set(own))
        if unknown:
            raise KeyError(f"weight update has tensors the rollout model does not: {unknown[:5]}")
        tied = {n for n in own if n not in named_tensors and self._is_tied(n)}
        missing = sorted(set(own) - set(named_tensors) - tied)
        if missing:
            raise KeyError(f"weight update lacks parameters of the rollout model: {missing[:5]}")
        misshapen = [
            f"{n}: {tuple(t.shape)} for {tuple(own[n].shape)}"
            for n, t in named_tensors.items()
            if t.shape != own[n].shape
        ]
        if misshapen:  # checked before any copy: a broadcast or a half-applied update would be silent
            raise ValueError(f"weight update has tensors of the wrong shape: {misshapen[:5]}")
        lock = self._model_lock or asyncio.Lock()
        async with lock:
            with torch.no_grad():
                for name, tensor in named_tensors.items():
                    own[name].copy_(tensor.to(own[name].dtype))
            if global_steps is not None:
                self.global_steps = global_steps
            self.weight_updates += 1
        return state_checksum({n: p for n, p in self.model.named_parameters()})

    def _is_tied(self, name: str) -> bool:
        return name == "lm_head.weight" and bool(getattr(self.model.config, "tie_word_embeddings", False))

    async def weight_checksum(self) -> str:
        return state_checksum(dict(self.model.named_parameters()))

    async def status(self) -> dict[str, Any]:
        return {"global_steps": self.global_steps, "weight_updates": self.weight_updates}

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # ---- verl's control calls: nothing to free or pause (the model stays loaded) -----------------
    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        # requests run to completion (the weight update waits for the model lock), none is aborted
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class HFCPUReplica(RolloutReplica):
    """A rollout replica of :class:`HFCPUServer` actors, one per node of the replica."""

    async def launch_servers(self) -> None:
        if len(self.workers) != self.world_size:
            raise RuntimeError(
                f"hf_cpu replica {self.replica_rank}: {len(self.workers)} workers, expected {self.world_size}"
            )
        infos = await asyncio.gather(
            *[
                w.__ray_call__.remote(lambda self: (ray.get_runtime_context().get_node_id(), worker_placement()))
                for w in self.workers
            ]
        )
        server_cls = ray.remote(HFCPUServer)
        for node_rank in range(self.nnodes):
            node_id, placement = infos[node_rank * self.gpus_per_replica_node]
            # on an accelerator: Ray must leave the worker's visible devices to the server (as for vLLM's)
            env = (
                {"runtime_env": {"env_vars": {v: "1" for v in placement["ray_noset"]}}}
                if placement["ray_noset"]
                else {}
            )
            server = server_cls.options(
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False
                ),
                name=server_name(self.replica_rank, node_rank, self.name_suffix),
                max_concurrency=self.max_concurrency,
                num_cpus=0,
                **env,
            ).remote(
                config=self.config,
                model_config=self.model_config,
                replica_rank=self.replica_rank,
                node_rank=node_rank,
                device=placement["device"],
                visible_key=placement["visible_key"],
                visible_devices=placement["visible_devices"],
            )
            self.servers.append(server)
        await asyncio.gather(*[s.status.remote() for s in self.servers])  # loaded and answering
        self._server_handle = self.servers[0]
        self._server_address = server_name(self.replica_rank, 0, self.name_suffix)


class HFCPUServerAdapter(BaseRollout):
    """verl's rollout adapter for ``hf_cpu``: forwards weight updates to the replica's server.

    In a data-parallel actor every rank iterates the weights (FSDP gathers them collectively);
    only the replica's rank 0 sends them to the server.
    """

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, replica_rank: int = -1, **kwargs: Any):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self.is_leader_rank = self.rollout_rank == 0
        self._server: Any = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank, 0))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        global_steps: Optional[int] = None,
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(
                f"rollout.name=hf_cpu takes full weights (wire_format named_tensors), got {wire_format!r}"
            )
        named: dict[str, torch.Tensor] = {}
        async for name, tensor in ensure_async_iterator(weights):
            if self.is_leader_rank:
                named[name] = tensor.detach().to("cpu", copy=True)
        if self.is_leader_rank:
            await self._server_handle().update_weights.remote(named, global_steps)


def register() -> None:
    """Make ``rollout.name=hf_cpu`` known to verl (idempotent)."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.HFCPUServerAdapter"
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: HFCPUReplica)


# On import, like the platform and the checkpoint engine: a process whose first import is this
# module (Ray unpickling HFCPUServer) reaches the plugin from inside it, before ``register`` exists.
register()
