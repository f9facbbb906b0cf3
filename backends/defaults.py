"""Parameter defaults: the one place each is written. A request's unset value takes the model yaml's
``model.model_config`` value, else the value here (``backends.params.resolve``); None means "off"."""
from __future__ import annotations

MAX_NEW_TOKENS = 20  # RequestParams.max_new_tokens when the client sends none

# Used when neither the request nor the yaml sets a value.
FALLBACKS: dict[str, float | int | bool | None] = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": None,  # off
    "top_p": 1.0,  # off
    "typical_p": 1.0,  # off
    "repetition_penalty": 1.0,  # off
}
