"""Text in and out: a Hugging Face tokenizer from a local model directory, chat templates, incremental
detokenization with stop strings, and what the directory's configs say (EOS ids, context length).

    tok = Tokenizer.from_dir("/models/llama")            # tokenizer.json (+ tokenizer_config.json)
    ids = tok.encode("Hello")                             # or tok.chat([{"role": "user", "content": "Hi"}])
    text = TextStream(tok, stop=["\\n\\n"])              # per request: feed tokens, read .text / .visible

Loading goes through ``transformers.AutoTokenizer`` (``local_files_only``; chat templates need it and jinja2)
and falls back to ``tokenizers.Tokenizer.from_file`` when transformers is not installed. Incremental decoding is
``tokenizers.decoders.DecodeStream`` (multi-byte characters split over tokens come out whole), so a fast
tokenizer (``tokenizer.json``) is required. Requests given as token ids need no tokenizer at all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json",)


class TokenizerError(ValueError):
    """No usable tokenizer where one was asked for; the message says what is missing."""


def has_tokenizer(path) -> bool:
    return path is not None and Path(path).is_dir() and any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


class Tokenizer:
    """A fast Hugging Face tokenizer (``from_dir``); ``backend`` is its ``tokenizers.Tokenizer``."""

    def __init__(self, backend, hf=None, path: Path | None = None):
        self.backend = backend  # tokenizers.Tokenizer
        self.hf = hf  # transformers tokenizer, when transformers is installed (chat templates)
        self.path = path

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        path = Path(path)
        if not has_tokenizer(path):
            raise TokenizerError(f"tokenizer: {str(path)!r} has no {' or '.join(TOKENIZER_FILES)} (a fast Hugging "
                                 "Face tokenizer); pass --tokenizer DIR, or give token ids")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import transformers
        except ImportError:
            try:
                from tokenizers import Tokenizer as Backend
            except ImportError:
                raise TokenizerError("tokenizer: text needs Hugging Face tokenizers (pip install 'pagedkv[text]'), "
                                     "or give token ids") from None
            return cls(Backend.from_file(str(path / "tokenizer.json")), None, path)
        hf = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise TokenizerError(f"tokenizer: {str(path)!r} loads as a slow (Python) tokenizer; incremental "
                                 "decoding needs a fast one (tokenizer.json)")
        return cls(backend, hf, path)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.hf is not None and self.hf.eos_token_id is not None:
            return (int(self.hf.eos_token_id),)
        return ()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.hf is not None:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat (``[{"role": ..., "content": ...}]``) through the model's chat template."""
        if self.hf is None:
            raise TokenizerError("chat: chat templates need transformers (pip install 'pagedkv[text]')")
        if not getattr(self.hf, "chat_template", None):
            raise TokenizerError(f"chat: the tokenizer in {str(self.path)!r} has no chat template")
        ids = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]


class TextStream:
    """One request's output text, token by token (``DecodeStream``), with stop strings.

    ``push(token)`` adds a token and returns True when a stop string appeared: ``text`` is then cut before it
    (or after it, with ``include_stop``). ``visible`` is what may be streamed so far: everything but the last
    ``max(len(stop)) - 1`` characters while the request runs (they could still begin a stop string).
    """

    def __init__(self, tokenizer: Tokenizer, stop=(), *, include_stop: bool = False, skip_special_tokens=True):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> bool:
        chunk = self._stream.step(self.tokenizer.backend, int(token))
        if not chunk:
            return False
        start = max(0, len(self.text) - self._holdback)
        self.text += chunk
        for s in self.stop:
            at = self.text.find(s, start)
            if at >= 0:
                self.text = self.text[:at + (len(s) if self.include_stop else 0)]
                self.stopped = True
                return True
        return False

    def visible(self, finished: bool) -> str:
        return self.text if finished or self.stopped else self.text[:max(0, len(self.text) - self._holdback)]


# ---- what a model directory says -----------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def eos_token_ids(model_dir) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (what ``generate`` stops at), else ``config.json``."""
    if model_dir is None:
        return ()
    d = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        ids = _ids(_read_json(d / name).get("eos_token_id"))
        if ids:
            return ids
    return ()


def max_positions(model_dir) -> int | None:
    """The model's context length from ``config.json`` (``max_position_embeddings`` or ``n_positions``)."""
    if model_dir is None:
        return None
    config = _read_json(Path(model_dir) / "config.json")
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return None
