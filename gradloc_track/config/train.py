"""Model, optimizer and training-loop configs for the example apps (groups ``model``, ``optim``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ._validate import check, one_of


@dataclass
class ModelConfig:
    kind: str = "tiny_gpt"  # tiny_gpt (hand-written) | hf_gpt2 (transformers, random init)
    vocab_size: int = 256  # byte-level tokenizer
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    max_seq_len: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        one_of("model.kind", self.kind, ("tiny_gpt", "hf_gpt2"))
        check(self.d_model % self.n_head == 0, "model.d_model", self.d_model,
              f"must be divisible by model.n_head={self.n_head}")
        check(self.n_layer >= 1, "model.n_layer", self.n_layer, "use 1 or more")


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    adamc: bool = False  # AdamC corrected weight decay: wd_t = wd * lr_t / lr_max

    def __post_init__(self) -> None:
        check(self.lr > 0, "optim.lr", self.lr, "use a positive learning rate")
        check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "use 0 or more")


@dataclass
class SpikeInjectionConfig:
    """A data outlier injected into one batch at a known step (the spike demo).

    The sample and the garbage bytes vary with the step (seeded), so repeated injections differ.
    """

    def at(self, step: int) -> bool:
        if self.step is None or step < self.step:
            return False
        return step == self.step or (self.every is not None and (step - self.step) % self.every == 0)


    step: Optional[int] = None  # None = no injection
    every: Optional[int] = None  # repeat every N steps after ``step`` (None = once)
    sample: int = 0  # which sequence of the batch is corrupted
    kind: str = "short_garbage_doc"  # garbled_span | short_garbage_doc | corrupt_span
    span: int = 4  # how many loss tokens carry the corruption
    text: str = "â€™"  # the junk repeated by ``garbled_span`` (mojibake of a curly apostrophe)
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.step is not None:
            check(self.step >= 0, "train.inject.step", self.step, "use a step >= 0 or null")
        if self.every is not None:
            check(self.every >= 1, "train.inject.every", self.every, "use a positive number of steps or null")
        check(self.kind in ("garbled_span", "short_garbage_doc", "corrupt_span"), "train.inject.kind",
              self.kind, "use garbled_span, short_garbage_doc or corrupt_span")


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    seed: int = 0
    device: str = "cpu"
    loss_norm: str = "token"  # token (mean over all loss tokens) | sample (mean of per-sample means)
    corpus: Optional[str] = None  # path to a UTF-8 text file; None = built-in offline corpus
    num_threads: Optional[int] = None  # torch.set_num_threads; None = leave torch's default
    tokenizer: str = "byte"  # byte (vocab 256) | bpe (trained on the corpus, vocab = model.vocab_size)
    cache_dir: Optional[str] = None  # where the trained BPE is kept; None = ~/.cache/gradloc-track
    inject: SpikeInjectionConfig = field(default_factory=SpikeInjectionConfig)

    def __post_init__(self) -> None:
        check(self.steps >= 1, "train.steps", self.steps, "use 1 or more")
        check(self.batch_size >= 1, "train.batch_size", self.batch_size, "use 1 or more")
        check(self.seq_len >= 2, "train.seq_len", self.seq_len, "use 2 or more")
        one_of("train.loss_norm", self.loss_norm, ("token", "sample"))
        one_of("train.tokenizer", self.tokenizer, ("byte", "bpe"))
