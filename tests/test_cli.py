"""The `pagedattn` command line (CPU only, nothing compiled): argparse conventions, info, list, cache,
bundle verify, bench --out, grammar and --help examples (issue 19, item 5)."""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedattn import __version__, cli, envs
from pagedattn.codegen.cache import write_entry
from pagedattn.info import plural

LONG = "attn_fwd_bf16_kvauto_d128_decodetma_window_softcap_alibi_sinks"


def run(capsys, *argv) -> tuple[int, str, str]:
    """main(argv) in this process: (exit code, stdout, stderr); argparse's exits count as returns."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _entry(root: Path, variant: str, arch: str = "sm_90a", age_days: float = 0.0) -> Path:
    folder = root / f"{variant}-{arch}-0123456789abcdef"
    write_entry(folder, key="k" * 64, material={}, variant=variant, arch=arch, cubin=b"\x7fELF cubin",
                source="// x", options=[], seconds=0.1, origin="jit")
    if age_days:
        meta = json.loads((folder / "meta.json").read_text())
        meta["created"] = time.time() - age_days * 86400
        (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.fixture
def cache_root(fresh_cache, monkeypatch) -> Path:
    monkeypatch.delenv("PAGEDATTN_AOT_DIR", raising=False)
    return Path(os.environ["PAGEDATTN_CACHE_DIR"])


# -- conventions ---------------------------------------------------------------------------------
def test_version(capsys):
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.startswith(f"pagedattn {__version__} (")


@pytest.mark.parametrize("argv, usage", [
    (["cache", "ls", "--bogus"], "usage: pagedattn cache ls"),
    (["cache", "clear", "--bogus"], "usage: pagedattn cache clear"),
    (["info", "--bogus"], "usage: pagedattn info"),
    (["list", "--bogus"], "usage: pagedattn list"),
    (["bundle", "verify", "DIR", "--bogus"], "usage: pagedattn bundle verify"),
    (["precompile", "--bogus"], "usage: pagedattn precompile"),
    (["bench", "--bogus"], "usage: pagedattn bench"),
    (["bench", "report", "--bogus"], "usage: pagedattn bench report"),
])
def test_unknown_flag_prints_the_subcommands_usage(capsys, argv, usage):
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert err.startswith(usage) and "unrecognized arguments: --bogus" in err


def test_words_after_options_join_the_trailing_list():
    """`list attn_fwd -v kv_write` reads as `list attn_fwd kv_write -v` (argparse alone refuses the word
    after the option); a word where no list argument takes it is still refused."""
    parser = cli.build_parser()
    args = cli.parse(parser, ["list", "attn_fwd", "-v", "kv_write"])
    assert args.family == ["attn_fwd", "kv_write"] and args.verbose
    args = cli.parse(parser, ["list", "-v", "attn_fwd"])
    assert args.family == ["attn_fwd"] and args.verbose
    with pytest.raises(SystemExit) as info:
        cli.parse(parser, ["info", "--json", "stray"])
    assert info.value.code == 2


def _commands(parser, path=()):
    for p, child in cli._walk(parser):
        yield " ".join(p), child


def test_every_subcommand_help_has_an_example(capsys):
    parser = cli.build_parser()
    paths = dict(_commands(parser))
    assert {"info", "list", "cache ls", "cache clear", "cache verify", "precompile", "bundle verify",
            "bench", "bench compare", "bench ab", "bench report"} <= set(paths)
    for path, child in paths.items():
        text = child.format_help()
        assert "examples:\n  pagedattn " in text, f"`pagedattn {path} --help` has no example"


def test_help_keeps_example_lines_and_wraps_descriptions(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    rc, out, _ = run(capsys, "cache", "clear", "--help")
    assert rc == 0
    assert "\n  pagedattn cache clear --older-than 30 --yes\n" in out
    assert all(len(line) <= 80 for line in out.splitlines())


def test_no_traceback_when_the_reader_goes_away():
    """`pagedattn list -v | head -1`: the first line, no BrokenPipeError traceback."""
    code = f"{sys.executable} -m pagedattn.cli list -v | head -1"
    r = subprocess.run(["bash", "-c", f"set -o pipefail; {code}"], capture_output=True, text=True,
                       timeout=300)
    assert r.stdout.startswith("kv_write: ") and r.stdout.count("\n") == 1
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr
    assert r.returncode == 141  # as a tool killed by SIGPIPE


def test_grammar():
    assert plural(1, "kernel") == "1 kernel" and plural(2, "kernel") == "2 kernels"
    assert plural(1, "entry", "entries") == "1 entry" and plural(0, "entry", "entries") == "0 entries"


# -- info / list ---------------------------------------------------------------------------------
def test_info_json(capsys, cache_root):
    rc, out, _ = run(capsys, "info", "--json")
    assert rc == 0
    info = json.loads(out)
    assert info["pagedattn"] == __version__ and info["cache"]["dir"] == str(cache_root)
    assert "torch" in info["packages"] and isinstance(info["gpus"], list)


def test_info_text_names_knobs(capsys, cache_root):
    rc, out, _ = run(capsys, "info")
    assert rc == 0 and f"knobs: PAGEDATTN_CACHE_DIR={cache_root}" in out
    assert "(0 entries," in out


def test_list_unknown_family_is_exit_2(capsys):
    rc, _, err = run(capsys, "list", "no_such_family")
    assert rc == 2 and "unknown family no_such_family" in err


# -- cache ls ------------------------------------------------------------------------------------
def test_cache_ls_empty_says_so(capsys, cache_root):
    rc, out, _ = run(capsys, "cache", "ls")
    assert rc == 0 and out.startswith(f"no kernels in {cache_root}")


def test_cache_ls_piped_shows_whole_names(capsys, cache_root, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")  # ignored when piped: nothing is cut
    _entry(cache_root, LONG)
    _entry(cache_root, "kv_write_bf16_auto_span", arch="sm_80")
    rc, out, _ = run(capsys, "cache", "ls")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["variant", "arch", "size", "age", "origin", "ok"]
    assert any(line.startswith(LONG + " ") and line.split()[1] == "sm_90a" for line in lines)
    assert lines[-1].startswith("2 kernels, ")


@pytest.mark.parametrize("columns, stacked", [(120, False), (70, True)])
def test_cache_ls_tty_fits_the_terminal_and_keeps_names_whole(capsys, cache_root, monkeypatch,
                                                              columns, stacked):
    """Wide terminal: one row per kernel. Narrow: the whole name on its line, details below."""
    _entry(cache_root, LONG)
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    rc, out, _ = run(capsys, "cache", "ls")
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)  # rich's colours
    assert rc == 0
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= columns
    (name_line,) = [line for line in lines if LONG in line]  # on one line, not folded
    assert ("sm_90a" in name_line) is not stacked
    if stacked:
        details = lines[lines.index(name_line) + 1].split()
        assert details[0] == "sm_90a" and details[-2:] == ["jit", "yes"]
    assert "1 kernel, " in out


def test_cache_ls_json(capsys, cache_root):
    folder = _entry(cache_root, LONG)
    rc, out, _ = run(capsys, "cache", "ls", "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["cache_dir"] == str(cache_root) and data["aot_dirs"] == []
    (row,) = data["kernels"]
    assert row["variant"] == LONG and row["arch"] == "sm_90a" and row["origin"] == "jit"
    assert row["ok"] is True and row["path"] == str(folder) and row["size"] > 0


# -- cache clear ---------------------------------------------------------------------------------
def test_cache_clear_dry_run_removes_nothing(capsys, cache_root):
    old = _entry(cache_root, "kv_write_bf16_auto_span", age_days=40)
    new = _entry(cache_root, LONG)
    rc, out, _ = run(capsys, "cache", "clear", "--older-than", "30", "--dry-run")
    assert rc == 0 and f"would remove {old}" in out and str(new) not in out
    assert "would remove 1 cache entry, " in out
    assert old.exists() and new.exists()


def test_cache_clear_yes(capsys, cache_root):
    old = _entry(cache_root, "kv_write_bf16_auto_span", age_days=40)
    new = _entry(cache_root, LONG)
    rc, out, _ = run(capsys, "cache", "clear", "--older-than", "30", "--yes")
    assert rc == 0 and "removed 1 cache entry from" in out
    assert not old.exists() and new.exists()


def test_cache_clear_without_a_tty_needs_yes(capsys, cache_root, monkeypatch):
    entry = _entry(cache_root, LONG)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    rc, _, err = run(capsys, "cache", "clear")
    assert rc == 2 and "--yes" in err and entry.exists()


@pytest.mark.parametrize("answer, removed", [("y\n", True), ("\n", False), ("no\n", False)])
def test_cache_clear_asks_on_a_tty(capsys, cache_root, monkeypatch, answer, removed):
    entry = _entry(cache_root, LONG)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or answer.strip())
    rc, out, _ = run(capsys, "cache", "clear")
    assert asked and asked[0].endswith("[y/N] ") and "1 cache entry" in asked[0]
    assert entry.exists() is not removed
    assert rc == (0 if removed else 1)


def test_cache_clear_of_an_empty_cache(capsys, cache_root):
    rc, out, _ = run(capsys, "cache", "clear", "--yes")
    assert rc == 0 and out.startswith("nothing to remove")


def test_cache_verify_grammar(capsys, cache_root):
    _entry(cache_root, LONG)
    rc, out, _ = run(capsys, "cache", "verify")
    assert rc == 0 and "1 entry checked, 0 corrupt" in out


# -- bundle verify / bench -----------------------------------------------------------------------
def test_bundle_verify_of_a_missing_folder_is_exit_2(capsys, tmp_path):
    missing = tmp_path / "no_bundle"
    rc, out, err = run(capsys, "bundle", "verify", str(missing))
    assert rc == 2 and out == ""
    assert err.startswith("usage: pagedattn bundle verify") and f"{missing}: no such folder" in err


def test_bench_out_default_does_not_depend_on_the_working_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    parser = cli.build_parser()
    expected = tmp_path / "data" / "pagedattn" / "bench" / "results"
    assert envs.bench_results_dir() == expected
    assert Path(parser.parse_args(["bench"]).out) == expected
    assert Path(parser.parse_args(["bench", "report"]).results) == expected
    assert Path(parser.parse_args(["bench", "--out", "perf/results"]).out) == Path("perf/results")
    help_text = dict(_commands(parser))["bench"].format_help()
    assert "XDG_DATA_HOME" in help_text


def test_bench_out_default_without_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert envs.bench_results_dir() == tmp_path / ".local" / "share" / "pagedattn" / "bench" / "results"


@pytest.mark.parametrize("jobs", ["0", "-3", "two"])
def test_precompile_refuses_jobs_below_one(capsys, jobs):
    rc, _, err = run(capsys, "precompile", "--arch", "sm_90a", "--dry-run", "--jobs", jobs)
    assert rc == 2 and "--jobs" in err and "usage: pagedattn precompile" in err


def test_precompile_of_a_variant_the_arch_does_not_build_is_an_error(capsys):
    """An explicit --variant that the chosen arch does not build says where it is built (not '0 kernels')."""
    variant = "attn_fwd:dtype=bf16 kv_cache_dtype=auto head_dim=128 mode=prefill_ws"
    rc, out, err = run(capsys, "precompile", "--arch", "sm_80", "--variant", variant, "--dry-run")
    assert rc == 2 and "attn_fwd_bf16_kvauto_d128_prefillws is not built for sm_80 (it is for: sm_90a)" in err
    assert "0 kernels" not in out
    rc, out, _ = run(capsys, "precompile", "--arch", "sm_90a", "--variant", variant, "--dry-run")
    assert rc == 0 and "dry run: 1 kernel (" in out
