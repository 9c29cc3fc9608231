import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter (on the CPU); it must be chosen
# before the kernels are defined, i.e. before mhla.triton_ops is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen():
    """A fresh, randomly seeded generator per test: inputs are new draws every run.

    The seed is printed on failure (pytest shows captured stdout) so a failure can be replayed
    with MHLA_TEST_SEED.
    """
    seed = int(os.environ.get("MHLA_TEST_SEED", torch.seed() % (2**31)))
    print(f"MHLA_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="session")
def tiny_components():
    """The tiny random-weight model (``tiny-random``), loaded once per session and shared by the tests that
    generate with it; use it through a fixture that puts it back to ``flash`` (conversions only add parameters)."""
    from pipelines.loading import load_components

    return load_components("tiny-random", dtype="float32", device="cpu")
