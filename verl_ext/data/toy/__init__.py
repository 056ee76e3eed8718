"""The toy task: zero-padded n-digit addition, learned by a ~1M-parameter Llama on CPU.

``"047+385="`` -> ``"0432"`` (short answers) or the column-by-column scratchpad then the sum (long
answers). The modules, bottom to top: :mod:`.problems` (prompts, answers, scratchpad responses,
response lengths, and :func:`~.problems.toy_data_source`, the task's one name), :mod:`.model` (the
character tokenizer and the tiny Llama), :mod:`.scoring` (sampled accuracy through the reward
registry), :mod:`.cache` (a folder cache keyed by settings: file lock, atomic rename),
:mod:`.checkpoints` (the pinned supervised warm start, its weights' sha256, the model a run trains)
and :mod:`.__main__` (``python -m verl_ext.data.toy``: the warm start from the command line).
Import from the modules; this package itself exports nothing.
"""
