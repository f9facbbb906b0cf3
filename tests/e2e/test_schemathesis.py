"""A bounded schemathesis run against the served OpenAPI document, through a real socket: every operation the
document lists, a few generated requests each, ``--checks all`` (no 5xx, statuses, content types, headers
and bodies as documented, 405s with ``Allow``, schema-valid requests accepted, schema-invalid ones refused).

Phases: the coverage phase's negative cases (boundary violations, and every method an operation does not
declare: a 405 with ``Allow``), then fuzzing (positive and negative). One check is off on the five
generation routes and the two Anthropic routes only: ``positive_data_acceptance`` (a schema-valid request
must not get a 4xx). Their bodies carry rules JSON Schema cannot state, each refused with a 4xx naming the
field after the schema check: a grammar must compile (a random regex such as ``(`` does not; on
``/v1/messages`` and its ``count_tokens`` a tool's ``input_schema``), a ``logit_bias`` id must be in the
vocabulary, the prompt must fit the token limit (counted in tokens), tools need a model whose chat template
has a tool-call format, image blocks a model that takes images. Every
other operation keeps it, and every other check runs on these routes too.

The server runs the default model with a context wide enough (2048 tokens) that generated prompts fit, with
ASCII strings; generation is capped at 4 tokens by the engine (maxIterTimes). The run is seeded and
deterministic: the same document gets the same requests; a failure prints schemathesis' report, with a curl
line per case."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backends.mindspore.engine import Engine
from backends.settings import EngineConfig

WIDE = EngineConfig(max_seq_len=2048, max_input_tokens=2040, max_batch_size=2, max_iter_times=4, block_size=64,
                    prefill_chunk=64, window_buckets=(2048,), batch_buckets=(1, 2))
EXAMPLES = 6  # per operation
SEED = 20261202
CONFIG = """
[checks]
enabled = true

[[operations]]
include-path-regex = "^/(generate|generate_stream|v1/completions|v1/chat/completions|v1/messages(/count_tokens)?)?$"
include-method = "POST"
checks.positive_data_acceptance.enabled = false

[phases.coverage.generation]
mode = "negative"
"""


@pytest.fixture(scope="module")
def url(live_servers, default_model_dir):
    with Engine(default_model_dir, WIDE) as engine:
        yield live_servers.start(engine)


def test_schemathesis_checks_all_pass_against_the_served_document(url, tmp_path):
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    (tmp_path / "schemathesis.toml").write_text(CONFIG, encoding="utf-8")
    command = [st, "--config-file", str(tmp_path / "schemathesis.toml"), "run", f"{url}/openapi.json",
               "--max-examples", str(EXAMPLES),
               "--phases", "examples,coverage,fuzzing", "--seed", str(SEED), "--generation-deterministic",
               "--generation-codec", "ascii", "--request-timeout", "120",
               "--max-response-time", "120", "--workers", "1", "--no-color", "--warnings", "off"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]
    assert "generated" in done.stdout and "Selected: " in done.stdout
