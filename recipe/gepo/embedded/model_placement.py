"""Where the embedded engine's models run and in what precision, read in one place from the
``hetero:`` section: ``hetero.device``, ``hetero.learner_precision``, ``hetero.sampler_precision``.

- Every model of a run is built here (:meth:`Placement.load_learner`, :meth:`Placement.load_sampler`):
  loaded on the CPU, then moved to the device (a sampler's also cast to its precision).
- Every tensor a step makes follows its model: the learner moves its collated batch to its
  model's device, the sampler its prompts (:func:`model_device`); nothing falls back to a
  default device.
- Weights leave the device as CPU tensors (:func:`cpu_copy`): replay's snapshots, checkpoints,
  async mode's weight store. A sampler's ``load_state_dict`` copies them to its device and dtype.
- The learner keeps fp32 master weights, gradients and AdamW state whatever its precision: bf16
  means its forward passes run under ``torch.autocast(dtype=bfloat16)``
  (:attr:`Placement.learner_compute_dtype`, applied by :func:`recipe.gepo.embedded.policy.forward_logits`);
  the log-softmax and the loss stay in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``hetero.*_precision`` -> torch dtype."""


def check_device(device: str, key: str = "hetero.device") -> None:
    """Refuse (ValueError naming ``key`` and its value) a CUDA device this machine does not have."""
    if torch.device(device).type == "cpu":
        return
    if not torch.cuda.is_available():
        raise ValueError(
            f"{key}={device!r}: CUDA is not available here (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}, CUDA build {torch.version.cuda}); use {key}=cpu"
        )
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise ValueError(
            f"{key}={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s) "
            f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})"
        )


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s parameters (where its inputs must go)."""
    return next(model.parameters()).device


def cpu_copy(value: Any) -> Any:
    """``value`` with every tensor in it (nested dicts, lists, tuples) replaced by a detached CPU
    copy: what a checkpoint or a weight snapshot holds, loadable on any machine."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(v) for v in value)
    return value


@dataclass(frozen=True)
class Placement:
    """The device and precisions of one run (:meth:`of` the validated ``hetero:`` section)."""

    device: str
    """``hetero.device``: cpu | cuda | cuda:N."""
    learner_precision: str
    """``hetero.learner_precision``: fp32 | bf16 (compute; master weights fp32)."""
    sampler_precision: str
    """``hetero.sampler_precision``: fp32 | bf16 (the sampler model's dtype)."""

    @classmethod
    def of(cls, hetero: Any) -> "Placement":
        return cls(str(hetero.device), str(hetero.learner_precision), str(hetero.sampler_precision))

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def learner_compute_dtype(self) -> Optional[torch.dtype]:
        """The autocast dtype of the learner's forward passes, or None (fp32: no autocast)."""
        return None if self.learner_precision == "fp32" else DTYPES[self.learner_precision]

    @property
    def sampler_dtype(self) -> torch.dtype:
        return DTYPES[self.sampler_precision]

    def load_learner(self, path: str):
        """(model, tokenizer) of the learner: fp32 master weights on the device."""
        from .policy import load_policy

        model, tokenizer = load_policy(path)
        return model.to(self.torch_device), tokenizer

    def load_sampler(self, path: str):
        """(model, tokenizer) of a sampler: in the sampler's precision, on the device."""
        from .policy import load_policy

        # built in that dtype (as HF's from_pretrained does it: buffers such as the rotary
        # frequencies stay fp32), not cast afterwards
        model, tokenizer = load_policy(path, dtype=self.sampler_dtype)
        return model.to(self.torch_device), tokenizer
