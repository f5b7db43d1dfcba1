"""Tokenizers: text <-> token ids, and chat messages -> prompt text. Free of torch: the scheduler
tokenizes each prompt once (daemon/scheduler/prompt_tokens.py), the worker's engine detokenizes.

Chat templates are Jinja programs shipped inside model directories, i.e. untrusted code: they run
in Jinja's immutable sandbox with the same helpers transformers provides (raise_exception,
strftime_now, a tojson that does not HTML-escape), so templates written for transformers render
the same here. Text in the messages never becomes a special token (special_text.py) unless the
model's config opts out (content_special_tokens); the embedded byte tokenizer has no special
tokens in text at all: its role markers are plain bytes.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as RustTokenizer

from mcpd import small_file
from mcpd.config import EMBEDDED_PATH, ModelConfig
from mcpd.special_text import SpecialText


class Tokenizer(Protocol):
    eos_token_ids: set[int]
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens=False for text from apply_chat_template, which already has them."""

    def decode(self, token_ids: list[int]) -> str:
        """Special tokens are dropped; bytes that are not (yet) valid UTF-8 become U+FFFD."""

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The prompt for these messages, ending with the assistant's turn opening."""

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The prompt's token ids; the messages' own text gives no special token."""


class ByteTokenizer:
    """The embedded model's tokenizer: ids 0..255 are bytes, then BOS and EOS."""
    BOS, EOS = 256, 257
    vocab_size = 258

    def __init__(self) -> None:
        self.bos_token_id = self.BOS
        self.eos_token_ids = {self.EOS}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([self.BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        lines = [f"<|{m['role']}|>\n{m['content']}\n" for m in _checked(messages)]
        return "".join(lines) + "<|assistant|>\n"

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


class HFTokenizer:
    """A Hugging Face tokenizer.json, with the chat template of tokenizer_config.json."""

    def __init__(self, model_dir: Path, eos_token_ids: set[int], content_special_tokens: bool = False) -> None:
        """content_special_tokens: special-token text in messages gives special tokens (the opt-out)."""
        config_file = model_dir / "tokenizer_config.json"
        config = optional_json(config_file)
        self._take(read_tokenizer(model_dir / "tokenizer.json"), _token_text(config, "bos_token", config_file),
                   _token_text(config, "eos_token", config_file), eos_token_ids,
                   _compiled(*_chat_template_source(model_dir, config)), content_special_tokens, model_dir)

    @classmethod
    def from_gguf(cls, path: Path, content_special_tokens: bool = False) -> "HFTokenizer":
        """The tokenizer a GGUF file carries (gguf_tokenizer.py builds it from the metadata)."""
        from mcpd import gguf_file, gguf_tokenizer

        try:
            built = gguf_tokenizer.parts(gguf_file.open_gguf(path), path)
        except gguf_file.BadGGUF as e:
            raise ValueError(f"{path}: {e}") from None
        tokenizer = cls.__new__(cls)
        tokenizer._take(built.tokenizer, built.bos_token, built.eos_token, built.eos_token_ids,
                        _compiled(built.chat_template, path), content_special_tokens, path)
        return tokenizer

    def _take(self, tokenizer: RustTokenizer, bos_token: str | None, eos_token: str | None, eos_token_ids: set[int],
              chat_template, content_special_tokens: bool, source: Path) -> None:
        """Serve `tokenizer` with these special tokens and chat template (_compiled's)."""
        self.tokenizer = tokenizer
        self.plain: RustTokenizer | None = None   # a copy that reads special-token text as text; made when needed
        specials = {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        self.special_text = None if content_special_tokens else SpecialText(specials)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = self._id_of(self.bos_token)
        eos_id = self._id_of(self.eos_token)
        self.eos_token_ids = eos_token_ids | ({eos_id} if eos_id is not None else set())
        self.chat_template = chat_template
        self.model_dir = source

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The rendered prompt's tokens (a template carries its own special tokens, as in
        transformers); special-token text in the messages is encoded as text."""
        masked = self.special_text.mask(messages) if self.special_text is not None else None
        if masked is None:
            return self.encode(self.apply_chat_template(messages), add_special_tokens=False)
        ids = []
        for piece in self.special_text.pieces(self.apply_chat_template(masked.messages), masked):
            ids += [piece] if isinstance(piece, int) else self.encode_text(piece)
        return ids

    def encode_text(self, text: str) -> list[int]:
        """`text`'s tokens with special-token text in it encoded as text (no BOS/EOS either)."""
        return self._plain().encode(text, add_special_tokens=False).ids

    def _plain(self) -> RustTokenizer:
        if self.plain is None:
            self.plain = RustTokenizer.from_str(self.tokenizer.to_str())
            self.plain.encode_special_tokens = True
        return self.plain

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self.chat_template is None:
            raise ValueError(f"the model in {self.model_dir} has no chat template (neither "
                             "tokenizer_config.json nor chat_template.jinja): send a prompt, not messages")
        from jinja2 import TemplateError   # loaded already: it compiled the template

        try:
            return self.chat_template.render(messages=_checked(messages), add_generation_prompt=True,
                                             bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise ValueError(f"chat template: {e}") from None

    def _id_of(self, token: str | None) -> int | None:
        return self.tokenizer.token_to_id(token) if token else None


def load(config: ModelConfig) -> Tokenizer:
    """The tokenizer of the model in config.path (a checkpoint directory or a GGUF file), or the
    embedded model's."""
    if config.path in ("", EMBEDDED_PATH):
        return ByteTokenizer()
    path = Path(config.path)
    if path.suffix == ".gguf":
        return HFTokenizer.from_gguf(path, config.content_special_tokens)
    return HFTokenizer(path, eos_token_ids(path, small_file.read_json(path / "config.json")),
                       config.content_special_tokens)


def eos_token_ids(path: Path, hf: dict) -> set[int]:
    """config.json (`hf`) and generation_config.json may each name end tokens (Llama 3 has several);
    ValueError naming the file where one names something else (a string, a dict)."""
    ids = set()
    generation = optional_json(path / "generation_config.json")
    for name, source in (("config.json", hf), ("generation_config.json", generation)):
        eos = source.get("eos_token_id")
        listed = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if not all(type(token) is int and token >= 0 for token in listed):
            raise ValueError(f"{path / name}: eos_token_id {eos!r:.100} is not a token id or a list of them")
        ids.update(listed)
    return ids


def optional_json(path: Path) -> dict:
    """The JSON object a model directory may hold beside config.json ({} where it holds none);
    ValueError naming the file where it is no small regular file of one (a FIFO must not hang a start)."""
    if not path.exists():
        return {}
    try:
        loaded = small_file.read_json(path)
    except (OSError, small_file.NotSmallFile) as e:
        raise ValueError(f"{path}: not a readable JSON object ({e})") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: not a JSON object")
    return loaded


def read_tokenizer(path: Path) -> RustTokenizer:
    """The tokenizers library's Tokenizer in the tokenizer.json at path; ValueError naming the
    file where it is none (the library raises a bare Exception for JSON of any wrong shape)."""
    try:
        text = small_file.read_text(path, small_file.MAX_JSON_BYTES)   # a FIFO must not hang a start
    except (OSError, small_file.NotSmallFile) as e:
        raise ValueError(f"{path}: not a readable tokenizer ({e})") from None
    try:
        return RustTokenizer.from_str(text)
    except Exception as e:   # noqa: BLE001 - the library's only exception type
        raise ValueError(f"{path}: not a readable tokenizer ({e})") from None


def _checked(messages: list[dict]) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"each message needs a string role and content, got {m!r:.100}")
    return messages


def _token_text(config: dict, key: str, config_file: Path) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    token = config.get(key)
    text = token.get("content") if isinstance(token, dict) else token
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{config_file}: {key} {token!r:.100} is not a token's text")
    return text


def _chat_template_source(model_dir: Path, config: dict) -> tuple[str | None, Path]:
    """The chat template's source, and the file it is read from."""
    template_file = model_dir / "chat_template.jinja"  # where newer transformers save it
    if template_file.exists():
        try:
            return small_file.read_text(template_file, small_file.MAX_JSON_BYTES), template_file
        except (OSError, small_file.NotSmallFile) as e:
            raise ValueError(f"{template_file}: not a readable template ({e})") from None
    config_file = model_dir / "tokenizer_config.json"
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in template)
        template = {t["name"]: t.get("template") for t in template}.get("default") if named else template
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{config_file}: chat_template {config.get('chat_template')!r:.100} is not a template "
                         "or a list of named ones")
    return template, config_file


def _compiled(template: str | None, source: Path):
    """The chat template compiled in the sandbox (None for none); ValueError naming its file
    where it is no Jinja template."""
    if not template:
        return None
    from jinja2 import TemplateError

    try:
        return _sandbox().from_string(template)
    except TemplateError as e:
        raise ValueError(f"{source}: chat template: {e}") from None


def _sandbox():
    """Jinja's immutable sandbox; jinja2 is imported here, by a model with a chat template: every
    scheduler, worker and pool keeper imports this module, most serve the embedded model."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
