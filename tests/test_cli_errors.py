"""Issue 26 item 5: every ordinary CLI error is one line on stderr and a non-zero exit, no traceback
(`--debug` shows it). In-process via main(argv); the CLI never loads a model here."""

from __future__ import annotations

import pathlib
import socket

import pytest
import yaml

from kvserve.cli.main import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llama3-8b-l4.yaml"


def run_cli(capsys, *argv: str) -> tuple[int, list[str], str]:
    """(exit code, stderr lines, stdout) of `kvserve ARGV`."""
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.err.splitlines(), captured.out


def assert_one_error_line(rc: int, err: list[str], *names: str, code: int = 2) -> None:
    """`code`: 2 for an input the CLI cannot use (argparse's convention), 1 for a plan that does not fit."""
    assert rc == code, rc
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    for name in names:
        assert name in err[0], (name, err[0])


def test_render_missing_file(capsys, tmp_path):
    missing = str(tmp_path / "missing.yaml")
    rc, err, out = run_cli(capsys, "render", "-f", missing)
    assert_one_error_line(rc, err, missing, "No such file")
    assert out == ""


def test_render_yaml_syntax_error_names_file_and_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: [InferenceService\nspec: {}\n")
    rc, err, _ = run_cli(capsys, "render", "-f", str(bad))
    assert_one_error_line(rc, err, str(bad), "invalid YAML", "line ")


@pytest.mark.parametrize(
    ("section", "field"), [(None, "gatway"), ("engine", "maxNumSeqz")], ids=["top-level", "nested"]
)
def test_render_unknown_spec_field_is_named(capsys, tmp_path, section, field):
    doc = yaml.safe_load(EXAMPLE.read_text())
    (doc["spec"][section] if section else doc["spec"])[field] = 1
    path = tmp_path / "unknown.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc, err, out = run_cli(capsys, "render", "-f", str(path))
    dotted = "spec." + (f"{section}." if section else "") + field
    assert_one_error_line(rc, err, str(path), f"unknown field '{dotted}'")
    assert out == ""  # nothing rendered from a spec kubectl would refuse
    # the example itself renders cleanly (the check does not refuse known fields)
    assert main(["render", "-f", str(EXAMPLE)]) == 0
    assert capsys.readouterr().err == ""


def test_serve_missing_model_dir(capsys, tmp_path):
    missing = str(tmp_path / "no" / "such" / "dir")
    rc, err, _ = run_cli(capsys, "serve", missing)
    assert_one_error_line(rc, err, missing, "config.json")


def test_serve_port_in_use_is_said_before_loading(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # not loadable: the port check must come first
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        rc, err, _ = run_cli(capsys, "serve", str(tmp_path), "--host", "127.0.0.1", "--port", str(port))
    assert_one_error_line(rc, err, f"--port {port}", "already in use")
    assert "load" not in err[0]


def test_plan_that_does_not_fit_says_by_how_much_and_which_tp_fits(capsys):
    rc, err, out = run_cli(capsys, "plan", "--model", "llama-3-70b", "--gpu", "a100-80gb")
    assert_one_error_line(rc, err, "llama-3-70b", "a100-80gb", "GB over", "--tensor-parallel-size 2 would fit", code=1)
    assert "tensorParallelSize" not in err[0] and out == ""  # CLI flag names, not spec.* names; no table
    # the suggestion is right: TP 2 fits
    assert main(["plan", "--model", "llama-3-70b", "--gpu", "a100-80gb", "--tensor-parallel-size", "2"]) == 0
    capsys.readouterr()


def test_plan_that_no_tensor_parallel_size_fits_names_a_gpu_that_does(capsys):
    args = ["plan", "--model", "gemma-2-27b", "--gpu", "a10g", "--gpus-per-node", "2"]
    rc, err, out = run_cli(capsys, *args)
    assert_one_error_line(
        rc, err, "no --tensor-parallel-size up to --gpus-per-node 2 fits", "--gpu h100-80gb would fit", code=1
    )
    # the suggestion is right: that GPU fits at the same --tensor-parallel-size
    assert main(["plan", "--model", "gemma-2-27b", "--gpu", "h100-80gb", "--gpus-per-node", "2"]) == 0
    capsys.readouterr()


def test_debug_flag_shows_the_traceback(capsys, tmp_path):
    missing = str(tmp_path / "missing.yaml")
    rc = main(["--debug", "render", "-f", missing])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" in err and missing in err.splitlines()[-1]


def test_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvserve {metadata.version('kvserve')}"


def _bad_yaml(tmp_path) -> str:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: [InferenceService\nspec: {}\n")
    return str(bad)


def _unknown_field(tmp_path) -> str:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["gatway"] = 1
    path = tmp_path / "unknown.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize(
    ("argv", "code", "names"),
    [
        (lambda t: ["render", "-f", str(t / "missing.yaml")], 2, ["No such file"]),
        (lambda t: ["render", "-f", _bad_yaml(t)], 2, ["invalid YAML", "line 3"]),
        (lambda t: ["render", "-f", _unknown_field(t)], 2, ["unknown field 'spec.gatway'"]),
        (lambda t: ["serve", str(t / "no" / "dir")], 2, ["no config.json"]),
        (lambda t: ["plan", "--model", "llama-3-70b", "--gpu", "a100-80gb"], 1, ["--tensor-parallel-size 2 would fit"]),
    ],
    ids=["missing-file", "bad-yaml", "unknown-field", "missing-model-dir", "plan-does-not-fit"],
)
def test_the_installed_console_script_says_one_line(tmp_path, argv, code, names):
    """The same cases through the real `kvserve` process (its interpreter shutdown and logging included):
    exactly one stderr line, that exit code, no traceback, nothing on stdout."""
    import shutil
    import subprocess
    import sys

    script = shutil.which("kvserve", path=str(pathlib.Path(sys.executable).parent))
    assert script, "the kvserve console script is not installed next to this interpreter"
    proc = subprocess.run([script, *argv(tmp_path)], capture_output=True, text=True, timeout=120)
    assert_one_error_line(proc.returncode, proc.stderr.splitlines(), *names, code=code)
    assert proc.stdout == ""


def test_the_console_script_says_port_in_use_in_one_line(tmp_path):
    import shutil
    import subprocess
    import sys

    (tmp_path / "config.json").write_text("{}")
    script = shutil.which("kvserve", path=str(pathlib.Path(sys.executable).parent))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        proc = subprocess.run(
            [script, "serve", str(tmp_path), "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert_one_error_line(proc.returncode, proc.stderr.splitlines(), f"--port {port}", "already in use")
