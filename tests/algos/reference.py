"""Independent float64 reference implementations for the algorithm-core tests.

Written from the formulas (the GEPO paper, REFERENCE_IMPL.md "Losses, as the code computes
them", verl's loss_agg_mode definitions), as plain Python loops over sequences and groups on
Python floats. Nothing here imports or mirrors the code under test; tensors are converted to
nested lists first so no torch vectorisation is shared with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """A synthetic RL batch: B = n_groups * group_size sequences, T padded response tokens."""

    log_p: torch.Tensor  # [B, T] learner token log-probs
    log_q: torch.Tensor  # [B, T] sampler token log-probs
    advantages: torch.Tensor  # [B, T], one value per sequence on its tokens
    mask: torch.Tensor  # [B, T] bool
    groups: torch.Tensor  # [B] group labels (contiguous runs unless shuffled)

    def rows(self, perm: torch.Tensor) -> "Batch":
        return Batch(self.log_p[perm], self.log_q[perm], self.advantages[perm], self.mask[perm], self.groups[perm])


def make_batch(
    seed: int,
    n_groups: int = 3,
    group_size: int = 4,
    max_len: int = 7,
    drift: float = 0.3,
    dtype: torch.dtype = torch.float64,
    garbage_padding: bool = True,
    labels: list[int] | None = None,
) -> Batch:
    """Random ragged batch, groups laid out contiguously. Padded positions hold finite garbage
    (so a test fails if any masking is missing). ``drift`` = std of log p - log q per token."""
    g = torch.Generator().manual_seed(seed)
    B, T = n_groups * group_size, max_len
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    log_q = -(0.05 + 2.5 * torch.rand(B, T, generator=g, dtype=torch.float64))
    log_p = log_q + drift * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    if garbage_padding:
        junk = lambda: 4.0 * torch.rand(B, T, generator=g, dtype=torch.float64) - 2.0  # noqa: E731
        log_q = torch.where(mask, log_q, junk())
        log_p = torch.where(mask, log_p, junk())
        adv = torch.where(mask, adv, junk())
    if labels is None:
        groups = torch.arange(B) // group_size
    else:
        groups = torch.tensor(labels)[torch.arange(B) // group_size]
    return Batch(log_p.to(dtype), log_q.to(dtype), adv.to(dtype), mask, groups)


# ----------------------------------------------------------------------------- primitives


def _rows(t: torch.Tensor) -> list[list[float]]:
    return [[float(x) for x in row] for row in t.detach().to(torch.float64).tolist()]


def _mask_rows(m: torch.Tensor) -> list[list[bool]]:
    return [[bool(x) for x in row] for row in m.tolist()]


def logsumexp(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(math.fsum(math.exp(x - m) for x in xs))


def seq_log_prob(token_lp: torch.Tensor, mask: torch.Tensor, reduction: str = "mean") -> list[float]:
    out = []
    for row, mrow in zip(_rows(token_lp), _mask_rows(mask)):
        toks = [x for x, keep in zip(row, mrow) if keep]
        total = math.fsum(toks)
        if reduction == "sum":
            out.append(total)
        else:
            out.append(total / len(toks) if toks else 0.0)
    return out


def group_log_denominator(seq_lq: list[float], labels: list) -> list[float]:
    """log( sum_{j in g} q_j^2 / sum_{j in g} q_j ) for each sequence's group g."""
    out = []
    for li in labels:
        members = [x for x, lj in zip(seq_lq, labels) if lj == li]
        out.append(logsumexp([2 * x for x in members]) - logsumexp(members))
    return out


def clipped(w: float, a: float, lo: float, hi: float) -> tuple[float, bool]:
    """PPO pessimistic surrogate for one token: (loss, clipped-branch-active)."""
    unclipped = -a * w
    clip_loss = -a * min(max(w, 1 - lo), 1 + hi)
    return max(unclipped, clip_loss), clip_loss > unclipped


def k3(lp: float, lq: float) -> float:
    """k3 estimate of KL(q || p) from a token sampled by q: p/q - 1 - log(p/q)."""
    r = lp - lq
    return math.expm1(r) - r


def aggregate(loss_rows: list[list[float]], mask: torch.Tensor, mode: str, scale: float | None = None) -> float:
    """verl's loss_agg_mode definitions, single micro-batch, dp_size 1."""
    mrows = _mask_rows(mask)
    T = len(mrows[0])
    seq_sums, seq_means, toks = [], [], []
    for row, mrow in zip(loss_rows, mrows):
        vals = [x for x, keep in zip(row, mrow) if keep]
        toks.extend(vals)
        if vals:
            seq_sums.append(math.fsum(vals))
            seq_means.append(math.fsum(vals) / len(vals))
    if mode == "token-mean":
        return math.fsum(toks) / len(toks)
    if mode == "token-sum":
        return math.fsum(toks)
    if mode == "seq-mean-token-sum":
        return math.fsum(seq_sums) / len(seq_sums)
    if mode == "seq-mean-token-sum-norm":
        return math.fsum(seq_sums) / len(seq_sums) / (T if scale is None else scale)
    if mode == "seq-mean-token-mean":
        return math.fsum(seq_means) / len(seq_means)
    raise ValueError(mode)


# ----------------------------------------------------------------------------- losses
# Each returns (loss_rows [B][T] with 0 on padding, weights, clipped_rows [B][T] bool).


def _broadcast_seq(ws, adv, mask, lo, hi):
    loss_rows, clip_rows = [], []
    for w, arow, mrow in zip(ws, _rows(adv), _mask_rows(mask)):
        lr, cr = [], []
        for a, keep in zip(arow, mrow):
            if keep:
                l, c = clipped(w, a, lo, hi)
            else:
                l, c = 0.0, False
            lr.append(l)
            cr.append(c)
        loss_rows.append(lr)
        clip_rows.append(cr)
    return loss_rows, ws, clip_rows


def gepo(b: Batch, lo=0.2, hi=0.2, reduction="mean", labels=None, log_den=None):
    labels = b.groups.tolist() if labels is None else labels
    slp = seq_log_prob(b.log_p, b.mask, reduction)
    slq = seq_log_prob(b.log_q, b.mask, reduction)
    den = group_log_denominator(slq, labels) if log_den is None else log_den
    ws = [math.exp(p - d) for p, d in zip(slp, den)]
    return _broadcast_seq(ws, b.advantages, b.mask, lo, hi)


def eqp(b: Batch, lo=0.2, hi=0.2, reduction="mean"):
    labels = b.groups.tolist()
    slp = seq_log_prob(b.log_p, b.mask, reduction)
    slq = seq_log_prob(b.log_q, b.mask, reduction)
    ws = []
    for i, li in enumerate(labels):
        idx = [j for j, lj in enumerate(labels) if lj == li]
        # sum_j (q_j / sum_k q_k) p_j, all in log space
        log_norm = logsumexp([slq[j] for j in idx])
        log_den = logsumexp([slq[j] - log_norm + slp[j] for j in idx])
        ws.append(math.exp(slp[i] - log_den))
    return _broadcast_seq(ws, b.advantages, b.mask, lo, hi)


def gepo_adaptive(b: Batch, threshold: float, lo=0.2, hi=0.2, reduction="mean"):
    labels = b.groups.tolist()
    slp = seq_log_prob(b.log_p, b.mask, reduction)
    slq = seq_log_prob(b.log_q, b.mask, reduction)
    gden = group_log_denominator(slq, labels)
    ws = []
    for i, (prow, qrow, mrow) in enumerate(zip(_rows(b.log_p), _rows(b.log_q), _mask_rows(b.mask))):
        kls = [k3(p, q) for p, q, keep in zip(prow, qrow, mrow) if keep]
        kl = math.fsum(kls) / len(kls)
        den = slq[i] if kl < threshold else gden[i]
        ws.append(math.exp(slp[i] - den))
    return _broadcast_seq(ws, b.advantages, b.mask, lo, hi)


def gepo_tr(b: Batch, lo=0.2, hi=0.2, reduction="mean"):
    """c_i * max(-A r_i, -A clip(r_i)) with r_i = p_i / q_i and c_i = q_i / E_q[q]; weight c_i r_i."""
    labels = b.groups.tolist()
    slp = seq_log_prob(b.log_p, b.mask, reduction)
    slq = seq_log_prob(b.log_q, b.mask, reduction)
    den = group_log_denominator(slq, labels)
    loss_rows, clip_rows, ws = [], [], []
    for i, (arow, mrow) in enumerate(zip(_rows(b.advantages), _mask_rows(b.mask))):
        r, c = math.exp(slp[i] - slq[i]), math.exp(slq[i] - den[i])
        ws.append(c * r)
        lr, cr = [], []
        for a, keep in zip(arow, mrow):
            l, was_clipped = clipped(r, a, lo, hi) if keep else (0.0, False)
            lr.append(c * l)
            cr.append(was_clipped)
        loss_rows.append(lr)
        clip_rows.append(cr)
    return loss_rows, ws, clip_rows


def topr(b: Batch, reduction="sum"):
    """-w_i A_it log p_it, w_i = 1 if A_i >= 0 else min(p_i / q_i, 1)."""
    slp = seq_log_prob(b.log_p, b.mask, reduction)
    slq = seq_log_prob(b.log_q, b.mask, reduction)
    loss_rows, ws, clip_rows = [], [], []
    for i, (prow, arow, mrow) in enumerate(zip(_rows(b.log_p), _rows(b.advantages), _mask_rows(b.mask))):
        seq_adv = math.fsum(a for a, keep in zip(arow, mrow) if keep) / max(1, sum(mrow))
        ratio = math.exp(slp[i] - slq[i])
        w = 1.0 if seq_adv >= 0 else min(ratio, 1.0)
        ws.append(w)
        loss_rows.append([-w * a * p if keep else 0.0 for p, a, keep in zip(prow, arow, mrow)])
        clip_rows.append([keep and seq_adv < 0 and ratio > 1 for keep in mrow])
    return loss_rows, ws, clip_rows


def token_clip(b: Batch, lo=0.2, hi=0.2):
    """GRPO's token-level clipped surrogate (no dual clip)."""
    loss_rows, w_rows, clip_rows = [], [], []
    for prow, qrow, arow, mrow in zip(_rows(b.log_p), _rows(b.log_q), _rows(b.advantages), _mask_rows(b.mask)):
        lr, wr, cr = [], [], []
        for p, q, a, keep in zip(prow, qrow, arow, mrow):
            w = math.exp(p - q)
            l, c = clipped(w, a, lo, hi)
            lr.append(l if keep else 0.0)
            wr.append(w)
            cr.append(c and keep)
        loss_rows.append(lr)
        w_rows.append(wr)
        clip_rows.append(cr)
    return loss_rows, w_rows, clip_rows


def delta_l(b: Batch, alpha=1.0, lo=0.2, hi=0.2, scale=None) -> float:
    """(1/M) sum_i x_i sum_t l_it, x_i = L_i^-alpha / sum_j L_j^-alpha."""
    loss_rows, _, _ = token_clip(b, lo, hi)
    mrows = _mask_rows(b.mask)
    lengths = [sum(m) for m in mrows]
    inv = [L ** (-alpha) if L > 0 else 0.0 for L in lengths]
    total = math.fsum(inv)
    M = len(mrows[0]) if scale is None else scale
    return math.fsum(x / total * math.fsum(row) for x, row in zip(inv, loss_rows)) / M


def sampler_kl(b: Batch) -> float:
    """Per-token k3, token-mean per sequence, mean over sequences."""
    seq = []
    for prow, qrow, mrow in zip(_rows(b.log_p), _rows(b.log_q), _mask_rows(b.mask)):
        vals = [k3(p, q) for p, q, keep in zip(prow, qrow, mrow) if keep]
        if vals:
            seq.append(math.fsum(vals) / len(vals))
    return math.fsum(seq) / len(seq)


def clip_fraction(clip_rows, mask) -> float:
    mrows = _mask_rows(mask)
    n = sum(sum(m) for m in mrows)
    return sum(c and k for crow, mrow in zip(clip_rows, mrows) for c, k in zip(crow, mrow)) / n


LOG_CLAMP = 20.0  # the methods' own bound on a log-ratio before exp (AReaL / the VESPO authors' code)


def _clamp(x: float, bound: float = LOG_CLAMP) -> float:
    return min(max(x, -bound), bound)


def m2po_keep(b: Batch, threshold: float) -> list[list[bool]]:
    """M2PO's mask (AReaL's _get_m2po_loss_mask): sort the valid tokens' (log p/q)^2 descending, drop
    the first k where k is the first index whose remaining mean (over the n - k left) is < threshold;
    if none is, keep only the smallest. Padding is never kept."""
    mrows = _mask_rows(b.mask)
    entries = []  # (squared log-ratio, i, t)
    for i, (prow, qrow, mrow) in enumerate(zip(_rows(b.log_p), _rows(b.log_q), mrows)):
        for t, (p, q, keep) in enumerate(zip(prow, qrow, mrow)):
            if keep:
                entries.append((_clamp(p - q) ** 2, i, t))
    keep_rows = [[False] * len(m) for m in mrows]
    n = len(entries)
    if n == 0:
        return keep_rows
    entries.sort(key=lambda e: e[0], reverse=True)
    first = n - 1
    for k in range(n):
        remaining = [e[0] for e in entries[k:]]
        if math.fsum(remaining) / len(remaining) < threshold:
            first = k
            break
    for _, i, t in entries[first:]:
        keep_rows[i][t] = True
    return keep_rows


def m2po(b: Batch, threshold: float = 0.04):
    """-M r A per token, r = p / q (no clip). weight rows: r; clipped rows: the masked tokens."""
    keep_rows = m2po_keep(b, threshold)
    loss_rows, w_rows, clip_rows = [], [], []
    for prow, qrow, arow, mrow, krow in zip(
        _rows(b.log_p), _rows(b.log_q), _rows(b.advantages), _mask_rows(b.mask), keep_rows
    ):
        lr, wr, cr = [], [], []
        for p, q, a, valid, kept in zip(prow, qrow, arow, mrow, krow):
            r = math.exp(_clamp(p - q))
            lr.append(-r * a if kept else 0.0)
            wr.append(r)
            cr.append(valid and not kept)
        loss_rows.append(lr)
        w_rows.append(wr)
        clip_rows.append(cr)
    return loss_rows, w_rows, clip_rows


def vespo_phi(log_w: float, k: float, lam: float) -> float:
    """VESPO's coefficient phi(W) = W^k exp(lam (1 - W)), from log W."""
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


def vespo(b: Batch, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0):
    """-phi(W_i) A_it log p_it, log W_i = clamp(sum_t clamp(lp - lq)), (k, lam) by the sign of the
    sequence's advantage (A >= 0: positive pair). weight: phi [B]; clipped: phi underflowed to 0."""
    loss_rows, ws, clip_rows = [], [], []
    for prow, qrow, arow, mrow in zip(_rows(b.log_p), _rows(b.log_q), _rows(b.advantages), _mask_rows(b.mask)):
        log_w = _clamp(math.fsum(_clamp(p - q) for p, q, keep in zip(prow, qrow, mrow) if keep))
        advs = [a for a, keep in zip(arow, mrow) if keep]
        seq_adv = math.fsum(advs) / len(advs) if advs else 0.0
        k, lam = (k_pos, lam_pos) if seq_adv >= 0 else (k_neg, lam_neg)
        phi = vespo_phi(log_w, k, lam)
        ws.append(phi)
        loss_rows.append([-phi * a * p if keep else 0.0 for p, a, keep in zip(prow, arow, mrow)])
        clip_rows.append([keep and phi == 0.0 for keep in mrow])
    return loss_rows, ws, clip_rows


def token_ratio_ess(b: Batch) -> float:
    """ESS of the response tokens' r_it = p_it / q_it over the batch, (sum r)^2 / (n sum r^2)
    (GEPO-TC-ESS's band factor)."""
    rs = [
        math.exp(_clamp(p - q))
        for prow, qrow, mrow in zip(_rows(b.log_p), _rows(b.log_q), _mask_rows(b.mask))
        for p, q, keep in zip(prow, qrow, mrow)
        if keep
    ]
    return math.fsum(rs) ** 2 / (len(rs) * math.fsum(r * r for r in rs))


def gepo_tc(b: Batch, lo=0.2, hi=0.2, reduction="mean", ess_bound=False, labels=None):
    """GEPO-TC: value -A w_i on every token, w_i = p_i / E_q[q]; a token is clipped where GRPO's token
    clip on r_it = p_it / q_it acts (A > 0, r > 1 + hi, or A < 0, r < 1 - lo). ess_bound: (lo, hi) x
    ESS, ESS = (sum r)^2 / (n sum r^2) over the response tokens."""
    labels = b.groups.tolist() if labels is None else labels
    slp = seq_log_prob(b.log_p, b.mask, reduction)
    slq = seq_log_prob(b.log_q, b.mask, reduction)
    den = group_log_denominator(slq, labels)
    ws = [math.exp(_clamp(p - d)) for p, d in zip(slp, den)]
    ratio_rows = [
        [math.exp(_clamp(p - q)) for p, q in zip(prow, qrow)] for prow, qrow in zip(_rows(b.log_p), _rows(b.log_q))
    ]
    if ess_bound:
        ess = token_ratio_ess(b)
        lo, hi = lo * ess, hi * ess
    loss_rows, clip_rows = [], []
    for w, rrow, arow, mrow in zip(ws, ratio_rows, _rows(b.advantages), _mask_rows(b.mask)):
        loss_rows.append([-a * w if keep else 0.0 for a, keep in zip(arow, mrow)])
        clip_rows.append(
            [keep and ((a > 0 and r > 1 + hi) or (a < 0 and r < 1 - lo)) for r, a, keep in zip(rrow, arow, mrow)]
        )
    return loss_rows, ws, clip_rows
