"""The ``fuseformer`` command as users meet it: ``python -m fuseformer``, help texts written for
users, and user errors reported as one line with exit code 2 (no traceback)."""

import argparse
import os
import subprocess
import sys

import pytest
import torch

from fuseformer.cli import build_parser, main

_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the error is about a machine without CUDA")


def test_python_m_fuseformer():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "fuseformer", "--help"], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert "usage: fuseformer" in run.stdout and "generate" in run.stdout and "train" in run.stdout


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_help_texts_are_for_users():
    """No reST markup or notes for developers in the top-level, generate and train help; every
    flag of generate and train has help that gives its default."""
    top = build_parser().format_help()
    assert "``" not in top and "COMMAND --help" in top
    for name in ("generate", "train"):
        p = _subparser(name)
        text = p.format_help()
        assert "``" not in text and "add_train_parser" not in text and "cli.py" not in text, name
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and "(default: " in action.help, (name, action.option_strings)


@_no_cuda
def test_bench_tune_without_gpu_is_a_clear_error(capsys):
    assert main(["bench", "--tune"]) == 2
    err = capsys.readouterr().err
    assert "--tune needs a CUDA GPU" in err and "Traceback" not in err


@_no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_generate_device_cuda_without_cuda_is_a_clear_error(device, capsys):
    assert main(["generate", "hi", "--device", device]) == 2
    assert f"--device {device}: no CUDA device is available" in capsys.readouterr().err


def test_generate_bad_device_and_threads(capsys):
    assert main(["generate", "hi", "--device", "cuda:x"]) == 2
    assert "--device must be cpu, cuda or cuda:N" in capsys.readouterr().err
    assert main(["generate", "hi", "--device", "cpu", "--threads", "0"]) == 2
    assert "--threads must be at least 1" in capsys.readouterr().err


def test_train_model_missing_directory(tmp_path, capsys):
    assert (
        main(["train", "--model", str(tmp_path / "nowhere"), "--data", str(tmp_path), "--out-dir", str(tmp_path / "o")])
        == 2
    )
    err = capsys.readouterr().err
    assert "nowhere is not a directory" in err and "Traceback" not in err
