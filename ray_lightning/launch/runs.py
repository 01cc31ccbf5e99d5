"""A run in storage (``storage_path``) as the driver's calls see it: where its files go, said once per process, and a
first fit's resume from its newest complete checkpoint there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray_lightning import namespaces
from ray_lightning.home import storage
from ray_lightning.launch.call_record import DriverCall

if TYPE_CHECKING:
    import pytorch_lightning as pl

# The runs (their folders in storage) this process named, and fitted: a run resumes from storage only in its
# first fit in a process (a later fit of a notebook starts where the module is).
_RUNS_SAID: set[str] = set()
_RUNS_FITTED: set[str] = set()


def announce_run(strategy: Any, call: DriverCall, trainer: pl.Trainer | None, given: Any) -> None:
    """Say where the run's files go; a fit that names no checkpoint, in the first call of a run in this process,
    resumes from the newest complete one in the run's folder (its earlier driver died), and says so."""
    run = call.run
    assert run is not None
    say = namespaces.of(strategy).pl("utilities.rank_zero.rank_zero_info")
    if run.url not in _RUNS_SAID:
        _RUNS_SAID.add(run.url)
        say(f"ray_lightning: run {run.name!r} keeps its checkpoints and logs in {run.url}")
    if trainer is None or trainer.state.fn != namespaces.FITTING or run.url in _RUNS_FITTED:
        return
    _RUNS_FITTED.add(run.url)
    if given is not None:
        return
    entry = storage.newest_complete(run)
    if entry is None:
        return
    call.recovery.resume_from_storage(entry)
    header = entry.header
    say(
        f"ray_lightning: resuming run {run.name!r} from its newest complete checkpoint in storage, "
        f"{entry.folder} (epoch {header['epoch']}, step {header['global_step']})"
    )
