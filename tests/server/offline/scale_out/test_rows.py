"""Ray Data rows as requests (no Ray needed): both row shapes, Arrow's nulls, bad rows."""

from __future__ import annotations

import json

from server.offline.scale_out.rows import row_request
from server.offline.work import batch_request_id
from server.openai.serving import CHAT, COMPLETIONS


def test_arrow_rows_lose_their_nulls_and_take_run_batchs_ids() -> None:
    rows = [  # as Table.to_pylist gives them: one struct type for every row's body
        {"custom_id": "a", "body": {"prompt": "hi", "max_tokens": 3, "messages": None}},
        {
            "custom_id": "b",
            "body": {"messages": [{"role": "user", "content": "yo", "name": None}], "prompt": None},
            "prompt": None,
        },
    ]
    first, second = (row_request(row, "m", {}) for row in rows)
    assert first.body == {"prompt": "hi", "max_tokens": 3}
    assert second.body == {"messages": [{"role": "user", "content": "yo"}]}
    assert (first.endpoint, second.endpoint) == (COMPLETIONS, CHAT)
    assert first.request_id == batch_request_id("a", COMPLETIONS)
    assert second.request_id == batch_request_id("b", CHAT)


def test_plain_rows_take_the_model_and_sampling_and_bad_rows_say_why() -> None:
    plain = row_request({"prompt": "Once"}, "demo", {"max_tokens": 5, "temperature": 0})
    assert plain.endpoint == COMPLETIONS and plain.request_id is None
    assert plain.body == {"max_tokens": 5, "temperature": 0, "model": "demo", "prompt": "Once"}
    chat = row_request({"messages": [{"role": "user", "content": "x"}]}, "demo", {})
    assert chat.endpoint == CHAT and chat.body["model"] == "demo"
    as_text = row_request({"body": json.dumps({"prompt": "p"}), "url": COMPLETIONS}, "d", {})
    assert as_text.body == {"prompt": "p"} and as_text.problem is None
    for row, code in [
        ({"text": "no request here"}, "invalid_value"),
        ({"body": "{not json"}, "invalid_value"),
        ({"body": "[1]"}, "invalid_value"),
        ({"body": {"prompt": "p"}, "url": "/v1/embeddings"}, "invalid_url"),
    ]:
        problem = row_request(row, "d", {}).problem
        assert problem is not None and problem.status_code == 400 and problem.code == code
