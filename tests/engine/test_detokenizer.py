"""IncrementalDetokenizer against tokenizer.decode of the whole sequence, on tiny tokenizers trained
here (byte-level BPE that splits multi-byte characters across tokens; a SentencePiece-style Metaspace
one that drops the space of a text's first token); stop strings across token boundaries."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fuseformer.engine.detokenizer import IncrementalDetokenizer
from fuseformer.engine.sampling_params import SamplingParams

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "Café naïve façade — déjà vu. 日本語のテキスト 🙂🚀 ok",
    "The quick brown fox jumps over the lazy dog. STOP here please.",
] * 3

TEXTS = [
    "Hello world, the fox is quick.",
    "Say 🙂 déjà 日本語 and 🚀🚀 ok",
    " leading space, trailing space ",
    "é",
    "x",
]


@pytest.fixture(scope="module")
def byte_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def metaspace():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<eos>"]))
    return tok


def _stream(tok, prompt, ids, params, chunk=1):
    """Feed ids ``chunk`` at a time; returns the detokenizer, the streamed deltas and the stop string."""
    d = IncrementalDetokenizer(tok, prompt, params)
    deltas, stop = [], None
    for i in range(0, len(ids), chunk):
        stop = d.update(ids[i : i + chunk])
        if stop is not None:
            break
        deltas.append(d.get_next_output_text(finished=False))
    if stop is None:
        d.flush()
    deltas.append(d.get_next_output_text(finished=True))
    return d, deltas, stop


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt_text", ["", "A prompt: ", "日本"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_equals_full_decode_byte_level(byte_bpe, text, prompt_text, chunk):
    prompt = byte_bpe.encode(prompt_text).ids or [byte_bpe.token_to_id("<eos>")]
    ids = byte_bpe.encode(text).ids
    d, deltas, stop = _stream(byte_bpe, prompt, ids, SamplingParams(), chunk)
    assert stop is None and d.output_token_ids == ids
    assert d.output_text == "".join(deltas) == byte_bpe.decode(ids) == text
    # Characters split across tokens are held back, never streamed as U+FFFD.
    assert not any("\ufffd" in x for x in deltas)


def test_multibyte_really_split(byte_bpe):
    """The case above is only a test if some character spans several tokens."""
    ids = byte_bpe.encode("🙂").ids
    assert len(ids) > 1 and "\ufffd" in byte_bpe.decode(ids[:1])


def test_incomplete_character_flushed_at_end(byte_bpe):
    ids = byte_bpe.encode("ok 🙂").ids[:-1]  # ends inside the emoji
    d, deltas, _ = _stream(byte_bpe, [1], ids, SamplingParams())
    assert d.output_text == byte_bpe.decode(ids) and d.output_text.endswith("\ufffd")
    assert "".join(deltas) == d.output_text


@pytest.mark.parametrize("text", ["Hello world this is", "the lazy dog jumps", "over the"])
def test_spaces_with_metaspace(metaspace, text):
    """A SentencePiece-style decoder drops the first token's space; with the prompt as context the
    output still starts with its space: prompt text + output text == the whole decode."""
    prompt = metaspace.encode("Hello world").ids
    ids = metaspace.encode(text).ids
    d, deltas, _ = _stream(metaspace, prompt, ids, SamplingParams())
    whole = metaspace.decode(prompt + ids)
    assert metaspace.decode(prompt) + d.output_text == whole
    assert d.output_text.startswith(" ") and "".join(deltas) == d.output_text
    # Word pieces in the middle keep no spurious spaces ("wor" "l" "d" -> "world").
    assert d.output_text.strip() == metaspace.decode(ids)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 2])
def test_stop_string(byte_bpe, include, chunk):
    text = "The quick brown fox. STOP here please."
    ids = byte_bpe.encode(text).ids
    params = SamplingParams(stop=["never", "STOP"], include_stop_str_in_output=include)
    d, deltas, stop = _stream(byte_bpe, [1], ids, params, chunk)
    assert stop == "STOP" and d.finished and d.stop_string == "STOP"
    want = "The quick brown fox. STOP" if include else "The quick brown fox. "
    assert d.output_text == want and "".join(deltas) == want
    if not include:
        assert not any("S" in x for x in deltas)  # no prefix of the stop string was ever streamed


def test_stop_string_across_tokens(byte_bpe):
    """Characters fed one token each: the stop string only appears after several tokens."""
    ids = [byte_bpe.token_to_id(c) for c in "abXYZcd"]
    assert None not in ids
    d, deltas, stop = _stream(byte_bpe, [1], ids, SamplingParams(stop="XYZ"))
    assert stop == "XYZ" and d.output_text == "ab" and "".join(deltas) == "ab"
    assert d.output_token_ids == ids[:5]  # stopped at the token that completed it


def test_first_completed_stop_string_wins(byte_bpe):
    """Tokens are checked one by one, even when a step brings several: the stop string completed
    first wins ("de" at token "e", before "cdef" at "f"); of two completed by the same token, the
    one starting earlier ("bcd" over "cd")."""
    ids = [byte_bpe.token_to_id(c) for c in "abcdef"]
    d, _, stop = _stream(byte_bpe, [1], ids, SamplingParams(stop=["cdef", "de"]), chunk=6)
    assert stop == "de" and d.output_text == "abc" and d.output_token_ids == ids
    d, _, stop = _stream(byte_bpe, [1], ids, SamplingParams(stop=["cd", "bcd"]), chunk=6)
    assert stop == "bcd" and d.output_text == "a"


@pytest.mark.parametrize("skip", [True, False])
def test_eos_token_text(byte_bpe, skip):
    eos = byte_bpe.token_to_id("<eos>")
    ids = byte_bpe.encode("Hello world").ids + [eos]
    # Finished by EOS (stop_terminated): the EOS token is left out of the text.
    d = IncrementalDetokenizer(byte_bpe, [1], SamplingParams(skip_special_tokens=skip))
    assert d.update(ids, stop_terminated=True) is None
    assert d.output_text == "Hello world"
    # Kept with include_stop_str_in_output: visible only when special tokens are not skipped.
    params = SamplingParams(skip_special_tokens=skip, include_stop_str_in_output=True)
    d = IncrementalDetokenizer(byte_bpe, [1], params)
    d.update(ids, stop_terminated=True)
    assert d.output_text == ("Hello world" if skip else "Hello world<eos>")


@pytest.mark.parametrize("skip", [True, False])
def test_repeated_skipped_special_tokens_do_not_grow_the_window(byte_bpe, tmp_path, skip):
    """A request that keeps sampling EOS (``ignore_eos``; a finished grammar allows only EOS), between
    and after text: with the model's Tokenizer and ``skip_special_tokens`` the EOS tokens never enter
    the decoding window (whose two decodes a step would otherwise grow by a token a step); the text is
    the full decode's either way."""
    from fuseformer.models.tokenizer import Tokenizer as ModelTokenizer

    byte_bpe.save(str(tmp_path / "tokenizer.json"))
    tok = ModelTokenizer(tmp_path)
    eos = byte_bpe.token_to_id("<eos>")
    assert eos in tok.special_token_ids
    ids = byte_bpe.encode("Hello").ids + [eos] * 3 + byte_bpe.encode(" world 🙂").ids + [eos] * 200
    d = IncrementalDetokenizer(tok, [1], SamplingParams(skip_special_tokens=skip))
    widths = []
    for t in ids:
        d.update([t])
        widths.append(len(d._tokens) - d._prefix_offset)
    d.flush()
    assert d.output_text == byte_bpe.decode(ids, skip_special_tokens=skip)
    assert d.output_token_ids == ids
    if skip:
        assert max(widths) <= 6  # the window holds what a character or a word's space needs
