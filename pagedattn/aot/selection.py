"""What a precompile run covers: the specs (by family, filters, preset, Hugging Face model configs or
exact `--variant` specs) and the archs.

Selection is generic over the registry: every family's variant space is its `SUPPORTED` fields, and the
CLI filters map onto fields by name where a family has them (FILTERS below). A family without a field
is not narrowed by that filter (the kv_write family has no head size, so `--head-sizes` leaves it whole).
"""
from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

# -- the selection vocabulary --------------------------------------------------------------------------


@dataclass(frozen=True)
class Filter:
    option: str            # CLI flag without dashes
    fields: tuple          # spec field names it narrows (the first one a family has)
    what: str


FILTERS = (
    Filter("dtypes", ("dtype",), "activation / query dtype"),
    Filter("kv_cache_dtypes", ("kv_cache_dtype",), "what the KV cache stores"),
    Filter("head_sizes", ("head_dim", "head_size"), "head size"),
    Filter("layouts", ("layout",), "KV cache layout"),
    Filter("features", ("features",), "attention feature set (none, window, window+softcap, ...)"),
)
FILTER_BY_OPTION = {f.option: f for f in FILTERS}

# `--preset NAME`: the one place a documented matrix is defined. A value a family does not support is
# dropped quietly (presets are wider than any one family); None means every supported value.
PRESETS: dict[str, dict] = {
    "default": {
        "doc": "fp16 and bf16; head sizes 64, 80, 96, 128, 256 (Llama 3.2 1B/Qwen2.5 0.5B, "
               "Phi-2/Pythia, Phi-3, Llama/Mistral/Qwen/Mixtral, Gemma); every KV cache dtype "
               "(auto, fp8_e4m3, fp8_e5m2); every layout; every registered family",
        "dtypes": ("fp16", "bf16"),
        "kv_cache_dtypes": None,
        "head_sizes": (64, 80, 96, 128, 256),
        "layouts": None,
        "features": ("none",),  # feature variants: --features window,window+softcap,... (or JIT)
    },
}

_DTYPE_ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32",
                  "float": "fp32"}
_KV_ALIASES = {"fp8": "fp8_e4m3", "fp8e4m3": "fp8_e4m3", "fp8e5m2": "fp8_e5m2"}


def _norm(option: str, value) -> str:
    text = str(value).strip()
    low = text.lower()
    if option == "dtypes":
        return _DTYPE_ALIASES.get(low, low)
    if option == "kv_cache_dtypes":
        return _KV_ALIASES.get(low, low)
    return low


class SelectionError(ValueError):
    """The command line names nothing, or something the registry does not support."""


# -- Hugging Face model configs -----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    path: str
    model_type: str | None
    head_size: int
    num_heads: int
    num_kv_heads: int
    dtype: str | None      # our short name, None when the config does not say

    def describe(self) -> str:
        group = self.num_heads // self.num_kv_heads if self.num_kv_heads else 0
        return (f"{Path(self.path).name}: {self.model_type or 'model'} head_size={self.head_size} "
                f"Hq={self.num_heads} Hkv={self.num_kv_heads} (group {group}) "
                f"dtype={self.dtype or 'unspecified'}")


def read_model_config(path) -> ModelConfig:
    """Head size (head_dim, else hidden_size / num_attention_heads), Hq, Hkv and dtype (torch_dtype,
    or `dtype` in newer transformers) of a Hugging Face config.json. Multimodal configs that keep the
    language model under `text_config` are read from there."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SelectionError(f"--model-config {path}: cannot read it ({exc})") from None
    if not isinstance(cfg, dict):
        raise SelectionError(f"--model-config {path}: not a JSON object")
    text = cfg.get("text_config")
    if isinstance(text, dict) and "num_attention_heads" not in cfg:
        cfg = {**cfg, **text}
    heads = cfg.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        raise SelectionError(f"--model-config {path}: no num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head = cfg.get("head_dim")
    if not head:
        hidden = cfg.get("hidden_size")
        if not isinstance(hidden, int) or hidden % heads:
            raise SelectionError(f"--model-config {path}: no head_dim, and hidden_size={hidden!r} "
                                 f"is not a multiple of num_attention_heads={heads}")
        head = hidden // heads
    raw = cfg.get("torch_dtype") or cfg.get("dtype")
    dtype = None
    if raw not in (None, "auto"):
        dtype = _norm("dtypes", str(raw).replace("torch.", ""))
        if dtype not in ("fp16", "bf16", "fp32"):
            raise SelectionError(f"--model-config {path}: torch_dtype={raw!r} is not one of "
                                 "float16, bfloat16, float32")
    return ModelConfig(str(path), cfg.get("model_type"), int(head), heads, int(kv_heads), dtype)


# -- specs <-> command line ---------------------------------------------------------------------------


def spec_fields(spec) -> dict:
    """A spec's fields by name, without those left at None (a family's default) and those outside the
    family's SUPPORTED matrix left at their default (e.g. kv_write's append=False)."""
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if getattr(spec, f.name) is not None
            and (f.name in spec.SUPPORTED or getattr(spec, f.name) != f.default)}


def format_variant(spec) -> str:
    """`family:field=value ...`, the --variant form (registry.precompile_command prints it)."""
    fields = " ".join(f"{name}={value}" for name, value in spec_fields(spec).items())
    return f"{spec.FAMILY}:{fields}"


def _convert(cls, name: str, text: str):
    allowed = cls.SUPPORTED.get(name)
    if allowed is not None:
        for value in allowed:
            if str(value) == text:
                return value
        for value in allowed:
            if str(value).lower() == text.lower():
                return value
        raise SelectionError(f"--variant {cls.FAMILY}: {name}={text!r} is not supported; supported: "
                             f"{', '.join(map(str, allowed))}")
    ftype = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    if ftype in (int, "int", "int | None"):
        return int(text)
    if ftype in (bool, "bool"):
        return text.lower() in ("1", "true", "yes")
    return text


def parse_variant(text: str):
    """The spec named by `family:field=value field=value` (commas also separate fields)."""
    from ..registry import FAMILIES, UnsupportedError

    family, sep, rest = text.partition(":")
    family = family.strip()
    if not sep or family not in FAMILIES:
        raise SelectionError(f"--variant {text!r}: expected 'family:field=value ...' with a family "
                             f"among {', '.join(FAMILIES)}")
    cls = FAMILIES[family]
    names = [f.name for f in dataclasses.fields(cls)]
    given: dict[str, str] = {}
    for token in rest.replace(",", " ").split():
        name, eq, value = token.partition("=")
        if not eq or name not in names:
            raise SelectionError(f"--variant {text!r}: {token!r} is not field=value with a field of "
                                 f"{family} ({', '.join(names)})")
        given[name] = value
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in given
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise SelectionError(f"--variant {text!r}: missing " + ", ".join(
            f"{n} (one of {', '.join(map(str, cls.SUPPORTED.get(n, ('?',))))})" for n in missing))
    try:
        return cls(**{n: _convert(cls, n, v) for n, v in given.items()})
    except UnsupportedError as exc:
        raise SelectionError(f"--variant {text!r}: {exc}") from None


def resolve_archs(text: str) -> list[str]:
    """`sm_80,sm_90a`, `all`, or `native` (the arch of every visible GPU, via arch_for_device)."""
    from ..codegen.compile import SUPPORTED_ARCHS

    out: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if item == "native":
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise SelectionError(
                    "--arch native: no CUDA GPU is visible here. Name the target(s) instead, e.g. "
                    f"--arch sm_90a (H100/H200) or --arch sm_80,sm_90a; supported: "
                    f"{', '.join(SUPPORTED_ARCHS)}")
            from ..registry import arch_for_device

            archs = [arch_for_device(i) for i in range(count)]
        elif item == "all":
            archs = list(SUPPORTED_ARCHS)
        elif item in SUPPORTED_ARCHS:
            archs = [item]
        else:
            raise SelectionError(f"--arch {item!r} is not supported; use native, all or a list of "
                                 f"{', '.join(SUPPORTED_ARCHS)}")
        for arch in archs:
            if arch not in out:
                out.append(arch)
    if not out:
        raise SelectionError("--arch names no target")
    return out


@dataclass
class Selection:
    specs: list
    notes: list[str] = field(default_factory=list)
    models: list[ModelConfig] = field(default_factory=list)


def _family_field(cls, flt: Filter) -> str | None:
    # fields, and the derived properties a family selects by (AttnFwdSpec.features)
    names = {f.name for f in dataclasses.fields(cls)} | set(cls.SUPPORTED)
    return next((n for n in flt.fields if n in names), None)


def select(*, ops=None, preset: str | None = None, filters: dict[str, list] | None = None,
           model_configs=(), variants=()) -> Selection:
    """The specs a precompile run covers. Per filter the values come from (later wins) the preset,
    the model configs (dtype, head size) and the explicit flags; explicit and model values must be
    supported by some selected family, preset values are intersected quietly."""
    from ..registry import FAMILIES

    filters = {k: v for k, v in (filters or {}).items() if v}
    if variants:
        if ops or preset or filters or model_configs:
            raise SelectionError("--variant selects exact variants; do not combine it with --ops, "
                                 "--preset, --model-config or the value filters")
        specs = []
        for text in variants:
            spec = parse_variant(text)
            if spec not in specs:
                specs.append(spec)
        return Selection(specs)

    ops = [o.strip() for o in (ops or []) if o.strip()]
    unknown = [o for o in ops if o not in FAMILIES]
    if unknown:
        raise SelectionError(f"--ops: unknown famil{'y' if len(unknown) == 1 else 'ies'} "
                             f"{', '.join(unknown)}; registered: {', '.join(FAMILIES)}")
    families = [FAMILIES[o] for o in (ops or FAMILIES)]
    sel = Selection([])

    wanted: dict[str, tuple[set[str], str | None]] = {}   # option -> (normalized values, source)
    # source None: a preset's values, intersected quietly; else the flag named in errors
    if preset is not None:
        if preset not in PRESETS:
            raise SelectionError(f"--preset {preset!r}: known presets: {', '.join(PRESETS)}")
        for option, values in PRESETS[preset].items():
            if option in FILTER_BY_OPTION and values is not None:
                wanted[option] = ({_norm(option, v) for v in values}, None)
    if model_configs:
        models = [m if isinstance(m, ModelConfig) else read_model_config(m) for m in model_configs]
        sel.models = models
        dtypes = {m.dtype for m in models if m.dtype}
        if dtypes:
            wanted["dtypes"] = (dtypes, "--model-config (dtype)")
        wanted["head_sizes"] = ({str(m.head_size) for m in models}, "--model-config (head size)")
    for option, values in filters.items():
        if option not in FILTER_BY_OPTION:
            raise SelectionError(f"unknown filter {option}")
        wanted[option] = ({_norm(option, v) for v in values}, "--" + option.replace("_", "-"))

    # check explicit values against what the selected families support
    for option, (values, flag) in wanted.items():
        flt = FILTER_BY_OPTION[option]
        strict = flag is not None
        having = [(cls, _family_field(cls, flt)) for cls in families]
        having = [(cls, name) for cls, name in having if name]
        if not having:
            if strict:
                sel.notes.append(f"{flag}: no selected family has a {'/'.join(flt.fields)} field; "
                                 "nothing is narrowed by it")
            continue
        known = {_norm(option, v) for cls, name in having for v in cls.SUPPORTED.get(name, ())}
        # a head size a family runs on a larger compiled one (attention: 72 on 80, 112 on 128) is no error
        bad = sorted(v for v in values - known
                     if not (option == "head_sizes" and v.isdigit() and
                             any(getattr(cls, "runs_head_size", lambda h: False)(int(v)) for cls, _ in having)))
        if strict and bad:
            fams = "; ".join(f"{cls.FAMILY}: {', '.join(map(str, cls.SUPPORTED.get(name, ())))}"
                             for cls, name in having)
            raise SelectionError(f"{flag}: {', '.join(bad)} not supported by any selected family "
                                 f"({fams})")

    for cls in families:
        narrow = []
        for option, (values, _) in wanted.items():
            name = _family_field(cls, FILTER_BY_OPTION[option])
            if name:
                narrow.append((name, option, values))
        for spec in cls.all_variants():
            if all(_matches(spec, name, option, values) for name, option, values in narrow):
                sel.specs.append(spec)
    if not sel.specs:
        raise SelectionError("no registered variant matches this selection "
                             "(see `pagedattn list` for each family's values)")
    return sel


def _matches(spec, name: str, option: str, values: set[str]) -> bool:
    """Whether a spec's field is one of a filter's values. Head sizes ask the family when it says which
    head sizes a variant serves (`serves_head_size`: attention runs some head sizes' prefills on a wider
    compiled tile), else the field."""
    serves = getattr(spec, "serves_head_size", None) if option == "head_sizes" else None
    if serves is not None:
        return any(serves(int(v)) for v in values if v.isdigit())
    return _norm(option, getattr(spec, name)) in values


def command_for(spec, arch: str, out) -> str:
    """The exact command that compiles one variant into a bundle (MissingKernelError's hint)."""
    return (f"pagedattn precompile --arch {arch} --variant {shlex.quote(format_variant(spec))} "
            f"--out {shlex.quote(str(out))}")
