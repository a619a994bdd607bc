"""Real demo models: the converted safetensors copy must behave exactly like the GGUF it came from.

Fetches into the normal cache (``$SAFE_ENGINE_CACHE`` or ~/.cache/safe-engine) once; later runs reuse it.
"""

from __future__ import annotations

import json

import pytest

from safe_engine.runtime import demo_models as dm

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

PROMPT = "The capital of France is"
TEXTS = [
    "Hello world",
    "  leading spaces and\ttabs\nnewline",
    "Unicode: café, naïve, Ærøskøbing, 日本語, Привет, 🙂🚀",
    "def f(x):\n    return x ** 2  # square",
    "12345 + 67890 = 80235",
]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def pair(request):
    """(name, converted model, converted tokenizer, GGUF model, GGUF tokenizer, converted dir)."""
    name = request.param
    out_dir = dm.model_dir(name, progress=False)
    gguf_path = dm.fetch(name, progress=False)
    auto_model, auto_tok = transformers.AutoModelForCausalLM, transformers.AutoTokenizer
    converted = auto_model.from_pretrained(str(out_dir)).eval()
    converted_tok = auto_tok.from_pretrained(str(out_dir))
    src, file = str(gguf_path.parent), gguf_path.name
    original = auto_model.from_pretrained(src, gguf_file=file, dtype=torch.float32).eval()
    original_tok = auto_tok.from_pretrained(src, gguf_file=file)
    yield name, converted, converted_tok, original, original_tok, out_dir
    del converted, original


def test_converted_dir_is_plain_safetensors(pair):
    name, converted, _, _, _, out_dir = pair
    spec = dm.DEMO_MODELS[name]
    assert any(out_dir.glob("*.safetensors"))
    assert not any(out_dir.glob("*.gguf")) and not any(out_dir.glob("*.bin"))
    assert getattr(converted.config, "quantization_config", None) is None
    assert next(converted.parameters()).dtype == torch.float32
    meta = json.loads((out_dir / "safe_engine.json").read_text())
    assert meta["source"] == name and meta["sha256"] == spec.sha256
    assert out_dir == dm.cache_root() / "gguf" / spec.sha256[:16]
    row = next(r for r in dm.list_models() if r["name"] == name)
    assert row["fetched"] and row["converted"] and row["path"] == out_dir


def test_logits_match_the_gguf_model(pair):
    _, converted, _, original, original_tok, _ = pair
    ids = torch.tensor([original_tok.encode(PROMPT)])
    with torch.inference_mode():
        got, want = converted(ids).logits, original(ids).logits
    assert got.shape == want.shape
    assert torch.equal(got, want) or (got - want).abs().max().item() < 1e-5


def test_tokenizers_agree(pair):
    _, _, converted_tok, _, original_tok, _ = pair
    for text in TEXTS:
        ids = original_tok.encode(text)
        assert converted_tok.encode(text) == ids, text
        assert converted_tok.decode(ids) == original_tok.decode(ids)
    assert converted_tok.eos_token_id == original_tok.eos_token_id
    assert converted_tok.bos_token_id == original_tok.bos_token_id
    assert len(converted_tok) == len(original_tok)


def test_chat_template_presence(pair):
    name, _, converted_tok, _, original_tok, _ = pair
    if name == "smollm2-135m":
        assert converted_tok.chat_template
        assert converted_tok.chat_template == original_tok.chat_template
        text = converted_tok.apply_chat_template(
            [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
        )
        assert "Hi" in text and "<|im_start|>" in text
    else:  # gemma-3-270m is the base model: its GGUF carries no template
        assert converted_tok.chat_template is None
        assert original_tok.chat_template is None


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_the_tokenizer_saved_alone_is_the_converted_dirs(name, tmp_path, monkeypatch):
    """A llama.cpp member reads the GGUF's tokenizer saved alone (tokenizer_dir: no float32 copy of the weights),
    which must be the tokenizer the conversion saves."""
    converted = transformers.AutoTokenizer.from_pretrained(str(dm.model_dir(name, progress=False)))
    gguf = dm.fetch(name, progress=False)
    monkeypatch.setenv("SAFE_ENGINE_CACHE", str(tmp_path / "cache"))  # an empty cache: no converted dir there
    directory = dm.tokenizer_dir(gguf)
    assert directory == tmp_path / "cache" / "tokenizers" / dm.DEMO_MODELS[name].sha256[:16]
    assert not (tmp_path / "cache" / "gguf").exists() and not any(directory.glob("*.safetensors"))
    alone = transformers.AutoTokenizer.from_pretrained(str(directory))
    for text in TEXTS:
        ids = converted.encode(text)
        assert alone.encode(text) == ids, text
        assert alone.decode(ids) == converted.decode(ids)
    assert (len(alone), alone.eos_token_id, alone.bos_token_id) == (
        len(converted),
        converted.eos_token_id,
        converted.bos_token_id,
    )
    assert alone.chat_template == converted.chat_template


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"])
def test_a_written_dir_loads_its_tokenizer_json_as_it_is(name):
    """The engine reads a directory it wrote with transformers' generic backend (`load_tokenizer`: the
    tokenizer.json in Rust, no Python parse kept), which must tokenize, decode and template exactly as the
    family's own class that AutoTokenizer picks (Qwen2Tokenizer, GemmaTokenizer, ...)."""
    directory = dm.tokenizer_dir(dm.fetch(name, progress=False), dm.DEMO_MODELS[name].sha256)
    assert dm.written_here(directory) and dm.written_here(f"{directory}/../{directory.name}/")
    assert not dm.written_here(directory.parent)
    own = transformers.AutoTokenizer.from_pretrained(str(directory))
    read = dm.load_tokenizer(directory)
    assert type(read) is transformers.TokenizersBackend
    for text in [*TEXTS, "<|im_end|><start_of_turn></s><s> specials as text", "", "\r\n\r\n  x"]:
        for special in (True, False):
            a = own(text, add_special_tokens=special, return_offsets_mapping=True)
            b = read(text, add_special_tokens=special, return_offsets_mapping=True)
            assert (b["input_ids"], b["offset_mapping"]) == (a["input_ids"], a["offset_mapping"]), (text, special)
        ids = own.encode(text)
        assert read.decode(ids) == own.decode(ids)
        assert read.convert_ids_to_tokens(ids) == own.convert_ids_to_tokens(ids)
    assert read.get_vocab() == own.get_vocab()
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids", "chat_template"):
        assert getattr(read, attr) == getattr(own, attr), attr
    if own.chat_template:
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
        assert read.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == own.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True
        )


def test_fetch_again_is_verified_and_cached():
    path = dm.fetch("smollm2-135m", progress=False)
    dm.verify_sha256(path, dm.DEMO_MODELS["smollm2-135m"].sha256)
    assert path.parent == dm.cache_root() / "demo" / "smollm2-135m"
    assert not any(path.parent.glob("*.whl")) and not any(path.parent.glob(".tmp-*"))


def test_convert_gguf_of_a_user_file_reuses_the_content_keyed_dir(tmp_path):
    """A copy of a demo GGUF elsewhere maps to the same converted dir (keyed by sha256, not path)."""
    spec = dm.DEMO_MODELS["smollm2-135m"]
    expected = dm.model_dir(spec.name, progress=False)
    copy = tmp_path / "renamed-model.gguf"
    copy.symlink_to(dm.fetch(spec.name, progress=False))
    assert dm.convert_gguf(copy, progress=False) == expected
