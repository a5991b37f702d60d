"""Smoke tests that keep every maintained tool in scripts/ working: each Python script imports and answers --help,
each shell script parses (and device_train.sh rejects a bad arm before it touches an accelerator), and the C++
of the CPU floor compiles.  A new script is added to KEPT with its check; a probe whose answer is recorded goes
(git history keeps it).  Seconds in all: the scripts run in this process, none measures anything.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shutil
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
PYTHON = ["bench_ab.py", "cpu_roofline.py", "kernel_chain_ab.py", "kernel_step_ab.py", "kflat_ab.py",
          "llamacpp_ab.py", "profile_step.py", "startup_bench.py"]
SHELL = ["device_check.sh", "device_stage.sh", "device_train.sh"]
CPP = ["cpu_roofline.cc"]
KEPT = PYTHON + SHELL + CPP


def test_scripts_holds_the_maintained_tools_only():
    assert sorted(os.listdir(SCRIPTS)) == sorted(KEPT)  # a new tool gets a check here, a finished probe goes
    assert len(KEPT) <= 12


@pytest.mark.parametrize("name", PYTHON)
def test_python_script_answers_help(name, monkeypatch):
    path = os.path.join(SCRIPTS, name)
    monkeypatch.setattr(sys, "argv", [path, "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # a script may put scripts/ on it
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        runpy.run_path(path, run_name="__main__")
    assert exit_.value.code in (0, None)
    assert out.getvalue().startswith("usage:"), out.getvalue()[:200]


@pytest.mark.parametrize("name", KEPT)
def test_script_says_when_and_how_to_use_it(name):
    with open(os.path.join(SCRIPTS, name)) as fh:
        text = fh.read()
    head = text[:3000]
    if name.endswith(".py"):
        assert text.startswith('"""'), "a module docstring first"
        assert f"python scripts/{name}" in head, "the docstring shows the command"
    elif name.endswith(".sh"):
        assert text.startswith("#!/usr/bin/env bash\n#"), "a header comment after the shebang"
        assert f"scripts/{name}" in head
    else:
        assert text.startswith("//")
    assert not re.search(r"\bsession \d|\bsessions \d|recipe\d", text, re.IGNORECASE)


@pytest.mark.parametrize("name", SHELL)
def test_shell_script_parses(name):
    subprocess.run(["bash", "-n", os.path.join(SCRIPTS, name)], check=True)


def test_device_train_rejects_a_bad_arm_before_starting(tmp_path):
    for args, message in ((["nope"], "unknown arm nope"), (["regen", "init"], "unknown arm regen"),
                          (["regen"], "PROMPTS=DIR")):
        r = subprocess.run(["bash", os.path.join(SCRIPTS, "device_train.sh"), "out", "target.gguf", "1", *args],
                           cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PROMPTS": ""})
        assert r.returncode != 0 and message in r.stdout + r.stderr, (args, r.stdout, r.stderr)
        assert not (tmp_path / "out" / "run.log").exists()  # nothing ran on a device


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_cpu_roofline_cc_compiles():
    kernels = os.path.join(os.path.dirname(SCRIPTS), "src", "specjax", "kernels")
    flags = subprocess.run(["g++", "-march=native", "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True,
                           text=True).stdout
    if "__AVX2__" not in flags and "__AVX512F__" not in flags:
        pytest.skip("the kernels' vector header needs AVX-512F or AVX2 + FMA")
    subprocess.run(["g++", "-fsyntax-only", "-std=c++17", "-march=native", "-pthread", f"-I{kernels}",
                    os.path.join(SCRIPTS, "cpu_roofline.cc")], check=True)
