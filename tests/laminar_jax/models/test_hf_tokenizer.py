"""Our tokenizer loader against transformers' AutoTokenizer on the same folder."""
import json
import os

import pytest

from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.tokenizer import check_vocab, load_tokenizer
from tests.laminar_jax.models.hf_fixtures import make_hf_tokenizer

TEXTS = ["What is 2+3? The answer is 5.", "  leading spaces and ünïcödé → ok\n\nnew lines",
         "<|im_start|>user\nhi<|im_end|>", ""]
MESSAGES = [{"role": "system", "content": "Think step by step."},
            {"role": "user", "content": "What is 12*7?"}]

# A template in the old place (tokenizer_config.json), using the features transformers enables.
LEGACY_TEMPLATE = (
    "{%- for m in messages %}\n"
    "  {%- if m['role'] == 'system' %}{{ bos_token if bos_token else '' }}{{ m['content'] | tojson }}\n"
    "  {%- else %}{{ '<|im_start|>' ~ m['role'] ~ '\\n' ~ m['content'] ~ eos_token }}{% endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = make_hf_tokenizer(str(tmp_path_factory.mktemp("tok")))
    return folder, AutoTokenizer.from_pretrained(folder)


def test_encode_decode_match_transformers(folders):
    folder, reference = folders
    tok = load_tokenizer(folder)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text), text
        assert tok.decode(ids) == reference.decode(ids), text
        assert tok.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert tok.encode_batch(TEXTS) == [reference.encode(t) for t in TEXTS]
    assert (tok.eos_token, tok.eos_token_id) == (reference.eos_token, reference.eos_token_id)
    assert (tok.pad_token, tok.pad_token_id) == (reference.pad_token, reference.pad_token_id)
    assert len(tok) == len(reference)


def test_chat_template_renders_like_transformers(folders):
    folder, reference = folders
    tok = load_tokenizer(folder)
    assert os.path.exists(os.path.join(folder, "chat_template.jinja"))
    for gen in (True, False):
        expect = reference.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen) == expect
    ids = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.apply_chat_template(MESSAGES, tokenize=True) == list(ids)


def test_legacy_template_in_tokenizer_config(folders, tmp_path):
    from transformers import AutoTokenizer

    folder, _ = folders
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(open(os.path.join(folder, name), "rb").read())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(chat_template=LEGACY_TEMPLATE, bos_token="<|endoftext|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    expect = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert '"Think step by step."' in expect
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True) == expect
    assert tok.stop_token_ids == (tok.eos_token_id, 0)


def test_errors(folders, tmp_path):
    folder, _ = folders
    tok = load_tokenizer(folder)
    check_vocab(tok, DecoderConfig.preset("tiny"))
    with pytest.raises(ValueError, match=f"tokenizer {folder}.*vocab_size=300"):
        check_vocab(tok, DecoderConfig.preset("tiny", vocab_size=300), model_source="config.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_bytes(open(os.path.join(folder, "tokenizer.json"), "rb").read())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match="eos_token '<\\|nope\\|>'"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(str(tmp_path)).apply_chat_template(MESSAGES)
