"""The model's tokenizer and chat template, read from GGUF metadata or a Hugging Face directory.

`ChatTokenizer` is what the server and engine see: text <-> token ids, the
chat template rendered the way Hugging Face renders it, and the ids that end a
turn. Two sources build it:

* a GGUF file: a byte-level BPE rebuilt from `tokenizer.ggml.*` metadata. The
  pre-tokenizer follows what llama.cpp does for the file's `tokenizer.ggml.pre`
  value, because llama.cpp is the reference for GGUF files (transformers'
  GGUF converter ignores `pre` and always uses the plain GPT-2 split);
* a Hugging Face directory: `tokenizer.json` as is, plus `tokenizer_config.json`,
  `chat_template.jinja` and `generation_config.json`.

Encoding never adds special tokens except a BOS when the model asks for one;
special-token text inside the input ("<|im_start|>") encodes as the single
special id, as in transformers, because rendered chat text relies on that.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import cache, partial
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from gguf import GGUFReader
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from kvtierd.model.errors import ChatTemplateError, ModelLoadError, UnsupportedModelError

logger = logging.getLogger(__name__)

# llama.cpp token types (`tokenizer.ggml.token_type`).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Texts of end-of-turn tokens. One of these ends generation when it is a token
# of the model and the chat template writes it (SmolLM2's "<|im_end|>").
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>")

# Split regexes of the Llama 3 and Qwen2 families (their tokenizer.json and llama.cpp agree).
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_split() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's regex list for these: "\p{N}" first (every digit alone), then GPT-2's.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _regex_split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# `tokenizer.ggml.pre` -> pre-tokenizer, after llama.cpp's table (llama-vocab.cpp).
GGUF_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2_split,
    "gpt2": _gpt2_split,
    "gpt-2": _gpt2_split,
    "smollm": _digits_then_gpt2_split,
    "starcoder": _digits_then_gpt2_split,
    "llama-bpe": partial(_regex_split, _LLAMA3_SPLIT),
    "qwen2": partial(_regex_split, _QWEN2_SPLIT),
}

_warned_pre: set[str] = set()


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    make = GGUF_PRE_TOKENIZERS.get(pre)
    if make is None:
        if pre not in _warned_pre:
            _warned_pre.add(pre)
            logger.warning("GGUF pre-tokenizer %r is not known; using the GPT-2 split (ids may differ from llama.cpp)", pre)
        make = _gpt2_split
    return make()


class ChatTokenizer:
    """Text <-> token ids and the chat template of one model.

    `eos_token_ids` holds every id that ends generation: the model's eos, the
    GGUF eot/eom ids or generation_config's eos list, and the end-of-turn
    marker its chat template writes. `special_token_ids` are left out of decoded text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
    ) -> None:
        """`eos_token_ids`: the model's eos first, then any other ids that end generation."""
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.add_bos = add_bos
        added = tokenizer.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        ends = set(eos_token_ids)
        for marker in END_OF_TURN_MARKERS:
            marker_id = tokenizer.token_to_id(marker)
            if marker_id is not None and chat_template is not None and marker in chat_template:
                ends.add(marker_id)
        self.eos_token_ids: frozenset[int] = frozenset(ends)
        self._template: jinja2.Template | None = None

    # -- loading -----------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path, *, reader: GGUFReader | None = None) -> ChatTokenizer:
        """Builds the tokenizer from a GGUF file's metadata; pass `reader` to reuse an open `GGUFReader`."""
        if reader is None:
            reader = GGUFReader(str(path))

        def field(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        kind = field("tokenizer.ggml.model")
        if kind is None:
            raise ModelLoadError(f"{path}: GGUF metadata has no tokenizer (no 'tokenizer.ggml.model')")
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"{path}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        tokens: list[str] = field("tokenizer.ggml.tokens") or []
        if not tokens:
            raise ModelLoadError(f"{path}: GGUF metadata has no 'tokenizer.ggml.tokens'")
        types: list[int] = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges: list[str] = field("tokenizer.ggml.merges") or []

        vocab: dict[str, int] = {}
        for i, token in enumerate(tokens):
            vocab.setdefault(token, i)
        if len(vocab) != len(tokens):
            logger.warning("%s: %d duplicate token texts in the GGUF vocabulary", path, len(tokens) - len(vocab))
        # A merge is "left right"; llama.cpp splits at the first space after the first character.
        pairs = []
        for merge in merges:
            cut = merge.find(" ", 1)
            if cut < 0:
                raise ModelLoadError(f"{path}: malformed GGUF merge {merge!r} (expected 'left right')")
            pairs.append((merge[:cut], merge[cut + 1 :]))
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        tokenizer.pre_tokenizer = _gguf_pre_tokenizer(field("tokenizer.ggml.pre", "default"))
        tokenizer.decoder = decoders.ByteLevel()

        # Control and user-defined tokens are matched whole in the input text; they keep
        # the id their text has in the vocabulary. Only control tokens are special.
        control = [t for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL]
        user = [t for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED]
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

        eos_ids = [
            int(i)
            for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if (i := field(key)) is not None
        ]
        bos = field("tokenizer.ggml.bos_token_id")
        return cls(
            tokenizer,
            chat_template=field("tokenizer.chat_template"),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            add_bos=bool(field("tokenizer.ggml.add_bos_token", False)),
        )

    def state(self) -> dict[str, Any]:
        """What `from_state` needs to build this tokenizer again (JSON-serializable)."""
        return {"tokenizer": self._tokenizer.to_str(), "chat_template": self.chat_template,
                "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "eos_token_ids": sorted(self.eos_token_ids), "add_bos": self.add_bos}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ChatTokenizer:
        eos = state["eos_token_id"]
        ends = ([] if eos is None else [eos]) + [i for i in state["eos_token_ids"] if i != eos]
        tokenizer = cls(Tokenizer.from_str(state["tokenizer"]), chat_template=state["chat_template"],
                        bos_token_id=state["bos_token_id"], eos_token_ids=ends, add_bos=state["add_bos"])
        tokenizer.eos_token_id = eos  # the model's own eos (maybe none): the first of `ends` only when there is one
        return tokenizer

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ChatTokenizer:
        """Loads `tokenizer.json` and the chat template and special tokens around it."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{path}: no tokenizer.json (kvtierd needs the fast-tokenizer file)")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        template_file = path / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        template = template or _pick_template(config.get("chat_template"))

        def token_id(value: Any) -> int | None:
            text = value.get("content") if isinstance(value, Mapping) else value
            return tokenizer.token_to_id(text) if isinstance(text, str) else None

        bos = token_id(config.get("bos_token"))
        eos_ids = [i for i in [token_id(config.get("eos_token"))] if i is not None]
        gen_eos = generation.get("eos_token_id")
        eos_ids += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        # The BOS rule lives in tokenizer.json's post-processor: see whether it adds one.
        with_specials = tokenizer.encode("", add_special_tokens=True).ids
        return cls(
            tokenizer,
            chat_template=template,
            bos_token_id=bos,
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            add_bos=bos is not None and with_specials[:1] == [bos],
        )

    # -- tokens ------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with a BOS in front only when the model adds one."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat --------------------------------------------------------------

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, as transformers' `apply_chat_template(tokenize=False)`."""
        template = self._compiled_template()
        try:
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.bos_token_id),
                eos_token=self._token_text(self.eos_token_id),
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat; a BOS is added only if the model wants one and the template has none."""
        ids = self._tokenizer.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            return [self.bos_token_id, *ids]
        return ids

    def _token_text(self, token_id: int | None) -> str:
        text = None if token_id is None else self._tokenizer.id_to_token(token_id)
        return text or ""

    def _compiled_template(self) -> jinja2.Template:
        if self._template is None:
            if not self.chat_template:
                raise ChatTemplateError(
                    "this model has no chat template; use /v1/completions with a raw prompt, "
                    "or load a model whose metadata carries one"
                )
            try:
                self._template = _template_env().from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as exc:
                raise ChatTemplateError(f"the model's chat template does not parse: {exc}") from exc
        return self._template


# -- helpers -----------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not readable JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


def _pick_template(value: Any) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"}: take "default"."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default")
    return None


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@cache
def _template_env() -> ImmutableSandboxedEnvironment:
    # The environment transformers renders chat templates in: sandboxed, with
    # trim_blocks/lstrip_blocks, loop controls, and these helpers.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
