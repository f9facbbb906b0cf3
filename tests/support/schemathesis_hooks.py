"""Schemathesis hooks of the bounded run (tests/e2e/test_schemathesis.py): ``positive_data_acceptance`` on every
route, with exactly the rules JSON Schema cannot state left out, each named, recognised by the server's
refusal message. The served document says each of them in words (the field's description)."""
from __future__ import annotations

import re

import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi.checks import positive_data_acceptance

# rule → the server's refusal of a request that breaks it
UNSTATABLE_RULES = {
    # the text of parameters.grammar, response_format.json_schema.schema, text.format.schema or a tool's
    # parameters must compile (a regex such as "(" does not; nor does a JSON Schema the compiler refuses)
    "a grammar compiles": re.compile(r"does not compile|could not be checked within"),
    "a grammar's text is at most 65536 bytes": re.compile(r"grammar is \d+ bytes, more than the limit"),
    # a cross-reference between two fields' values
    "tool_choice names one of the tools": re.compile(r"tool_choice names the function .*, which is not in tools"),
    "tool names are unique": re.compile(r"is the name of another tool too"),
    # statable with "contains", which schemathesis cannot generate from (its "Schema Error")
    "a JSON response_format excludes tool_choice auto with a strict tool":
        re.compile(r"(response_format|output_config\.format) cannot be combined with tool_choice"),
    # the model's vocabulary, chat template and media kinds are the loaded model's, not the document's
    "a logit_bias token id is in the vocabulary": re.compile(r"outside the vocabulary of \d+ tokens"),
    "a media part is one the model takes": re.compile(r"which this model does not accept"),
    # a sum over a list, and the prompt counted in tokens
    "the stop strings total at most 32768 characters": re.compile(r"must total at most \d+ characters"),
    "the prompt encodes to 1 token or more, and within the token limit":
        re.compile(r"has \d+ tokens, more than the limit of|encodes to 0 tokens"),
}


def unstatable_rule(message: str) -> str | None:
    """The name of the unstatable rule ``message`` refuses a request for, if any."""
    return next((name for name, pattern in UNSTATABLE_RULES.items() if pattern.search(message)), None)


@schemathesis.check
def positive_data_acceptance_but_unstatable_rules(ctx, response, case) -> bool | None:
    """``positive_data_acceptance``, except a refusal for one of ``UNSTATABLE_RULES``."""
    try:
        return positive_data_acceptance(ctx, response, case)
    except RejectedPositiveData:
        if unstatable_rule(response.text) is None:
            raise
        return None
