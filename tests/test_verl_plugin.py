"""The ``verl.plugins`` entry points register HeteroRL's algorithms (``heterorl``) and its CPU
backend (``heterorl_cpu``) wherever verl is imported, and only there.

verl logs a failing plugin only at DEBUG level, so each check runs in a *fresh* process that
imports nothing but verl (a plain subprocess and a Ray worker) and asserts the names arrived.
Two more fresh processes, with verl told to load fewer entry points (``VERL_USE_EXTERNAL_PLUGINS``),
show that importing the loss config or the losses does not install the CPU backend. Finally
verl's own CPU loss tests must still pass with the plugins loaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

# a literal on purpose: the plugin must register this known set (not whatever it declares)
REQUIRED_LOSSES = {"gepo", "eqp", "gepo_adaptive", "gepo_tr", "gepo_tc", "topr", "delta_l", "m2po", "vespo"}
REQUIRED_ESTIMATORS = {"bnpo"}

# what of the CPU backend a process holds: its modules, the verl registrations, the patch hook
_CPU_BACKEND = """
def cpu_backend():
    import sys
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.plugin.platform.platform_manager import PlatformRegistry
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    patches = sys.modules.get("verl_ext.cpu.patches")
    return {
        "modules": sorted(m for m in sys.modules if m == "verl_ext.cpu" or m.startswith("verl_ext.cpu.")),
        "platform": "cpu" in PlatformRegistry.registered_names(),
        "rollout": ("hf_cpu", "async") in rollout_base._ROLLOUT_REGISTRY,
        "replica": "hf_cpu" in RolloutReplicaRegistry._registry,
        "checkpoint_engine": "ray_mailbox" in CheckpointEngineRegistry._registry,
        "patches_applied": bool(patches is not None and patches._applied),
    }
"""

_PROBE = _CPU_BACKEND + textwrap.dedent(
    """
    import json, sys
    import verl  # loads the verl.plugins entry points; nothing of the project imported here
    from verl.trainer.ppo import core_algos
    print("REGISTRY=" + json.dumps({
        "losses": sorted(core_algos.POLICY_LOSS_REGISTRY),
        "estimators": sorted(core_algos.ADV_ESTIMATOR_REGISTRY),
        "plugin_declared": sorted(getattr(sys.modules.get("verl_ext.algos.registry"), "HETERORL_LOSS_MODES", ())),
        "cpu_backend": cpu_backend(),
    }))
    """
)

# verl loads only the named entry points (or none); the probe then imports the project's loss
# modules itself: whatever of the CPU backend shows up, they brought in
_LOSS_IMPORT_PROBE = _CPU_BACKEND + textwrap.dedent(
    """
    import importlib, json, sys
    for name in sys.argv[1].split(","):
        importlib.import_module(name)
    from verl.trainer.ppo import core_algos
    print("REGISTRY=" + json.dumps({
        "losses": sorted(core_algos.POLICY_LOSS_REGISTRY),
        "loss_module_loaded": "verl_ext.algos.registry" in sys.modules,
        "cpu_backend": cpu_backend(),
    }))
    """
)

_RAY_PROBE = textwrap.dedent(
    """
    import json
    import os
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

    @ray.remote
    def registry_in_worker():
        import os, sys
        import verl
        from verl.plugin.platform.platform_manager import PlatformRegistry
        from verl.trainer.ppo import core_algos
        return {
            "pid": os.getpid(),
            "losses": sorted(core_algos.POLICY_LOSS_REGISTRY),
            "estimators": sorted(core_algos.ADV_ESTIMATOR_REGISTRY),
            "cpu_platform": "cpu" in PlatformRegistry.registered_names(),
        }

    try:
        result = ray.get(registry_in_worker.remote(), timeout=120)
    finally:
        ray.shutdown()
    result["driver_pid"] = os.getpid()
    print("REGISTRY=" + json.dumps(result))
    """
)


def _site_packages() -> Path:
    spec = importlib.util.find_spec("verl")
    return Path(spec.origin).resolve().parent.parent


VERL_TEST_FILES = [
    "test_core_algos_on_cpu.py",
    "test_dynamic_policy_losses_on_cpu.py",
    "test_loss_aggregation_on_cpu.py",
]


def _verl_tests_probe(site: Path) -> str:
    """One fresh process: print the registries right after ``import verl``, then run verl's own
    CPU loss tests in it (so they run with the plugin loaded)."""
    files = [str(site / "tests" / "trainer" / "ppo" / f) for f in VERL_TEST_FILES]
    return _PROBE + textwrap.dedent(
        f"""
        import pytest
        sys.stdout.flush()
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", {str(site)!r}] + {files!r}))
        """
    )


class _Proc:
    """A subprocess started at once (the two probes run concurrently) and collected on demand."""

    def __init__(self, code: str, cwd: str, timeout: float, args: tuple[str, ...] = (), plugins: str = "auto"):
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # only the installed entry point may bring the plugin in
        env["VERL_USE_EXTERNAL_PLUGINS"] = plugins  # which entry points verl loads
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=env,
        )
        self._result = None

    def result(self):
        if self._result is None:
            try:
                out, err = self.proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, err = self.proc.communicate()
                pytest.fail(f"probe timed out after {self.timeout}s: {err[-2000:]}")
            self._result = (self.proc.returncode, out, err)
        return self._result

    def registry(self) -> dict:
        _, out, err = self.result()
        lines = [l for l in out.splitlines() if l.startswith("REGISTRY=")]
        assert lines, (out[-2000:], err[-3000:])
        return json.loads(lines[0][len("REGISTRY=") :])


@pytest.fixture(scope="module")
def probes():
    site = _site_packages()
    have_tests = all((site / "tests" / "trainer" / "ppo" / f).is_file() for f in VERL_TEST_FILES)
    running = {
        "ray": _Proc(_RAY_PROBE, cwd="/", timeout=300),
        "fresh": _Proc(_verl_tests_probe(site) if have_tests else _PROBE, cwd=str(site), timeout=400),
        # no entry point at all: the config module alone
        "config_only": _Proc(_LOSS_IMPORT_PROBE, cwd="/", timeout=300, args=("verl_ext.algos.config",), plugins="none"),
        # only the losses' entry point: the config, the losses and the loss bridge
        "losses_only": _Proc(
            _LOSS_IMPORT_PROBE,
            cwd="/",
            timeout=300,
            plugins="heterorl",
            args=("verl_ext.algos.config,verl_ext.algos.registry,verl_ext.algos.objective",),
        ),
    }
    running["have_verl_tests"] = have_tests
    yield running
    for key in ("ray", "fresh", "config_only", "losses_only"):
        if running[key].proc.poll() is None:
            running[key].proc.kill()
            running[key].proc.wait()


def test_entry_points_declared():
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="verl.plugins")}
    assert eps.get("heterorl") == "verl_ext.algos.registry", eps
    assert eps.get("heterorl_cpu") == "verl_ext.cpu", eps


def test_fresh_process_import_verl_registers_everything(probes):
    reg = probes["fresh"].registry()
    assert REQUIRED_LOSSES <= set(reg["losses"]), reg["losses"]
    assert REQUIRED_ESTIMATORS <= set(reg["estimators"]), reg["estimators"]
    # whatever else the plugin declares arrived too (e.g. grpo_token, should it come back)
    assert REQUIRED_LOSSES <= set(reg["plugin_declared"])
    assert set(reg["plugin_declared"]) <= set(reg["losses"])
    # verl's own built-ins are still there (the plugin did not clobber the registry)
    assert {"vanilla", "gspo", "geo_mean", "cispo"} <= set(reg["losses"])
    assert {"grpo", "gae"} <= set(reg["estimators"])


def test_fresh_process_import_verl_installs_the_cpu_backend(probes):
    """On this machine (no accelerator) ``import verl`` alone registers the CPU backend; its patches
    of verl wait until verl picks the platform (tests/cpu/test_platform.py)."""
    backend = probes["fresh"].registry()["cpu_backend"]
    assert "verl_ext.cpu" in backend["modules"]
    assert backend["platform"] and backend["rollout"] and backend["replica"] and backend["checkpoint_engine"]
    assert not backend["patches_applied"]


def test_importing_the_loss_config_installs_nothing(probes):
    """With no entry point loaded, the config module registers no loss and brings no CPU backend."""
    reg = probes["config_only"].registry()
    assert not reg["loss_module_loaded"] and not REQUIRED_LOSSES & set(reg["losses"])
    assert reg["cpu_backend"] == {
        "modules": [],
        "platform": False,
        "rollout": False,
        "replica": False,
        "checkpoint_engine": False,
        "patches_applied": False,
    }


def test_importing_the_losses_does_not_install_the_cpu_backend(probes):
    """With only the losses' entry point loaded, the config, the losses and the loss bridge register
    the losses and leave the CPU backend out."""
    reg = probes["losses_only"].registry()
    assert REQUIRED_LOSSES <= set(reg["losses"])
    assert reg["cpu_backend"] == {
        "modules": [],
        "platform": False,
        "rollout": False,
        "replica": False,
        "checkpoint_engine": False,
        "patches_applied": False,
    }


def test_ray_worker_import_verl_registers_everything(probes):
    reg = probes["ray"].registry()
    assert reg["pid"] != reg["driver_pid"]  # really another process
    assert REQUIRED_LOSSES <= set(reg["losses"]), reg["losses"]
    assert REQUIRED_ESTIMATORS <= set(reg["estimators"]), reg["estimators"]
    assert reg["cpu_platform"]  # the CPU backend's entry point runs in Ray workers too


def test_verls_own_cpu_loss_tests_pass_with_plugin_loaded(probes):
    if not probes["have_verl_tests"]:
        pytest.skip("verl's packaged tests (site-packages/tests/trainer/ppo) are not installed")
    code, out, err = probes["fresh"].result()
    assert REQUIRED_LOSSES <= set(probes["fresh"].registry()["losses"])  # the plugin was loaded in that run
    assert code == 0, (out[-4000:], err[-2000:])
    assert " passed" in out and " failed" not in out
