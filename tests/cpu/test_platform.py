"""The CPU platform for verl 0.9.1 and its version-guarded patches (verl_ext/cpu/platform.py, patches.py).

What is pinned:

- in a *fresh* process where nothing but ``import verl`` loads the project (``VERL_PLATFORM`` and
  ``PYTHONPATH`` removed), verl picks :class:`PlatformCPU` by itself (device ``cpu``, gloo), the
  ``hf_cpu`` rollout and the ``ray_mailbox`` weight sync are in verl's registries, verl's FSDP LM
  engine is found for device ``cpu``, and verl's ``initialize_global_process_group_ray`` -- which
  on its own asks torch for ``cpu:gloo,cpu:gloo`` and raises -- starts a working gloo group;
- the patches are applied lazily, when verl picks the platform; verl's ``Worker.__init__`` picks it
  (``Worker.env_keys``), so ``TrainingWorker.__init__`` (``engine_workers.py:89``) always calls the
  patched function -- the ordering the fix relies on is pinned in a second fresh process;
- the version guard refuses any verl but 0.9.1, naming both versions, before patching anything;
- ``after_import`` runs a hook once, after the module body, and at once for a module already imported;
- the ``flush=`` fix for verl's separate-async trainer logger.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import uuid

import pytest

PROBE_TIMEOUT_S = 180

# The brief's order: the platform is picked first (which applies the patches), verl's worker
# module is imported afterwards (so its patch arrives through the post-import hook).
_PLATFORM_PROBE = textwrap.dedent(
    """
    import json, os, sys
    import verl  # loads the verl.plugins entry point; nothing of the project imported explicitly
    from verl.plugin.platform import get_platform
    from verl.utils.device import get_device_name
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    out = {}
    platform = get_platform()
    out["platform_class"] = type(platform).__module__ + "." + type(platform).__qualname__
    out["device_name"] = platform.device_name
    out["comm_backend"] = platform.communication_backend_name()
    out["utils_device_name"] = get_device_name()
    out["replica_registered"] = "hf_cpu" in RolloutReplicaRegistry._registry
    out["rollout_registered"] = ("hf_cpu", "async") in rollout_base._ROLLOUT_REGISTRY
    adapter = rollout_base.get_rollout_class("hf_cpu")
    out["rollout_class"] = adapter.__module__ + "." + adapter.__qualname__
    engine = CheckpointEngineRegistry.get("ray_mailbox")
    out["ckpt_engine_class"] = engine.__module__ + "." + engine.__qualname__

    import verl.workers.engine_workers as ew
    out["engine_workers_patched"] = bool(getattr(ew.initialize_global_process_group_ray, "_heterorl_gloo_default", False))
    from verl.workers.engine.base import EngineRegistry
    lm = EngineRegistry.get_engine_cls("language_model", "fsdp2")
    out["lm_engine_class"] = lm.__module__ + "." + lm.__qualname__

    import torch
    import torch.distributed as dist
    ew.initialize_global_process_group_ray(timeout_second=60)

    # a CPU weight snapshot of an FSDP2 module is a copy, not the live parameters
    from torch.distributed.fsdp import fully_shard
    from verl.utils import fsdp_utils
    module = fully_shard(torch.nn.Linear(2, 2))
    snapshot, _ = fsdp_utils.fsdp2_sharded_save_to_cpu(module)
    with torch.no_grad():
        module.weight.add_(1.0)
    out["snapshot_is_copy"] = not torch.equal(snapshot["weight"][0], module.weight._local_tensor)
    import verl.utils.model as verl_model
    out["valuehead_sdpa"] = bool(getattr(verl_model.load_valuehead_model, "_heterorl_sdpa", False))
    import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
    out["offload_unpinned"] = fsdp_impl.CPUOffloadPolicy(pin_memory=True).pin_memory is False
    out["dist_initialized"] = dist.is_initialized()
    out["dist_backend"] = str(dist.get_backend())
    t = torch.tensor([1.0, 2.0])
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    dist.destroy_process_group()
    print("PROBE=" + json.dumps(out))
    """
)

# verl's own order in a worker process: the worker module is imported before any platform call,
# then Worker.__init__ (which TrainingWorker.__init__ calls first) picks the platform.
_ORDER_PROBE = textwrap.dedent(
    """
    import json
    import verl
    import verl.workers.engine_workers as ew
    from verl.plugin.platform import platform_manager

    out = {}
    out["platform_before"] = platform_manager._current_platform is not None
    out["patched_before"] = bool(getattr(ew.initialize_global_process_group_ray, "_heterorl_gloo_default", False))
    from verl.single_controller.base.worker import Worker
    Worker()
    out["platform_after_worker"] = type(platform_manager._current_platform).__name__
    out["patched_after_worker"] = bool(getattr(ew.initialize_global_process_group_ray, "_heterorl_gloo_default", False))
    import torch.distributed as dist
    ew.initialize_global_process_group_ray(timeout_second=60)
    out["dist_backend"] = str(dist.get_backend())
    dist.destroy_process_group()
    print("PROBE=" + json.dumps(out))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Probe:
    """A fresh python started at once (both probes run concurrently), collected on demand."""

    def __init__(self, code: str):
        env = dict(os.environ)
        env.pop("VERL_PLATFORM", None)  # verl must pick the CPU platform by itself
        env.pop("PYTHONPATH", None)  # only the installed entry point may bring the plugin in
        env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/", env=env
        )
        self._out = None

    def result(self) -> dict:
        if self._out is None:
            try:
                out, err = self.proc.communicate(timeout=PROBE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, err = self.proc.communicate()
                pytest.fail(f"probe timed out after {PROBE_TIMEOUT_S}s: {err[-2000:]}")
            lines = [line for line in out.splitlines() if line.startswith("PROBE=")]
            assert self.proc.returncode == 0 and lines, (self.proc.returncode, out[-2000:], err[-4000:])
            self._out = json.loads(lines[0][len("PROBE=") :])
        return self._out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# the first import is the rollout module itself (a Ray actor process unpickling HFCPUServer): verl's
# plugin runs from inside it, while the module is half-initialised
_ROLLOUT_FIRST_PROBE = """
import json, logging, io
stream = io.StringIO()
logging.basicConfig(stream=stream, level=logging.WARNING)
import verl_ext.cpu.rollout
from verl.workers.rollout import base
from verl.workers.rollout.replica import RolloutReplicaRegistry
print("PROBE=" + json.dumps({
    "rollout_class": base._ROLLOUT_REGISTRY.get(("hf_cpu", "async")),
    "replica_registered": "hf_cpu" in RolloutReplicaRegistry._registry,
    "warnings": stream.getvalue(),
}))
"""


@pytest.fixture(scope="module")
def probes():
    running = {
        "platform": _Probe(_PLATFORM_PROBE),
        "order": _Probe(_ORDER_PROBE),
        "rollout_first": _Probe(_ROLLOUT_FIRST_PROBE),
    }
    yield running
    for probe in running.values():
        probe.kill()


# ---- fresh process: what `import verl` alone gives -----------------------------------------------


def test_fresh_process_picks_the_cpu_platform(probes):
    """Without VERL_PLATFORM and without a GPU, verl's auto-detection picks PlatformCPU (cpu, gloo)."""
    out = probes["platform"].result()
    assert out["platform_class"] == "verl_ext.cpu.platform.PlatformCPU"
    assert out["device_name"] == "cpu"
    assert out["comm_backend"] == "gloo"
    assert out["utils_device_name"] == "cpu"


def test_fresh_process_registers_hf_cpu_rollout_and_ray_mailbox(probes):
    """``rollout.name=hf_cpu`` and ``checkpoint_engine.backend=ray_mailbox`` resolve in verl's registries."""
    out = probes["platform"].result()
    assert out["replica_registered"]
    assert out["rollout_registered"]
    assert out["rollout_class"] == "verl_ext.cpu.rollout.HFCPUServerAdapter"
    assert out["ckpt_engine_class"] == "verl_ext.cpu.checkpoint_engine.RayMailboxCheckpointEngine"


def test_fresh_process_importing_the_rollout_module_first_still_registers_it(probes):
    out = probes["rollout_first"].result()
    assert out["rollout_class"] == "verl_ext.cpu.rollout.HFCPUServerAdapter"
    assert out["replica_registered"]
    assert "not registered" not in out["warnings"], out["warnings"]


def test_fresh_process_patches_verl_workers_and_finds_fsdp_engine_on_cpu(probes):
    """engine_workers imported after the platform is picked gets the gloo-default wrapper through the
    post-import hook, and verl's EngineRegistry returns the FSDP LM engine for device cpu."""
    out = probes["platform"].result()
    assert out["engine_workers_patched"]
    assert out["snapshot_is_copy"]  # verl/utils/fsdp_utils.py:1180 aliases on the CPU unpatched
    assert out["valuehead_sdpa"]  # verl/utils/model.py:649 forces flash-attention-2 for a critic
    assert out["offload_unpinned"]  # transformer_impl.py:462 pins the reference model's memory
    assert out["lm_engine_class"] == "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead"


def test_fresh_process_global_process_group_is_gloo(probes):
    """The call verl's TrainingWorker makes (no backend given) starts a gloo group that reduces.
    Unpatched, verl builds ``cpu:gloo,cpu:gloo`` and torch raises 'Duplicate device type cpu'."""
    out = probes["platform"].result()
    assert out["dist_initialized"]
    assert "gloo" in out["dist_backend"]
    assert out["all_reduce"] == [1.0, 2.0]  # world of one: the sum is the tensor itself


def test_verl_worker_init_picks_platform_before_engine_workers_needs_patch(probes):
    """In verl's own order the patch is not there right after the import (it is applied when verl
    picks the platform), but ``Worker.__init__`` picks it, so the call that follows in
    ``TrainingWorker.__init__`` is the patched one and gloo starts."""
    out = probes["order"].result()
    assert not out["platform_before"] and not out["patched_before"]
    assert out["platform_after_worker"] == "PlatformCPU"
    assert out["patched_after_worker"]
    assert "gloo" in out["dist_backend"]


# ---- in this process ----------------------------------------------------------------------------


def test_version_guard_refuses_other_verl_and_names_both_versions(monkeypatch):
    """check_verl_version passes on the installed 0.9.1 and refuses 0.9.2 with both versions named;
    apply_patches refuses before registering any hook."""
    import verl

    from verl_ext import import_hooks
    from verl_ext.cpu import patches

    assert verl.__version__ == patches.PATCHED_VERL_VERSION == "0.9.1"
    patches.check_verl_version()  # installed release: no error

    monkeypatch.setattr(verl, "__version__", "0.9.2")
    with pytest.raises(patches.UnsupportedVerlVersion) as err:
        patches.check_verl_version()
    assert "0.9.1" in str(err.value) and "0.9.2" in str(err.value)

    monkeypatch.setattr(patches, "_applied", False)
    hooks_before = {name: list(hooks) for name, hooks in import_hooks._hooks.items()}
    with pytest.raises(patches.UnsupportedVerlVersion):
        patches.apply_patches()
    assert {name: list(hooks) for name, hooks in import_hooks._hooks.items()} == hooks_before
    assert patches._applied is False


def _throwaway_package(tmp_path, monkeypatch) -> str:
    name = f"heterorl_hook_probe_{uuid.uuid4().hex[:8]}"
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("EXECUTIONS = []\nEXECUTIONS.append(1)\nMARKER = 'set by the module body'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_after_import_runs_once_after_the_module_body(tmp_path, monkeypatch):
    """A hook registered before the import runs exactly once, on the executed module (it sees an
    attribute the body set), not again on a re-import or a reload."""
    from verl_ext.import_hooks import after_import

    name = _throwaway_package(tmp_path, monkeypatch)
    modname = f"{name}.mod"
    seen = []
    try:
        after_import(modname, lambda m: seen.append((m.__name__, getattr(m, "MARKER", None), list(m.EXECUTIONS))))
        assert seen == []  # not imported yet: nothing ran
        module = importlib.import_module(modname)
        assert seen == [(modname, "set by the module body", [1])]
        assert module.MARKER == "set by the module body"
        importlib.import_module(modname)
        importlib.reload(module)
        assert len(seen) == 1
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def test_after_import_on_an_imported_module_runs_at_once(tmp_path, monkeypatch):
    """Registering a hook for a module that is already imported runs it before after_import returns."""
    from verl_ext.import_hooks import after_import

    name = _throwaway_package(tmp_path, monkeypatch)
    modname = f"{name}.mod"
    try:
        module = importlib.import_module(modname)
        seen = []
        after_import(modname, lambda m: seen.append(m))
        assert seen == [module]
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def test_separate_async_logger_accepts_flush(monkeypatch):
    """verl's trainer_separate_async calls ``logger.info(..., flush=True)``: a stdlib logger raises
    TypeError for that (shown on a plain logger and on the module's own unwrapped logger); after
    fix_separate_async_logger the module's logger takes it."""
    from verl_ext.verl_fixes import fix_separate_async_logger

    plain = logging.getLogger(f"heterorl-test-{uuid.uuid4().hex[:6]}")
    plain.setLevel(logging.INFO)  # a disabled level would skip _log and hide the error
    with pytest.raises(TypeError, match="flush"):
        plain.info("x", flush=True)

    fix_separate_async_logger()
    import verl.trainer.ppo.v1.trainer_separate_async as m

    assert isinstance(m.logger, logging.LoggerAdapter)
    underlying = m.logger.logger
    old_level = underlying.level
    monkeypatch.setattr(underlying, "disabled", False)
    underlying.setLevel(logging.INFO)  # setLevel clears the logger's isEnabledFor cache
    try:
        assert m.logger.isEnabledFor(logging.INFO)
        with pytest.raises(TypeError, match="flush"):
            underlying.info("x", flush=True)  # the failure mode the fix removes
        m.logger.info("x", flush=True)  # no error
    finally:
        underlying.setLevel(old_level)
    fix_separate_async_logger()  # idempotent: still one adapter around the stdlib logger
    assert m.logger.logger is underlying
