"""llama.cpp's own ``llama-server`` (built by ../shared/tools/build-llama-anchors.sh into ~/.cache/llama-anchors) on
a GGUF, for agreement tests that skip when it is absent: start it on a free port, ask for greedy ids."""
from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from tests.support.http import free_ports

LLAMA_ANCHORS = Path(os.environ.get("MINDSERVE_LLAMA_ANCHORS", Path.home() / ".cache" / "llama-anchors"))


def llama_server_binary() -> Path | None:
    path = LLAMA_ANCHORS / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


@contextmanager
def llama_server(gguf: Path, log: Path, threads: int = 2, extra: tuple[str, ...] = ()):
    """A llama-server process (one slot) on ``gguf`` (``extra``: more of its options); yields its base URL, kills it
    at exit."""
    binary = llama_server_binary()
    assert binary is not None, "no llama-server in " + str(LLAMA_ANCHORS)
    (port,) = free_ports(1)
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(binary.parent),
                                                                          os.environ.get("LD_LIBRARY_PATH")]))}
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", "1024", "-np", "1",
           "--host", "127.0.0.1", "--port", str(port), *extra]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not come up ({proc.poll()}): {log.read_text()[-2000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.kill()
        proc.wait(30)


def llama_greedy(url: str, ids: list[int], n: int) -> list[int]:
    """``n`` greedy ids after the prompt ``ids`` (sent as ids: no tokenizer involved), EOS not special."""
    body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0, "ignore_eos": True,
            "cache_prompt": False, "return_tokens": True}
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return [int(t) for t in json.loads(r.read())["tokens"]]


def llama_tokenize(url: str, text: str) -> list[int]:
    """llama-server's own tokenization of ``text`` (no BOS; special tokens parsed)."""
    body = {"content": text, "add_special": False, "parse_special": True}
    req = urllib.request.Request(url + "/tokenize", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return [int(t) for t in json.loads(r.read())["tokens"]]
