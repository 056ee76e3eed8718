#!/usr/bin/env python3
"""Bytes and seconds of one weight version over the rate-limited link: what a
slow link costs each weight sync, full and delta (docs/network.md).

    python -m research.testbeds.wan.sync_bench --rates 10,100,1000 --trials 3 [--out runs/wan/sync.json]
    python -m research.testbeds.wan.sync_bench --behind 1,2,4,8 [--lr 1e-6] [--model-path DIR] > rows.jsonl

``--rates``: brings up the two-node cluster (``cluster.py``), places a receiver actor on the sampler
node and times its ``ray.get`` and decoding of one version per rate and wire form (fp32, bf16, and
bf16-xor: the bf16 bit patterns of v+1 XOR those of v, zlib level 1, checked by SHA-256 on the
receiver), beside one raw TCP transfer of the fp32 size (``probe.py``); bounded (``--trials``, a
timeout each) and torn down at the end, also on failure, SIGTERM or Ctrl-C. ``--behind`` (no network,
no privileges): for a sampler k versions behind, the bytes of the direct delta, of a chain of one-step
deltas and of a full bf16 version, as JSON lines. The XOR encoding is the engine's
(``verl_ext.hetero.weights``), one implementation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

if not __package__:  # run as a file: its sibling modules are reachable only through the package
    raise SystemExit("run it from the repository root as: python -m research.testbeds.wan.sync_bench ...")
from . import cluster, link, probe  # noqa: E402

# the engine's XOR delta (hetero.weight_sync=delta): what is measured here is what the engine sends
from verl_ext.hetero.weights import decode_xor, encode_xor, floating_bits  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[3]
FORMS = ("fp32", "bf16", "bf16-xor")
BIG_MODELS = {"1.7B": 1.7e9, "8B": 8.0e9}  # parameters, for the extrapolated sync times
BIG_RATES_GBIT = (1.0, 10.0)


# --- encodings (pure) -----------------------------------------------------------------------------


def bf16_bits(state: dict[str, torch.Tensor]) -> np.ndarray:
    """All floating tensors, in name order, as one flat uint16 array of bf16 bit patterns (the
    engine's :func:`floating_bits` with a bf16 wire, one value per element). [P]"""
    return floating_bits(state, "bf16").view(np.uint16)


def sha256(data: bytes | np.ndarray) -> str:
    return hashlib.sha256(data.tobytes() if isinstance(data, np.ndarray) else data).hexdigest()


def versions(model_path: str, lr: float, steps: int, seed: int = 0) -> list[dict]:
    """State dicts of versions 0..steps of the model: each one AdamW step (next-token loss on a
    fresh batch of random token sequences) after the previous. Adam's first step moves every
    weight with a gradient by about lr; later steps by at most about lr."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    out = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    for _ in range(steps):
        ids = torch.randint(3, model.config.vocab_size, (8, 16))
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def two_versions(model_path: str, lr: float, seed: int = 0) -> tuple[dict, dict]:
    """Versions v and v+1 (one AdamW step apart)."""
    v0, v1 = versions(model_path, lr, 1, seed)
    return v0, v1


def delta_vs_behind(model_path: str, lr: float, behind: list[int]) -> list[dict]:
    """For a sampler holding version 0 and k in ``behind``: bytes of the direct bf16-xor delta
    0 -> k, of the chain of one-step deltas 0 -> 1 -> ... -> k, of the engine's delta messages for
    that chain (``hetero.weight_sync=delta`` with ``weights_bf16``: the XOR plus header and
    non-floating tensors; applied and checked bit-exact here), and of the full bf16 message (where
    a full version becomes the cheaper fetch). Pure CPU, no network."""
    from verl_ext.hetero.weights import apply_delta, encode_delta, serialize_state_dict, wire_sha256, wire_tensors

    states = versions(model_path, lr, max(behind))
    bits = [bf16_bits(state) for state in states]
    full = len(serialize_state_dict(states[-1], 0, wire_dtype="bf16"))
    # a learner keeping only consecutive deltas sends the chain v0->v1->...->vk instead
    step_bytes = [len(encode_xor(bits[i], bits[i - 1])) for i in range(1, len(bits))]
    wires = [wire_tensors(state, "bf16") for state in states]
    messages = [encode_delta(wires[i - 1][0], wires[i][0], wires[i][1], i - 1, i) for i in range(1, len(wires))]
    held = wires[0][0]
    for i, message in enumerate(messages, start=1):  # what a sampler does: apply, check the SHA-256
        _, held, _, sha = apply_delta(message, held)
        assert sha == wire_sha256(wires[i][0])
    rows = []
    for k in behind:
        blob = encode_xor(bits[k], bits[0])
        assert np.array_equal(decode_xor(blob, bits[0]), bits[k])
        rows.append(
            {
                "behind": k,
                "lr": lr,
                "delta_bytes": len(blob),
                "chain_bytes": sum(step_bytes[:k]),
                "engine_chain_bytes": sum(len(m) for m in messages[:k]),
                "bf16_full_bytes": full,
                "changed_frac": float(np.mean(bits[k] != bits[0])),
            }
        )
    return rows


# --- the receiver, on the sampler node ------------------------------------------------------------


class Receiver:
    """Lives on the sampler node; holds the sampler's current bf16 weights (the delta base)."""

    def __init__(self):
        self.base: Optional[np.ndarray] = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def set_base(self, box: list) -> str:
        import ray

        self.base = np.frombuffer(ray.get(box[0]), dtype=np.uint16).copy()
        return sha256(self.base)

    def fetch(self, box: list, form: str) -> dict:
        """Pull the object (``box`` keeps Ray from resolving it before the clock starts), decode
        it, and return seconds and the checksum of what was reconstructed."""
        import ray

        from verl_ext.hetero.weights import deserialize_state_dict

        t0 = time.perf_counter()
        data = ray.get(box[0], timeout=300)
        t1 = time.perf_counter()
        if form == "bf16-xor":
            digest = sha256(decode_xor(data, self.base))
        else:
            _, state = deserialize_state_dict(data)
            digest = (
                sha256(bf16_bits(state))
                if form == "bf16"
                else sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state)))
            )
        return {"bytes": len(data), "transfer_s": t1 - t0, "decode_s": time.perf_counter() - t1, "sha256": digest}


# --- the run --------------------------------------------------------------------------------------


def encode_forms(v0: dict, v1: dict) -> dict[str, dict]:
    """Each form's wire bytes for version v+1, encode seconds and the checksum the receiver must get."""
    from verl_ext.hetero.weights import serialize_state_dict

    out = {}
    t0 = time.perf_counter()
    out["fp32"] = {"blob": serialize_state_dict(v1, 1, wire_dtype=None)}
    out["fp32"]["encode_s"] = time.perf_counter() - t0
    out["fp32"]["sha256"] = sha256(b"".join(v1[k].numpy().tobytes() for k in sorted(v1)))
    t0 = time.perf_counter()
    out["bf16"] = {"blob": serialize_state_dict(v1, 1, wire_dtype="bf16")}
    out["bf16"]["encode_s"] = time.perf_counter() - t0
    new_bits = bf16_bits(v1)
    out["bf16"]["sha256"] = sha256(new_bits)
    t0 = time.perf_counter()
    out["bf16-xor"] = {"blob": encode_xor(new_bits, bf16_bits(v0))}
    out["bf16-xor"]["encode_s"] = time.perf_counter() - t0
    out["bf16-xor"]["sha256"] = out["bf16"]["sha256"]
    changed = int(np.count_nonzero(new_bits != bf16_bits(v0)))
    out["bf16-xor"]["changed_frac"] = changed / new_bits.size
    return out


def extrapolate(bytes_per_param: float) -> dict[str, dict[str, float]]:
    """Seconds per version for the big models at 1 and 10 Gbit/s, from measured bytes/parameter
    (wire rate only: no protocol overhead, no latency)."""
    return {
        name: {f"{g:g}Gbit": n * bytes_per_param * 8 / (g * 1e9) for g in BIG_RATES_GBIT}
        for name, n in BIG_MODELS.items()
    }


def run(rates: list[float], trials: int, model_path: str, lr: float) -> dict:
    cluster.join_env()
    import ray

    link_cfg, cfg = link.LinkConfig(), cluster.ClusterConfig()
    v0, v1 = two_versions(model_path, lr)
    params = sum(t.numel() for t in v1.values() if t.is_floating_point())
    forms = encode_forms(v0, v1)
    result: dict = {
        "model_path": model_path,
        "params": params,
        "lr": lr,
        "trials": trials,
        "loadavg_before": Path("/proc/loadavg").read_text().split()[:3],
        "rows": [],
    }
    for name, f in forms.items():
        result.setdefault("forms", {})[name] = {
            "bytes": len(f["blob"]),
            "bytes_per_param": len(f["blob"]) / params,
            "encode_s": f["encode_s"],
            **({"changed_frac": f["changed_frac"]} if "changed_frac" in f else {}),
            "extrapolated_s": extrapolate(len(f["blob"]) / params),
        }
    address = cluster.up(cfg, link_cfg, rates[0])
    try:
        ray.init(
            address=address,
            _node_ip_address=link_cfg.host_ip,
            log_to_driver=False,
            logging_level="ERROR",
            runtime_env={"env_vars": {"PYTHONPATH": f"{REPO}:{REPO / 'research' / 'testbeds' / 'wan'}"}},
        )
        receiver = ray.remote(num_cpus=0)(Receiver).options(resources={"sampler_node": 0.01}).remote()
        result["receiver_ip"] = ray.get(receiver.node_ip.remote(), timeout=120)
        if result["receiver_ip"] != link_cfg.ns_ip:
            raise RuntimeError(f"receiver runs on {result['receiver_ip']}, not the sampler node {link_cfg.ns_ip}")
        for rate in rates:
            link.set_rate(link_cfg, rate)
            base = bf16_bits(v0).tobytes()
            ray.get(receiver.set_base.remote([ray.put(base)]), timeout=300)  # the sampler holds version v
            tcp = probe.transfer(link_cfg, len(forms["fp32"]["blob"]), timeout=300)
            result["rows"].append(
                {"rate_mbit": rate, "form": "raw-tcp", "bytes": tcp["bytes"], "transfer_s": tcp["seconds"]}
            )
            for name in FORMS:
                for trial in range(trials):
                    ref = ray.put(forms[name]["blob"])  # a new object each time: nothing cached on the worker
                    got = ray.get(receiver.fetch.remote([ref], name), timeout=300)
                    if got["sha256"] != forms[name]["sha256"]:
                        raise RuntimeError(f"{name} at {rate} Mbit/s: checksum mismatch after reconstruction")
                    del ref
                    result["rows"].append({"rate_mbit": rate, "form": name, "trial": trial, **got})
                    print(json.dumps(result["rows"][-1]), flush=True)
        result["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.down(cfg, link_cfg)
    return result


def summarize(result: dict) -> list[dict]:
    """Median transfer seconds and effective Mbit/s per (rate, form)."""
    groups: dict[tuple, list] = {}
    for row in result["rows"]:
        groups.setdefault((row["rate_mbit"], row["form"]), []).append(row)
    out = []
    for (rate, form), rows in groups.items():
        t = float(np.median([r["transfer_s"] for r in rows]))
        out.append(
            {
                "rate_mbit": rate,
                "form": form,
                "bytes": rows[0]["bytes"],
                "transfer_s": t,
                "decode_s": float(np.median([r.get("decode_s", 0.0) for r in rows])),
                "effective_mbit_s": rows[0]["bytes"] * 8 / 1e6 / t,
            }
        )
    return out


DEFAULT_RATES, DEFAULT_TRIALS = "10,100,1000", 3


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the checked arguments (exits with a usage error naming a bad or conflicting
    one): ``--behind`` is a separate offline measurement that only prints, so the link
    benchmark's ``--rates``, ``--trials`` and ``--out`` are refused with it, not ignored."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default=None, help=f"comma-separated Mbit/s (default {DEFAULT_RATES})")
    parser.add_argument(
        "--trials", type=int, default=None, help=f"transfers per rate and form (1-10, default {DEFAULT_TRIALS})"
    )
    parser.add_argument("--model-path", default="", help="HF folder; default: the cached toy model")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW lr of the step between versions")
    parser.add_argument("--out", default=None, help="write the full result as JSON here (not with --behind)")
    parser.add_argument(
        "--behind",
        default=None,
        help="e.g. 1,2,4,8,16: only print the bf16-xor delta's bytes "
        "for a sampler k versions behind as JSON lines (no network, no privileges), then exit; "
        "not with --rates, --trials, --out",
    )
    args = parser.parse_args(argv)
    if args.behind is not None:
        given = [
            flag
            for flag, value in (("--rates", args.rates), ("--trials", args.trials), ("--out", args.out))
            if value is not None
        ]
        if given:
            parser.error(
                f"{', '.join(given)} with --behind {args.behind}: --behind only prints its rows (JSON lines: "
                "redirect stdout to keep them) and runs no link benchmark; drop " + ", ".join(given)
            )
        try:
            args.behind = [int(k) for k in args.behind.split(",")]
        except ValueError:
            parser.error(f"--behind {args.behind!r}: expected comma-separated integers, e.g. 1,2,4,8")
        if not all(1 <= k <= 64 for k in args.behind):
            parser.error(f"--behind {','.join(map(str, args.behind))}: each k must be in [1, 64]")
        return parser, args
    args.rates = DEFAULT_RATES if args.rates is None else args.rates
    args.trials = DEFAULT_TRIALS if args.trials is None else args.trials
    try:
        args.rates = [link.parse_rate_mbit(r) for r in args.rates.split(",")]
    except ValueError as err:
        parser.error(str(err))
    if not 1 <= args.trials <= 10:
        parser.error(f"--trials {args.trials}: must be in [1, 10]")
    return parser, args


def main(argv: Optional[Sequence[str]] = None) -> int:
    _, args = parse_args(argv)
    if args.behind is not None:
        for row in delta_vs_behind(args.model_path or default_toy_model(), args.lr, args.behind):
            print(json.dumps(row))
        return 0
    problems = link.missing_requirements(link.effective_caps())
    if problems:
        print(link.refusal_message(problems), file=sys.stderr)
        return link.EXIT_REFUSED
    model_path = args.model_path or default_toy_model()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run()'s finally tears down
    result = run(args.rates, args.trials, model_path, args.lr)
    result["summary"] = summarize(result)
    print(
        json.dumps({k: result[k] for k in ("params", "forms", "summary", "loadavg_before", "loadavg_after")}, indent=1)
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def default_toy_model() -> str:
    """The toy warm start cached by ``make demo`` / any toy run (never trained here: bounded time)."""
    found = sorted((REPO / ".cache" / "heterorl").glob("toy_add*/config.json"))
    if not found:
        raise SystemExit("no cached toy model under .cache/heterorl; run `make demo` once or pass --model-path")
    return str(found[0].parent)


if __name__ == "__main__":
    sys.exit(main())
