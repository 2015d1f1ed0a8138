"""The tokenizer of a GGUF file, rebuilt with the ``tokenizers`` library, and its chat template.

A GGUF file carries its vocabulary as data: ``tokenizer.ggml.tokens`` (one string per id), ``merges``,
``token_type`` (3 = control, 4 = user-defined: both matched whole in text), the BOS / EOS / padding ids
and a Jinja chat template. Two tokenizer models are rebuilt:

- ``gpt2``: byte-level BPE (GPT-2, SmolLM, LLaMA 3, Qwen2); ``tokenizer.ggml.pre`` names the split of
  the text before BPE (:data:`PRE_TOKENIZERS`).
- ``llama``: SentencePiece BPE with byte fallback (LLaMA 1/2, Mistral), when the file has its merges.

The chat template is rendered in Jinja's sandbox (no attribute access to Python internals), with the
globals transformers gives it (``raise_exception``, ``tojson``), and tokenized without extra BOS, as
transformers' ``apply_chat_template`` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["EOG_TOKENS", "PRE_TOKENIZERS", "GGUFTokenizer", "field_value"]

_INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}  # GGUF u8 i8 u16 i16 u32 i32 u64 i64
_FLOAT_TYPES = {6, 12}
_STRING, _BOOL, _ARRAY = 8, 7, 9
#: llama.cpp's pre-tokenizer names -> the regular expression split before byte-level BPE (None: GPT-2's,
#: inside ``ByteLevel``); "smollm" and "starcoder" put every digit apart first.
PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "gpt-2": None,
    "smollm": None,
    "starcoder": None,
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_DIGITS_APART = ("smollm", "starcoder")
#: Control tokens that end a turn or a text in the chat models llama.cpp knows (its end-of-generation set).
EOG_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<EOT>")


def _kind_name(types: list[Any]) -> str:
    names = [getattr(t, "name", str(t)).lower() for t in types]
    return "array of " + names[1] if len(names) > 1 else names[0]


def field_value(reader: Any, key: str, kind: type, where: str, default: Any = ...) -> Any:
    """The scalar metadata value ``key`` of a ``gguf.GGUFReader``, checked to be of ``kind`` (int, float,
    str or bool); ``default`` when absent (required when not given).

    Raises:
        ValueError: a missing required key, or a value of another type (naming ``where`` and the key).
    """
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise ValueError(f"{where}: the metadata key {key!r} is missing; the file is incomplete")
        return default
    t = int(f.types[0])
    ok = {int: _INT_TYPES, float: _INT_TYPES | _FLOAT_TYPES, str: {_STRING}, bool: {_BOOL}}[kind]
    if t not in ok or len(f.types) != 1:
        raise ValueError(
            f"{where}: the metadata key {key!r} holds a {_kind_name(f.types)}, not a {kind.__name__} "
            "(per-layer values are not supported)"
        )
    part = f.parts[f.data[0]]
    if kind is str:
        return _text(bytes(part), key, where)
    return kind(part[0])


def _text(raw: bytes, key: str, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where}: the metadata key {key!r} holds text that is not UTF-8") from None


def _array(reader: Any, key: str, item: int, where: str, required: bool = True) -> list[Any] | None:
    """The array metadata value ``key`` with items of GGUF type ``item`` (strings decoded)."""
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ValueError(f"{where}: the metadata key {key!r} is missing; the file has no vocabulary")
        return None
    types = [int(t) for t in f.types]
    if types[0] != _ARRAY or (len(types) > 1 and not (types[1] == item or {types[1], item} <= _INT_TYPES)):
        raise ValueError(
            f"{where}: the metadata key {key!r} holds a {_kind_name(f.types)}, not the array expected"
        )
    if item == _STRING:
        return [_text(bytes(f.parts[i]), key, where) for i in f.data]
    return [f.parts[i][0].item() for i in f.data]


def _byte_level(vocab: dict[str, int], merges: list[tuple[str, str]], pre: str, where: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{where}: tokenizer.ggml.pre is {pre!r}, a text split multihead does not know; known: "
            f"{sorted(PRE_TOKENIZERS)}"
        )
    tk = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    regex = PRE_TOKENIZERS[pre]
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if pre in _DIGITS_APART else []
    if regex is not None:
        steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None))
    tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece(vocab: dict[str, int], merges: list[tuple[str, str]], unk: str, space: bool) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    tk = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend("\u2581")] if space else []
    tk.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    parts = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence([*parts, decoders.Strip(" ", 1, 0)] if space else parts)
    return tk


class GGUFTokenizer:
    """Text <-> token ids for a model read from a GGUF file, with its special ids and chat template.

    Attributes:
        tokenizer: the ``tokenizers.Tokenizer``.
        bos_token_id, eos_token_id, pad_token_id: ids from the file (None where it has none).
        eos_token_ids: the ids that end a turn: EOS, then the file's end-of-turn ids and its control
            tokens among :data:`EOG_TOKENS` (what generation stops at by default).
        chat_template: the Jinja template text, or None.
    """

    def __init__(self, tokenizer: Any, special: Mapping[str, Any], chat_template: str | None, where: str):
        self.tokenizer = tokenizer
        self.bos_token_id = special.get("bos")
        self.eos_token_id = special.get("eos")
        self.pad_token_id = special.get("pad")
        self.add_bos = bool(special.get("add_bos"))
        self.eos_token_ids: tuple[int, ...] = tuple(special.get("eog", ()))
        self.chat_template = chat_template
        self._where = where
        self._template: Any = None
        if chat_template is not None:
            try:
                import jinja2  # noqa: F401  (compiled now when present: a bad template fails at load)
            except ImportError:
                return
            self._template = _compile(chat_template, where)

    def __getstate__(self) -> dict[str, Any]:
        """The state to copy or pickle: all but the compiled chat template (a Jinja object that can be
        neither), which the copy compiles again at its first ``apply_chat_template``; so a model that
        holds this tokenizer can be deep-copied (``mh.quant.quantize``, ``mh.heads.to_mla``)."""
        return {**self.__dict__, "_template": None}

    @classmethod
    def from_reader(cls, reader: Any, where: str, vocab_size: int) -> GGUFTokenizer:
        """The tokenizer of a ``gguf.GGUFReader`` whose model has ``vocab_size`` embedding rows.

        Raises:
            ValueError: a missing or mistyped vocabulary, more tokens than embedding rows, special ids
                outside the vocabulary, a tokenizer model or text split multihead does not rebuild.
        """
        from tokenizers import AddedToken

        tokens = _array(reader, "tokenizer.ggml.tokens", _STRING, where)
        assert tokens is not None
        if not 0 < len(tokens) <= vocab_size:
            raise ValueError(
                f"{where}: tokenizer.ggml.tokens holds {len(tokens)} tokens for {vocab_size} embedding rows"
            )
        types = _array(reader, "tokenizer.ggml.token_type", 5, where, required=False) or [1] * len(tokens)
        merges = [
            tuple(m.split(" ", 1))
            for m in _array(reader, "tokenizer.ggml.merges", _STRING, where, False) or []
        ]
        if any(len(m) != 2 for m in merges):
            raise ValueError(
                f"{where}: tokenizer.ggml.merges holds an entry without a space between its pair"
            )
        vocab = {t: i for i, t in enumerate(tokens)}
        model = field_value(reader, "tokenizer.ggml.model", str, where)
        tk = _build(reader, model, vocab, merges, tokens, where)
        control = [i for i, k in enumerate(types[: len(tokens)]) if k == 3]
        user = [i for i, k in enumerate(types[: len(tokens)]) if k == 4]
        tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
        tk.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
        special = _special_ids(reader, tokens, control, where)
        template = field_value(reader, "tokenizer.chat_template", str, where, None)
        return cls(tk, special, template, where)

    # -- text <-> ids ------------------------------------------------------------------------------
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; control tokens written in it (``<|im_start|>``) are matched whole; BOS
        is prepended when the file asks for it (``tokenizer.ggml.add_bos_token``) and
        ``add_special_tokens``."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (control tokens left out unless ``skip_special_tokens=False``)."""
        return str(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        tokenize: bool = True, **kwargs: Any,
    ) -> list[int] | str:  # fmt: skip
        """The conversation ``messages`` (``[{"role": "user", "content": "..."}, ...]``) rendered with
        the file's chat template: its token ids, or its text with ``tokenize=False``. With
        ``add_generation_prompt`` the text ends where the assistant's answer begins.

        Raises:
            ImportError: jinja2 is missing.
            ValueError: the file has no chat template, messages that are not a list of role/content
                mappings, or an error the template raises itself.
        """
        if self.chat_template is None:
            raise ValueError(
                f"{self._where} has no chat template (tokenizer.chat_template); encode text instead"
            )
        if isinstance(messages, (str, bytes)) or not all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages
        ):
            raise ValueError('messages must be a list of {"role": ..., "content": ...} mappings')
        if self._template is None:
            try:
                import jinja2  # noqa: F401
            except ImportError:
                raise ImportError('chat templates need jinja2: pip install "multihead[lm]"') from None
            self._template = _compile(self.chat_template, self._where)
        names = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id}
        shown = {k: "" if v is None else self.tokenizer.id_to_token(v) for k, v in names.items()}
        text = _render(self._template, messages, add_generation_prompt, {**shown, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _build(reader: Any, model: str, vocab: dict[str, int], merges: list[tuple[str, str]], tokens: list[str],
           where: str) -> Any:  # fmt: skip
    """The ``tokenizers.Tokenizer`` of tokenizer model ``model`` ("gpt2" or "llama")."""
    if model == "gpt2":
        return _byte_level(
            vocab, merges, field_value(reader, "tokenizer.ggml.pre", str, where, "default"), where
        )
    if model == "llama" and merges:
        unk = field_value(reader, "tokenizer.ggml.unknown_token_id", int, where, 0)
        space = field_value(reader, "tokenizer.ggml.add_space_prefix", bool, where, True)
        return _sentencepiece(vocab, merges, tokens[unk] if unk < len(tokens) else tokens[0], space)
    why = "a SentencePiece vocabulary without tokenizer.ggml.merges" if model == "llama" else repr(model)
    raise ValueError(
        f"{where}: tokenizer.ggml.model is {why}; multihead rebuilds 'gpt2' (byte-level BPE) and 'llama' "
        "(SentencePiece BPE with its merges) tokenizers"
    )


def _special_ids(reader: Any, tokens: list[str], control: list[int], where: str) -> dict[str, Any]:
    """BOS / EOS / padding ids and the end-of-turn ids, each checked to lie in the vocabulary."""
    out: dict[str, Any] = {}
    for name in ("bos", "eos", "pad", "eot", "eom"):
        key = f"tokenizer.ggml.{'padding' if name == 'pad' else name}_token_id"
        i = field_value(reader, key, int, where, None)
        if i is not None and not 0 <= i < len(tokens):
            raise ValueError(f"{where}: {key}={i} lies outside the {len(tokens)} tokens of the vocabulary")
        out[name] = i
    out["add_bos"] = field_value(reader, "tokenizer.ggml.add_bos_token", bool, where, False)
    named = [i for i in control if tokens[i] in EOG_TOKENS]
    eog = [i for i in (out["eos"], out["eot"], out["eom"], *named) if i is not None]
    out["eog"] = tuple(dict.fromkeys(eog))  # in order, once each
    return out


def _compile(template: str, where: str) -> Any:
    """The template compiled in Jinja's immutable sandbox, with transformers' globals and options."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"the chat template of {where} refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ValueError(f"{where}: tokenizer.chat_template is not a valid Jinja template ({e})") from None


def _render(template: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
            names: Mapping[str, Any]) -> str:  # fmt: skip
    from jinja2 import TemplateError

    try:
        return str(
            template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **names)
        )
    except TemplateError as e:
        raise ValueError(f"the chat template failed on these messages ({e})") from None
