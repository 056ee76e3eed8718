"""scripts/bench/bench_weight_delta.py measures what the engine's WeightStore publishes: the
fraction of bf16 elements changed, full bf16 bytes against the delta message, and every delta
applies back to the exact bits of its version (checked here with ``apply_delta``, not only by
the script's own flag). The fast tests drive the meter with real AdamW steps of a small torch
model; the slow one runs the script on the toy task's warm start for two real GEPO steps."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from verl_ext.hetero.protocol import version_key
from verl_ext.hetero.weights import apply_delta, floating_bits, serialize_state_dict, wire_tensors

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_weight_delta", REPO / "scripts" / "bench" / "bench_weight_delta.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, dtypes, shapes and bytes."""
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype
        and a[n].shape == b[n].shape
        and np.array_equal(a[n].contiguous().view(torch.uint8).numpy(), b[n].contiguous().view(torch.uint8).numpy())
        for n in a
    )


class _Recording:
    """Wraps a meter: keeps each published version's bf16 wire tensors (as the samplers get them)."""

    def __init__(self, meter):
        self.meter, self.wire = meter, {}

    def publish(self, weights, version):
        self.wire[version] = {n: t.clone() for n, t in wire_tensors(weights, "bf16")[0].items()}
        self.meter.publish(weights, version)


def _check_deltas(recording: _Recording) -> int:
    """Apply every delta the store still holds to the version before it; returns how many."""
    meter, checked = recording.meter, 0
    for version in meter.store.delta_versions():
        delta = meter.transport.get(meter.store.delta_topic, version_key(version))
        got, target, _, _ = apply_delta(delta, recording.wire[version - 1])
        assert got == version
        assert _bits_equal(target, recording.wire[version])
        checked += 1
    return checked


def _adamw_versions(lr: float, steps: int) -> list[dict[str, torch.Tensor]]:
    """State dicts of a small model (tied-free fp32 layers and an integer buffer) after each of
    ``steps`` AdamW steps at ``lr``, version 0 first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    model.register_buffer("step_count", torch.zeros(3, dtype=torch.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    for i in range(steps):
        ids = torch.randint(0, 64, (16, 8))
        loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, 64), ids.roll(1, dims=1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.step_count += i + 1  # a non-floating tensor that changes: it travels whole in the delta
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


@pytest.mark.parametrize("lr", [1e-2, 1e-5])
def test_the_meter_measures_the_engines_messages(bench, lr):
    recording = _Recording(bench.DeltaMeter())
    versions = _adamw_versions(lr, 3)
    for version, state in enumerate(versions):
        recording.publish(state, version)
    rows = recording.meter.rows
    assert [r["version"] for r in rows] == [1, 2, 3] and recording.meter.params == 64 * 32 + 32 * 64 + 64
    for row, state in zip(rows, versions[1:]):
        assert 0 < row["bf16_changed_frac"] <= row["fp32_changed_frac"] <= 1
        assert row["full_bf16_bytes"] == len(serialize_state_dict(state, row["version"], "bf16"))
        assert row["full_bf16_bytes"] == row["full_bf16_bytes_serialize"]
        assert row["xor_bytes"] < row["delta_bytes"]  # the message carries the XOR plus its header
        assert row["delta_exact"] is True
    if lr == 1e-5:  # few bf16 values move at a small lr: the delta is a fraction of a version
        assert all(r["bf16_changed_frac"] < 0.5 and r["delta_bytes"] < r["full_bf16_bytes"] / 2 for r in rows)
    else:  # lr 1e-2 moves most weights by more than a bf16 ulp (2^-8 of their size)
        assert all(r["bf16_changed_frac"] > 0.5 for r in rows), [r["bf16_changed_frac"] for r in rows]
    # the fraction is of the bf16 elements, as the engine's wire carries them
    bits = [floating_bits(wire_tensors(s, "bf16")[0]).view(np.uint16) for s in versions[-2:]]
    assert rows[-1]["bf16_changed_frac"] == pytest.approx(np.mean(bits[0] != bits[1]))
    assert _check_deltas(recording) == 2  # keep_last=2: the deltas of the two newest versions


def test_a_delta_applied_to_other_bits_fails_loudly(bench, monkeypatch):
    """A meter whose held base is not the published version stops instead of reporting bytes."""
    meter = bench.DeltaMeter()
    versions = _adamw_versions(1e-3, 1)
    meter.publish(versions[0], 0)
    version, wire, bits, fp32 = meter._prev
    wire = {n: t.clone() for n, t in wire.items()}
    next(t for t in wire.values() if t.is_floating_point()).view(torch.int16)[0] ^= 1  # one bit off
    meter._prev = (version, wire, bits, fp32)
    with pytest.raises(ValueError, match="other bits"):
        meter.publish(versions[1], 1)


def test_help_documents_every_flag_and_lr_takes_a_number_without_a_preset(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--lr", "--steps", "--seed", "--prompts", "--group-size", "--out", "--format"):
        assert flag in text
    assert bench.resolve_lr("1e-6", "smollm2") == (1e-6, "--lr")
    with pytest.raises(SystemExit, match="neither a number nor a preset"):
        bench.resolve_lr("no_such_preset", "toy")


@pytest.mark.slow  # two real GEPO steps of the toy model through the script (~15-30 s, most of it imports)
def test_two_real_gepo_steps_of_the_toy_model(bench, tmp_path, monkeypatch):
    recordings = []

    class Meter(bench.DeltaMeter):
        def __init__(self):
            super().__init__()
            recordings.append(_Recording(self))

        def publish(self, weights, version):
            recordings[-1].wire[version] = {n: t.clone() for n, t in wire_tensors(weights, "bf16")[0].items()}
            super().publish(weights, version)

    monkeypatch.setattr(bench, "DeltaMeter", Meter)
    threads = torch.get_num_threads()
    out = tmp_path / "delta.json"
    try:
        # the qwen3 presets' lr (1e-6, from paper_online.yaml through the preset's defaults)
        bench.main(["--model", "toy", "--steps", "2", "--lr", "qwen3_1p7b_fsdp", "--out", str(out), "--quiet"])
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    meta, rows = result["meta"], result["rows"]
    assert meta["lr"] == 1e-6 and meta["lr_source"].endswith("qwen3_1p7b_fsdp.yaml") and meta["loss_mode"] == "gepo"
    assert meta["params"] == 1_053_824
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 0 < row["bf16_changed_frac"] <= 1 and 0 < row["fp32_changed_frac"] <= 1
        assert row["grad_norm"] > 0  # a real update, not an all-equal-rewards step
        assert row["delta_bytes"] < row["full_bf16_bytes"] / 2
        assert row["delta_exact"] is True
    assert _check_deltas(recordings[0]) == 2
