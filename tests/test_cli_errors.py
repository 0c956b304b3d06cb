"""The command line ends every failure with one line on stderr and a non-zero exit; a traceback
only with --debug. Run in-process against a tiny model folder (`tiny_model_dir`)."""

from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
from collections import namedtuple

import pytest

from conftest import one_error_line, open_files_in, run_cli
from infinigen.cli import build_parser, main
from infinigen.errors import InputError


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n\t\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (tmp_path / "prompt.txt").write_text("The quick brown fox jumps over the lazy dog.")
    (tmp_path / "a-file").write_text("x")
    return tmp_path


# (arguments after `generate --model DIR`, with {tmp} for the files folder; status; what the line says)
INPUT_ERRORS = {
    "empty prompt file": (["--prompt-file", "{tmp}/empty.txt"], 2, "prompt file {tmp}/empty.txt is empty"),
    "blank prompt file": (["--prompt-file", "{tmp}/blank.txt"], 2, "prompt file {tmp}/blank.txt is empty"),
    "non-UTF-8 prompt file": (
        ["--prompt-file", "{tmp}/latin1.txt"],
        2,
        "prompt file {tmp}/latin1.txt is not UTF-8 text (invalid continuation byte at byte 3)",
    ),
    "prompt file is a directory": (["--prompt-file", "{tmp}"], 2, "prompt file {tmp} is a directory"),
    "missing prompt file": (["--prompt-file", "{tmp}/nope.txt"], 2, "prompt file {tmp}/nope.txt does not exist"),
    "empty --prompt": (["--prompt", ""], 2, "the prompt is empty"),
    "both prompts": (["--prompt", "a", "--prompt-file", "{tmp}/prompt.txt"], 2, "give --prompt or --prompt-file"),
    "unparsable flag value": (["--prompt", "a", "--alpha", "abc"], 2, "argument --alpha: alpha takes a number"),
    "unknown flag": (["--prompt", "a", "--bogus"], 2, "unrecognized arguments: --bogus"),
    "invalid setting": (["--prompt", "a", "--kv-dtype", "int8"], 2, "invalid configuration: kv_dtype must be one of"),
    "incompatible settings": (
        ["--prompt", "a", "--policy", "int4", "--tier", "disk"],
        2,
        "invalid configuration: policy 'int4': the int4 format keeps its packed KV in host RAM",
    ),
    "--kv-dir is a file": (
        ["--prompt", "a", "--tier", "disk", "--kv-dir", "{tmp}/a-file"],
        2,
        "KV directory {tmp}/a-file is not a directory",
    ),
    "missing --kv-dir": (
        ["--prompt", "a", "--tier", "disk", "--kv-dir", "{tmp}/no/such/dir"],
        2,
        "KV directory {tmp}/no/such/dir does not exist: create it (mkdir -p {tmp}/no/such/dir)",
    ),
    "prompt longer than the context": (
        ["--prompt", "x" * 4000, "--max-new-tokens", "200"],
        2,
        "prompt (4000 tokens) + max_new_tokens (200) exceeds the model's context of 4096",
    ),
    "damaged --skew-file": (
        ["--prompt", "a", "--skew-file", "{tmp}/latin1.txt", "--calibration-tokens", "64"],
        2,
        "skew artifact {tmp}/latin1.txt cannot be read",
    ),
    "pinned tier without CUDA": (["--prompt", "a", "--tier", "pinned"], 2, "the pinned tier needs a CUDA device"),
}


@pytest.mark.parametrize("case", INPUT_ERRORS, ids=list(INPUT_ERRORS))
def test_every_expected_error_is_one_line(case, files, tiny_model_dir, capsys):
    args, status, says = INPUT_ERRORS[case]
    if case == "pinned tier without CUDA":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    argv = ["generate", "--model", str(tiny_model_dir), "--quiet", "--max-new-tokens", "2"]
    argv += [a.replace("{tmp}", str(files)) for a in args]
    rc, out, err = run_cli(capsys, *argv)
    line = one_error_line(err)
    assert rc == status, err
    assert says.replace("{tmp}", str(files)) in line
    assert out == ""
    assert sorted(p.name for p in files.iterdir()) == ["a-file", "blank.txt", "empty.txt", "latin1.txt", "prompt.txt"]


def test_the_exact_skew_command_names_the_model(files, tiny_model_dir, capsys):
    bad = files / "bad.safetensors"
    bad.write_bytes(b"\0" * 100)
    rc, _, err = run_cli(
        capsys, "generate", "--model", str(tiny_model_dir), "--quiet", "--prompt", "a", "--skew-file", str(bad),
        "--partial-ratio", "0.5", "--calibration-tokens", "64",
    )  # fmt: skip
    line = one_error_line(err)
    assert rc == 2
    command = f"infinigen skew --model {tiny_model_dir} --partial-ratio 0.5 --calibration-tokens 64 --output {bad}"
    assert f"`{command}`" in line
    # ... and that command, run as printed, makes an artifact the first command then accepts.
    assert main(command.split()[1:] + ["--quiet"]) == 0
    capsys.readouterr()
    rc, out, err = run_cli(
        capsys, "generate", "--model", str(tiny_model_dir), "--quiet", "--prompt", "a", "--skew-file", str(bad),
        "--partial-ratio", "0.5", "--calibration-tokens", "64", "--max-new-tokens", "2",
    )  # fmt: skip
    assert rc == 0 and err == "" and "2 new tokens" in out


def test_a_skew_file_of_other_settings_is_kept_and_the_command_writes_beside_it(files, tiny_model_dir, capsys):
    """A sound artifact made for other settings is not the one to overwrite: the command printed
    computes this run's into a new file, and the run then takes that one."""
    given = files / "r05.safetensors"
    calibrate = ["skew", "--model", str(tiny_model_dir), "--quiet", "--calibration-tokens", "64"]
    assert main([*calibrate, "--partial-ratio", "0.5", "--output", str(given)]) == 0
    capsys.readouterr()
    before = given.read_bytes()
    run = ["generate", "--model", str(tiny_model_dir), "--quiet", "--prompt", "a", "--max-new-tokens", "2"]
    run += ["--partial-ratio", "0.3", "--calibration-tokens", "64"]
    rc, _, err = run_cli(capsys, *run, "--skew-file", str(given))
    line = one_error_line(err)
    beside = files / "r05-r0.3.safetensors"
    command = f"infinigen skew --model {tiny_model_dir} --partial-ratio 0.3 --calibration-tokens 64 --output {beside}"
    assert rc == 2 and "has partial_ratio=0.5" in line and "is kept" in line
    assert f"`{command}` and give --skew-file {beside}," in line
    assert main(command.split()[1:] + ["--quiet"]) == 0
    capsys.readouterr()
    assert given.read_bytes() == before
    rc, out, err = run_cli(capsys, *run, "--skew-file", str(beside))
    assert rc == 0 and err == "" and "2 new tokens" in out


def test_help_is_for_users(capsys):
    """What infinigen is, its commands and its exit statuses; one default per flag; every flag
    explained; --version."""
    from infinigen.cli import build_parser, version
    from infinigen.cli_settings import flag_help

    rc, out, _ = run_cli(capsys, "--help")
    assert rc == 0 and out.startswith("usage: infinigen")
    assert "KV cache lives in a slow tier" in out and "generate" in out and "`infinigen generate |" not in out
    exit_line = next(line for line in out.splitlines() if line.startswith("exit status:"))
    assert all(f"{code} " in exit_line for code in ("0", "2", "1", "130/143"))
    assert flag_help("budget", None).count("default") == 1
    assert flag_help("kv_dtype", "float16").endswith("bfloat16 (default: float16)")
    assert flag_help("tier", "disk").endswith("(default: disk)")
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in ("generate", "demo", "skew", "eval"):
        silent = [a.option_strings for a in commands[name]._actions if a.option_strings and not a.help]
        assert silent == [], name
    rc, out, _ = run_cli(capsys, "--version")
    assert rc == 0 and out.strip() == f"infinigen {version()}" and version()[0].isdigit()


def _subcommands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    """(command words, parser) of every command, the nested ones (bench decode, ...) included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, (*words, name))
    if words:
        yield words, parser


def _help_of_each_flag(text: str) -> dict[str, str]:
    """Each flag's help in a --help text (by its first option string), its wrapped lines joined."""
    helps: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        if match := re.match(r"  (-[-\w]+)", line):
            flag = match.group(1)
            helps[flag] = line
        elif flag and line.startswith("   "):
            helps[flag] += " " + line.strip()
        else:
            flag = None
    return helps


COMMANDS = {" ".join(words): parser for words, parser in _subcommands(build_parser())}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_with_a_default_says_it_in_help(command, capsys):
    """A default that is a value (not None, False or empty) is in the flag's --help; a setting's
    (suppressed in the parser: the config keeps it) is said in the setting's own help."""
    from infinigen.cli import shown_default
    from infinigen.config import setting_fields

    rc, out, _ = run_cli(capsys, *command.split(), "--help")
    assert rc == 0
    helps = {flag: "".join(text.split()) for flag, text in _help_of_each_flag(out).items()}  # wrapping undone
    checked = 0
    for action in COMMANDS[command]._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        flag, default = action.option_strings[0], action.default
        if default is argparse.SUPPRESS:
            if action.dest in setting_fields():
                assert "default" in helps[flag], flag
                checked += 1
        elif default is not None and default is not False and default not in ([], ""):
            assert f"(default:{shown_default(default)})".replace(" ", "") in helps[flag], (flag, default)
            checked += 1
    assert checked or command == "bench"


@pytest.mark.parametrize("what", ["non-UTF-8", "empty", "missing"])
def test_calibration_file_errors_name_the_file(what, files, tiny_model_dir, capsys):
    path = {"non-UTF-8": files / "latin1.txt", "empty": files / "empty.txt", "missing": files / "nope.txt"}[what]
    rc, _, err = run_cli(
        capsys, "skew", "--model", str(tiny_model_dir), "--quiet", "--calibration-file", str(path),
        "--output", str(files / "out.safetensors"),
    )  # fmt: skip
    assert rc == 2 and f"calibration file {path}" in one_error_line(err)
    assert not (files / "out.safetensors").exists()


def test_model_errors_are_one_line(tmp_path, tiny_model_dir, capsys):
    rc, _, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nowhere"), "--quiet", "--prompt", "a")
    assert rc == 2 and "not found" in one_error_line(err)
    rc, _, err = run_cli(capsys, "generate", "--model", str(tmp_path), "--quiet", "--prompt", "a")
    assert rc == 2 and "has no config.json" in one_error_line(err)
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_model_dir, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    rc, _, err = run_cli(capsys, "generate", "--model", str(damaged), "--quiet", "--prompt", "a")
    assert rc == 1 and f"cannot load the model in {damaged}" in one_error_line(err)


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_model_name_is_refused_not_taken_for_the_default(name, capsys, monkeypatch):
    from infinigen import loading

    def default_model(*args, **kwargs):
        raise AssertionError("the default model was resolved")

    monkeypatch.setattr(loading, "smollm2_gguf", default_model)
    rc, _, err = run_cli(capsys, "generate", "--model", name, "--quiet", "--prompt", "a")
    assert rc == 2 and "error: the model name is empty: give 'smollm2'" in one_error_line(err)
    with pytest.raises(InputError, match="the model name is empty"):
        loading.load_model(name)


def test_not_enough_space_is_one_line_before_the_model_runs(tmp_path, tiny_model_dir, capsys, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    rc, out, err = run_cli(
        capsys, "generate", "--model", str(tiny_model_dir), "--quiet", "--prompt", "a", "--policy", "full",
        "--tier", "disk", "--kv-dir", str(tmp_path),
    )  # fmt: skip
    line = one_error_line(err)
    assert rc == 1 and f"not enough free space in {tmp_path}" in line and "1000 free" in line
    assert list(tmp_path.iterdir()) == [] and open_files_in(tmp_path) == []


def test_a_disk_that_fills_during_the_run_is_one_line_and_nothing_is_left(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    """ENOSPC from the write call itself (the disk filled behind the reservation's back)."""
    real = os.pwrite
    writes = []

    def full_after_probe(fd, buf, offset):
        writes.append(offset)
        if len(writes) > 4:  # the first writes are the files' O_DIRECT probes
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", full_after_probe)
    rc, out, err = run_cli(
        capsys, "generate", "--model", str(tiny_model_dir), "--quiet", "--prompt", "x" * 300, "--policy", "full",
        "--tier", "disk", "--kv-dir", str(tmp_path), "--max-new-tokens", "40",
    )  # fmt: skip
    line = one_error_line(err)
    assert rc == 1 and f"the disk holding the KV files ({tmp_path}) is full" in line
    assert list(tmp_path.iterdir()) == [] and open_files_in(tmp_path) == []


@pytest.mark.parametrize("how", ["mount", "permissions"])
def test_a_read_only_kv_dir_is_one_line(how, tmp_path, tiny_model_dir, capsys, mount_tmpfs):
    if how == "mount":
        directory, says = mount_tmpfs("1m", readonly=True), "is on a read-only file system"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes through permissions")
        directory, says = tmp_path / "locked", "is not writable by this user"
        directory.mkdir(mode=0o555)
    rc, _, err = run_cli(
        capsys, "generate", "--model", str(tiny_model_dir), "--quiet", "--prompt", "a", "--policy", "full",
        "--tier", "disk", "--kv-dir", str(directory),
    )  # fmt: skip
    assert rc == 1 and f"KV directory {directory} {says}" in one_error_line(err)


def test_a_bug_is_one_line_that_points_at_debug(tiny_model_dir, capsys, monkeypatch):
    import infinigen.generation

    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch\nin some kernel")

    monkeypatch.setattr(infinigen.generation, "run_generation", broken)
    rc, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--quiet", "--prompt", "a")
    line = one_error_line(err)
    assert rc == 1
    assert line == (
        "error: internal error (RuntimeError: shape mismatch; in some kernel); run again with --debug for the traceback"
    )


def test_debug_shows_the_traceback(files, tiny_model_dir):
    with pytest.raises(InputError, match="is empty"):
        main(["generate", "--model", str(tiny_model_dir), "--prompt-file", str(files / "empty.txt"), "--debug"])
    with pytest.raises(InputError, match="is empty"):
        main(["--debug", "generate", "--model", str(tiny_model_dir), "--prompt-file", str(files / "empty.txt")])


def test_a_recalibrated_artifact_is_one_warning_line(tiny_model_dir, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    argv = ["generate", "--model", str(tiny_model_dir), "--quiet", "--prompt", "abc", "--max-new-tokens", "2"]
    argv += ["--calibration-tokens", "64"]
    assert main(argv) == 0
    capsys.readouterr()
    (cached,) = (tmp_path / "skew").glob("*.safetensors")
    cached.write_bytes(cached.read_bytes()[:-64])
    assert main(argv) == 0
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert line.startswith(f"warning: the cached skew artifact {cached} cannot be read (")
    assert line.endswith("): recalibrating and replacing it")
    assert "2 new tokens" in out


def test_the_one_time_conversion_says_so_on_stderr_so_stdout_stays_json(tmp_path, capsys):
    """`generate --json` prints one JSON object on stdout even on the run that converts the model:
    the conversion's line goes to stderr (here the GGUF is not a model, so it fails after saying it)."""
    from infinigen.loading import ModelLoadError, convert_gguf

    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError):
        convert_gguf(gguf, cache_dir=tmp_path / "cache", progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "converting broken.gguf to safetensors once" in err
