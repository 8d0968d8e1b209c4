"""Chat logprobs + top_logprobs and n choices through the openai client (embedded model)."""

from __future__ import annotations

from tests.support import embedded

server, client, model_name = embedded.server, embedded.client, embedded.model_name


def test_chat_top_logprobs_and_n(client, model_name):
    out = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=4,
        n=3,
        temperature=0.8,
        seed=5,
        logprobs=True,
        top_logprobs=3,
        frequency_penalty=0.5,
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice in out.choices:
        for entry in choice.logprobs.content:
            assert len(entry.top_logprobs) == 3
            values = [t.logprob for t in entry.top_logprobs]
            assert values == sorted(values, reverse=True) and entry.logprob <= values[0] + 1e-5
    # echo with text: the prompt comes back first, its first token without a logprob
    res = client.completions.create(
        model=model_name, prompt="The capital of France is", echo=True, logprobs=1, max_tokens=0
    )
    lp = res.choices[0].logprobs
    assert res.choices[0].text == "The capital of France is"
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == "The capital of France is"
