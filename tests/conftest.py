"""Shared fixtures: tiny random Qwen2 models generated once per session, in every on-disk form we load.

The tests run against the installed `novainfer` package (built by scripts/test), never the source tree's
`python/` folder, so they exercise the compiled extension exactly as users get it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tiny_qwen2 import write_tiny_gguf, write_tiny_model

def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m cuda`` alone, a test module without a CUDA test is not even imported.

    ``scripts/gpu-test run`` runs ``pytest -m cuda tests`` on a GPU machine that cannot fetch, whose image lacks
    the test-only packages other modules import at their top (jsonschema, pyzmq, playwright, ...). Collecting
    them would fail there before any GPU test ran; skipping them costs nothing, as none is selected.
    """
    if config.getoption("markexpr", "") != "cuda":
        return None
    if collection_path.is_dir():
        # The Web UI's own conftest would replace this one as the module `conftest` once collected, and the CUDA
        # tests that import a sibling test module (test_awq_gptq, test_fp8: `from conftest import PROMPT`) at
        # run time would then fail to import.
        return collection_path.name == "ui" or None
    if collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return "pytest.mark.cuda" not in collection_path.read_text(encoding="utf-8")


# Ordinary (non-special) token ids of the tiny vocabulary, as a fixed multi-token prompt.
PROMPT = [72, 101, 108, 108, 111, 32, 300, 301, 5, 260, 17, 99]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Name → path of each tiny-model variant (HF dirs and GGUF files of the same weights)."""
    root = tmp_path_factory.mktemp("tiny-models")
    f32 = write_tiny_model(root / "f32")
    return {
        "f32": f32,
        "bf16": write_tiny_model(root / "bf16", dtype="bf16"),
        "f16": write_tiny_model(root / "f16", dtype="f16"),
        "sharded": write_tiny_model(root / "sharded", sharded=True),
        "tied": write_tiny_model(root / "tied", tie_word_embeddings=True),
        "gguf": write_tiny_gguf(root / "tiny-f32.gguf", hf_dir=f32),
        "gguf_q8_0": write_tiny_gguf(root / "tiny-q8_0.gguf", hf_dir=f32, qtype="q8_0"),
    }


@pytest.fixture(scope="session")
def tiny_llm(tiny_models: dict[str, Path]):  # noqa: ANN201 - novainfer.LLM
    from novainfer import LLM

    return LLM(tiny_models["f32"])


def logits_of(llm, token_ids: list[int], *, step_by_step: bool = False) -> np.ndarray:
    """The engine's next-token logits at every position, as a (rows, vocab) array."""
    raw, rows, vocab = llm.prompt_logits(token_ids, step_by_step=step_by_step)
    return np.frombuffer(raw, dtype="<f4").reshape(rows, vocab)
