"""Static checks of deploy/Dockerfile and deploy/Dockerfile.cuda (there is no
container engine on the build machines, so the images are not built here).

* The runtime stage of deploy/Dockerfile installs a package for every shared
  library the freshly built coalesce-server and coalesce-cli load
  (`ldd`, then `dpkg -S`, as the Dockerfile's comment says): a new library
  dependency fails this test until the Dockerfile lists its package.
* Both Dockerfiles: multi-stage, the expected bases, the entrypoint, ports and
  user that deploy/k8s/base/deployment.yaml relies on.
"""

import os
import re
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKERFILE = os.path.join(REPO, "deploy", "Dockerfile")
DOCKERFILE_CUDA = os.path.join(REPO, "deploy", "Dockerfile.cuda")
SERVER = os.environ.get("COALESCE_SERVER") or os.path.join(REPO, "build", "bin", "coalesce-server")
CLI = os.environ.get("COALESCE_CLI") or os.path.join(REPO, "build", "bin", "coalesce-cli")
# In debian:12-slim already and not listed: the C library.
IN_BASE_IMAGE = {"libc6"}
# The CUDA toolkit of a build with the CUDA backend (not a Debian package).
# deploy/Dockerfile builds on debian:12 without it, so its binaries do not
# link these; test_cpu_image_builds_without_cuda checks that premise.
CUDA_ROOT = os.path.realpath(os.environ.get("CUDA_HOME", "/usr/local/cuda"))


def instructions(path):
    """(INSTRUCTION, argument) pairs, continuation lines joined, comments dropped."""
    out, current = [], ""
    with open(path) as f:
        for line in f:
            stripped = line.strip()
            if stripped.startswith("#") or not stripped:
                continue
            current += line.rstrip("\n")
            if current.endswith("\\"):
                current = current[:-1] + " "
                continue
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            current = ""
    return out


def stages(path):
    """[(FROM argument, [instructions])]."""
    result = []
    for word, arg in instructions(path):
        if word == "FROM":
            result.append((arg, []))
        elif result:
            result[-1][1].append((word, arg))
    return result


def installed_by(steps):
    """The packages named by the `apt-get install` commands of RUN steps."""
    packages = []
    for word, arg in steps:
        if word == "RUN" and "apt-get install" in arg:
            command = arg.split("apt-get install", 1)[1].split("&&")[0]
            packages += [t for t in command.split() if not t.startswith("-")]
    return packages


def needed_packages(binary):
    """{Debian package: a library of `binary` it owns}."""
    if not os.path.exists(binary):
        pytest.fail("binary not found: %s (set COALESCE_SERVER / COALESCE_CLI)" % binary)
    if shutil.which("ldd") is None or shutil.which("dpkg") is None:
        pytest.skip("needs ldd and dpkg (a Debian machine)")
    ldd = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    libs = [lib for lib in re.findall(r"=> (/\S+)", ldd)
            if not os.path.realpath(lib).startswith(CUDA_ROOT + os.sep)]
    # One dpkg call for every path (each library as loaded and as resolved,
    # since merged /usr makes them differ): "package: path" for those it knows.
    paths = sorted(set(libs) | {os.path.realpath(lib) for lib in libs})
    r = subprocess.run(["dpkg", "-S"] + paths, capture_output=True, text=True)
    owner_of = {}
    for line in r.stdout.splitlines():
        owners, _, path = line.partition(": ")
        owner_of[path.strip()] = owners.split(",")[0].split(":")[0].strip()
    packages = {}
    for lib in libs:
        owner = owner_of.get(os.path.realpath(lib)) or owner_of.get(lib)
        assert owner, "no Debian package owns %s (loaded by %s)" % (lib, binary)
        packages[owner] = lib
    return packages


@pytest.mark.parametrize("binary", [SERVER, CLI], ids=["coalesce-server", "coalesce-cli"])
def test_runtime_stage_has_every_shared_library(binary):
    base, steps = stages(DOCKERFILE)[-1]
    assert base.startswith("debian:12-slim"), base
    listed = set(installed_by(steps))
    needed = needed_packages(binary)
    missing = {p: lib for p, lib in needed.items() if p not in listed | IN_BASE_IMAGE}
    assert not missing, ("deploy/Dockerfile's runtime stage lacks the packages of %s "
                         "(package: library): %s" % (os.path.basename(binary), missing))


def test_dockerfile_stages():
    s = stages(DOCKERFILE)
    assert len(s) == 2
    assert s[0][0] == "debian:12 AS build"
    build_runs = " ".join(arg for word, arg in s[0][1] if word == "RUN")
    assert "tools/install-deps.sh" in build_runs
    assert "--target coalesce-server coalesce-cli" in build_runs
    _check_runtime(s[1][1])


def test_dockerfile_cuda_stages():
    s = stages(DOCKERFILE_CUDA)
    assert len(s) == 2
    assert re.fullmatch(r"nvidia/cuda:\$\{CUDA_VERSION\}-devel-ubuntu\$\{UBUNTU_VERSION\} AS build",
                        s[0][0]), s[0][0]
    assert re.fullmatch(r"nvidia/cuda:\$\{CUDA_VERSION\}-runtime-ubuntu\$\{UBUNTU_VERSION\} "
                        r"AS runtime", s[1][0]), s[1][0]
    # Its build dependencies are a subset of tools/install-deps.sh's.
    with open(os.path.join(REPO, "tools", "install-deps.sh")) as f:
        deps = f.read()
    install = installed_by(s[0][1])
    assert "libgrpc++-dev" in install
    for p in install:
        assert re.search(r"(^|\s)%s(\s|$)" % re.escape(p), deps, re.M), (
            "%s is installed by Dockerfile.cuda but not listed in tools/install-deps.sh" % p)
    _check_runtime(s[1][1])


def _check_runtime(steps):
    words = dict(steps)  # the last of each instruction
    assert words["ENTRYPOINT"] == '["/usr/local/bin/coalesce-server"]'
    assert set(words["EXPOSE"].split()) == {"50051", "9090"}
    # deploy/k8s/base/deployment.yaml runs as this user and group.
    assert words["USER"] == "10001:10001"
    with open(os.path.join(REPO, "deploy", "k8s", "base", "deployment.yaml")) as f:
        deployment = f.read()
    assert "runAsUser: 10001" in deployment and "runAsGroup: 10001" in deployment
    copies = [arg for word, arg in steps if word == "COPY"]
    assert any("coalesce-server" in c and c.endswith("/usr/local/bin/") for c in copies), copies


def test_cpu_image_builds_without_cuda():
    """The CPU image's binaries link no CUDA library because its build stage
    has no CUDA toolkit: CMake then leaves the CUDA backend out."""
    base, steps = stages(DOCKERFILE)[0]
    assert base.startswith("debian:12"), base
    packages = installed_by(steps)
    assert not [p for p in packages if "cuda" in p or p == "nvidia-cuda-toolkit"], packages
