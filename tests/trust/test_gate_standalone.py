"""The trust package stands alone: a gate built from a config, a buffer and a model the caller
supplies -- no Ray, no engine -- admits an honest group and refuses a lie about its log-probs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys

    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from verl_ext.trust.config import TrustConfig
    from verl_ext.hetero.buffer import RolloutBuffer
    from verl_ext.hetero.records import RecordRejected, RolloutGroup
    from verl_ext.hetero.weights import serialize_state_dict
    from verl_ext.trust import build_gate, build_verifier
    from verl_ext.trust.verifier import group_log_probs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    config = TrustConfig(verify_fraction=1.0, check_rewards=False)
    config.validate()
    buffer = RolloutBuffer(max_delay=2)
    verifier = build_verifier(config, None, None, 1.0, {"adv_estimator": "grpo"}, keep_versions=3, scorer=model)
    gate = build_gate(config, buffer, verifier)
    gate.remember(0, serialize_state_dict(model.state_dict(), 0))

    rng = np.random.default_rng(0)

    def group(uid, sampler):
        g = RolloutGroup(
            group_uid=uid, prompt_ids=rng.integers(1, 32, size=4).astype(np.int64),
            response_ids=rng.integers(1, 32, size=(4, 5)).astype(np.int64),
            response_mask=np.ones((4, 5), np.int8), sampler_logprobs=np.zeros((4, 5), np.float32),
            rewards=np.array([1, 0, 0, 1], np.float32), advantages=np.array([1, -1, -1, 1], np.float32),
            policy_version=0, sampler_id=sampler, created_at=0.0, sampler_precision="fp32")
        g.sampler_logprobs = group_log_probs(model, g, 1.0)
        return g

    honest = group("h0", "honest")
    print("honest", gate.admit(honest))
    liar = group("l0", "liar")
    liar.sampler_logprobs = liar.sampler_logprobs * 1.5
    try:
        gate.admit(liar)
        print("liar admitted")
    except RecordRejected as refused:
        print("liar", refused.reason)
    print("liar status", gate.ledger.refusal("liar"))
    loaded = sorted(m for m in sys.modules if m in ("ray", "recipe") or m.startswith(("ray.", "recipe.")))
    print("loaded", loaded)
    """
)


def test_a_gate_without_ray_or_an_engine_admits_the_honest_and_quarantines_a_liar():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "honest True" in lines  # re-scored (probation) and vouched for
    assert "liar bad_logprobs" in lines
    assert "liar status quarantined" in lines
    assert "loaded []" in lines, lines
