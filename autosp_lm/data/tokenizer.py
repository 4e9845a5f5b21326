"""Tokenizers: SentencePiece (training and a small wrapper) and Hugging Face ``tokenizer.json``.

``--tokenizer-type`` uses Megatron-LM's names: ``SentencePieceTokenizer`` (a ``.model`` file, the
default) and ``HuggingFaceTokenizer`` (a ``tokenizer.json`` or a directory holding one, read with
the ``tokenizers`` library: no ``transformers`` at run time). :func:`build_tokenizer` makes
either; both offer ``encode``/``decode``, ``vocab_size``, ``eod_id``, ``pad_id`` and pickle for
worker processes.

SentencePiece models trained here use ids ``unk=0, bos=1, eos=2, pad=3``; the end-of-document token (``eod``)
is SentencePiece's ``eos``. By default training uses the *identity* normalization and keeps
whitespace as is, and ``"\\n"`` is a user-defined symbol, so ``decode(encode(text)) == text``
for any text whose characters are covered (always, with ``byte_fallback``): source code keeps its
indentation and line breaks.
"""
from __future__ import annotations

import json
import os
import random
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np

MAX_SENTENCE_CHARS = 4096
TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer")


class _TokenizerBase:
    """What both tokenizer kinds share: ``encode`` (with an optional end-of-document id),
    ``decode`` and ``pad``, over the subclass's ``_ids``, ``_ids_batch`` and ``_text``."""

    eod_id: Optional[int]
    pad_id: Optional[int]

    def encode(self, text: Union[str, Sequence[str]], *, append_eod: bool = False):
        """Token ids of ``text`` (a list of ints), or of each text of a list."""
        if isinstance(text, str):
            ids = self._ids(text)
            return ids + [self.eod_id] if append_eod else ids
        out = self._ids_batch(list(text))
        if append_eod:
            out = [ids + [self.eod_id] for ids in out]
        return out

    tokenize = encode

    def decode(self, ids) -> str:
        """Text of ``ids`` (list, numpy array or tensor); control and special tokens (pad, eos,
        bos) vanish."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._text([int(i) for i in ids])

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


class Tokenizer(_TokenizerBase):
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
    def _ids(self, text: str) -> list:
        return self._sp.EncodeAsIds(text)

    def _ids_batch(self, texts: list) -> list:
        return self._sp.Encode(texts)

    def _text(self, ids: list) -> str:
        return self._sp.DecodeIds(ids)

    def __repr__(self):
        return f"Tokenizer({self.model_path!r}, vocab {self.vocab_size}, eod {self.eod_id})"


SentencePieceTokenizer = Tokenizer


def _special_token(value) -> Optional[str]:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HuggingFaceTokenizer(_TokenizerBase):
    """A Hugging Face fast tokenizer (``tokenizer.json``) through the ``tokenizers`` library.

    ``path``: the ``tokenizer.json`` file or a directory holding it. The end-of-document id is the
    tokenizer's eos: ``eos_token`` of ``tokenizer_config.json`` (or ``special_tokens_map.json``)
    beside it, else ``eos_token_id`` of a ``generation_config.json``/``config.json`` there, else
    the first of ``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ``<eos>`` in the vocabulary;
    ``bos``/``pad`` likewise. ``encode`` applies the tokenizer's post-processor (e.g. Llama 3's
    ``<|begin_of_text|>``) unless ``add_special_tokens=False``, as ``transformers`` does;
    ``decode`` drops special tokens.
    """

    KNOWN_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")

    def __init__(self, path: Union[str, os.PathLike], *, add_special_tokens: bool = True):
        from tokenizers import Tokenizer as _HFTokenizer

        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(
                f"tokenizer.json not found: {file} (HuggingFaceTokenizer reads a fast tokenizer's "
                f"tokenizer.json; a directory with only a slow tokenizer can be converted with "
                f"transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))")
        self.model_path = file
        self.add_special_tokens = bool(add_special_tokens)
        try:
            self._tok = _HFTokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
            raise ValueError(f"{file}: not a Hugging Face tokenizer.json ({e})") from None
        self._specials = self._read_specials(os.path.dirname(os.path.abspath(file)))

    def _read_specials(self, directory: str) -> dict:
        names: dict = {}
        for fname in ("special_tokens_map.json", "tokenizer_config.json"):  # later wins
            f = os.path.join(directory, fname)
            if os.path.isfile(f):
                try:
                    with open(f) as fh:
                        data = json.load(fh)
                except (OSError, json.JSONDecodeError):
                    continue
                for key in ("bos", "eos", "pad", "unk"):
                    tok = _special_token(data.get(f"{key}_token"))
                    if tok is not None:
                        names[key] = tok
        ids = {k: self._tok.token_to_id(v) for k, v in names.items()}
        ids = {k: v for k, v in ids.items() if v is not None}
        for fname in ("generation_config.json", "config.json"):
            f = os.path.join(directory, fname)
            if os.path.isfile(f):
                try:
                    with open(f) as fh:
                        data = json.load(fh)
                except (OSError, json.JSONDecodeError):
                    continue
                for key in ("bos", "eos", "pad"):
                    v = data.get(f"{key}_token_id")
                    if isinstance(v, list):
                        v = v[0] if v else None
                    if isinstance(v, int) and key not in ids:
                        ids[key] = v
        if "eos" not in ids:
            for tok in self.KNOWN_EOS:
                i = self._tok.token_to_id(tok)
                if i is not None:
                    ids["eos"] = i
                    break
        return ids

    # -- pickling ----------------------------------------------------------------------------
    def __getstate__(self):
        return {"model_path": self.model_path, "json": self._tok.to_str(), "specials": self._specials,
                "add_special_tokens": self.add_special_tokens}

    def __setstate__(self, state):
        from tokenizers import Tokenizer as _HFTokenizer

        self.model_path = state["model_path"]
        self._tok = _HFTokenizer.from_str(state["json"])
        self._specials = state["specials"]
        self.add_special_tokens = state["add_special_tokens"]

    # -- vocabulary ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """One more than the largest id (added tokens included)."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)

    @property
    def eod_id(self) -> Optional[int]:
        """End-of-document id: the tokenizer's eos (None if it has none)."""
        return self._specials.get("eos")

    eos_id = eod_id

    @property
    def bos_id(self) -> Optional[int]:
        return self._specials.get("bos")

    @property
    def unk_id(self) -> Optional[int]:
        return self._specials.get("unk")

    @property
    def pad_id(self) -> Optional[int]:
        """The tokenizer's pad id, or the eod id when it defines none."""
        pad = self._specials.get("pad")
        return pad if pad is not None else self.eod_id

    def id_to_piece(self, i: int) -> str:
        return self._tok.id_to_token(int(i))

    def piece_to_id(self, piece: str) -> Optional[int]:
        return self._tok.token_to_id(piece)

    def files(self) -> list[str]:
        """``tokenizer.json`` and the config files beside it (what an export copies)."""
        d = os.path.dirname(os.path.abspath(self.model_path))
        out = [self.model_path]
        for f in ("tokenizer_config.json", "special_tokens_map.json"):
            if os.path.isfile(os.path.join(d, f)):
                out.append(os.path.join(d, f))
        return out

    # -- encoding ------------------------------------------------------------------------------
    def _ids(self, text: str) -> list:
        return self._tok.encode(text, add_special_tokens=self.add_special_tokens).ids

    def _ids_batch(self, texts: list) -> list:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=self.add_special_tokens)]

    def _text(self, ids: list) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def __repr__(self):
        return f"HuggingFaceTokenizer({self.model_path!r}, vocab {self.vocab_size}, eod {self.eod_id})"


def infer_tokenizer_type(path: Union[str, os.PathLike]) -> str:
    """``HuggingFaceTokenizer`` for a directory or a ``.json`` file, else ``SentencePieceTokenizer``."""
    path = os.fspath(path)
    return "HuggingFaceTokenizer" if os.path.isdir(path) or path.endswith(".json") else "SentencePieceTokenizer"


def build_tokenizer(tokenizer_type: Optional[str], path: Union[str, os.PathLike]):
    """A tokenizer of ``tokenizer_type`` (Megatron's names; None: inferred from ``path``)."""
    kind = tokenizer_type or infer_tokenizer_type(path)
    if kind == "SentencePieceTokenizer":
        return Tokenizer(path)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(path)
    raise ValueError(f"unknown tokenizer type {kind!r}: choose one of {', '.join(TOKENIZER_TYPES)}")


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


__all__ = ["Tokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer", "TOKENIZER_TYPES",
           "build_tokenizer", "infer_tokenizer_type", "train_sentencepiece", "training_sentences",
           "sample_sentences"]
