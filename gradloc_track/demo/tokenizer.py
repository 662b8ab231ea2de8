"""A small BPE for the demos, trained once on the offline corpus and cached.

Subword tokens make the spike artifacts read like text (" function", " returns") instead of
bytes. Characters, not bytes, are the base alphabet (SentencePiece-style ``▁`` for spaces), so
every token decodes to readable text on its own — mojibake such as ``â€™`` stays visible as the
characters a reader recognises; characters never seen in the corpus map to ``<unk>``. Training
2k merges on the ~1 MB corpus takes a couple of seconds with Hugging Face ``tokenizers``; the
result is cached as ``bpe-<vocab>-<corpus hash>.json`` in the cache dir.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

PAD, UNK = "<pad>", "<unk>"
SPACE = "\u2581"  # ▁
# characters every tokenizer knows, seen in the corpus or not: the demo's mojibake among them
EXTRA_ALPHABET = list("âÃ€™œ¢‚¬„©")


def min_vocab(text: str) -> int:
    """The fewest tokens a BPE of ``text`` has: its characters (spaces as ``▁``, the extra alphabet
    included) and the two specials; ``model.vocab_size`` below it cannot be honoured."""
    trained_on = "".join(text.split("\n\n")).replace(" ", SPACE)  # paragraphs, as train_or_load feeds them
    return len(set(trained_on) | set(EXTRA_ALPHABET)) + 2


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/gradloc-track`` (``~/.cache/gradloc-track``)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gradloc-track"


class BpeTokenizer:
    """``encode``/``decode``/``convert_ids_to_tokens`` over a ``tokenizers.Tokenizer``.

    ``decode`` of one id (what the artifacts show a reader, ``text.decode_token``) gives the token's
    *text* (" returns"), not its symbol ("▁returns"); ``convert_ids_to_tokens`` gives the same per id.
    """

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.pad_id = tokenizer.token_to_id(PAD)

    @classmethod
    def train_or_load(cls, text: str, vocab_size: int, cache_dir: str | Path | None = None) -> "BpeTokenizer":
        from .._optional import require

        require("tokenizers", "demo")
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        cache = Path(cache_dir) if cache_dir else default_cache_dir()
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
        path = cache / f"bpe-{vocab_size}-{digest}.json"
        if path.exists():
            return cls(Tokenizer.from_file(str(path)))
        tok = Tokenizer(models.BPE(unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.Sequence([  # newlines are tokens of their own
            pre_tokenizers.Split("\n", behavior="isolated"),
            pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never")])
        tok.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="never")
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, UNK], show_progress=False,
                                      initial_alphabet=EXTRA_ALPHABET)
        tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tok.save(str(tmp))
        os.replace(tmp, path)  # atomic: concurrent multirun jobs never read half a file
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        if isinstance(ids, int):
            ids = [ids]
        ids = [int(i) for i in ids]
        if len(ids) == 1:  # one token keeps its leading space (the decoder would strip it)
            return self.token_text(ids[0])
        return self._tok.decode(ids, skip_special_tokens=False)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self.decode([int(i)]) for i in ids]

    def token_text(self, token_id: int) -> str:
        """One token as it reads in the text (``▁returns`` -> `` returns``)."""
        return (self._tok.id_to_token(int(token_id)) or "").replace(SPACE, " ")

    def to_transformers(self):
        """The same vocabulary as a ``transformers`` fast tokenizer (what TRL's trainers take as
        ``processing_class``); ``<pad>`` doubles as end-of-sequence."""
        from .._optional import require

        require("transformers", "hf")
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=self._tok, pad_token=PAD, unk_token=UNK, eos_token=PAD)


def make_tokenizer(kind: str, vocab_size: int, corpus: str, cache_dir: str | Path | None = None):
    """``train.tokenizer``: the byte tokenizer, or a BPE of ``model.vocab_size`` tokens trained on
    (and cached for) the corpus."""
    if kind == "byte":
        from .data import ByteTokenizer

        if vocab_size < 256:
            raise ValueError(f"model.vocab_size={vocab_size} is too small for train.tokenizer=byte: use 256 or more")
        return ByteTokenizer()
    tok = BpeTokenizer.train_or_load(corpus, vocab_size, cache_dir)
    if tok.vocab_size > vocab_size:  # pragma: no cover - the config asks for min_vocab(corpus) or more
        raise ValueError(f"model.vocab_size={vocab_size} < the BPE's {tok.vocab_size} tokens")
    return tok
