"""One unwrap rule for every caller: the step hook, the skip guard and the update signal all reach
the torch optimizer that really steps."""
import pytest
import torch

from gradloc_track.clip.skip_step import guard_for
from gradloc_track.integrations.handle import hookable_optimizer
from gradloc_track.monitor.adam_update import AdamUpdate
from gradloc_track.clip.handoff import NonfiniteFlag
from gradloc_track.optim_unwrap import unwrap_optimizer


class Wrapper:
    """A wrapper as frameworks write them: no torch hook tables, the real one at ``.optimizer``."""

    def __init__(self, inner):
        self.optimizer = inner


@pytest.fixture
def adam():
    return torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=1e-3)


def test_a_torch_optimizer_is_itself(adam):
    assert unwrap_optimizer(adam) is adam
    assert unwrap_optimizer(None) is None


def test_wrappers_are_unwrapped_to_the_optimizer_that_steps(adam):
    assert unwrap_optimizer(Wrapper(adam)) is adam
    assert unwrap_optimizer(Wrapper(Wrapper(adam))) is adam
    # the skip guard once knew Accelerate's wrapper by its type name only: another wrapper left the
    # step unguarded, and a NaN step went into the optimizer
    guard = guard_for(Wrapper(adam), NonfiniteFlag(torch.device("cpu")))
    assert guard is not None and guard.optimizer is adam


def test_something_else_is_left_as_it_is():
    cyc = Wrapper(None)
    cyc.optimizer = cyc
    assert unwrap_optimizer(cyc) is cyc
    assert unwrap_optimizer(object) is object
    with pytest.raises(TypeError, match="cannot hook Wrapper.step"):
        hookable_optimizer(cyc, hook=True)


def test_accelerates_wrapper_reaches_the_inner_optimizer_everywhere(adam):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer

    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerate.Accelerator(cpu=True)
        wrapped = AcceleratedOptimizer(adam, device_placement=False)
        assert unwrap_optimizer(wrapped) is adam
        assert hookable_optimizer(wrapped, hook=True) is adam
        guard = guard_for(wrapped, NonfiniteFlag(torch.device("cpu")))
        assert guard is not None and guard.optimizer is adam
        assert AdamUpdate(wrapped).optimizer is adam
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


class Raising:
    """A wrapper whose ``optimizer`` property raises (a lazily built or closed wrapper)."""

    @property
    def optimizer(self):
        raise RuntimeError("the engine is not initialised")


def test_a_wrapper_whose_optimizer_raises_is_an_error_naming_the_fix():
    with pytest.raises(TypeError, match=r"reading Raising.optimizer .* raised RuntimeError: the engine is not "
                                        r"initialised\. Pass the torch optimizer itself"):
        unwrap_optimizer(Raising())


def test_watch_names_the_wrapper_whose_optimizer_raises(tmp_path):
    import gradloc_track

    model = torch.nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"Raising.optimizer .* raised RuntimeError.*handle.step\(\)"):
        gradloc_track.watch(model, Raising(), tracker="none", run_dir=tmp_path / "run")
