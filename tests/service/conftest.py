"""pytest fixtures of the end-to-end tests (helpers live in e2e_support)."""

import json
import os
import shutil
import sys
import tempfile

import pytest

from e2e_support import (GOLDEN_JSON, HEALTH_PROTO, REFLECTION_PROTO, REPO, _RUNNING_SERVERS,
                         Stubs, _protoc)


@pytest.fixture(scope="session")
def pb():
    d = tempfile.mkdtemp(prefix="coalesce-e2e-stubs-")
    extra = os.path.join(d, "extra")
    for rel, text in (("grpc/health/v1/health.proto", HEALTH_PROTO),
                      ("grpc/reflection/v1alpha/reflection.proto", REFLECTION_PROTO)):
        path = os.path.join(extra, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    out = os.path.join(d, "out")
    os.makedirs(out)
    _protoc(os.path.join(REPO, "proto"), out, "coalesce/v1/generator.proto")
    _protoc(extra, out, "grpc/health/v1/health.proto")
    _protoc(extra, out, "grpc/reflection/v1alpha/reflection.proto")
    sys.path.insert(0, out)
    from coalesce.v1 import generator_pb2
    # `grpc` is the installed grpc package, so the generated grpc.health and
    # grpc.reflection modules are loaded from their files, under other names.
    import importlib.util

    def load(name, rel):
        spec = importlib.util.spec_from_file_location(name, os.path.join(out, rel))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    health_pb2 = load("e2e_health_pb2", "grpc/health/v1/health_pb2.py")
    reflection_pb2 = load("e2e_reflection_pb2", "grpc/reflection/v1alpha/reflection_pb2.py")
    s = Stubs()
    s.g = generator_pb2
    s.health = health_pb2
    s.reflection = reflection_pb2
    yield s
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def golden():
    with open(GOLDEN_JSON) as f:
        data = json.load(f)
    cases = data["cases"]
    assert len(cases) >= 2
    return cases


@pytest.fixture(autouse=True)
def _server_log_on_failure():
    """Prints each running server's log lines from this test. pytest shows the
    captured output only for tests that fail."""
    marks = {id(s): s.log_len() for s in _RUNNING_SERVERS}
    yield
    for s in list(_RUNNING_SERVERS):
        start = marks.get(id(s), 0)
        sys.stderr.write("---- server log (%s), from this test ----\n%s"
                         % (" ".join(s.cmd[4:]), s.log(start)))
