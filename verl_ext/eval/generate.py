"""Sampling completions for evaluation: HF transformers (CPU or one GPU), vLLM when importable.

:class:`SamplingParams` defaults are the paper's protocol (temperature 0.6, top_p 0.95, top_k 20,
8 samples per problem); ``max_new_tokens`` is the caller's (the evaluation entry point: 4096).
:class:`HFGenerator` runs batched ``model.generate`` with left padding and an explicit seed per
call, so a batch of prompts with a seed samples the same completions on the same machine.
:class:`VLLMGenerator` is a thin wrapper, used only when ``vllm`` is importable (``engine=auto``
picks it only with CUDA and when vLLM honours every option set); untested here (docs/evaluation.md,
"Generation engines"). :func:`check_engine_options` decides, without importing vLLM, which
settings an engine honours, and refuses one it would ignore naming the key and value, before
anything is loaded. Models load from an HF folder or a GGUF file (``model_path=/dir/model.gguf``,
or a folder holding exactly one ``.gguf`` and no ``config.json``), GGUF weights dequantised.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from verl_ext.sampling import eos_mask, generate

__all__ = [
    "SamplingParams",
    "Completion",
    "resolve_model_path",
    "load_model_and_tokenizer",
    "HFGenerator",
    "VLLMGenerator",
    "vllm_available",
    "check_engine_options",
    "resolve_engine",
    "vllm_llm_kwargs",
    "make_generator",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings (paper defaults)."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    max_new_tokens: int = 4096

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (sampling evaluation)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables top-k)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")


@dataclass(frozen=True)
class Completion:
    """One sampled completion: decoded ``text`` (special tokens removed), number of generated
    tokens up to and including the first stop token, and whether it hit ``max_new_tokens``."""

    text: str
    n_tokens: int
    truncated: bool


def resolve_model_path(model_path: str | Path | None) -> tuple[Path, str | None]:
    """Return ``(folder, gguf_file_name_or_None)``; raise naming the path if unusable."""
    if model_path is None or str(model_path).strip() in ("", "None", "null", "???"):
        raise ValueError("model_path is not set: pass model_path=<HF folder or .gguf file>")
    p = Path(str(model_path)).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model_path {str(p)!r} does not exist")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"model_path {str(p)!r} is a file but not a .gguf; give an HF folder or a .gguf file")
        return p.parent, p.name
    if (p / "config.json").is_file():
        return p, None
    ggufs = sorted(x.name for x in p.glob("*.gguf"))
    if len(ggufs) == 1:
        return p, ggufs[0]
    raise FileNotFoundError(
        f"model_path {str(p)!r} has no config.json and "
        + (f"{len(ggufs)} .gguf files {ggufs}: name one" if ggufs else "no .gguf file")
    )


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model_and_tokenizer(model_path, dtype: str = "float32", device: str = "auto", tokenizer_path=None):
    """Load ``(model, tokenizer)`` for generation (eval mode, on ``device``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} unknown; choose one of {sorted(_DTYPES)}")
    folder, gguf = resolve_model_path(model_path)
    kw = {"gguf_file": gguf} if gguf else {}
    if tokenizer_path:
        tfolder, tgguf = Path(str(tokenizer_path)), None
        if not tfolder.exists():
            raise FileNotFoundError(f"tokenizer_path {str(tfolder)!r} does not exist")
        if tfolder.is_file() and tfolder.suffix == ".gguf":
            tfolder, tgguf = tfolder.parent, tfolder.name
        tokenizer = AutoTokenizer.from_pretrained(str(tfolder), **({"gguf_file": tgguf} if tgguf else {}))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=_DTYPES[dtype], **kw)
    model.to(_pick_device(device)).eval()
    return model, tokenizer


def _stop_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for v in (gen_eos, tokenizer.eos_token_id):
        if v is None:
            continue
        for i in v if isinstance(v, (list, tuple)) else [v]:
            if int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("neither the model's generation_config nor the tokenizer defines an eos token")
    return ids


class HFGenerator:
    """Batched sampling with ``transformers``' ``generate``.

    ``batch_size`` is the number of sequences per ``generate`` call (prompts x samples are
    flattened, so one call may hold several problems).
    """

    engine = "hf"

    def __init__(
        self,
        model,
        tokenizer,
        params: SamplingParams,
        batch_size: int = 16,
        add_special_tokens: bool | None = None,
        show_progress: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.model, self.tokenizer, self.params = model, tokenizer, params
        self.batch_size = int(batch_size)
        self.add_special_tokens = add_special_tokens
        self.show_progress = show_progress
        self.stop_ids = _stop_ids(model, tokenizer)
        if tokenizer.pad_token_id is None:  # padding is masked out; any stop token will do
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(self.stop_ids[0])
        self.pad_id = tokenizer.pad_token_id

    @classmethod
    def from_path(
        cls,
        model_path,
        params: SamplingParams,
        batch_size: int = 16,
        dtype: str = "float32",
        device: str = "auto",
        tokenizer_path=None,
        **kw,
    ) -> HFGenerator:
        model, tok = load_model_and_tokenizer(model_path, dtype=dtype, device=device, tokenizer_path=tokenizer_path)
        return cls(model, tok, params, batch_size=batch_size, **kw)

    def _encode(self, prompts: Sequence[str]):
        tok = self.tokenizer
        add = self.add_special_tokens
        if add is None:  # a rendered chat prompt that already starts with BOS gets no second one
            add = not (tok.bos_token and all(p.startswith(tok.bos_token) for p in prompts))
        old_side = tok.padding_side
        tok.padding_side = "left"  # decoder-only: new tokens must follow the prompt directly
        try:
            enc = tok(list(prompts), return_tensors="pt", padding=True, add_special_tokens=add)
        finally:
            tok.padding_side = old_side
        return enc

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], n: int, seed: int = 0, desc: str = "sampling") -> list[list[Completion]]:
        """``n`` completions for each prompt: ``out[i][j]`` is sample ``j`` of prompt ``i``.

        Batches are seeded with ``seed + batch_index``; results depend on the batch layout.
        """
        from tqdm.auto import tqdm

        if n < 1:
            raise ValueError(f"n={n} samples per prompt must be >= 1")
        rows = [(i, j) for i in range(len(prompts)) for j in range(n)]
        out: list[list[Completion | None]] = [[None] * n for _ in prompts]
        p = self.params
        device = next(self.model.parameters()).device
        with tqdm(total=len(rows), desc=desc, unit="seq", disable=not self.show_progress, leave=False) as bar:
            for b, start in enumerate(range(0, len(rows), self.batch_size)):
                batch = rows[start : start + self.batch_size]
                enc = self._encode([prompts[i] for i, _ in batch]).to(device)
                gen = generate(
                    self.model,
                    enc["input_ids"],
                    enc["attention_mask"],
                    max_new_tokens=p.max_new_tokens,
                    eos_token_ids=self.stop_ids,
                    pad_token_id=self.pad_id,
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k,
                    seed=int(seed) + b,
                    with_log_q=False,
                )
                lengths = eos_mask(gen.tokens, self.stop_ids).sum(dim=-1).tolist()  # up to and including the stop
                for r, (i, j) in enumerate(batch):
                    n_tok = lengths[r]
                    truncated = gen.tokens[r, n_tok - 1].item() not in self.stop_ids
                    ids = gen.tokens[r, :n_tok] if truncated else gen.tokens[r, : n_tok - 1]
                    text = self.tokenizer.decode(ids, skip_special_tokens=True)
                    out[i][j] = Completion(text=text, n_tokens=n_tok, truncated=truncated)
                bar.update(len(batch))
        return out  # type: ignore[return-value]


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


#: devices vLLM runs on as asked: it places a single-GPU model on the first visible GPU itself
_VLLM_DEVICES = ("auto", "cuda", "cuda:0")


def check_engine_options(
    engine: str,
    *,
    tokenizer_path=None,
    dtype: str = "float32",
    device: str = "auto",
    batch_size: int = 16,
    samples_per_problem: int | None = None,
) -> None:
    """Refuse, naming the key and value, an option ``engine`` (``hf`` or ``vllm``) would not
    honour. Pure: imports neither vLLM nor a model, so it runs at start.

    HF honours all of them. vLLM takes ``tokenizer_path`` (an HF tokenizer folder, as its
    ``tokenizer=``) and every ``dtype``; it cannot be pointed at the CPU or a given GPU (it uses the
    visible GPUs: set ``CUDA_VISIBLE_DEVICES``), and it schedules a generate call's sequences
    itself, so ``batch_size`` acts only as the chunk size: a chunk of one problem still sends its
    ``samples_per_problem`` sequences in one call.
    """
    if engine not in ("hf", "vllm"):
        raise ValueError(f"engine={engine!r} unknown; choose hf or vllm (auto is resolved by resolve_engine)")
    if dtype not in ("auto", *_DTYPES):
        raise ValueError(f"dtype={dtype!r} unknown; choose one of {['auto', *sorted(_DTYPES)]}")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if engine == "hf":
        return
    if str(device) not in _VLLM_DEVICES:
        raise ValueError(
            f"device={device!r} is not honoured by engine=vllm (vLLM runs on the visible GPU; choose a GPU with "
            "CUDA_VISIBLE_DEVICES and device=auto or cuda), or use engine=hf"
        )
    if tokenizer_path and str(tokenizer_path).endswith(".gguf"):
        raise ValueError(
            f"tokenizer_path={str(tokenizer_path)!r}: engine=vllm takes an HF tokenizer folder (its tokenizer=), "
            "not a .gguf file; give the base model's tokenizer folder or use engine=hf"
        )
    if samples_per_problem is not None and batch_size < samples_per_problem:
        raise ValueError(
            f"batch_size={batch_size} is not honoured by engine=vllm with samples_per_problem={samples_per_problem}: "
            "vLLM gets a problem's samples in one call and batches them itself; set batch_size >= "
            "samples_per_problem or use engine=hf"
        )


def resolve_engine(engine: str, *, vllm_usable: bool | None = None, **options) -> str:
    """``hf`` or ``vllm`` for ``engine`` (``auto``, ``hf``, ``vllm``), after
    :func:`check_engine_options` on ``options``. ``auto`` is vLLM when it is importable, CUDA is
    available (``vllm_usable``; detected when None) and vLLM honours every option, else HF."""
    if engine not in ("auto", "hf", "vllm"):
        raise ValueError(f"engine={engine!r} unknown; choose auto, hf or vllm")
    if engine == "auto":
        if vllm_usable is None:
            vllm_usable = vllm_available() and torch.cuda.is_available()
        engine = "hf"
        if vllm_usable:
            try:
                check_engine_options("vllm", **options)
                engine = "vllm"
            except ValueError:
                pass  # an option only HF honours (device=cpu, a .gguf tokenizer, ...): auto means HF
    check_engine_options(engine, **options)
    return engine


def vllm_llm_kwargs(model_path, dtype: str = "bfloat16", seed: int = 0, tokenizer_path=None) -> dict:
    """The keyword arguments of ``vllm.LLM`` for these settings (checked, no vLLM import)."""
    check_engine_options("vllm", tokenizer_path=tokenizer_path, dtype=dtype)
    folder, gguf = resolve_model_path(model_path)
    kw = {"model": str(folder / gguf) if gguf else str(folder), "dtype": dtype, "seed": int(seed)}
    if tokenizer_path:
        tok = Path(str(tokenizer_path)).expanduser()
        if not tok.exists():
            raise FileNotFoundError(f"tokenizer_path {str(tok)!r} does not exist")
        kw["tokenizer"] = str(tok)
    return kw


class VLLMGenerator:
    """Thin vLLM path (GPU). Not exercised in this repository's CPU environment."""

    engine = "vllm"

    def __init__(
        self,
        model_path,
        params: SamplingParams,
        dtype: str = "bfloat16",
        seed: int = 0,
        tokenizer_path=None,
        show_progress: bool = True,
        **llm_kw,
    ):
        kw = vllm_llm_kwargs(model_path, dtype=dtype, seed=seed, tokenizer_path=tokenizer_path)
        if not vllm_available():
            raise ImportError("engine=vllm but the 'vllm' package is not importable")
        from vllm import LLM

        self.params = params
        self.show_progress = show_progress
        self.llm = LLM(**kw, **llm_kw)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompts: Sequence[str], n: int, seed: int = 0, desc: str = "sampling") -> list[list[Completion]]:
        from vllm import SamplingParams as VSP

        p = self.params
        sp = VSP(
            n=n,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else -1,
            max_tokens=p.max_new_tokens,
            seed=int(seed),
        )
        results = self.llm.generate(list(prompts), sp, use_tqdm=self.show_progress)
        return [
            [
                Completion(text=o.text, n_tokens=len(o.token_ids), truncated=o.finish_reason == "length")
                for o in r.outputs
            ]
            for r in results
        ]


def make_generator(
    engine: str,
    model_path,
    params: SamplingParams,
    batch_size: int = 16,
    dtype: str = "float32",
    device: str = "auto",
    tokenizer_path=None,
    seed: int = 0,
    show_progress: bool = True,
    samples_per_problem: int | None = None,
):
    """``engine``: ``hf``, ``vllm``, or ``auto`` (see :func:`resolve_engine`). Every option reaches
    the engine or is refused (:func:`check_engine_options`) before vLLM is imported."""
    engine = resolve_engine(
        engine,
        tokenizer_path=tokenizer_path,
        dtype=dtype,
        device=device,
        batch_size=batch_size,
        samples_per_problem=samples_per_problem,
    )
    if dtype == "auto":  # the documented rule for both engines (vLLM's own "auto" would be the checkpoint's)
        dtype = "bfloat16" if torch.cuda.is_available() and str(device) != "cpu" else "float32"
    if engine == "vllm":
        return VLLMGenerator(
            model_path, params, dtype=dtype, seed=seed, tokenizer_path=tokenizer_path, show_progress=show_progress
        )
    return HFGenerator.from_path(
        model_path,
        params,
        batch_size=batch_size,
        dtype=dtype,
        device=device,
        tokenizer_path=tokenizer_path,
        show_progress=show_progress,
    )
