"""MindSpore's own log, set before MindSpore is first imported (its C++ log reads the environment once, when the
library loads): the compile cache's expected notices are silenced, nothing else, and never over a user's choice."""
from __future__ import annotations

import os
from collections.abc import MutableMapping

# MindSpore's PIPELINE submodule warns twice for every graph its compile cache does not hold yet ("Open the hash file
# ... failed", "Check the consistency of dependency files hash failed. Execute all the compilation actions."): on a
# first start, that is every graph. Level 3 keeps that submodule's errors; our own log says what the cache holds
# ("graph cache: DIR (empty: compiling)"). Every other submodule keeps MindSpore's default (warnings).
QUIET = {"MS_SUBMODULE_LOG_v": "{PIPELINE:3}"}
_USER_KEYS = ("GLOG_v", "MS_SUBMODULE_LOG_v")  # set by the user: their choice stands


def quiet_expected_notices(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``QUIET`` in ``environ`` unless the user set MindSpore's log levels; True if it was set."""
    if any(key in environ for key in _USER_KEYS):
        return False
    environ.update(QUIET)
    return True
