"""The gRPC API's messages for the end-to-end tests' client, built at test time
from a FileDescriptorSet (protoc --descriptor_set_out) through protobuf's
descriptor pool: no generated *_pb2.py code, which protobuf supports only
under runtimes of the major version that generated it, and no grpc python
plugin (the client calls through grpc's generic multi-callables). Debian bookworm's python3-grpc-tools
(1.14.1) bundles a protoc too old for proto3 `optional`, so when
`python3 -m grpc_tools.protoc` fails the system `protoc` is used. A machine
without protoc (the GPU check's) is given a set compiled elsewhere:

    python3 tests/service/e2e_protos.py OUT.desc                    # where protoc is
    COALESCE_E2E_DESCRIPTORS=OUT.desc python3 -m pytest tests/service  # where it is not

Compiling needs protoc and the standard library; loading needs protobuf.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import types

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The subset of grpc/reflection/v1alpha/reflection.proto that list_services
# needs (field numbers as upstream; unknown fields are skipped on parse).
REFLECTION_PROTO = """
syntax = "proto3";
package grpc.reflection.v1alpha;
message ServerReflectionRequest {
  string host = 1;
  oneof message_request {
    string file_by_filename = 3;
    string file_containing_symbol = 4;
    string list_services = 7;
  }
}
message ServiceResponse { string name = 1; }
message ListServiceResponse { repeated ServiceResponse service = 1; }
message ErrorResponse { int32 error_code = 1; string error_message = 2; }
message ServerReflectionResponse {
  string valid_host = 1;
  ServerReflectionRequest original_request = 2;
  oneof message_response {
    ListServiceResponse list_services_response = 6;
    ErrorResponse error_response = 7;
  }
}
service ServerReflection {
  rpc ServerReflectionInfo(stream ServerReflectionRequest)
      returns (stream ServerReflectionResponse);
}
"""


def _protoc(include_dirs, out, protos):
    """Compiles `protos` (relative to include_dirs) into one FileDescriptorSet
    at `out`, their imports included."""
    attempts = [[sys.executable, "-m", "grpc_tools.protoc"]]
    if shutil.which("protoc"):
        attempts.append([shutil.which("protoc")])
    includes = ["-I" + d for d in include_dirs]
    errors = []
    for cmd in attempts:
        r = subprocess.run(cmd + includes + ["--include_imports", "--descriptor_set_out=" + out]
                           + list(protos), capture_output=True, text=True)
        if r.returncode == 0:
            return
        errors.append("%s: %s" % (" ".join(cmd), r.stderr.strip()))
    raise RuntimeError("cannot compile %s:\n%s" % (" ".join(protos), "\n".join(errors)))


def compile_descriptors(out):
    """Writes the FileDescriptorSet of coalesce.v1, of the health protocol the
    server serves (both from proto/) and of the reflection subset above to
    `out`."""
    with tempfile.TemporaryDirectory(prefix="coalesce-e2e-protos-") as extra:
        for rel, text in (("grpc/reflection/v1alpha/reflection.proto", REFLECTION_PROTO),):
            path = os.path.join(extra, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        _protoc([os.path.join(REPO, "proto"), extra], out,
                ["coalesce/v1/generator.proto", "grpc/health/v1/health.proto",
                 "grpc/reflection/v1alpha/reflection.proto"])


def load_stubs(path):
    """The message classes of a FileDescriptorSet: .g (coalesce.v1), .health
    and .reflection, each a namespace of top-level messages by name (nested
    enums' values are attributes of their message, as in generated code)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    with open(path, "rb") as f:
        files = descriptor_pb2.FileDescriptorSet.FromString(f.read()).file
    pool = descriptor_pool.DescriptorPool()
    for proto in files:  # --include_imports lists each file after its imports
        pool.Add(proto)
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        message_class = message_factory.GetMessageClass
    else:
        message_class = message_factory.MessageFactory(pool).GetPrototype
    packages = {}
    for proto in files:
        ns = packages.setdefault(proto.package, types.SimpleNamespace())
        for message in proto.message_type:
            descriptor = pool.FindMessageTypeByName(proto.package + "." + message.name)
            setattr(ns, message.name, message_class(descriptor))
    return types.SimpleNamespace(g=packages["coalesce.v1"],
                                 health=packages["grpc.health.v1"],
                                 reflection=packages["grpc.reflection.v1alpha"])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: e2e_protos.py OUT.desc")
    compile_descriptors(sys.argv[1])
