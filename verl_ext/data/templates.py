"""Prompt templates: Qwen3 chat with thinking on or off, any model's own chat template, plain text,
and the toy task.

Two forms of the same prompt: :func:`build_messages`, the chat messages verl's parquet stores in
``prompt`` (verl applies the tokenizer's chat template, with :func:`chat_template_kwargs`), and
:func:`render_prompt`, the exact text a model is fed (HF generation, evaluation). Templates
(:data:`TEMPLATES`): ``qwen3_think`` / ``qwen3_nothink`` (Qwen3 chat, thinking on; off as Qwen3's
template renders ``enable_thinking=False``: an empty think block), ``plain`` (``Question: ...`` /
``Answer:``, for base models), ``toy`` (the addition prompt as is), ``chat`` (the model's own chat
template, no arguments; :func:`render_prompt` needs the tokenizer) and ``chat_1shot`` (``chat`` with
one worked example, :data:`ONE_SHOT_EXAMPLE`, before the problem, so that a weak model ends with a
``\\boxed{}`` answer: docs/gpu.md). The math templates append :data:`MATH_INSTRUCTION` (the
paper's models' instruction) so answers land in ``\\boxed{}`` where the reward looks for them.
"""

from __future__ import annotations

import re

__all__ = [
    "TEMPLATES",
    "MATH_INSTRUCTION",
    "ONE_SHOT_EXAMPLE",
    "build_messages",
    "render_prompt",
    "chat_template_kwargs",
    "check_template",
    "needs_tokenizer",
]

TEMPLATES = ("qwen3_think", "qwen3_nothink", "plain", "toy", "chat", "chat_1shot")
#: templates rendered by the model's own chat template (render_prompt needs its tokenizer)
_OWN_CHAT = ("chat", "chat_1shot")

#: appended (after a newline) to every math problem
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

#: the worked example of ``chat_1shot`` (made up, not from any benchmark), in the form the
#: problem that follows is left open in (``Problem: ...`` / ``Solution:``)
ONE_SHOT_EXAMPLE = (
    "Problem: Tom has 3 apples and buys 2 more. How many apples does he have now?\n"
    "Solution: Tom has 3 + 2 = 5 apples. The answer is \\boxed{5}."
)

_TOY_RE = re.compile(r"\d+\+\d+=")


def check_template(template: str) -> str:
    """Return ``template`` if known, else raise ValueError naming it and the known ones."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; known templates: {', '.join(TEMPLATES)}")
    return template


def needs_tokenizer(template: str) -> bool:
    """Whether ``template`` is rendered by the model's own chat template (``chat``, ``chat_1shot``):
    :func:`render_prompt` then needs the model's tokenizer."""
    return check_template(template) in _OWN_CHAT


def _check_problem(problem: str, template: str) -> str:
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"problem must be a non-empty str, got {problem!r:.200}")
    if template == "toy" and not _TOY_RE.fullmatch(problem):
        raise ValueError(f"toy problems look like '047+385=', got {problem!r:.200}")
    return problem


def _user_content(problem: str, template: str) -> str:
    if template == "toy":
        return problem
    if template == "chat_1shot":
        return f"{MATH_INSTRUCTION}\n\n{ONE_SHOT_EXAMPLE}\n\nProblem: {problem.strip()}\nSolution:"
    return f"{problem.strip()}\n{MATH_INSTRUCTION}"


def build_messages(problem: str, template: str = "qwen3_think") -> list[dict[str, str]]:
    """Chat form: ``[{"role": "user", "content": ...}]`` (one user turn, no system prompt).

    Thinking on/off is not part of the messages; it is a chat-template argument
    (:func:`chat_template_kwargs`), so both Qwen3 templates give the same messages.
    """
    check_template(template)
    _check_problem(problem, template)
    return [{"role": "user", "content": _user_content(problem, template)}]


def chat_template_kwargs(template: str) -> dict:
    """Extra ``apply_chat_template`` arguments of a template, e.g. ``{"enable_thinking": False}``.

    With verl: ``+data.apply_chat_template_kwargs.enable_thinking=false`` for ``qwen3_nothink``.
    """
    check_template(template)
    if template == "qwen3_think":
        return {"enable_thinking": True}
    if template == "qwen3_nothink":
        return {"enable_thinking": False}
    return {}


def _builtin_qwen3(content: str, thinking: bool) -> str:
    # Qwen3's chat template for a single user turn with add_generation_prompt=True
    text = f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    if not thinking:
        text += "<think>\n\n</think>\n\n"
    return text


def render_prompt(problem: str, template: str = "qwen3_think", tokenizer=None) -> str:
    """The prompt text for ``problem`` (a str), ready for ``tokenizer(text)``.

    Args:
        problem: the problem statement (toy: ``"047+385="``).
        template: one of :data:`TEMPLATES`.
        tokenizer: for the chat templates, a tokenizer whose own chat template is applied
            (``add_generation_prompt=True`` plus :func:`chat_template_kwargs`); None renders
            Qwen3's format without one (``chat``/``chat_1shot`` need one). Ignored by ``plain`` and ``toy``.
    """
    check_template(template)
    _check_problem(problem, template)
    if template == "toy":
        return problem
    content = _user_content(problem, template)
    if template == "plain":
        return f"Question: {content}\nAnswer:"
    if tokenizer is None and template in _OWN_CHAT:
        raise ValueError(
            f"template {template!r} applies the model's own chat template: pass its tokenizer "
            "(or use qwen3_nothink / plain, which render without one)"
        )
    if tokenizer is not None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"template {template!r} needs a tokenizer with a chat template; "
                f"{type(tokenizer).__name__} has none (pass tokenizer=None for the built-in Qwen3 format)"
            )
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}],
            tokenize=False,
            add_generation_prompt=True,
            **chat_template_kwargs(template),
        )
    return _builtin_qwen3(content, thinking=template == "qwen3_think")
