"""Sampling with the sampler's log-probs (verl_ext/sampling.py) and the ``hf_cpu`` rollout server
(verl_ext/cpu/rollout.py), on the project's untrained ~1M-parameter toy Llama (fp32, real HF model).

What is pinned:

- ``prepare_toy_assets`` writes a HF model folder and parquet files verl can read (``data_source``
  ``toy_add3``);
- ``sample_continuations``: lengths within ``max_new_tokens``; a finished continuation ends on its
  first EOS; the reported log q equals ``log_softmax(logits / T)`` of a teacher-forced forward pass
  over prompt + continuation (T = 1, 0.7; greedy and top-k report the untruncated softmax too);
  greedy is deterministic and follows the argmax; the same seed gives the same samples;
- ``HFCPUServer`` (in-process, built from verl's own ``RolloutConfig``/``HFModelConfig``): verl's
  ``TokenOutput`` with log-probs tagged with the weight version, concurrent requests batched with
  correct log-probs, real weight loading (checksum, log-probs, version) and refusals of state dicts
  that do not fit the model.
"""

from __future__ import annotations

import asyncio

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import TokenOutput

from verl_ext.cpu.rollout import HFCPUServer, state_checksum
from verl_ext.data.toy_assets import prepare_toy_assets
from verl_ext.sampling import sample_continuations

PROMPT_TEXTS = ["1+2=", "12+34=", "864+394=", "5+77=", "903+18=", "6+6=", "450+450=", "31+9="]
RESPONSE_LENGTH = 8
TOL = 1e-4
CALL_TIMEOUT_S = 120  # a hung request fails the test instead of the run


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return prepare_toy_assets(tmp_path_factory.mktemp("toy"), n_train=16, n_val=8)


@pytest.fixture(scope="module")
def model_config(assets):
    return omega_conf_to_dataclass(OmegaConf.create({"path": str(assets.model_path)}), dataclass_type=HFModelConfig)


@pytest.fixture(scope="module")
def tokenizer(model_config):
    return model_config.tokenizer


@pytest.fixture(scope="module")
def model(assets):
    return AutoModelForCausalLM.from_pretrained(assets.model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(text) for text in PROMPT_TEXTS]


def teacher_forced_log_probs(model, prompt: list[int], continuation: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) at each continuation token, from one unpadded forward pass."""
    ids = torch.tensor([list(prompt) + list(continuation)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    start = len(prompt) - 1  # logits at t predict token t + 1
    step_logits = logits[start : start + len(continuation)]
    log_q = F.log_softmax(step_logits / temperature, dim=-1)
    return log_q.gather(-1, torch.tensor(continuation).unsqueeze(-1)).squeeze(-1).tolist()


def greedy_tokens(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


# ---- toy assets ---------------------------------------------------------------------------------


def test_toy_assets_are_a_hf_folder_and_readable_parquet(assets):
    """The model folder has a config and weights; both parquet files read back with pyarrow with
    the toy task's data_source and the requested row counts."""
    assert (assets.model_path / "config.json").is_file()
    assert any(assets.model_path.glob("*.safetensors"))
    for path, n in ((assets.train_file, 16), (assets.val_file, 8)):
        rows = pq.read_table(path).to_pylist()
        assert len(rows) == n
        assert {row["data_source"] for row in rows} == {"toy_add3"}
        assert all(row["prompt"][0]["content"].endswith("=") for row in rows)


# ---- sample_continuations -----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_equal_teacher_forced_log_softmax(model, tokenizer, prompts, temperature):
    """Shapes, EOS handling and q = log_softmax(logits / T) at each sampled token (left-padded batch
    vs unpadded teacher forcing)."""
    eos = [tokenizer.eos_token_id]
    max_new = 10
    outs = sample_continuations(model, prompts, max_new, eos, tokenizer.pad_token_id, temperature, generator_seed=3)
    assert len(outs) == len(prompts)
    finished = [o for o in outs if o.finished]
    assert finished and len(finished) < len(outs), "the seed should give both finished and cut-off rows"
    for prompt, out in zip(prompts, outs):
        assert 1 <= len(out.token_ids) <= max_new
        assert len(out.log_probs) == len(out.token_ids)
        if out.finished:
            assert out.token_ids[-1] in eos
            assert not set(out.token_ids[:-1]) & set(eos)
        else:
            assert len(out.token_ids) == max_new and not set(out.token_ids) & set(eos)
        expected = teacher_forced_log_probs(model, prompt, out.token_ids, temperature)
        assert torch.allclose(torch.tensor(out.log_probs), torch.tensor(expected), atol=TOL, rtol=0)


def test_greedy_is_deterministic_and_follows_the_argmax(model, tokenizer, prompts):
    """temperature=0: two calls agree, tokens are the argmax chain, log-probs those of softmax(logits)."""
    pad, eos = tokenizer.pad_token_id, [tokenizer.eos_token_id]
    first = sample_continuations(model, prompts[:4], 6, eos, pad, temperature=0.0)
    torch.manual_seed(12345)  # greedy must not depend on the RNG
    second = sample_continuations(model, prompts[:4], 6, eos, pad, temperature=0.0)
    assert first == second
    for prompt, out in zip(prompts[:4], first):
        assert out.token_ids == greedy_tokens(model, prompt, 6)[: len(out.token_ids)]
        expected = teacher_forced_log_probs(model, prompt, out.token_ids, 1.0)
        assert torch.allclose(torch.tensor(out.log_probs), torch.tensor(expected), atol=TOL, rtol=0)


def test_same_seed_same_samples_other_seed_other_samples(model, tokenizer, prompts):
    pad, eos = tokenizer.pad_token_id, [tokenizer.eos_token_id]
    a = sample_continuations(model, prompts, 8, eos, pad, 1.0, generator_seed=11)
    b = sample_continuations(model, prompts, 8, eos, pad, 1.0, generator_seed=11)
    c = sample_continuations(model, prompts, 8, eos, pad, 1.0, generator_seed=12)
    assert a == b
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_top_k_truncates_sampling_but_not_the_reported_log_probs(model, tokenizer, prompts):
    """top_k=1 samples the argmax, yet the log-probs are those of the full softmax(logits / T)
    (what verl's actor computes), not log 1 = 0."""
    pad, eos = tokenizer.pad_token_id, [tokenizer.eos_token_id]
    outs = sample_continuations(model, prompts[:3], 5, eos, pad, temperature=0.7, top_k=1, generator_seed=5)
    for prompt, out in zip(prompts[:3], outs):
        assert out.token_ids == greedy_tokens(model, prompt, 5)[: len(out.token_ids)]
        expected = teacher_forced_log_probs(model, prompt, out.token_ids, 0.7)
        assert torch.allclose(torch.tensor(out.log_probs), torch.tensor(expected), atol=TOL, rtol=0)
        assert max(out.log_probs) < 0


def test_sampling_refuses_bad_arguments(model, tokenizer, prompts):
    pad, eos = tokenizer.pad_token_id, [tokenizer.eos_token_id]
    with pytest.raises(ValueError, match="max_new_tokens"):
        sample_continuations(model, prompts[:1], 0, eos, pad)
    with pytest.raises(ValueError, match="temperature"):
        sample_continuations(model, prompts[:1], 4, eos, pad, temperature=-0.1)
    with pytest.raises(ValueError, match="at least one token"):
        sample_continuations(model, [[]], 4, eos, pad)


# ---- HFCPUServer in-process ---------------------------------------------------------------------


def rollout_config(max_num_seqs: int = 4) -> RolloutConfig:
    """verl's RolloutConfig as verl builds it (omegaconf -> dataclass), with the hf_cpu fields."""
    node = OmegaConf.create(
        {
            "name": "hf_cpu",
            "prompt_length": 16,
            "response_length": RESPONSE_LENGTH,
            "dtype": "float32",
            "max_num_seqs": max_num_seqs,
            "calculate_log_probs": True,
            "tensor_model_parallel_size": 1,
        }
    )
    return omega_conf_to_dataclass(node, dataclass_type=RolloutConfig)


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: the server's batching task lives on the loop of its first call."""
    loop = asyncio.new_event_loop()
    yield loop
    close_loop(loop)


def close_loop(loop) -> None:
    """Cancel what still runs on ``loop`` (the server's batching task) and close it."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending))
    loop.close()


@pytest.fixture(scope="module")
def server(model_config):
    return HFCPUServer(rollout_config(), model_config)


def run(loop, coro, timeout: float = CALL_TIMEOUT_S):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


def test_server_built_from_verl_configs(server, model_config):
    assert isinstance(server.config, RolloutConfig) and isinstance(server.model_config, HFModelConfig)
    assert server.eos_token_ids[0] == model_config.tokenizer.eos_token_id
    assert next(server.model.parameters()).dtype == torch.float32


def test_generate_returns_token_output_tagged_with_weight_version(loop, server, prompts):
    """verl's TokenOutput: equal-length token ids and log-probs within response_length, tagged with
    the version set_global_steps set; no log-probs when not asked; max_tokens is honoured."""
    run(loop, server.set_global_steps(7))
    out = run(
        loop,
        server.generate(prompt_ids=prompts[1], sampling_params={"temperature": 1.0, "logprobs": True}, request_id="r"),
    )
    assert isinstance(out, TokenOutput)
    assert 1 <= len(out.token_ids) <= RESPONSE_LENGTH
    assert out.log_probs is not None and len(out.log_probs) == len(out.token_ids)
    assert out.extra_fields["global_steps"] == 7

    quiet = run(loop, server.generate(prompt_ids=prompts[1], sampling_params={"temperature": 1.0}, request_id="q"))
    assert quiet.log_probs is None and quiet.token_ids
    short = run(
        loop,
        server.generate(prompt_ids=prompts[1], sampling_params={"temperature": 1.0, "max_tokens": 2}, request_id="s"),
    )
    assert 1 <= len(short.token_ids) <= 2


def test_concurrent_generates_complete_with_correct_log_probs(loop, server, prompts):
    """Eight concurrent requests (prompts of different lengths, more than max_num_seqs=4) all
    complete; each one's log-probs equal teacher forcing, so left-padded batching is right."""
    run(loop, server.set_global_steps(3))

    async def burst():
        return await asyncio.gather(
            *[
                server.generate(
                    prompt_ids=p, sampling_params={"temperature": 1.0, "logprobs": True}, request_id=f"c{i}"
                )
                for i, p in enumerate(prompts)
            ]
        )

    outs = run(loop, burst())
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs):
        assert 1 <= len(out.token_ids) <= RESPONSE_LENGTH and len(out.log_probs) == len(out.token_ids)
        assert out.extra_fields["global_steps"] == 3
        expected = teacher_forced_log_probs(server.model, prompt, out.token_ids, 1.0)
        assert torch.allclose(torch.tensor(out.log_probs), torch.tensor(expected), atol=TOL, rtol=0)


def test_bad_request_fails_alone(loop, server, prompts):
    """A request the sampler refuses (negative temperature) raises to its caller; the server keeps serving."""
    with pytest.raises(ValueError, match="temperature"):
        run(loop, server.generate(prompt_ids=prompts[0], sampling_params={"temperature": -1.0}, request_id="bad"))
    ok = run(loop, server.generate(prompt_ids=prompts[0], sampling_params={"temperature": 1.0}, request_id="ok"))
    assert ok.token_ids


def test_update_weights_loads_new_weights_and_tags_them(loop, server, prompts):
    """Scaled weights: the checksum changes (and is what update_weights returns), parameters hold
    the new values, greedy log-probs change, and outputs carry the new global_steps."""
    original = {k: v.clone() for k, v in server.model.state_dict().items()}
    greedy = {"temperature": 0.0, "logprobs": True}
    before_sum = run(loop, server.weight_checksum())
    before = run(loop, server.generate(prompt_ids=prompts[2], sampling_params=dict(greedy), request_id="b"))
    updates = run(loop, server.status())["weight_updates"]
    try:
        scaled = {k: v * 0.5 for k, v in original.items()}
        returned = run(loop, server.update_weights(scaled, global_steps=5))
        after_sum = run(loop, server.weight_checksum())
        assert after_sum != before_sum and returned == after_sum
        assert after_sum == state_checksum({n: scaled[n] for n, _ in server.model.named_parameters()})
        assert torch.equal(server.model.get_parameter("model.norm.weight"), scaled["model.norm.weight"])
        assert run(loop, server.status()) == {"global_steps": 5, "weight_updates": updates + 1}
        after = run(loop, server.generate(prompt_ids=prompts[2], sampling_params=dict(greedy), request_id="a"))
        assert after.extra_fields["global_steps"] == 5
        n = min(len(before.log_probs), len(after.log_probs))
        assert not torch.allclose(torch.tensor(before.log_probs[:n]), torch.tensor(after.log_probs[:n]), atol=1e-3)
    finally:
        run(loop, server.update_weights(original, global_steps=None))
    assert run(loop, server.weight_checksum()) == before_sum


def test_update_weights_refuses_state_dicts_that_do_not_fit(loop, server):
    """An unknown tensor name or a missing parameter raises KeyError naming it and loads nothing;
    omitting only the tied lm_head is accepted."""
    state = {k: v.clone() for k, v in server.model.state_dict().items()}
    checksum = run(loop, server.weight_checksum())

    unknown = dict(state, **{"model.not_a_layer.weight": torch.zeros(2)})
    unknown["model.norm.weight"] = state["model.norm.weight"] * 3  # would change the model if loaded
    with pytest.raises(KeyError, match="model.not_a_layer.weight"):
        run(loop, server.update_weights(unknown))

    missing = {k: v * 3 for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(KeyError, match="model.norm.weight"):
        run(loop, server.update_weights(missing))
    assert run(loop, server.weight_checksum()) == checksum

    assert server.model.config.tie_word_embeddings  # the toy model ties lm_head to the embeddings
    untied = {k: v for k, v in state.items() if k != "lm_head.weight"}
    assert run(loop, server.update_weights(untied)) == checksum


def test_malformed_sampling_params_do_not_stall_the_server(model_config, prompts):
    """A request whose sampling params cannot be read fails on its own, and the next request is served."""
    fresh = HFCPUServer(rollout_config(), model_config)  # not the shared one: the bug would hang it
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises((TypeError, ValueError)):
            loop.run_until_complete(
                asyncio.wait_for(
                    fresh.generate(prompt_ids=prompts[0], sampling_params={"temperature": None}, request_id="x"), 5
                )
            )
        ok = loop.run_until_complete(
            asyncio.wait_for(
                fresh.generate(prompt_ids=prompts[0], sampling_params={"temperature": 1.0}, request_id="y"), 30
            )
        )
        assert ok.token_ids
    finally:
        worker = fresh._worker  # with the bug it died with the TypeError: collect it, keep the log quiet
        if worker is not None and worker.done() and not worker.cancelled():
            worker.exception()
        close_loop(loop)
