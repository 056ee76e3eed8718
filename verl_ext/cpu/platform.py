"""verl's platform interface for a machine with no accelerator: torch on the CPU, gloo collectives.

verl 0.9.1 picks its platform once per process (``verl.plugin.platform.get_platform``): first
``VERL_PLATFORM``, then every registered platform's ``is_platform_available``, in registration
order, then a fall-back to ``nvidia``. CUDA, NPU and ROCm are registered first, so on a machine
with any of them this class is never chosen; on a machine with none it is, and no environment
variable is needed.

Ray still schedules verl's workers on "GPU" bundles (verl's resource pools hard-code
``use_gpu=True``, ``single_controller/ray/base.py:210``): the CPU presets start Ray with *logical*
GPUs (``ray_kwargs.ray_init.num_gpus``), which Ray only counts; torch never sees a device.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Optional

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

PLATFORM_NAME = "cpu"


def accelerator_present() -> bool:
    """Whether torch sees a CUDA/ROCm or Ascend device in this process."""
    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


class _CPUDeviceModule(ModuleType):
    """What verl calls on ``get_torch_device()`` (torch.cuda's API), answered for the CPU.

    Memory and stream calls are no-ops or report host memory; seeding and RNG state go to torch's
    CPU generator. Anything else falls through to ``torch.cpu``.
    """

    def __init__(self):
        super().__init__("verl_ext.cpu.device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> str:
        return "cpu"  # verl uses it as a device: tensor.to(get_device_id())

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"


CPU_DEVICE_MODULE = _CPUDeviceModule()


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """torch on the CPU; gloo for collectives; logical Ray GPUs as scheduling slots."""

    def __init__(self) -> None:
        # the verl-internal fixes this platform needs are applied when it is chosen, never on GPUs
        from verl_ext.cpu.megatron import apply_megatron_patches
        from verl_ext.cpu.patches import apply_patches

        apply_patches()
        apply_megatron_patches()  # nothing without megatron-core; other megatron-core / mbridge versions refused

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return not accelerator_present()

    def current_device(self) -> str:
        # verl passes it to .to(...) (e.g. utils/fsdp_utils.py:507); an int would mean cuda:<int>
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # Ray sets it for logical GPUs; nothing reads it on the CPU

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
