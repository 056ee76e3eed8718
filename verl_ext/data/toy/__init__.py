"""The toy task: zero-padded n-digit addition, learned by a ~1M-parameter Llama on CPU.

``"047+385="`` -> ``"0432"`` (short answers) or the column-by-column scratchpad then the sum
(long answers). The package's modules, bottom to top:

* :mod:`.problems` -- prompts, answers, scratchpad responses, response lengths, and
  :func:`~.problems.toy_data_source`, the task's one name (``toy_add3``, ``toy_add3_scratch``).
* :mod:`.model` -- the character tokenizer and the tiny Llama (config, fresh init, loading).
* :mod:`.scoring` -- sampled accuracy of a model on problems, through the reward registry.
* :mod:`.cache` -- a folder cache keyed by settings (file lock, atomic rename).
* :mod:`.checkpoints` -- the pinned supervised warm start (N steps, the same weights on any
  machine), its weights' sha256, and the model a run trains.
* ``python -m verl_ext.data.toy`` (:mod:`.__main__`) -- the warm start from the command line.

Import from the modules; this package itself exports nothing.
"""
