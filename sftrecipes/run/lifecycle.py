"""What a run's processes and the launcher that started them tell each other, torch-free: where the run writes
(`output_dir`), the environment `launch` gives its ranks, the preemption record and exit code, the lines ranks leave.

    read_preempted()     <output_dir>/preempted.json, what `launch` reports after a preemption
    note_refusal()       a rank's one line for `launch` (refused, stopped, interrupted); refusals() reads them back

A rank's own life (lock, signals voted across ranks, heartbeats) is train/runlife.py's RunLife. The exit codes of a
run: 0 done, 1 training failed, 2 bad input, 75 preempted (a complete checkpoint was saved; resume with
resume_from_checkpoint: auto) or, for an evaluation-only run (evalonly.py), interrupted (nothing was written: run it
again). See docs/reliability.md for what each piece guarantees and the test that shows it.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

from sftrecipes.core.procs import now_iso
from sftrecipes.recipe.typed import Recipe

LOCK_ENV = "SFTRECIPES_LOCK"  # the token of the lock `launch` took for the ranks it starts
REFUSED_ENV = "SFTRECIPES_REFUSED_DIR"  # set by `launch`: a rank that refuses the recipe (exit 2) leaves its line there
# what a rank's line in that folder says it did (file name prefix): refused the recipe, stopped after training (a
# streamed row it could not parse: streamtrain.DataStopped, exit 2), or interrupted an evaluation-only run (a signal)
NOTE_PREFIX = {"refused": "rank-", "stopped": "stopped-rank-", "interrupted": "interrupted-rank-"}
SUPERVISED_ENV = "SFTRECIPES_SUPERVISED"  # set by `launch` for its ranks: it turns their preemption into exit 75 itself
PREEMPTED = "preempted.json"
EXIT_PREEMPTED = 75


def output_dir(recipe: Recipe) -> Path:
    return Path(recipe.trl.get("output_dir") or "trainer_output")  # transformers' default when unset


def preempted_exit_code() -> int:
    """75, or 0 for a rank `launch` supervises (it reports 75 itself; torch's agent would print a failure for 75)."""
    return 0 if os.environ.get(SUPERVISED_ENV) else EXIT_PREEMPTED


def write_preempted(out: Path, step: int, signame: str, checkpoint: str | None) -> None:
    record = {"step": step, "signal": signame, "checkpoint": checkpoint, "time": now_iso()}
    tmp = out / (PREEMPTED + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(out / PREEMPTED)


def read_preempted(out: Path, since: float | None = None) -> dict | None:
    """<out>/preempted.json, if written at or after `since` (a Unix time; whole seconds)."""
    try:
        record = json.loads((out / PREEMPTED).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not record:
        return None
    if since is not None:
        try:
            if datetime.fromisoformat(record["time"]).timestamp() < int(since):
                return None
        except (KeyError, TypeError, ValueError):
            return None
    return record


def note_refusal(message: str, kind: str = "refused") -> None:
    """A rank refused the recipe (RecipeError, exit 2), stopped after training (kind "stopped": streamtrain.DataStopped,
    exit 2) or interrupted an evaluation (kind "interrupted"): leave its one line in the folder `launch` gave its ranks
    (REFUSED_ENV, outside output_dir: nothing of the run is written), so `launch` ends as they did and says why."""
    folder = os.environ.get(REFUSED_ENV)
    if folder and Path(folder).is_dir():
        (Path(folder) / f"{NOTE_PREFIX[kind]}{os.environ.get('RANK', '0')}").write_text(message)


def refusals(folder: Path, kind: str = "refused") -> list[str]:
    """The lines the ranks left (note_refusal) of one kind, one per rank."""
    return [f.read_text() for f in sorted(folder.glob(f"{NOTE_PREFIX[kind]}*"))]
