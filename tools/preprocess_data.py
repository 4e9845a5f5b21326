#!/usr/bin/env python
"""Tokenize jsonl or plain-text files into Megatron-LM indexed datasets (.bin/.idx).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-model tok.model --append-eod --workers 8
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model Llama-3.2-1B --append-eod

writes ``data/corpus_text_document.bin`` and ``.idx`` (one pair per ``--json-keys`` key), byte
compatible with Megatron-LM; train with ``--data-path data/corpus_text_document``.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autosp_lm.config.cli import HelpFormatter  # noqa: E402
from autosp_lm.data.preprocess import default_workers, preprocess_files  # noqa: E402
from autosp_lm.data.sources import DOCUMENT_PER, BadLineError  # noqa: E402
from autosp_lm.data.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="jsonl (.jsonl/.json[.gz]) or text files")
    p.add_argument("--output-prefix", required=True,
                   help="writes PREFIX_{key}_document.bin/.idx for each json key")
    p.add_argument("--tokenizer-model", required=True,
                   help="SentencePiece .model file, or a Hugging Face tokenizer.json / directory")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES,
                   help="Megatron's tokenizer type (default: HuggingFaceTokenizer for a .json file or "
                        "a directory, else SentencePieceTokenizer); the end-of-document id of "
                        "--append-eod is the tokenizer's eos")
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="jsonl keys to tokenize, one output dataset per key")
    p.add_argument("--append-eod", action="store_true",
                   help="end every document with the end-of-document (eos) token")
    p.add_argument("--workers", type=int, default=min(4, default_workers()),
                   help="tokenizer worker processes")
    p.add_argument("--document-per", choices=DOCUMENT_PER, default="file",
                   help="what one document is in a plain-text input")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip (and count) malformed jsonl lines instead of stopping")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
        stats = preprocess_files(args.input, args.output_prefix, tokenizer,
                                 json_keys=args.json_keys, append_eod=args.append_eod,
                                 workers=args.workers, skip_bad_lines=args.skip_bad_lines,
                                 document_per=args.document_per, progress=not args.no_progress)
    except BadLineError as e:
        print(f"error: {e}\n(use --skip-bad-lines to skip and count malformed lines)",
              file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(stats.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
