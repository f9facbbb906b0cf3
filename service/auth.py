"""The API key of the business routes (``ServerConfig.apiKey``, ``serve --api-key``): a request must carry
``Authorization: Bearer <key>``. Routes that monitoring and browsers reach without credentials (health, /info,
/metrics, /openapi.json, the playground page) are marked ``public`` on their handler class."""
from __future__ import annotations

import hmac

from service.errors import Unauthorized

SCHEME = "Bearer"


def key_refusal(api_key: str | None, authorization: str | None) -> Unauthorized | None:
    """The 401 for a request with ``authorization`` (its header, or None) when the server wants ``api_key``;
    None when it may pass. The comparison takes the same time whatever the key sent."""
    if api_key is None:
        return None
    if not authorization:
        return Unauthorized("this server needs an API key: send the header Authorization: Bearer <key>")
    scheme, _, sent = authorization.strip().partition(" ")
    if scheme.lower() != SCHEME.lower() or not hmac.compare_digest(sent.strip().encode(), api_key.encode()):
        return Unauthorized("the API key is not valid (Authorization: Bearer <key>)")
    return None
