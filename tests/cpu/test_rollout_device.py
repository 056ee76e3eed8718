"""Where the ``hf_cpu`` rollout server puts its model (``verl_ext.cpu.rollout``), checked on the CPU.

- the device choice: the replica's workers report their verl platform's device
  (``worker_placement``: ``cpu`` on this machine); ``server_device`` keeps ``cpu`` and refuses a
  CUDA placement this process cannot see, or a device type the server does not run on;
- the CPU path unchanged: a server asked for ``cpu`` and one built as before sample the same tokens
  and log-probs with the same seed;
- no tensor on a default device: the server's generation and weight update run with
  ``torch.set_default_device("meta")`` around them and give the same results, so on CUDA every
  tensor follows the model's device, not a default one.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig

from verl_ext.cpu import rollout
from verl_ext.cpu.rollout import HFCPUServer, server_device, state_checksum, worker_placement
from verl_ext.data.toy_assets import prepare_toy_assets

PROMPT_TEXTS = ["1+2=", "12+34=", "864+394=", "5+77="]


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    assets = prepare_toy_assets(tmp_path_factory.mktemp("toy"), n_train=8, n_val=4)
    return omega_conf_to_dataclass(OmegaConf.create({"path": str(assets.model_path)}), dataclass_type=HFModelConfig)


def rollout_config() -> RolloutConfig:
    node = {
        "name": "hf_cpu",
        "prompt_length": 16,
        "response_length": 8,
        "dtype": "float32",
        "max_num_seqs": 4,
        "calculate_log_probs": True,
        "tensor_model_parallel_size": 1,
    }
    return omega_conf_to_dataclass(OmegaConf.create(node), dataclass_type=RolloutConfig)


def sample_all(server: HFCPUServer, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Every prompt once, concurrently (one batch), with a fixed torch seed; the server's batching
    task is cancelled afterwards."""

    async def go():
        torch.manual_seed(123)
        outs = await asyncio.gather(
            *[
                server.generate(
                    prompt_ids=p, sampling_params={"temperature": 1.0, "logprobs": True}, request_id=f"r{i}"
                )
                for i, p in enumerate(prompts)
            ]
        )
        server._worker.cancel()
        server._worker = None
        return [(o.token_ids, o.log_probs) for o in outs]

    return asyncio.run(asyncio.wait_for(go(), 120))


def test_the_replica_workers_device_here_is_the_cpu():
    placement = worker_placement()  # verl's platform in this process: the project's cpu platform
    assert placement == {"device": "cpu", "visible_key": None, "visible_devices": None, "ray_noset": []}
    assert server_device(placement["device"]) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA device exists")
def test_a_cuda_placement_without_cuda_is_refused_naming_it():
    with pytest.raises(RuntimeError, match=r"hf_cpu.*'cuda:0'.*sees 0 CUDA device"):
        server_device("cuda:0")
    with pytest.raises(ValueError, match=r"hf_cpu.*'npu:0'.*cpu or cuda only"):
        server_device("npu:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA device exists")
def test_the_server_refuses_cuda_before_loading_its_model(model_config):
    with pytest.raises(RuntimeError, match="sees 0 CUDA device"):
        HFCPUServer(rollout_config(), model_config, device="cuda:0")


def test_cpu_path_unchanged_and_no_tensor_on_a_default_device(model_config, monkeypatch):
    tok = model_config.tokenizer
    prompts = [tok.encode(text) for text in PROMPT_TEXTS]
    before = HFCPUServer(rollout_config(), model_config)  # built as before the device argument existed
    server = HFCPUServer(rollout_config(), model_config, device="cpu")
    assert next(server.model.parameters()).device == torch.device("cpu")
    reference = sample_all(before, prompts)
    assert sample_all(server, prompts) == reference  # same seed, same tokens and log-probs

    # a weight update from CPU tensors, then generation, all with the default device on meta: a
    # tensor made without its inputs' device would land on meta and fail (as it would beside CUDA).
    # The default device is per thread, and the server generates in a worker thread: meta there too.
    real = rollout.sample_continuations

    def sample_under_meta(*args, **kwargs):
        with torch.device("meta"):
            return real(*args, **kwargs)

    monkeypatch.setattr(rollout, "sample_continuations", sample_under_meta)
    new = {n: p.detach().clone() * 0.5 for n, p in server.model.named_parameters()}
    torch.set_default_device("meta")
    try:
        digest = asyncio.run(server.update_weights(new, global_steps=3))
        under_meta = sample_all(server, prompts)
    finally:
        torch.set_default_device(None)
    assert digest == state_checksum(new)
    assert next(server.model.parameters()).device == torch.device("cpu")
    before_update = asyncio.run(before.update_weights({n: t.clone() for n, t in new.items()}, global_steps=3))
    assert before_update == digest
    assert under_meta == sample_all(before, prompts)  # the same results as without a default device
    assert under_meta != reference  # and the update took effect
