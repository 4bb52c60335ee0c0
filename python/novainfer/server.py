"""`novainfer serve` / `novainfer-server`: the Rust OpenAI-compatible server, run in this process.

Python only makes sure every demo model named by ``--model`` is fetched and cached (the Rust server finds
demo models in that cache by name), then hands the unchanged argument list to ``_native.serve``, which
parses it with the same options as the standalone ``novainfer-server`` binary and serves with the GIL
released until SIGINT or SIGTERM. ``python -m novainfer.server ARGS`` does the same.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import NovaInferError

__all__ = ["serve", "main", "DEFAULT_MODEL"]

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


def _model_specs(argv: Sequence[str]) -> list[str]:
    """The values of every ``--model``/``-m`` option (the default model if there is none)."""
    specs = []
    it = iter(argv)
    for arg in it:
        if arg in ("--model", "-m"):
            value = next(it, None)
            if value is not None:
                specs.append(value)
        elif arg.startswith("--model="):
            specs.append(arg.split("=", 1)[1])
        elif arg.startswith("-m") and len(arg) > 2:
            specs.append(arg[2:].lstrip("="))
    return specs or [DEFAULT_MODEL]


def serve(argv: Sequence[str]) -> None:
    """Serve with `novainfer-server` arguments until interrupted; fetches demo models first."""
    argv = list(argv)
    if not any(a in ("-h", "--help", "-V", "--version") for a in argv):
        from .fetch import DEMO_MODELS, fetch_model

        for spec in _model_specs(argv):
            if spec in DEMO_MODELS and not Path(spec).exists():
                fetch_model(spec)
    from . import _native
    from .cuda_libs import find_cuda_libraries

    find_cuda_libraries()
    _native.serve(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `novainfer-server` script."""
    try:
        serve(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        # The Rust server already shut down on this SIGINT; Python's own handler saw it too and
        # raises once the call returns.
        return 0
    except NovaInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if getattr(e, "param", None) == "argv" else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
