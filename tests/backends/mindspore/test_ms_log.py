"""backends/mindspore/ms_log.py: MindSpore's compile-cache notices are silenced only where the user left MindSpore's
log levels unset (pure logic: a dict stands for the environment)."""
from __future__ import annotations

import pytest

from backends.mindspore.ms_log import QUIET, quiet_expected_notices


@pytest.mark.parametrize(("environ", "quieted"), [
    ({}, True),
    ({"PATH": "/bin"}, True),
    ({"GLOG_v": "1"}, False),  # the user asked for MindSpore's INFO log: theirs
    ({"MS_SUBMODULE_LOG_v": "{DEVICE:1}"}, False),
])
def test_the_pipeline_notices_are_quiet_unless_the_user_set_mindspores_levels(environ, quieted):
    before = dict(environ)
    assert quiet_expected_notices(environ) is quieted
    assert environ == ({**before, **QUIET} if quieted else before)


def test_the_quiet_setting_names_only_the_pipeline_submodule_at_error_level():
    assert QUIET == {"MS_SUBMODULE_LOG_v": "{PIPELINE:3}"}
