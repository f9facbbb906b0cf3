"""A Qwen3 model served on a real socket (the tiny random checkpoint, tests/support/make_tiny_qwen3.py, on the AOT
kernels): POST /, /generate_stream and /v1/completions return HF transformers' golden greedy ids
(tests/golden/qwen3_tiny.json), alone and with the three prompts in flight at once; /info names the architecture.
The checks are tests/support/hf_golden_http.py's, collected here."""
from __future__ import annotations

import pytest

from tests.support.hf_golden_engine import golden_fixture
from tests.support.hf_golden_http import served_fixtures
from tests.support.hf_golden_http import (
    check_generate_gives_the_golden_ids,
    check_generate_stream_streams_the_golden_ids,
    check_concurrent_requests_each_give_their_golden_ids,
    check_openai_completions_gives_the_golden_text,
    check_info_names_the_architecture,
)


# hf_golden_http's checks, collected as this module's tests
test_generate_gives_the_golden_ids = check_generate_gives_the_golden_ids
test_generate_stream_streams_the_golden_ids = check_generate_stream_streams_the_golden_ids
test_concurrent_requests_each_give_their_golden_ids = check_concurrent_requests_each_give_their_golden_ids
test_openai_completions_gives_the_golden_text = check_openai_completions_gives_the_golden_text
test_info_names_the_architecture = check_info_names_the_architecture

pytestmark = pytest.mark.slow
golden = golden_fixture("qwen3_tiny.json")
served, url = served_fixtures("tiny_qwen3_dir", model_name="tiny-qwen3", arch="Qwen3ForCausalLM")
