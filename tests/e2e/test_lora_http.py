"""LoRA adapters over HTTP, on a real socket in front of the ``lora_engine`` (the default model with three
adapters): ``parameters.adapter_id`` on the TGI routes, an unknown id's 422, the OpenAI ``model`` selecting an
adapter and ``/v1/models`` listing them, ``/info`` and the per-adapter metrics, and the run-time load/unload
routes with their root checks; hostile adapter files refused with the server healthy after.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import requests

from backends.lora import BaseDims
from backends.mindspore.families import load_model
from tests.support.http import error_json, ok_json, post, stream_events
from tests.support.lora_adapters import make_adapter
from tests.support.metrics import delta, scrape

TIMEOUT = 120
PROMPT = "My name is Olivier and I"
MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"max_new_tokens": 12, "do_sample": False}


@pytest.fixture(scope="module")
def lora_url(live_servers, lora_engine):
    return live_servers.start(lora_engine, lora=lora_engine.config.lora)


@pytest.fixture(scope="module")
def locked_url(live_servers, lora_engine):
    """The same engine behind a server whose config leaves runtime updates off."""
    return live_servers.start(lora_engine, lora=replace(lora_engine.config.lora, runtime_updates=False))


def generated(url: str, adapter: str | None, path: str = "/") -> str:
    params = {**GREEDY, **({"adapter_id": adapter} if adapter is not None else {})}
    reply = post(url, {"inputs": PROMPT, "parameters": params}, path=path)
    return ok_json(reply)["generated_text"] if path == "/" else reply.json()["generated_text"]


def test_adapter_id_selects_the_adapter_on_every_tgi_route(lora_url):
    base, none = generated(lora_url, None), generated(lora_url, "None")
    assert base == none  # "None" is the base model
    texts = {name: generated(lora_url, name) for name in ("all7", "rslora", "qv")}
    assert len({base, *texts.values()}) == 4  # each adapter changes the text
    assert generated(lora_url, "all7", "/generate") == texts["all7"]
    reply = post(lora_url, {"inputs": PROMPT, "parameters": {**GREEDY, "adapter_id": "qv"}}, path="/generate_stream",
                 stream=True)
    assert stream_events(reply)[-1]["generated_text"] == texts["qv"]


@pytest.mark.parametrize("path", ["/", "/generate", "/generate_stream"])
def test_unknown_adapter_is_a_422_naming_it_and_the_loaded_ones(lora_url, path):
    reply = post(lora_url, {"inputs": PROMPT, "parameters": {"adapter_id": "sql/v9"}}, path=path)
    message = error_json(reply, 422, "Input Validation Error")
    assert message == 'parameters.adapter_id "sql/v9" is not a loaded adapter (loaded: all7, qv, rslora)'


def test_openai_model_selects_an_adapter_and_models_lists_them(lora_url):
    def complete(model: str) -> requests.Response:
        return requests.post(lora_url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 12,
                                                                 "temperature": 0})

    adapted = complete("all7")
    assert adapted.status_code == 200
    assert adapted.json()["model"] == "all7"
    assert adapted.json()["choices"][0]["text"] == generated(lora_url, "all7")
    assert complete(MODEL).json()["choices"][0]["text"] == generated(lora_url, None)
    missing = complete("nope")
    assert missing.status_code == 404
    assert "all7" in missing.json()["error"]["message"]
    models = requests.get(lora_url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [MODEL, "all7", "rslora", "qv"]
    assert all(m["parent"] == MODEL for m in models[1:])
    card = requests.get(lora_url + "/v1/models/qv", timeout=10)
    assert card.status_code == 200 and card.json()["parent"] == MODEL


def test_info_lists_the_adapters(lora_url):
    lora = requests.get(lora_url + "/info", timeout=10).json()["mindserve"]["lora"]
    assert lora["slots"] == 5 and lora["rank"] == 16 and lora["runtime_updates"] is True
    by_name = {a["name"]: a for a in lora["adapters"]}
    assert set(by_name) == {"all7", "rslora", "qv"}
    assert by_name["all7"]["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj"]
    assert by_name["rslora"]["use_rslora"] is True
    assert by_name["rslora"]["scale"] == pytest.approx(8 / 16 ** 0.5)
    assert by_name["qv"]["scale"] == pytest.approx(8 / 4)


def test_metrics_count_requests_and_tokens_by_adapter(lora_url):
    before = scrape(lora_url)
    generated(lora_url, "qv")
    post(lora_url, {"inputs": PROMPT, "parameters": {"adapter_id": "qv", "top_p": 1.0}})
    post(lora_url, {"inputs": PROMPT, "parameters": {"adapter_id": "made-up-by-a-client"}})
    after = scrape(lora_url)
    assert not [k for k in after if "made-up-by-a-client" in k]  # a client cannot mint label values
    assert delta(before, after, "adapter_requests_total{adapter=qv}{outcome=success}") == 1
    assert delta(before, after, "adapter_generation_tokens_total{adapter=qv}") == GREEDY["max_new_tokens"]
    assert delta(before, after, "adapter_requests_total{adapter=None}{outcome=failed}") == 2  # refused


# --- run-time load and unload ----------------------------------------------------------------------

def admin(url: str, route: str, body: dict) -> requests.Response:
    return requests.post(f"{url}/v1/{route}", json=body, timeout=TIMEOUT)


def test_runtime_load_serves_the_adapter_and_unload_refuses_it_after(lora_url, lora_adapter_dirs):
    reply = admin(lora_url, "load_lora_adapter", {"lora_name": "late", "lora_path": "qv"})  # relative to the root
    assert reply.status_code == 200, reply.text
    assert reply.json()["adapter"]["name"] == "late"
    assert generated(lora_url, "late") == generated(lora_url, "qv")
    duplicate = admin(lora_url, "load_lora_adapter", {"lora_name": "late", "lora_path": str(lora_adapter_dirs["qv"])})
    assert "already loaded" in error_json(duplicate, 422, "Input Validation Error")
    assert admin(lora_url, "unload_lora_adapter", {"lora_name": "late"}).json()["status"] == "unloaded"
    gone = post(lora_url, {"inputs": PROMPT, "parameters": {"adapter_id": "late"}})
    assert "is not a loaded adapter" in error_json(gone, 422, "Input Validation Error")
    again = admin(lora_url, "unload_lora_adapter", {"lora_name": "late"})
    assert 'lora_name "late" is not a loaded adapter' in error_json(again, 404, "NotFoundError")


@pytest.fixture(scope="module")
def outside(tmp_path_factory, default_model_dir):
    """A valid adapter outside the adapter root."""
    path = tmp_path_factory.mktemp("outside") / "evil"
    make_adapter(path, BaseDims.of(load_model(default_model_dir)), seed=3, rank=4)
    return path


def test_paths_outside_the_root_are_refused(lora_url, lora_adapter_dirs, outside):
    root = next(iter(lora_adapter_dirs.values())).parent
    link = root / "link-out"
    if not link.exists():
        os.symlink(outside, link)
    cases = {
        str(outside): "is not under the adapter root",
        "../" + outside.parent.name + "/evil": "contains '..'",
        str(root / "qv" / ".." / ".." / outside.parent.name / "evil"): "contains '..'",
        "link-out": "once its symbolic links are followed",
        "no-such-dir": "is not a directory",
    }
    for path, why in cases.items():
        reply = admin(lora_url, "load_lora_adapter", {"lora_name": "evil", "lora_path": path})
        assert why in error_json(reply, 422, "Input Validation Error"), path
    assert "evil" not in [a["name"] for a in requests.get(lora_url + "/info", timeout=10).json()["mindserve"]["lora"]
                          ["adapters"]]


def test_hostile_adapter_files_are_refused_and_the_server_stays_up(lora_url, lora_adapter_dirs):
    root = next(iter(lora_adapter_dirs.values())).parent
    good = (lora_adapter_dirs["qv"] / "adapter_model.safetensors").read_bytes()
    config = (lora_adapter_dirs["qv"] / "adapter_config.json").read_text()
    header_len = int.from_bytes(good[:8], "little")
    cases = {
        "truncated": good[: len(good) // 2],
        "huge-rank": (b'{"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": {"dtype": "F32", '
                      b'"shape": [1000000, 576], "data_offsets": [0, 2304000000]}}'),
        "wrong-dtype": good[:8] + good[8:8 + header_len].replace(b'"F32"', b'"I32"') + good[8 + header_len:],
        "garbage": os.urandom(4096),
    }
    for name, data in cases.items():
        d = root / f"hostile-{name}"
        d.mkdir(exist_ok=True)
        if name == "huge-rank":
            data = len(data).to_bytes(8, "little") + data
        (d / "adapter_model.safetensors").write_bytes(data)
        (d / "adapter_config.json").write_text(config)
        reply = admin(lora_url, "load_lora_adapter", {"lora_name": f"h-{name}", "lora_path": d.name})
        assert reply.status_code == 422, (name, reply.text)
        assert "adapter_model.safetensors" in reply.json()["error"], (name, reply.text)
    assert requests.get(lora_url + "/health", timeout=10).status_code == 200
    assert generated(lora_url, "qv")


def test_runtime_routes_are_off_unless_the_config_enables_them(locked_url):
    reply = admin(locked_url, "load_lora_adapter", {"lora_name": "x", "lora_path": "qv"})
    assert "allowRuntimeLoraUpdating" in error_json(reply, 404, "NotFoundError")
    reply = admin(locked_url, "unload_lora_adapter", {"lora_name": "qv"})
    assert "allowRuntimeLoraUpdating" in error_json(reply, 404, "NotFoundError")


def test_admin_bodies_are_checked_against_their_schemas(lora_url):
    reply = admin(lora_url, "load_lora_adapter", {"lora_name": "-bad", "lora_path": "qv"})
    assert "lora_name" in error_json(reply, 422, "Input Validation Error")
    reply = admin(lora_url, "load_lora_adapter", {"lora_name": "ok"})
    assert "lora_path" in error_json(reply, 422, "Input Validation Error")
