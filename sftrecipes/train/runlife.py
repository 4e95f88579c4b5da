"""One rank of a run from start to exit (`RunLife`): its lock, its preemption signals voted across the ranks so that
every rank stops after the same step with a checkpoint (exit 75), its death with the launcher and its heartbeats."""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import sys
import threading

from sftrecipes.core.procs import die_with_parent
from sftrecipes.recipe.evalonly import eval_only
from sftrecipes.recipe.typed import Recipe
from sftrecipes.run.checkpoints import finished_run, forget_finished, is_complete, latest_checkpoint, mark_finished
from sftrecipes.run.heartbeats import HEARTBEATS, Heartbeat, Watch, beat_interval, describe_silent
from sftrecipes.run.lifecycle import LOCK_ENV, PREEMPTED, note_refusal, output_dir, preempted_exit_code, write_preempted
from sftrecipes.run.runlock import Lock, check_lock, read_lock, take_lock

# torch and transformers are imported where they are used: train.py holds the signals first thing and enters RunLife
# (the lock, a finished run's no-op) before torch loads, so a refused run answers at once

log = logging.getLogger("sftrecipes")

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped on a preemption signal after saving a complete checkpoint (exit 75)."""


class AlreadyTrained(Exception):
    """The checkpoint resumed from is at max_steps: only the final save is left to do."""


_PIPE: list[int] = []  # read and write end of the pipe Python's C signal handler writes signal numbers into


def hold_signals() -> None:
    """From now on SIGTERM/SIGUSR1 do not end this process: their numbers queue in a pipe (signal.set_wakeup_fd,
    written by the C handler, so nothing waits for the main thread) until a RunLife thread reads them. train.py calls
    it first thing, so a rank signalled while it starts does not die of SIGTERM's default action nor miss SIGUSR1
    (ignored by torch's agent under `launch`, and inherited so)."""
    if _PIPE:
        return
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    _PIPE[:] = [r, w]
    for s in PREEMPT_SIGNALS:
        signal.signal(s, lambda *_: None)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)


def release_signals() -> None:
    if _PIPE:
        signal.set_wakeup_fd(-1)
        for s in PREEMPT_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        for fd in _PIPE:
            os.close(fd)
        _PIPE.clear()


class SignalVote:
    """The ranks' preemption signals, all-reduced (max) without waiting: start() launches the reduction at one step's
    end, result() at the next step's end returns it. On a GPU the result travels to pinned host memory behind a CUDA
    event, so reading it waits only for that point of the stream, not for the step queued after it; on CPU (gloo)
    it waits for the reduction itself, which every rank started a step earlier."""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._pending = None  # (work, tensor to read, event or None)
        self._host = torch.zeros(1, dtype=torch.int64, pin_memory=True) if self.cuda else None  # read before reused

    def start(self, signum: int) -> None:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([signum], dtype=torch.int64, device=self.device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        if not self.cuda:
            self._pending = (work, flag, None)
            return
        work.wait()  # NCCL: the current stream waits for the reduction; the host does not
        self._host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (None, self._host, event)

    def result(self) -> int:
        """The reduction start() launched last (0 when none); waits for that one only."""
        if self._pending is None:
            return 0
        work, value, event = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        if event is not None:
            event.synchronize()
        return int(value[0])


class RunLife:
    """One process of a run, from start to exit (a context manager around train.py's work).

    On entry: a rank started by a launcher dies with it (die_with_parent); SIGTERM/SIGUSR1 are taken over by a thread
    (signal.set_wakeup_fd: it acts even while the main thread is blocked in C++, e.g. a collective); the main process
    checks the lock (another live run: LockHeld, exit 2), sees whether resume 'auto' finds a finished run (then
    `finished` holds the line to print, and nothing is written), else takes the lock (or finds the one `launch` took
    for it). A preemption signal before training ends the process at once (exit 75; nothing to save), during training
    it stops every rank after the same optimizer step with a checkpoint (callback()), during the final save it is
    noted and the save goes on. Heartbeats run from training's start to exit. On exit: the lock is released.
    """

    def __init__(self, recipe: Recipe):
        self.recipe, self.out = recipe, output_dir(recipe)
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.timeout = recipe.run.heartbeat_timeout
        self.finished: str | None = None
        self.lock: Lock | None = None
        self.owns = False  # the main process, once the output_dir is this run's
        self.phase = "setup"  # setup -> training -> finishing
        self.signal = 0  # the first preemption signal this process received
        self.stopped_by = 0  # the signal every rank agreed to stop on (callback)
        self.step = 0
        self._parent = None
        self._heart: Heartbeat | None = None
        self._watch: Watch | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- entry / exit

    def __enter__(self) -> RunLife:
        if "LOCAL_RANK" in os.environ:  # started by a launcher (torch's agent): end with it, whatever kills it
            self._parent = os.getppid()
            die_with_parent(self._parent)
        hold_signals()
        try:
            if self.rank == 0:
                inherited = os.environ.get(LOCK_ENV)
                check_lock(self.out, self.recipe.run.force_lock, inherited)
            self.finished = finished_run(self.recipe)
            if self.finished:
                log.info("%s", self.finished)
                return self
            if self.rank == 0:
                if not (inherited and (read_lock(self.out) or {}).get("token") == inherited):
                    self.lock = take_lock(self.out, self.recipe.run.force_lock)
                self.owns = True
        except BaseException:
            self._shutdown()
            raise
        self._thread = threading.Thread(target=self._loop, name="sftrecipes-life", daemon=True)
        self._thread.start()  # (a signal received so far waits in the pipe: it is handled now, the lock known)
        return self

    def __exit__(self, *exc) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            if _PIPE:  # wake the watcher from its select (a byte no signal has), or the join waits out a beat interval
                try:
                    os.write(_PIPE[1], b"\0")
                except OSError:
                    pass
            self._thread.join(timeout=10)
        if self._heart is not None:
            try:
                self._heart.beat(self.step, done=True)
            except OSError:
                pass
            self._heart = None
        release_signals()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _exit(self, code: int, last: str | None = None) -> None:
        """End this process now, from the watcher thread: the lock released, the log flushed. `last`: a warning that is
        the process's last line: written while this thread holds every log handler's lock, so that a line the main
        thread logs meanwhile (it runs on until os._exit) waits, and never follows it."""
        if self.lock is not None:
            self.lock.release()
        handlers = logging.getLogger().handlers + log.handlers
        if last is not None:
            record = log.makeRecord(log.name, logging.WARNING, __file__, 0, "%s", (last,), None)
            for h in handlers:
                h.acquire()
            for h in handlers:
                if record.levelno >= h.level and h.filter(record):
                    h.emit(record)
        for h in handlers:
            h.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    # --- the watcher thread: signals, parent, heartbeats

    def _loop(self) -> None:
        r = _PIPE[0]
        while not self._stop.is_set():
            interval = beat_interval(self.timeout) if self._heart else 1.0
            ready, _, _ = select.select([r], [], [], interval)
            if ready:
                try:
                    data = os.read(r, 64)
                except BlockingIOError:
                    data = b""
                for signum in data:
                    if signum in PREEMPT_SIGNALS:
                        self._on_signal(signal.Signals(signum))
            if self._parent is not None and os.getppid() != self._parent:
                log.error("the launcher that started this rank is gone (parent %d); exiting", self._parent)
                self._exit(1)
            if self._heart is not None and not self._stop.is_set():
                try:
                    self._heart.beat(self.step)
                except OSError as e:
                    log.warning("heartbeat: cannot write %s (%s)", self._heart.path, e.strerror)
                stale = self._watch.stale()
                if stale and not self._stop.is_set():
                    for rec in stale:
                        log.error("%s", describe_silent(rec, self.timeout))
                    for rec in stale:  # a frozen rank on this host ends too (SIGKILL reaches a stopped process)
                        if rec["host"] == socket.gethostname():
                            try:
                                os.kill(int(rec["pid"]), signal.SIGKILL)
                            except OSError:
                                pass
                    self._exit(1)

    def _on_signal(self, sig: signal.Signals) -> None:
        if eval_only(self.recipe):  # an evaluation saves nothing to resume from: no preempted.json
            line = (f"evaluation interrupted by {sig.name} before it finished: nothing was written (an evaluation-only "
                    "run saves no checkpoint to resume from); run it again (exit 75)")
            note_refusal(line, "interrupted")  # under launch: it says so and exits 75 (this rank exits 0, as preempted)
            self._exit(preempted_exit_code(), last=line)
        if self.phase == "setup":
            if self.owns:
                last = latest_checkpoint(self.out)
                write_preempted(self.out, int(last.name.rsplit("-", 1)[-1]) if last else 0, sig.name, str(last) if last else None)
            self._exit(preempted_exit_code(), last=f"preemption: {sig.name} before training started: nothing to save; "
                       "exiting (resume_from_checkpoint: auto starts again from the latest complete checkpoint)")
        elif self.phase == "training":
            if not self.signal:
                self.signal = int(sig)
                log.warning("preemption: %s: every rank finishes its current optimizer step, saves a checkpoint, exits",
                            sig.name)
        else:
            log.warning("preemption: %s during the final save: finishing it", sig.name)

    # --- during the run

    def started(self, args) -> None:
        """Once the process group is up: a barrier. Past it every rank knows that the main process holds the lock
        (had it been refused, it would have exited), so nothing is written into another run's folder."""
        if self.world > 1 and args.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def _training_begins(self) -> None:
        """The first write of this run into output_dir that is not a checkpoint, once inputs are checked and everything
        loaded (so bad input still writes nothing): heartbeats begin, and a finished run's marker goes (this run
        changes the folder)."""
        if self.world > 1 and self.timeout > 0 and self._thread is not None and self._heart is None:
            self._heart = Heartbeat(self.out / HEARTBEATS, self.rank)  # (a RunLife not entered has no thread)
            self._watch = Watch(self.out / HEARTBEATS, self.timeout, own_rank=self.rank, world=self.world)
        if self.owns:
            forget_finished(self.out)

    def callback(self):
        """TrainerCallback: at each optimizer step's end the ranks agree (all-reduce of the signal number) whether to
        stop; if so they save checkpoint-<step> (with its marker) and the loop ends. At train begin, a checkpoint
        already at max_steps raises AlreadyTrained (transformers would train one step more).

        With several ranks the all-reduce started at one step's end is read at the next one's (SignalVote): no rank
        waits for it, and on a GPU the host never waits for the device's queue (a read of this step's result would
        sync the stream every step). Every rank reads the same vote at the same step, so they still stop together,
        one step after the signal at most."""
        from transformers import TrainerCallback

        life = self

        class Preemption(TrainerCallback):
            vote = None

            def on_train_begin(self, args, state, control, **kwargs):
                life._training_begins()
                if state.max_steps > 0 and state.global_step >= state.max_steps:
                    life.phase = "finishing"
                    raise AlreadyTrained(state.global_step)
                life.phase = "training"

            def on_step_end(self, args, state, control, **kwargs):
                life.step = state.global_step
                sig = life.signal
                if life.world > 1:
                    if self.vote is None:
                        self.vote = SignalVote(args.device)
                    sig = self.vote.result()  # every rank's signal as of the previous step's end (0 at the first)
                    self.vote.start(life.signal)
                if sig and state.global_step < state.max_steps:
                    life.stopped_by = sig
                    control.should_save = True
                    control.should_training_stop = True

            def on_train_end(self, args, state, control, **kwargs):
                if self.vote is not None:
                    self.vote.result()  # the last step's vote: no collective left in flight
                    self.vote = None
                life.phase = "finishing"

        return Preemption()

    def train(self, trainer, resume: str | None) -> None:
        """trainer.train, resuming; a run whose checkpoint is already at max_steps goes straight to its final save."""
        try:
            trainer.train(resume_from_checkpoint=resume)
        except AlreadyTrained as e:
            log.info("resume: %s is at max_steps (step %s): training is complete; only the final save is left", resume, e)

    def stop_if_preempted(self, trainer) -> None:
        """After a preemption stop: rank 0 records preempted.json (the checkpoint is complete by now), then every
        rank raises Preempted."""
        if not self.stopped_by:
            return
        step = trainer.state.global_step
        ckpt = self.out / f"checkpoint-{step}"
        name = signal.Signals(self.stopped_by).name
        if not is_complete(ckpt):
            raise RuntimeError(f"preemption: {name} at step {step}, but {ckpt} is not complete; the latest complete checkpoint stays")
        if self.owns:
            write_preempted(self.out, step, name, str(ckpt))
        trainer.accelerator.wait_for_everyone()
        raise Preempted(f"preempted by {name} at step {step}: {ckpt} is complete; resume with resume_from_checkpoint: auto")

    def finish(self, step: int) -> None:
        """The run is complete (final save checked, summary written): mark it finished, drop a preemption record."""
        if self.owns:
            (self.out / PREEMPTED).unlink(missing_ok=True)
            mark_finished(self.out, step)
