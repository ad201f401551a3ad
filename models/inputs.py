"""Real data a profile reads from disk: what it declares, what is present, and how to bring the rest in.

A (full) profile declares its inputs in `params.yaml` (`inputs: {name: {path, format, url, license, sha256}}`,
`models.contract.InputSpec`); `paperline data <id>` lists them and `require_present` refuses a run whose inputs are
missing before any work starts (exit 2, with the commands that bring them in). Real data enters DVC like any stage
input: the `prepare` stage of the run depends on every declared path (`tasks/data.py`), so replacing the data
reruns it. Nothing here downloads anything.

A relative input path is relative to the project root (`PAPERLINE_ROOT`, else this checkout), never to the current
directory: a variant's `prepare` stage runs inside `variants/<id>/<profile>-<hash>/`. Loaders open their paths
through `input_path` for that reason.

`SYNTHETIC` names the papers whose full profile reads no file, and why: by the spec (the paper's setting is
synthetic or a simulator), or because the paper's public benchmark is not wired yet, which the reason then says.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from models.contract import InputSpec, PaperParams

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# single-file formats `dvc import-url` brings in as they are; archives and landing pages need a manual step
_ARCHIVES = (".tar", ".tar.gz", ".tgz", ".zip", ".tar.bz2", ".7z", ".gz")
_FILES = (".h5", ".hdf5", ".json", ".jsonl", ".tsv", ".csv", ".parquet", ".npz", ".npy", ".sdf", ".txt", ".pt",
          ".pth", ".safetensors", ".h5ad", ".pkl")

# paper id -> why its full profile reads no file from disk (shown by `paperline data`; tests/test_inputs.py checks
# that every paper either declares inputs in its full profile or stands here, never both)
SYNTHETIC: dict[str, str] = {
    "icl_bayes_gap": "synthetic by the spec: the paper's setting is in-context regression on drawn tasks",
    "induction_smoothing": "synthetic by the spec: Markov-chain sequences drawn in prepare",
    "opo_cmdp": "synthetic by the spec: random tabular constrained MDPs",
    "repa_p": "synthetic by the spec: Darcy flow and electrostatics fields solved in prepare (the PIDM Darcy, "
              "channel-flow and topology-optimisation loaders are not wired yet)",
    "tbik": "synthetic by the spec: token streams drawn in prepare; the 1B-class checkpoint of the paper is not wired",
    "token_sparse_attention": "synthetic by the spec at this size: retrieval-style sequences drawn in prepare "
                              "(RULER / LongBench on Llama-3.1-8B are not wired)",
    "sslogic": "synthetic by the spec: logic-puzzle families generated in prepare (SynLogic / KORBench loaders "
               "exist but the full profile does not read them)",
    "eralign": "synthetic by the spec: 5 generated graphs with swept homophily",
    "guda": "synthetic digit and style groups (the spec's CIFAR-10 stage is not wired into the full profile yet)",
    "pb_sac": "simulators: gymnasium classic control and MuJoCo (Hopper, HalfCheetah, Walker2d), both packaged: "
              "nothing to download",
    "mint": "synthetic gridworlds in the spirit of MiniGrid (NOT the minigrid package the spec names: it is not a "
            "project dependency; Atari Pac-Man and Isaac are out of scope)",
    "dila": "synthetic sprite videos (NOT BridgeData V2: the per-trajectory JPEG loader is not written yet)",
    "pacer": "synthetic SEM graphs (NOT Sachs / Perturb-seq: the per-condition CSV loader exists but is not wired "
             "into the full profile)",
    "vfm_forecast": "synthetic moving-object videos (NOT Cityscapes with DINOv2: no Cityscapes loader is written)",
    "causal_forcing": "synthetic latent clips (the Self Forcing ODE-pair loader exists but Wan2.1 latents are not "
                      "declared as an input)",
    "phaselock": "synthetic physics videos (the Physics-IQ reader exists but is not declared as an input)",
    "t3_video": "synthetic sprite videos (the clip-folder loader exists; set clip_dir and declare it to use real "
                "clips)",
}


def project_root() -> Path:
    """Same rule as `tasks.settings.root` (a paper module must not import `tasks`)."""
    return Path(os.environ.get("PAPERLINE_ROOT", _PACKAGE_ROOT)).resolve()


def input_path(path: str | Path) -> Path:
    """An input path as a loader opens it: absolute as given, relative to the project root otherwise."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else project_root() / p


@dataclass(frozen=True)
class InputStatus:
    name: str
    spec: InputSpec
    path: Path      # absolute
    present: bool   # exists (a folder: not empty)
    tracked: bool   # a `<path>.dvc` file versions it (dvc add / dvc import-url)

    def how(self) -> list[str]:
        """Commands (and the one manual step, where there is one) that bring this input in."""
        return how_to_get(self.name, self.spec)


def _shown(path: str) -> str:
    return path if Path(path).is_absolute() else path.rstrip("/")


def how_to_get(name: str, spec: InputSpec) -> list[str]:
    """`dvc import-url` for a directly downloadable file, else: get it from the URL, put it at the path, `dvc add`."""
    url, path = spec.url.strip(), _shown(spec.path)
    tail = url.split("?")[0].rstrip("/").lower()
    direct = url and not tail.endswith(_ARCHIVES) and (tail.endswith(_FILES) or url.startswith(("s3://", "gs://")))
    if direct and not Path(spec.path).is_absolute():
        return [f"dvc import-url {url} {path}"]
    where = f"from {url}" if url else "(no public URL: bring your own copy)"
    unpack = " and unpack it" if tail.endswith(_ARCHIVES) else ""
    steps = [f"get {name} {where}{unpack} so that {path} holds it ({spec.format})"]
    if not Path(spec.path).is_absolute():
        steps.append(f"dvc add {path}")
    return steps


def statuses(params: PaperParams | Mapping) -> list[InputStatus]:
    """Every declared input of a profile (validated params, or a raw params.yaml section) and whether it is there."""
    raw = params.inputs if isinstance(params, PaperParams) else (params.get("inputs") or {})
    out = []
    for name, spec in raw.items():
        spec = spec if isinstance(spec, InputSpec) else InputSpec.model_validate(spec)
        path = input_path(spec.path)
        present = path.is_file() or (path.is_dir() and any(path.iterdir()))
        out.append(InputStatus(name, spec, path, present, Path(f"{path}.dvc").exists()))
    return out


def missing_message(paper_id: str, missing: list[InputStatus]) -> str:
    lines = [f"{paper_id}: {len(missing)} input(s) of this profile are not on disk "
             f"(`paperline data {paper_id}` lists them):"]
    for s in missing:
        lines.append(f"  {s.name}: {s.spec.path} ({s.spec.format})" + (f", license {s.spec.license}"
                                                                       if s.spec.license else ""))
        lines += [f"    {step}" for step in s.how()]
    return "\n".join(lines)


def require_present(paper_id: str, params: PaperParams | Mapping) -> None:
    """Raise ConfigError (bad user input: exit 2 before any work) naming every missing input and how to get it."""
    missing = [s for s in statuses(params) if not s.present]
    if missing:
        from models.registry import ConfigError  # lazily: the registry imports the contract, not this module

        raise ConfigError(missing_message(paper_id, missing))
