"""What a lying sampler does to a group, as functions of an honest one, each returning a new
:class:`RolloutGroup` (the honest one is left as it was). The soak's lying samplers (:mod:`.liars`)
and the detection table of ``research/bench/bench_trust.py detection-table`` both make their lies
here, so the soak and the table measure the same attacks:

- :func:`scaled_q`: log q times ``factor`` (1.5 a large lie, 1 + eps a small systematic one);
- :func:`q_at_temperature`: the group's own tokens (drawn at the run's temperature), log q as the
  sampler's model gives it at another temperature (0.9, 0.95: close to 1.0);
- :func:`redrawn`: the tokens drawn again, with the group's own Gumbel-max seed, by another model
  (other weights, or the same truncated to top-k / top-p by :func:`truncated`), with log q, rewards
  and advantages true to them: only checkable sampling's token check can tell;
- :func:`near_copy`: another sampler's group with its rows rotated and one log q changed by 1e-5
  (a replay that tries to look new).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import numpy as np
import torch

from verl_ext.algos.advantages import sequence_advantages
from verl_ext.trust.verifier import group_log_probs
from verl_ext.hetero.records import RolloutGroup
from verl_ext.sampling import eos_mask, generate

NEAR_COPY_NUDGE = 1e-5
"""What :func:`near_copy` adds to one log q of the copy."""


def scaled_q(group: RolloutGroup, factor: float) -> RolloutGroup:
    """log q x ``factor`` on every token (padding stays 0)."""
    return dataclasses.replace(group, sampler_logprobs=(group.sampler_logprobs * factor).astype(np.float32))


def q_at_temperature(group: RolloutGroup, model: torch.nn.Module, temperature: float) -> RolloutGroup:
    """The group's tokens with log q of ``model`` at ``temperature`` (one forward pass of ``model``,
    the sampler's own: its precision's arithmetic)."""
    q = group_log_probs(model, group, temperature) * group.response_mask
    return dataclasses.replace(group, sampler_logprobs=q.astype(np.float32))


@contextlib.contextmanager
def truncated(model: torch.nn.Module, top_k: int = 0, top_p: float = 1.0) -> Iterator[torch.nn.Module]:
    """``model`` whose logits keep only the ``top_k`` best tokens (k <= 0: all) and the smallest set
    whose softmax mass reaches ``top_p`` (1.0: all); the others are -inf. A forward hook on the
    output layer while the block runs: any sampling through ``model`` then draws from the
    truncated distribution (top-k / top-p sampling, which a Gumbel-max draw of it imitates)."""

    def hook(module, inputs, logits):
        keep = torch.ones_like(logits, dtype=torch.bool)
        if top_k > 0:
            kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            keep &= logits >= kth
        if top_p < 1.0:
            probs = torch.softmax(logits.float(), dim=-1)
            ordered, order = probs.sort(dim=-1, descending=True)
            before = ordered.cumsum(dim=-1) - ordered  # the mass of the better tokens
            keep &= torch.zeros_like(keep).scatter(-1, order, before < top_p)
        return logits.masked_fill(~keep, float("-inf"))

    handle = model.get_output_embeddings().register_forward_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@torch.no_grad()
def redrawn(
    group: RolloutGroup,
    drawer: torch.nn.Module,
    scorer: torch.nn.Module,
    tokenizer: Any,
    score: Callable[[str, dict], float],
    temperature: float,
    max_new_tokens: int,
    algorithm_config: Any,
) -> RolloutGroup:
    """The group's G responses drawn again by ``drawer`` with the group's Gumbel-max seed
    (``group.sampling_seed``, needed), as the engine's sampler draws (``verl_ext.sampling.generate``);
    log q of those tokens under ``scorer`` (the claimed version's weights: q true to the tokens),
    their rewards by ``score`` against ``group.extra['answer']``, the advantages of those rewards."""
    if group.sampling_seed is None:
        raise ValueError("redrawn: the group has no sampling_seed (drawn without checkable sampling)")
    g = group.response_ids.shape[0]
    device = next(drawer.parameters()).device
    prompt = torch.as_tensor(group.prompt_ids, dtype=torch.long, device=device).reshape(1, -1).expand(g, -1)
    tokens = generate(
        drawer,
        prompt,
        torch.ones_like(prompt),
        max_new_tokens=max_new_tokens,
        eos_token_ids=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        temperature=temperature,
        with_log_q=False,
        gumbel_seeds=[int(group.sampling_seed)],
    ).tokens.cpu()
    mask = eos_mask(tokens, tokenizer.eos_token_id)
    length = int(mask.sum(dim=-1).max())
    responses = torch.where(mask.bool(), tokens, torch.full_like(tokens, tokenizer.pad_token_id))[:, :length]
    mask = mask[:, :length]
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    answer = {"answer": str(group.extra.get("answer", ""))}
    rewards = torch.tensor([score(text, answer) for text in texts], dtype=torch.float32)
    advantages = sequence_advantages(rewards, mask, [group.group_uid] * g, algorithm_config)
    lie = dataclasses.replace(
        group,
        response_ids=responses.numpy().astype(np.int64),
        response_mask=mask.numpy().astype(np.int8),
        rewards=rewards.numpy(),
        advantages=advantages.numpy().astype(np.float32),
        extra={**group.extra, "texts": texts},
    )
    q = group_log_probs(scorer, lie, temperature) * lie.response_mask
    return dataclasses.replace(lie, sampler_logprobs=q.astype(np.float32))


def near_copy(source: RolloutGroup, group_uid: str, sampler_id: str) -> RolloutGroup:
    """``source`` under another uid and sampler: rows rotated by one, the first token's log q of
    the new first row moved by :data:`NEAR_COPY_NUDGE`."""

    def rotated(array):
        return None if array is None else np.roll(np.asarray(array), 1, axis=0)

    q = rotated(source.sampler_logprobs).astype(np.float32)
    q[0, 0] += NEAR_COPY_NUDGE
    return dataclasses.replace(
        source,
        group_uid=group_uid,
        sampler_id=sampler_id,
        response_ids=rotated(source.response_ids),
        response_mask=rotated(source.response_mask),
        sampler_logprobs=q,
        rewards=rotated(source.rewards),
        advantages=rotated(source.advantages),
    )
