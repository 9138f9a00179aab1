"""Render benchmark JSON (from ``fuseformer bench``) as the Markdown tables kept in BENCHMARKS.md.

python -m fuseformer.bench.report OUT_DIR/ops.json [more.json ...]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def _env_line(env: dict) -> str:
    parts = [
        f"{env.get('date', '?')[:10]}",
        f"{env.get('gpu')}",
        f"torch {env.get('torch')}",
        f"Triton {env.get('triton')}",
        f"Liger-Kernel {env.get('liger_kernel')}",
        f"copy ceiling {env.get('copy_ceiling_tb_s', 0):.2f} TB/s",
        f"bf16 GEMM {env.get('gemm_ceiling_tflop_s', 0):.0f} TFLOP/s",
    ]
    return "Measured " + ", ".join(parts) + "."


def ops_markdown(data: dict) -> str:
    """One table per (op, shape): a row per impl with fwd and bwd TB/s and % of copy."""
    env, records = data["env"], data["records"]
    groups: dict[tuple, dict[str, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        groups[(r["op"], "x".join(map(str, r.get("shape", []))))][r["impl"]][r["pass_"]] = r
    lines = [_env_line(env), ""]
    lines.append(
        "| op | shape (bf16) | impl | fwd ms | fwd TB/s (% copy) | fwd graph TB/s | bwd ms | bwd TB/s (% copy) | bwd graph TB/s |"
    )
    lines.append("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for (op, shape), impls in groups.items():
        for impl, passes in impls.items():
            cells = []
            for p in ("fwd", "bwd"):
                r = passes.get(p)
                if r is None:
                    cells += ["", "", ""]
                elif "error" in r:
                    cells += ["error", r["error"][:40].replace("|", "/"), ""]
                else:
                    graph = f"{r['graph_tb_s']:.2f} ({r['graph_pct_copy']:.0f}%)" if "graph_tb_s" in r else ""
                    cells += [f"{r['ms']:.4f}", f"{r['tb_s']:.2f} ({r['pct_copy']:.0f}%)", graph]
            name = f"**{impl}**" if impl == "fuseformer" else impl
            lines.append(f"| {op} | {shape} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    for path in argv:
        with open(path) as f:
            data = json.load(f)
        if path.endswith("ops.json"):
            print(ops_markdown(data))
        else:
            print(_env_line(data["env"]))
            for r in data["records"]:
                print(json.dumps(r))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
