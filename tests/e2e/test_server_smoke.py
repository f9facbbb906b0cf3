"""A first end-to-end check: the real model behind a real socket answers POST / as a JSON list."""
from __future__ import annotations

import requests


def test_post_root_returns_one_element_list(server_url):
    body = {"inputs": "My name is Olivier and I", "parameters": {"max_new_tokens": 5, "do_sample": False}}
    reply = requests.post(server_url + "/", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert isinstance(data, list) and len(data) == 1
    assert data[0]["generated_text"].startswith("'m here to help")
