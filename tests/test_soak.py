"""`novainfer bench soak`, short: streaming clients with random aborts, disconnects and bad requests against the
tiny model for a few seconds, then no leaked KV block and nothing running (issue 14, point 7). The long run
(10 minutes, 64 streams, the 0.5B demo model) is in docs/benchmarks.md.
"""

from __future__ import annotations

import re
import subprocess
import sys

from test_hardening import failpoint_server_binary  # noqa: F401 - a fixture
from test_server import KV

SERVER_KV = [f"--server-arg={a}" for a in KV]


def soak(tiny_models, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "novainfer.cli", "bench", "soak", "--model", str(tiny_models["f32"]),
         "--concurrency", "8", "--abort-fraction", "0.2", "--bad-fraction", "0.1", "--output-range", "8", "64",
         *SERVER_KV, *extra],
        capture_output=True, text=True, timeout=300,
    )


def outcomes(stdout: str) -> dict[str, int]:
    line = next(line for line in stdout.splitlines() if line.strip().startswith("requests "))
    return {name: int(n) for name, n in re.findall(r"([a-z_0-9]+) (\d+)", line.split(":", 1)[1])}


def test_soak_leaves_the_engine_idle(tiny_models):
    res = soak(tiny_models, "--duration", "8")
    assert res.returncode == 0, res.stdout + res.stderr
    seen = outcomes(res.stdout)
    for expected in ("ok", "disconnected", "malformed_json_400", "oversized_413", "slow_headers_closed"):
        assert seen.get(expected, 0) > 0, seen
    assert seen.get("cancelled", 0) + seen.get("cancel_after_finish", 0) > 0, seen
    assert "unexpected" not in seen
    assert "novainfer:kv_cache_used_blocks 0, novainfer:num_requests_running 0" in res.stdout


def test_soak_with_an_engine_fault_hangs_nobody(tiny_models, failpoint_server_binary):  # noqa: F811
    # 60 steps: a loaded 2-core machine reaches them within the first second or two of the 4.
    res = soak(tiny_models, "--duration", "4", "--fault-after-steps", "60",
               "--server-executable", failpoint_server_binary)
    assert res.returncode == 0, res.stdout + res.stderr
    seen = outcomes(res.stdout)
    assert seen.get("engine_down_503", 0) > 0, seen
    assert "health_status 503" in res.stdout
