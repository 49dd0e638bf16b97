"""Jinja rendering of kernel sources. Pure: the same context always yields the same text."""
from __future__ import annotations

import functools
import re
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


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.MULTILINE)


@functools.lru_cache(maxsize=None)
def _includes_of(rel: str) -> tuple[str, ...]:
    """Quoted includes of one shipped header that resolve to shipped headers (relative paths)."""
    text = (include_root() / rel).read_text()
    return tuple(i for i in _INCLUDE.findall(text) if (include_root() / i).is_file())


@functools.lru_cache(maxsize=4096)
def headers_digest(source: str) -> str:
    """sha256 over the shipped headers a source includes, directly or through other shipped headers
    (quoted includes found under include_root()), so editing a header changes the cache keys of
    exactly the kernels that compile it."""
    import hashlib

    seen: set[str] = set()
    todo = [i for i in _INCLUDE.findall(source) if (include_root() / i).is_file()]
    while todo:
        rel = todo.pop()
        if rel not in seen:
            seen.add(rel)
            todo.extend(_includes_of(rel))
    h = hashlib.sha256()
    for rel in sorted(seen):
        h.update(rel.encode())
        h.update((include_root() / rel).read_bytes())
    return h.hexdigest()
