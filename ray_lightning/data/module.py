"""``RayDataModule``: Ray Data datasets as a LightningDataModule, each rank streaming its share."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from ray_lightning import _lightning, _ray, namespaces, runtime
from ray_lightning.config.variables import DATA_TIMEOUT_ENV, seconds
from ray_lightning.data.coordinator import Coordinator, PassSpec
from ray_lightning.data.loader import MASK, LoaderSpec, PassStart, RayDataLoader
from ray_lightning.data.order import Deal, DealSpec, Intervals, Rest, batches_per_rank, epoch_seed

if TYPE_CHECKING:
    import pytorch_lightning as pl

NAMES = ("train", "val", "test", "predict")
STAGES = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}
SHUFFLES = ("local", "full", None)
LAST_BATCH = ("drop", "pad")
# The rows a window holds at least, shuffled together: a constant, since an epoch's order must not change with
# the number of workers or the batch size (a resume on another world size continues in the same order).
SHUFFLE_BUFFER_ROWS = 2048
DEFAULT_BATCH_TIMEOUT_S = 600.0
# What a coordinator may keep in the object store for a restart of a fit that may restart, and how far a pass's
# pipeline may run ahead of the ranks: these shares of the cluster's object store memory.
RETAIN_SHARE = 0.25
AHEAD_SHARE = 0.1


class RayDataModule(*namespaces.every("LightningDataModule")):  # type: ignore[misc]
    """A ``LightningDataModule`` of Ray Data datasets: every worker streams its own share, as torch batches.

    Each batch reaches ``training_step`` (and the others) as a dict with one tensor per column (strings stay
    numpy arrays); Lightning moves it to the worker's device. A training epoch gives every rank the same number
    of batches; validation and test see each row once per pass across the ranks (a rank may get one batch
    fewer); ``trainer.predict`` returns the predictions in dataset order. Preprocessing in the datasets
    (``map_batches``...) runs as Ray Data tasks wherever Ray finds free CPUs, nodes without training workers
    included (the workers' CPUs are left out of Ray Data's plan). No process holds another rank's rows: one
    coordinator actor per dataset hands out block references (metadata), each rank fetches its own blocks from
    the object store and cuts its batches. The position in the training epoch is in the checkpoint: a resume
    (``ckpt_path``, a ``max_failures`` restart, a run resumed from storage) continues at the next untrained row,
    also on another number of workers. Use it with a ray_lightning strategy.

    Args:
        train, val, test, predict: ``ray.data.Dataset`` s for each stage (any may be None).
        batch_size: rows per batch and rank (training).
        eval_batch_size: rows per batch and rank for val, test and predict (default: ``batch_size``).
        shuffle: the training rows' order, new every epoch, the same in every rerun with the same seed and on
            any number of workers: ``"local"`` (default: rows shuffled within windows of consecutive blocks of at
            least ``shuffle_buffer`` rows; a materialized dataset's blocks also in a random order), ``"full"``
            (Ray Data's ``random_shuffle``: every row anywhere; costs a full shuffle, a barrier, per epoch) or
            None (dataset order).
        shuffle_buffer: the rows a window holds at least (default 2048): what ``"local"`` mixes, and about what a
            rank fetches at a time.
        last_batch: the rows of a training epoch that do not fill a batch on every rank: ``"drop"`` (default:
            left out of that epoch; another epoch's order includes them) or ``"pad"`` (filled with rows from the
            epoch's start; every training batch then has a boolean ``"mask"`` column, False on padding rows,
            for the loss to weigh).
        seed: the run's seed (default: ``PL_GLOBAL_SEED``, which ``seed_everything`` sets, else 0).
        columns: the columns to read (default: all); a column the dataset lacks is an error before training.
        batch_timeout_s: the longest a rank waits for its next batch before it fails saying so (default
            ``RAY_LIGHTNING_DATA_TIMEOUT_S``, else 600); a resume's skip of trained rows is not counted.

    Example::

        ds = ray.data.read_parquet("s3://bucket/train").map_batches(decode)
        dm = RayDataModule(train=ds, val=val_ds, batch_size=64)
        pl.Trainer(strategy=RayStrategy(num_workers=4), max_epochs=3).fit(model, datamodule=dm)
    """

    def __init__(
        self,
        train: Any = None,
        val: Any = None,
        test: Any = None,
        predict: Any = None,
        *,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        shuffle: str | None = "local",
        shuffle_buffer: int | None = None,
        last_batch: str = "drop",
        seed: int | None = None,
        columns: list[str] | None = None,
        batch_timeout_s: float | None = None,
    ) -> None:
        super().__init__()
        self.batch_timeout_s = seconds("batch_timeout_s", batch_timeout_s, DATA_TIMEOUT_ENV, DEFAULT_BATCH_TIMEOUT_S)
        datasets = dict(zip(NAMES, (train, val, test, predict)))
        _check_arguments(datasets, batch_size, eval_batch_size, shuffle, shuffle_buffer, last_batch, seed, columns)
        self.datasets = {name: ds for name, ds in datasets.items() if ds is not None}
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.shuffle = shuffle
        self.shuffle_buffer = shuffle_buffer
        self.last_batch = last_batch
        self.seed = seed
        self.columns = list(columns) if columns else None
        self._coordinators: dict[str, Any] | None = None  # set on the driver before the workers start
        self._rows: dict[str, int | None] = {}
        self._resume: dict[str, Any] | None = None  # the training position a checkpoint held
        self._pass: tuple[int, Intervals, int, int] | None = None  # (epoch, base, first batch, Lightning's count then)
        self._loaders: dict[str, RayDataLoader] = {}
        self._made: dict[str, int] = {}
        self._said_unknown: set[str] = set()

    @property
    def window_rows(self) -> int:
        return self.shuffle_buffer or SHUFFLE_BUFFER_ROWS

    # -- on the driver, before the workers start (the launcher calls it) ----------------------------------------

    def ray_lightning_prepare(self, trainer: pl.Trainer, resources: Any) -> Callable[[], None]:
        """Check the datasets for this call and start a coordinator for each; returns what ends them.
        ``resources``: the workers' (``ray_lightning.config.resources.WorkerResources``)."""
        import ray

        world_size = resources.num_workers
        cluster = ray.cluster_resources()
        _warn_if_no_cpu_is_left(resources, cluster.get("CPU", 0))
        fn = str(trainer.state.fn.value)
        needed = STAGES.get(fn, ())[0]
        if needed not in self.datasets:
            raise ValueError(f"RayDataModule: trainer.{fn} needs a {needed} dataset: RayDataModule({needed}=...)")
        names = [n for n in STAGES[fn] if n in self.datasets]
        if self.seed is None:
            self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        exclude = {"cpu": world_size * resources.cpus, "gpu": world_size * resources.gpus}
        store = cluster.get("object_store_memory", 0)
        retain, ahead = int(store * RETAIN_SHARE) if _may_restart(trainer) else 0, int(store * AHEAD_SHARE)
        coordinators = {}
        for name in names:
            dataset = self._checked(name, self.datasets[name], world_size)
            # Outside the workers' placement group: the dataset's tasks must not wait for the workers' CPUs.
            actor = ray.remote(Coordinator).options(
                num_cpus=0, max_concurrency=4 * world_size + 8, scheduling_strategy="DEFAULT"
            )
            coordinators[name] = actor.remote(dataset, name, exclude, retain, ahead)
        self._coordinators = coordinators

        def end() -> None:
            for coordinator in coordinators.values():
                ray.kill(coordinator)
            self._coordinators = None

        return end

    def _checked(self, name: str, dataset: Any, world_size: int) -> Any:
        try:
            dataset.schema(fetch_if_missing=False)  # where the blocks exist: Ray unifies theirs, or cannot
        except Exception as error:  # noqa: BLE001 - pyarrow's ArrowTypeError/ArrowInvalid name the column
            raise ValueError(
                f"RayDataModule: the {name} dataset's blocks do not share one schema ({error}); cast the column to "
                "one type in every block (map_batches) before training."
            ) from None
        rows = self._rows[name] = _ray.data.known_row_count(dataset)
        if rows is None and name not in self._said_unknown:
            self._said_unknown.add(name)
            warnings.warn(
                f"RayDataModule: the {name} dataset's row count is unknown until it is read (map_batches or "
                "filter can change it), so its loaders have no length: progress bars show no total and "
                "val_check_interval must be an int. A dataset whose metadata holds its count (read_parquet, "
                "from_numpy, or .materialize()) has one.",
                stacklevel=4,
            )
        if rows == 0:
            raise ValueError(f"RayDataModule: the {name} dataset has no rows")
        size = self.batch_size if name == "train" else self.eval_batch_size
        if name == "train" and rows is not None and rows // world_size < size:
            raise ValueError(
                f"RayDataModule: batch_size={size} is larger than a rank's share of the train dataset "
                f"({rows} rows over {world_size} workers: {rows // world_size} each); lower batch_size"
            )
        if self.columns:
            schema = dataset.schema(fetch_if_missing=False)
            missing = [c for c in self.columns if schema is not None and c not in schema.names]
            if missing:
                raise ValueError(
                    f"RayDataModule: the {name} dataset has no column(s) {missing}; it has {list(schema.names)}"
                )
            dataset = dataset.select_columns(self.columns)
        if name == "train" and self.last_batch == "pad":
            schema = dataset.schema(fetch_if_missing=False)
            if schema is not None and MASK in schema.names:
                raise ValueError(f"RayDataModule(last_batch='pad') adds a {MASK!r} column; the dataset has one")
        return dataset

    def _deal_spec(self, name: str, world: int) -> DealSpec:
        if name != "train":
            return DealSpec(world, self.eval_batch_size, self.window_rows, "eval")
        return DealSpec(world, self.batch_size, self.window_rows, self.last_batch)

    # -- on every rank --------------------------------------------------------------------------------------------

    @override
    def setup(self, stage: str) -> None:
        if self._coordinators is None:
            strategy = type(self.trainer.strategy).__name__ if self.trainer is not None else "none"
            raise TypeError(
                f"RayDataModule streams Ray Data into the workers of a ray_lightning strategy (RayStrategy, "
                f"RayFSDPStrategy, ...); this Trainer's strategy is {strategy}. Pass strategy=RayStrategy(...)."
            )

    @override
    def train_dataloader(self) -> RayDataLoader | list:
        return self._loader("train")

    @override
    def val_dataloader(self) -> RayDataLoader | list:
        return self._loader("val")

    @override
    def test_dataloader(self) -> RayDataLoader | list:
        return self._loader("test")

    @override
    def predict_dataloader(self) -> RayDataLoader | list:
        return self._loader("predict")

    def _loader(self, name: str) -> RayDataLoader | list:
        assert self._coordinators is not None and self.trainer is not None
        if name not in self._coordinators:
            return []  # Lightning's "no loader": no validation without a val dataset
        trainer = self.trainer
        world, rank = trainer.world_size, trainer.global_rank
        context = runtime.current_context()
        attempt = f"{context.main_address}:{context.main_port}" if context else "local"
        deal = self._deal_spec(name, world)
        rows = self._rows.get(name)
        length = batches_per_rank(rows, deal, rank) if rows is not None else None
        spec = LoaderSpec(deal.batch, deal.mode, deal.cap)
        made = self._made[name] = self._made.get(name, 0) + 1
        if name == "train":
            start = self._start_training_pass
        else:
            passes = iter(range(1 << 62))
            key = ("eval", name, attempt, made)
            pass_spec = PassSpec(None, None, self.window_rows)
            start = lambda: PassStart((*key, next(passes)), pass_spec, total=rows)  # noqa: E731
        loader = RayDataLoader(
            self._coordinators[name], spec, rank, world, attempt, length, start, name, self.batch_timeout_s
        )
        self._loaders[name] = loader
        return loader

    def _start_training_pass(self) -> PassStart:
        """At each training epoch's start: its order, and where a checkpoint says this epoch is."""
        trainer = self.trainer
        epoch = trainer.current_epoch
        base, first, trained = self._resume_plan(epoch, trainer.world_size)
        self._pass = (epoch, base, first, _lightning.batches_processed(trainer))
        seed = epoch_seed(int(self.seed or 0), epoch) if self.shuffle else None
        spec = PassSpec(self.shuffle, seed, self.window_rows)
        rows = self._rows.get("train")
        return PassStart(("train", epoch, seed), spec, base.to_list(), first, rows, trained.to_list())

    def _resume_plan(self, epoch: int, world: int) -> tuple[Intervals, int, Intervals]:
        """Where this epoch's pass starts: the positions its deal leaves out, the batch of each rank's stream it
        starts at, and every position trained. The checkpoint's deal goes on where it stopped on the same world
        size and batch, else the rest is dealt anew."""
        resume = self._resume
        if resume is None or resume.get("epoch") != epoch:
            return Intervals(), 0, Intervals()
        trained = Intervals(resume.get("trained") or [[0, int(resume.get("rows", 0))]])
        deal = resume.get("deal") or {}
        now = {"world": world, "batch": self.batch_size, "cap": self.window_rows}
        if all(deal.get(k) == v for k, v in now.items()) and "base" in resume:
            return Intervals(resume["base"]), int(deal.get("steps", 0)), trained
        return trained, 0, trained

    def resumed_batches(self) -> int | None:
        """The batches each rank trains in an epoch resumed mid-way (from the checkpoint's position, on this world
        size); None when the epoch starts from its first row. ``data.elastic`` starts the epoch's batch count there."""
        trainer, rows = self.trainer, self._rows.get("train")
        if trainer is None or rows is None:
            return None
        base, first, _ = self._resume_plan(trainer.current_epoch, trainer.world_size)
        if not base.spans and not first:
            return None
        deal = self._deal_spec("train", trainer.world_size)
        return max(0, batches_per_rank(Rest(base).length(rows), deal, 0) - first)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The training position: the epoch, the positions of its order trained (``trained``), and the deal that
        was reading it (so a restart on the same world size takes every later step's rows as before)."""
        trainer, loader = self.trainer, self._loaders.get("train")
        if trainer is None or loader is None or trainer.state.fn != namespaces.FITTING or self._pass is None:
            return {}
        epoch, base, first, before = self._pass
        if epoch != trainer.current_epoch or loader.reader is None:
            return {}
        steps = first + _lightning.batches_processed(trainer) - before
        deal: Deal = loader.reader.deal
        trained = base.union(deal.trained(steps, loader.reader.rest, loader.reader.reach))
        if trainer.global_rank == 0:
            loader.coordinator.checkpointed.remote(loader.reader.start.key, trained.to_list())
        return {
            "epoch": epoch,
            "rows": len(trained),
            "trained": trained.to_list(),
            "base": base.to_list(),
            "deal": {"world": deal.spec.world, "batch": deal.spec.batch, "cap": deal.spec.cap, "steps": steps},
            "seed": self.seed,
        }

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self._resume = dict(state)
        if state.get("seed") is not None:
            self.seed = state["seed"]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_loaders"] = {}  # a rank's loaders stay in that rank
        return state


def _may_restart(trainer: Any) -> bool:
    """Whether the fit may start its workers again (``max_failures``, ``num_workers=(min, max)``)."""
    strategy = trainer.strategy
    workers = getattr(strategy, "workers", None)
    return bool(getattr(strategy, "max_failures", 0)) or getattr(workers, "elastic", None) is not None


def _warn_if_no_cpu_is_left(resources: Any, cluster_cpus: float) -> None:
    held = resources.num_workers * resources.cpus
    if cluster_cpus - held < 1:
        warnings.warn(
            f"RayDataModule: the {resources.num_workers} workers hold {held:g} of the cluster's {cluster_cpus:g} "
            "CPUs, leaving none for Ray Data's tasks (reads, map_batches): training waits until a node with free "
            "CPUs joins. Give the cluster more CPUs, or the workers fewer (num_cpus_per_worker).",
            stacklevel=4,
        )


def _check_arguments(
    datasets: dict[str, Any], batch_size: Any, eval_batch_size: Any, shuffle: Any, shuffle_buffer: Any,
    last_batch: Any, seed: Any, columns: Any,
) -> None:  # fmt: skip
    from ray.data import Dataset

    for name, ds in datasets.items():
        if ds is not None and not isinstance(ds, Dataset):
            raise TypeError(f"RayDataModule({name}=...) takes a ray.data.Dataset, not {type(ds).__name__}")
    for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size),
                        ("shuffle_buffer", shuffle_buffer)):  # fmt: skip
        if value is None and name != "batch_size":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"RayDataModule({name}={value!r}): give a positive int")
    if shuffle not in SHUFFLES:
        raise ValueError(f"RayDataModule(shuffle={shuffle!r}): one of 'local', 'full' or None")
    if last_batch not in LAST_BATCH:
        raise ValueError(f"RayDataModule(last_batch={last_batch!r}): 'drop' or 'pad'")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"RayDataModule(seed={seed!r}): an int or None")
    if columns is not None and (isinstance(columns, str) or not all(isinstance(c, str) for c in columns)):
        raise ValueError(f"RayDataModule(columns={columns!r}): a list of column names")
