"""Graceful shutdown of ``mindserve serve`` (a real subprocess, real signals) and HTTPS.

The shutdown tests start the CLI through the bootstrap of tests/support/served.py that slows the tiny model's decode
(each step sleeps), so that a stream is still running when the signal arrives; everything else is
the real ``serve``: signal handlers, draining, the grace period and the exit code.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import requests
import yaml

from service.config import ConfigFileError, ServerSettings, load_server_config
from service.tls import server_ssl_context
from tests.support.cli import server_config
from tests.support.fake_backend import FakeBackend
from tests.support.http import until
from tests.support.paths import REPO
from tests.support.served import Served

TIMEOUT = 60


def write_config(tmp_path: Path, model_dir: Path, **server) -> Path:
    cfg = server_config(model_dir, **server)
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def stream_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """POST a stream in a thread; ``out`` gets 'first' (an Event set at the first event), 'events', 'status'."""
    out: dict = {"first": threading.Event(), "events": []}

    def run() -> None:
        with requests.post(url + "/", json=body, stream=True, timeout=TIMEOUT) as reply:
            out["status"] = reply.status_code
            for line in reply.iter_lines():
                if line.startswith(b"data: "):
                    out["events"].append(json.loads(line[6:]))
                    out["first"].set()
        out["first"].set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# --- graceful shutdown ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_in_flight_requests_then_exits_0(tmp_path, tiny_model_dir, sig):
    served = Served(write_config(tmp_path, tiny_model_dir, shutdownGracePeriod=30), slow_decode=0.2)
    try:
        url = served.wait_url()
        thread, out = stream_in_thread(url, {"inputs": "hello", "stream": True, "parameters": {
            "max_new_tokens": 30, "do_sample": False, "details": True}})
        assert out["first"].wait(TIMEOUT) and out["events"], served.text()[-2000:]
        served.proc.send_signal(sig)
        refused: list[requests.Response] = []

        def new_request_refused() -> bool:
            reply = requests.post(url + "/", json={"inputs": "x", "parameters": {"max_new_tokens": 1}}, timeout=10)
            refused.append(reply)
            return reply.status_code == 503

        assert until(new_request_refused, 5), [r.status_code for r in refused]
        assert refused[-1].json() == {"error": "the server is shutting down", "error_type": "Service Unavailable"}
        assert requests.get(url + "/health", timeout=10).status_code == 503
        assert served.proc.poll() is None  # still serving the stream
        thread.join(TIMEOUT)
        assert out["status"] == 200
        last = out["events"][-1]
        assert "error" not in last and last["generated_text"] is not None, last
        assert last["details"]["generated_tokens"] == len(out["events"])  # nothing lost
        assert served.proc.wait(30) == 0, served.text()[-2000:]
        assert "shutting down" in served.text() and "Traceback" not in served.text()
    finally:
        served.stop()


def test_requests_still_running_after_the_grace_period_are_cut_off(tmp_path, tiny_model_dir):
    served = Served(write_config(tmp_path, tiny_model_dir, shutdownGracePeriod=0.5), slow_decode=0.3)
    try:
        url = served.wait_url()
        thread, out = stream_in_thread(url, {"inputs": "hello", "stream": True,
                                             "parameters": {"max_new_tokens": 30, "do_sample": False}})
        assert out["first"].wait(TIMEOUT)
        signalled = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(30) == 0, served.text()[-2000:]
        assert time.monotonic() - signalled < 5  # 0.5 s of grace, not the 9 s the stream would need
        thread.join(10)
        last = out["events"][-1]
        assert last.get("error_type") == "Service Unavailable", last  # told, not silently dropped
        assert "still in flight are cut off" in served.text()
    finally:
        served.stop()


# --- TLS ---------------------------------------------------------------------------------------------------

def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=mindserve test CA", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=mindserve test {name}", cwd=d)
        extra = ["-extfile", "server.ext"] if name == "server" else []
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", *extra, cwd=d)
        (d / f"{name}.key").chmod(0o600)
    return d


def tls_settings(pki: Path, **extra) -> ServerSettings:
    return replace(ServerSettings(), https_enabled=True, tls_cert=pki / "server.pem", tls_pk=pki / "server.key",
                   **extra)


def start_https(live_servers, settings: ServerSettings) -> str:
    return live_servers.start(FakeBackend(), settings, ssl_options=server_ssl_context(settings))


def test_https_with_a_self_signed_ca(live_servers, pki):
    url = start_https(live_servers, tls_settings(pki))
    reply = requests.post(url + "/generate", json={"inputs": "x"}, verify=str(pki / "ca.pem"), timeout=TIMEOUT)
    assert reply.status_code == 200 and reply.json()["generated_text"] == "aaa"
    with pytest.raises(requests.exceptions.SSLError):  # an unknown CA is not trusted
        requests.get(url + "/health", timeout=TIMEOUT)
    with pytest.raises(requests.exceptions.ConnectionError):  # plain HTTP on the TLS port
        requests.get(url.replace("https", "http") + "/health", timeout=TIMEOUT)


def test_https_with_client_certificates_required(live_servers, pki):
    url = start_https(live_servers, tls_settings(pki, tls_ca_files=(pki / "ca.pem",)))
    ca = str(pki / "ca.pem")
    reply = requests.get(url + "/health", verify=ca, cert=(str(pki / "client.pem"), str(pki / "client.key")),
                         timeout=TIMEOUT)
    assert reply.status_code == 200
    with pytest.raises((requests.exceptions.SSLError, requests.exceptions.ConnectionError)):
        requests.get(url + "/health", verify=ca, timeout=TIMEOUT)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_private_key_others_can_read_is_refused(pki, tmp_path, mode):
    key = tmp_path / "server.key"
    key.write_bytes((pki / "server.key").read_bytes())
    key.chmod(mode)
    with pytest.raises(ConfigFileError, match=rf"tlsPk: private key file {re.escape(str(key))} has mode "
                                              rf"0{mode:o}.*chmod 600"):
        server_ssl_context(replace(tls_settings(pki), tls_pk=key))


@pytest.mark.parametrize("problem, key, words", [
    ("missing key file", "nokey", ["tlsPk", "is not a file"]),
    ("cert is not PEM", "badcert", ["tlsCert/tlsPk", "cannot load"]),
])
def test_unusable_tls_files_are_refused(pki, tmp_path, problem, key, words):
    settings = tls_settings(pki)
    if key == "nokey":
        settings = replace(settings, tls_pk=tmp_path / "missing.key")
    else:
        bad = tmp_path / "bad.pem"
        bad.write_text("not a certificate")
        settings = replace(settings, tls_cert=bad)
    with pytest.raises(ConfigFileError) as info:
        server_ssl_context(settings)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_cli_refuses_a_world_readable_key_with_exit_2(tmp_path, tiny_model_dir, pki):
    key = tmp_path / "server.key"
    key.write_bytes((pki / "server.key").read_bytes())
    key.chmod(0o644)
    path = write_config(tmp_path, tiny_model_dir, httpsEnabled=True, tlsCert=str(pki / "server.pem"),
                        tlsPk=str(key))
    out = subprocess.run([sys.executable, "-m", "service", "serve", "--config", str(path)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert str(key) in out.stderr and "mode 0644" in out.stderr and "Traceback" not in out.stderr


def test_cli_serves_https_then_exits_0_on_sigterm(tmp_path, tiny_model_dir, pki):
    served = Served(write_config(tmp_path, tiny_model_dir, httpsEnabled=True, tlsCert=str(pki / "server.pem"),
                                 tlsPk=str(pki / "server.key"), tlsCaFile=str(pki / "ca.pem")))
    try:
        url = served.wait_url()
        assert url.startswith("https://")
        reply = requests.post(url + "/", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}},
                              verify=str(pki / "ca.pem"), cert=(str(pki / "client.pem"), str(pki / "client.key")),
                              timeout=TIMEOUT)
        assert reply.status_code == 200 and isinstance(reply.json(), list)
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(60) == 0
    finally:
        served.stop()


@pytest.mark.parametrize("value, expected", [(None, 30.0), (2.5, 2.5), (0, 0.0)])
def test_shutdown_grace_period_is_read_from_the_config(tmp_path, tiny_model_dir, value, expected):
    extra = {} if value is None else {"shutdownGracePeriod": value}
    assert load_server_config(write_config(tmp_path, tiny_model_dir, **extra)).server.shutdown_grace_period == expected


@pytest.mark.parametrize("value", [-1, 3601, "soon"])
def test_a_bad_shutdown_grace_period_names_the_key(tmp_path, tiny_model_dir, value):
    with pytest.raises(ConfigFileError, match="ServerConfig.shutdownGracePeriod"):
        load_server_config(write_config(tmp_path, tiny_model_dir, shutdownGracePeriod=value))
