"""A CPU platform for verl 0.9, so its FSDP engine runs on CPU with gloo (tests, the example).

verl 0.9 resolves its device through ``verl.plugin.platform``: CUDA, NPU and ROCm are registered,
and a machine without an accelerator falls back to ``nvidia``, where ``init_device_mesh("cuda")``
fails. ``use_cpu_platform()`` registers ``cpu`` and makes it current: device ``"cpu"``,
collectives on gloo, no-op memory statistics. verl's own model code is unchanged; on CPU use
``attn_implementation="eager"`` (or ``sdpa``) and ``use_torch_compile=False``. Packed micro-batches
(``use_remove_padding=True``) run too: without flash-attention's varlen kernel, transformers (5.x)
keeps the samples of the packed row apart by their restarting position ids (checked against the
padded call in the tests).
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
        reset_peak_memory_stats=lambda *a: None, get_device_name=lambda *a: "cpu")


@contextlib.contextmanager
def _no_range(self, msg):
    yield


def _platform_class() -> type:
    """``PlatformBase`` with CPU answers (built here: verl is imported only when it is used)."""
    from verl.plugin.platform.platform_base import PlatformBase

    const = {"is_available": True, "current_device": "cpu", "device_count": 1, "communication_backend_name": "gloo",
             "visible_devices_envvar": "CUDA_VISIBLE_DEVICES", "ray_resource_name": "GPU", "ray_noset_envvars": [],
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


def _gloo_groups() -> None:
    """verl's Ray workers start their process group with ``cpu:gloo,<device>:<backend>``, which
    torch refuses when the device is ``cpu`` too: there the group is plain gloo."""
    from verl.utils import distributed

    for name in ("initialize_global_process_group_ray",):
        original = getattr(distributed, name)
        if getattr(original, "__gradloc_cpu__", False):
            continue

        def on_cpu(timeout_second=None, backend=None, _original=original):
            return _original(timeout_second=timeout_second, backend=backend or "gloo")

        on_cpu.__gradloc_cpu__ = True
        setattr(distributed, name, on_cpu)


def use_cpu_platform() -> None:
    """Register verl's ``cpu`` platform and make it the current one (before building an engine).

    Also the ``worker_process_setup_hook`` of verl's Ray runtime env for ``main_ppo`` on CPU
    (``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=gradloc_track.integrations.verl.cpu.use_cpu_platform``,
    with GPUs declared to Ray: ``+ray_kwargs.ray_init.num_gpus=N``, each one worker slot): every
    Ray worker then runs on this platform, its process group on gloo."""
    from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

    cls = PlatformRegistry.get("cpu") or PlatformRegistry.register(platform="cpu")(_platform_class())
    set_platform(cls())
    _gloo_groups()
