"""After ``fit``, the one-process habits: ``trainer.save_checkpoint`` writes what a one-process fit would, by the
fit's workers while they wait (``keep_workers_alive_s``), and is refused naming why once they are gone."""

from __future__ import annotations

import os

import pytest
import pytorch_lightning as pl
import torch

from ray_lightning import RayFSDPStrategy, RayStrategy, release_idle_workers
from ray_lightning.namespaces import GLOO_SHARDING_TORCH, version_tuple
from tests.models import BoringModel

pytestmark = pytest.mark.usefixtures("ray_local")


class MomentumModel(BoringModel):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}


def _trainer(strategy, epochs: int, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )


def test_save_checkpoint_after_fit_is_written_by_the_workers_and_resumes_exactly(tmp_path):
    pl.seed_everything(0)
    model = MomentumModel()
    trainer = _trainer(RayStrategy(num_workers=2), epochs=2)
    trainer.fit(model)
    final = tmp_path / "final.ckpt"
    trainer.save_checkpoint(final)  # what Lightning's tutorials end with

    saved = torch.load(final, weights_only=False)
    assert saved["epoch"] == trainer.current_epoch == 2 and saved["global_step"] == trainer.global_step
    (optimizer,) = saved["optimizer_states"]
    assert all("momentum_buffer" in state for state in optimizer["state"].values()), "the optimizer's own state"
    assert saved["lr_schedulers"][0]["last_epoch"] == 2
    # The trained weights: the ones that came home into the driver's module.
    torch.testing.assert_close(saved["state_dict"]["layer.weight"], model.layer.weight)

    # The optimizers' and schedulers' settings read what they read after a one-process fit of the same module.
    alone = _trainer("auto", epochs=2, accelerator="cpu", devices=1)
    alone.fit(MomentumModel())
    for ours, theirs in zip(trainer.optimizers, alone.optimizers):
        assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in theirs.param_groups] == [0.05 * 0.25]
        assert ours.param_groups[0]["momentum"] == 0.9
    ((config, reference),) = zip(trainer.lr_scheduler_configs, alone.lr_scheduler_configs)
    assert (config.interval, config.frequency) == (reference.interval, reference.frequency)
    assert config.scheduler.last_epoch == reference.scheduler.last_epoch == 2
    assert config.scheduler.get_last_lr() == reference.scheduler.get_last_lr()
    assert config.scheduler.optimizer is trainer.optimizers[0]
    with pytest.raises(RuntimeError, match="stepped in the Ray workers"):
        trainer.optimizers[0].step()

    # It resumes where the fit ended: one more epoch, not three.
    resumed = _trainer(RayStrategy(num_workers=2), epochs=3)
    resumed.fit(MomentumModel(), ckpt_path=final)
    assert resumed.global_step == trainer.global_step * 3 // 2

    # Once the workers are gone, the driver cannot write it: refused, saying why.
    release_idle_workers()
    with pytest.raises(RuntimeError, match="which are gone .*keep_workers_alive_s"):
        trainer.save_checkpoint(tmp_path / "late.ckpt")
    assert not os.path.exists(tmp_path / "late.ckpt")


@pytest.mark.skipif(
    version_tuple(torch.__version__) < GLOO_SHARDING_TORCH, reason="FSDP2 on CPUs (gloo) needs a newer torch"
)
def test_a_sharded_fit_saves_its_shards_after_fit(tmp_path):
    trainer = _trainer(RayFSDPStrategy(num_workers=2, state_dict_type="sharded"), epochs=1)
    trainer.fit(BoringModel())
    folder = tmp_path / "final.ckpt"
    trainer.save_checkpoint(folder)
    assert sorted(f for f in os.listdir(folder) if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert torch.load(folder / "meta.pt", weights_only=False)["global_step"] == trainer.global_step
