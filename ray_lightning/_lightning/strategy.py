"""Lightning's private strategy attributes and hooks, behind public names of our own.

:class:`LightningStrategyHooks` goes into every ray_lightning strategy's bases, before Lightning's
own strategy class. It overrides the private hooks Lightning's strategies are meant to override
(``_configure_launcher``, DDP's ``_get_process_group_backend``) and the ``accelerator`` property
(stored by Lightning in ``_accelerator``), forwarding each to a public method the strategy
defines, and gives read access to the private attributes Lightning keeps (DDP's ``_timeout`` and
``_process_group_backend``, ``_lightning_optimizers``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from typing_extensions import override


class LightningStrategyHooks:
    """Mixed into a Lightning ``Strategy`` subclass; see the module docstring."""

    # -- what the strategy provides ------------------------------------------------------------------

    def make_launcher(self) -> Any:
        """The launcher Lightning calls ``launch`` on."""
        raise NotImplementedError

    def choose_accelerator(self, accelerator: Any) -> Any:
        """What to keep when Lightning assigns ``accelerator`` (chosen from the driver's hardware)."""
        return accelerator

    def worker_process_group_backend(self) -> str:
        """The torch.distributed backend this worker's process group uses."""
        raise NotImplementedError

    # -- Lightning's private hooks --------------------------------------------------------------------

    @property
    @override
    def accelerator(self) -> Any:
        return self._accelerator

    @accelerator.setter
    @override
    def accelerator(self, accelerator: Any) -> None:
        self._accelerator = None if accelerator is None else self.choose_accelerator(accelerator)

    @override
    def _configure_launcher(self) -> None:
        self._launcher = self.make_launcher()

    @override
    def _get_process_group_backend(self) -> str:
        return self.worker_process_group_backend()

    # -- Lightning's private attributes ---------------------------------------------------------------

    def forget_accelerator(self) -> None:
        """Drop the accelerator Lightning assigned (a strategy reused for another Trainer)."""
        self._accelerator = None

    @property
    def ddp_timeout(self) -> timedelta | None:
        """``DDPStrategy(timeout=...)``; None for strategies without one."""
        return getattr(self, "_timeout", None)

    @property
    def requested_process_group_backend(self) -> str | None:
        """``DDPStrategy(process_group_backend=...)`` as the user gave it (None: choose)."""
        return getattr(self, "_process_group_backend", None)

    def use_process_group_backend(self, backend: str) -> None:
        """Record the backend chosen for this worker where DDP's ``process_group_backend`` reads it."""
        self._process_group_backend = backend

    @property
    def lightning_optimizers(self) -> list[Any]:
        """Lightning's ``LightningOptimizer`` wrappers of ``self.optimizers``."""
        return self._lightning_optimizers
