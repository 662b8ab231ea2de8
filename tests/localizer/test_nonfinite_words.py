"""``localizer/nonfinite_words``: the non-finite findings' sentences, with their numbers."""
from __future__ import annotations

import math

from gradloc_track.localizer import nonfinite_words as words
from gradloc_track.localizer.nonfinite import NonfiniteSample


def test_values_and_labels():
    assert [words.value(v) for v in (math.inf, -math.inf, math.nan, 0.22102, None)] == [
        "Inf", "-Inf", "NaN", "0.221", "unknown"]
    assert words.label(3) == "sample 3"
    assert words.label(0, micro_batch=1, document=2) == "document 2 (micro-batch 1, sample 0)"
    assert words.names(["a", "b", "c", "d"]) == "a, b, c, ..." and words.names(["a"]) == "a"


def test_a_sample_says_its_loss_first_when_that_is_what_broke():
    lossy = NonfiniteSample(3, loss=math.inf, grad="NaN", terms=(17,))
    assert words.sample_sentence(lossy) == "sample 3's loss is Inf (token 17): its gradient is NaN"
    grad_only = NonfiniteSample(4, micro_batch=1, loss=0.5, grad="Inf", terms=tuple(range(7)))
    assert words.sample_sentence(grad_only) == \
        "micro-batch 1, sample 4's gradient is Inf (tokens 0, 1, 2, 3, 4, +2); its loss is 0.5"
    assert "gradient is not probed (budget)" in words.sample_sentence(NonfiniteSample(1, grad="?"))


def test_a_distributed_sample_names_its_rank_first():
    u = NonfiniteSample(0, micro_batch=2, loss=math.nan, grad="NaN", terms=(3,), rank=1)
    assert words.sample_sentence(u) == "rank 1, micro-batch 2, sample 0's loss is NaN (token 3): its gradient is NaN"
    assert words.forward_loss(3, None, math.nan) == \
        "rank 3: its own forward's loss is NaN, so the non-finite value enters there"


def test_a_sum_overflow_gives_the_dtype_max_and_the_largest_sample():
    alone = words.largest_alone(4, "sample 0", 1.24e5, 1.96e4)
    text = words.sum_overflow(8, "float16", 65504.0, "head.weight", [4], alone)
    assert text.startswith("the sum overflows, not one sample: 8 samples' gradients add up past float16's max 65504")
    assert "sets of 4 samples" in text and "the largest of 4 probed alone: sample 0, norm 1.24e+05, largest " \
        "element 1.96e+04" in text
    assert "(norms 1, 2)" in words.micro_batch_sum([1.0, 2.0], "bfloat16", 3.39e38, "w")
