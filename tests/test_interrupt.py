"""Ctrl-C during `LLM.generate`: `KeyboardInterrupt` promptly, and the batch aborted.

The native wait releases the GIL and wakes every 50 ms to run Python's signal handlers, so SIGINT is
noticed within one poll interval plus the step in progress; the test allows 3 s for the whole exit
(interpreter shutdown included) on a loaded 2-core CI machine.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from conftest import PROMPT

#: How long SIGINT → process exit may take.
EXIT_BOUND_S = 3.0

SCRIPT = r"""
import json, signal, sys, time
from novainfer import LLM, SamplingParams

# A shell that starts the suite in the background without job control starts it with SIGINT ignored,
# and Python then keeps it ignored: Ctrl-C's handler is what this test is about, so install it.
signal.signal(signal.SIGINT, signal.default_int_handler)

llm = LLM(sys.argv[1])
prompts = [[(t + i) % 400 for t in PROMPT] for i in range(256)]
params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
print("ready", flush=True)
try:
    llm.generate(prompts, params)
    print("finished", flush=True)
except KeyboardInterrupt:
    stats = llm.stats()
    print(json.dumps(stats), flush=True)
    raise
"""


def test_sigint_interrupts_generate_and_aborts_the_batch(tiny_models):
    script = f"PROMPT = {PROMPT!r}\n" + SCRIPT
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tiny_models["f32"])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # well inside the batch (256 × 480 tokens take several seconds here)
        assert proc.poll() is None, "the batch finished before the signal"
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "KeyboardInterrupt" in err, f"status {proc.returncode}, stdout {out[-500:]!r}, stderr {err[-2000:]!r}"
    assert proc.returncode != 0
    assert elapsed < EXIT_BOUND_S, f"took {elapsed:.2f} s to exit after SIGINT"
    lines = out.strip().splitlines()
    assert "finished" not in lines
    stats = json.loads(lines[-1])
    # The abort is queued before the stats request on the same channel: the engine is idle.
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_used_blocks"] == 0
