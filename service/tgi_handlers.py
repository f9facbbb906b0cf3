"""TGI's own routes: ``POST /generate`` (one JSON object) and ``POST /generate_stream`` (SSE).

Same body, schema and rules as ``POST /``; the route fixes the response mode, so a ``stream`` field
in the body does not change it (it is still checked as on ``POST /``).
"""
from __future__ import annotations

from dataclasses import replace

from service.errors import ValidationError
from service.handlers import GenerateHandler
from service.protocol import ParsedRequest


class GenerateObjectHandler(GenerateHandler):
    """``POST /generate``: the result object itself, not a one-element list."""

    wrap_in_list = False

    def parse(self) -> ParsedRequest:
        return replace(super().parse(), stream=False)


class GenerateStreamHandler(GenerateHandler):
    """``POST /generate_stream``: always a stream of ``data:`` events."""

    def parse(self) -> ParsedRequest:
        req = super().parse()
        if req.params.decoder_input_details:
            raise ValidationError("parameters.decoder_input_details must not be true on /generate_stream, got true")
        return replace(req, stream=True)
