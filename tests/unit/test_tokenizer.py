"""engine.loader.tokenizer: the GGUF-built SmolLM2 tokenizer (checked against transformers),
chat templates, ByteTokenizer, and the torch-free import path the gateway relies on."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.loader import load_tokenizer, smollm2_gguf_path
from engine.loader.tokenizer import ByteTokenizer, render_default_chat

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Ids from transformers' own GGUF tokenizer (AutoTokenizer.from_pretrained(dir, gguf_file=...)).
FIXED = {
    "Hello world 12345": [19556, 905, 216, 33, 34, 35, 36, 37],
    "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2],
    "  spaces\t\ttabs\n\nnl": [216, 5600, 197, 197, 100, 7366, 198, 198, 14861],
    "héllo 你好 🤖": [88, 2756, 31394, 216, 18645, 250, 48392, 138, 15107, 114, 240],
}

VARIED = [
    "", " ", "a", "Hello, world!", "  leading and trailing  ", "tabs\tand\nnewlines\r\n",
    "3.14159 + 2,718 = 5.85959; 1000000 1e-9 0x1F", "year 2024, phone +1-555-0100",
    "Ünïcödé çàfé naïve résumé", "日本語のテキストと中文字符", "emoji 😀🎉👍🏽 and ZWJ 👨‍👩‍👧",
    "def f(x):\n    return [i**2 for i in range(x)]  # squares\n",
    "if (a && b || !c) { x->y = z[0]; }", "<|im_start|>system\nBe brief.<|im_end|>\n",
    "text<|endoftext|>more<file_sep>code", "<|im_start|> spaced <|im_end|>", "I'm we'll they've",
    "MIXED case WORDS AndCamelCase snake_case", "   \n\n\n   ", "русский текст", "α β γ ∑ ∫ √",
    "a" * 200, "http://example.com/path?q=1&b=2#frag", "<not_special> <|im_startx|>",
]

CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
]


@pytest.fixture(scope="module")
def smollm2_tok():
    return load_tokenizer("smollm2-135m")


def test_smollm2_tokenizer_attributes(smollm2_tok):
    assert smollm2_tok.bos_token_id == 1
    assert smollm2_tok.eos_token_ids == (2,)
    assert smollm2_tok.vocab_size == 49152
    assert smollm2_tok.has_chat_template
    assert smollm2_tok.convert_ids_to_tokens([1, 2, 905]) == ["<|im_start|>", "<|im_end|>",
                                                             "Ġworld"]


@pytest.mark.parametrize("text", sorted(FIXED))
def test_smollm2_fixed_vectors(smollm2_tok, text):
    ids = smollm2_tok.encode(text)
    assert ids == FIXED[text]
    assert smollm2_tok.encode(text, add_special_tokens=False) == ids  # add_bos_token is false
    assert smollm2_tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", VARIED)
def test_smollm2_decode_round_trip(smollm2_tok, text):
    assert smollm2_tok.decode(smollm2_tok.encode(text), skip_special_tokens=False) == text


def test_digits_are_single_tokens(smollm2_tok):
    toks = smollm2_tok.convert_ids_to_tokens(smollm2_tok.encode("x 9876543210"))
    assert toks[-10:] == list("9876543210")


def test_decode_skips_special_tokens(smollm2_tok):
    ids = smollm2_tok.encode("<|im_start|>assistant\nHi!<|im_end|>")
    assert smollm2_tok.decode(ids) == "assistant\nHi!"


def test_smollm2_chat_template(smollm2_tok):
    text = smollm2_tok.apply_chat_template(CHATS[0])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    no_prompt = smollm2_tok.apply_chat_template(CHATS[1], add_generation_prompt=False)
    assert no_prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert no_prompt.endswith("<|im_start|>user\nand 3+3?<|im_end|>\n")


def test_template_raise_exception_and_sandbox():
    from jinja2.exceptions import SecurityError, TemplateError
    from tokenizers import Tokenizer as Backend, models

    from engine.loader.tokenizer import Tokenizer

    def make(template):
        return Tokenizer(Backend(models.BPE()), bos_token_id=None, eos_token_ids=(),
                         chat_template=template)

    with pytest.raises(TemplateError, match="roles must alternate"):
        make("{{ raise_exception('roles must alternate') }}").apply_chat_template(CHATS[0])
    with pytest.raises(SecurityError):
        make("{{ messages.append(1) }}").apply_chat_template(CHATS[0])
    assert make("{{ messages | tojson }}").apply_chat_template(CHATS[0]) == \
        '[{"role": "user", "content": "hi"}]'


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo 🤖\n\x00"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[1:] == [b + 3 for b in text.encode("utf-8")]
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode([1, 2, 500, 72 + 3]) == "H"  # specials and out-of-range ids vanish
    assert tok.decode([1, 75], skip_special_tokens=False) == "<bos>H"
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), 259)
    assert not tok.has_chat_template
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|user|>\nhi\n<|assistant|>\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == \
        render_default_chat(msgs, False) == "<|user|>\nhi\n"
    assert load_tokenizer("dummy:tiny").encode("A") == [1, 68]


def test_tokenizer_path_never_imports_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import engine.loader.tokenizer\n"
        "from engine.loader import load_tokenizer, load_config\n"
        "tok = load_tokenizer('smollm2-135m')\n"
        "assert tok.encode('Hello world') == [19556, 905], tok.encode('Hello world')\n"
        "assert load_config('smollm2-135m').num_layers == 30\n"
        "assert load_tokenizer('dummy:tiny').encode('A') == [1, 68]\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2_tok):
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                        gguf_file=os.path.basename(path))
    for text in VARIED + sorted(FIXED):
        assert smollm2_tok.encode(text) == ref.encode(text), text
        ids = ref.encode(text)
        assert smollm2_tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    for chat in CHATS:
        for gen in (True, False):
            assert smollm2_tok.apply_chat_template(chat, add_generation_prompt=gen) == \
                ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
