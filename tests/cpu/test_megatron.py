"""verl's Megatron engine on the CPU (verl_ext/cpu/megatron.py, configs/verl_preset/cpu_toy_megatron.yaml).

Fast:

- the version guard accepts only megatron-core 0.16.1 + mbridge 0.15.1, does nothing without
  megatron-core, and names the versions when it refuses; in a fresh process with other versions
  reported, the CPU platform leaves megatron-core alone and the Megatron engine for ``cpu``
  refuses to start with that message (FSDP unaffected);
- in a fresh process on the installed versions, verl picks the CPU platform and the fixes are in
  place (engines registered for ``cpu``, megatron-core's modules see the CPU for ``torch.cuda``,
  torch itself unchanged); the tied-embedding PP>1 fix is registered with no platform chosen (it
  is not a CPU fix);
- the per-site helpers: CUDA type names / ``.cuda()`` only inside the wrapped call, gradient
  clipping, local-spec norm names, the tied output layer read from the embedding while loading,
  float32 Megatron weights accepted on the CPU.

Slow (Ray + verl's Megatron workers over gloo):

- ``make verl-smoke-megatron``: verl's stock ``main_ppo``, TP=2, ``loss_mode=gepo``, 2 steps;
- ``main_gepo`` on Megatron with the full objective (GSPO, entropy, KL to the reference worker)
  killed after a checkpoint and resumed: every step once;
- agreement on one fixed batch (3 prompt groups x 4, micro-batches of 2: groups split over
  micro-batches and pipeline stages), verl's actor worker (the verl engine's ``HeteroActorWorker``)
  driven as verl's trainer drives it: Megatron TP=2 (with and without sequence parallelism), PP=2,
  DP=2, TP=2 x PP=2 and TP=2 x DP=2 against TP=1, and TP=2 against the FSDP2 engine, all float32
  (the preset's dtype); and bf16 (verl's default) against float32;
- every algorithm preset's loss with entropy and KL-to-reference: Megatron TP=2 against FSDP2;
- weight sync from Megatron shards to an hf_cpu sampler through verl's checkpoint manager,
  delayed and not, checked by the checksum of the weights the sampler holds.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verl_ext.cpu import megatron as cpu_megatron
from verl_ext.cpu.megatron import PATCHED_VERSIONS, UnsupportedMegatronVersion, check_versions

PROBE_TIMEOUT_S = 240
ROOT = Path(__file__).resolve().parents[2]


# ---- the version guard --------------------------------------------------------------------------


def test_the_guard_accepts_the_patched_versions_and_ignores_a_machine_without_megatron():
    assert check_versions(dict(PATCHED_VERSIONS)) is True
    assert check_versions({"megatron-core": None, "mbridge": None}) is False
    assert check_versions({"megatron-core": None, "mbridge": "0.15.1"}) is False
    assert cpu_megatron.apply_megatron_patches({"megatron-core": None, "mbridge": None}) is False


@pytest.mark.parametrize(
    "versions, named",
    [
        ({"megatron-core": "0.17.0", "mbridge": "0.15.1"}, "megatron-core 0.17.0"),
        ({"megatron-core": "0.16.1", "mbridge": "0.16.0"}, "mbridge 0.16.0"),
        ({"megatron-core": "0.16.1", "mbridge": None}, "mbridge (not installed)"),
    ],
)
def test_the_guard_refuses_other_versions_naming_them(versions, named):
    with pytest.raises(UnsupportedMegatronVersion) as err:
        check_versions(versions)
    message = str(err.value)
    assert named in message and "megatron-core==0.16.1" in message and "mbridge==0.15.1" in message


def test_the_installed_versions_are_the_patched_ones():
    """`make install` pins them (pyproject.toml's ``megatron`` extra)."""
    assert cpu_megatron.installed_versions() == PATCHED_VERSIONS


# ---- fresh processes ----------------------------------------------------------------------------

_PATCHED_PROBE = """
import json, torch
import verl
from verl.plugin.platform import get_platform
out = {"platform": type(get_platform()).__name__}
from verl.workers.engine.base import EngineRegistry
import verl.workers.engine  # imports verl's Megatron engine (and megatron-core)
lm = EngineRegistry.get_engine_cls("language_model", "megatron")
out["lm_engine"] = lm.__qualname__
out["value_engine"] = EngineRegistry.get_engine_cls("value_model", "megatron").__qualname__
import megatron.core.tensor_parallel.layers as layers, megatron.core.tensor_parallel.random as rnd
import megatron.core.optimizer.optimizer as opt
out["megatron_device"] = layers.torch.cuda.current_device()
out["megatron_cuda_tensor"] = str(layers.torch.zeros(1, device="cuda").device)
out["rng_state_is_cpu"] = bool(torch.equal(rnd._get_cuda_rng_state(), torch.get_rng_state()))
out["clip_is_ours"] = opt.clip_grad_by_total_norm_fp32.__module__
try:
    torch.cuda.current_device()
    out["torch_unchanged"] = False
except (AssertionError, RuntimeError):
    out["torch_unchanged"] = True
import mbridge.core.llm_bridge as llm_bridge
out["local_spec"] = type(llm_bridge.get_gpt_decoder_block_spec).__name__
print("PROBE=" + json.dumps(out))
"""

_WRONG_VERSION_PROBE = """
import json, torch
import verl
import verl_ext.cpu.megatron as m
m.installed_versions = lambda: {"megatron-core": "0.17.0", "mbridge": "0.15.1"}
from verl.plugin.platform import get_platform
out = {"platform": type(get_platform()).__name__}
from verl.workers.engine.base import EngineRegistry
import verl.workers.engine
out["fsdp_engine"] = EngineRegistry.get_engine_cls("language_model", "fsdp2").__qualname__
import megatron.core.tensor_parallel.layers as layers
out["megatron_untouched"] = layers.torch is torch
try:
    EngineRegistry.new("language_model", "megatron", model_config=None, engine_config=None,
                       optimizer_config=None, checkpoint_config=None)
    out["refused"] = ""
except m.UnsupportedMegatronVersion as exc:
    out["refused"] = str(exc)
print("PROBE=" + json.dumps(out))
"""

# no platform chosen, no verl module imported beyond the plugins: the tied fix is already armed
_TIED_PROBE = """
import json, torch
import verl
from verl.plugin.platform import platform_manager
import mbridge.core.bridge as bridge
import megatron.core.tensor_parallel.layers as layers
print("PROBE=" + json.dumps({
    "platform_chosen": platform_manager._current_platform is not None,
    "tied_fix": bool(getattr(bridge.Bridge.load_weights, "_heterorl_patched", False)),
    "megatron_untouched": layers.torch is torch,
}))
"""


def _probe(code: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "PYTHONPATH")}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
        env=env,
    )


def _result(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("PROBE=")]
    assert proc.returncode == 0 and lines, (proc.returncode, out[-2000:], err[-4000:])
    return json.loads(lines[0][len("PROBE=") :])


@pytest.fixture(scope="module")
def probes():
    running = {"patched": _probe(_PATCHED_PROBE), "wrong": _probe(_WRONG_VERSION_PROBE), "tied": _probe(_TIED_PROBE)}
    yield running
    for proc in running.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_on_the_patched_versions_the_cpu_platform_runs_megatron(probes):
    out = _result(probes["patched"])
    assert out["platform"] == "PlatformCPU"
    assert (out["lm_engine"], out["value_engine"]) == ("MegatronEngineWithLMHead", "MegatronEngineWithValueHead")
    assert out["megatron_device"] == "cpu" and out["megatron_cuda_tensor"] == "cpu"
    assert out["rng_state_is_cpu"] and out["clip_is_ours"] == "verl_ext.cpu.megatron"
    assert out["torch_unchanged"]  # only megatron-core's and mbridge's view of torch.cuda changed
    assert out["local_spec"] == "partial"


def test_on_other_versions_the_megatron_engine_refuses_and_fsdp_is_unaffected(probes):
    out = _result(probes["wrong"])
    assert out["platform"] == "PlatformCPU" and out["fsdp_engine"] == "FSDPEngineWithLMHead"
    assert out["megatron_untouched"]  # nothing patched blind
    assert "megatron-core 0.17.0" in out["refused"] and "megatron-core==0.16.1" in out["refused"]


def test_the_tied_embedding_fix_is_armed_on_every_device(probes):
    out = _result(probes["tied"])
    assert not out["platform_chosen"] and out["tied_fix"] and out["megatron_untouched"]


# ---- the per-site helpers -----------------------------------------------------------------------


def test_cuda_tensor_calls_pass_on_the_cpu_only_inside_the_wrapped_call():
    t = torch.zeros(2)
    with cpu_megatron._cuda_tensor_calls_on_cpu():
        assert t.type() == "torch.cuda.FloatTensor" and t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert t.cuda() is t and t.pin_memory() is t
        assert t.type(torch.float64).dtype == torch.float64  # a conversion is still a conversion
    assert t.type() == "torch.FloatTensor"
    with pytest.raises(RuntimeError):  # CPU-only torch: no accelerator to pin for
        t.pin_memory()


def test_gradient_clipping_scales_every_gradient_below_the_norm():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1))]
    params[0].grad, params[1].grad = torch.full((3,), 2.0), torch.full((2,), 4.0)
    cpu_megatron.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=4.0)
    assert torch.allclose(params[0].grad, torch.full((3,), 0.5), atol=1e-6)
    assert torch.allclose(params[1].grad, torch.full((2,), 1.0), atol=1e-6)
    cpu_megatron.clip_grad_by_total_norm_fp32(params, max_norm=10.0, total_norm=4.0)  # below: unchanged
    assert torch.allclose(params[1].grad, torch.full((2,), 1.0), atol=1e-6)


def test_local_spec_norms_map_to_hf_names():
    from mbridge.models.llama import LLaMABridge

    cpu_megatron._patch_local_norm_names(sys.modules["mbridge.core.bridge"])
    bridge = object.__new__(LLaMABridge)
    to_hf = bridge._weight_name_mapping_mcore_to_hf
    assert to_hf("decoder.layers.3.input_layernorm.weight") == ["model.layers.3.input_layernorm.weight"]
    assert to_hf("decoder.layers.3.pre_mlp_layernorm.weight") == ["model.layers.3.post_attention_layernorm.weight"]
    assert to_hf("decoder.layers.0.mlp.linear_fc2.weight") == ["model.layers.0.mlp.down_proj.weight"]


def test_a_tied_output_layer_is_loaded_from_the_embedding():
    class Bridge:
        _DIRECT_MAPPING = {"output_layer.weight": "lm_head.weight"}

        def __init__(self, tied):
            self.hf_config = SimpleNamespace(tie_word_embeddings=tied)

        def load_weights(self, models, weights_path):
            return self._DIRECT_MAPPING["output_layer.weight"]

    cpu_megatron._patch_tied_output_layer(SimpleNamespace(Bridge=Bridge))
    tied, untied = Bridge(True), Bridge(False)
    assert tied.load_weights([], "path") == "model.embed_tokens.weight"
    assert "_DIRECT_MAPPING" not in tied.__dict__  # exported names (weight sync) stay mbridge's
    assert untied.load_weights([], "path") == "lm_head.weight"


def test_float32_megatron_weights_are_accepted_on_the_cpu():
    """verl refuses them (``workers/config/engine.py:218``) on every device; with no accelerator the
    backend lets float32 through and keeps verl's other checks (here: SP off when TP=1)."""
    from verl.workers.config import McoreEngineConfig

    config = McoreEngineConfig(dtype="float32", tensor_model_parallel_size=1, sequence_parallel=True)
    assert config.dtype == "float32" and config.sequence_parallel is False
    with pytest.raises(AssertionError, match="dtype float64 not supported"):
        McoreEngineConfig(dtype="float64")


# ---- slow: real runs ----------------------------------------------------------------------------


@pytest.mark.slow
def test_make_verl_smoke_megatron_trains_two_gepo_steps(tmp_path):
    """``make verl-smoke-megatron``: verl's stock main_ppo, Megatron TP=2 over gloo, GEPO."""
    from tests.cpu.test_verl_trainer import _stock_main_ppo

    out = _stock_main_ppo(
        tmp_path,
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gepo",
        preset="cpu_toy_megatron",
    )
    assert re.findall(r"step:(\d+) - .*", out)[:2] == ["1", "2"], out[-4000:]
    for step in ("1", "2"):
        line = re.search(rf"step:{step} - (.*)", out).group(1)
        metrics = dict(re.findall(r"([\w/@.-]+):([-+0-9.eE]+|nan|inf)", line))
        for key in ("actor/is/weight_mean", "actor/is/ess", "actor/pg_loss", "actor/grad_norm"):
            assert key in metrics and math.isfinite(float(metrics[key])), (key, line[:2000])
        # float32 learner (the preset) and float32 sampler: the same probabilities on-policy
        assert float(metrics["training/rollout_probs_diff_max"]) < 1e-3


def _session_processes(sid: int) -> list[int]:
    """Every live process of session ``sid`` (the killed run's driver, Ray's daemons and workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return pids


@pytest.mark.slow
def test_the_verl_engine_on_megatron_survives_a_crash_and_resumes(tmp_path):
    """main_gepo on Megatron TP=2 with the full objective (GSPO's loss, entropy bonus, KL to the
    reference worker), a checkpoint every step, 4 steps: SIGKILL to the whole run (driver, Ray,
    workers) once a checkpoint at step >= 2 is complete; the same command then resumes from that
    checkpoint (model + distributed-optimizer state) and metrics.jsonl holds each step 1..4 once,
    with the KL and entropy terms logged on every step."""
    import signal
    import time

    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "recipe.gepo.main_gepo",
        "--config-dir",
        "configs",
        "+verl_preset=cpu_toy_megatron",
        "hetero.engine=verl",
        "algorithm_preset=gspo",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.05",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "trainer.total_training_steps=4",
        "trainer.save_freq=1",
        "trainer.resume_mode=auto",
        f"trainer.default_local_dir={run_dir}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    tracker = run_dir / "latest_checkpointed_iteration.txt"
    with open(tmp_path / "crashed.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not (tracker.exists() and tracker.read_text().strip() not in ("", "1")):
            assert proc.poll() is None, (tmp_path / "crashed.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint at step 2 within 600 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        for pid in _session_processes(proc.pid):  # anything that left the group (none expected)
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    crashed_at = int(tracker.read_text())
    assert crashed_at < 4 and proc.returncode == -signal.SIGKILL

    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-4000:]
    assert f"Resuming from {run_dir}/global_step_{crashed_at}" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        assert math.isfinite(row["actor/kl_loss"]) and row["actor/entropy_loss"] > 0.0, row
    assert rows[-1]["actor/kl_loss"] > 0.0  # the policy has left the reference


GROUPS, G = 3, 4
TP1 = {"actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1}
MEGATRON = {  # name -> (ranks, overrides of cpu_toy_megatron: TP=2, float32)
    "tp1": (1, TP1),
    "tp2": (2, {}),
    "pp2": (2, {**TP1, "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 2}),
    "dp2": (2, TP1),  # TP=1 PP=1 on 2 ranks: data parallel 2, a prompt group split over the ranks
    "tp2_sp": (
        2,
        {
            "actor_rollout_ref.actor.megatron.sequence_parallel": True,  # optional on the CPU
            "actor_rollout_ref.actor.megatron.override_transformer_config.sequence_parallel": True,
        },
    ),
    "tp2_pp2": (4, {"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 2}),  # 4 ranks
    "tp2_dp2": (4, {}),  # TP=2 on 4 ranks: 2 data-parallel TP groups
    "tp2_bf16": (2, {"actor_rollout_ref.actor.megatron.dtype": "bfloat16"}),  # verl's default dtype
}
AGREEMENT_KEYS = ("actor/pg_loss", "grad_norm", "is/weight_mean", "is/weight_max", "is/weight_min", "is/ess")


COMMON = (
    f"task.cache_dir={ROOT / '.cache' / 'heterorl'}",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",  # groups of 4 split over micro-batches
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.optim.total_training_steps=10",  # set by verl's trainer; Megatron's scheduler needs it
)


def _configs(*overrides: str) -> tuple:
    """(Megatron config, FSDP2 config): cpu_toy_megatron and cpu_toy with the task's files."""
    from recipe.gepo.verl_engine.runner import resolve_task_files
    from tests.cpu import verl_actor as va

    return tuple(resolve_task_files(va.compose(*COMMON, *overrides, preset=p)) for p in ("cpu_toy_megatron", "cpu_toy"))


def _warm_start_groups(cfg) -> tuple:
    """:data:`GROUPS` prompt groups of :data:`G` sampled by the toy warm start, and its tokenizer."""
    from recipe.gepo.embedded.policy import load_policy
    from recipe.gepo.embedded.rollout_groups import RolloutSettings, generate_groups
    from recipe.gepo.embedded.tasks import Task
    from recipe.gepo.sections import TaskConfig

    model, tokenizer = load_policy(cfg.actor_rollout_ref.model.path)
    task = Task(TaskConfig.from_omegaconf(cfg.task), seed=0)
    settings = RolloutSettings(G, float(cfg.actor_rollout_ref.rollout.temperature), 8)
    groups = generate_groups(
        model, tokenizer, task.train_items(GROUPS, 0, 0), task.score, settings, cfg.algorithm, 0, "s0", 0, "b0"
    )
    return groups, tokenizer


@pytest.fixture(scope="module")
def agreement():
    """One on-policy batch from the toy warm start through verl's actor worker on every Megatron
    layout in :data:`MEGATRON` and on FSDP2 (cpu_toy): the log-probs before, the update's metrics,
    the log-probs after."""
    import ray

    from tests.cpu import verl_actor as va

    megatron_cfg, fsdp_cfg = _configs("actor_rollout_ref.actor.policy_loss.loss_mode=gepo")
    groups, tokenizer = _warm_start_groups(megatron_cfg)
    data = va.verl_batch(groups, tokenizer.pad_token_id, va.reduction_of(megatron_cfg))
    runs = [
        (name, va.with_overrides(megatron_cfg, **overrides), ranks) for name, (ranks, overrides) in MEGATRON.items()
    ]
    runs.append(("fsdp", fsdp_cfg, 1))
    results = {}
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        for name, cfg, ranks in runs:
            with va.actor_group(cfg, ranks, f"mc_{name}") as group:
                before = va.log_probs(group, cfg, data)
                metrics = va.update_actor(group, cfg, data)
                results[name] = {"before": before, "metrics": metrics, "after": va.log_probs(group, cfg, data)}
    finally:
        ray.shutdown()
    results["data"] = data
    return results


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["tp2", "pp2", "tp2_sp", "dp2", "tp2_pp2", "tp2_dp2"])
def test_megatron_on_several_ranks_gives_one_ranks_gepo_loss_gradient_and_update(agreement, parallel):
    """float32 split over 2 ranks (TP=2 with and without sequence parallelism, PP=2, DP=2) and 4
    (TP=2 x PP=2, TP=2 x DP=2); groups of 4 split over micro-batches of 2, and over the DP ranks:
    equal to float rounding. Bounds: 1e-5 relative on the loss, the
    gradient norm and the is/* metrics; 2e-5 on the log-probs before and after the step (which
    moves them by more than 1). Measured: 3e-6, 4e-7, <1e-6; 3.3e-6."""
    one, two = agreement["tp1"], agreement[parallel]
    uids = list(agreement["data"].non_tensor_batch["uid"])
    assert len(set(uids[:6]) & set(uids[6:])) == 1  # DP=2 gets 6 sequences each: one group on both ranks
    assert one["metrics"]["actor/has_group_denominator"] == two["metrics"]["actor/has_group_denominator"] == 1.0
    assert torch.allclose(two["before"], one["before"], atol=2e-5)
    for key in AGREEMENT_KEYS:
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key
    assert (one["after"] - one["before"]).abs().max() > 1.0
    assert torch.allclose(two["after"], one["after"], atol=2e-5)


@pytest.mark.slow
def test_megatron_and_fsdp_engines_agree(agreement):
    """Megatron TP=2 against FSDP2, both float32, from the same weights on the same batch: p = q
    on-policy in both; loss, gradient norm and is/* to 1e-4 relative (measured 7e-6, 8e-7);
    updated log-probs within 1e-4 (measured 3e-5, on a move of 2.2)."""
    fsdp, mc = agreement["fsdp"], agreement["tp2"]
    q = agreement["data"].batch["old_log_probs"]
    assert torch.allclose(fsdp["before"], q, atol=2e-5) and torch.allclose(mc["before"], q, atol=2e-5)
    for key in AGREEMENT_KEYS:
        assert mc["metrics"][key] == pytest.approx(fsdp["metrics"][key], rel=1e-4, abs=1e-7), key
    assert torch.allclose(mc["after"], fsdp["after"], atol=1e-4)


@pytest.mark.slow
def test_megatron_in_bf16_agrees_to_bf16_precision_only(agreement):
    """verl's default Megatron dtype (bfloat16; GPUs) on the same batch: p differs from the float32
    q by bf16 rounding (measured up to 5.5e-2 nats), the loss by 1e-3 absolute, the gradient norm
    by 4e-3 relative; bf16 weights also round away much of a 1e-4 Adam step (updated log-probs
    0.39 off on a move of 2.2), which is why the CPU preset runs float32."""
    bf16, fp32 = agreement["tp2_bf16"], agreement["tp2"]
    assert 1e-3 < (bf16["before"] - fp32["before"]).abs().max() < 0.1
    assert bf16["metrics"]["actor/pg_loss"] == pytest.approx(fp32["metrics"]["actor/pg_loss"], abs=2e-3)
    assert bf16["metrics"]["grad_norm"] == pytest.approx(fp32["metrics"]["grad_norm"], rel=1e-2)


# ---- every algorithm preset, with entropy and KL-to-reference -----------------------------------

PRESETS = sorted(p.stem for p in (ROOT / "recipe" / "gepo" / "config" / "algorithm_preset").glob("*.yaml"))
FULL_OBJECTIVE = (  # every term of the actor objective on; lr 0: every preset sees the same weights
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.05",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    "actor_rollout_ref.actor.optim.lr=0.0",
)
OBJECTIVE_KEYS = (
    "actor/pg_loss",
    "grad_norm",
    "kl_loss",
    "actor/entropy_loss",
    "is/weight_mean",
    "is/weight_max",
    "is/weight_min",
)


def _off_policy_batch(data, reduction: str, seed: int):
    """``data`` with q and the reference log-probs moved off the learner's (token noise of 0.1 nats),
    and the GEPO denominators of that q under ``reduction``: ratios away from 1 and a KL term with a
    gradient, so clipping, truncation and the KL/entropy terms all take part."""
    from recipe.gepo.verl_engine import batch_rules
    from verl_ext.algos.worker_loss import GROUP_LOG_DENOMINATOR

    out = data.slice(0, len(data))
    gen = torch.Generator().manual_seed(seed)
    mask = out.batch["response_mask"].float()
    q = out.batch["old_log_probs"] + 0.1 * torch.randn(mask.shape, generator=gen) * mask
    out.batch["old_log_probs"] = out.batch["rollout_log_probs"] = q
    out.batch["ref_log_prob"] = data.batch["old_log_probs"] + 0.1 * torch.randn(mask.shape, generator=gen) * mask
    out.batch[GROUP_LOG_DENOMINATOR] = batch_rules.group_log_denominator(
        q, out.batch["response_mask"], out.non_tensor_batch["uid"], reduction
    )
    return out


@pytest.fixture(scope="module")
def every_preset():
    """Each algorithm preset's loss (plus entropy bonus and KL-to-reference) on one worker group
    per engine, switched with verl's ``set_loss_fn``: Megatron TP=2 and FSDP2, same warm-start
    weights (lr 0), same off-policy batch. Returns ``{engine: {preset: metrics}}`` and the log-probs
    before and after all the calls."""
    import ray
    from verl.utils.config import omega_conf_to_dataclass

    from verl_ext.algos.worker_loss import hetero_ppo_loss
    from tests.cpu import verl_actor as va
    from verl_ext.algos.objective import rollout_correction_settings

    configs = {p: _configs(*FULL_OBJECTIVE, f"algorithm_preset={p}") for p in PRESETS}
    groups, tokenizer = _warm_start_groups(configs["gepo"][0])
    base = va.verl_batch(groups, tokenizer.pad_token_id, "mean")
    results = {}
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        for index, (engine, ranks) in enumerate((("megatron", 2), ("fsdp", 1))):
            first = configs[PRESETS[0]][index]
            with va.actor_group(first, ranks, f"presets_{engine}") as group:
                runs = {"before": va.log_probs(group, first, base)}
                for preset in PRESETS:
                    cfg = configs[preset][index]
                    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
                    group.set_loss_fn(partial(hetero_ppo_loss, config=actor))
                    runs[preset] = va.update_actor(group, cfg, _off_policy_batch(base, va.reduction_of(cfg), seed=1))
                runs["after"] = va.log_probs(group, first, base)
            results[engine] = runs
    finally:
        ray.shutdown()
    # presets whose difference from their base is verl's driver-side rollout correction (not in this batch)
    results["corrected"] = {p for p in PRESETS if rollout_correction_settings(configs[p][0].algorithm) is not None}
    return results


@pytest.mark.slow
def test_every_preset_with_entropy_and_kl_gives_fsdps_loss_on_megatron(every_preset):
    """Every algorithm preset (GEPO, every baseline's and newer method's loss, aggregation and
    clipping) with the entropy bonus and the KL-to-reference term on: Megatron TP=2 computes the
    FSDP2 engine's policy loss, KL and entropy terms, gradient norm and is/* metrics to 1e-4
    relative (float32)."""
    megatron, fsdp = every_preset["megatron"], every_preset["fsdp"]
    assert torch.allclose(megatron["after"], megatron["before"]) and torch.allclose(fsdp["after"], fsdp["before"])
    norms: dict[float, list[str]] = {}
    for preset in PRESETS:
        mc, ref = megatron[preset], fsdp[preset]
        for key in OBJECTIVE_KEYS:
            assert key in mc and math.isfinite(mc[key]), (preset, key)
            assert mc[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (preset, key, mc[key], ref[key])
        assert mc["kl_loss"] > 1e-4 and mc["actor/entropy_loss"] > 0.1, preset  # both terms really computed
        norms.setdefault(round(mc["grad_norm"], 6), []).append(preset)
    # the presets differ, except where this batch cannot tell them apart: the rollout-correction presets
    # are their base's loss here (their weights come from verl's driver), and with q only ~0.1 nats off
    # p few ratios reach a clip band or M2PO's mask, so losses that differ only there coincide
    alike = ({"bnpo", "grpo", "grpo_paper", "m2po"}, {"gepo_tr", "gepo_tc", "gepo_tc_ess"}, {"gspo", "gspo_wide"})
    for names in norms.values():
        names = set(names) - every_preset["corrected"]
        assert len(names) <= 1 or any(names <= family for family in alike), names


# ---- weight sync from Megatron shards -----------------------------------------------------------


@pytest.mark.slow
def test_samplers_hold_the_exact_version_pushed_from_megatron_shards():
    """Megatron TP=2 behind verl's real checkpoint manager (ray_mailbox) and an hf_cpu replica:
    version 0 reaches the samplers bit for bit as the HF checkpoint it was loaded from (the TP
    shards gathered and renamed exactly); with a constant 2-step weight delay the samplers hold, at
    step v + 2, exactly the weights they got at step v without delay (restored from the learner's
    CPU snapshot of its shards), and the learner never trains on pushed-back weights."""
    import ray
    from verl.workers.rollout.llm_server import LLMServerManager

    from recipe.gepo.embedded.policy import load_policy
    from recipe.gepo.verl_engine.delayed_sync import DelayedSyncSchedule
    from tests.cpu import verl_actor as va
    from verl_ext.cpu.rollout import state_checksum
    from verl_ext.hetero.delay import make_delay_model

    cfg, _ = _configs("actor_rollout_ref.actor.policy_loss.loss_mode=gepo")
    groups, tokenizer = _warm_start_groups(cfg)
    data = va.verl_batch(groups, tokenizer.pad_token_id, va.reduction_of(cfg))
    hf_model, _ = load_policy(cfg.actor_rollout_ref.model.path)
    loaded = state_checksum(dict(hf_model.named_parameters()))
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        replicas = LLMServerManager.create(config=cfg, start_rank=0).get_replicas()
        now = DelayedSyncSchedule(make_delay_model("none"), "steps", max_pending=4)
        truth, truth_learner, _ = va.sync_run(cfg, data, replicas, now, "mc_sync_now", 4, n_ranks=2)
        delayed = DelayedSyncSchedule(make_delay_model("constant", value=2.0), "steps", max_pending=4)
        served, learner, manager = va.sync_run(cfg, data, replicas, delayed, "mc_sync_delayed", 4, n_ranks=2)
    finally:
        ray.shutdown()
    assert truth[0] == loaded
    assert len(set(truth)) == 4  # every update changed the weights the samplers get
    assert served == [truth[0], truth[0], truth[0], truth[1]]
    assert manager.pushed == [0, 1]
    for mine, expected in zip(learner, truth_learner):
        assert torch.allclose(mine, expected, atol=1e-6)
