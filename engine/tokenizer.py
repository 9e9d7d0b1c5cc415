"""The tokenizer of a Hugging Face model directory (tokenizer.json through the `tokenizers` library)."""

from __future__ import annotations

import json
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

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
