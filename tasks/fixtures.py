"""Small files in the real formats the full profiles read (CIFAR-10 pickles, HotpotQA JSON, GSM8K jsonl, AnnData
.h5ad, TSPLIB, MineLib, D4RL HDF5, AMASS .npz with an SMPL body model), written from a seeded generator.

Two users: the planner (`tasks/planning.py`) prepares a full profile on one of these when the real data is absent,
so the trace sees the real row shapes (32x32x3 CIFAR images, not the test profile's 8x8 stand-in); and the loader
tests (`tests/test_inputs.py`), which check each loader on the format its input declares. The values are random:
only the format and the shapes are real.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

# D4RL locomotion: (observation, action) sizes of the gymnasium env each file stands for
_D4RL_DIMS = {"Hopper": (11, 3), "HalfCheetah": (17, 6), "Walker2d": (17, 6), "Ant": (27, 8)}


def cifar(folder: Path, rows: int = 300) -> Path:
    """`cifar-10-batches-py`: pickled dicts of uint8 rows (3 x 32 x 32, channel-major) and integer labels."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in ("data_batch_1", "data_batch_2", "test_batch"):
        with open(folder / name, "wb") as fh:
            pickle.dump({b"data": rng.integers(0, 256, (rows, 3072), dtype=np.uint8),
                         b"labels": list(rng.integers(0, 10, rows))}, fh)
    return folder


def hotpot(folder: Path) -> Path:
    """HotpotQA's distractor JSON: question, answer, supporting facts, titled context paragraphs."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"_id": str(i), "question": f"Who wrote book {i}?", "answer": f"writer {i % 3}",
             "supporting_facts": [[f"book {i}", 0], [f"writer {i % 3}", 0]],
             "context": [[f"book {i}", [f"Book {i} is a novel.", f"It was written by writer {i % 3}."]],
                         [f"writer {i % 3}", ["A writer."]], ["other", ["Unrelated."]]]} for i in range(12)]
    (folder / "hotpot.json").write_text(json.dumps(rows))
    return folder / "hotpot.json"


def gsm8k(folder: Path, rows: int = 64) -> Path:
    """GSM8K's jsonl: {"question": a word problem, "answer": "reasoning ... #### n"}, questions of GSM8K's lengths
    (about 100 to 400 characters)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(rows):
        a, b = (int(v) for v in rng.integers(2, 90, 2))
        story = " ".join(f"Then she buys {int(v)} more." for v in rng.integers(1, 9, int(rng.integers(1, 9))))
        question = f"Natalia sold {a} clips in April and {b} in May. {story} How many clips did she sell in all?"
        lines.append(json.dumps({"question": question, "answer": f"{a} + {b} = {a + b}\n#### {a + b:,}"}))
    (folder / "test.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "test.jsonl"


def norman(folder: Path) -> Path:
    """AnnData's .h5ad layout (dense X of counts, categorical obs.condition), written with h5py."""
    import h5py

    folder.mkdir(parents=True, exist_ok=True)
    conds = ["ctrl", "A+ctrl", "B+ctrl", "C+ctrl", "A+B", "B+C", "A+C"]
    with h5py.File(folder / "norman.h5ad", "w") as f:
        f["X"] = np.random.default_rng(0).poisson(2, (70, 12)).astype(np.float32)
        col = f.create_group("obs").create_group("condition")
        col["codes"], col["categories"] = np.arange(70) % 7, np.array(conds, dtype=h5py.string_dtype())
    return folder / "norman.h5ad"


def tsp(folder: Path) -> Path:
    """A TSPLIB EUC_2D instance of 15 cities."""
    folder.mkdir(parents=True, exist_ok=True)
    xy = np.random.default_rng(0).uniform(0, 100, (15, 2))
    (folder / "t15.tsp").write_text("NAME : t15\nTYPE : TSP\nDIMENSION : 15\nEDGE_WEIGHT_TYPE : EUC_2D\n"
                                    "NODE_COORD_SECTION\n" + "".join(f"{i + 1} {x:.1f} {y:.1f}\n"
                                                                     for i, (x, y) in enumerate(xy)) + "EOF\n")
    return folder / "t15.tsp"


def minelib(folder: Path) -> Path:
    """A 4-block MineLib UPIT instance: .upit (header, OBJECTIVE_FUNCTION) and .prec (block, k, predecessors)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny.upit").write_text("% a MineLib-format fixture\nNAME: tiny\nTYPE: UPIT\nNBLOCKS: 4\n"
                                      "OBJECTIVE_FUNCTION:\n0 -1.0\n1 -2.0\n2 5.0\n3 1.0\nEOF\n")
    (folder / "tiny.prec").write_text("0 0\n1 0\n2 2 0 1\n3 1 1\n")
    return folder / "tiny.upit"


def d4rl(folder: Path, envs: tuple[str, ...] = ("Hopper-v5",), rows: int = 200) -> dict[str, str]:
    """One D4RL-layout HDF5 file per env id (observations, actions, rewards, terminals, timeouts)."""
    import h5py

    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for k, env in enumerate(envs):
        obs, act = _D4RL_DIMS.get(env.split("-")[0], (11, 3))
        rng = np.random.default_rng(k)
        path = folder / f"{env.split('-')[0].lower()}.hdf5"
        with h5py.File(path, "w") as f:
            f["observations"], f["actions"] = rng.standard_normal((rows, obs)), rng.uniform(-1, 1, (rows, act))
            f["rewards"], f["terminals"] = rng.random(rows), np.zeros(rows, bool)
            f["timeouts"] = np.arange(rows) % 100 == 99
        out[env] = str(path)
    return out


# SMPL's kinematic tree of the 22 body joints (pelvis, hips, spine, knees, ..., head 15, wrists 20 and 21), and a
# rest pose in AMASS's z-up frame (metres, offset of each joint from its parent; facing -y, so +x is the body's left)
_SMPL_PARENTS = (-1, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 12, 13, 14, 16, 17, 18, 19)
_SMPL_OFFSETS = ((0, 0, 0.93), (0.06, 0, -0.09), (-0.06, 0, -0.09), (0, 0, 0.11), (0.04, 0, -0.38), (-0.04, 0, -0.38),
                 (0, 0, 0.14), (0, 0.04, -0.4), (0, 0.04, -0.4), (0, 0, 0.06), (0, -0.12, -0.06), (0, -0.12, -0.06),
                 (0, 0, 0.21), (0.08, 0, 0.12), (-0.08, 0, 0.12), (0, -0.05, 0.09), (0.12, 0, 0.03), (-0.12, 0, 0.03),
                 (0.26, 0, 0), (-0.26, 0, 0), (0.25, 0, 0), (-0.25, 0, 0))


def smpl_body(folder: Path) -> Path:
    """A body-model .npz as motionmar's loader reads it: parents (22,), joints_template (22, 3) and the joints'
    shape directions joints_shapedirs (22, 3, 16)."""
    folder.mkdir(parents=True, exist_ok=True)
    rest = np.zeros((len(_SMPL_PARENTS), 3))
    for j, (parent, offset) in enumerate(zip(_SMPL_PARENTS, _SMPL_OFFSETS, strict=True)):
        rest[j] = (rest[parent] if parent >= 0 else 0) + np.asarray(offset)
    path = folder / "smpl_body_model.npz"
    np.savez(path, parents=np.asarray(_SMPL_PARENTS), joints_template=rest,
             joints_shapedirs=np.random.default_rng(0).normal(0, 0.005, (len(_SMPL_PARENTS), 3, 16)))
    return path


def amass(folder: Path, frames: int = 800) -> Path:
    """AMASS's layout: <subset>/<subject>/<take>_poses.npz with SMPL-H poses (T, 156) as axis-angles, trans (T, 3),
    betas (16,), dmpls (T, 8), gender and mocap_framerate (120 Hz). 800 frames: two 196-frame windows at the full
    profile's 60 fps in each of the four takes (two of which seed 0 holds out)."""
    rng = np.random.default_rng(0)
    t = np.arange(frames)[:, None] / 120.0
    for k, take in enumerate(("CMU/01/01_01", "CMU/02/02_03", "BMLrub/rub001/0001_walking1", "HDM05/bk/HDM_bk_01")):
        path = folder / f"{take}_poses.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        freq, phase, amp = rng.uniform(0.5, 2.0, 156), rng.uniform(0, 2 * np.pi, 156), rng.uniform(0, 0.3, 156)
        poses = amp * np.sin(2 * np.pi * freq * t + phase)  # (T, 156): smooth joint rotations
        poses[:, 2] += rng.uniform(-np.pi, np.pi)  # a heading about z (up)
        trans = np.cumsum(rng.normal(0, 0.01, (frames, 3)) * [1, 1, 0.1], 0)
        np.savez(path, poses=poses, trans=trans, betas=rng.normal(0, 1, 16), dmpls=rng.normal(0, 1, (frames, 8)),
                 gender=np.array("female" if k % 2 else "male"), mocap_framerate=np.array(120.0))
    return folder


Writer = Callable[[Path, Mapping[str, Any]], Any]  # (folder, the profile's params) -> the path key's new value

# paper -> (the full profile's data keys kept, the path key a fixture replaces, the fixture writer)
REAL_FORMAT: dict[str, tuple[tuple[str, ...], str, Writer]] = {
    "async_rag": (("dataset",), "dataset_path", lambda d, raw: str(hotpot(d))),
    "spectral_schedule": (("dataset",), "dataset_dir", lambda d, raw: str(cifar(d / "cifar"))),
    "perturbed_vae": (("dataset",), "dataset_dir", lambda d, raw: str(norman(d))),
    "qubo_relax": ((), "tsp_file", lambda d, raw: str(tsp(d))),
    "doit": ((), "d4rl", lambda d, raw: d4rl(d, tuple(raw.get("d4rl") or ("Hopper-v5",)))),
    "quantile_mia": (("dataset",), "dataset_dir", lambda d, raw: str(cifar(d / "cifar"))),
    "guda": (("dataset",), "dataset_dir", lambda d, raw: str(cifar(d / "cifar"))),
    "protovar": (("dataset",), "dataset_dir", lambda d, raw: str(cifar(d / "cifar"))),
    "fedgr": (("dataset",), "dataset_dir", lambda d, raw: str(cifar(d / "cifar"))),
    "motionmar": (("dataset",), "amass_dir", lambda d, raw: str(amass(d / "amass"))),
    "mad_uncertainty": (("dataset",), "jsonl_path", lambda d, raw: str(gsm8k(d / "gsm8k"))),
}
# paper -> further path keys its fixture replaces (a loader that opens more than one input), each with its writer
ALSO_WRITES: dict[str, dict[str, Writer]] = {"motionmar": {"body_model": lambda d, raw: str(smpl_body(d))},
                                             "qubo_relax": {"minelib_file": lambda d, raw: str(minelib(d / "mine"))}}


def real_format(paper_id: str, raw: Mapping[str, Any], folder: Path) -> dict[str, Any] | None:
    """The profile's data keys with its path key pointing at a fixture written into `folder` (None: no writer)."""
    if paper_id not in REAL_FORMAT:
        return None
    keys, path_key, write = REAL_FORMAT[paper_id]
    also = {key: more(folder, raw) for key, more in ALSO_WRITES.get(paper_id, {}).items()}
    return {**{k: raw[k] for k in keys if k in raw}, path_key: write(folder, raw), **also}
