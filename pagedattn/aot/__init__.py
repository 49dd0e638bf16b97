"""Ahead-of-time compilation: compile, without a GPU, every kernel a deployment will use into a bundle.

NVRTC needs no GPU, so a CPU-only build stage can compile every kernel a deployment will use into a
relocatable bundle (codegen/bundle.py: DIR/manifest.json + DIR/kernels/*.cubin). At run time
PAGEDATTN_AOT_DIR=DIR is searched before the JIT cache, and PAGEDATTN_DISABLE_JIT=1 turns any miss into
a MissingKernelError naming the `pagedattn precompile ...` command that produces the missing kernel.

  selection.py  what a run covers: filters, presets, Hugging Face configs, `--variant` specs, archs
  build.py      the compile plan (one Job per spec and arch) and the runner that fills a bundle
The commands (`pagedattn precompile`, `pagedattn bundle verify`) are in pagedattn/aotcli.py.
"""
from __future__ import annotations

from .build import Job, Summary, default_jobs, plan, precompile
from .selection import FILTER_BY_OPTION, FILTERS, PRESETS, Filter, ModelConfig, Selection
from .selection import SelectionError, command_for, format_variant, parse_variant
from .selection import read_model_config, resolve_archs, select, spec_fields

__all__ = ["FILTERS", "FILTER_BY_OPTION", "PRESETS", "Filter", "Job", "ModelConfig", "Selection", "SelectionError",
           "Summary", "command_for", "default_jobs", "format_variant", "parse_variant", "plan", "precompile",
           "read_model_config", "resolve_archs", "select", "spec_fields"]
