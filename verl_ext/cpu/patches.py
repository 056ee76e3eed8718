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

import importlib.abc
import importlib.util
import logging
import sys
import threading
from functools import wraps
from typing import Any, Callable

PATCHED_VERL_VERSION = "0.9.1"

_hooks: dict[str, list[Callable[[Any], None]]] = {}
_package_hooks: list[tuple[str, Callable[[Any], None]]] = []  # (package, hook): every module under it
_lock = threading.Lock()
_applied = False


class UnsupportedVerlVersion(RuntimeError):
    """verl_ext.cpu was asked to patch a verl release it was not written for."""


# ---- post-import hooks ------------------------------------------------------------------------


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for hook in _package_hook_list(self._name) + _hooks.pop(self._name, []):
            hook(module)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, ... as the real loader
        return getattr(self._loader, attr)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds watched modules with the normal machinery, then runs their hooks after they execute."""

    def __init__(self):
        self._busy: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if (fullname not in _hooks and not _package_hook_list(fullname)) or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


_finder = _PostImportFinder()


def after_import(module_name: str, hook: Callable[[Any], None]) -> None:
    """Run ``hook(module)`` once ``module_name`` is imported (at once if it already is)."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is None:
            _hooks.setdefault(module_name, []).append(hook)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    hook(module)


def _in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _package_hook_list(name: str) -> list[Callable[[Any], None]]:
    return [hook for package, hook in _package_hooks if _in_package(name, package)]


def after_import_package(package: str, hook: Callable[[Any], None]) -> None:
    """Run ``hook(module)`` on ``package`` and every module under it: at once on those already
    imported, and on each of the others right after its import."""
    with _lock:
        _package_hooks.append((package, hook))
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        loaded = [m for name, m in list(sys.modules.items()) if m is not None and _in_package(name, package)]
    for module in loaded:
        hook(module)


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


class _FlushTolerantLogger(logging.LoggerAdapter):
    """Drops the ``flush=`` keyword that print-style calls pass to a stdlib logger."""

    def process(self, msg, kwargs):
        kwargs.pop("flush", None)
        return msg, kwargs


def _patch_separate_async_logger(module: Any) -> None:
    """``verl/trainer/ppo/v1/trainer_separate_async.py:181-185`` calls ``logger.info(..., flush=True)``
    on a stdlib ``logging.Logger``: ``TypeError: Logger._log() got an unexpected keyword argument
    'flush'`` whenever ``actor_rollout_ref.hybrid_engine=false``. A verl bug on every device (see
    docs/scale-out.md, "Upstream report"); :func:`fix_separate_async_logger` applies this on GPUs too."""
    if not isinstance(module.logger, _FlushTolerantLogger):
        module.logger = _FlushTolerantLogger(module.logger, {})


def fix_separate_async_logger() -> None:
    """The ``flush=`` fix, for every device (the verl engine's trainer calls it)."""
    after_import("verl.trainer.ppo.v1.trainer_separate_async", _patch_separate_async_logger)


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
                pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
                attn_implementation="sdpa", trust_remote_code=trust_remote_code,
            )  # fmt: skip
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
