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
synthetic or a simulator), or because the paper's public benchmark is not wired yet, which the reason then says
("NOT <benchmark>"). `PARTLY_SYNTHETIC` says what a full profile with inputs still generates.
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
    # synthetic by the spec: the paper's own setting is generated
    "icl_bayes_gap": "synthetic by the spec: in-context regression on drawn tasks (d = 20, K = 5, M up to 2^20)",
    "induction_smoothing": "synthetic by the spec: Markov-chain sequences drawn in prepare",
    "opo_cmdp": "synthetic by the spec: random tabular constrained MDPs and feature maps",
    "eralign": "synthetic by the spec: generated text-attributed graph pairs with swept homophily (the TAG-folder "
               "loader reads real pairs with --set dataset=folder folders=[...])",
    "skeleton_llm": "synthetic by the spec: 8 actions in 3 joint formats with the rationale facts the claim needs "
                    "(NTU RGB+D / Kinetics-skeleton give labels only: --set source=ntu data_root=...)",
    "pb_sac": "simulators, packaged: gymnasium classic control and MuJoCo (Hopper, HalfCheetah, Walker2d); "
              "nothing to download",
    # a public benchmark the spec names is not read: said here, and in the module's docstring
    "pacer": "synthetic SEMs up to d = 2,000 (the spec's scale study); NOT Sachs (loader wired: --set "
             "dataset=sachs dataset_dir=...) nor CausalBench Perturb-seq (no .h5ad loader in this module yet)",
    "mint": "synthetic gridworlds in the spirit of MiniGrid; NOT the minigrid package, Atari Pac-Man or Isaac "
            "(the method's observations and goals are built on the synthetic world)",
    "dila": "synthetic sprite videos with known actions (the metrics need them); NOT BridgeData V2: no "
            "trajectory-folder loader yet",
    "vfm_forecast": "synthetic sprite videos with per-pixel labels on every frame; NOT Cityscapes with DINOv2: no "
                    "Cityscapes loader and no DINOv2 weights",
    "causal_forcing": "synthetic latent clips from a teacher trained in the pipeline; NOT Wan2.1-T2V-1.3B latents "
                      "(the Self Forcing ODE-pair reader load_ode_pairs is tested but no Wan2.1 student fits here)",
    "phaselock": "synthetic bouncing-ball videos with true trajectories (the physics metric needs them); NOT "
                 "Physics-IQ (the reader load_physics_iq is tested, but Physics-IQ gives no trajectories)",
    "t3_video": "synthetic sprite videos; the paper's 4K clips are not public (the clip-folder loader reads your "
                "own: --set clip_dir=...)",
    "sslogic": "synthetic puzzle families generated in prepare; NOT SynLogic / KORBench (the JSONL suite loader "
               "reads converted files with --set dataset=jsonl eval_path=...)",
    "repa_p": "Darcy flow and electrostatics solved in prepare; NOT the PIDM Darcy, channel-flow or topology "
              "data (no loaders yet)",
    "tbik": "synthetic token streams and a small LM trained in the pipeline; NOT a 1B-class open-weight "
            "checkpoint (no safetensors loader yet)",
    "token_sparse_attention": "synthetic retrieval sequences; NOT RULER / LongBench / InfiniteBench on "
                              "Llama-3.1-8B (no loaders or checkpoint yet)",
}

# papers whose full profile reads declared inputs but still generates part of what the spec names
PARTLY_SYNTHETIC: dict[str, str] = {
    "guda": "CIFAR-10 class groups only: the spec's 10 digit groups run in smoke, its 30 style groups are not built",
    "qubo_relax": "the knapsack instances stay generated (uniform, n = 1,000): Pisinger's instances are not wired",
    "doit": "the classic-control tasks are generated offline data; D4RL covers the MuJoCo medium sets "
            "(medium-replay / medium-expert via --set d4rl=...)",
    "async_rag": "HotpotQA only (2WikiMultihopQA / MuSiQue: --set dataset=2wiki|musique dataset_path=...)",
    "perturbed_vae": "Norman et al. 2019 gives no true causal latents: the rho_inv sweep and MCC are synthetic-only",
    "sei": "images from disk, but not open_clip's RN50 (no such architecture or weights here): MiniLM prompts and "
           "an image tower trained in the pipeline",
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
