"""Jinja rendering of kernel sources. Pure: the same context always yields the same text."""
from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

import jinja2


def templates_root() -> Path:
    return Path(str(resources.files("pagedattn.templates")))


def include_root() -> Path:
    """Folder added to NVRTC's include path: holds pagedattn/*.cuh."""
    return templates_root() / "include"


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_root())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def render(template: str, **context) -> str:
    """Render templates/<template> with the given context; any undefined name is an error."""
    return _env().get_template(template).render(**context)


@functools.lru_cache(maxsize=1)
def headers_digest() -> str:
    """sha256 over every shipped .cuh, so an edited header changes every cache key."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted(include_root().rglob("*.cuh")):
        h.update(path.relative_to(include_root()).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()
