"""``fuseformer info`` says what runs on this machine (issue 30 item 15): no "gluon on" or direct
launch where there is no sm_90 GPU, and the reason."""

import torch

from fuseformer.cli import main


def test_info_says_what_runs_here(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    gluon = next(line for line in out.splitlines() if line.startswith("gluon"))
    launch = next(line for line in out.splitlines() if line.startswith("launch"))
    assert "native" not in out
    if not torch.cuda.is_available():
        assert gluon.split()[1] == "off" and "no sm_90 GPU" in gluon or "Triton" in gluon
        assert launch.split()[1] == "kernel[grid]" and "(" in launch
