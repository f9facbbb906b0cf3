"""The MindSpore ("ms") backend: yaml configs, weights, tokenizer, network, engine.

Every module here that imports MindSpore is imported after this file has run, so this is where MindSpore's log is
set up (``ms_log.py``)."""
from backends.mindspore.ms_log import quiet_expected_notices

quiet_expected_notices()
