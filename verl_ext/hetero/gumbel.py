"""Sampling the learner can check: seeded Gumbel-max.

Sampling token t from softmax(logits / T) is the same as taking argmax(logits / T + g) with g a
vector of independent Gumbel(0, 1) draws. When g comes from a seed the sampler declares -- one
vector per (seed, row, position), from a counter-based generator that gives the same numbers on
every machine and device -- the learner can re-derive, with its own logits and the same noise,
which token the sampler had to choose, and check the tokens themselves, not only the log-probs
reported for them. A sampler that draws from other weights, at another temperature or from a
truncated distribution (top-k, top-p) then picks other tokens at some positions, even when the q it
reports matches the tokens it sent.

Arithmetic differs between sampler and learner (bf16 kernels on a GPU, fp32 on the learner): where
the best and second-best noised scores are within that difference, they may swap. A chosen token
that is not the learner's argmax is therefore allowed when its noised score is within
``tie_margin`` of the best (a near tie), and refused otherwise (a mismatch). Measured (GPU_FIRST_RUN.md
5, SmolLM2 on the CPU): under the same noise, bf16's argmax differs from fp32's at 1.95% of tokens;
the noised margin between the best two tokens is under 0.1 at 1.6% of tokens.

Not yet wired into the engines: the samplers draw with ``verl_ext.sampling.generate``, and the
record carries no seed. :func:`sample` and :func:`check_tokens` are the two halves that would be.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


def gumbel_noise(seed: int, row: int, position: int, vocab: int) -> np.ndarray:
    """float64 [vocab]: the Gumbel(0, 1) noise of one (seed, row, position), the same on every
    machine (numpy's counter-based Philox, keyed by the three numbers; computed on the CPU)."""
    rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([int(seed), int(row), int(position)])))
    u = rng.random(int(vocab))
    return -np.log(-np.log(np.clip(u, np.finfo(np.float64).tiny, None)))


def _noise(seed: int, rows: int, position: int, vocab: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([gumbel_noise(seed, r, position, vocab) for r in range(rows)]))


@dataclass(frozen=True)
class Sample:
    """G responses to one prompt, drawn by :func:`sample`."""

    tokens: torch.Tensor  # int64 [G, R]
    mask: torch.Tensor  # int64 [G, R]: 1 up to and including the first stop token
    log_q: torch.Tensor  # float32 [G, R]: log softmax(logits / T) at each token


@torch.no_grad()
def sample(model, prompt_ids, group_size: int, max_new_tokens: int, temperature: float, seed: int,
           eos_token_id: int, pad_token_id: int) -> Sample:  # fmt: skip
    """G responses by Gumbel-max: at row r, position t, the token argmax(logits / T + g(seed, r, t))
    (one full forward pass a step: a reference, not a fast sampler)."""
    device = next(model.parameters()).device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1).expand(group_size, -1)
    ids, done = prompt.clone(), torch.zeros(group_size, dtype=torch.bool, device=device)
    tokens, log_q = [], []
    for t in range(max_new_tokens):
        logits = model(input_ids=ids).logits[:, -1, :].double()
        scores = logits / temperature + _noise(seed, group_size, t, logits.shape[-1]).to(device)
        token = scores.argmax(-1)
        token = torch.where(done, torch.full_like(token, pad_token_id), token)
        tokens.append(token)
        log_q.append(F.log_softmax(logits / temperature, dim=-1).gather(-1, token[:, None]).squeeze(-1).float())
        done = done | (token == eos_token_id)
        ids = torch.cat([ids, token[:, None]], dim=1)
        if bool(done.all()):
            break
    tokens_t = torch.stack(tokens, dim=1).cpu()
    is_eos = (tokens_t == eos_token_id).long()
    mask = ((torch.cumsum(is_eos, dim=-1) - is_eos) == 0).long()
    return Sample(tokens_t, mask, torch.stack(log_q, dim=1).cpu() * mask)


@dataclass(frozen=True)
class TokenCheck:
    """What :func:`check_tokens` found over a group's response tokens."""

    tokens: int  # tokens checked
    near_ties: int  # chosen token not the learner's argmax, within tie_margin of it
    mismatches: int  # chosen token further than tie_margin below the learner's argmax
    worst_margin: float  # the largest (best - chosen) noised score over the group


@torch.no_grad()
def check_tokens(model, prompt_ids, response_ids, response_mask, temperature: float, seed: int,
                 tie_margin: float) -> TokenCheck:  # fmt: skip
    """Re-derive with ``model`` (one forward pass) which token each position's noise selects, and
    compare with the response's tokens (the module docstring)."""
    device = next(model.parameters()).device
    responses = torch.as_tensor(np.asarray(response_ids), dtype=torch.long, device=device)
    mask = torch.as_tensor(np.asarray(response_mask)).bool()
    g, r = responses.shape
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1).expand(g, -1)
    ids = torch.cat([prompt, responses], dim=1)
    logits = model(input_ids=ids).logits[:, prompt.shape[1] - 1 : -1, :].double().cpu()  # [G, R, V]
    noise = torch.stack([_noise(seed, g, t, logits.shape[-1]) for t in range(r)], dim=1)  # [G, R, V]
    scores = logits / temperature + noise
    chosen = scores.gather(-1, responses.cpu()[..., None]).squeeze(-1)
    margin = (scores.max(-1).values - chosen)[mask]
    off = margin > 0
    return TokenCheck(int(mask.sum()), int((off & (margin <= tie_margin)).sum()), int((margin > tie_margin).sum()),
                      float(margin.max()) if margin.numel() else 0.0)  # fmt: skip
