"""The toy task's tokenizer and model: a character-level tokenizer and a ~0.8M-parameter Llama.

* :func:`build_tokenizer` -- character-level ``PreTrainedTokenizerFast`` (WordLevel model from the
  ``tokenizers`` library): ``<pad>`` (id 0), ``<s>``, ``</s>``, ``<unk>``, the digits, ``+``, ``=``.
  Encoding adds ``<s>`` in front; left padding; decoding fuses characters (no spaces); a chat
  template (``<s>`` + message contents) so verl's chat-message prompts work unchanged.
* :func:`toy_model_config` -- the tiny Llama (hidden 128, 4 layers, 4 heads, FFN 512, tied
  embeddings).
* :func:`new_toy_model` -- a freshly initialised model from a seed (what the warm start trains).
* :func:`load_toy_model` -- a saved model folder back as ``(model, tokenizer)``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SPECIAL_TOKENS", "CHARS", "build_tokenizer", "toy_model_config", "new_toy_model", "load_toy_model"]

#: special tokens, in id order 0..3
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
#: the task's characters, ids 4..15
CHARS = tuple("0123456789+=")
_CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_tokenizer(model_max_length: int = 64):
    """The character tokenizer as a ``transformers.PreTrainedTokenizerFast``.

    Args:
        model_max_length: longest sequence in tokens the tokenizer reports (prompt + answer of a
            9-digit problem is 32 tokens).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS.values())
    vocab = {tok: i for i, tok in enumerate(specials + list(CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per char
    core.decoder = decoders.Fuse()  # join characters without spaces
    bos = SPECIAL_TOKENS["bos_token"]
    core.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
    )
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        model_max_length=model_max_length,
        padding_side="left",
        chat_template=_CHAT_TEMPLATE,
        **SPECIAL_TOKENS,
    )
    return tok


def toy_model_config(tokenizer=None, **overrides):
    """``LlamaConfig`` of the tiny model (~0.8M parameters); ``overrides`` replace fields.

    hidden 128, 4 layers, 4 attention heads (head dim 32, no GQA), FFN 512, tied input/output
    embeddings, 64 positions, vocabulary and special-token ids from ``tokenizer`` (default: a
    fresh :func:`build_tokenizer`).
    """
    from transformers import LlamaConfig

    tok = tokenizer if tokenizer is not None else build_tokenizer()
    fields = dict(
        vocab_size=len(tok),
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=512,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def new_toy_model(seed: int):
    """``(model, tokenizer)``: the tiny Llama initialised after ``torch.manual_seed(seed)``, with a
    generation config carrying the tokenizer's special-token ids."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tok = build_tokenizer()
    model = LlamaForCausalLM(toy_model_config(tok))
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    return model, tok


def load_toy_model(path: str | os.PathLike):
    """``(model, tokenizer)`` from a saved model folder, e.g. a warm start (float32, eval mode)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"not a model folder (no config.json): {str(path)!r}")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    return model, tok
