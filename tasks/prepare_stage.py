"""The command a DVC `prepare` stage runs: `python -m tasks.prepare_stage <id> <params key> <out dir>`.

It reads `params.yaml` in the stage's working directory, validates the section named by the dotted key with the
paper's `Params`, and writes the paper's parquet tables into the output folder (emptied first, so a stage's output
is exactly what `prepare` wrote).

It runs torch on one thread: a data stage's tensors are small (MiniLM over short texts, generators), a second
thread's hand-offs cost more CPU than they save, and in a `--parallel` suite the other core is training another
paper.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from models import registry


def run_prepare(paper_id: str, params_key: str, out_dir: Path, params_path: Path = Path("params.yaml")) -> None:
    paper = registry.get(paper_id)
    section: object = registry.load_params_file(params_path, require_papers=False)
    for part in params_key.split("."):
        if not isinstance(section, dict) or part not in section:
            raise registry.ConfigError(f"{params_path}: missing section {params_key}")
        section = section[part]
    params = registry.validate(paper, section, where=params_key)  # type: ignore[arg-type]
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    paper.prepare(params, out_dir)
    if not any(out_dir.glob("*.parquet")):
        raise RuntimeError(f"{paper_id}.prepare wrote no parquet table into {out_dir}")


if __name__ == "__main__":
    from tasks.settings import configure_environment

    configure_environment()
    import torch

    torch.set_num_threads(1)
    try:
        run_prepare(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
    except registry.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
