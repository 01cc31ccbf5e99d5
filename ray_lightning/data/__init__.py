"""Ray Data into the training workers: :class:`RayDataModule` (module); a pass's one order and its deal to the
ranks, pure functions (order); the actor that runs each pipeline and hands out block references, never rows
(coordinator); and what each rank iterates, cutting its own batches from the blocks it fetches (loader)."""

from ray_lightning.data.module import RayDataModule

__all__ = ["RayDataModule"]
