"""The hf tokenizer on tiny tokenizers trained here and saved with save_pretrained:
a byte-level BPE (GPT-2 style) and a SentencePiece-style BPE with byte fallback (Llama 2
style), each against transformers' own AutoTokenizer on the same directory."""

import json

import pytest

from pyagent_framework import registries
from pyagent_framework.chat_templates import render_chat_template
from pyagent_framework.testing.tokenizer import TokenizerContract

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "def add(a, b):\n    return a + b\n",
    "Continuous batching lets new requests join a running batch at any step.",
    "Tokenizers split text into pieces; the model sees only their ids.",
] * 10

TEXTS = [
    "The quick brown fox.",
    "unseen words: xylophone quizzical",
    "héllo wörld — naïve café",
    "emoji 🦜🚀 and 中文 and 한국어",
    "  two leading spaces and\ttab\nnewline",
    "def f(x):\n    return x ** 2\n",
    "<s> looks special </s> and <|eot|> is added",
    "numbers 0123456789 and symbols !@#$%^&*()",
    "a" * 50,
    "",
]

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eot|>{% endfor %}"


def _save(tmp_path, name, backend, **special):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(tmp_path / name))
    return tmp_path / name


@pytest.fixture(scope="module")
def byte_level_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path = _save(tmp_path_factory.mktemp("tok"), "byte_level", backend, bos_token="<s>", eos_token="</s>")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2], "bos_token_id": 0}))
    return path


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    # Train the merges on ASCII text, then build the Llama-2 layout: <unk> <s> </s>, the
    # 256 byte-fallback pieces <0x00>..<0xFF>, then the learnt pieces.
    trainer_backend = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    trainer_backend.train_from_iterator(CORPUS, trainer)
    learnt = json.loads(trainer_backend.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in sorted(learnt["vocab"], key=learnt["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learnt["merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    from tokenizers import AddedToken

    backend.add_special_tokens([AddedToken("<unk>"), AddedToken("<s>"), AddedToken("</s>"), AddedToken("<|eot|>")])
    return _save(
        tmp_path_factory.mktemp("tok"), "sentencepiece", backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _pair(path):
    from transformers import AutoTokenizer

    ours = registries.tokenizers.load("hf").from_pretrained(str(path))
    ref = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return ours, ref


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_encode_decode_match_transformers(kind, byte_level_dir, sentencepiece_dir):
    ours, ref = _pair(byte_level_dir if kind == "byte_level" else sentencepiece_dir)
    assert ours.vocab_size == len(ref)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
        with_bos = ours.encode(text)
        assert with_bos[0] == ours.bos_token_id  # the post-processor adds <s>


def test_byte_level_token_bytes(byte_level_dir):
    ours, ref = _pair(byte_level_dir)
    for text in TEXTS:
        if "<" in text:
            continue
        ids = ours.encode(text, add_special_tokens=False)
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode("utf-8"), text
    assert ours.token_bytes(0) == b"<s>" and ours.token_bytes(2) == b"<|eot|>"
    # Every single byte is a token of its own in a byte-level vocabulary.
    single = {ours.token_bytes(i) for i in range(ours.vocab_size) if len(ours.token_bytes(i)) == 1}
    assert single == {bytes([b]) for b in range(256)}


def test_byte_level_special_ids_and_template(byte_level_dir):
    ours, _ = _pair(byte_level_dir)
    assert ours.bos_token_id == 0
    assert ours.eos_token_ids == frozenset({1, 2})  # tokenizer eos + generation_config.json
    assert (ours.bos_token, ours.eos_token) == ("<s>", "</s>")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert render_chat_template(ours.chat_template, messages) == "<|user|>hi<|eot|><|assistant|>yo<|eot|>"
    # A file inside a checkpoint directory (as for a weights file) stands for its directory.
    again = registries.tokenizers.load("hf").from_pretrained(str(byte_level_dir / "tokenizer.json"))
    assert again.encode("The fox") == ours.encode("The fox") and again.eos_token_ids == ours.eos_token_ids


def test_sentencepiece_token_bytes_with_byte_fallback(sentencepiece_dir):
    ours, ref = _pair(sentencepiece_dir)
    assert ours.token_bytes(3 + 0x0A) == b"\n" and ours.token_bytes(3 + 0xF0) == b"\xf0"
    used_fallback = False
    for text in TEXTS:
        if "<" in text or not text:
            continue
        ids = ours.encode(text, add_special_tokens=False)
        pieces = ref.convert_ids_to_tokens(ids)
        used_fallback |= any(p.startswith("<0x") for p in pieces)
        # The "▁" the normalizer puts before the text is a real leading space of the first piece.
        assert b"".join(ours.token_bytes(i) for i in ids) == (" " + text).encode("utf-8"), text
    assert used_fallback  # emoji, CJK and accents are outside the learnt pieces
    assert ours.token_bytes(1) == b"<s>" and ours.token_bytes(0) == b"<unk>"
    assert ours.eos_token_ids == frozenset({2})  # no generation_config.json


def test_bad_paths_raise_value_error_naming_the_path(tmp_path, smollm2_path):
    cls = registries.tokenizers.load("hf")
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match="nowhere"):
        cls.from_pretrained(str(missing))
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty_dir"):
        cls.from_pretrained(str(empty))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf"):
        cls.from_pretrained(str(junk))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{ this is not json")
    with pytest.raises(ValueError, match="broken"):
        cls.from_pretrained(str(broken))


class TestByteLevelContract(TokenizerContract):
    """The framework's tokenizer kit on the byte-level BPE."""

    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls, byte_level_dir):
        return registries.tokenizers.load("hf").from_pretrained(str(byte_level_dir))


class TestSentencePieceContract(TokenizerContract):
    """The framework's tokenizer kit on the SentencePiece-style BPE with byte fallback
    (whose normalizer puts "▁", a space, in front of the text)."""

    token_bytes_prefix = b" "

    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls, sentencepiece_dir):
        return registries.tokenizers.load("hf").from_pretrained(str(sentencepiece_dir))
