"""A CPU platform for verl 0.9, so its FSDP engine runs on CPU with gloo (tests, the example).

verl 0.9 resolves its device through ``verl.plugin.platform``: CUDA, NPU and ROCm are registered,
and a machine without an accelerator falls back to ``nvidia``, where ``init_device_mesh("cuda")``
fails. ``use_cpu_platform()`` registers ``cpu`` and makes it current: device ``"cpu"``,
collectives on gloo, no-op memory statistics. verl's own model code is unchanged; on CPU use
``attn_implementation="eager"`` (or ``sdpa``) and ``use_remove_padding=False`` (flash-attention's
packed sequences do not exist there) and ``use_torch_compile=False``.
"""
from __future__ import annotations

import contextlib
import types

import torch


def _device_module() -> types.SimpleNamespace:
    """What verl calls on ``get_torch_device()``: CPU answers (memory statistics read 0)."""
    zero = lambda *a, **k: 0  # noqa: E731
    return types.SimpleNamespace(
        is_available=lambda: True, current_device=lambda: "cpu", device_count=lambda: 1,
        set_device=lambda *a: None, synchronize=lambda *a: None, manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed, empty_cache=lambda: None, max_memory_allocated=zero,
        max_memory_reserved=zero, memory_allocated=zero, memory_reserved=zero, mem_get_info=lambda *a: (0, 0),
        reset_peak_memory_stats=lambda *a: None)


@contextlib.contextmanager
def _no_range(self, msg):
    yield


def _platform_class() -> type:
    """``PlatformBase`` with CPU answers (built here: verl is imported only when it is used)."""
    from verl.plugin.platform.platform_base import PlatformBase

    const = {"is_available": True, "current_device": "cpu", "device_count": 1, "communication_backend_name": "gloo",
             "visible_devices_envvar": "CUDA_VISIBLE_DEVICES", "ray_resource_name": "CPU", "ray_noset_envvars": [],
             "is_ipc_supported": False, "cudart": None, "get_device_capability": (None, None)}
    noop = ("set_device", "synchronize", "set_allocator_settings", "empty_cache", "profiler_start", "profiler_stop")
    body: dict = {k: (lambda v: lambda self, *a, **kw: v)(v) for k, v in const.items()}
    body.update({k: lambda self, *a, **kw: None for k in noop})
    module = _device_module()
    body.update(device_name=property(lambda self: "cpu"), vendor_name=property(lambda self: "cpu"),
                device_module=property(lambda self: module), nvtx_range=_no_range,
                manual_seed=lambda self, seed: torch.manual_seed(seed),
                manual_seed_all=lambda self, seed: torch.manual_seed(seed))
    return type("PlatformCPU", (PlatformBase,), body)


def use_cpu_platform() -> None:
    """Register verl's ``cpu`` platform and make it the current one (before building an engine)."""
    from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

    cls = PlatformRegistry.get("cpu") or PlatformRegistry.register(platform="cpu")(_platform_class())
    set_platform(cls())
