"""Where and when the sweep ran: the machine, the load, the commit."""

import os
import subprocess

from . import REPO


def command_output(cmd):
    """The command's stripped stdout, run in the repository; "" if it fails."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                              cwd=REPO).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info():
    cpu_model, cpus = "unknown CPU", str(os.cpu_count())
    for line in command_output(["lscpu"]).splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            cpu_model = value.strip()
        elif key.strip() == "CPU(s)":
            cpus = value.strip()
    memory = "unknown"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    memory = "%.1f GiB" % (int(line.split()[1]) / (1 << 20))
    except OSError:
        pass
    os_name = "unknown OS"
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    os_name = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return {"cpu_model": cpu_model, "cpus": cpus, "memory": memory, "os": os_name}


def load_average():
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "unknown"
