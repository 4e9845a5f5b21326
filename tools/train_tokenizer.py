#!/usr/bin/env python
"""Train a SentencePiece tokenizer on jsonl or plain-text files.

    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix tok --vocab-size 32000

writes ``tok.model`` and ``tok.vocab``. The end-of-document token is SentencePiece's ``eos``
(id 2); ``unk=0, bos=1, pad=3``. See docs/data.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autosp_lm.config.cli import HelpFormatter  # noqa: E402
from autosp_lm.data.sources import DOCUMENT_PER, SourceStats, iter_documents  # noqa: E402
from autosp_lm.data.tokenizer import Tokenizer, train_sentencepiece, training_sentences  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="jsonl (.jsonl/.json[.gz]) or text files")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, required=True,
                   help="number of pieces, special tokens included (e.g. 32000)")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe",
                   help="SentencePiece algorithm")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl keys whose text is used")
    p.add_argument("--document-per", choices=DOCUMENT_PER, default="file",
                   help="what one document is in a plain-text input")
    p.add_argument("--byte-fallback", action="store_true",
                   help="spell unknown characters as bytes (needs vocab > 260)")
    p.add_argument("--character-coverage", type=float, default=1.0,
                   help="fraction of the characters seen that get their own piece (1.0 keeps all; "
                        "the rest become unknown or, with --byte-fallback, bytes)")
    p.add_argument("--normalization", default="identity",
                   help="SentencePiece normalization rule (identity keeps text exactly; nmt_nfkc "
                        "is what SentencePiece itself would pick)")
    p.add_argument("--max-sentences", type=int, default=2_000_000,
                   help="train on a deterministic sample of at most this many lines")
    p.add_argument("--num-threads", type=int, default=None,
                   help="SentencePiece training threads (default: the usable cores, at most 16)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip (and count) malformed jsonl lines instead of stopping")
    p.add_argument("--verbose", action="store_true", help="show SentencePiece's own log")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    stats = SourceStats()
    docs = iter_documents(args.input, args.json_keys, document_per=args.document_per,
                          skip_bad_lines=args.skip_bad_lines, stats=stats)
    texts = (d[k] for d in docs for k in args.json_keys)
    try:
        model = train_sentencepiece(
            training_sentences(texts), args.output_prefix, args.vocab_size,
            model_type=args.model_type, byte_fallback=args.byte_fallback,
            character_coverage=args.character_coverage, normalization=args.normalization,
            max_sentences=args.max_sentences, num_threads=args.num_threads, verbose=args.verbose)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tok = Tokenizer(model)
    if stats.bad_lines:
        print(f"skipped {stats.bad_lines} malformed lines (first: {stats.bad_examples[0]})",
              file=sys.stderr)
    print(f"wrote {model} and {args.output_prefix}.vocab: vocab {tok.vocab_size}, "
          f"eod id {tok.eod_id}, {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
