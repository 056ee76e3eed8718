"""The few changes to verl 0.9.1 internals that its trainer needs on a CPU-only machine.

Each fix names the verl file:line it works around. They are applied only when verl picks the CPU
platform (:class:`verl_ext.cpu.platform.PlatformCPU`), never on a GPU machine, and only on the verl
version they were written against: another verl refuses with a clear message instead of being
patched blind. Modules not imported yet are patched right after their import (a post-import hook),
so loading the plugin does not import verl's heavy worker modules into every process.

What is *not* here because verl has a public extension point for it: the platform itself
(``PlatformRegistry``), the ``hf_cpu`` rollout (``RolloutReplicaRegistry`` + rollout class
registry), the ``ray_mailbox`` weight-sync engine (``CheckpointEngineRegistry``), and the FSDP
engines for device ``cpu`` (``EngineRegistry.register``).
"""

from __future__ import annotations

from functools import wraps
from typing import Any, Callable

from verl_ext.import_hooks import after_import
from verl_ext.verl_fixes import fix_separate_async_logger

PATCHED_VERL_VERSION = "0.9.1"

_applied = False


class UnsupportedVerlVersion(RuntimeError):
    """verl_ext.cpu was asked to patch a verl release it was not written for."""


# ---- the fixes ---------------------------------------------------------------------------------


def _gloo_default(init: Callable) -> Callable:
    """``verl/utils/distributed.py:89`` builds the backend string ``cpu:gloo,<device>:<backend>``:
    on the CPU that is ``cpu:gloo,cpu:gloo``, which torch rejects (duplicate device type). It is
    called without a backend from ``verl/workers/engine_workers.py:89``."""
    if getattr(init, "_heterorl_gloo_default", False):
        return init

    @wraps(init)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return init(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    initialize_global_process_group_ray._heterorl_gloo_default = True
    return initialize_global_process_group_ray


def _patch_gloo_default(module: Any) -> None:
    module.initialize_global_process_group_ray = _gloo_default(module.initialize_global_process_group_ray)


def _register_fsdp_engines_for_cpu(module: Any) -> None:
    """``verl/workers/engine/fsdp/transformer_impl.py:1143`` and ``:1594`` register the FSDP engines
    for devices cuda and npu only; the same classes run on the CPU with gloo. (A registration
    through verl's public ``EngineRegistry``, not a patch.)"""
    from verl.workers.engine.base import EngineRegistry

    for model_type, engine in (
        ("language_model", module.FSDPEngineWithLMHead),
        ("value_model", module.FSDPEngineWithValueHead),
    ):
        registered = EngineRegistry._engines.get(model_type, {})
        if "cpu" not in registered.get("fsdp", {}):
            EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(engine)


def _patch_fsdp2_snapshot_copies(module: Any) -> None:
    """``verl/utils/fsdp_utils.py:1167`` and ``:1180`` snapshot each parameter shard with
    ``tensor.detach().cpu()``: a copy from a GPU, but on the CPU ``.cpu()`` returns the parameter
    itself, so the "snapshot" keeps following training. ``DetachActorWorker.save_model_to_cpu``
    (verl's separate_async, the verl engine's delayed weight sync) then pushes the current
    weights under an old version's name. The FSDP1 helper copies (``copy=True``); this makes the
    FSDP2 one copy too."""
    save = module.fsdp2_sharded_save_to_cpu
    if getattr(save, "_heterorl_copies", False):
        return

    @wraps(save)
    def fsdp2_sharded_save_to_cpu(model):
        state, global_spec = save(model)
        return {name: (shard.clone(), spec) for name, (shard, spec) in state.items()}, global_spec

    fsdp2_sharded_save_to_cpu._heterorl_copies = True
    module.fsdp2_sharded_save_to_cpu = fsdp2_sharded_save_to_cpu


def _patch_valuehead_attention(module: Any) -> None:
    """``verl/utils/model.py:649`` loads a critic's value model with
    ``attn_implementation="flash_attention_2"`` whatever the config says; flash-attention is
    CUDA-only. On the CPU the value model is loaded with ``sdpa``, as the actor is (cpu_toy's
    ``override_config.attn_implementation``); a checkpoint that is not a token-classification model
    still takes verl's own TRL value-head path."""
    load = module.load_valuehead_model
    if getattr(load, "_heterorl_sdpa", False):
        return

    @wraps(load)
    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        try:
            return AutoModelForTokenClassification.from_pretrained(
                pretrained_model_name_or_path=local_path,
                torch_dtype=torch_dtype,
                config=model_config,
                attn_implementation="sdpa",
                trust_remote_code=trust_remote_code,
            )
        except (ValueError, OSError, KeyError):
            return load(local_path, torch_dtype, model_config, trust_remote_code)

    load_valuehead_model._heterorl_sdpa = True
    module.load_valuehead_model = load_valuehead_model


def _patch_offload_pinning(module: Any) -> None:
    """``verl/workers/engine/fsdp/transformer_impl.py:462`` gives a forward-only FSDP2 model (the
    reference policy of ``actor.use_kl_loss``) ``CPUOffloadPolicy(pin_memory=True)``; pinning
    needs an accelerator ("Cannot access accelerator device"). On the CPU the policy keeps its
    meaning without pinned memory."""
    policy = module.CPUOffloadPolicy
    if getattr(policy, "_heterorl_unpinned", False):
        return

    def CPUOffloadPolicy(pin_memory: bool = True):  # noqa: N802 -- stands in for the class verl calls
        return policy(pin_memory=False)

    CPUOffloadPolicy._heterorl_unpinned = True
    module.CPUOffloadPolicy = CPUOffloadPolicy


def check_verl_version() -> None:
    import verl

    if verl.__version__ != PATCHED_VERL_VERSION:
        raise UnsupportedVerlVersion(
            f"verl_ext.cpu runs verl's trainer on the CPU by patching verl {PATCHED_VERL_VERSION} internals "
            f"(verl_ext/cpu/patches.py names each file:line), but verl {verl.__version__} is installed. "
            f"Install verl=={PATCHED_VERL_VERSION} (the project pins it), or run on GPUs, where these "
            "patches are not used."
        )


def apply_patches() -> None:
    """Apply every CPU fix (idempotent). Called when verl selects the CPU platform."""
    global _applied
    if _applied:
        return
    check_verl_version()
    after_import("verl.utils.distributed", _patch_gloo_default)
    after_import("verl.workers.engine_workers", _patch_gloo_default)
    after_import("verl.workers.engine.fsdp.transformer_impl", _register_fsdp_engines_for_cpu)
    after_import("verl.workers.engine.fsdp.transformer_impl", _patch_offload_pinning)
    after_import("verl.utils.fsdp_utils", _patch_fsdp2_snapshot_copies)
    after_import("verl.utils.model", _patch_valuehead_attention)
    fix_separate_async_logger()
    _applied = True
