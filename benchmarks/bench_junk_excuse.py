"""The junk excuse's tokenizer witness (``spikes/text_check.py``, issue 37): what it excuses and what it lets by.

A Latin window the junk rule would fire on is excused when the tokenizer wrote it (decoded and encoded
again, its ids come back) and its words are words (no word switches class more than ``SWITCHES`` times).
This prints, per tokenizer (the held-out zoo's 2k byte-level BPEs and the demo's 512-token character BPE):

- whether it witnesses at all (``tells_random_ids``: random stretches come back changed),
- the share of its own clean 16-token windows that round-trip (should be all),
- the share of 16 random ids set inside clean text that would be excused (the witness's miss rate on a
  short garbled span), of whole rows of random ids, and of base64 blobs,
- the most word switches in any 16-token window of the dev half's pydoc text: ``SWITCHES`` is that number.

    python benchmarks/bench_junk_excuse.py [--draws 300]
"""
from __future__ import annotations

import argparse
import base64
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo.sources import ByteBpe, text  # noqa: E402

from gradloc_track.spikes.text_check import (SWITCHES, clean_text, read_window, tells_random_ids,  # noqa: E402
                                             word_switches)


def _rate(hits: int, n: int) -> str:
    return f"{hits}/{n} ({100 * hits / max(n, 1):.0f}%)"


def measure(name: str, tok, ids: list[int], low: int, draws: int) -> None:
    g = torch.Generator().manual_seed(0)
    V = tok.vocab_size
    tells = tells_random_ids(tok)
    clean = inside = whole = b64 = 0
    for _ in range(draws):
        i = int(torch.randint(0, len(ids) - 80, (1,), generator=g))
        row = list(ids[i:i + 80])
        clean += read_window(row, 32, 48, tok).tokenized
        row[32:48] = torch.randint(low, V, (16,), generator=g).tolist()
        inside += clean_text(read_window(row, 32, 48, tok)) is not None
        rand = torch.randint(low, V, (80,), generator=g).tolist()
        whole += clean_text(read_window(rand, 32, 48, tok)) is not None
        raw = bytes(torch.randint(0, 256, (120,), generator=g).tolist())
        blob = row[:32] + list(tok.encode(base64.b64encode(raw).decode("ascii")))[:16] + row[48:]
        b64 += clean_text(read_window(blob, 32, 48, tok)) is not None
    print(f"| {name} | {V} | {'yes' if tells else 'no'} | {_rate(clean, draws)} | {_rate(inside, draws)} | "
          f"{_rate(whole, draws)} | {_rate(b64, draws)} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=300)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pydoc = ByteBpe.train_or_load("pydoc").to_transformers()
    pids = pydoc.encode(text("pydoc"), add_special_tokens=False)
    most = max(word_switches(pydoc.decode(pids[i:i + 16])) for i in range(0, len(pids) - 16, 3))
    print(f"dev half (pydoc, 2k byte-level BPE): the most word switches in a 16-token window: {most} "
          f"(SWITCHES = {SWITCHES})\n")
    print("| tokenizer | vocab | witnesses | its clean windows round-trip | 16 random ids inside clean text "
          "excused | a row of random ids excused | 16 base64 tokens inside clean text excused |")
    print("|---|---|---|---|---|---|---|")
    measure("zoo pydoc (dev)", pydoc, pids, 3, args.draws)
    for src in ("licences", "python"):
        tok = ByteBpe.train_or_load(src).to_transformers()
        measure(f"zoo {src} (held out)", tok, tok.encode(text(src), add_special_tokens=False), 3, args.draws)
    from gradloc_track.demo.data import load_corpus
    from gradloc_track.demo.tokenizer import BpeTokenizer

    demo = BpeTokenizer.train_or_load(load_corpus(), 512)
    measure("demo character BPE", demo, demo.encode(load_corpus()[:400_000]), 2, args.draws)


if __name__ == "__main__":
    main()
