"""Text <-> token ids for GGUF models, matching llama.cpp's tokenizer.

Why: the engine loads models from GGUF files, whose tokenizer lives in metadata
(``tokenizer.ggml.*``), not in a Hugging Face ``tokenizer.json``. llama.cpp is the
reference implementation of that metadata, so this module follows its rules
(llama-vocab.cpp): which pre-tokenizer regexes a ``tokenizer.ggml.pre`` name means,
how special tokens are split out of the text before BPE, which ids end a turn, and
how ids turn back into bytes. The heavy lifting (BPE merges) runs in the Rust
``tokenizers`` library; this file only wires it up.

Supported ``tokenizer.ggml.model`` values:

* ``"gpt2"``: byte-level BPE (SmolLM, Llama 3, Qwen, ...) from tokens + merges, with
  the pre-tokenizer regexes llama.cpp picks for ``tokenizer.ggml.pre``.
* ``"llama"``: SentencePiece-style BPE (Llama 2, Mistral, TinyLlama, ...): "▁" for
  spaces, an optional space prefix, ``<0xXX>`` byte fallback, merges ranked by the
  token scores (the order llama.cpp's SPM tokenizer merges in).

Deliberate differences from llama.cpp: ``decode`` does not apply llama.cpp's
"clean spaces" pass (so ``decode(encode(t)) == t``), and the per-model lstrip/rstrip
token attributes (Phi-3, some embedding models) are not applied.

Public API: ``Tokenizer`` (encode/decode/chat template/end-of-turn ids) and
``StreamDecoder`` (incremental detokenizer that never splits a UTF-8 character).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Regex
from tokenizers import Tokenizer as _RustTokenizer
from tokenizers import models as _models
from tokenizers import pre_tokenizers as _pre

from .errors import LuceboxError, ModelNotFoundError, UnsupportedModelError

__all__ = ["Tokenizer", "StreamDecoder", "ChatTemplateError", "TokenType"]

log = logging.getLogger(__name__)


class ChatTemplateError(LuceboxError, ValueError):
    """The chat template rejected the messages (its ``raise_exception`` was called)."""


class TokenType:
    """GGUF ``tokenizer.ggml.token_type`` values (same numbering as llama.cpp / gguf-py)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Texts of tokens that end generation (llama.cpp's end-of-generation list, llama-vocab.cpp),
# and of the fill-in-the-middle pad/repo/file-separator tokens it also stops on.
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)
_FIM_EOG_TEXTS = (
    ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ("<|file_sep|>",),
)
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")

# ---------------------------------------------------------------------------------
# Pre-tokenizer regexes, by llama.cpp pre-tokenizer type. Each entry is a sequence of
# regexes applied one after the other; like llama.cpp's unicode_regex_split, every
# regex splits each piece into matches *and* the text between them.
_R_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_R_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_R_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
            r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_R_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
             r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_R_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
             r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_R_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS
            + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS
            + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_R_DEEPSEEK3_MAIN = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                     r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

_PRE_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _R_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_R_GPT2,),
    "smollm": (r"\p{N}", _R_GPT2),  # also starcoder, refact, command-r, ...
    "llama3": (_R_LLAMA3,),
    "qwen2": (_R_QWEN2,),
    "qwen35": (_R_QWEN35,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _R_GPT2, r"[0-9][0-9][0-9]"),
    "deepseek-llm": (  # (\u escapes: some of these letters would be NFC-normalised by editors)
        "[\r\n]",
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
        "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
        "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
        "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
        "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
        "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
        "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
        "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
        "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
        "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
        "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
        "\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        _CJK,
        r"\p{N}+",
    ),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
    "deepseek-v3": (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _R_DEEPSEEK3_MAIN),
    "poro": (r" ?[^(\s|.,!?…。，、।۔،)]+",),
    "viking": (r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"),
    "tekken": (_R_TEKKEN,),
    "gpt-4o": (_R_GPT4O,),
    "seed-coder": (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
                   r"|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "bailingmoe": (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",),
}

# tokenizer.ggml.pre name -> (regex set, default add_bos, ignore_merges), as llama-vocab.cpp maps them.
_PRE_NAMES: dict[str, tuple[str, bool, bool]] = {}
for _names, _spec in [
    (("default",), ("default", False, False)),
    (("gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
      "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais",
      "trillion", "granite-docling", "exaone4"), ("gpt2", False, False)),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
     ("smollm", False, False)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"), ("llama3", True, True)),
    (("dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), ("llama3", False, False)),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
      "grok-2"), ("qwen2", False, False)),
    (("qwen35",), ("qwen35", False, False)),
    (("falcon",), ("falcon", False, False)),
    (("deepseek-llm",), ("deepseek-llm", False, False)),
    (("deepseek-coder",), ("deepseek-coder", False, False)),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), ("deepseek-v3", False, False)),
    (("poro-chat", "bloom", "gpt3-finnish"), ("poro", False, False)),
    (("viking",), ("viking", False, False)),
    (("tekken",), ("tekken", True, True)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), ("gpt-4o", False, False)),
    (("seed-coder",), ("seed-coder", False, False)),
    (("bailingmoe", "bailingmoe2", "llada-moe"), ("bailingmoe", False, False)),
]:
    for _n in _names:
        _PRE_NAMES[_n] = _spec


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabs."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_ENCODER = _bytes_to_unicode()
_BYTE_DECODER = {c: b for b, c in _BYTE_ENCODER.items()}


def _plain(value: Any) -> Any:
    """Metadata value -> JSON-friendly Python (numpy scalars/arrays to int/float/list)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], (str, int, float, bool)):
            return list(value)  # already plain (gguf's contents() gives Python values)
        return [_plain(v) for v in value]
    return value


def _byte_token_value(text: str) -> int | None:
    """``"<0x0A>"`` -> 10; anything else -> None."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


class Tokenizer:
    """A GGUF model's tokenizer.

    Build it with :meth:`from_gguf_file` or :meth:`from_gguf_metadata`; save it with
    :meth:`to_metadata` (a JSON-serialisable dict that :meth:`from_gguf_metadata` reads back).
    """

    def __init__(self, meta: Mapping[str, Any]):
        meta = {k: _plain(v) for k, v in meta.items() if k.startswith("tokenizer.")}
        self._meta = meta
        model = meta.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(
                f"unsupported tokenizer type {model!r} (tokenizer.ggml.model); supported: 'gpt2' "
                "(byte-level BPE) and 'llama' (SentencePiece BPE)")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise UnsupportedModelError("model has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        self.model: str = model
        self._tokens: list[str] = list(tokens)
        n = len(self._tokens)
        types = [int(t) for t in (meta.get("tokenizer.ggml.token_type") or [])[:n]]
        self._types: list[int] = types + [TokenType.NORMAL] * (n - len(types))
        self._token_to_id: dict[str, int] = {}
        for i, t in enumerate(self._tokens):
            self._token_to_id.setdefault(t, i)

        def opt_id(key: str, default: int | None) -> int | None:
            v = meta.get(key, default)
            return int(v) if v is not None and 0 <= int(v) < n else None

        spm = model == "llama"
        self.bos_id: int | None = opt_id("tokenizer.ggml.bos_token_id", 1 if spm else None)
        self.eos_id: int | None = opt_id("tokenizer.ggml.eos_token_id", 2 if spm else None)
        self.unk_id: int | None = opt_id("tokenizer.ggml.unknown_token_id", 0 if spm else None)
        self.pad_id: int | None = opt_id("tokenizer.ggml.padding_token_id", None)

        if spm:
            self.pre = None
            regex_set, add_bos_default, ignore_merges = None, True, False
            self.add_space_prefix: bool = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        else:
            pre = meta.get("tokenizer.ggml.pre")
            if not pre:
                log.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer")
                pre = "default"
            if pre not in _PRE_NAMES:
                log.warning("unknown pre-tokenizer %r (tokenizer.ggml.pre); using the GPT-2 regex", pre)
                spec = ("gpt2", False, False)
            else:
                spec = _PRE_NAMES[pre]
            self.pre = pre
            regex_set, add_bos_default, ignore_merges = spec
            self.add_space_prefix = False
        self.add_bos: bool = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and self.bos_id is not None
        self.add_eos: bool = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and self.eos_id is not None

        self.eot_ids: frozenset[int] = frozenset(self._end_of_generation_ids(opt_id))

        # Tokens split out of raw text before BPE, longest first (llama.cpp's tokenizer_st_partition).
        special_types = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
        specials = [i for i in range(n) if self._types[i] in special_types and self._tokens[i]]
        specials.sort(key=lambda i: -len(self._tokens[i].encode("utf-8")))
        self._specials: list[tuple[str, int, bool]] = [
            (self._tokens[i], i, self._types[i] == TokenType.USER_DEFINED) for i in specials]

        self._pieces: list[bytes] = [self._piece_bytes(i) for i in range(n)]
        self._rust = self._build_spm(meta) if spm else self._build_bpe(meta, regex_set, ignore_merges)

    def _end_of_generation_ids(self, opt_id) -> set[int]:
        """Ids that end generation, chosen the way llama.cpp does; their tokens become CONTROL."""
        t2i, types = self._token_to_id, self._types
        found = lambda texts: next((t2i[t] for t in texts if t in t2i), None)  # noqa: E731
        eot = opt_id("tokenizer.ggml.eot_token_id", None)
        eot = eot if eot is not None else found(_EOT_TEXTS)
        eom = opt_id("tokenizer.ggml.eom_token_id", None)
        eom = eom if eom is not None else found(("<|eom_id|>",))
        eog = {i for i in (found(texts) for texts in _FIM_EOG_TEXTS) if i is not None}
        eog.update(t2i[t] for t in _EOG_TEXTS if t in t2i)
        for i in eog | {eot, eom} - {None}:
            if types[i] in (TokenType.NORMAL, TokenType.USER_DEFINED):
                types[i] = TokenType.CONTROL  # llama.cpp forces the CONTROL attribute on these
        eog.update(i for i in (self.eos_id, eot, eom) if i is not None)
        # gpt-oss / solar-open: "<|end|>" ends a message, not the generation
        if "<|end|>" in t2i and (("<|return|>" in t2i and "<|call|>" in t2i)
                                 or ("<|calls|>" in t2i and "<|flush|>" in t2i)):
            eog.discard(t2i["<|end|>"])
            types[t2i["<|end|>"]] = TokenType.USER_DEFINED
        # gemma4 / paddleocr: "</s>" is not an end token when "<|tool_response>" exists
        if "<|tool_response>" in t2i and "</s>" in t2i:
            eog.discard(t2i["</s>"])
        return eog

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """Build from a dict of GGUF metadata (keys like ``"tokenizer.ggml.tokens"``).

        Keys not starting with ``tokenizer.`` are ignored, so the whole metadata dict of a
        file, or the dict :meth:`to_metadata` returned, both work.
        """
        return cls(meta)

    @classmethod
    def from_gguf_file(cls, path: str | os.PathLike) -> "Tokenizer":
        """Read the ``tokenizer.*`` metadata of a GGUF file and build the tokenizer."""
        import gguf  # imported here: only needed when reading a .gguf

        if not os.path.isfile(path):
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        reader = gguf.GGUFReader(path)
        meta = {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}
        return cls(meta)

    def to_metadata(self) -> dict[str, Any]:
        """The ``tokenizer.*`` metadata this tokenizer was built from, JSON-serialisable."""
        return {k: v for k, v in self._meta.items() if k != "tokenizer.ggml.precompiled_charsmap"}

    def _build_bpe(self, meta: Mapping[str, Any], regex_set: str, ignore_merges: bool) -> _RustTokenizer:
        merges = []
        vocab = self._token_to_id
        for m in meta.get("tokenizer.ggml.merges") or []:
            pos = m.find(" ", 1)  # llama.cpp splits at the first space after position 0
            if pos < 0:
                continue
            a, b = m[:pos], m[pos + 1:]
            if a in vocab and b in vocab and a + b in vocab:
                merges.append((a, b))
        rust = _RustTokenizer(_models.BPE(vocab=dict(vocab), merges=merges, ignore_merges=ignore_merges))
        rust.pre_tokenizer = _pre.Sequence(
            [_pre.Split(Regex(r), behavior="isolated") for r in _PRE_REGEXES[regex_set]]
            + [_pre.ByteLevel(add_prefix_space=False, use_regex=False)])
        return rust

    def _build_spm(self, meta: Mapping[str, Any]) -> _RustTokenizer:
        # llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose concatenation is
        # the highest-scoring vocab token. As a BPE merge list: every split of every token into
        # two vocab tokens, ranked by the merged token's score (ties: lower id first).
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(self._tokens)
        vocab = self._token_to_id
        ranked = []
        for tid, tok in enumerate(self._tokens):
            if vocab.get(tok) != tid or len(tok) < 2:
                continue
            for k in range(1, len(tok)):
                a, b = tok[:k], tok[k:]
                if a in vocab and b in vocab:
                    ranked.append((-float(scores[tid]), tid, k, a, b))
        ranked.sort()
        unk = self._tokens[self.unk_id] if self.unk_id is not None else None
        model = _models.BPE(vocab=dict(vocab), merges=[(a, b) for *_, a, b in ranked],
                            unk_token=unk, byte_fallback=True, fuse_unk=False)
        return _RustTokenizer(model)  # no normalizer/pre-tokenizer: encode() escapes spaces itself

    def _piece_bytes(self, i: int) -> bytes:
        """Bytes a token stands for (special tokens: their text), as llama.cpp's token_to_piece."""
        text, ttype = self._tokens[i], self._types[i]
        if ttype in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
            return text.encode("utf-8")
        if ttype == TokenType.BYTE:
            b = _byte_token_value(text)
            if b is not None:
                return bytes([b])
        if ttype == TokenType.UNUSED:
            return b""
        if self.model == "llama":
            return text.replace("▁", " ").encode("utf-8")
        try:
            return bytes(_BYTE_DECODER[c] for c in text)
        except KeyError:  # not a byte-level token: keep its UTF-8
            return text.encode("utf-8")

    # -- vocabulary -----------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def chat_template(self) -> str | None:
        return self._meta.get("tokenizer.chat_template")

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of ``token_id`` (as stored, e.g. ``"Ġhello"``, ``"▁hello"``)."""
        return self._tokens[token_id]

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string, or None."""
        return self._token_to_id.get(token)

    def token_type(self, token_id: int) -> int:
        """GGUF token type of ``token_id`` (see :class:`TokenType`)."""
        return self._types[token_id]

    def is_special(self, token_id: int) -> bool:
        """True for control and unknown tokens (the ones ``skip_special`` drops)."""
        return self._types[token_id] in (TokenType.CONTROL, TokenType.UNKNOWN)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes ``token_id`` decodes to (may be part of a UTF-8 character)."""
        return self._pieces[token_id]

    # -- encode / decode ------------------------------------------------------------

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split special tokens out of ``text``: a list of raw text pieces and token ids."""
        frags: list[str | int] = [text] if text else []
        for s, tid, user_defined in self._specials:
            if not parse_special and not user_defined:
                continue  # like llama.cpp, user-defined tokens are matched even then
            if not any(isinstance(f, str) and s in f for f in frags):
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or s not in f:
                    out.append(f)
                    continue
                for j, part in enumerate(f.split(s)):
                    if j:
                        out.append(tid)
                    if part:
                        out.append(part)
            frags = out
        return frags

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        add_special: add BOS (and EOS) where the model asks for it (``tokenizer.ggml.add_bos_token``
            / ``add_eos_token``); SmolLM2 asks for neither.
        parse_special: turn the text of control tokens (``<|im_start|>``...) into their ids;
            when False they are tokenized as plain text (user-defined tokens still match, as in
            llama.cpp).
        """
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self.bos_id)
        frags = self._partition(text, parse_special)
        raw: list[str] = []
        prev_special = True
        for f in frags:
            if isinstance(f, int):
                prev_special = True
                continue
            if self.model == "llama":
                f = (" " + f if self.add_space_prefix and prev_special else f).replace(" ", "▁")
            raw.append(f)
            prev_special = False
        pieces = iter(raw)
        for f in frags:  # (encode, not encode_batch: no thread pool, so no fork warnings)
            ids.extend([f] if isinstance(f, int) else self._rust.encode(next(pieces), add_special_tokens=False).ids)
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``. Control tokens are rendered as their text unless ``skip_special``.

        Invalid UTF-8 (e.g. ids cut in the middle of a character) becomes U+FFFD.
        """
        out: list[bytes] = []
        for i in ids:
            piece = self._pieces[i]
            if piece and not (skip_special and self.is_special(i)):
                out.append(self._unprefixed(i, piece) if not out else piece)
        return b"".join(out).decode("utf-8", errors="replace")

    def _unprefixed(self, token_id: int, piece: bytes) -> bytes:
        """First piece of a decode: SPM models drop the space encode() put in front of the text."""
        if self.add_space_prefix and piece[:1] == b" " and self._types[token_id] == TokenType.NORMAL:
            return piece[1:]
        return piece

    # -- chat -----------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render ``messages`` ([{"role", "content"}, ...]) with the model's chat template.

        Renders like Hugging Face ``apply_chat_template(..., tokenize=False)``: sandboxed jinja2
        with trim_blocks/lstrip_blocks, ``raise_exception``, ``strftime_now``, ``bos_token`` and
        ``eos_token``. Extra keyword arguments become template variables. The result contains
        the special tokens as text; encode it with ``parse_special=True``.
        """
        template = self.chat_template
        if not template:
            raise UnsupportedModelError("this model has no chat template (tokenizer.chat_template); "
                                        "use a raw prompt instead")
        compiled = self.__dict__.get("_compiled_template")
        if compiled is None or compiled[0] != template:  # compile once (jinja2 parsing costs ~10 ms a call)
            compiled = (template, _jinja_env().from_string(template))
            self.__dict__["_compiled_template"] = compiled
        name = lambda i: self._tokens[i] if i is not None else ""  # noqa: E731
        variables = {
            "bos_token": name(self.bos_id), "eos_token": name(self.eos_id),
            "unk_token": name(self.unk_id), "pad_token": name(self.pad_id),
            **kwargs,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        return compiled[1].render(**variables)


_JINJA_ENV = None


def _jinja_env():
    global _JINJA_ENV
    if _JINJA_ENV is None:
        import jinja2.ext
        import jinja2.nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise ChatTemplateError(f"chat template error: {message}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        class GenerationTag(jinja2.ext.Extension):
            """HF's ``{% generation %}...{% endgeneration %}`` (marks assistant text): render the body."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        _JINJA_ENV = env
    return _JINJA_ENV


def _incomplete_tail(buf: bytes | bytearray) -> int:
    """Length of an unfinished UTF-8 character at the end of ``buf`` (0 if none)."""
    for k in range(1, min(4, len(buf)) + 1):
        b = buf[-k]
        if b & 0xC0 != 0x80:  # lead byte (or ASCII)
            need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
            return k if need > k else 0
    return 0


class StreamDecoder:
    """Incremental detokenizer: feed ids one at a time, get text as soon as it is whole.

    Works on bytes, so a character split across tokens (emoji, CJK in byte-level BPE, SPM
    byte fallback) is held back until its last byte arrives; ``flush()`` returns whatever is
    left (an unfinished character becomes U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._buf = bytearray()
        self._started = False  # anything emitted yet (SPM: strip the prefix space before that)

    def push(self, token_id: int) -> str:
        """Add one token id; return the text completed by it (maybe "")."""
        tok = self.tokenizer
        if self.skip_special and tok.is_special(token_id):
            return ""
        piece = tok.token_bytes(token_id)
        if not piece:
            return ""
        if not self._started:
            self._started = True
            piece = tok._unprefixed(token_id, piece)
        self._buf += piece
        cut = len(self._buf) - _incomplete_tail(self._buf)
        if cut <= 0:
            return ""
        text = self._buf[:cut].decode("utf-8", errors="replace")
        del self._buf[:cut]
        return text

    def flush(self) -> str:
        """Return the held-back bytes (decoded with replacement) and reset the buffer."""
        text = self._buf.decode("utf-8", errors="replace")
        self._buf.clear()
        return text
