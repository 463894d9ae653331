"""``FlashCheckpointCallback``: flash checkpoints for the Hugging Face ``Trainer``.

How it takes over saving
    transformers 5.x decides to save inside ``Trainer._maybe_log_save_evaluate``, after
    the step's logging, evaluation and best-metric bookkeeping, and then calls
    ``Trainer._save_checkpoint(model, trial)`` followed by ``on_save``. Setting
    ``control.should_save = False`` in ``on_step_end`` would skip the save, but a
    snapshot taken there comes too early: ``trainer_state.json`` would lack the step's
    log entry, the best metric of its evaluation, and the FLOs the save folds in. So the
    callback replaces ``_save_checkpoint`` on the one Trainer instance it is given to (found
    once, at ``on_init_end``), keeping the stock save point and the ``on_save`` event.
    The replacement does the stock bookkeeping (``store_flos``, the best checkpoint,
    stateful callbacks) and then copies model, optimizer, scheduler, scaler, RNG and
    trainer state into shared memory: the only stall. The node's saver process
    persists the step and the exporter (:mod:`flashckpt.hf._export`) writes the stock
    ``checkpoint-<N>`` folder and rotates old ones, all in the background. Steps between
    saves (``memory_every``) are snapshots the callback asks for by setting
    ``control.should_save`` in ``on_step_end``; they stay in memory only.

How resuming prefers memory
    At ``on_init_end`` (the Trainer's constructor, on every rank) the callback agrees on
    the newest step in memory or committed and, when no folder is as new, writes that
    step's ``checkpoint-<N>`` folder, which ``resume_from_checkpoint`` then reads: see
    :mod:`flashckpt.hf._resume`.

Where its own files live, and what a run leaves
    While ``train()`` runs, ``<output_dir>/.flashckpt`` holds the step being written in
    flashckpt's own format (the exporter reads it to write the folder; one more copy of
    the state on disk) and the files that do not change during ``train()``. It sits in
    ``output_dir`` on purpose: every rank's saver writes its shard there, so it must be a
    directory all nodes share whenever the folders are, and the folders are renamed into
    place from the same file system. It is scratch, not a checkpoint: the folders are the
    checkpoints. So it is removed once nothing needs it: at a clean end of ``train()``
    (after every folder is written and memory-only snapshots are dropped), after
    ``train()`` raised (once the newest step in memory is written out as its folder and
    the memory freed), and at construction, after a crashed run's memory was written out.
    ``output_dir`` then holds exactly what the stock Trainer leaves. It stays only where
    a crash (or a failed write after an error) left memory that a later construction
    still has to write out, which needs its files.

    When ``train()`` raises, the callback (which wraps ``train`` on the Trainer it was
    given to) persists the newest step in memory if it is not on storage yet, waits for
    every folder asked for, and frees the shared memory before the exception goes on, so
    nothing writes into ``output_dir`` after ``train()`` has raised. If that fails, the
    memory is kept for the next Trainer built on ``output_dir`` (which writes it out) and
    the failure is logged; the original exception is raised either way.

    ``resume_from_checkpoint=True`` keeps its stock meaning (a ``ValueError`` when
    ``output_dir`` holds no ``checkpoint-<N>``); :func:`last_checkpoint` gives the newest
    folder or None, so one script both starts fresh and resumes::

        trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))

Costs and limits
    Under the Trainer's DeepSpeed integration the DeepSpeed engine's own
    ``save_checkpoint`` runs into flashckpt's DeepSpeed checkpoint engine, and the folder
    gets DeepSpeed's tag and ``latest`` as the stock save writes them (see
    :mod:`flashckpt.hf._deepspeed`). FSDP, XLA, SageMaker MP, ``push_to_hub`` and
    hyper-parameter search trials keep the stock save, with a warning; so do PEFT
    adapters and quantized models. Only process 0 writes the model files
    (``save_on_each_node`` is not honoured; multi-node runs need a shared file system).

Trainer internals it relies on, and why no public hook does
    ``Trainer._save_checkpoint`` (replaced on the instance: no callback event sits at the
    stock save point, see above); ``Trainer.train`` wrapped on the instance (no callback
    event reports an exception out of training); the calling frames, to find the Trainer (callback
    events are not given it); ``model._keys_to_ignore_on_save``,
    ``remove_tied_weights_from_state_dict`` and ``revert_weight_conversion`` (the steps
    ``save_pretrained`` applies, so ``model.safetensors`` is byte-equal without calling
    it in the training loop); under DeepSpeed, ``engine.checkpoint_engine`` (DeepSpeed
    has no registry) and ``_zero3_consolidated_16bit_state_dict`` (what accelerate
    calls). Everything else is public: ``store_flos``, ``callback_handler``,
    ``accelerator``, ``model_wrapped``, ``is_deepspeed_enabled``, ``hp_search_backend``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import sys
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import SaveStrategy

from .._options import Options, resolve_options
from .._errors import CheckpointError
from ..storage._files import write_atomic
from ..torch import Checkpointer
from . import _deepspeed, _export
from ._capture import capture_main_state, capture_rank_state, peft_or_quantized, write_static_files
from ._failure import TrainerCapture
from ._resume import PARAMS_FILE, recover

__all__ = ["FlashCheckpointCallback"]

log = logging.getLogger("flashckpt.hf")

STATE_DIR = ".flashckpt"
"""Under ``output_dir``: the engine's committed steps (the newest only) and static files."""
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_FOLDER_COUNTS = ("persist_every", "keep_last")
"""Options the callback takes as its own arguments: they count steps and folders here."""


def _check_positive(name: str, value: int | None, minimum: int) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
        raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}")


def _engine_options(options: Options | None, shorthands: dict[str, Any]) -> Options:
    """The options of the callback's engine: ``options`` with the keyword shorthands over it,
    keeping the newest step only (the ``checkpoint-<N>`` folders are the checkpoints)."""
    defaults = Options()
    counted = [name for name in _FOLDER_COUNTS
               if isinstance(options, Options) and getattr(options, name) != getattr(defaults, name)]
    if counted:
        raise ValueError(f"FlashCheckpointCallback({counted[0]}=...) is the callback's own argument (it counts "
                         f"steps and checkpoint-N folders); an Options' {', '.join(counted)} does not apply here")
    return dataclasses.replace(resolve_options(options, **shorthands), keep_last=1)


def _check_local(output_dir: str) -> None:
    """The Trainer writes and reads its ``checkpoint-<N>`` folders with local file calls."""
    if _URL_RE.match(output_dir):
        raise CheckpointError(f"FlashCheckpointCallback: output_dir {output_dir!r} is a URL, but the Trainer writes "
                              "and reads its checkpoint-N folders on a file system; give a local or mounted path "
                              "(flashckpt's own checkpointers take object-store URLs)")


def _check_writable(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".flashckpt-probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.unlink(probe)
    except OSError as exc:
        raise CheckpointError(f"FlashCheckpointCallback: output_dir {path!r} is not writable ({exc}); "
                              "Trainer checkpoints could not be written there") from exc


class FlashCheckpointCallback(TrainerCallback):
    """Trainer checkpoints that cost the training loop one memory copy.

    Pass it to the Trainer's constructor, on every rank::

        trainer = Trainer(..., callbacks=[FlashCheckpointCallback()])
        trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))  # None: start fresh

    At every step the Trainer would save (``save_strategy`` / ``save_steps``), the state
    is copied into shared memory and the stock ``checkpoint-<N>`` folder is written in
    the background; ``train()`` returns once every folder is on storage, leaving
    ``output_dir`` as the stock Trainer would. If ``train()`` raises, the newest step in
    memory is written out and the memory freed before the exception leaves it.

    Args:
        memory_every: also snapshot into memory every this many steps (not persisted;
            written out only when needed to resume after a crash). None: save steps only.
        persist_every: write a ``checkpoint-<N>`` folder every this many steps (the
            Trainer's save steps are then memory snapshots). None: at the Trainer's save steps.
        keep_last: folders to keep. None: ``save_total_limit``.
        options: a :class:`flashckpt.Options` for the engine underneath (``job_id``,
            ``allow_pickle``, ``memory_slots``, ``replicas``); each of its fields may also be
            given as a keyword, laid over ``options`` (another keyword is a TypeError).
            ``persist_every`` and ``keep_last`` are the callback's own, above.
        memory_slots: shared-memory copies per rank: 2, or 1 for half the memory (a
            save then waits while the previous folder is read from it).
        replicas: peer-memory replicas: 1 has each node's saver copy the node's newest
            snapshot into the next node's memory, so that a node lost whole resumes from a
            survivor's memory; 0 turns them off. None: 1 when the job spans two or more nodes.
        job_id: names the job's shared memory (default: a hash of ``<output_dir>/.flashckpt``);
            a restarted job resumes from memory only under the same ``job_id``.
        save_on_failure: on SIGTERM/SIGINT or an exception out of ``train()``, every rank not
            inside an optimizer update saves the last finished step, written out as its
            ``checkpoint-<N>``, where the restart resumes (see :mod:`flashckpt.hf._failure`).

    Attributes:
        resumed_from: after construction, ``{"step": N, "source": "memory"}`` when shared
            memory (this node's, or a peer node's replica) held a step at least as new as
            the newest folder (so a ``resume_from_checkpoint=True`` resumes from it),
            ``{"step": N, "source": "storage"}`` when a committed step's missing folder
            was written, else None.
    """

    def __init__(self, *, memory_every: int | None = None, persist_every: int | None = None,
                 keep_last: int | None = None, save_on_failure: bool = False, options: Options | None = None,
                 **shorthands: Any) -> None:
        if not isinstance(save_on_failure, bool):
            raise TypeError(f"save_on_failure must be a bool, got {save_on_failure!r}")
        _check_positive("memory_every", memory_every, 1)
        _check_positive("persist_every", persist_every, 1)
        _check_positive("keep_last", keep_last, 0)
        self._options = _engine_options(options, shorthands)
        self.memory_every = memory_every
        self.persist_every = persist_every
        self.keep_last = keep_last
        self.save_on_failure = save_on_failure
        self._capture: TrainerCapture | None = None
        self.resumed_from: dict[str, Any] | None = None
        self._trainer: Any = None
        self._stock_save: Any = None
        self._ckpt: Checkpointer | None = None
        self._static: str | None = None
        self._export: dict[str, Any] | None = None
        self._persist_at: dict[int, bool] = {}
        self._persisted: set[int] = set()

    # -- events -------------------------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs):
        """Attach to the Trainer being constructed; write a newer in-memory step out as a folder."""
        trainer = self._find_trainer()
        if trainer is None:
            raise CheckpointError("FlashCheckpointCallback must be passed to a transformers Trainer "
                                  "(Trainer(..., callbacks=[FlashCheckpointCallback()]))")
        if self._attach(trainer):
            self._open()
            try:
                self.resumed_from = recover(self._ckpt.engine, trainer.args.output_dir)
            except BaseException:
                self._abandon()  # keep the memory: it may be the only copy of the newest step
                raise
            self._close()  # memory is now on storage or stale; train() opens a fresh engine
            self._remove_state_dir()  # what a crashed run left there is in the folders now

    def on_train_begin(self, args, state, control, **kwargs):
        if self._trainer is None:  # added with trainer.add_callback() after construction
            trainer = self._find_trainer()
            if trainer is None or not self._attach(trainer):
                return
            log.warning("FlashCheckpointCallback was added after the Trainer was built: it saves, but a "
                        "resume cannot prefer memory (pass it to the Trainer's constructor for that)")
        if self._stock_save is None:
            return
        if self._ckpt is None:
            self._open()
        # the Trainer has loaded its checkpoint by now: this run's saves descend from that step
        # (-1: from nothing), so older steps of an abandoned line never outrank them
        self._ckpt.engine.start_line(state.global_step if state.global_step > 0 else -1)
        trainer = self._trainer

        def write_run_files() -> str | None:
            if not trainer.args.should_save:
                return None
            static = write_static_files(trainer, self._state_dir())
            write_atomic(os.path.join(self._state_dir(), PARAMS_FILE), json.dumps(self._params(static)).encode())
            return static

        everyone = self._ckpt.engine.on_all_ranks(write_run_files, "writing training_args.bin and the tokenizer files")
        self._static = everyone[0]
        self._export = {"name": "hf", "params": self._params(self._static)}
        if self.save_on_failure:
            self._capture = TrainerCapture(trainer, self._ckpt, self._export, self._deepspeed_dir)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._capture is not None:
            self._capture.update_begins()

    def on_step_end(self, args, state, control, **kwargs):
        """Decide whether this step is snapshotted and whether it is persisted."""
        if self._stock_save is None:
            return
        step = state.global_step
        if self._capture is not None:
            self._capture.step_end(step)
        stock = control.should_save
        if self.persist_every is None:
            persist = stock
        else:
            persist = step % self.persist_every == 0 or (stock and control.should_training_stop)
        memory = self.memory_every is not None and step % self.memory_every == 0
        if stock or memory or persist:
            control.should_save = True  # the Trainer calls _save_checkpoint after logging and evaluating
            self._persist_at[step] = persist

    def on_epoch_end(self, args, state, control, **kwargs):
        """At the end of training, wait for every folder: the Trainer loads the best one (and
        rotates them) before ``on_train_end``, also when it stopped at a step that saved none."""
        if self._ckpt is not None and (control.should_training_stop or state.global_step >= state.max_steps):
            self._wait_for_folders()

    def _wait_for_folders(self) -> None:
        """Until every folder asked for is written: a folder is exported by the saver that
        commits its step last, maybe on another node, so every rank waits for its own and
        then for the others."""
        self._ckpt.engine.on_all_ranks(self._ckpt.wait, "waiting for the checkpoint folders")

    def on_train_end(self, args, state, control, **kwargs):
        """Wait until every folder is on storage, free the shared memory, remove the scratch."""
        self._close()
        self._remove_state_dir()

    # -- attaching ----------------------------------------------------------------

    def _find_trainer(self) -> Any:
        """The Trainer whose callbacks include this one, from the calling frames (the
        callback API passes no Trainer, but saving needs its bookkeeping)."""
        frame = sys._getframe(1)
        while frame is not None:
            candidate = frame.f_locals.get("self")
            handler = getattr(candidate, "callback_handler", None)
            if handler is not None and any(cb is self for cb in getattr(handler, "callbacks", ())):
                return candidate
            frame = frame.f_back
        return None

    def _attach(self, trainer: Any) -> bool:
        """Check the setup and take over the Trainer's save; False keeps the stock save."""
        self._trainer = trainer
        args = trainer.args
        unsupported = [name for name, on in (
            ("FSDP", getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False)),
            ("push_to_hub", args.push_to_hub),
        ) if on]
        from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available
        if is_torch_xla_available():
            unsupported.append("XLA")
        if is_sagemaker_mp_enabled():
            unsupported.append("SageMaker model parallel")
        if peft_or_quantized(trainer.model):
            unsupported.append("PEFT adapters or quantized models")
        if unsupported:
            log.warning("FlashCheckpointCallback does not support %s yet: the Trainer keeps its own save",
                        ", ".join(unsupported))
            return False
        if args.save_strategy == SaveStrategy.NO and self.memory_every is None:
            log.warning("FlashCheckpointCallback: save_strategy='no' and no memory_every, so there is nothing "
                        "to checkpoint; the callback stays idle")
            return False
        if args.save_strategy == SaveStrategy.NO:
            log.info("FlashCheckpointCallback: save_strategy='no': snapshots every %d steps stay in memory; "
                     "a folder is written only to resume after a crash", self.memory_every)
        if args.save_only_model:
            log.info("FlashCheckpointCallback: save_only_model=True: checkpoints (memory and folders) hold the "
                     "model and trainer state only, as the Trainer's own; a resume starts a fresh optimizer")
        _check_local(args.output_dir)
        _check_writable(args.output_dir)
        self._stock_save = trainer._save_checkpoint
        trainer._save_checkpoint = self._save_checkpoint
        stock_best = trainer._determine_best_metric

        def determine_best_metric(*args: Any, **kwargs: Any) -> bool:
            # with save_strategy="best" the Trainer saves a step only when this says True,
            # which would drop the memory snapshot planned for the step; the best metric
            # is recorded all the same, and _snapshot persists only a new best
            new_best = stock_best(*args, **kwargs)
            return new_best or (trainer.args.save_strategy == SaveStrategy.BEST
                                and trainer.state.global_step in self._persist_at)

        trainer._determine_best_metric = determine_best_metric
        stock_train = trainer.train

        def train(*args: Any, **kwargs: Any) -> Any:
            try:
                return stock_train(*args, **kwargs)
            except BaseException:
                self._stop_after_error()
                raise

        train.__doc__ = stock_train.__doc__
        trainer.train = train
        return True

    def _params(self, static: str | None) -> dict[str, Any]:
        """The exporter's parameters for this ``train()`` (see :mod:`flashckpt.hf._export`)."""
        args = self._trainer.args
        return {"run_dir": args.output_dir, "static": static,
                "limit": self.keep_last if self.keep_last is not None else args.save_total_limit}

    def _state_dir(self) -> str:
        return os.path.join(self._trainer.args.output_dir, STATE_DIR)

    def _deepspeed_dir(self) -> str:
        """Where the DeepSpeed engine is told to save (it only copies its scripts there)."""
        return os.path.join(self._state_dir(), "deepspeed")

    def _open(self) -> None:
        # only the newest step is kept here: the checkpoint-N folders are the checkpoints
        self._ckpt = Checkpointer(self._state_dir(), options=self._options)
        self._ckpt.engine.expect_export("hf")

    def _disarm(self) -> None:
        capture, self._capture = self._capture, None
        if capture is not None:
            capture.disarm()

    def _close(self) -> None:
        """All ranks: wait for every folder asked for, drop the memory, disconnect."""
        self._disarm()
        if self._ckpt is None:
            return
        ckpt, self._ckpt = self._ckpt, None
        try:
            # every rank waits, so that no saver still writes when the scratch goes
            ckpt.engine.on_all_ranks(ckpt.wait, "writing the checkpoint folders")
        finally:
            # snapshots between saves exist to survive a crash; a clean end leaves the
            # folders the Trainer itself would have left, so close() has nothing to flush
            ckpt.engine.discard_newer_than(-1)
            ckpt.close()

    def _remove_state_dir(self) -> None:
        """Process 0, after :meth:`_close` on every rank: remove ``<output_dir>/.flashckpt``,
        which nothing needs once the folders are written and the memory freed (the next
        engine is built only after a collective, so no rank is still using it)."""
        trainer = self._trainer
        if trainer is None or trainer.args.process_index != 0:
            return
        path = self._state_dir()
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            log.warning("FlashCheckpointCallback: could not remove %s (flashckpt's scratch; safe to delete)", path)

    def _stop_after_error(self) -> None:
        """``train()`` raised: write the newest step in memory out if it is not on storage,
        wait for every folder, free the memory; so that nothing writes into ``output_dir``
        once the exception has left ``train()``. This rank only (another rank may be
        stuck in a collective)."""
        if self._ckpt is None:  # raised before on_train_begin, or after on_train_end
            return
        ckpt, self._ckpt = self._ckpt, None
        self._persist_at.clear()
        try:
            ckpt.close()  # captures (save_on_failure), flushes, waits (bounded), frees the memory
        except Exception as exc:  # the training error goes on; this one is logged
            log.error("FlashCheckpointCallback: after train() raised, writing the newest step out failed (%s); "
                      "its memory copy is kept: building a Trainer with this callback on %s writes it out",
                      exc, self._trainer.args.output_dir)
            return
        finally:
            self._disarm()
        if ckpt.engine.collective.world_size == 1:  # other ranks may still be writing there
            self._remove_state_dir()

    def _abandon(self) -> None:
        """Disconnect, leaving shared memory in place for a later attempt."""
        ckpt, self._ckpt = self._ckpt, None
        try:
            ckpt.engine.close(unlink=False)
        except Exception as exc:  # the error being raised already says what went wrong
            log.debug("closing after a failed recovery: %s", exc)

    # -- saving -------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Replaces ``Trainer._save_checkpoint``: the stock bookkeeping, then one copy into memory."""
        trainer = self._trainer
        if trial is not None or trainer.hp_search_backend is not None or self._ckpt is None:
            return self._stock_save(model, trial)
        self._snapshot(trainer)

    def _snapshot(self, trainer: Any) -> None:
        args, state = trainer.args, trainer.state
        step = state.global_step
        persist = self._persist_at.pop(step, True)  # a save we did not plan (best metric, epoch end)
        if args.save_strategy == SaveStrategy.BEST and state.best_global_step == step:
            # the Trainer decided this save after evaluating, later than on_step_end's plan
            persist = (self.persist_every is None or step % self.persist_every == 0
                       or trainer.control.should_training_stop)
        trainer.store_flos()
        run_dir = args.output_dir  # what Trainer._get_output_dir gives outside hyper-parameter search
        best_step = state.best_global_step
        if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and best_step:
            best = os.path.join(run_dir, _export.folder_name(best_step))
            if os.path.exists(best) or best_step in self._persisted or (best_step == step and persist):
                state.best_model_checkpoint = best
        if args.should_save:  # as the stock save: record the stateful callbacks' state
            for cb in [cb for cb in trainer.callback_handler.callbacks + [trainer.control]
                       if isinstance(cb, ExportableState)]:
                name = cb.__class__.__name__
                if isinstance(state.stateful_callbacks[name], list):
                    state.stateful_callbacks[name].append(cb.state())
                else:
                    state.stateful_callbacks[name] = cb.state()
        tree = capture_rank_state(trainer)
        model_state, keep_tied = None, False
        if getattr(trainer, "is_deepspeed_enabled", False):
            if _deepspeed.saves_tag(trainer):
                tree["deepspeed"] = _deepspeed.capture_files(trainer, self._deepspeed_dir())
            model_state, keep_tied = _deepspeed.model_state_dict(trainer)
        if args.process_index == 0:
            tree["hf"] = capture_main_state(trainer, model_state, keep_tied)
        self._ckpt.engine.save(step, tree, persist=persist, export=self._export)
        if persist:
            self._persisted.add(step)
        if step >= state.max_steps or trainer.control.should_training_stop:
            # before on_train_end the Trainer loads the best folder and, with save_total_limit=1,
            # deletes every other folder: the folders must all be there by then
            self._wait_for_folders()
