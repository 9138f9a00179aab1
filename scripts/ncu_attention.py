"""One launch of each hd 128 attention kernel at the issue-3 goal shapes, for Nsight Compute.

    ncu --clock-control none --kernel-name regex:"fwd_kernel|dkdv_kernel|dq_kernel" \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
        --section WarpStateStats --section InstructionStats --print-details all python3 scripts/ncu_attention.py

Runs (B 4 x S 4096 causal, then B 1 x S 16384 full) forward twice each, then the causal backward
once (its dK/dV and dQ kernels). Pass ``fwd`` to skip the backward.
"""

import sys

import torch

from fuseformer.ops import attention as attn
from fuseformer.ops import attention_bwd as attn_bwd


def main() -> None:
    torch.manual_seed(0)
    for batch, seqlen, causal in ((4, 4096, True), (1, 16384, False)):
        q, k, v = (torch.randn(batch, seqlen, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        args = (q, k, v, None, None, seqlen, seqlen, 128**-0.5, -1, 0 if causal else -1)
        for _ in range(2):
            out, lse = attn.flash_attention_fwd(*args)
        torch.cuda.synchronize()
        if causal and "fwd" not in sys.argv[1:]:
            do = torch.randn_like(out)
            attn_bwd.flash_attention_bwd(do, q, k, v, out, lse, None, None, None, seqlen, seqlen, 128**-0.5, -1, 0)
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
