"""What runs in a Tune trial's own process (the driver of the trial's workers): ``ray.tune.report`` with what rank
0 sends, where the ranks write a checkpoint, the checkpoint Tune restored the trial with, and the end of a trial
Tune stopped."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import warnings
import weakref
from typing import Any

from ray_lightning import _ray
from ray_lightning.config.storage import is_local
from ray_lightning.home import storage

# The note beside the checkpoint file in each directory reported to Tune: which file it is.
MARKER_FILE = ".ray_lightning_tune.json"

# The Tune function runs (each a thread of the trial's process) whose first fit has started: only that fit
# resumes by itself; a later fit of the same run is the user's next step, not a restore.
_fitted_runs: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def first_fit_of_trial() -> bool:
    run = threading.current_thread()
    first = run not in _fitted_runs
    _fitted_runs.add(run)
    return first


def restored_checkpoint() -> Any:
    """The checkpoint this Tune trial was started from, or None (also outside Tune)."""
    from ray import tune

    with warnings.catch_warnings():
        # Outside a trial Tune warns and answers None: a fit outside Tune is not a misuse here.
        warnings.simplefilter("ignore")
        return tune.get_checkpoint()


# How long Tune waits for a stopped trial's function to end before it reuses the trial's process for the next
# trial (reuse_actors=True): Tune's default is 2 s, read when it reuses the process; a stopped trial here ends
# fit at the report's step on every rank and brings the results home first, which takes longer under load (a
# reuse that times out fails). Set in the trial's process unless the user set it.
THREAD_TIMEOUT_ENV = "TUNE_FUNCTION_THREAD_TIMEOUT_S"
STOPPED_TRIAL_END_S = 120


def give_stopped_trials_time_to_end() -> None:
    if _ray.tune.in_trial():
        os.environ.setdefault(THREAD_TIMEOUT_ENV, str(STOPPED_TRIAL_END_S))


def ranks_write_to_tune_storage(rank_directories_of: str | None = None) -> bool:
    """On the trial's process: whether the ranks can write this trial's checkpoints into Tune's storage.

    ``rank_directories_of``: the strategy's name when its checkpoint is a directory every rank writes its part of
    with local file I/O (DeepSpeed's): then anything but a Tune storage_path every node mounts is refused here,
    before launch, since such a checkpoint cannot go through the trial's process as one file.
    """
    url, why = _ray.tune.trial_storage_url()
    in_trial = why != "not in a Tune trial"
    if rank_directories_of is not None and in_trial and not (url is not None and is_local(url)):
        raise ValueError(
            f"TuneReportCheckpointCallback with {rank_directories_of}: its checkpoint is a directory every rank writes "
            "its part of with local file I/O, so Tune's storage_path must be a directory every node mounts; "
            f"{f'{url} is not one' if url is not None else why}. Give tune.RunConfig(storage_path=...) such a "
            "directory, or report metrics only (TuneReportCallback) and keep checkpoints with ModelCheckpoint."
        )
    if url is None and in_trial:
        warnings.warn(
            f"ray_lightning.tune: the trial's checkpoints go through the trial's process as bytes: {why}. "
            "Give Tune a storage_path that fsspec reaches (a directory every node mounts, s3://, gs://).",
            stacklevel=3,
        )
    return url is not None


# Per Tune function run (a thread of the trial's process): whether its Fabric rank 0 copies checkpoints into Tune's
# storage itself. Decided at its first report (a probe written and looked for), not again at every report.
_rank_zero_copies: weakref.WeakKeyDictionary[threading.Thread, bool] = weakref.WeakKeyDictionary()


def folder_for_rank_zero() -> str | None:
    """On the trial's process, asked by a Fabric function's rank 0 before it reports a checkpoint: the folder Tune
    keeps the next one in, where rank 0 copies its file itself; None where it cannot (then it sends the bytes)."""
    run = threading.current_thread()
    if run not in _rank_zero_copies:
        _rank_zero_copies[run] = ranks_write_to_tune_storage()
    return next_checkpoint_folder() if _rank_zero_copies[run] else None


def sees_rank_zeros_copy(location: str) -> bool:
    """On the trial's process, asked by a Fabric function's rank 0 after copying its checkpoint: whether this
    process sees it; if not, this run's checkpoints go through this process from now on (with a warning)."""
    if sees(location, sharded=False):
        return True
    _rank_zero_copies[threading.current_thread()] = False
    warnings.warn(
        f"ray_lightning.tune: the trial's process does not see the checkpoint rank 0 copied to {location} (Tune's "
        "storage_path is a local directory the workers' machines do not share): this trial's checkpoints go through "
        "the trial's process as bytes. Use a bucket or a directory every node mounts.",
        stacklevel=2,
    )
    return False


def next_checkpoint_folder() -> str:
    """On the trial's process, asked by rank 0: the folder Tune keeps the next reported checkpoint in, emptied of
    what an earlier attempt may have left there."""
    folder = _ray.tune.next_checkpoint_url()
    storage.remove(folder)
    return folder


def sees(location: str, sharded: bool) -> bool:
    """On the trial's process, asked by rank 0: whether the checkpoint the ranks wrote is there as this process
    sees Tune's storage: the file, or every file a sharded checkpoint's metadata names (each rank's shards)."""
    fs, path = storage.filesystem(location)
    fs.invalidate_cache()  # an object store's listing is cached: the ranks wrote since
    if not sharded:
        return fs.isfile(path)
    if not is_local(location):
        return fs.isdir(path)  # a bucket every rank wrote to: the one place, seen alike from everywhere
    from torch.distributed.checkpoint import FileSystemReader

    try:
        named = {item.relative_path for item in FileSystemReader(location).read_metadata().storage_data.values()}
    except (OSError, ValueError, RuntimeError):
        return False  # no metadata: rank 0 wrote elsewhere
    return all(os.path.exists(os.path.join(location, name)) for name in named)


def checkpoint_in_storage(checkpoint: Any) -> str | None:
    """The file (or sharded checkpoint's folder) of a Tune checkpoint this module reported, where every worker reads
    it in place; None when it is not one, or is not reachable so (then it is read through the trial's process)."""
    folder = _ray.tune.checkpoint_url(checkpoint)
    if folder is None:
        return None
    try:
        fs, path = storage.filesystem(storage.join(folder, MARKER_FILE))
        filename = json.loads(fs.cat_file(path))["filename"]
        location = storage.join(folder, filename)
        found_fs, found = storage.filesystem(location)
        return location if found_fs.exists(found) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_file(directory: str) -> str | None:
    """The checkpoint file in a directory this module reported to Tune, or None for anyone else's."""
    try:
        with open(os.path.join(directory, MARKER_FILE)) as f:
            filename = json.load(f)["filename"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = os.path.join(directory, filename)
    return path if os.path.exists(path) else None  # a file, or a directory every rank wrote a part of


# The Tune function runs that Tune stopped during a ray_lightning call: they end when the call returns.
_stopped_runs: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def end_if_tune_stopped() -> None:
    run = threading.current_thread()
    if run in _stopped_runs:
        _stopped_runs.discard(run)
        raise SystemExit(0)


def report_to_tune(
    metrics: dict[str, Any], checkpoint: tuple[str, bytes | None] | None, until_stopped: bool = False
) -> bool:
    """Runs in the trial's process: ``ray.tune.report``, with the checkpoint file written to a directory (its
    bytes None: the ranks wrote it into the folder Tune persists this checkpoint in, and Tune gets the note).

    Tune stops a trial (a scheduler's decision, the end of the search) by ending its function inside
    ``report``. With ``until_stopped`` that end waits: this returns True, the workers end ``fit`` at the
    report's step, and the function ends after the call (:func:`end_if_tune_stopped`). Returns False
    while the trial goes on.
    """
    run = threading.current_thread()
    if run in _stopped_runs:
        return True  # a rank reporting again before fit ended (min_epochs): Tune has ended the trial
    try:
        _report(metrics, checkpoint)
    except SystemExit:
        if not until_stopped:
            raise
        _stopped_runs.add(run)
        return True
    return False


def _report(metrics: dict[str, Any], checkpoint: tuple[str, bytes | None] | None) -> None:
    from ray import tune

    if checkpoint is None:
        tune.report(metrics)
        return
    filename, data = checkpoint
    with tempfile.TemporaryDirectory(prefix="ray_lightning-tune-") as directory:
        if data is not None:
            path = os.path.join(directory, filename)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        with open(os.path.join(directory, MARKER_FILE), "w") as f:
            # written_by: where the checkpoint's bytes went to Tune's storage from (the ranks, or this process).
            json.dump({"filename": filename, "written_by": "trial" if data is not None else "ranks"}, f)
        # Tune copies the directory into the trial's storage before report returns (only the files it holds:
        # a checkpoint the ranks wrote into that folder stays beside them).
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))
