"""The client's messages built from a descriptor set (e2e_protos), as the GPU
check's machine, which has no protoc, loads them: a set compiled to a file and
loaded from it must give working message classes with the API's fields."""

import subprocess
import sys

from e2e_protos import REPO, load_stubs


def test_a_compiled_descriptor_set_loads_into_working_messages(tmp_path):
    path = tmp_path / "api.desc"
    # As tools/gpu/prepare.sh runs it: the module as a script.
    subprocess.run([sys.executable, "%s/tests/service/e2e_protos.py" % REPO, str(path)],
                   check=True, timeout=60)
    pb = load_stubs(str(path))
    request = pb.g.GenerateRequest(prompt="Once upon a time", max_new_tokens=7,
                                   sampling=pb.g.SamplingParams(seed=3))
    again = pb.g.GenerateRequest.FromString(request.SerializeToString())
    assert (again.prompt, again.max_new_tokens) == ("Once upon a time", 7)
    assert again.sampling.HasField("seed") and again.sampling.seed == 3
    assert not again.sampling.HasField("top_p")  # proto3 optional: presence kept
    assert pb.health.HealthCheckResponse.SERVING == 1
    assert pb.health.HealthCheckResponse(status=2).status == pb.health.HealthCheckResponse.NOT_SERVING
    listing = pb.reflection.ServerReflectionRequest(list_services="")
    assert listing.WhichOneof("message_request") == "list_services"
