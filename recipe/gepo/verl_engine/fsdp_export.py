"""A verl FSDP actor checkpoint as a float32 Hugging Face folder (for ``recipe.gepo.evaluate``).

    python -m recipe.gepo.verl_engine.fsdp_export RUN_DIR/global_step_N/actor OUT_DIR

verl's own ``python -m verl.model_merger merge --backend fsdp`` casts every weight to bfloat16
(``fsdp_model_merger.py``: ``tensor._local_tensor.bfloat16()``). At the small learning rates of a
real LM run (1e-5) most of an update is below bfloat16's resolution (8 bits of mantissa: a relative
step of 2e-4 on a weight rounds back to the weight), so the merged model would mostly be the
starting model again. This export keeps float32: it reads the ranks' shards
(``model_world_size_W_rank_R.pt``, FSDP2 DTensors on a 1-D data-parallel mesh), concatenates each
sharded parameter along its shard dimension, and saves the model with the config and tokenizer verl
wrote to ``actor/huggingface``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch


def load_fsdp_state_dict(actor_dir: Path) -> dict[str, torch.Tensor]:
    """The full float32 state dict of an FSDP2 actor checkpoint with a 1-D mesh (any world size)."""
    from torch.distributed.tensor import DTensor

    meta = json.loads((actor_dir / "fsdp_config.json").read_text())
    if int(meta.get("FSDP_version", 0)) != 2:
        raise ValueError(
            f"{actor_dir}/fsdp_config.json: FSDP_version={meta.get('FSDP_version')!r}; only FSDP2 is supported"
        )
    world = int(meta["world_size"])
    shards = [
        torch.load(actor_dir / f"model_world_size_{world}_rank_{rank}.pt", map_location="cpu", weights_only=False)
        for rank in range(world)
    ]
    merged: dict[str, torch.Tensor] = {}
    for key in shards[0]:
        parts = [shard[key] for shard in shards]
        if not isinstance(parts[0], DTensor):
            merged[key] = parts[0].float()
            continue
        placements = parts[0].placements
        if len(placements) != 1:
            raise ValueError(f"{key}: a {len(placements)}-D device mesh (FSDP + TP) is not supported")
        placement = placements[0]
        local = [p._local_tensor.float() for p in parts]
        if placement.is_replicate():
            merged[key] = local[0]
        elif placement.is_shard():
            merged[key] = torch.cat(local, dim=placement.dim).contiguous()
        else:
            raise ValueError(f"{key}: placement {placement} is not supported")
    return merged


def export(actor_dir: Path, out_dir: Path) -> Path:
    """Write ``out_dir`` (model.safetensors in float32, config, tokenizer); returns it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hf_dir = actor_dir / "huggingface"
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir}/config.json: not a verl actor checkpoint (expected actor/huggingface)")
    config = AutoConfig.from_pretrained(hf_dir)
    config.dtype = torch.float32
    state = load_fsdp_state_dict(actor_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing = set(model.state_dict()) - set(state)
    if getattr(config, "tie_word_embeddings", False):
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"{actor_dir}: the checkpoint lacks {sorted(missing)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out_dir)
    return out_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("actor_dir", type=Path, help="RUN_DIR/global_step_N/actor")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    if not args.actor_dir.is_dir():
        parser.error(f"{args.actor_dir}: no such directory")
    print(export(args.actor_dir, args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
