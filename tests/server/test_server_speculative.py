"""Speculative decoding served: a verify step hands the API process several tokens of a
request at once; the streamed events carry them all, and the stream, the non-streamed answer
and a server without speculation agree token for token; /metrics counts the verify steps and
the accept length."""

from __future__ import annotations

import httpx

from tests.support.server import ServerProcess, post, sse_events


def repeating(period: int, n: int) -> list[int]:
    base = [(7 * i + 3) % 200 + 10 for i in range(period)]
    return (base * (n // period + 1))[:n]


def generate(srv: ServerProcess, ids: list[int], stream: bool):
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
        "stream": stream,
    }
    if not stream:
        return post(srv, "/generate", body).json()["output_ids"]
    with httpx.stream("POST", f"{srv.url}/generate", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    return events[-2]["output_ids"]


def test_streamed_tokens_equal_plain_decoding(tiny_model_dir, tmp_path):
    ps = [repeating(6, 30), repeating(9, 27)]
    plain = ServerProcess(["--model-path", str(tiny_model_dir)], tmp_path / "plain.log")
    spec = ServerProcess(
        ["--model-path", str(tiny_model_dir), "--speculative-algorithm", "NGRAM"],
        tmp_path / "spec.log",
    )
    try:
        plain.wait_ready()
        spec.wait_ready()
        for p in ps:
            want = generate(plain, p, stream=False)
            assert len(want) == 24
            assert generate(spec, p, stream=False) == want
            assert generate(spec, p, stream=True) == want
        metrics = httpx.get(f"{spec.url}/metrics", timeout=10).text
        values = {
            line.split()[0]: float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("breakgraph_spec_")
        }
        assert values["breakgraph_spec_verify_steps_total"] > 0
        assert (
            values["breakgraph_spec_draft_tokens_total"]
            >= (values["breakgraph_spec_accepted_tokens_total"])
        )
        assert values["breakgraph_spec_accept_length"] > 1.0
    finally:
        plain.stop()
        spec.stop()
