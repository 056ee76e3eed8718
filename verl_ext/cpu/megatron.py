"""verl 0.9.1's Megatron engine on the CPU: megatron-core 0.16.1 and mbridge 0.15.1 over gloo.

Applied by :class:`verl_ext.cpu.platform.PlatformCPU` when verl picks it (never on GPUs), through
the post-import hooks of :mod:`verl_ext.cpu.patches` (inside Ray workers too, only to the modules a
process imports). Nothing happens without megatron-core; on other versions nothing is patched and
the Megatron engine for device ``cpu`` refuses to start naming them
(:class:`UnsupportedMegatronVersion`); FSDP runs are unaffected. Each fix names the file:line it
works around (under ``megatron/core/``, ``mbridge/``, ``verl/``). The other settings a run needs
(local attention, no packed sequences, ``vanilla_mbridge``, float32):
``configs/verl_preset/cpu_toy_megatron.yaml``. Registered at plugin import instead:
:func:`fix_tied_embeddings_with_pipeline` (not a CPU fix: every device) and :func:`allow_float32_on_cpu`
(no accelerator: verl validates the config on the driver before it picks a platform).
"""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from functools import partial, wraps
from importlib import metadata
from types import ModuleType
from typing import Any, Callable, Mapping, Optional

import torch

from verl_ext.import_hooks import after_import, after_import_package

PATCHED_VERSIONS = {"megatron-core": "0.16.1", "mbridge": "0.15.1"}
logger = logging.getLogger(__name__)
_applied = False


class UnsupportedMegatronVersion(RuntimeError):
    """verl_ext.cpu was asked to run a megatron-core / mbridge release it was not written for."""


def installed_versions() -> dict[str, Optional[str]]:
    """The installed version of each distribution in :data:`PATCHED_VERSIONS` (None: not installed)."""
    versions = {}
    for dist in PATCHED_VERSIONS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def check_versions(versions: Mapping[str, Optional[str]]) -> bool:
    """False if megatron-core is not installed (nothing to patch); True on the patched versions;
    :class:`UnsupportedMegatronVersion` naming every mismatch otherwise."""
    if versions.get("megatron-core") is None:
        return False
    wrong = {dist: versions.get(dist) for dist, pinned in PATCHED_VERSIONS.items() if versions.get(dist) != pinned}
    if wrong:
        found = ", ".join(f"{dist} {v or '(not installed)'}" for dist, v in wrong.items())
        wanted = ", ".join(f"{dist}=={v}" for dist, v in PATCHED_VERSIONS.items())
        raise UnsupportedMegatronVersion(
            f"verl_ext.cpu runs verl's Megatron engine on the CPU by patching {wanted} internals "
            f"(verl_ext/cpu/megatron.py names each file:line), but this machine has {found}. "
            f"Install {wanted} (`make install` does), use the FSDP preset (+verl_preset=cpu_toy), "
            "or run on GPUs, where these patches are not used."
        )
    return True


# ---- helpers ------------------------------------------------------------------------------------


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable], as_staticmethod: bool = False) -> None:
    """``owner.name = make(owner.name)``, once: applying it again is a no-op."""
    original = getattr(owner, name)
    if getattr(original, "_heterorl_patched", False):
        return
    replacement = wraps(original)(make(original))
    replacement._heterorl_patched = True
    setattr(owner, name, staticmethod(replacement) if as_staticmethod else replacement)


@contextmanager
def _cuda_tensor_calls_on_cpu():
    """While a wrapped megatron / verl call runs: CPU tensors report CUDA type names
    (``tensor.type()`` -> ``torch.cuda.FloatTensor``), and ``tensor.cuda()`` / ``.pin_memory()``
    leave them as they are. (``torch.Tensor`` attributes swapped for the duration of the call.)"""
    type_, cuda, pin = torch.Tensor.type, torch.Tensor.cuda, torch.Tensor.pin_memory

    def cuda_type(self, *args, **kwargs):
        name = type_(self, *args, **kwargs)
        return name if args or kwargs or name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type, torch.Tensor.cuda = cuda_type, lambda self, *args, **kwargs: self
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda, torch.Tensor.pin_memory = type_, cuda, pin


def _on_cpu_during(fn: Callable) -> Callable:
    def call(*args, **kwargs):
        with _cuda_tensor_calls_on_cpu():
            return fn(*args, **kwargs)

    return call


# ---- megatron-core's torch.cuda calls, answered on the CPU ----------------------------------------


class _CudaOnCPU(ModuleType):
    """What megatron-core's ``torch.cuda.*`` calls get: the CPU device and generator, no-op syncs.
    Anything not here is the real ``torch.cuda`` (and fails as it would have)."""

    is_available = staticmethod(lambda: False)
    current_device = staticmethod(lambda: "cpu")
    synchronize = empty_cache = staticmethod(lambda *args, **kwargs: None)
    manual_seed = manual_seed_all = staticmethod(lambda seed: torch.manual_seed(seed))
    get_rng_state = staticmethod(lambda device=None: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, device=None: torch.set_rng_state(state))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _cpu_device(device: Any) -> Any:
    """``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")`` or an int (= cuda:N) -> ``"cpu"``."""
    cuda = isinstance(device, int) and not isinstance(device, bool)
    return "cpu" if cuda or str(device).startswith("cuda") else device


def _factory_on_cpu(factory: Callable) -> Callable:
    @wraps(factory)
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    return call


TORCH_ON_CPU = ModuleType("torch", torch.__doc__)
"""A copy of torch's namespace for megatron-core's and mbridge's modules (torch itself is not
changed): ``cuda`` is :class:`_CudaOnCPU`, and tensor factories map a CUDA ``device=`` to the CPU."""
TORCH_ON_CPU.__dict__.update(torch.__dict__)
TORCH_ON_CPU.cuda = _CudaOnCPU("torch.cuda")
for _name in (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand",
    "randn",
    "randint",
):
    setattr(TORCH_ON_CPU, _name, _factory_on_cpu(getattr(torch, _name)))


def _use_torch_on_cpu(module: Any) -> None:
    """Blockers 1, 3, 4 (MEGATRON_ON_CPU.md): ``torch.cuda.current_device()`` as a ``device=``
    argument (175 calls in 57 files, e.g. ``tensor_parallel/layers.py``), ``torch.cuda.synchronize``
    / ``empty_cache`` (``pipeline_parallel/p2p_communication.py:242``), ``torch.cuda.manual_seed``
    (``tensor_parallel/random.py``), and hard-coded ``device='cuda'`` in ``optimizer/optimizer.py:485``,
    ``:907``, ``optimizer/clip_grads.py:103``, ``pipeline_parallel/schedules.py:596``, ``:2138``,
    ``utils.py:1207``, ``transformer/utils.py:35``. The module's global ``torch`` becomes
    :data:`TORCH_ON_CPU`: scoped to megatron-core's and mbridge's modules, not a torch-function mode."""
    if module.__dict__.get("torch") is torch:
        module.torch = TORCH_ON_CPU


# ---- per-site fixes -----------------------------------------------------------------------------


def _patch_rng_state(module: Any) -> None:
    """Blocker 2, ``tensor_parallel/random.py:41`` and ``:72``: the model-parallel RNG tracker saves
    and restores CUDA generator states (``torch.cuda.default_generators``); on the CPU its states
    are the CPU generator's."""
    module._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    module._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


def _patch_optimizer_types(module: Any) -> None:
    """Blocker 5, ``optimizer/distrib_optimizer.py:431`` (the raise; the checks at ``:361``, ``:420``,
    ``:582``): the distributed optimizer takes only ``torch.cuda.{Float,Half,BFloat16}Tensor``
    parameters. (``optimizer/optimizer.py:671``, ``:690``, the non-distributed optimizer, are not
    wrapped: verl fails before them, ``verl/utils/megatron_utils.py:827``.)"""
    _wrap(module.DistributedOptimizer, "__init__", _on_cpu_during)


def _patch_empty_optimizer_state(module: Any) -> None:
    """Resume, ``optimizer/distrib_optimizer.py:642``: without Apex/TransformerEngine (the CPU) the
    distributed optimizer takes ``step`` from its Adam state (``assert len(steps) == 1``), which is
    empty when a checkpoint is loaded into a fresh optimizer (the template ``sharded_state_dict``
    is built before any step). Then every param group's step is 0, as Adam's own is before its
    first step; the loaded checkpoint replaces it."""

    def make(state_dict: Callable) -> Callable:
        def empty_aware_state_dict(self):
            if module.HAVE_APEX_OR_TE or len(self.optimizer.state) > 0:
                return state_dict(self)
            inner = self.optimizer.state_dict()
            out = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
            for group in out["optimizer"]["param_groups"]:
                del group["params"]
                group["step"] = 0
            if self.grad_scaler:
                out["grad_scaler"] = self.grad_scaler.state_dict()
            return out

        return empty_aware_state_dict

    _wrap(module.DistributedOptimizer, "state_dict", make)

    def no_grad(set_states: Callable) -> Callable:
        def set_states_without_grad(*args, **kwargs):
            with torch.no_grad():
                return set_states(*args, **kwargs)

        return set_states_without_grad

    # Resume with float32 weights, ``optimizer/distrib_optimizer.py:940``: the main parameter is then
    # the model's own (a leaf that requires grad; bf16 runs copy into separate fp32 masters), and
    # ``copy_`` into it outside ``no_grad`` raises. Loading a checkpoint is not differentiated.
    _wrap(module.DistributedOptimizer, "_set_main_param_and_optimizer_states", no_grad)


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad: bool = False) -> None:
    """Blocker 5, ``optimizer/clip_grads.py:167``: megatron's version asserts
    ``torch.cuda.FloatTensor`` gradients and scales them with a CUDA multi-tensor kernel. The same
    operation: every gradient times ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
    from megatron.core.utils import to_local_if_dtensor

    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    for param in [parameters] if isinstance(parameters, torch.Tensor) else parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            to_local_if_dtensor(grad).detach().mul_(clip_coeff)


def _patch_clip_grads(module: Any) -> None:
    """Installs :func:`clip_grad_by_total_norm_fp32` in ``optimizer/clip_grads.py`` and where it is
    imported by name (``optimizer/optimizer.py:50``)."""
    module.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _patch_language_module_cuda(module: Any) -> None:
    """Blocker 4, ``models/common/language_module/language_module.py:244``: with tied embeddings and
    PP > 1, ``weight.data.cuda()`` before the embedding all-reduce."""
    _wrap(module.LanguageModule, "setup_embeddings_and_output_layer", _on_cpu_during)


def _patch_mbridge_get_model(module: Any) -> None:
    """Blocker 4, ``mbridge/core/util.py:151``: ``model_module.cuda(torch.cuda.current_device())``
    after building the model (``get_model``, imported by name into ``mbridge/core/bridge.py:16``)."""
    _wrap(module, "get_model", _on_cpu_during)


def _patch_snapshot_pinning(module: Any) -> None:
    """``verl/utils/megatron_utils.py:1937``, ``:1939``, ``:1949`` (found with the verl engine's
    trainer): the CPU weight snapshot (``copy_megatron_model_to_cpu``, behind
    ``DetachActorWorker.save_model_to_cpu``: delayed weight sync) pins each copy, which needs an
    accelerator ("Cannot access accelerator device"). The snapshot stays a copy, unpinned."""
    _wrap(module, "copy_megatron_model_to_cpu", _on_cpu_during)


def _register_megatron_engines_for_cpu(module: Any) -> None:
    """Blocker 6, ``verl/workers/engine/megatron/transformer_impl.py:1171`` and ``:1504`` register the
    Megatron engines for device cuda only (a registration through verl's ``EngineRegistry``)."""
    _register_for_cpu(module.MegatronEngineWithLMHead, module.MegatronEngineWithValueHead)


def _register_for_cpu(language_model: type, value_model: type) -> None:
    from verl.workers.engine.base import EngineRegistry

    for model_type, engine in (("language_model", language_model), ("value_model", value_model)):
        if "cpu" not in EngineRegistry._engines.get(model_type, {}).get("megatron", {}):
            EngineRegistry.register(model_type=model_type, backend="megatron", device="cpu")(engine)


def _local_spec(spec: Callable, config: Any, use_transformer_engine: bool = True, **kwargs) -> Any:
    return spec(config, use_transformer_engine=False, **kwargs)


def _patch_local_layer_spec(module: Any) -> None:
    """Blocker 7, ``mbridge/core/llm_bridge.py:149``: mbridge asks for the TransformerEngine layer
    spec unconditionally; TransformerEngine is CUDA-only, so the local (plain torch) spec is built."""
    _wrap(module, "get_gpt_decoder_block_spec", lambda spec: partial(_local_spec, spec))


LOCAL_SPEC_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}


def _patch_local_norm_names(module: Any) -> None:
    """Blocker 8, ``mbridge/core/bridge.py:649``: mbridge's HF <-> Megatron names assume
    TransformerEngine's norms fused into ``linear_qkv`` / ``linear_fc1``; the local spec has separate
    ``decoder.layers.N.input_layernorm`` and ``pre_mlp_layernorm`` (HF ``input_layernorm`` and
    ``post_attention_layernorm``)."""

    def make(to_hf: Callable) -> Callable:
        def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
            parts = mcore_weights_name.split(".")
            hf_norm = LOCAL_SPEC_NORMS.get(".".join(parts[3:])) if parts[:2] == ["decoder", "layers"] else None
            return [f"model.layers.{parts[2]}.{hf_norm}"] if hf_norm else to_hf(self, mcore_weights_name)

        return _weight_name_mapping_mcore_to_hf

    _wrap(module.Bridge, "_weight_name_mapping_mcore_to_hf", make)


def _patch_causal_attention_mask(module: Any) -> None:
    """Blocker 10: verl's BSHD path hands attention a ``[b, s]`` padding mask
    (``verl/models/mcore/util.py:708``), which TransformerEngine's causal attention ignores and the
    local ``DotProductAttention`` (``transformer/dot_product_attention.py:210``) cannot broadcast.
    Causal layers drop it: sequences are right-padded, so the causal mask alone is exact for every
    real token, as with TransformerEngine."""
    from megatron.core.transformer.enums import AttnMaskType

    def make(forward: Callable) -> Callable:
        def causal_forward(self, query, key, value, attention_mask, attn_mask_type=None, *args, **kwargs):
            if (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal:
                attention_mask = None
            return forward(self, query, key, value, attention_mask, attn_mask_type, *args, **kwargs)

        return causal_forward

    _wrap(module.DotProductAttention, "forward", make)


def _patch_norm_sequence_parallel(module: Any) -> None:
    """Blocker 11 (optional sequence parallel): ``transformer/torch_norm.py:32`` refuses
    ``sequence_parallel`` for the local norms. A norm is per token, so it works on a sequence shard;
    its weights are tagged ``sequence_parallel`` so megatron all-reduces their gradients over TP."""

    def make(new: Callable) -> Callable:
        def sequence_parallel_new(cls, config, *args, **kwargs):
            if not config.sequence_parallel:
                return new(cls, config, *args, **kwargs)
            plain = copy.copy(config)
            plain.sequence_parallel = False
            layer = new(cls, plain, *args, **kwargs)
            for param in layer.parameters():
                param.sequence_parallel = True
            return layer

        return sequence_parallel_new

    _wrap(module.WrappedTorchNorm, "__new__", make, as_staticmethod=True)


def _allow_float32_weights(module: Any) -> None:
    """``verl/workers/config/engine.py:218``: ``McoreEngineConfig`` accepts ``dtype`` bfloat16 or
    float16 only. On the CPU float32 is what the FSDP preset uses (bf16 puts up to 5e-2 nats between
    the learner's p and the float32 sampler's q on-policy, and rounds away much of a small Adam
    step), and megatron-core runs it (no ``Float16Module``, fp32 optimizer path). verl's other
    checks run as written: the dtype check sees bfloat16, then float32 is put back."""

    def make(post_init: Callable) -> Callable:
        def __post_init__(self) -> None:
            if self.dtype not in ("float32", "fp32"):
                return post_init(self)
            object.__setattr__(self, "dtype", "bfloat16")  # verl's configs refuse attribute writes
            try:
                post_init(self)
            finally:
                object.__setattr__(self, "dtype", "float32")

        return __post_init__

    _wrap(module.McoreEngineConfig, "__post_init__", make)


def allow_float32_on_cpu() -> None:
    """Registers :func:`_allow_float32_weights`. Called at plugin import on a machine with no
    accelerator (the condition under which verl picks the CPU platform; ``verl_ext/cpu/__init__.py``),
    not when the platform is picked: ``main_ppo`` and ``main_gepo``'s plan validate the config on
    the driver before anything asks verl for a platform. Only on the versions this module patches."""
    import verl

    try:
        if verl.__version__ != "0.9.1" or not check_versions(installed_versions()):
            return
    except UnsupportedMegatronVersion:
        return
    after_import("verl.workers.config.engine", _allow_float32_weights)


# ---- not CPU-specific ---------------------------------------------------------------------------


def _patch_tied_output_layer(module: Any) -> None:
    """Blocker 9, every device: with tied embeddings (``tie_word_embeddings``: the toy model, Qwen3
    <= 4B) and PP > 1 the last stage holds its own copy of the embedding as ``output_layer.weight``,
    which ``Bridge.load_weights`` looks up as ``lm_head.weight`` (``mbridge/core/bridge.py:188`` ->
    ``core/safetensor_io.py:56``): a tied checkpoint has none ("Weights {'lm_head.weight'} not
    found"). While loading, that name is read from ``model.embed_tokens.weight``; exported names
    (weight sync) stay mbridge's."""

    def make(load: Callable) -> Callable:
        def load_weights(self, models, weights_path, *args, **kwargs):
            if not getattr(self.hf_config, "tie_word_embeddings", False):
                return load(self, models, weights_path, *args, **kwargs)
            own = self.__dict__.get("_DIRECT_MAPPING")
            self._DIRECT_MAPPING = {**self._DIRECT_MAPPING, "output_layer.weight": "model.embed_tokens.weight"}
            try:
                return load(self, models, weights_path, *args, **kwargs)
            finally:
                if own is None:
                    del self._DIRECT_MAPPING
                else:
                    self._DIRECT_MAPPING = own

        return load_weights

    _wrap(module.Bridge, "load_weights", make)


def fix_tied_embeddings_with_pipeline() -> None:
    """Blocker 9's fix, registered in every process that imports verl (the plugin's ``__init__``),
    **not gated on the CPU platform**: tied models with PP > 1 fail to load on GPUs too. Only on the
    mbridge it was written for; another mbridge is left alone (logged at debug level)."""
    try:
        version = metadata.version("mbridge")
    except metadata.PackageNotFoundError:
        return
    if version != PATCHED_VERSIONS["mbridge"]:
        logger.debug("mbridge %s: the tied-embedding PP>1 fix is written for %s", version, PATCHED_VERSIONS["mbridge"])
        return
    after_import("mbridge.core.bridge", _patch_tied_output_layer)


# ---- wiring ------------------------------------------------------------------------------------


def _register_refusal(message: str) -> None:
    """On a megatron-core / mbridge this was not written for: the Megatron engine for device ``cpu``
    raises :class:`UnsupportedMegatronVersion` when built (FSDP engines unaffected)."""

    def register(module: Any) -> None:
        class MegatronEngineRefusedOnCPU(module.BaseEngine):
            def __init__(self, *args, **kwargs):
                raise UnsupportedMegatronVersion(message)

        _register_for_cpu(MegatronEngineRefusedOnCPU, MegatronEngineRefusedOnCPU)

    after_import("verl.workers.engine.base", register)


HOOKS = (
    ("megatron.core.tensor_parallel.random", _patch_rng_state),
    ("megatron.core.optimizer.distrib_optimizer", _patch_optimizer_types),
    ("megatron.core.optimizer.distrib_optimizer", _patch_empty_optimizer_state),
    ("megatron.core.optimizer.clip_grads", _patch_clip_grads),
    ("megatron.core.optimizer.optimizer", _patch_clip_grads),
    ("megatron.core.models.common.language_module.language_module", _patch_language_module_cuda),
    ("megatron.core.transformer.dot_product_attention", _patch_causal_attention_mask),
    ("megatron.core.transformer.torch_norm", _patch_norm_sequence_parallel),
    ("mbridge.core.util", _patch_mbridge_get_model),
    ("mbridge.core.bridge", _patch_mbridge_get_model),
    ("mbridge.core.bridge", _patch_local_norm_names),
    ("mbridge.core.llm_bridge", _patch_local_layer_spec),
    ("verl.workers.engine.megatron.transformer_impl", _register_megatron_engines_for_cpu),
    ("verl.utils.megatron_utils", _patch_snapshot_pinning),
)


def apply_megatron_patches(versions: Optional[Mapping[str, Optional[str]]] = None) -> bool:
    """Called when verl picks the CPU platform. Returns whether the patches are installed: False
    without megatron-core, and False (the Megatron engine refusing on ``cpu``) on other versions.
    ``versions`` defaults to :func:`installed_versions` (tests pass others)."""
    global _applied
    try:
        if not check_versions(installed_versions() if versions is None else versions):
            return False
    except UnsupportedMegatronVersion as exc:
        logger.warning("%s", exc)
        _register_refusal(str(exc))
        return False
    if not _applied:
        for package in ("megatron.core", "mbridge"):
            after_import_package(package, _use_torch_on_cpu)
        for module_name, hook in HOOKS:
            after_import(module_name, hook)
        _applied = True
    return True
