"""``RayDataModule``: Ray Data datasets as a LightningDataModule, each rank streaming its share."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from ray_lightning import _lightning, _ray, namespaces, runtime
from ray_lightning.config.variables import DATA_TIMEOUT_ENV, seconds
from ray_lightning.data.dealer import MASK, Dealer, PassSpec, epoch_seed
from ray_lightning.data.loader import RayDataLoader

if TYPE_CHECKING:
    import pytorch_lightning as pl

NAMES = ("train", "val", "test", "predict")
STAGES = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}
SHUFFLES = ("local", "full", None)
LAST_BATCH = ("drop", "pad")
# The local shuffle's default buffer: a constant, since an epoch's order must not change with the number of
# workers or the batch size (a resume on another world size continues in the same order).
SHUFFLE_BUFFER_ROWS = 2048
DEFAULT_BATCH_TIMEOUT_S = 600.0


class RayDataModule(*namespaces.every("LightningDataModule")):  # type: ignore[misc]
    """A ``LightningDataModule`` of Ray Data datasets: every worker streams its own share, as torch batches.

    Each batch reaches ``training_step`` (and the others) as a dict with one tensor per column (strings stay
    numpy arrays); Lightning moves it to the worker's device. A training epoch deals every rank the same number
    of batches; validation and test see each row once per pass across the ranks (a rank may get one batch
    fewer); ``trainer.predict`` returns the predictions in dataset order. Preprocessing in the datasets
    (``map_batches``...) runs as Ray Data tasks wherever Ray finds free CPUs, nodes without training workers
    included. The position in the training epoch is in the checkpoint: a resume (``ckpt_path``, a
    ``max_failures`` restart, a run resumed from storage) continues at the next untrained row, also on another
    number of workers. Use it with a ray_lightning strategy.

    Args:
        train, val, test, predict: ``ray.data.Dataset`` s for each stage (any may be None).
        batch_size: rows per batch and rank (training).
        eval_batch_size: rows per batch and rank for val, test and predict (default: ``batch_size``).
        shuffle: the training rows' order, new every epoch, the same in every rerun with the same seed:
            ``"local"`` (default: blocks in random order, rows mixed in a buffer of ``shuffle_buffer`` rows),
            ``"full"`` (Ray Data's ``random_shuffle``: every row anywhere; costs a full shuffle per epoch) or
            None (dataset order).
        shuffle_buffer: rows of the local shuffle's buffer, held by the dealer (default 2048).
        last_batch: the rows of a training epoch that do not fill a batch on every rank: ``"drop"`` (default:
            left out of that epoch; another epoch's order includes them) or ``"pad"`` (filled with rows from the
            epoch's start; every training batch then has a boolean ``"mask"`` column, False on padding rows,
            for the loss to weigh).
        seed: the run's seed (default: ``PL_GLOBAL_SEED``, which ``seed_everything`` sets, else 0).
        columns: the columns to read (default: all); a column the dataset lacks is an error before training.
        batch_timeout_s: the longest a rank waits for its next batch before it fails saying so (default
            ``RAY_LIGHTNING_DATA_TIMEOUT_S``, else 600).

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
        self._dealers: dict[str, Any] | None = None  # set on the driver before the workers start
        self._rows: dict[str, int | None] = {}
        self._resume: dict[str, Any] | None = None  # the training position a checkpoint held
        self._pass_start: tuple[int, int, int] | None = None  # (epoch, rows skipped, batches done before)
        self._loaders: dict[str, RayDataLoader] = {}
        self._said_unknown: set[str] = set()

    # -- on the driver, before the workers start (the launcher calls it) ----------------------------------------

    def ray_lightning_prepare(self, trainer: pl.Trainer, resources: Any) -> Callable[[], None]:
        """Check the datasets for this call and start a dealer for each; returns what ends them. ``resources``:
        the workers' (``ray_lightning.config.resources.WorkerResources``)."""
        import ray

        world_size = resources.num_workers
        _warn_if_no_cpu_is_left(resources, ray.cluster_resources().get("CPU", 0))
        fn = str(trainer.state.fn.value)
        needed = STAGES.get(fn, ())[0]
        if needed not in self.datasets:
            raise ValueError(f"RayDataModule: trainer.{fn} needs a {needed} dataset: RayDataModule({needed}=...)")
        names = [n for n in STAGES[fn] if n in self.datasets]
        if self.seed is None:
            self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        dealers = {}
        for name in names:
            dataset = self._checked(name, self.datasets[name], world_size)
            # Outside the workers' placement group: the dataset's tasks must not wait for the workers' CPUs.
            dealer = ray.remote(Dealer).options(
                num_cpus=0, max_concurrency=world_size + 2, scheduling_strategy="DEFAULT"
            )
            dealers[name] = dealer.remote(dataset, self._spec(name, world_size))
        self._dealers = dealers

        def end() -> None:
            for dealer in dealers.values():
                ray.kill(dealer)
            self._dealers = None

        return end

    def _checked(self, name: str, dataset: Any, world_size: int) -> Any:
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

    def _spec(self, name: str, world_size: int) -> PassSpec:
        if name != "train":
            return PassSpec(self.eval_batch_size, training=False)
        buffer = self.shuffle_buffer or SHUFFLE_BUFFER_ROWS
        return PassSpec(self.batch_size, training=True, last_batch=self.last_batch, shuffle=self.shuffle,
                        shuffle_buffer=buffer)  # fmt: skip

    # -- on every rank --------------------------------------------------------------------------------------------

    @override
    def setup(self, stage: str) -> None:
        if self._dealers is None:
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
        assert self._dealers is not None and self.trainer is not None
        if name not in self._dealers:
            return []  # Lightning's "no loader": no validation without a val dataset
        trainer = self.trainer
        world, rank = trainer.world_size, trainer.global_rank
        context = runtime.current_context()
        attempt = f"{context.main_address}:{context.main_port}" if context else "local"
        spec = self._spec(name, world)
        length = _batches_per_rank(self._rows.get(name), spec, world, rank)
        start = self._start_training_pass if spec.training else (lambda: (None, 0))
        loader = RayDataLoader(
            self._dealers[name], spec, rank, world, attempt, length, start, name, self.batch_timeout_s
        )
        self._loaders[name] = loader
        return loader

    def _start_training_pass(self) -> tuple[int | None, int]:
        """At each training epoch's start: its seed and the rows a checkpoint says it already trained."""
        trainer = self.trainer
        epoch = trainer.current_epoch
        skip = 0
        if self._resume is not None and self._resume.get("epoch") == epoch:
            skip = int(self._resume["rows"])
        self._pass_start = (epoch, skip, _lightning.batches_processed(trainer))
        seed = epoch_seed(int(self.seed or 0), epoch) if self.shuffle else None
        return seed, skip

    def resumed_batches(self) -> int | None:
        """The batches each rank trains in an epoch resumed mid-way (from the checkpoint's position, on this world
        size); None when the epoch starts from its first row. ``data.elastic`` starts the epoch's batch count there."""
        trainer, resume = self.trainer, self._resume
        rows = self._rows.get("train")
        if trainer is None or resume is None or rows is None or resume.get("epoch") != trainer.current_epoch:
            return None
        if not resume.get("rows"):
            return None
        world = trainer.world_size
        return _batches_per_rank(max(0, rows - int(resume["rows"])), self._spec("train", world), world, 0)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The training position: the epoch and how many of its rows (in its one order) are trained."""
        trainer = self.trainer
        if trainer is None or "train" not in self._loaders or trainer.state.fn != namespaces.FITTING:
            return {}
        epoch = trainer.current_epoch
        done = _lightning.batches_processed(trainer)
        rows_per_batch = trainer.world_size * self.batch_size
        if self._pass_start is not None and self._pass_start[0] == epoch:
            _, skipped, before = self._pass_start
            rows = skipped + (done - before) * rows_per_batch
        else:
            rows = done * rows_per_batch
        return {"epoch": epoch, "rows": rows, "seed": self.seed}

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


def _warn_if_no_cpu_is_left(resources: Any, cluster_cpus: float) -> None:
    held = resources.num_workers * resources.cpus
    if cluster_cpus - held < 1:
        warnings.warn(
            f"RayDataModule: the {resources.num_workers} workers hold {held:g} of the cluster's {cluster_cpus:g} "
            "CPUs, leaving none for Ray Data's tasks (reads, map_batches): training waits until a node with free "
            "CPUs joins. Give the cluster more CPUs, or the workers fewer (num_cpus_per_worker).",
            stacklevel=4,
        )


def _batches_per_rank(rows: int | None, spec: PassSpec, world: int, rank: int) -> int | None:
    if rows is None:
        return None
    if spec.training:
        step = world * spec.batch_size
        return rows // step if spec.last_batch == "drop" else math.ceil(rows / step)
    batches = math.ceil(rows / spec.batch_size)
    return len(range(rank, batches, world))


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
