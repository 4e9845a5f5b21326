"""SentencePiece tokenizer: training and a small wrapper used by preprocessing and training.

Models trained here use ids ``unk=0, bos=1, eos=2, pad=3``; the end-of-document token (``eod``)
is SentencePiece's ``eos``. By default training uses the *identity* normalization and keeps
whitespace as is, and ``"\\n"`` is a user-defined symbol, so ``decode(encode(text)) == text``
for any text whose characters are covered (always, with ``byte_fallback``): source code keeps its
indentation and line breaks.
"""
from __future__ import annotations

import os
import random
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np

MAX_SENTENCE_CHARS = 4096


class Tokenizer:
    """A SentencePiece model: ``encode``/``decode``, ``vocab_size``, ``eod_id``, ``pad_id``.

    Picklable (the serialized model travels with it), so worker processes can use it.
    """

    def __init__(self, model_path: Union[str, os.PathLike]):
        import sentencepiece as spm

        self.model_path = os.fspath(model_path)
        if not os.path.isfile(self.model_path):
            raise FileNotFoundError(f"tokenizer model not found: {self.model_path}")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.model_path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{self.model_path}: not a SentencePiece model ({e})") from None

    # -- pickling ----------------------------------------------------------------------------
    def __getstate__(self):
        return {"model_path": self.model_path, "proto": self._sp.serialized_model_proto()}

    def __setstate__(self, state):
        import sentencepiece as spm

        self.model_path = state["model_path"]
        self._sp = spm.SentencePieceProcessor()
        self._sp.LoadFromSerializedProto(state["proto"])

    # -- vocabulary ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self._sp.GetPieceSize())

    @staticmethod
    def _opt(i: int) -> Optional[int]:
        return int(i) if i >= 0 else None

    @property
    def eod_id(self) -> Optional[int]:
        """End-of-document id: SentencePiece's ``eos`` (None if the model has none)."""
        return self._opt(self._sp.eos_id())

    eos_id = eod_id

    @property
    def bos_id(self) -> Optional[int]:
        return self._opt(self._sp.bos_id())

    @property
    def unk_id(self) -> Optional[int]:
        return self._opt(self._sp.unk_id())

    @property
    def pad_id(self) -> Optional[int]:
        """The model's pad id, or the eod id when the model defines no pad piece."""
        pad = self._opt(self._sp.pad_id())
        return pad if pad is not None else self.eod_id

    def id_to_piece(self, i: int) -> str:
        return self._sp.IdToPiece(int(i))

    def piece_to_id(self, piece: str) -> int:
        return int(self._sp.PieceToId(piece))

    # -- encoding ------------------------------------------------------------------------------
    def encode(self, text: Union[str, Sequence[str]], *, append_eod: bool = False):
        """Token ids of ``text`` (a list of ints), or of each text of a list."""
        if isinstance(text, str):
            ids = self._sp.EncodeAsIds(text)
            return ids + [self.eod_id] if append_eod else ids
        out = self._sp.Encode(list(text))
        if append_eod:
            out = [ids + [self.eod_id] for ids in out]
        return out

    tokenize = encode

    def decode(self, ids) -> str:
        """Text of ``ids`` (list, numpy array or tensor); control ids (pad, eos, bos) vanish."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._sp.DecodeIds([int(i) for i in ids])

    detokenize = decode

    def pad(self, sequences: Sequence[Sequence[int]], length: Optional[int] = None, *,
            pad_id: Optional[int] = None, left: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Stack ``sequences`` into ``[n, length]`` int64 ids plus a bool mask of real tokens.

        Sequences longer than ``length`` are truncated; padding uses ``pad_id`` (default:
        :attr:`pad_id`) on the right, or on the left with ``left=True``.
        """
        pad = self.pad_id if pad_id is None else pad_id
        if pad is None:
            raise ValueError("this tokenizer has neither a pad nor an eos id; pass pad_id")
        if length is None:
            length = max((len(s) for s in sequences), default=0)
        ids = np.full((len(sequences), length), pad, dtype=np.int64)
        mask = np.zeros((len(sequences), length), dtype=bool)
        for r, seq in enumerate(sequences):
            seq = np.asarray(seq, dtype=np.int64)[:length]
            sl = slice(length - seq.size, length) if left else slice(0, seq.size)
            ids[r, sl] = seq
            mask[r, sl] = True
        return ids, mask

    def __repr__(self):
        return f"Tokenizer({self.model_path!r}, vocab {self.vocab_size}, eod {self.eod_id})"


def training_sentences(texts: Iterable[str]) -> Iterator[str]:
    """The non-blank lines of each text (cut to ``MAX_SENTENCE_CHARS``): the training units."""
    for text in texts:
        for line in text.splitlines():
            if line.strip():
                yield line[:MAX_SENTENCE_CHARS]


def sample_sentences(sentences: Iterable[str], limit: Optional[int], seed: int = 0) -> list[str]:
    """At most ``limit`` sentences: a deterministic uniform sample (reservoir) when there are more."""
    if limit is None:
        return list(sentences)
    rng = random.Random(seed)
    out: list[str] = []
    for n, s in enumerate(sentences):
        if n < limit:
            out.append(s)
        else:
            j = rng.randint(0, n)
            if j < limit:
                out[j] = s
    return out


def train_sentencepiece(sentences: Iterable[str], output_prefix: Union[str, os.PathLike],
                        vocab_size: int, *, model_type: str = "bpe", byte_fallback: bool = False,
                        character_coverage: float = 1.0, normalization: str = "identity",
                        max_sentences: Optional[int] = None, user_defined_symbols=("\n",),
                        num_threads: Optional[int] = None, seed: int = 0, verbose: bool = False,
                        **extra) -> str:
    """Train a SentencePiece model on ``sentences``; writes ``P.model``/``P.vocab``, returns ``P.model``.

    ``max_sentences`` caps the training set with a deterministic sample. ``extra`` passes any
    other SentencePiece trainer option through. Files are written atomically (temp + rename).
    """
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram", "char", "word"):
        raise ValueError(f"unknown model type {model_type!r} (bpe, unigram, char, word)")
    data = sample_sentences(sentences, max_sentences, seed)
    if not data:
        raise ValueError("no training text: every input document is empty")
    prefix = os.fspath(output_prefix)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = f"{prefix}.tmp-{os.getpid()}"
    if num_threads is None:
        num_threads = max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                 else (os.cpu_count() or 1)))
    options = dict(
        model_prefix=tmp, vocab_size=int(vocab_size), model_type=model_type,
        byte_fallback=bool(byte_fallback), character_coverage=float(character_coverage),
        normalization_rule_name=normalization, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        max_sentence_length=4 * MAX_SENTENCE_CHARS + 16,
        input_sentence_size=0, shuffle_input_sentence=False,  # we sampled already
        num_threads=int(num_threads), minloglevel=0 if verbose else 2,
    )
    if user_defined_symbols:
        options["user_defined_symbols"] = list(user_defined_symbols)
    options.update(extra)
    try:
        spm.SentencePieceTrainer.Train(sentence_iterator=iter(data), **options)
    except RuntimeError as e:
        raise ValueError(f"SentencePiece training failed for {prefix}: {e}") from None
    os.replace(tmp + ".vocab", prefix + ".vocab")
    os.replace(tmp + ".model", prefix + ".model")
    return prefix + ".model"


__all__ = ["Tokenizer", "train_sentencepiece", "training_sentences", "sample_sentences"]
