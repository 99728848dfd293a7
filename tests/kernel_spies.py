"""Spies on the kernels' builders, shared by the lowering tests (CPU) and the model-level GPU tests."""

import inspect


def spy_mosaic_builds(monkeypatch):
    """Record the arguments (by name; defaults not filled in) of every Mosaic attention kernel the wrapper builds:
    a list that fills as it lowers."""
    from pallas_kernels.sparse_attention import gpu_mosaic

    built, real = [], gpu_mosaic._build
    bind = inspect.signature(real).bind
    monkeypatch.setattr(gpu_mosaic, "_build", lambda *a, **kw: built.append(bind(*a, **kw).arguments) or real(*a, **kw))
    return built
