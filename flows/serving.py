"""Each run's trained model as an MLflow model: a pyfunc whose context restores the paper's trained networks.

`log_run_model(paper_id, run_id)` packs the run's `outputs/` (what train saved, including every training phase's
network, `network.<phase>.pt`, and its EMA copy `network.<phase>.ema.pt` where the phase keeps one, written by
`TrainContext.fit`) into an MLflow pyfunc model under the run's `model/` artifact, with explicit pip requirements
(no requirement inference at log time: seconds). The model registry's versions point at it, so

    model = mlflow.pyfunc.load_model("models:/paperline-sei@champion-smoke")
    model.unwrap_python_model().networks      # {"detect": LockStep(...), "downstream": LockStep(...)}
    model.predict(table)                      # where the paper's method is a predictor

Loading needs the paperline package importable (the networks are pickled by reference to their classes in
`models/<id>.py`). `predict` runs the paper's trained method on a table in the format of the paper's data where the
method is a predictor (PREDICTORS below: sei's classifier, spectral_schedule's sampler given a seed); elsewhere it
raises "no predict for this paper".
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch

from tasks import tracking

MODEL_ARTIFACT = "model"  # the pyfunc model's folder among the run's artifacts
NETWORK_PREFIX = "network."  # outputs/network.<phase>.pt: one per ctx.fit phase


EMA_SUFFIX = ".ema.pt"  # outputs/network.<phase>.ema.pt: the EMA copy of a phase that keeps one


def load_networks(outputs: Path, ema: bool = False) -> dict[str, torch.nn.Module | dict]:
    """The trained networks a run saved, by training phase: the module itself, or (a module that could not be
    pickled) its state dict; `ema`: the EMA copies of the phases that keep one, by the same phase names."""
    networks = {}
    for path in sorted(outputs.glob(f"{NETWORK_PREFIX}*.pt")):
        if path.name.endswith(EMA_SUFFIX) != ema:
            continue
        saved = torch.load(path, map_location="cpu", weights_only=False)
        phase = path.name.removeprefix(NETWORK_PREFIX).removesuffix(EMA_SUFFIX if ema else ".pt")
        networks[phase] = saved["module"].eval() if "module" in saved else saved["state_dict"]
    return networks


class PaperModel(mlflow.pyfunc.PythonModel):
    """A paper's trained model. After `load_context`: `networks` (phase -> module), `ema_networks` (phase -> the
    EMA copy, for phases that keep one), `outputs` (the run's train outputs folder: records and result files),
    `paper_id`."""

    def __init__(self, paper_id: str):
        self.paper_id = paper_id
        self.networks: dict[str, torch.nn.Module | dict] = {}
        self.ema_networks: dict[str, torch.nn.Module | dict] = {}
        self.outputs: Path | None = None

    def load_context(self, context) -> None:
        self.outputs = Path(context.artifacts["outputs"])
        self.networks = load_networks(self.outputs)
        self.ema_networks = load_networks(self.outputs, ema=True)

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        return {k: v for k, v in self.networks.items() if isinstance(v, torch.nn.Module)}

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        fn = PREDICTORS.get(self.paper_id)
        if fn is None:
            raise NotImplementedError(
                f"no predict for this paper ({self.paper_id}): its method is not a predictor over a table; its "
                f"trained networks are in .unwrap_python_model().networks ({', '.join(self.networks) or 'none'})")
        table = pd.DataFrame(model_input)
        missing = [column for column in PREDICT_COLUMNS[self.paper_id] if column not in table.columns]
        if missing:
            has = ", ".join(map(repr, table.columns)) or "none"
            raise ValueError(f"{self.paper_id} predict: the input table has no column "
                             f"{', '.join(map(repr, missing))} (it has {has}). {predict_input(self.paper_id)}")
        with torch.no_grad():
            return fn(self, table, params or {})


def predict_input(paper_id: str) -> str:
    """What `predict` takes and returns for this paper (the predictor's docstring), or that it has none: the
    registered model's description."""
    fn = PREDICTORS.get(paper_id)
    if fn is None:
        return ("No predict: the method is not a predictor over a table; the trained networks are in "
                "`mlflow.pyfunc.load_model(uri).unwrap_python_model().networks`.")
    return "predict input: " + " ".join((fn.__doc__ or "").split())


def pip_requirements() -> list[str]:
    """Pinned from this environment: what loading the model imports (torch CPU build as installed)."""
    names = ("torch", "mlflow", "cloudpickle", "numpy", "pandas", "pyarrow", "pydantic", "scikit-learn")
    reqs = []
    for name in names:
        try:
            version = metadata.version(name).split("+")[0]
        except metadata.PackageNotFoundError:
            continue
        reqs.append(f"{name}=={version}")
    return reqs


def save_model(paper_id: str, outputs: Path, path: Path, metadata: dict | None = None) -> None:
    """A train outputs folder as a pyfunc model folder at `path` (what `log_run_model` logs)."""
    # MLflow warns that a Python object is cloudpickled: here it is a reference to this module's class
    # and that it cannot infer a signature from a DataFrame hint without an example: the input is the paper's table
    signature, example = predict_signature(paper_id)
    with _quiet("mlflow.pyfunc"), _quiet("mlflow.models"):
        mlflow.pyfunc.save_model(path, python_model=PaperModel(paper_id), artifacts={"outputs": str(outputs)},
                                 pip_requirements=pip_requirements(), signature=signature, input_example=example,
                                 metadata={"paperline.paper": paper_id, **(metadata or {})})


def predict_signature(paper_id: str):
    """The MLflow signature (input columns, predict's params) and an input example of a paper's predict; (None, None)
    for a paper without one. MLflow checks a table against it before predict runs."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, ParamSchema, ParamSpec, Schema

    if paper_id == "sei":
        inputs = Schema([ColSpec(Array("double"), "pixels")])
        params = ParamSchema([ParamSpec("setting", "long", 0)])
        example = pd.DataFrame({"pixels": [[0.0] * 64]})
    elif paper_id == "spectral_schedule":
        inputs = Schema([ColSpec("double", "logA"), ColSpec("double", "alpha"), ColSpec("long", "seed")])
        params = ParamSchema([ParamSpec("arm", "string", "tight"), ParamSpec("nfe", "long", None)])
        example = pd.DataFrame({"logA": [0.0], "alpha": [2.0], "seed": [0]})
    else:
        return None, None
    return ModelSignature(inputs=inputs, params=params), example


def log_run_model(paper_id: str, run_id: str) -> str:
    """Pack the run's `outputs/` as a pyfunc model into the run's `model/` artifact; returns its artifact URI
    (the source of the registered model version)."""
    client = tracking.client()
    with tempfile.TemporaryDirectory(prefix="paperline-model-") as tmp:
        outputs = Path(tmp) / "outputs"
        outputs.mkdir()
        if any(a.path == "outputs" for a in client.list_artifacts(run_id)):
            client.download_artifacts(run_id, "outputs", tmp)
        save_model(paper_id, outputs, Path(tmp) / MODEL_ARTIFACT, {"paperline.run_id": run_id})
        shutil.rmtree(outputs)  # copied into the model folder by save_model
        client.log_artifacts(run_id, str(Path(tmp) / MODEL_ARTIFACT), MODEL_ARTIFACT)
    return f"{client.get_run(run_id).info.artifact_uri}/{MODEL_ARTIFACT}"


@contextlib.contextmanager
def _quiet(logger: str):
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


# ---- predictors: the paper's trained method on a table in the format of its data ----------------------------------
def _pixels(table: pd.DataFrame, side: int) -> torch.Tensor:
    """`pixels` column (each row side*side values, flat or nested) -> (B, 1, side, side) float32."""
    rows = [np.asarray(v, dtype=np.float32).reshape(side, side) for v in table["pixels"]]
    return torch.from_numpy(np.stack(rows))[:, None]


def _sei(model: PaperModel, table: pd.DataFrame, params: dict) -> pd.DataFrame:
    """SEI's downstream classifier: the plain CNN retrained without the samples SEI flagged (first noise
    setting, or `params["setting"]` = index), on `samples.parquet` rows (`pixels`, 8x8). Returns the predicted
    label and the class probabilities."""
    nets = model.modules["downstream"].nets
    net = nets[f"s{int(params.get('setting', 0))}_sei"]
    side = int(round(np.sqrt(np.asarray(table["pixels"].iloc[0]).size)))
    probs = net(_pixels(table, side)).softmax(-1)  # (B, C)
    return pd.DataFrame({"label": probs.argmax(-1).numpy(), **{f"p{c}": probs[:, c].numpy()
                                                               for c in range(probs.shape[1])}})


def _spectral_schedule(model: PaperModel, table: pd.DataFrame, params: dict) -> pd.DataFrame:
    """The spectrally tight sampler, a generator given a seed: one image per row of a table in the format of
    `spectra.parquet` (`logA`, `alpha`: the image's spectral code) plus `seed`; `params`: `arm` (default the
    method, "tight") and `nfe` (default the profile's smallest). Returns each row's seed and its image (`pixels`,
    C*N*N values, like `images.parquet`)."""
    from models.spectral_schedule import sample_arm

    arms = model.modules["arms"]
    arms = arms.worlds["main"] if hasattr(arms, "worlds") else arms  # the paper's data set, not the digits control
    arm, nfe = str(params.get("arm", "tight")), int(params.get("nfe", min(arms.p.nfe)))
    channels = next(m for m in arms.nets[arm].modules() if isinstance(m, torch.nn.Conv2d)).in_channels
    shape = (channels, arms.p.image_size, arms.p.image_size)
    codes = table[["logA", "alpha"]].to_numpy(dtype=np.float64)
    images = [sample_arm(arms, arm, nfe, code[None].copy(), shape, torch.Generator().manual_seed(int(seed)))[0].ravel()
              for seed, code in zip(table["seed"], codes, strict=True)]
    return pd.DataFrame({"seed": table["seed"].to_numpy(), "pixels": images})


PREDICTORS: dict[str, Callable[[PaperModel, pd.DataFrame, dict], pd.DataFrame]] = {
    "sei": _sei, "spectral_schedule": _spectral_schedule}
# the columns each predictor reads: checked before it runs, so a wrong table fails naming what is missing
PREDICT_COLUMNS: dict[str, tuple[str, ...]] = {"sei": ("pixels",), "spectral_schedule": ("logA", "alpha", "seed")}
