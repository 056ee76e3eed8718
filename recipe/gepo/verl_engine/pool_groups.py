"""Rollout groups between verl's agent loop and the exchange, both ways.

Pool side, :func:`groups_from_agent_output`: the rows verl's ``AgentLoopManager.generate_sequences``
returns (G consecutive rows per prompt, left-padded prompts, right-padded responses, ``rm_scores``
on the last token, the sampler's ``rollout_log_probs``) become one signed-ready
:class:`~verl_ext.hetero.records.RolloutGroup` per prompt. Learner side,
:func:`trajectory_fields`: an admitted group becomes the TransferQueue rows verl's
``AgentLoopWorkerTQ`` would have written for one of the trainer's prompt uids (keys
``{uid}_{session}_0``, ``AgentLoopOutput.as_dict()`` fields, the tags verl's replay buffer reads),
with the weight version that generated it as ``min/max_global_steps``.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from verl_ext.hetero.records import RolloutGroup

PRECISION_OF_DTYPE = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16"}
"""``actor_rollout_ref.rollout.dtype`` -> the precision a group declares (``sampler_precision``)."""


def chat_prompt_ids(tokenizer: Any, messages: Any) -> list[int]:
    """A prompt's token ids as verl's agent loop makes them from a dataset row's chat messages."""
    ids = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=True)
    return [int(t) for t in getattr(ids, "input_ids", ids)]


def group_prompt(group: RolloutGroup) -> tuple[int, ...]:
    """A group's prompt as the token ids it carries (padding left out): how the learner and the
    pools name a prompt to each other."""
    return tuple(int(t) for t in group.prompt_ids[group.prompt_mask.astype(bool)])


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """float32 (G,): (r - mean) / (std + 1e-6) over the group. What the record carries; the
    verl learner computes its own advantages from the rewards (``algorithm.adv_estimator``)."""
    r = np.asarray(rewards, np.float64)
    std = r.std(ddof=1) if r.size > 1 else 0.0
    return ((r - r.mean()) / (std + 1e-6)).astype(np.float32)


def groups_from_agent_output(
    out: Any,
    group_size: int,
    uids: list[str],
    sampler_id: str,
    precision: Optional[str],
    extras: Optional[list[dict]] = None,
) -> list[RolloutGroup]:
    """One group per prompt from verl's agent-loop output ``out`` (a ``DataProto`` of
    ``len(uids) * group_size`` rows, the G rows of prompt i at ``[i*G, (i+1)*G)``).

    Shapes read: ``prompts`` [B, P] (left-padded; ``attention_mask[:, :P]`` marks real tokens),
    ``responses`` / ``response_mask`` / ``rollout_log_probs`` / ``rm_scores`` [B, R]. The weight
    version is the rows' ``min_global_steps``; a group whose rows were generated under more
    than one version (a weight load mid-generation) or under none raises ValueError."""
    batch, nt = out.batch, out.non_tensor_batch
    prompts, attention = batch["prompts"], batch["attention_mask"]
    width = prompts.shape[1]
    responses, mask = batch["responses"], batch["response_mask"]
    logq, scores = batch["rollout_log_probs"], batch["rm_scores"]
    rows = prompts.shape[0]
    if rows != len(uids) * group_size:
        raise ValueError(f"{rows} rows for {len(uids)} prompts x G={group_size}")
    groups = []
    for i, uid in enumerate(uids):
        sl = slice(i * group_size, (i + 1) * group_size)
        versions = {v for key in ("min_global_steps", "max_global_steps") for v in nt[key][sl].tolist()}
        if len(versions) != 1 or None in versions:
            raise ValueError(f"group {uid}: generated under weight versions {sorted(map(str, versions))}, not one")
        keep = attention[sl.start, :width].bool()
        prompt_ids = prompts[sl.start][keep]
        if any(not torch.equal(prompts[r][attention[r, :width].bool()], prompt_ids) for r in range(sl.start, sl.stop)):
            raise ValueError(f"group {uid}: its rows do not share one prompt")
        resp_mask = mask[sl].to(torch.int8)
        rewards = scores[sl].sum(dim=-1).float().numpy()
        groups.append(
            RolloutGroup(
                group_uid=uid,
                prompt_ids=prompt_ids.to(torch.int64).numpy(),
                response_ids=torch.where(resp_mask.bool(), responses[sl], 0).to(torch.int64).numpy(),
                response_mask=resp_mask.numpy(),
                sampler_logprobs=torch.where(resp_mask.bool(), logq[sl].float(), 0.0).numpy(),
                rewards=rewards,
                advantages=group_advantages(rewards),
                policy_version=int(versions.pop()),
                sampler_id=sampler_id,
                sampler_precision=precision,
                extra=dict(extras[i]) if extras else {},
            )
        )
    return groups


def trajectory_fields(
    group: RolloutGroup, prompt: dict, data: Optional[dict] = None
) -> tuple[list[str], list[dict], list[dict]]:
    """The TransferQueue rows (keys, fields, tags) of ``group`` filling the trainer's prompt slot
    ``prompt`` (one row of the batch the trainer handed to ``generate_sequences``: its ``uid``,
    ``global_steps``, ``index`` and data fields, as ``AgentLoopWorkerTQ`` unpacks them).

    The rows carry the group's tokens, q and rewards; ``data`` (the learner's own dataset row of
    the group's prompt: ``data_source``, ``reward_model``, ...) replaces the slot's fields of the
    same names, and the slot's other fields are kept, so every row of a batch has one set of columns. ``rm_scores`` holds the reward on
    the last response token; ``min/max_global_steps`` the group's weight version."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.utils.model import compute_position_id_with_mask

    uid = prompt["uid"]
    version = int(group.policy_version)
    prompt_ids = [int(t) for t, keep in zip(group.prompt_ids, group.prompt_mask) if keep]
    keys, fields, tags = [], [], []
    for session_id in range(group.group_size):
        length = int(group.response_mask[session_id].sum())
        score = float(group.rewards[session_id])
        output = AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=[int(t) for t in group.response_ids[session_id, :length]],
            response_mask=[1] * length,
            response_logprobs=[float(x) for x in group.sampler_logprobs[session_id, :length]],
            reward_score=score,
            num_turns=2,
            metrics=AgentLoopMetrics(),
            extra_fields={
                "min_global_steps": version,
                "max_global_steps": version,
                "turn_scores": [],
                "tool_rewards": [],
                "reward_extra_info": {"score": score},
            },
        )
        field = output.as_dict()
        field.update(prompt, session_id=session_id)
        field.update({k: v for k, v in (data or {}).items() if k in prompt})
        input_ids = torch.cat([field["prompts"], field["responses"]])
        field.update(
            loss_mask=field["response_mask"],
            input_ids=input_ids,
            multi_modal_inputs={},
            position_ids=compute_position_id_with_mask(torch.ones_like(input_ids)[None])[0],
        )
        keys.append(f"{uid}_{session_id}_0")
        fields.append(field)
        tags.append(
            {
                "status": "success",
                "prompt_len": len(prompt_ids),
                "response_len": length,
                "seq_len": len(prompt_ids) + length,
                "global_steps": prompt["global_steps"],
                "min_global_steps": version,
                "max_global_steps": version,
            }
        )
    return keys, fields, tags
