"""The demo app's configs: model, optimizer, training loop, data (groups ``model``, ``optim``; ``train``, ``data``).

``DemoConfig`` is the root ``conf/config.yaml`` composes from (stored as ``demo_schema``): the
library's ``RootConfig`` (tracker, monitor, clip, spikes, locate) plus these. They belong to the
example app, not to the library: a user's own training script has its own.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

from ..config import RootConfig
from ..config._validate import check, check_types, one_of
from .inject import max_span


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
        check_types(self, "model")
        one_of("model.kind", self.kind, ("tiny_gpt", "hf_gpt2"))
        check(self.vocab_size >= 1, "model.vocab_size", self.vocab_size, "use 1 or more")
        check(self.n_layer >= 1, "model.n_layer", self.n_layer, "use 1 or more")
        check(self.n_head >= 1, "model.n_head", self.n_head, "use 1 or more attention heads")
        check(self.d_model >= 1, "model.d_model", self.d_model, "use 1 or more")
        check(self.d_model % self.n_head == 0, "model.d_model", self.d_model,
              f"must be divisible by model.n_head={self.n_head}")
        check(self.max_seq_len >= 1, "model.max_seq_len", self.max_seq_len, "use 1 or more")
        check(0.0 <= self.dropout < 1.0, "model.dropout", self.dropout, "use a probability in [0, 1)")


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    adamc: bool = False  # AdamC corrected weight decay: wd_t = wd * lr_t / lr_max
    # the schedule's PEAK lr for AdamC; null = read from the scheduler (here: optim.lr, the peak)
    adamc_lr_max: Optional[float] = None

    def __post_init__(self) -> None:
        check_types(self, "optim")
        check(0 < self.lr < float("inf"), "optim.lr", self.lr, "use a positive, finite learning rate")
        check(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio", self.min_lr_ratio,
              "use a fraction of optim.lr in [0, 1]")
        check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "use 0 or more")
        check(0 <= self.weight_decay < float("inf"), "optim.weight_decay", self.weight_decay, "use 0 or more")
        for i, b in enumerate(self.betas):
            check(0.0 <= b < 1.0, f"optim.betas[{i}]", b, "use a value in [0, 1), e.g. betas=[0.9,0.95]")
        if self.adamc_lr_max is not None:
            check(0 < self.adamc_lr_max < float("inf"), "optim.adamc_lr_max", self.adamc_lr_max,
                  "use the schedule's positive, finite peak learning rate (inf would turn the decay off), or null "
                  "to read it from the scheduler")


@dataclass
class SpikeInjectionConfig:
    """A data outlier injected into one batch at a known step (the spike demo).

    The sample and the garbage bytes vary with the step (seeded), so repeated injections differ.
    """

    step: Optional[int] = None  # None = no injection
    every: Optional[int] = None  # repeat every N steps after ``step`` (None = once)
    sample: int = 0  # which sequence of the batch is corrupted
    rank: int = 0  # under torchrun: which rank's batch is corrupted
    kind: str = "short_garbage_doc"  # garbled_span | short_garbage_doc | corrupt_span
    span: int = 4  # how many loss tokens carry the corruption
    text: str = "â€™"  # the junk repeated by ``garbled_span`` (mojibake of a curly apostrophe)
    scale: float = 1.0

    def __post_init__(self) -> None:
        check_types(self, "train.inject")
        if self.step is not None:
            check(self.step >= 0, "train.inject.step", self.step, "use a step >= 0 or null")
        if self.every is not None:
            check(self.every >= 1, "train.inject.every", self.every, "use a positive number of steps or null")
        check(self.rank >= 0, "train.inject.rank", self.rank, "use a rank >= 0 (0 = the first process)")
        check(self.kind in ("garbled_span", "short_garbage_doc", "corrupt_span"), "train.inject.kind",
              self.kind, "use garbled_span, short_garbage_doc or corrupt_span")
        check(self.sample >= 0, "train.inject.sample", self.sample, "use a sample index >= 0 (< train.batch_size)")
        check(self.span >= 1, "train.inject.span", self.span, "use 1 or more loss tokens")
        if self.kind == "garbled_span":
            check(len(self.text) > 0, "train.inject.text", self.text,
                  "use a non-empty string, e.g. train.inject.text='â€™' (the junk the garbled answer repeats)")
        check(0 < self.scale < float("inf"), "train.inject.scale", self.scale, "use a positive, finite number")

    def at(self, step: int) -> bool:
        """Whether the batch of ``step`` is corrupted."""
        if self.step is None or step < self.step:
            return False
        return step == self.step or (self.every is not None and (step - self.step) % self.every == 0)


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    seed: int = 0
    device: str = "cpu"
    loss_norm: str = "token"  # token (mean over all loss tokens) | sample (mean of per-sample means)
    corpus: Optional[str] = None  # path to a UTF-8 text file; None = built-in offline corpus
    # torch.set_num_threads; None = half the cores, at most 4 (a small model gains nothing from more, and a busy
    # machine loses: the demo took 383 s on 2 busy cores with torch's default, ~150 s with 1); 0 = torch's default
    num_threads: Optional[int] = None
    tokenizer: str = "byte"  # byte (vocab 256) | bpe (trained on the corpus, vocab = model.vocab_size)
    cache_dir: Optional[str] = None  # where the trained BPE is kept; None = ~/.cache/gradloc-track
    inject: SpikeInjectionConfig = field(default_factory=SpikeInjectionConfig)

    def __post_init__(self) -> None:
        check_types(self, "train")
        check(self.steps >= 1, "train.steps", self.steps, "use 1 or more")
        check(self.batch_size >= 1, "train.batch_size", self.batch_size, "use 1 or more")
        check(self.seq_len >= 2, "train.seq_len", self.seq_len, "use 2 or more")
        one_of("train.loss_norm", self.loss_norm, ("token", "sample"))
        check(self.inject.sample < self.batch_size, "train.inject.sample", self.inject.sample,
              f"use a sample index below train.batch_size={self.batch_size}")
        longest = max_span(self.inject.kind, self.seq_len)
        check(self.inject.span <= longest, "train.inject.span", self.inject.span,
              f"{self.inject.kind} fits at most {longest} loss tokens in a row of train.seq_len={self.seq_len}: "
              f"use train.inject.span={longest} or less, or raise train.seq_len")
        if self.num_threads is not None:
            check(self.num_threads >= 0, "train.num_threads", self.num_threads,
                  "use 1 or more, 0 for torch's own default (every core), or null for the demo's (half the cores, "
                  "at most 4)")
        check_device(self.device)
        if self.corpus is not None:
            from pathlib import Path

            check(Path(self.corpus).is_file(), "train.corpus", self.corpus,
                  "use the path of an existing UTF-8 text file, or null for the built-in corpus")
            why = not_utf8_text(self.corpus)
            check(why is None, "train.corpus", self.corpus, f"{why}; convert it (e.g. iconv -f latin1 -t utf-8 "
                  "FILE > FILE.utf8) and pass that, or null for the built-in corpus")
        one_of("train.tokenizer", self.tokenizer, ("byte", "bpe"))


@dataclass
class DataConfig:
    """What the demo leaves out of its data."""

    # a blocklist file from ``gradloc-track culprits ... --export-blocklist FILE``: its samples
    # (matched by fingerprint) are left out of every batch and replaced by fresh windows
    blocklist: Optional[str] = None

    def __post_init__(self) -> None:
        check_types(self, "data")
        if self.blocklist is not None:
            from pathlib import Path

            from ..data import BlocklistError, load_blocklist

            check(Path(self.blocklist).is_file(), "data.blocklist", self.blocklist,
                  "use the path of a file written by 'gradloc-track culprits ... --export-blocklist FILE', or null")
            try:
                load_blocklist(self.blocklist, "data.blocklist")
            except BlocklistError as exc:
                check(False, "data.blocklist", self.blocklist, str(exc).split(": ", 1)[-1])


@dataclass
class DemoConfig(RootConfig):
    """The demo app's root: the library's groups plus ``model``, ``optim``, ``train`` and ``data``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.train.seq_len <= self.model.max_seq_len, "train.seq_len", self.train.seq_len,
              f"use at most model.max_seq_len={self.model.max_seq_len}, or raise model.max_seq_len")
        if self.train.tokenizer == "byte":
            check(self.model.vocab_size >= 256, "model.vocab_size", self.model.vocab_size,
                  "train.tokenizer=byte needs 256 (one token per byte): use model.vocab_size=256 or more")
        else:
            least = bpe_min_vocab(self.train.corpus)
            check(self.model.vocab_size >= least, "model.vocab_size", self.model.vocab_size,
                  f"train.tokenizer=bpe needs at least {least} tokens for this corpus (its characters and the "
                  f"<pad>/<unk> specials) before any merge: use model.vocab_size={max(least, 1024)}, or more")


def not_utf8_text(path: str) -> str | None:
    """Why the corpus at ``path`` cannot be read as text (None: it can). Checked at start: the set-up
    reads it as UTF-8 and a latin-1 file stopped the run there, a traceback naming no field."""
    from pathlib import Path

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return f"cannot read it ({exc.strerror or exc})"
    if not data:
        return "the file is empty"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"it is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
    return None


def check_device(device: str) -> None:
    """``train.device``: a device torch knows, and one this torch build can use (a CPU build has no cuda)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        check(False, "train.device", device, f"use a torch device such as cpu or cuda:0 ({exc})")
    if dev.type == "cuda":
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
        check(torch.cuda.is_available(), "train.device", device, f"{why}: use train.device=cpu")
        check(dev.index is None or dev.index < torch.cuda.device_count(), "train.device", device,
              f"this machine has {torch.cuda.device_count()} CUDA device(s): use cuda:0 .. cuda:"
              f"{torch.cuda.device_count() - 1}")
    elif dev.type == "mps":
        check(torch.backends.mps.is_available(), "train.device", device, "MPS is not available here: use cpu")


@functools.lru_cache(maxsize=8)
def bpe_min_vocab(corpus: str | None) -> int:
    """The smallest BPE for ``corpus`` (path, None = built-in): its alphabet plus two specials."""
    from .data import load_corpus
    from .tokenizer import min_vocab

    return min_vocab(load_corpus(corpus))


def register_configs() -> None:
    """Register the library's schemas, the demo's root (``demo_schema``) and its sweep folder names' resolver
    with Hydra (idempotent)."""
    from hydra.core.config_store import ConfigStore

    from ..config import register_configs as register_library_configs

    from .out_dir import register_job_dir_resolver

    register_library_configs()
    register_job_dir_resolver()  # the sweep jobs' folder names (conf/config.yaml)
    ConfigStore.instance().store(name="demo_schema", node=DemoConfig)
