"""coalesce-eval against live servers on stories260K-hf, checked against
Hugging Face transformers running the same folder:

* perplexity: the window plan (against this file's own implementation of the
  rule in tools/eval/scoring.h: every token after the first scored once), the
  token count (against `tokenizers`), and the summed negative
  log-likelihood (against transformers' log_softmax over the same windows);
* multiple choice: every choice's token count and summed log-probability
  (tokenized as lm-evaluation-harness does, here in Python), and the
  predictions and accuracies those scores give;
* greedy agreement: two identical servers agree on every token and never
  part; a server on slightly perturbed weights parts from the original where
  transformers' greedy tokens of the two models part;
* refusals: no server, malformed and hostile task files, a text that is not
  UTF-8, a window the context cannot hold: the right exit status and a
  message, never a crash.

Tolerance: a served log-probability is within 2e-4 of its row's largest
|logit| plus 1e-5 of transformers' (tests/service/logprob_check.py gives the
reason), so a sum over tokens is within the sum of its tokens' bounds; the
check computes that bound from the reference logits. An off-by-one window or
a token scored twice moves the sum by whole nats.

Needs torch and transformers (tests/requirements.txt): run it with the venv of
tools/make-venv.sh; ctest does, as eval_e2e.

Environment: COALESCE_SERVER, COALESCE_EVAL (the binaries), COALESCE_MODELS_DIR.
"""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "service"))
from e2e_support import MODELS, REPO, Server  # noqa: E402
from logprob_check import ABSOLUTE, RELATIVE  # noqa: E402

EVAL = os.environ.get("COALESCE_EVAL") or os.path.join(REPO, "build", "bin", "coalesce-eval")
HF_FOLDER = os.path.join(MODELS, "stories260K-hf")
STORY = os.path.join(HERE, "story.txt")
TASKS = os.path.join(REPO, "tools", "eval", "data", "commonsense.jsonl")
PROMPTS = os.path.join(REPO, "tools", "eval", "data", "prompts.jsonl")
EOS = 2
AGREE_TOKENS = 32


# ---------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        HF_FOLDER, torch_dtype=torch.float32, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(HF_FOLDER)
    return model, tokenizer


@pytest.fixture(scope="module")
def server():
    if not os.path.exists(EVAL):
        pytest.fail("coalesce-eval not found: %s (set COALESCE_EVAL)" % EVAL)
    s = Server(["--batch_window=20ms"], model_flags=["--model=" + HF_FOLDER])
    yield s
    s.kill()


def run_eval(args, expect_rc=0, timeout=120):
    cmd = [EVAL, "--progress=false"] + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == expect_rc, "%s\nexit %d\nstdout:\n%s\nstderr:\n%s" % (
        " ".join(cmd), r.returncode, r.stdout, r.stderr)
    return r


def run_json(args):
    return json.loads(run_eval(list(args) + ["--format=json", "--per_item"]).stdout)


def scored_logprobs(model, ids, positions):
    """transformers' log-probability of ids[i] for each i in positions (all
    >= 1), from one forward pass over ids; and the tolerance of their sum."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lsm = torch.log_softmax(logits, dim=-1)
    bound = RELATIVE * logits.abs().max(dim=-1).values + ABSOLUTE
    total = sum(float(lsm[i - 1, ids[i]]) for i in positions)
    return total, sum(float(bound[i - 1]) for i in positions)


def plan_windows(n, window, stride):
    """tools/eval/scoring.h's rule, written again: the first window scores
    tokens 1.. of [0, min(n, W)); each next one ends `stride` further (or at
    n), begins W before its end, and scores what the previous did not."""
    end = min(n, window)
    plan = [(0, end, 1)]
    while end < n:
        nxt = min(n, end + stride)
        plan.append((nxt - window, nxt, end))
        end = nxt
    return plan


def hf_greedy(model, ids, steps):
    """transformers' greedy tokens, to EOS inclusive (the server stops there)."""
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(torch.argmax(model(torch.tensor([ids])).logits[0, -1])))
            ids.append(out[-1])
            if out[-1] == EOS:
                break
    return out


# ---------------------------------------------------------------------------
# Perplexity
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("window,stride", [(64, 24), (0, 0)], ids=["w64_s24", "default"])
def test_perplexity_equals_transformers_over_the_same_windows(server, reference, window, stride):
    model, tokenizer = reference
    text = open(STORY, encoding="utf-8").read()
    args = ["--server=" + server.address, "--text=" + STORY, "--concurrency=4"]
    if window:
        args += ["--window=%d" % window, "--stride=%d" % stride]
    report = run_json(args)["perplexity"]

    ids = tokenizer(text).input_ids
    assert report["tokens"] == len(ids)
    assert report["bytes"] == len(text.encode("utf-8")) == report["file_bytes"]
    w = window or 511  # stories260K's context is 512: a prompt plus one new token
    s = stride or w // 2
    assert (report["window"], report["stride"]) == (w, s)
    plan = plan_windows(len(ids), w, s)
    assert [tuple(x) for x in report["window_plan"]] == plan
    assert len(plan) == report["windows"]
    if window:
        assert len(plan) > 10  # the sliding really happens
    # Every token but the first is scored exactly once.
    scored = [i for b, e, sb in plan for i in range(sb, e)]
    assert scored == list(range(1, len(ids)))
    assert report["scored_tokens"] == len(ids) - 1

    nll, bound = 0.0, 0.0
    for (b, e, sb), got in zip(plan, report["window_nll"]):
        lp, bd = scored_logprobs(model, ids[b:e], range(sb - b, e - b))
        assert abs(got + lp) <= bd, ((b, e, sb), got, -lp, bd)
        nll -= lp
        bound += bd
    assert sum(report["window_nll"]) == pytest.approx(report["nll"], rel=1e-12)
    err = abs(report["nll"] - nll)
    print("nll %.6f, transformers %.6f, difference %.3g (bound %.3g)"
          % (report["nll"], nll, err, bound))
    assert err <= bound
    mean = nll / (len(ids) - 1)
    assert report["mean_nll"] == pytest.approx(report["nll"] / report["scored_tokens"], rel=1e-12)
    assert report["perplexity"] == pytest.approx(math.exp(mean), rel=bound / len(ids) + 1e-9)
    assert report["bits_per_byte"] == pytest.approx(
        report["nll"] / math.log(2) / report["bytes"], rel=1e-12)


def test_max_bytes_scores_the_first_bytes(server, reference):
    _, tokenizer = reference
    report = run_json(["--server=" + server.address, "--text=" + STORY, "--max_bytes=200"])
    text = open(STORY, encoding="utf-8").read()
    assert report["perplexity"]["bytes"] == 200
    assert report["perplexity"]["tokens"] == len(tokenizer(text[:200]).input_ids)


# ---------------------------------------------------------------------------
# Multiple choice
# ---------------------------------------------------------------------------

def argmax(values):
    return max(range(len(values)), key=lambda i: (values[i], -i))


def test_multiple_choice_equals_transformers(server, reference):
    model, tokenizer = reference
    items = [json.loads(line) for line in open(TASKS, encoding="utf-8") if line.strip()]
    report = run_json(["--server=" + server.address, "--tasks=" + TASKS, "--concurrency=8"])
    mc = report["multiple_choice"]
    assert mc["items"] == len(items) == len(mc["per_item"])
    correct = {"acc": 0, "acc_norm": 0, "acc_per_token": 0}
    worst = 0.0
    for item, got in zip(items, mc["per_item"]):
        assert got["answer"] == item["answer"]
        context = item["context"].rstrip(" ")
        moved = item["context"][len(context):]
        context_ids = tokenizer(context).input_ids
        sums, bounds = [], []
        for choice, got_choice in zip(item["choices"], got["choices"]):
            whole = tokenizer(context + moved + choice).input_ids
            n = len(whole) - len(context_ids)
            assert got_choice["tokens"] == n, (item, choice)
            assert got_choice["bytes"] == len(choice.encode("utf-8"))
            total, bound = scored_logprobs(model, whole, range(len(context_ids), len(whole)))
            err = abs(got_choice["logprob"] - total)
            assert err <= bound, (item, choice, got_choice["logprob"], total, bound)
            worst = max(worst, err)
            sums.append(total)
            bounds.append(bound)
        lengths = [len(c.encode("utf-8")) for c in item["choices"]]
        tokens = [c["tokens"] for c in got["choices"]]
        for key, scores, field in (
                ("acc", sums, "prediction"),
                ("acc_norm", [x / b for x, b in zip(sums, lengths)], "prediction_norm"),
                ("acc_per_token", [x / t for x, t in zip(sums, tokens)], "prediction_per_token")):
            want = argmax(scores)
            # The same prediction, unless the two scores are closer than the
            # tolerance allows to tell apart.
            if got[field] != want:
                assert abs(scores[got[field]] - scores[want]) <= 2 * max(bounds), (item, key)
            correct[key] += got[field] == item["answer"]
    print("worst choice log-likelihood difference %.3g" % worst)
    for key in correct:
        assert mc[key]["correct"] == correct[key], key
        assert mc[key]["accuracy"] == pytest.approx(correct[key] / len(items))
    # stories260K knows a little of the world: better than a random choice of 4.
    assert mc["acc"]["accuracy"] > 0.25


# ---------------------------------------------------------------------------
# Greedy agreement
# ---------------------------------------------------------------------------

def perturbed_copy(tmp_path, model):
    """stories260K-hf with every weight scaled by 1 + 3% noise (fixed seed):
    a model that should at first follow the original and then part from it,
    as a lower precision does."""
    generator = torch.Generator().manual_seed(7)
    copy = transformers.AutoModelForCausalLM.from_pretrained(
        HF_FOLDER, torch_dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for _, p in sorted(copy.named_parameters()):
            p.mul_(1 + 0.03 * torch.randn(p.shape, generator=generator))
    folder = tmp_path / "perturbed"
    copy.save_pretrained(str(folder), safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json"):
        shutil.copy(os.path.join(HF_FOLDER, f), folder)
    return folder, copy


def test_identical_servers_agree_and_perturbed_weights_part(server, reference, tmp_path):
    model, tokenizer = reference
    prompts = [json.loads(line)["prompt"] for line in open(PROMPTS, encoding="utf-8")][:8]
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    folder, copy = perturbed_copy(tmp_path, model)
    twin = Server(["--batch_window=20ms"], model_flags=["--model=" + HF_FOLDER])
    other = Server(["--batch_window=20ms"], model_flags=["--model=%s" % folder])
    try:
        common = ["--server=" + server.address, "--prompts=%s" % prompt_file,
                  "--max_new_tokens=%d" % AGREE_TOKENS, "--concurrency=8"]
        same = run_json(common + ["--agree_with=" + twin.address])["agreement"]
        parted = run_json(common + ["--agree_with=" + other.address])["agreement"]
    finally:
        twin.kill()
        other.kill()

    # Two identical servers: every token identical, no parting.
    assert same["prompts"] == len(prompts)
    assert same["compared_tokens"] > len(prompts)
    assert same["identical_tokens"] == same["compared_tokens"]
    assert same["token_share"] == 1.0
    assert same["identical_prompts"] == len(prompts) and same["parted_prompts"] == 0
    assert same["earliest_parting"] is None and same["mean_first_parting"] is None

    # The perturbed server: each prompt's tokens are transformers' greedy
    # tokens of each model, and the agreement is what those tokens give.
    compared = identical = 0
    partings = []
    for prompt, got in zip(prompts, parted["per_prompt"]):
        ids = tokenizer(prompt).input_ids
        a, b = hf_greedy(model, ids, AGREE_TOKENS), hf_greedy(copy, ids, AGREE_TOKENS)
        assert got["tokens"] == a, prompt
        assert got["other_tokens"] == b, prompt
        n = max(len(a), len(b))
        same_at = [i < len(a) and i < len(b) and a[i] == b[i] for i in range(n)]
        first = next((i for i, s in enumerate(same_at) if not s), None)
        assert got["first_parting"] == first, prompt
        assert got["identical"] == sum(same_at) and got["compared"] == n
        compared += n
        identical += sum(same_at)
        if first is not None:
            partings.append(first)
    assert partings, "the perturbed model never parted: the check would prove nothing"
    assert parted["token_share"] == pytest.approx(identical / compared)
    assert parted["token_share"] < 1.0
    assert parted["earliest_parting"] == min(partings)
    assert parted["mean_first_parting"] == pytest.approx(sum(partings) / len(partings))
    assert parted["parted_prompts"] == len(partings)


# ---------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------

def test_no_server_is_exit_3():
    r = run_eval(["--server=127.0.0.1:1", "--tasks=" + TASKS, "--wait_for_server=0.5s"],
                 expect_rc=3)
    assert "no coalesce server answered at 127.0.0.1:1" in r.stderr


HOSTILE_LINES = [
    "{\"context\": \"a\", \"choices\": [\"x\"], \"answer\": 0}",
    "{\"context\": \"a\", \"choices\": [\"x\", \"y\"], \"answer\": 99999999999999999999999}",
    "{\"context\": \"a\", \"choices\": [\"x\", \"y\"], \"answer\": -1}",
    "{\"context\": {\"a\": 1}, \"choices\": [\"x\", \"y\"], \"answer\": 0}",
    "{\"context\": \"a\", \"choices\": [[\"x\"], \"y\"], \"answer\": 0}",
    "[" * 200000 + "]" * 200000,
    "{\"context\": \"a\", \"choices\": [\"x\", \"y\"], \"answer\": 0",
    "\x00\x01\x02",
]


@pytest.mark.parametrize("line", HOSTILE_LINES, ids=range(len(HOSTILE_LINES)))
def test_hostile_task_files_are_refused_before_any_request(line, tmp_path):
    good = json.dumps({"context": "The sky is", "choices": [" blue", " red"], "answer": 0})
    path = tmp_path / "tasks.jsonl"
    path.write_text(good + "\n" + line + "\n")
    # No server at all: the file is refused before one is asked.
    r = run_eval(["--server=127.0.0.1:1", "--tasks=%s" % path], expect_rc=2)
    assert ("%s line 2: " % path) in r.stderr, r.stderr


def test_bad_bytes_and_windows_are_refused(server, tmp_path):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"Once upon a time\xff\xfe")
    r = run_eval(["--server=" + server.address, "--text=%s" % binary], expect_rc=2)
    assert "not valid UTF-8" in r.stderr
    r = run_eval(["--server=" + server.address, "--text=" + STORY, "--window=512"], expect_rc=2)
    assert "does not fit the context of 512 tokens" in r.stderr
    r = run_eval(["--server=" + server.address, "--text=" + STORY, "--window=8", "--stride=8"],
                 expect_rc=2)
    assert "stride" in r.stderr
    r = run_eval(["--server=" + server.address], expect_rc=2)
    assert "nothing to measure" in r.stderr
    r = run_eval(["--server=" + server.address, "--tasks=%s" % (tmp_path / "missing")],
                 expect_rc=2)
    assert "cannot read" in r.stderr
