"""The run ledger: what MLflow already holds for a run as asked for, and so what each of its steps does.

`read` answers once, before any work starts, from the keys (tasks/tracking.py):
- the pipeline run, keyed by `pipeline_key` (the code training imports, the claim, the params as given and the
  data): a finished run of it is `cached` (reused, nothing runs); a killed or failed one is `resumable` (continued:
  the same MLflow run, its finished replicates kept);
- each replicate, keyed by its training key (the code training imports, its params with its seed, its data; not the
  claim): `keep` (finished in the run being continued), `resume` (started there: continued from its checkpoints),
  `reuse` (another pipeline run trained exactly it: its stored metrics decide again, when the claim changed or more
  replicates were asked for) or `train`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tasks import tracking

Action = Literal["keep", "resume", "reuse", "train"]


def pipeline_key(request, data_hash: str) -> str:
    """The pipeline run's cache key of a run request (or a registry.RawRequest: the CLI's check before anything
    is imported); a premises-only run has its own (it never answers for a full run, nor back)."""
    key = tracking.run_key(request.paper, request.profile, request.raw, data_hash)
    return f"premises-{key}" if getattr(request, "premises_only", False) else key


@dataclass(frozen=True)
class ReplicateEntry:
    index: int
    key: str               # its training key
    action: Action
    earlier: Any = None    # the MLflow run kept, resumed or reused (None: train)

    @property
    def trains(self) -> bool:
        """Whether its ranks run (train from scratch or resume from checkpoints)."""
        return self.action in ("train", "resume")


@dataclass(frozen=True)
class Ledger:
    key: str                                 # the pipeline run's cache key
    cached: Any                              # a finished pipeline run of exactly this work, or None
    resumable: Any                           # a killed or failed one, continued, or None
    replicates: tuple[ReplicateEntry, ...]   # empty when cached

    @property
    def reused(self) -> dict[int, Any]:
        """The replicates another pipeline run trained, by index: their stored metrics are reused."""
        return {e.index: e.earlier for e in self.replicates if e.action == "reuse"}

    @property
    def lineage(self) -> str:
        """trained (nothing reused), extended (some replicates reused) or re-decided (all reused)."""
        reused = len(self.reused)
        return "trained" if not reused else "re-decided" if reused == len(self.replicates) else "extended"

    @property
    def trained(self) -> int:
        """How many replicates train or resume."""
        return sum(e.trains for e in self.replicates)

    @property
    def trains_nothing(self) -> bool:
        return self.trained == 0

    def trains_after(self, index: int) -> bool:
        """Whether a replicate after `index` trains (so its ranks may warm up while `index` evaluates)."""
        return any(e.trains for e in self.replicates[index + 1:])


def read(request, data_hashes: Sequence[str], exp_id: str, force: bool) -> Ledger:
    """The ledger of `request` (a registry.RunRequest) over its prepared replicates' data hashes. `force` trains
    everything anew: nothing cached, resumed or reused."""
    key = pipeline_key(request, ",".join(data_hashes))
    if force:
        entries = tuple(ReplicateEntry(i, _training_key(request, i, h), "train") for i, h in enumerate(data_hashes))
        return Ledger(key, None, None, entries)
    cached = tracking.find_cached(exp_id, key)
    if cached is not None:
        return Ledger(key, cached, None, ())
    resumable = tracking.find_resumable(exp_id, key)
    entries = []
    for index, data_hash in enumerate(data_hashes):
        training_key = _training_key(request, index, data_hash)
        started = None if resumable is None else tracking.find_replicate(exp_id, resumable.info.run_id, index,
                                                                         training_key)
        if started is not None:
            entries.append(ReplicateEntry(index, training_key, "keep" if started.info.status == "FINISHED"
                                          else "resume", started))
            continue
        trained = tracking.find_trained(exp_id, request.paper, request.profile, training_key, data_hash,
                                        request.replicate(index).params.seed)
        entries.append(ReplicateEntry(index, training_key, "train" if trained is None else "reuse", trained))
    return Ledger(key, None, resumable, tuple(entries))


def _training_key(request, index: int, data_hash: str) -> str:
    return tracking.training_key(request.paper, request.profile, request.replicate(index).raw, data_hash)
