"""The sweep's grids: for each section, what is varied, what is held and how
long each point measures; the constants the analysis and the document share;
and the --kv_cache_memory each point needs."""

# Each section: what is varied, what is held, and how long each point measures.
# Durations are coalesce-bench durations ("3s"); every point also pays for the
# server start (a second or two) and the drain at the end of its measurement.
#
# The trade measures in rounds, not seconds: with every request the same
# length, a closed loop of c streams runs in lock step, so c warm-up requests
# (--warmup_requests) and then rounds x c measured ones (--requests, at least
# min_requests) keep the batch full from the first measured send to the end.
# A duration would not: at high concurrency one request outlasts a few seconds,
# so a warm-up by time would hold every stream and leave nothing measured.
GRIDS = {
    # About 15 minutes on a 2-core machine.
    "full": {
        "trade": {
            # synthetic:110m at concurrency 256 is the longest point, about
            # two minutes (three rounds of 64 steps of about half a second).
            "models": {"synthetic:15m": [1, 2, 4, 8, 16, 32, 64, 128, 256],
                       "synthetic:110m": [1, 2, 4, 8, 16, 32, 64, 128, 256]},
            "max_batch_size": 256,
            "batch_window": "0",
            "prompt_tokens": "32",
            "max_new_tokens": "64",
            "rounds": 2,
            "min_requests": 8,
        },
        "static": {
            "model": "synthetic:15m",
            # Closed loop at concurrency = the batch size.
            "max_batch_sizes": [8, 16],
            "batch_window": "5ms",
            "prompt_tokens": "32",
            # Uniform, then log-uniform (short outputs common, long ones rare).
            "lengths": ["16:512", "16:512:log"],
            "warmup": "5s",
            "duration": "30s",
        },
        "window": {
            "model": "synthetic:15m",
            "max_batch_size": 16,
            "windows_ms": [0, 1, 2, 5, 10, 20, 50],
            "load": 0.5,  # the open-loop rate, as a fraction of the measured capacity
            "prompt_tokens": "32",
            "max_new_tokens": "64",
            "calibration": "5s",
            "warmup": "2s",
            "duration": "12s",
        },
    },
    # About 1-2 minutes: the same shape, fewer and shorter points.
    "quick": {
        "trade": {
            "models": {"synthetic:15m": [1, 4, 16]},
            "max_batch_size": 256,
            "batch_window": "0",
            "prompt_tokens": "32",
            "max_new_tokens": "32",
            "rounds": 2,
            "min_requests": 4,
        },
        "static": {
            "model": "synthetic:15m",
            "max_batch_sizes": [8],
            "batch_window": "5ms",
            "prompt_tokens": "16",
            "lengths": ["16:128", "16:128:log"],
            "warmup": "1s",
            "duration": "6s",
        },
        "window": {
            "model": "synthetic:15m",
            "max_batch_size": 16,
            "windows_ms": [0, 5, 20],
            "load": 0.5,
            "prompt_tokens": "32",
            "max_new_tokens": "32",
            "calibration": "2s",
            "warmup": "1s",
            "duration": "4s",
        },
    },
    # Seconds: one or two points per section on the smallest model, for the
    # test (tests/bench/test_sweep.py). The numbers mean nothing.
    "smoke": {
        "trade": {
            "models": {"synthetic:tiny": [1, 2, 4]},
            "max_batch_size": 16,
            "batch_window": "0",
            "prompt_tokens": "8",
            "max_new_tokens": "8",
            "rounds": 2,
            "min_requests": 4,
        },
        "static": {
            "model": "synthetic:tiny",
            "max_batch_sizes": [4],
            "batch_window": "1ms",
            "prompt_tokens": "8",
            "lengths": ["4:16", "4:16:log"],
            "warmup": "0.2s",
            "duration": "0.6s",
        },
        "window": {
            "model": "synthetic:tiny",
            "max_batch_size": 8,
            "windows_ms": [0, 5],
            "load": 0.5,
            "prompt_tokens": "8",
            "max_new_tokens": "8",
            "calibration": "0.5s",
            "warmup": "0.2s",
            "duration": "0.6s",
        },
    },
}

SECTIONS = ("trade", "static", "window")

# The rule that picks the --batch_window the data supports (window section):
# among the windows whose throughput is within WINDOW_THROUGHPUT_TOLERANCE of
# the best and whose p50 time to first token is at most WINDOW_TTFT_BUDGET_MS
# above window 0's, the smallest. A window is a cost paid in every request's
# first token, so it must buy throughput to be worth it; when window 0 is
# already within the tolerance of the best, the rule picks 0.
WINDOW_THROUGHPUT_TOLERANCE = 0.05
WINDOW_TTFT_BUDGET_MS = 10.0

# The target for iteration-level against static batching.
STATIC_TARGET_RATIO = 2.0
# --batching modes of the static section: iteration-level, then the two
# static baselines (docs/batching.md).
STATIC_MODES = ("continuous", "static_padded", "static")
STATIC_LABELS = {"continuous": "iteration-level (continuous)",
                 "static_padded": "static, padded (classic)",
                 "static": "static, finished rows dropped"}

# KV bytes per token position of each synthetic model in fp32:
# 2 (K and V) x layers x KV dim x 4 bytes (docs/engines.md, "The embedded synthetic
# models"). Used to size --kv_cache_memory to what a grid point needs instead
# of the CPU default (max_batch_size full-context sequences, up to a quarter
# of RAM, which at --max_batch_size=256 is gigabytes).
KV_BYTES_PER_TOKEN = {
    "synthetic:tiny": 2 * 5 * 32 * 4,
    "synthetic:15m": 2 * 6 * 288 * 4,
    "synthetic:110m": 2 * 12 * 768 * 4,
    "synthetic:1b": 2 * 22 * 256 * 4,
}
KV_BLOCK = 16


def _upper(int_range):
    """'16:512' -> 512, '32' -> 32."""
    return int(str(int_range).split(":")[-1])


def kv_cache_flag(model, max_batch_size, prompt_tokens, max_new_tokens):
    """--kv_cache_memory holding max_batch_size sequences of the longest
    request, plus a quarter for the block rounding and preempted requests."""
    per_token = KV_BYTES_PER_TOKEN.get(model)
    if per_token is None:
        return []
    positions = _upper(prompt_tokens) + _upper(max_new_tokens)
    blocks = max_batch_size * (-(-positions // KV_BLOCK)) * 5 // 4 + 4
    mib = -(-blocks * KV_BLOCK * per_token // (1 << 20))
    return ["--kv_cache_memory=%dMiB" % max(mib, 1)]


def length_label(lengths):
    """'16:512' -> 'uniform 16:512', '16:512:log' -> 'log-uniform 16:512'."""
    return ("log-uniform " + lengths[:-4]) if lengths.endswith(":log") else ("uniform " + lengths)
