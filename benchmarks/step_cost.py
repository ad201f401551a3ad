"""What the platform costs a training step: `TrainContext.engine` + `ctx.fit` (one DeepSpeed rank in this process,
with the smoke profile's checkpoints, metric logging and progress) against a plain PyTorch loop of the same model,
batches and AdamW step, side by side in one process.

    python benchmarks/step_cost.py [--steps 300] [--repeats 5] [--threads 2]

The two models of issue 37's table, batch 128: an MLP 64-256-256-10 and a 2-layer transformer encoder (d 64, 4
heads, T 32, mean-pooled into 10 classes). Both loops clip the gradient norm at 1.0 (the engine's default), so they
do the same arithmetic; what differs is DeepSpeed's engine, `fit`'s per-step seeding, logging and progress, and a
committed checkpoint every `checkpoint_every` steps (50, the default) plus the network saved at the end. The loops
alternate (plain first on even repeats), the medians of ms a step are compared: ratio = platform / plain (target
<= 1.2). Writes benchmarks/results/step_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "step_cost.json"
BATCH = 128


class PooledTransformer(torch.nn.Module):
    def __init__(self, width: int = 64, layers: int = 2, classes: int = 10):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True,
                                                 dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


def models() -> dict[str, tuple]:
    """name -> (a constructor, one input's shape)."""
    return {
        "mlp_64_256_256_10": (lambda: torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 10)), (64,)),
        "transformer_2l_d64_t32": (PooledTransformer, (32, 64)),
    }


def batches(shape: tuple[int, ...], count: int = 16) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(BATCH, *shape, generator=generator),
             "y": torch.randint(0, 10, (BATCH,), generator=generator)} for _ in range(count)]


def plain_ms(build, data: list[dict[str, torch.Tensor]], steps: int) -> float:
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    began = time.perf_counter()
    for step in range(steps):
        batch = data[step % len(data)]
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return 1000 * (time.perf_counter() - began) / steps


def platform_ms(build, data: list[dict[str, torch.Tensor]], steps: int, out_dir: Path) -> float:
    from models.contract import PaperParams
    from tasks.context import MetricSink, TrainContext

    torch.manual_seed(0)
    ctx = TrainContext(params=PaperParams(), data_dir=out_dir, out_dir=out_dir, sink=MetricSink(None, None),
                       label="step_cost")
    engine = ctx.engine(build(), lr=1e-3)

    def step_fn(engine, batch, step):
        return torch.nn.functional.cross_entropy(engine(batch["x"]), batch["y"]), {}

    began = time.perf_counter()
    ctx.fit("bench", engine, step_fn, lambda step: data[step % len(data)], steps)
    return 1000 * (time.perf_counter() - began) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from tasks import settings, tracking
    from tasks.worker import _init_distributed

    settings.configure_environment()
    _init_distributed()
    torch.set_num_threads(args.threads)
    results = {"steps": args.steps, "repeats": args.repeats, "threads": args.threads, "batch": BATCH,
               "commit": tracking.git_commit()[:7], "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "models": {}}
    for name, (build, shape) in models().items():
        data = batches(shape)
        plain_ms(build, data, 20)  # warm-up: allocator, kernels' first calls
        samples: dict[str, list[float]] = {"plain_ms": [], "platform_ms": []}
        for repeat in range(args.repeats):
            order = ("plain", "platform") if repeat % 2 == 0 else ("platform", "plain")
            for which in order:
                if which == "plain":
                    samples["plain_ms"].append(plain_ms(build, data, args.steps))
                else:
                    with tempfile.TemporaryDirectory() as out_dir:
                        samples["platform_ms"].append(platform_ms(build, data, args.steps, Path(out_dir)))
        median = {k: round(statistics.median(v), 3) for k, v in samples.items()}
        results["models"][name] = {**median, "ratio": round(median["platform_ms"] / median["plain_ms"], 3),
                                   "samples": {k: [round(x, 3) for x in v] for k, v in samples.items()}}
        print(name, median, results["models"][name]["ratio"], flush=True)
    OUT.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
