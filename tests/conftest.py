"""Session-wide test configuration: markers that skip cleanly, and the path to ../shared/data."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    skip_shared = pytest.mark.skip(reason=f"needs ../shared/data beside the checkout ({SHARED_DATA} is absent)")
    has_gpu = _has_cuda()
    has_shared = SHARED_DATA.is_dir()
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "shared" in item.keywords and not has_shared:
            item.add_marker(skip_shared)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data; tests using it must also carry the `shared` marker so they skip without it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"needs ../shared/data ({SHARED_DATA} is absent)")
    return SHARED_DATA
