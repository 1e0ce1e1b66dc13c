"""Tokenizer tests against recorded references (no transformers/llama.cpp needed at test time).

* fixtures/tokenizer_hf_reference.json (made by fixtures/make_tokenizer_hf_fixture.py): Hugging
  Face (and llama.cpp, when recorded) ids for the embedded SmolLM2 GGUF, chat-template
  renderings, and a tiny SentencePiece model with the ids ``sentencepiece`` gives.
* fixtures/tokenizer_reference.json (when present): ids from llama.cpp (authoritative) and HF.
"""

import json
import logging
import os

import pytest

from lucebox_jax.errors import ModelNotFoundError, UnsupportedModelError
from lucebox_jax.tokenizer import _PRE_NAMES, ChatTemplateError, StreamDecoder, Tokenizer, TokenType

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
HF_REF = json.load(open(os.path.join(FIX, "tokenizer_hf_reference.json"), encoding="utf-8"))
LLAMACPP_REF_PATH = os.path.join(FIX, "tokenizer_reference.json")


def _gguf_path():
    from lucebox_jax.loader import default_model_path

    try:
        return default_model_path()
    except ModelNotFoundError:
        pytest.skip("embedded SmolLM2 GGUF not installed")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf_file(_gguf_path())


@pytest.fixture(scope="module")
def spm_tok():
    return Tokenizer.from_gguf_metadata(HF_REF["spm"]["metadata"])


HF_TEXTS = [t["text"] for t in HF_REF["texts"]]


# ------------------------------------------------------------------ SmolLM2 (byte-level BPE)

@pytest.mark.parametrize("i", range(len(HF_REF["texts"])), ids=lambda i: repr(HF_TEXTS[i])[:40])
def test_ids_match_hf(tok, i):
    case = HF_REF["texts"][i]
    assert tok.encode(case["text"]) == case["hf_ids"]


def _llamacpp_cases():
    cases = [c for c in HF_REF["texts"] if c.get("llamacpp_ids") is not None]
    if os.path.exists(LLAMACPP_REF_PATH):
        ref = json.load(open(LLAMACPP_REF_PATH, encoding="utf-8"))
        cases += [c for c in ref.get("texts", []) if c.get("llamacpp_ids") is not None]
    return cases


@pytest.mark.parametrize("case", _llamacpp_cases() or [None], ids=lambda c: repr(c["text"])[:40] if c else "absent")
def test_ids_match_llamacpp(tok, case):
    if case is None:
        pytest.skip("no llama.cpp ids recorded in the fixtures")
    assert tok.encode(case["text"]) == case["llamacpp_ids"]


@pytest.mark.parametrize("text", HF_TEXTS, ids=lambda t: repr(t)[:40])
def test_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, parse_special=False)) == text


def test_vocab_and_special_ids(tok):
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.id_to_token(1) == "<|im_start|>" and tok.token_to_id("<|im_end|>") == 2
    # <|endoftext|>, <|im_end|> (= eos), and <reponame>, which llama.cpp takes for a FIM "repo" token
    assert tok.eot_ids == {0, 2, 4}
    if HF_REF.get("llamacpp_eog_ids") is not None:
        assert tok.eot_ids == set(HF_REF["llamacpp_eog_ids"])
    assert not tok.add_bos  # tokenizer.ggml.add_bos_token = False
    assert tok.encode("") == []
    assert tok.encode("Hello")[0] != tok.bos_id
    assert tok.token_bytes(tok.token_to_id("Ġworld")) == b" world"
    assert tok.token_bytes(2) == b"<|im_end|>"


def test_special_tokens(tok):
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-1] == 2
    plain = tok.encode(text, parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert tok.decode(plain) == text
    assert tok.decode(ids, skip_special=True) == "user\nhi"
    assert tok.encode("<|endoftext|><|endoftext|>") == [0, 0]


def test_metadata_roundtrip(tok):
    meta = json.loads(json.dumps(tok.to_metadata()))
    again = Tokenizer.from_gguf_metadata(meta)
    assert again.to_metadata() == meta
    for text in HF_TEXTS[::3]:
        assert again.encode(text) == tok.encode(text)
    assert again.eot_ids == tok.eot_ids and again.chat_template == tok.chat_template


STREAM_TEXT = "Emoji 🤖🚀👍🏽 then 中文测试，日本語 and 👨‍👩‍👧 done. Ünïcödé ✓"


def _stream(t, ids, **kw):
    dec = StreamDecoder(t, **kw)
    chunks = [dec.push(i) for i in ids]
    return chunks, dec.flush()


def test_stream_decoder(tok):
    ids = tok.encode(STREAM_TEXT)
    # byte-level BPE really does split these characters across tokens
    assert any(tok.token_bytes(i).decode("utf-8", errors="replace") != tok.token_bytes(i).decode("utf-8", "ignore")
               for i in ids)
    chunks, rest = _stream(tok, ids)
    assert rest == ""
    assert "".join(chunks) == STREAM_TEXT
    assert all("\ufffd" not in c for c in chunks)
    assert "" in chunks  # something was held back until its character was complete


def test_stream_decoder_flush_partial(tok):
    ids = tok.encode("🤖")
    assert len(ids) > 1
    chunks, rest = _stream(tok, ids[:-1])
    assert "".join(chunks) == "" and rest == "\ufffd"


def test_stream_decoder_skip_special(tok):
    ids = tok.encode("<|im_start|>assistant\nHi 🤖<|im_end|>")
    chunks, rest = _stream(tok, ids, skip_special=True)
    assert "".join(chunks) + rest == "assistant\nHi 🤖"


@pytest.mark.parametrize("case", HF_REF["chat"], ids=lambda c: str(len(c["messages"])))
def test_chat_template_matches_hf(tok, case):
    got = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert got == case["rendered"]


def test_chat_template_errors(tok):
    meta = dict(tok.to_metadata())
    meta["tokenizer.chat_template"] = "{% if messages|length == 0 %}{{ raise_exception('need a message') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="need a message"):
        Tokenizer.from_gguf_metadata(meta).apply_chat_template([])
    meta["tokenizer.chat_template"] = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                                       "{{ m.content }}{% endgeneration %}{% else %}{{ m.content | tojson }}{% endif %}"
                                       "{% endfor %}{{ bos_token }}")
    msgs = [{"role": "user", "content": "é"}, {"role": "assistant", "content": "ok"}]
    assert Tokenizer.from_gguf_metadata(meta).apply_chat_template(msgs) == '"é"ok<|im_start|>'
    del meta["tokenizer.chat_template"]
    with pytest.raises(UnsupportedModelError, match="chat template"):
        Tokenizer.from_gguf_metadata(meta).apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_inputs():
    with pytest.raises(ModelNotFoundError):
        Tokenizer.from_gguf_file("/nonexistent/model.gguf")
    with pytest.raises(UnsupportedModelError, match="tokenizer type"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})


# ------------------------------------------------------------------ pre-tokenizer choice (synthetic vocab)

def _byte_level_meta(pre, extra_tokens=(), merges=()):
    from lucebox_jax.tokenizer import _BYTE_ENCODER

    tokens = [_BYTE_ENCODER[b] for b in range(256)] + list(extra_tokens)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * len(tokens), "tokenizer.ggml.merges": list(merges)}


def _digit_pieces(pre, text="x 1234567"):
    meta = _byte_level_meta(pre, ["Ġ1", "Ġ12", "Ġ123", "12", "123", "45", "456", "4567"],
                            ["Ġ 1", "Ġ1 2", "Ġ12 3", "1 2", "12 3", "4 5", "45 6", "456 7"])
    t = Tokenizer.from_gguf_metadata(meta)
    return [t.id_to_token(i) for i in t.encode(text)]


def test_pre_tokenizer_regex_by_name(caplog):
    # gpt2: " 1234567" is one word; smollm: digits one by one; llama3: groups of at most 3
    assert _digit_pieces("gpt-2") == ["x", "Ġ123", "4567"]
    assert _digit_pieces("smollm") == ["x", "Ġ", "1", "2", "3", "4", "5", "6", "7"]
    assert _digit_pieces("llama-bpe") == ["x", "Ġ", "123", "456", "7"]
    assert _digit_pieces("qwen2") == ["x", "Ġ", "1", "2", "3", "4", "5", "6", "7"]
    with caplog.at_level(logging.WARNING, logger="lucebox_jax.tokenizer"):
        assert _digit_pieces("no-such-pre") == _digit_pieces("gpt-2")
    assert "no-such-pre" in caplog.text


@pytest.mark.parametrize("pre", sorted(_PRE_NAMES))
def test_every_pre_tokenizer_builds(pre):
    t = Tokenizer.from_gguf_metadata(_byte_level_meta(pre))
    text = "Hello world's 12345 中文 Ωμέγα ﾃｽﾄ\n\n  x\t\ty 🤖 éà ǅ"
    assert t.decode(t.encode(text)) == text


def test_llama3_ignore_merges_and_bos():
    # llama3 looks a whole word up in the vocab before merging ("1234567" has no merge path here)
    meta = _byte_level_meta("llama-bpe", ["ab", "abc"], ["a b"])
    meta["tokenizer.ggml.bos_token_id"] = 97  # any id will do
    t = Tokenizer.from_gguf_metadata(meta)
    assert t.add_bos  # llama.cpp's default for llama3 when add_bos_token is absent
    assert [t.id_to_token(i) for i in t.encode("abc", add_special=False)] == ["abc"]
    assert t.encode("abc")[0] == 97
    plain = Tokenizer.from_gguf_metadata(_byte_level_meta("gpt-2", ["ab", "abc"], ["a b"]))
    assert [plain.id_to_token(i) for i in plain.encode("abc")] == ["ab", "c"]


# ------------------------------------------------------------------ SentencePiece-style ("llama")

@pytest.mark.parametrize("case", HF_REF["spm"]["texts"], ids=lambda c: repr(c["text"])[:40])
def test_spm_matches_sentencepiece(spm_tok, case):
    assert spm_tok.encode(case["text"], add_special=False) == case["sp_ids"]
    ids = spm_tok.encode(case["text"])
    assert ids == [spm_tok.bos_id] + case["sp_ids"]  # add_bos_token True
    assert spm_tok.decode(ids, skip_special=True) == case["text"]
    assert spm_tok.decode(case["sp_ids"]) == case["text"]


@pytest.mark.parametrize("case", HF_REF["spm"].get("llamacpp_texts") or [None],
                         ids=lambda c: repr(c["text"])[:40] if c else "absent")
def test_spm_matches_llamacpp(spm_tok, case):
    if case is None:
        pytest.skip("no llama.cpp ids recorded for the SPM vocab")
    assert spm_tok.encode(case["text"]) == case["llamacpp_ids"]


def test_spm_byte_fallback_and_stream(spm_tok):
    text = "unseen 中文 🤖!"
    ids = spm_tok.encode(text, add_special=False)
    byte_ids = [i for i in ids if spm_tok.token_type(i) == TokenType.BYTE]
    assert len(byte_ids) == len("中文🤖".encode())
    assert spm_tok.id_to_token(byte_ids[0]) == "<0xE4>"
    chunks, rest = _stream(spm_tok, ids)
    assert "".join(chunks) + rest == text and all("\ufffd" not in c for c in chunks)


def test_spm_special_tokens(spm_tok):
    # like llama.cpp: control tokens are split out and the text after one gets a space prefix
    ids = spm_tok.encode("hello</s>world", add_special=False)
    eos = ids.index(spm_tok.eos_id)
    assert ids[:eos] == spm_tok.encode("hello", add_special=False)
    assert ids[eos + 1:] == spm_tok.encode("world", add_special=False)
    assert spm_tok.eos_id not in spm_tok.encode("hello</s>world", parse_special=False)
    assert spm_tok.eot_ids == {spm_tok.eos_id}


def test_spm_metadata_roundtrip(spm_tok):
    again = Tokenizer.from_gguf_metadata(json.loads(json.dumps(spm_tok.to_metadata())))
    for case in HF_REF["spm"]["texts"]:
        assert again.encode(case["text"]) == spm_tok.encode(case["text"])
