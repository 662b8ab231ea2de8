"""The demo app's configs: the optimizer's AdamC peak is checked."""
from __future__ import annotations

import pytest


def test_optim_config_lr_max_is_validated():
    from gradloc_track.config import ConfigError
    from gradloc_track.demo.config import OptimConfig

    assert OptimConfig(adamc=True, adamc_lr_max=3e-4).adamc_lr_max == 3e-4
    for bad in (0.0, float("inf"), float("nan")):  # inf silently turned the decay off (wd * lr / inf = 0)
        with pytest.raises(ConfigError, match="optim.adamc_lr_max"):
            OptimConfig(adamc=True, adamc_lr_max=bad)


def test_the_demo_configs_small_mistakes_fail_at_start_naming_the_field_and_the_fix():
    """Each passed validation before and crashed later: a span longer than the row, cuda on a CPU-only
    torch, a BPE smaller than its alphabet, an empty junk text."""
    import torch

    from gradloc_track.config import ConfigError
    from gradloc_track.demo.config import DemoConfig, ModelConfig, SpikeInjectionConfig, TrainConfig
    from gradloc_track.demo.inject import max_span

    with pytest.raises(ConfigError, match=r"train.inject.span=200 is invalid: garbled_span fits at most 30 loss "
                                          r"tokens in a row of train.seq_len=32: use train.inject.span=30 or less"):
        TrainConfig(seq_len=32, inject=SpikeInjectionConfig(kind="garbled_span", span=200))
    for kind in ("garbled_span", "short_garbage_doc", "corrupt_span"):
        TrainConfig(seq_len=32, inject=SpikeInjectionConfig(kind=kind, span=max_span(kind, 32)))  # the longest fits
        with pytest.raises(ConfigError, match="train.inject.span"):
            TrainConfig(seq_len=32, inject=SpikeInjectionConfig(kind=kind, span=max_span(kind, 32) + 1))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"train.device='cuda' is invalid: .*: use train.device=cpu"):
            TrainConfig(device="cuda")
    with pytest.raises(ConfigError, match=r"train.device='gpu' is invalid: use a torch device"):
        TrainConfig(device="gpu")
    with pytest.raises(ConfigError, match=r"model.vocab_size=1 is invalid: train.tokenizer=bpe needs at least "
                                          r"\d+ tokens for this corpus .*: use model.vocab_size=1024"):
        DemoConfig(model=ModelConfig(vocab_size=1), train=TrainConfig(tokenizer="bpe"))
    with pytest.raises(ConfigError, match="model.vocab_size=128 is invalid: train.tokenizer=byte needs 256"):
        DemoConfig(model=ModelConfig(vocab_size=128))
    with pytest.raises(ConfigError, match=r"train.inject.text='' is invalid: use a non-empty string"):
        SpikeInjectionConfig(kind="garbled_span", text="")
    SpikeInjectionConfig(kind="short_garbage_doc", text="")  # the text is garbled_span's only
    with pytest.raises(ConfigError, match="train.num_threads=-1"):
        TrainConfig(num_threads=-1)


def test_the_bpe_floor_is_the_smallest_vocabulary_the_tokenizer_honours(tmp_path):
    """``min_vocab`` (what the config asks for) is exactly the size the BPE trainer cannot go below."""
    from gradloc_track.demo.tokenizer import BpeTokenizer, min_vocab

    text = "the cat sat on the mat\n\nâ€™ a dog"
    floor = min_vocab(text)
    assert BpeTokenizer.train_or_load(text, floor, tmp_path).vocab_size == floor
    assert BpeTokenizer.train_or_load(text, floor - 1, tmp_path).vocab_size == floor  # more than asked for


@pytest.mark.parametrize("content, says", [
    (b"caf\xe9 na\xefve " * 400, r"not UTF-8 text \(byte 0xe9 at offset 3\)"),
    (b"x" * 70_000 + b"\xff", r"not UTF-8 text \(byte 0xff at offset 70000\)"),
    (b"", "empty")])
def test_a_corpus_that_is_no_utf8_text_fails_naming_train_corpus(tmp_path, content, says):
    """A latin-1 corpus passed validation and crashed in the training set-up (a raw Hydra traceback)."""
    from gradloc_track.config import ConfigError
    from gradloc_track.demo.config import TrainConfig

    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"train.corpus='{path}' is invalid: .*{says}"):
        TrainConfig(corpus=str(path))
    path.write_bytes("café naïve ".encode() * 400)
    assert TrainConfig(corpus=str(path)).corpus == str(path)
