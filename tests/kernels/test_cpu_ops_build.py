"""No compile stall (issue 43): with KVSERVE_CPU_OPS_BUILD=background (`kvserve serve`'s default) a CPU whose
compiled ops are not built yet starts on the pure-torch path at once while a separate process builds them into
$KVSERVE_CPU_OPS_DIR; the next start loads them. `kvserve build-ops` builds them ahead of time. A library of
other sources or another CPU (another name) never counts as built."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvserve.kernels import cpu_ops, cpu_ops_build
from kvserve.runtime import config
from kvserve.runtime.errors import InvalidParameter

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def fresh_choice(monkeypatch):
    """A process that has not chosen its CPU backend yet (the choice is made once per process)."""
    monkeypatch.setattr(config, "_DEFAULT_CPU", [])


def test_a_foreign_build_is_not_built_and_a_held_lock_starts_no_second_builder(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_OPS_DIR", str(tmp_path))
    name = cpu_ops.extension_name()
    foreign = name.rsplit("_", 1)[0] + "_00000000"  # the same CPU, other sources
    os.makedirs(tmp_path / foreign)
    (tmp_path / foreign / f"{foreign}.so").write_bytes(b"not ours")
    assert not cpu_ops.is_built()
    assert cpu_ops.build_directory() == str(tmp_path / name)
    (tmp_path / name / f"{name}.so").write_bytes(b"a build in progress")
    (tmp_path / name / "lock").write_text("")  # torch's FileBaton: a builder is at work
    assert not cpu_ops.is_built()
    proc, log_path = cpu_ops_build.start_background_build()
    assert proc is None and log_path == str(tmp_path / name / cpu_ops_build.LOG_NAME)


def test_a_bad_build_mode_names_the_variable(fresh_choice, monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_OPS_BUILD", "later")
    with pytest.raises(InvalidParameter) as info:
        config.default_cpu_backend()
    assert info.value.param == "KVSERVE_CPU_OPS_BUILD" and "wait, background" in str(info.value)


def test_background_build_starts_on_torch_at_once_then_the_next_start_uses_the_ops(
    tmp_path, fresh_choice, monkeypatch, caplog
):
    name = cpu_ops.extension_name()
    if not cpu_ops.load():
        pytest.skip(f"the compiled CPU ops do not build here: {cpu_ops.unavailable_reason()}")
    assert cpu_ops.extension_name() == name  # a build leaves the name alone (torch's load edits flag lists)
    monkeypatch.setenv("KVSERVE_CPU_OPS_DIR", str(tmp_path))
    monkeypatch.setenv("KVSERVE_CPU_OPS_BUILD", "background")
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="kvserve.runtime.config"):
        assert config.default_cpu_backend() == "torch"
    assert time.monotonic() - started < 5  # no compile in the way (a build takes 20-100 s)
    assert "building them in the background (pid" in caplog.text and "The next start uses them" in caplog.text
    assert not cpu_ops.is_built()
    deadline = time.monotonic() + 800
    while not cpu_ops.is_built() and time.monotonic() < deadline:
        time.sleep(1)
    log = (tmp_path / cpu_ops.extension_name() / cpu_ops_build.LOG_NAME).read_text()
    assert cpu_ops.is_built(), log
    assert "compiled CPU ops" in log and cpu_ops.library_path() in log
    monkeypatch.setattr(config, "_DEFAULT_CPU", [])  # the next start
    assert config.default_cpu_backend() == "cpu"
    # Ahead of time: `kvserve build-ops` finds it built (no compile) and says where it is.
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "build-ops", "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("kvserve build-ops: compiled CPU ops ") and cpu_ops.library_path() in proc.stdout
