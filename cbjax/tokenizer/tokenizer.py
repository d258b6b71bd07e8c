"""The model's tokenizer (Hugging Face `tokenizers`, read from a checkpoint directory) and the
incremental detokenizer that turns a stream of sampled ids into text."""

import json
from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, processors

from cbjax.tokenizer.chat_template import Message, render_chat_template

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encodes, decodes and renders chats exactly as `transformers.AutoTokenizer` does for the same directory."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str],
        eos_token_ids: list[int],
        chat_template: str | None,
        source: str = "<in memory>",
    ):
        self.backend = backend
        self.special_tokens = special_tokens
        self._eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.source = source
        # Each token's text decoded alone, by skip_special_tokens: filled as tokens are met. And the
        # same for the detokenizer's joining path, "" where that text is not complete.
        self._token_texts: tuple[dict[int, str], dict[int, str]] = ({}, {})
        self._complete_texts: tuple[dict[int, str], dict[int, str]] = ({}, {})
        # Byte-level BPE (GPT-2's, Llama 3's, SmolLM2's) decodes ids to the UTF-8 of their tokens'
        # bytes, so ids whose text is complete (no U+FFFD) decode to their texts joined: the
        # incremental detokenizer then needs no window decode for such a token.
        self.decodes_by_joining = isinstance(backend.decoder, decoders.ByteLevel)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Read tokenizer.json plus, where present, tokenizer_config.json, special_tokens_map.json,
        generation_config.json and chat_template.jinja."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{path} has no tokenizer.json; point at a Hugging Face model directory "
                "(`cbjax import-gguf` writes one from a GGUF file)"
            )
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        special_tokens = _named_special_tokens(config, _read_json(path / "special_tokens_map.json"))
        # transformers rebuilds the post-processor when the config states either flag (and keeps tokenizer.json's otherwise).
        if "add_bos_token" in config or "add_eos_token" in config:
            backend.post_processor = _bos_eos_post_processor(
                backend, special_tokens, config.get("add_bos_token", False), config.get("add_eos_token", False)
            )
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        eos_ids = generation_eos if isinstance(generation_eos, list) else [generation_eos]
        eos_ids.append(backend.token_to_id(special_tokens["eos_token"]) if "eos_token" in special_tokens else None)
        eos_token_ids = list(dict.fromkeys(i for i in eos_ids if i is not None))
        return cls(backend, special_tokens, eos_token_ids, _chat_template(path, config), source=str(path))

    def encode(self, text: str) -> list[int]:
        """Token ids with the model's own BOS/EOS behaviour, like `AutoTokenizer(...)(text)["input_ids"]`.

        encode_batch_fast, unlike encode, lets go of the GIL while it works, and tracks no offsets,
        so the Encoding it makes is also quick to free (freeing holds the GIL): a server tokenizing
        a long prompt in a thread keeps streaming meanwhile (test_server_limits measures the stall)."""
        return self.backend.encode_batch_fast([text], add_special_tokens=True)[0].ids

    def encode_chat(self, rendered_chat: str) -> list[int]:
        """Ids of a rendered chat: the template already wrote any BOS, so none is added (as transformers does)."""
        return self.backend.encode_batch_fast([rendered_chat], add_special_tokens=False)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """One token's text decoded alone; cached, as the detokenizer asks it of nearly every token."""
        texts = self._token_texts[skip_special_tokens]
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = self.backend.decode([token_id], skip_special_tokens=skip_special_tokens)
        return text

    def complete_texts(self, skip_special_tokens: bool) -> dict[int, str]:
        """The cache complete_token_text fills: the detokenizer reads it directly, every token."""
        return self._complete_texts[skip_special_tokens]

    def complete_token_text(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """decode_token's text if it is complete text (not empty, no character cut short), else ""."""
        text = self.decode_token(token_id, skip_special_tokens)
        complete = self._complete_texts[skip_special_tokens][token_id] = text if "\ufffd" not in text else ""
        return complete

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included (transformers' `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id("bos_token")

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: generation_config.json's, then the tokenizer's eos_token."""
        return list(self._eos_token_ids)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops: special added tokens and the named ones."""
        special = {index for index, token in self.backend.get_added_tokens_decoder().items() if token.special}
        special |= {self.token_id(name) for name in self.special_tokens} - {None}
        return sorted(special)

    def token_id(self, name: str) -> int | None:
        """The id of a named special token (`"bos_token"`, `"eos_token"`, ...), or None if the model has none."""
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True, **variables) -> str:
        """The prompt text for one conversation (`transformers`' `apply_chat_template(tokenize=False)`)."""
        if self.chat_template is None:
            raise ValueError(
                f"the tokenizer in {self.source} has no chat template (none in tokenizer_config.json, no "
                "chat_template.jinja); pass a plain prompt instead, or add the model's template to the directory"
            )
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt, **{**self.special_tokens, **variables}
        )


class IncrementalDetokenizer:
    """Text of a growing output, emitted piece by piece, in O(new tokens) per call (the caller
    joins the pieces).

    Decoding a token alone is wrong for two reasons: a byte-level token can hold part of a
    multi-byte character (its decode ends in U+FFFD until the rest arrives), and some tokenizers
    (sentencepiece's leading-space rule) decode a token differently at the start of a sequence.
    So, as vLLM does, each step decodes a short window of ids: `window[:read_offset]` was emitted
    before and is only context, the rest is new. Text is emitted up to the last complete
    character; the window moves on once it decodes to complete text. With a byte-level BPE
    tokenizer, a token whose own text is complete, after complete context, needs no window
    decode: its text is what the window would add (most tokens of most outputs).
    """

    # Prompt tokens kept as the first window's context (vLLM uses the same number).
    _PROMPT_CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._window = list(prompt_token_ids)[-self._PROMPT_CONTEXT_TOKENS :]
        self._read_offset = len(self._window)
        self._context_text = self._decode(self._window)
        self._emitted_chars = 0  # of the window's text after `_context_text`, while it still ends incomplete
        self._joinable = tokenizer.decodes_by_joining and "\ufffd" not in self._context_text
        self._complete_texts = tokenizer.complete_texts(skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Append one sampled id; return the text it finalised (empty while it is only part of a character)."""
        if self._joinable and len(self._window) == self._read_offset:
            # Nothing pending after complete context (byte-level BPE): a token whose own text is
            # complete adds just that text, and the window moves on to it, as the general path does.
            text = self._complete_texts.get(token_id)
            if text is None:
                text = self.tokenizer.complete_token_text(token_id, self.skip_special_tokens)
            if text:
                self._window, self._read_offset, self._context_text = [token_id], 1, text
                return text
        return self._add_to_window([token_id])

    def text_as_is(self, token_id: int) -> str:
        """The text add_token(token_id) would return now, where it is the token's own text (nothing
        pending, byte-level BPE, the token's text complete); else "" (not known without a decode)."""
        if self._joinable and len(self._window) == self._read_offset:
            text = self._complete_texts.get(token_id)
            return self.tokenizer.complete_token_text(token_id, self.skip_special_tokens) if text is None else text
        return ""

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append sampled ids; return the text they finalised (empty while it is only part of a character)."""
        return self.add_token(token_ids[0]) if len(token_ids) == 1 else self._add_to_window(token_ids)

    def _add_to_window(self, token_ids: Sequence[int]) -> str:
        self._window.extend(token_ids)
        window_text = self._decode(self._window)
        complete = not window_text.endswith("\ufffd")
        new_text = window_text.rstrip("\ufffd")[len(self._context_text) + self._emitted_chars :]
        if not complete:
            self._emitted_chars += len(new_text)
        # Move on only past real text: a window of skipped special tokens is no context for what follows.
        elif len(window_text) > len(self._context_text):
            self._window = self._window[self._read_offset :]
            self._read_offset = len(self._window)
            self._context_text = self._decode(self._window)
            self._emitted_chars = 0
            self._joinable = self.tokenizer.decodes_by_joining and "\ufffd" not in self._context_text
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        # Called twice per token the window path takes. The second call, once the window has moved
        # on, is nearly always of the one newest token: cached.
        if len(token_ids) == 1:
            return self.tokenizer.decode_token(token_ids[0], self.skip_special_tokens)
        # The backend's own decode: the wrapper's copy shows.
        return self.tokenizer.backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


def _bos_eos_post_processor(
    backend: tokenizers.Tokenizer, special_tokens: dict[str, str], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    bos, eos = special_tokens.get("bos_token"), special_tokens.get("eos_token")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None

    def template(sequence: str, type_id: int) -> list[str]:
        return [f"{bos}:{type_id}"] * add_bos + [f"${sequence}:{type_id}"] + [f"{eos}:{type_id}"] * add_eos

    return processors.TemplateProcessing(
        single=template("A", 0),
        pair=template("A", 0) + template("B", 1),
        special_tokens=[(bos, backend.token_to_id(bos))] * add_bos + [(eos, backend.token_to_id(eos))] * add_eos,
    )


def _chat_template(path: Path, config: dict) -> str | None:
    # transformers 5 saves the template as chat_template.jinja, and prefers it to the config's copy.
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {entry["name"]: entry["template"] for entry in template}.get("default")
    return template


def _named_special_tokens(config: dict, special_tokens_map: dict) -> dict[str, str]:
    """`{"bos_token": "<s>", ...}` from tokenizer_config.json, else special_tokens_map.json."""
    special_tokens = {}
    for name in _NAMED_SPECIAL_TOKENS:
        token = config.get(name) or special_tokens_map.get(name)
        if token:
            # Older files store a special token as a serialized AddedToken.
            special_tokens[name] = token["content"] if isinstance(token, dict) else token
    return special_tokens


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
