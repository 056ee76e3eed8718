"""The ``verl.plugins`` entry point registers HeteroRL's algorithms wherever verl is imported.

verl logs a failing plugin only at DEBUG level, so each check runs in a *fresh* process that
imports nothing but verl (a plain subprocess and a Ray worker) and asserts the names arrived.
Finally verl's own CPU loss tests must still pass with the plugin loaded.
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

REQUIRED_LOSSES = {"gepo", "eqp", "gepo_adaptive", "gepo_tr", "topr", "delta_l"}
REQUIRED_ESTIMATORS = {"bnpo"}

_PROBE = textwrap.dedent(
    """
    import json, sys
    import verl  # loads the verl.plugins entry points; nothing of the project imported here
    from verl.trainer.ppo import core_algos
    print("REGISTRY=" + json.dumps({
        "losses": sorted(core_algos.POLICY_LOSS_REGISTRY),
        "estimators": sorted(core_algos.ADV_ESTIMATOR_REGISTRY),
        "plugin_declared": sorted(getattr(sys.modules.get("verl_ext.verl_plugin"), "HETERORL_LOSS_MODES", ())),
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
        from verl.trainer.ppo import core_algos
        return {
            "pid": os.getpid(),
            "losses": sorted(core_algos.POLICY_LOSS_REGISTRY),
            "estimators": sorted(core_algos.ADV_ESTIMATOR_REGISTRY),
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


VERL_TEST_FILES = ["test_core_algos_on_cpu.py", "test_dynamic_policy_losses_on_cpu.py", "test_loss_aggregation_on_cpu.py"]


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

    def __init__(self, code: str, cwd: str, timeout: float):
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # only the installed entry point may bring the plugin in
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env
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
        return json.loads(lines[0][len("REGISTRY="):])


@pytest.fixture(scope="module")
def probes():
    site = _site_packages()
    have_tests = all((site / "tests" / "trainer" / "ppo" / f).is_file() for f in VERL_TEST_FILES)
    running = {
        "ray": _Proc(_RAY_PROBE, cwd="/", timeout=300),
        "fresh": _Proc(_verl_tests_probe(site) if have_tests else _PROBE, cwd=str(site), timeout=400),
    }
    running["have_verl_tests"] = have_tests
    yield running
    for key in ("ray", "fresh"):
        if running[key].proc.poll() is None:
            running[key].proc.kill()
            running[key].proc.wait()


def test_entry_point_declared():
    eps = [ep for ep in metadata.entry_points(group="verl.plugins") if ep.value == "verl_ext.verl_plugin"]
    assert eps, "pyproject.toml must declare verl_ext.verl_plugin in entry-point group verl.plugins"


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


def test_ray_worker_import_verl_registers_everything(probes):
    reg = probes["ray"].registry()
    assert reg["pid"] != reg["driver_pid"]  # really another process
    assert REQUIRED_LOSSES <= set(reg["losses"]), reg["losses"]
    assert REQUIRED_ESTIMATORS <= set(reg["estimators"]), reg["estimators"]


def test_verls_own_cpu_loss_tests_pass_with_plugin_loaded(probes):
    if not probes["have_verl_tests"]:
        pytest.skip("verl's packaged tests (site-packages/tests/trainer/ppo) are not installed")
    code, out, err = probes["fresh"].result()
    assert REQUIRED_LOSSES <= set(probes["fresh"].registry()["losses"])  # the plugin was loaded in that run
    assert code == 0, (out[-4000:], err[-2000:])
    assert " passed" in out and " failed" not in out
