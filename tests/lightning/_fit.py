"""A tiny Lightning fit, run as a script by the tests: ``python -m tests.lightning._fit DIR OUT [options]``.

Every rank writes ``OUT-rank<R>.json``: the weights after the restore (``restored``, with the
IO's load source) or after ``--record-at`` steps, and at the end of the fit. ``--kill-at K``:
every rank SIGKILLs itself as step K+1 begins (step K's checkpoint saved and returned), as a
node's crash would.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from flashckpt.lightning import FlashCheckpointIO


class Tiny(L.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def training_step(self, batch, _idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def weights(module: torch.nn.Module) -> list[float]:
    return [float(v) for p in module.parameters() for v in p.detach().flatten()]


class Probe(L.Callback):
    """Records weights (and the load source) and kills the rank where asked."""

    def __init__(self, io: FlashCheckpointIO | None, out: str, kill_at: int | None, record_at: int | None) -> None:
        self.io, self.out, self.kill_at, self.record_at = io, out, kill_at, record_at
        self.report: dict = {}

    def _write(self, trainer) -> None:
        with open(f"{self.out}-rank{trainer.global_rank}.json", "w") as f:
            json.dump(self.report, f)

    def on_train_start(self, trainer, module) -> None:
        last = None if self.io is None else self.io.checkpointer.last_load
        self.report["start_step"] = trainer.global_step
        self.report["restored"] = weights(module)
        self.report["source"] = None if last is None else last.source
        self._write(trainer)

    def on_train_batch_start(self, trainer, module, batch, idx) -> None:
        if trainer.global_step == self.record_at:
            self.report["recorded"] = weights(module)
            self._write(trainer)
        if trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, trainer, module) -> None:
        self.report["final"] = weights(module)
        self.report["end_step"] = trainer.global_step
        self._write(trainer)


def trainer_for(directory: str, out: str, *, devices: int = 1, steps: int = 6, every: int = 2,
                kill_at: int | None = None, record_at: int | None = None, batch: int = 2,
                flash: bool = True) -> tuple[L.Trainer, DataLoader]:
    """The Trainer and data of one fit (``flash=False``: the stock checkpoint IO)."""
    L.seed_everything(0, verbose=False)
    x = torch.randn(8, 4)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch)
    io = FlashCheckpointIO(directory) if flash else None
    callbacks = [ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=every),
                 Probe(io, out, kill_at, record_at)] + ([io] if flash else [])
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    return trainer, data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("out")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--record-at", type=int)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    trainer, data = trainer_for(args.dir, args.out, devices=args.devices, steps=args.steps, every=args.every,
                                kill_at=args.kill_at, record_at=args.record_at)
    trainer.fit(Tiny(), data, ckpt_path="last" if args.resume else None)


if __name__ == "__main__":
    main()
