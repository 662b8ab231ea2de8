"""``integrations/verl/cpu.py``: verl resolves its device to the CPU platform (gloo)."""
from __future__ import annotations


def test_verl_sees_the_cpu_platform():
    from verl.plugin.platform import platform_manager
    from verl.utils.device import get_device_name, get_torch_device

    from gradloc_track.integrations.verl import use_cpu_platform

    before = platform_manager._current_platform
    try:
        use_cpu_platform()
        use_cpu_platform()  # idempotent
        assert get_device_name() == "cpu"
        assert platform_manager.get_platform().communication_backend_name() == "gloo"
        assert get_torch_device().max_memory_allocated() == 0
    finally:
        platform_manager._current_platform = before
