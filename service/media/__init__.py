"""Media parts of a request (``inputs`` lists): from the part a client sent to a checked ``MediaInput``.

``kinds.py`` the part types and their file types; ``parts.py`` the rules that need no I/O (shapes, count,
source, type, URL length); ``policy.py`` what a deployment allows (root, caps, whitelist, timeouts);
``local.py`` files under the media root; ``addresses.py`` and ``fetch.py`` remote files; ``content.py``
what the bytes must be; ``loader.py`` one request's media, off the generation slot, within ``gate.py``'s
bounds. Every refusal is an ``errors.py`` error naming ``inputs[i]``, the rule and the value.
"""
