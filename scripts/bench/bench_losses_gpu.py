"""Forward + backward time of vanilla and the group-expectation losses, eager and torch.compile'd,
against vanilla in the same mode and against the memory-bandwidth floor.

    python scripts/bench/bench_losses_gpu.py [--device cuda] [--shapes 256x4096,1024x8192] [--repeats 20]
                                             [--backend inductor] [--bandwidth-tbs 4.8] [--json rows.json] [--quick]

Timed: one ``token-mean(loss_mat)`` and ``torch.autograd.grad(loss, log_p)`` on float32 [B, T]
tensors (G = 8 a prompt), the pure functions of ``verl_ext.algos.losses`` (no verl import: runs on
a bare CUDA machine); "compiled" is ``torch.compile(fullgraph=True, dynamic=False)`` of the same
forward for every loss. Medians over ``--repeats``, round-robin; CUDA events on CUDA. The floor is
20 bytes a token at the card's bandwidth (:data:`BANDWIDTH_TBS` by device name, or
``--bandwidth-tbs``). Each row also gives the compiled result's largest relative difference from
eager. Targets, backends on a CPU and results: docs/benchmarks.md. ``main(argv) -> list[dict]``
returns the rows for the GPU lane (research/gpu_lane/)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from verl_ext.algos import compiled as compiled_losses  # noqa: E402
from verl_ext.algos import losses  # noqa: E402

CLIP_LOW, CLIP_HIGH = 0.2, 0.28
GROUP_SIZE = 8
BYTES_PER_TOKEN = 20
SHAPES = [(256, 4096), (1024, 8192)]
QUICK_SHAPES = [(32, 128)]

#: (substring of torch.cuda.get_device_name, TB/s), first match wins: spec-sheet peak bandwidths
BANDWIDTH_TBS: list[tuple[str, float]] = [
    ("GH200", 4.0),
    ("H200", 4.8),
    ("H100 PCIe", 2.0),
    ("H100 NVL", 3.9),
    ("H100", 3.35),
    ("H800", 3.35),
    ("B200", 8.0),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),
    ("L40S", 0.864),
    ("L4", 0.3),
]

#: label -> (loss_mode of verl_ext.algos.compiled, its options); "vanilla" is the token-clipped surrogate
LOSSES: dict[str, tuple[str, dict]] = {
    "vanilla": ("vanilla", {}),
    "gepo": ("gepo", {}),
    "eqp": ("eqp", {}),
    "gepo_adaptive": ("gepo_adaptive", {"kl_threshold": 0.002}),
    "gepo_tr": ("gepo_tr", {}),
    "gepo_tc": ("gepo_tc", {}),
    "gepo_tc_ess": ("gepo_tc", {"ess_bound": True}),
}


def bandwidth_tbs(device: torch.device) -> tuple[Optional[float], str]:
    """(TB/s, the device's name) from :data:`BANDWIDTH_TBS`; None for a CPU or an unknown card."""
    if device.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(device)
    for key, tbs in BANDWIDTH_TBS:
        if key in name:
            return tbs, name
    return None, name


def make_batch(batch: int, length: int, device: torch.device, seed: int = 0):
    """(log_p, log_q, advantages, mask, group_index), float32 on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    log_q = -torch.rand(batch, length, generator=gen) * 3
    log_p = log_q + 0.05 * torch.randn(batch, length, generator=gen)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()
    adv = (
        torch.randn(batch // GROUP_SIZE, 1, generator=gen)
        .repeat_interleave(GROUP_SIZE, 0)
        .expand(-1, length)
        .contiguous()
    )
    groups = torch.arange(batch) // GROUP_SIZE
    return [t.to(device) for t in (log_p, log_q, adv, mask, groups)]


def loss_forward(label: str, eager: bool) -> Callable[..., torch.Tensor]:
    """(log_p, log_q, adv, mask, group_index) -> the token-mean loss. Eager: the loss's own function
    (GEPO-TC-ESS reads its ESS to the host); compiled: the graph-safe form the compiled path traces."""
    mode, options = LOSSES[label]

    def forward(log_p, log_q, adv, mask, group_index):
        if mode == "vanilla":
            loss_mat = losses.token_clipped_loss_terms(
                log_p, log_q, adv, mask, clip_low=CLIP_LOW, clip_high=CLIP_HIGH
            ).loss_mat
        elif eager:
            loss_mat = compiled_losses.COMPILABLE_LOSS_TERMS[mode](
                log_p, log_q, adv, mask, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, group_index=group_index, **options
            ).loss_mat
        else:
            loss_mat = compiled_losses.traceable_loss_terms(
                mode,
                log_p,
                log_q,
                adv,
                mask,
                clip_low=CLIP_LOW,
                clip_high=CLIP_HIGH,
                group_index=group_index,
                **options,
            )[0]
        return (loss_mat * mask).sum() / mask.sum()

    return forward


def make_step(forward: Callable[..., torch.Tensor], inputs: list[torch.Tensor]):
    """One forward + backward; returns (loss, d loss / d log_p)."""
    log_p = inputs[0].detach().clone().requires_grad_(True)
    rest = inputs[1:]

    def step():
        loss = forward(log_p, *rest)
        (grad,) = torch.autograd.grad(loss, log_p)
        return loss, grad

    return step


def timed_ms(step, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(x) for x in part.lower().split("x")) for part in text.split(",") if part]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or s[0] < GROUP_SIZE or s[0] % GROUP_SIZE or s[1] < 4 for s in shapes):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected BxT[,BxT...] with B a positive multiple of {GROUP_SIZE} and T >= 4, e.g. 256x4096"
        )
    return shapes  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--shapes", type=_shapes, default=None, help="BxT,... (default 256x4096,1024x8192; --quick 32x128)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed calls a loss and mode (default 20; --quick 3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (the first compiles)")
    parser.add_argument("--losses", default=",".join(LOSSES), help=f"comma-separated, of {', '.join(LOSSES)}")
    parser.add_argument(
        "--backend", default=None, help="torch.compile backend (default inductor on CUDA, aot_eager on CPU)"
    )
    parser.add_argument(
        "--mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs (default: none)"
    )
    parser.add_argument(
        "--bandwidth-tbs", type=float, default=None, help="memory bandwidth for the floor (default: by device name)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the rows here too")
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats (CPU tests)")
    args = parser.parse_args(argv)

    labels = [x for x in args.losses.split(",") if x]
    unknown = [x for x in labels if x not in LOSSES]
    if unknown or "vanilla" not in labels:
        parser.error(
            f"--losses {args.losses}: unknown {unknown}" if unknown else "--losses must include vanilla (the baseline)"
        )
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 20)
    if repeats < 1 or args.warmup < 1:
        parser.error("--repeats and --warmup must be >= 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    backend = args.backend or ("inductor" if device.type == "cuda" else "aot_eager")
    tbs, device_name = bandwidth_tbs(device)
    if args.bandwidth_tbs is not None:
        tbs = args.bandwidth_tbs
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False

    # every loss's forward shares one code object: room for all of them without falling back to eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(LOSSES))
    rows: list[dict] = []
    for batch, length in shapes:
        torch.compiler.reset()  # each shape's graphs compiled afresh, none left from the last shape
        inputs = make_batch(batch, length, device)
        entries: dict[tuple[str, str], Callable] = {}
        results: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        errors: dict[str, str] = {}
        for label in labels:
            for mode in ("eager", "compiled"):
                forward = loss_forward(label, eager=mode == "eager")
                if mode == "compiled":
                    forward = torch.compile(forward, fullgraph=True, dynamic=False, backend=backend, mode=args.mode)
                step = make_step(forward, inputs)
                try:
                    for _ in range(args.warmup):
                        out = step()
                    # copies: a later call may overwrite its outputs (CUDA graphs under --mode reduce-overhead)
                    results[(label, mode)] = tuple(t.detach().clone() for t in out)
                    entries[(label, mode)] = step
                except Exception as exc:  # noqa: BLE001 -- a compile or device failure is a finding: report it
                    errors[label] = f"{mode}: {type(exc).__name__}: {exc}"[:300]
        times: dict[tuple[str, str], list[float]] = {key: [] for key in entries}
        for _ in range(repeats):
            for key, step in entries.items():
                times[key].append(timed_ms(step, device))
        median = {key: statistics.median(ts) for key, ts in times.items()}
        floor_ms = BYTES_PER_TOKEN * batch * length / (tbs * 1e12) * 1e3 if tbs else None
        for label in labels:
            row: dict = {
                "device": device_name,
                "backend": backend,
                "B": batch,
                "T": length,
                "loss": label,
                "repeats": repeats,
            }
            for mode in ("eager", "compiled"):
                ms = median.get((label, mode))
                base = median.get(("vanilla", mode))
                row[f"{mode}_ms"] = ms
                row[f"{mode}_x_vanilla"] = ms / base if ms is not None and base else None
                row[f"{mode}_x_floor"] = ms / floor_ms if ms is not None and floor_ms else None
            if (label, "eager") in results and (label, "compiled") in results:
                (el, eg), (cl, cg) = results[(label, "eager")], results[(label, "compiled")]
                row["loss_rel_err"] = rel_err(cl, el)
                row["grad_rel_err"] = rel_err(cg, eg)
            row["floor_ms"] = floor_ms
            row["bandwidth_tbs"] = tbs
            if label in errors:
                row["error"] = errors[label]
            rows.append(row)

    print(format_table(rows, repeats))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict], repeats: int) -> str:
    first = rows[0]
    lines = [
        f"{first['device']}, torch {torch.__version__}, compile backend {first['backend']}, float32, "
        f"median of {repeats} forward+backward calls; floor = {BYTES_PER_TOKEN} B/token at "
        f"{_fmt(first['bandwidth_tbs'], '.2f')} TB/s",
        "",
        "| B | T | loss | eager ms | compiled ms | eager x vanilla | compiled x vanilla | eager x floor "
        "| compiled x floor | compiled vs eager: loss / grad rel. diff |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        err = f" ({r['error']})" if "error" in r else ""
        lines.append(
            f"| {r['B']} | {r['T']} | {r['loss']}{err} | {_fmt(r['eager_ms'], '.3f')} | {_fmt(r['compiled_ms'], '.3f')} "
            f"| {_fmt(r['eager_x_vanilla'], '.2f')} | {_fmt(r['compiled_x_vanilla'], '.2f')} "
            f"| {_fmt(r['eager_x_floor'], '.0f')} | {_fmt(r['compiled_x_floor'], '.0f')} "
            f"| {_fmt(r.get('loss_rel_err'), '.1e')} / {_fmt(r.get('grad_rel_err'), '.1e')} |"
        )
    largest = max((r["B"] * r["T"], r["B"], r["T"]) for r in rows)[1:]
    for r in rows:
        if (r["B"], r["T"]) == largest and r["loss"] == "gepo":
            lines.append("")
            lines.append(
                f"target at B={largest[0]}, T={largest[1]}: gepo compiled x vanilla compiled "
                f"{_fmt(r['compiled_x_vanilla'], '.2f')} (<= 1.2), x floor {_fmt(r['compiled_x_floor'], '.0f')} (<= 10)"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
