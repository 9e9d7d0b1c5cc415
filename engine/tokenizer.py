"""The tokenizer of a Hugging Face model directory (tokenizer.json through the `tokenizers` library)."""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _Tokenizer

from engine.checkpoint import CheckpointError

DEFAULT_CHAT_TEMPLATE = "plain"     # "<role>: <content>\n" per message, then "assistant:"


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no tokenizer.json")
        self._tok = _Tokenizer.from_file(str(path))
        config_path = Path(model_dir) / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        eos = self.config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None
        self.chat_template = self.config.get("chat_template")
        self._detok_ids: tuple[frozenset[int], frozenset[int]] | None = None   # made at the first detokenizer()
        self._decoder_types: frozenset[str] | None = None
        self._bytes: dict[int, bytes] = {}          # ids' own bytes, as token_bytes() met them
        self._alphabet: dict[str, int] | None = None
        added = self._tok.get_added_tokens_decoder()
        self._special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._special_by_text = {added[i].content: i for i in sorted(self._special_ids)}
        # Longest first: where two control tokens start at one place, the longer is the token, as the tokenizer's
        # own matching takes it; a token that strips whitespace beside it takes that whitespace along.
        alternatives = [(r"\s*" if added[i].lstrip else "") + re.escape(text) + (r"\s*" if added[i].rstrip else "")
                        for text, i in sorted(self._special_by_text.items(), key=lambda kv: -len(kv[0]))]
        self._special_re = re.compile("|".join(alternatives)) if alternatives else None
        self._as_text: _Tokenizer | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, literal: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids of ``text``, a special token's text read as that token, except where it lies in one of the
        ``literal`` ``(start, end)`` character spans (disjoint): there it is ordinary text (a chat message's
        content must not open a turn of its own). Outside those spans the text is cut where it would be anyway, at
        its special tokens, so the ids equal ``encode(text)``'s wherever no literal span holds one."""
        # encode_batch releases the GIL while it works (encode holds it): a long prompt tokenized on a
        # server's worker thread must not stall its event loop.
        if not literal or self._special_re is None:
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        pieces: list[str | int] = []        # text to tokenize, or a control token's id
        spans = sorted(literal)
        starts = [a for a, _ in spans]
        start = 0
        for match in self._special_re.finditer(text):
            token = match.group().strip()       # less the whitespace it strips beside it
            first = match.start() + match.group().index(token)
            # The spans do not overlap: only the last one starting before the token's end can hold part of it.
            k = bisect.bisect_left(starts, first + len(token)) - 1
            if k >= 0 and spans[k][1] > first:
                continue
            pieces += [text[start:match.start()], self._special_by_text[token]]
            start = match.end()
        pieces.append(text[start:])
        texts = [p for p in pieces if isinstance(p, str)]
        encoded = iter(self._text_tokenizer().encode_batch(texts, add_special_tokens=False))
        return [i for p in pieces for i in ([p] if isinstance(p, int) else next(encoded).ids)]

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The special (control) tokens' texts."""
        return tuple(self._special_by_text)

    def _text_tokenizer(self) -> _Tokenizer:
        """A copy of the tokenizer that reads special tokens' text as ordinary characters (a copy: the flag
        belongs to the object, which other threads encode with)."""
        if self._as_text is None:
            tok = _Tokenizer.from_str(self._tok.to_str())
            tok.encode_special_tokens = True
            self._as_text = tok
        return self._as_text

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (special tokens included), as logprobs report it."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        """One token's own bytes, as logprobs report them: a byte-level BPE or byte-fallback (<0xNN>) token may
        hold part of a character, which ``token_text`` shows as U+FFFD. With ``skip_special_tokens``: what the token
        adds to ``decode``'s text (a special token nothing)."""
        if skip_special_tokens and token_id in self._special_ids:
            return b""
        raw = self._bytes.get(token_id)
        if raw is None:     # one id at a time (a whole vocabulary's table would stall the first logprobs request)
            if self._alphabet is None:
                self._alphabet = _byte_level_alphabet() if "ByteLevel" in self._decoders() else {}
            raw = self._bytes[token_id] = _token_bytes(self._tok, token_id, self._alphabet,
                                                       "ByteFallback" in self._decoders())
        return raw

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _decoders(self) -> frozenset[str]:
        """The types of the tokenizer's decoders ("ByteLevel", "ByteFallback", "Metaspace", ...)."""
        if self._decoder_types is None:
            types, nodes = set(), [json.loads(self._tok.to_str()).get("decoder")]
            while nodes:
                node = nodes.pop()
                if isinstance(node, dict):
                    types.add(node.get("type"))
                    nodes += node.values()
                elif isinstance(node, list):
                    nodes += node
            self._decoder_types = frozenset(t for t in types if isinstance(t, str))
        return self._decoder_types

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        """A fresh incremental detokenizer for one growing sequence of ids (one per request); its text is
        ``decode(ids, skip_special_tokens)``'s."""
        if self._detok_ids is None:
            byte_ids = _byte_fallback_ids(self._tok) if "ByteFallback" in self._decoders() else frozenset()
            self._detok_ids = byte_ids, self._special_ids
        byte_ids, special_ids = self._detok_ids
        return IncrementalDetokenizer(self._tok, byte_ids, special_ids if skip_special_tokens else frozenset(),
                                      skip_special_tokens)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_fallback_ids(tok: _Tokenizer) -> frozenset[int]:
    """Ids a ByteFallback decoder turns into raw bytes (<0xNN>)."""
    return frozenset(i for t, i in tok.get_vocab(with_added_tokens=True).items() if _BYTE_PIECE.fullmatch(t))


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE's (GPT-2's) alphabet: for each character of its vocabulary the byte it stands for.
    Printable bytes stand for themselves; the others for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


def _token_bytes(tok: _Tokenizer, token_id: int, alphabet: dict[str, int], byte_fallback: bool) -> bytes:
    """The token's own bytes: an added token's content, a byte-level piece through the byte ``alphabet`` (empty
    without one), a <0xNN> byte-fallback piece's byte, else the token's text on its own (b"" for an unknown id)."""
    piece = tok.id_to_token(token_id)
    if piece is None:
        return b""
    added = tok.get_added_tokens_decoder().get(token_id)
    if added is not None:
        return added.content.encode()
    if alphabet and all(ch in alphabet for ch in piece):
        return bytes(alphabet[ch] for ch in piece)
    byte = _BYTE_PIECE.fullmatch(piece) if byte_fallback else None
    if byte:
        return bytes([int(byte.group(1), 16)])
    return tok.decode([token_id], skip_special_tokens=False).encode()


class IncrementalDetokenizer:
    """The text of a growing id sequence, decoding only a short window of ids per step.

    The prefix-offset / read-offset scheme: ``ids[prefix_offset:read_offset]`` is the last chunk of ids
    whose text was emitted, kept as context for decoders whose output for a token depends on its
    neighbours (leading-space stripping); ``decode(ids[prefix_offset:])`` minus that context's text is
    the new text. Text is emitted only once it cannot change: never while it ends in U+FFFD (an
    incomplete UTF-8 sequence), does not extend the context's text, or ends in a byte-fallback token
    (ByteFallback decodes a run of <0xNN> tokens, special tokens skipped, all at once: all U+FFFD
    unless the whole run is valid UTF-8). ``finish`` emits what is still held back. Everything ``step``
    and ``finish`` return concatenates to ``Tokenizer.decode(ids, skip_special_tokens)`` for the
    byte-level, byte-fallback, Metaspace and Fuse decoders; not for a decoder that rewrites earlier text
    on later tokens (WordPiece's cleanup, " ' " -> "'"), which no generative model here uses.
    """

    __slots__ = ("_tok", "_byte_ids", "_special_ids", "_skip", "prefix_offset", "read_offset", "_prefix_text")

    def __init__(self, tok: _Tokenizer, byte_ids: frozenset[int] = frozenset(),
                 special_ids: frozenset[int] = frozenset(), skip_special_tokens: bool = True):
        self._tok = tok
        self._byte_ids = byte_ids       # <0xNN> ids of a ByteFallback decoder
        self._special_ids = special_ids  # skipped by decode: they do not end a byte run
        self._skip = skip_special_tokens
        self.prefix_offset = 0          # where the context window starts
        self.read_offset = 0            # ids before this have their text emitted
        self._prefix_text = ""          # decode(ids[prefix_offset:read_offset])

    def step(self, ids: list[int]) -> str:
        """The new final text once ``ids`` (the whole sequence so far) has grown; "" while held back."""
        if len(ids) <= self.read_offset:
            return ""
        if self._byte_ids:
            k = len(ids) - 1
            while k >= self.read_offset and ids[k] in self._special_ids:
                k -= 1
            if k >= self.read_offset and ids[k] in self._byte_ids:
                return ""               # a byte run still open: its text depends on how it ends
        text = self._tok.decode(ids[self.prefix_offset:], skip_special_tokens=self._skip)
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd") or \
                not text.startswith(self._prefix_text):
            return ""
        new = text[len(self._prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self._prefix_text = self._tok.decode(ids[self.prefix_offset:self.read_offset],
                                             skip_special_tokens=self._skip)
        return new

    def finish(self, ids: list[int]) -> str:
        """The held-back text at the end of the sequence (incomplete UTF-8 decodes to U+FFFD, as decode does)."""
        if len(ids) <= self.read_offset:
            return ""
        text = self._tok.decode(ids[self.prefix_offset:], skip_special_tokens=self._skip)
        new = text[len(self._prefix_text):] if text.startswith(self._prefix_text) else ""
        self.prefix_offset = self.read_offset = len(ids)
        self._prefix_text = ""
        return new
