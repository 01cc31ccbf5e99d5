"""Ray Data into the training workers: :class:`RayDataModule` (module), the per-rank loader (loader) and the
actor that deals each pass's batches to the ranks in one fixed order (dealer)."""

from ray_lightning.data.module import RayDataModule

__all__ = ["RayDataModule"]
