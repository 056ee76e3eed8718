"""Sampling continuations of token-id prompts with a HF causal LM, with the sampler's log-probs.

q is ``log_softmax(logits / temperature)`` at each sampled token -- what verl's actor computes as
the learner's p (``logprobs_mode=processed_logprobs`` without top-k/top-p truncation) -- so p/q
compares like with like. Used by the ``hf_cpu`` rollout server (:mod:`verl_ext.cpu.rollout`).

Shapes: N prompts of varying length; each continuation is at most ``max_new_tokens`` tokens and
ends at (and includes) the first EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Continuation:
    """One sampled continuation: its token ids and log q of each of them (same length)."""

    token_ids: list[int]
    log_probs: list[float]
    finished: bool
    """True when it ended on an EOS token, False when it ran out of ``max_new_tokens``."""


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> (input_ids [N, P], attention_mask [N, P]), left-padded."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def sample_continuations(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    generator_seed: int | None = None,
) -> list[Continuation]:
    """One continuation per prompt.

    Args:
        model: a HF ``PreTrainedModel`` with ``generate``.
        prompts: N token-id lists (unpadded).
        max_new_tokens: >= 1.
        eos_token_ids: ids that end a continuation (kept as its last token).
        pad_token_id: id used for left padding.
        temperature: 0 = greedy (log-probs then of softmax(logits)); > 0 samples softmax(logits / T).
        top_p, top_k: nucleus / top-k truncation of the sampling (k <= 0: off). The reported
            log-probs stay those of the untruncated softmax(logits / T), as verl's actor computes.
        generator_seed: reseed torch's RNG first (reproducible sampling), or None.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    input_ids, attention_mask = left_pad(prompts, pad_token_id)
    if generator_seed is not None:
        torch.manual_seed(generator_seed)
    greedy = temperature == 0
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=not greedy,
        temperature=None if greedy else temperature,
        top_p=None if greedy else top_p,
        top_k=None if greedy else (top_k if top_k and top_k > 0 else 0),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        eos_token_id=list(eos_token_ids),
        output_logits=True,
        return_dict_in_generate=True,
    )
    generated = out.sequences[:, input_ids.shape[1] :]
    logits = torch.stack(out.logits, dim=1).float()  # [N, R, V], before any processing
    log_q = F.log_softmax(logits / (1.0 if greedy else temperature), dim=-1)
    token_log_q = torch.gather(log_q, -1, generated.unsqueeze(-1)).squeeze(-1)
    eos = set(int(t) for t in eos_token_ids)
    results = []
    for row, row_log_q in zip(generated.tolist(), token_log_q.tolist()):
        end = next((i + 1 for i, t in enumerate(row) if t in eos), None)
        n = end if end is not None else len(row)
        results.append(Continuation(row[:n], row_log_q[:n], end is not None))
    return results
