"""Every loss in one package: the maths, its options, verl's registry, the objective both engines compute.

``importance``, ``losses``, ``advantages``, ``diagnostics``: pure torch on [B, T] tensors;
``compiled``: the group losses as one ``torch.compile`` graph; ``config``: the ``policy_loss:`` options
(``HeteroPolicyLossConfig``); ``registry``: the losses and estimators registered into verl (entry
point ``heterorl``); ``objective``: ``compute_actor_loss``, the actor's loss in both engines;
``worker_loss``: verl's ``ppo_loss`` replacement on the verl engine's workers. Importing the package
imports none of them (``config`` alone registers nothing). Adding a loss: docs/algorithms.md.
"""
