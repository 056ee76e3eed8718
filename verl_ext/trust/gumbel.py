"""Sampling the learner can check: seeded Gumbel-max.

Sampling from softmax(logits / T) equals taking argmax(logits / T + g), g a vector of Gumbel(0, 1)
draws. With g from a seed the sampler declares (one vector per (seed, row, position), from a
counter-based generator that gives the same numbers on every machine and device), the learner
re-derives from its own logits which token the sampler had to choose, so a sampler drawing from
other weights, at another temperature or from a truncated distribution is caught by its tokens,
even when its reported q matches them. A chosen token that is not the learner's argmax passes when
its noised score is within ``tie_margin`` of the best (a near tie: the two sides' arithmetic
differ) and fails otherwise (a mismatch); a precision's margin (:data:`TIE_MARGINS`, or a
calibration's) is twice the largest honest |Δ log q| of a token. :func:`sample` and
:func:`check_tokens` are the two halves; the gate runs :func:`check_scores` on the logits of its
re-score (``hetero.trust.checkable_sampling``; the seed in the signed record).
The seed is the learner's assignment (:mod:`.assignment`). Evidence and limits: docs/reliability.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .bounds import TIE_MARGINS  # noqa: F401 - the margins live beside the other bounds


def group_seed(base_seed: int, index: int) -> int:
    """The Gumbel seed of group ``index`` of a batch drawn with ``base_seed`` (a 63-bit integer;
    distinct groups get unrelated noise)."""
    words = np.random.SeedSequence([int(base_seed) & (2**63 - 1), int(index)]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def gumbel_noise(seed: int, row: int, position: int, vocab: int) -> np.ndarray:
    """float64 [vocab]: the Gumbel(0, 1) noise of one (seed, row, position), the same on every
    machine (numpy's counter-based Philox, keyed by the three numbers; computed on the CPU)."""
    rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([int(seed), int(row), int(position)])))
    u = rng.random(int(vocab))
    return -np.log(-np.log(np.clip(u, np.finfo(np.float64).tiny, None)))


def _noise(seed: int, rows: int, position: int, vocab: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([gumbel_noise(seed, r, position, vocab) for r in range(rows)]))


class GumbelMax:
    """A HF ``generate`` logits processor (greedy decoding) that turns each step into a Gumbel-max
    draw: row i of the batch, generated position t, takes argmax(logits / T + g(seed, i % G, t))
    with ``seed = seeds[i // G]`` (G = rows / len(seeds): each seed one group's consecutive rows).
    Returns -inf everywhere but the chosen token (chosen in float64, whatever the model's dtype)."""

    def __init__(self, seeds, rows: int, prompt_length: int, temperature: float):
        self.seeds = [int(s) for s in seeds]
        if not self.seeds or rows % len(self.seeds):
            raise ValueError(f"{rows} rows do not split into groups of {len(self.seeds)} seeds")
        self.group_size, self.prompt_length, self.temperature = rows // len(self.seeds), int(prompt_length), temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[1] - self.prompt_length
        g = self.group_size
        noise = torch.cat([_noise(seed, g, position, scores.shape[-1]) for seed in self.seeds])
        chosen = (scores.double().cpu() / self.temperature + noise).argmax(-1).to(scores.device)
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(len(chosen), device=scores.device), chosen] = 0.0
        return out


@dataclass(frozen=True)
class Sample:
    """G responses to one prompt, drawn by :func:`sample`."""

    tokens: torch.Tensor  # int64 [G, R]
    mask: torch.Tensor  # int64 [G, R]: 1 up to and including the first stop token
    log_q: torch.Tensor  # float32 [G, R]: log softmax(logits / T) at each token


@torch.no_grad()
def sample(
    model,
    prompt_ids,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eos_token_id: int,
    pad_token_id: int,
) -> Sample:
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
def check_tokens(
    model, prompt_ids, response_ids, response_mask, temperature: float, seed: int, tie_margin: float
) -> TokenCheck:
    """Re-derive with ``model`` (one forward pass) which token each position's noise selects, and
    compare with the response's tokens (the module docstring)."""
    device = next(model.parameters()).device
    responses = torch.as_tensor(np.asarray(response_ids), dtype=torch.long, device=device)
    g = responses.shape[0]
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1).expand(g, -1)
    ids = torch.cat([prompt, responses], dim=1)
    logits = model(input_ids=ids).logits[:, prompt.shape[1] - 1 : -1, :]  # [G, R, V]
    return check_scores(logits, response_ids, response_mask, temperature, seed, tie_margin)


def noised_margins(logits: torch.Tensor, response_ids, response_mask, temperature: float, seed: int) -> torch.Tensor:
    """float64 [N]: for each of the N response tokens (the mask's, row by row), the noised best score
    minus the chosen token's (0 where the chosen token is the best), from ``logits`` [G, R, V]
    predicting each response token and the noise of ``seed``."""
    responses = torch.as_tensor(np.asarray(response_ids), dtype=torch.long, device="cpu")
    mask = torch.as_tensor(np.asarray(response_mask), device="cpu").bool()
    rows, positions = mask.nonzero(as_tuple=True)  # only the response's tokens: padding needs no noise
    logits = logits.detach()[rows.to(logits.device), positions.to(logits.device)].double().cpu()  # [N, V]
    vocab = logits.shape[-1]
    noise = torch.from_numpy(
        np.stack([gumbel_noise(seed, r, t, vocab) for r, t in zip(rows.tolist(), positions.tolist())])
        if len(rows)
        else np.zeros((0, vocab))
    )
    scores = logits / temperature + noise
    chosen = scores.gather(-1, responses[rows, positions][:, None]).squeeze(-1)
    return scores.max(-1).values - chosen


def check_scores(
    logits: torch.Tensor, response_ids, response_mask, temperature: float, seed: int, tie_margin: float
) -> TokenCheck:
    """The token check on logits already computed: ``logits`` [G, R, V] predicting each response
    token (the learner's re-scoring forward gives them), the responses' tokens [G, R] and mask."""
    margin = noised_margins(logits, response_ids, response_mask, temperature, seed)
    off = margin > 0
    return TokenCheck(
        int(margin.numel()),
        int((off & (margin <= tie_margin)).sum()),
        int((margin > tie_margin).sum()),
        float(margin.max()) if margin.numel() else 0.0,
    )
