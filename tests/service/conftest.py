"""pytest fixtures of the end-to-end tests (helpers live in e2e_support)."""

import json
import os
import sys
import tempfile

import pytest

from e2e_protos import compile_descriptors, load_stubs
from e2e_support import GOLDEN_JSON, _RUNNING_SERVERS, _STARTED_IN_TEST


@pytest.fixture(scope="session")
def pb():
    """The client's message classes (see e2e_support: COALESCE_E2E_DESCRIPTORS)."""
    given = os.environ.get("COALESCE_E2E_DESCRIPTORS")
    if given:
        return load_stubs(given)
    with tempfile.TemporaryDirectory(prefix="coalesce-e2e-stubs-") as d:
        path = os.path.join(d, "coalesce.desc")
        compile_descriptors(path)
        return load_stubs(path)


@pytest.fixture(scope="session")
def golden():
    with open(GOLDEN_JSON) as f:
        data = json.load(f)
    cases = data["cases"]
    assert len(cases) >= 2
    return cases


@pytest.fixture(autouse=True)
def _server_log_on_failure():
    """Prints the log lines from this test of each server that ran in it,
    including servers the test stopped, with their exit status. pytest shows
    the captured output only for tests that fail."""
    marks = {id(s): s.log_len() for s in _RUNNING_SERVERS}
    earlier = list(_RUNNING_SERVERS)
    del _STARTED_IN_TEST[:]
    yield
    for s in earlier + [s for s in _STARTED_IN_TEST if id(s) not in marks]:
        rc = s.proc.poll()
        state = ("running" if rc is None else
                 "killed by signal %d" % -rc if rc < 0 else "exit status %d" % rc)
        sys.stderr.write("---- server log (%s; %s), from this test ----\n%s"
                         % (" ".join(s.cmd[1:]), state, s.log(marks.get(id(s), 0))))
