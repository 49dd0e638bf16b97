import os
import tempfile

import pytest

# Tests never touch the user's cache; each session gets its own unless the caller set one.
os.environ.setdefault("PAGEDATTN_CACHE_DIR", tempfile.mkdtemp(prefix="pagedattn-test-cache-"))

import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache dir and an empty in-memory front, restored afterwards."""
    from pagedattn.codegen import cache

    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path / "cache"))
    fresh = cache.KernelCache()
    monkeypatch.setattr(cache, "_CACHE", fresh)
    return fresh


@pytest.fixture
def pagedattn_log(caplog):
    """caplog sees the 'pagedattn' logger (it does not propagate to the root)."""
    import logging

    logger = logging.getLogger("pagedattn")
    logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.WARNING)
    yield caplog
    logger.removeHandler(caplog.handler)
