"""The real server on a Hugging Face model folder (stories260K-hf: config.json,
model.safetensors, tokenizer.json): the public goldens through gRPC, alone and
batched, with the tokenizer of the folder.

    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/service/test_hf_server_e2e.py
"""

import json
import os
import shutil

import grpc
import pytest

from e2e_support import MODELS, run_concurrently, start_server

HF_DIR = os.path.join(MODELS, "stories260K-hf")


@pytest.fixture(scope="module")
def hf_srv(pb):
    server, client = start_server(["--batch_window=20ms"], model_flags=["--model=" + HF_DIR])
    client.bind(pb)
    yield client
    server.kill()


def test_model_info_comes_from_the_folder(hf_srv):
    info = hf_srv.info()
    assert info.name == "stories260K-hf"
    assert info.path == HF_DIR
    assert info.architecture == "llama"
    assert (info.vocab_size, info.context_length) == (512, 512)
    assert list(info.eos_token_ids) == [2]  # generation_config.json
    assert info.bos_token_id == 1
    assert not info.synthetic


def test_goldens_alone_and_batched(hf_srv, golden):
    c = hf_srv
    reqs = [c.request(prompt=case["prompt"], max_new_tokens=len(case["output_ids"]))
            for case in golden]
    for case, req in zip(golden, reqs):
        # tokenizer.json encodes the prompt exactly as tok512.bin does.
        assert c.tokenize(case["prompt"], True) == case["prompt_ids"]
        alone = c.generate(req)
        assert alone.code is None, alone
        assert alone.ids == case["output_ids"]
        assert alone.text == case["completion_text"]
        assert c.detokenize(case["prompt_ids"] + case["output_ids"]) == case["text"]
    # Both goldens with six other requests in the same batches.
    others = [c.request(prompt=p, max_new_tokens=60)
              for p in ("Tim", "The sun", "A cat sat", "Mom and Dad", "Ben ran", "Sue")]
    results = run_concurrently([lambda r=r: c.generate(r) for r in reqs + others])
    for case, res in zip(golden, results):
        assert res.code is None and res.ids == case["output_ids"], res
    assert all(r.code is None for r in results)


def test_an_empty_prompt_needs_a_tokenizer_that_adds_bos(pb, tmp_path):
    """The folder's tokenizer.json without its post-processor adds no BOS: an
    empty prompt then encodes to no tokens and is refused, saying why; text
    and ids still work."""
    folder = tmp_path / "no-bos"
    shutil.copytree(HF_DIR, folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    server, c = start_server([], model_flags=["--model=" + str(folder)])
    try:
        c.bind(pb)
        res = c.generate(c.request(prompt="", max_new_tokens=4))
        assert res.code == grpc.StatusCode.INVALID_ARGUMENT, res
        assert "no BOS" in res.details, res
        assert c.generate(c.request(prompt="Once", max_new_tokens=4)).code is None
        assert c.generate(c.request(ids=[1, 403], max_new_tokens=4)).code is None
    finally:
        server.kill()
