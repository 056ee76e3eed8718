"""The embedded engine's device and precisions (hetero.device, hetero.learner_precision,
hetero.sampler_precision): values checked at start naming the key, CUDA refused where there is
none, the verl engine refusing all three (naming verl's own keys), bf16 learner and sampler
running for real on the CPU, and every tensor of a learner step and a sampler's batch on the
configured device, none made on a default device by the engine's code."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from recipe.gepo.embedded.engine_config import EngineConfig
from recipe.gepo.embedded.learner import Learner
from recipe.gepo.embedded.model_placement import Placement, cpu_copy
from recipe.gepo.embedded.rollout_groups import RolloutSettings, generate_groups
from recipe.gepo.embedded.tasks import Task
from recipe.gepo.main_gepo import run, run_local
from recipe.gepo.options import OptionNotHonoured
from recipe.gepo.sections import HeteroConfig
from verl_ext.trust.bounds import TOLERANCES, bounds_file_payload

from .helpers import read_metrics, train_lines

ROOT = Path(__file__).resolve().parents[3]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ------------------------------------------------------------------------------ values at start


@pytest.mark.parametrize(
    "key, value",
    [
        ("device", "gpu"),
        ("device", "cuda:"),
        ("device", "cuda:x"),
        ("device", "CPU"),
        ("device", "meta"),
        ("learner_precision", "fp16"),
        ("sampler_precision", "bfloat16"),
    ],
)
def test_bad_values_fail_naming_the_key(key, value):
    with pytest.raises(ValueError, match=re.escape(f"hetero.{key}={value!r}")):
        HeteroConfig(**{key: value})


def test_good_values_pass():
    for device in ("cpu", "cuda", "cuda:0", "cuda:12"):
        assert HeteroConfig(device=device, mode="replay").device == device
    HeteroConfig(learner_precision="bf16", sampler_precision="bf16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_is_refused_where_there_is_none(tiny_cfg, tmp_path, device):
    run_dir = tmp_path / "run"
    cfg = tiny_cfg(run_dir, "hetero.mode=replay", f"hetero.device={device}")
    with pytest.raises(ValueError, match=re.escape(f"hetero.device={device!r}: CUDA is not available")):
        run_local(cfg)
    assert not run_dir.exists()  # before any work


@pytest.mark.parametrize(
    "override", ["hetero.device=cuda", "hetero.learner_precision=bf16", "hetero.sampler_precision=bf16"]
)
def test_the_verl_engine_refuses_them_naming_its_own_keys(override):
    from hydra import compose, initialize_config_dir

    from recipe.gepo.verl_engine.launch_plan import build_plan

    searchpath = f"hydra.searchpath=[pkg://verl.trainer.config,file://{ROOT / 'configs'}]"
    with initialize_config_dir(config_dir=str(ROOT / "recipe" / "gepo" / "config"), version_base=None):
        cfg = compose(config_name="gepo_trainer", overrides=[searchpath, "+verl_preset=qwen3_1p7b_fsdp", override])
    key = override.split("=")[0]
    with pytest.raises(OptionNotHonoured, match=f"{re.escape(key)}=.* is not honoured by hetero.engine=verl") as err:
        build_plan(cfg)
    for verl_key in (
        "trainer.device",
        "actor_rollout_ref.actor.fsdp_config.model_dtype",
        "actor_rollout_ref.actor.fsdp_config.dtype",
        "actor_rollout_ref.rollout.dtype",
    ):
        assert verl_key in str(err.value)


# ------------------------------------------------------------------------------ bf16 on the CPU, for real


def _replay(tiny_cfg, run_dir, *overrides):
    # max_delay=0: every batch on-policy, so the sampler/learner mismatch is precision alone
    cfg = tiny_cfg(
        run_dir,
        "hetero.mode=replay",
        "hetero.max_delay=0",
        "trainer.total_training_steps=3",
        "trainer.test_freq=0",
        *overrides,
    )
    run(cfg)
    return train_lines(read_metrics(run_dir))


def test_bf16_learner_and_sampler_train_and_mismatch_more_than_fp32(tiny_cfg, tmp_path):
    fp32 = _replay(tiny_cfg, tmp_path / "fp32")
    bf16 = _replay(tiny_cfg, tmp_path / "bf16", "hetero.learner_precision=bf16", "hetero.sampler_precision=bf16")
    assert len(fp32) == len(bf16) == 3
    for line in bf16:
        for name in ("actor/loss", "actor/grad_norm", "is/kl_sampler_learner", "reward/mean"):
            assert math.isfinite(line[name]), (line["step"], name)
        assert line["actor/nonfinite_skipped"] == 0
    # on-policy in fp32, the sampler's q and the learner's p agree to float rounding; bf16 on
    # both sides (different kernels: incremental generation vs one forward) does not
    kl32 = max(line["is/kl_sampler_learner"] for line in fp32)
    kl16 = min(line["is/kl_sampler_learner"] for line in bf16)
    assert kl32 < 1e-6 and kl16 > 10 * max(kl32, 1e-9), (kl32, kl16)
    # the checkpoint: fp32 master weights and AdamW state, all on the CPU
    from verl_ext.rundir import load_latest_checkpoint

    state = load_latest_checkpoint(tmp_path / "bf16")["learner"]
    params = list(state["model"].values())
    moments = [t for s in state["optimizer"]["state"].values() for t in s.values() if t.dim() > 0]
    assert params and moments
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in params + moments)


@pytest.mark.slow  # ~19 s; test_bf16_learner_and_sampler_train_and_mismatch_more_than_fp32 stays in the default run
def test_async_mode_runs_bf16_learner_and_samplers_and_checks_their_q(tiny_cfg, tiny_model_path, tmp_path):
    """Async mode honours both precisions; the trust gate re-scores every group's q with a model in
    the sampler's precision, so honest bf16 samplers pass every check (no quarantine)."""
    bounds = tmp_path / "bounds_bf16.json"  # a bf16 scorer needs bounds for its model: the table's values here
    measured = {"model": str(tiny_model_path), "scorer_precision": "bf16", "temperature": 1.0}
    bounds.write_text(json.dumps(bounds_file_payload("bf16", TOLERANCES["bf16"], measured)))
    cfg = tiny_cfg(
        tmp_path,
        "hetero.mode=async",
        "hetero.num_samplers=1",
        "hetero.learner_precision=bf16",
        "hetero.sampler_precision=bf16",
        "hetero.trust.verify_fraction=1.0",
        f"hetero.trust.bounds_file={bounds}",
        "hetero.delay.dist=none",
        "hetero.wait_timeout_s=120",
        "trainer.total_training_steps=3",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
    )
    final = run(cfg)
    lines = train_lines(read_metrics(tmp_path))
    assert len(lines) == 3 and final["training/policy_version"] == 3
    assert all(math.isfinite(line["actor/loss"]) and math.isfinite(line["actor/grad_norm"]) for line in lines)
    assert final["trust/checked"] > 0 and final["trust/failed"] == 0 and final["trust/quarantined"] == 0


def test_precision_only_where_asked(tiny_model_path):
    """The sampler's model is held in its precision; the learner's master weights stay fp32 and
    its forward runs under autocast only when asked."""
    mixed = Placement("cpu", "bf16", "bf16")
    sampler, _ = mixed.load_sampler(tiny_model_path)
    learner, _ = mixed.load_learner(tiny_model_path)
    assert {p.dtype for p in sampler.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in learner.parameters()} == {torch.float32}
    assert mixed.learner_compute_dtype == torch.bfloat16
    assert Placement("cpu", "fp32", "fp32").learner_compute_dtype is None
    # weights published by the fp32 learner load into the bf16 sampler, rounded
    sampler.load_state_dict(cpu_copy(dict(learner.state_dict())))
    name, weight = next(iter(learner.state_dict().items()))
    assert torch.equal(sampler.state_dict()[name], weight.to(torch.bfloat16))


# ------------------------------------------------------------------------------ every tensor on the device

FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.arange,
    torch.tensor,
    torch.as_tensor,
    torch.linspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
}
TORCH_DIR = str(Path(torch.__file__).parent)
# the code this test holds to the rule: the embedded engine and the sampling module
AUDITED = (str(ROOT / "recipe" / "gepo" / "embedded"), str(ROOT / "verl_ext" / "sampling.py"))


class DeviceAudit(TorchFunctionMode):
    """Records every torch call made from the audited code that creates a tensor without naming
    its device: on a GPU run it would land on the default device, the CPU, beside the model's
    tensors (what no CPU run can see otherwise). ``calls``: the audited calls seen."""

    def __init__(self):
        super().__init__()
        self.found, self.calls = [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(AUDITED):
            return out
        self.calls += 1
        where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {getattr(func, '__name__', func)}"
        if func in FACTORIES and kwargs.get("device") is None:
            self.found.append(f"{where}: no device=")
        return out


def _groups(model, tokenizer, task, engine, n=2):
    settings = RolloutSettings(engine.settings.group_size, engine.settings.temperature, engine.settings.max_new_tokens)
    return generate_groups(
        model,
        tokenizer,
        task.train_items(n, stream=1, index=0),
        task.score,
        settings,
        engine.algorithm,
        policy_version=0,
        sampler_id="s",
        seed=3,
        uid_prefix="u",
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_tensor_of_a_step_is_on_the_configured_device(tiny_cfg, tmp_path, device, precision):
    cfg = tiny_cfg(
        tmp_path,
        "hetero.mode=replay",
        f"hetero.device={device}",
        f"hetero.learner_precision={precision}",
        f"hetero.sampler_precision={precision}",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.use_kl_loss=true",
    )
    engine = EngineConfig.from_omegaconf(cfg)
    placement = Placement.of(engine.hetero)
    expected = placement.torch_device
    model_path = str(cfg.actor_rollout_ref.model.path)
    task = Task(engine.task, 0)
    sampler, tokenizer = placement.load_sampler(model_path)
    learner_model, _ = placement.load_learner(model_path)
    learner = Learner(
        learner_model,
        engine.actor,
        engine.settings.temperature,
        tokenizer.pad_token_id,
        compute_dtype=placement.learner_compute_dtype,
    )

    seen: list[torch.Tensor] = []
    hook = lambda _m, _a, out: seen.append(out.logits)  # noqa: E731
    handles = [m.register_forward_hook(hook) for m in (sampler, learner_model, learner.reference)]
    audit = DeviceAudit()
    try:
        with audit:
            groups = _groups(sampler, tokenizer, task, engine)
            metrics = learner.train_step(groups)
    finally:
        for h in handles:
            h.remove()
    assert audit.calls > 20  # the audit saw the engine's calls
    assert not audit.found, "\n".join(audit.found)
    assert math.isfinite(metrics["actor/loss"]) and learner.version == 1
    # the models ran where they were put, in their precision
    assert seen and all(t.device == expected for t in seen)
    if precision == "bf16":
        assert {t.dtype for t in seen} == {torch.bfloat16}
    else:
        assert {t.dtype for t in seen} == {torch.float32}
    assert all(p.device == expected and p.dtype == torch.float32 for p in learner_model.parameters())
    moments = [t for s in learner.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert moments and all(t.device == expected and t.dtype == torch.float32 for t in moments)
    # what leaves the device: groups (numpy), the learner's state (CPU)
    state = learner.state_dict()
    assert all(t.device.type == "cpu" for t in state["model"].values())
