#!/usr/bin/env python3
"""A training-like program that follows suanli's checkpoint contract (docs/checkpoints.md).

It steps a counter, sleeps --step-s per step, and checkpoints every --checkpoint-every steps
and when it receives the checkpoint signal (SIGUSR1 by default: a flag, checked at the end of
the current step). A checkpoint is `ckpt-<step>/state.json` (plus --bytes of padding) under
$SUANLI_CHECKPOINT_DIR, committed by writing `suanli-checkpoint.json` atomically (temp file,
then rename). It resumes from $SUANLI_RESTORE_FROM, exits 0 after --steps steps and 143 on
SIGTERM. An elastic job's replica (docs/job-spec.md, "Elastic jobs") starts with its world
size in $SUANLI_WORLD_SIZE and watches $SUANLI_WORLD_FILE each step: a new membership
generation is journalled as a "world" event (a real trainer would re-form its process group
there, from its last checkpoint). Each event is one JSON line appended to $TRAINER_JOURNAL
(when set): {"job", "attempt", "alloc", "step", "t", "event":
"start"|"restore"|"step"|"checkpoint"|"world"|"exit"}; "start" and "world" carry
"world_size" (and "world" the "generation").
Python 3 standard library only.
"""

import argparse
import json
import os
import signal
import sys
import time

MANIFEST = "suanli-checkpoint.json"
KEEP = 2  # committed checkpoints kept in the directory (older ones are deleted)


class Trainer:
    def __init__(self, args):
        self.args = args
        self.ckpt_dir = os.environ.get("SUANLI_CHECKPOINT_DIR", "")
        self.journal_path = os.environ.get("TRAINER_JOURNAL", "")
        self.ident = {
            "job": os.environ.get("SUANLI_JOB_ID", ""),
            "attempt": os.environ.get("SUANLI_ATTEMPT", ""),
            "alloc": os.environ.get("SUANLI_ALLOC_ID", ""),
        }
        self.step = 0
        self.world_file = os.environ.get("SUANLI_WORLD_FILE", "")
        self.world_size = int(os.environ.get("SUANLI_WORLD_SIZE", "1") or "1")
        self.world_gen = None
        self.want_checkpoint = False
        self.want_stop = False
        self.committed = []

    def journal(self, event, **extra):
        if not self.journal_path:
            return
        line = dict(self.ident, step=self.step, t=time.time(), event=event, **extra)
        # One write of one line with O_APPEND: lines of concurrent writers never interleave.
        fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(line, sort_keys=True) + "\n").encode())
        finally:
            os.close(fd)

    def restore(self):
        path = os.environ.get("SUANLI_RESTORE_FROM", "")
        if not path:
            return
        state_file = os.path.join(path, "state.json") if os.path.isdir(path) else path
        with open(state_file) as f:
            state = json.load(f)
        self.step = int(state["step"])
        self.journal("restore", restore_step=os.environ.get("SUANLI_RESTORE_STEP", ""))

    def checkpoint(self):
        if not self.ckpt_dir:
            return
        name = "ckpt-%d" % self.step
        target = os.path.join(self.ckpt_dir, name)
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, "state.json"), "w") as f:
            json.dump({"step": self.step, "job": self.ident["job"]}, f)
        if self.args.bytes > 0:
            with open(os.path.join(target, "padding.bin"), "wb") as f:
                left = self.args.bytes
                chunk = b"\0" * min(left, 1 << 20)
                while left > 0:
                    n = min(left, len(chunk))
                    f.write(chunk[:n])
                    left -= n
        total = 0
        for root, _dirs, files in os.walk(target):
            for fn in files:
                total += os.path.getsize(os.path.join(root, fn))
        manifest = {
            "step": self.step,
            "wall_time": int(time.time()),
            "path": name,
            "bytes": total,
            "hardware_bound": self.args.hardware_bound,
        }
        tmp = os.path.join(self.ckpt_dir, ".%s.tmp" % MANIFEST)
        with open(tmp, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(self.ckpt_dir, MANIFEST))
        self.journal("checkpoint")
        # Keep the last few; the agent may still be uploading the previous one.
        self.committed.append(target)
        while len(self.committed) > KEEP:
            old = self.committed.pop(0)
            for root, dirs, files in os.walk(old, topdown=False):
                for fn in files:
                    os.unlink(os.path.join(root, fn))
                for d in dirs:
                    os.rmdir(os.path.join(root, d))
            os.rmdir(old)

    def watch_world(self):
        """Reads $SUANLI_WORLD_FILE; journals a membership generation not seen before."""
        if not self.world_file:
            return
        try:
            with open(self.world_file) as f:
                w = json.load(f)
        except (OSError, ValueError):
            return  # between the agent's write and rename, or not there: next step
        gen = int(w.get("generation", 0))
        if self.world_gen is None:
            self.world_gen = gen
        if gen != self.world_gen:
            self.world_gen = gen
            self.world_size = int(w.get("world_size", self.world_size))
            self.journal("world", world_size=self.world_size, generation=gen)

    def run(self):
        self.restore()
        self.journal("start", world_size=self.world_size)
        self.watch_world()
        while self.step < self.args.steps:
            time.sleep(self.args.step_s)
            self.watch_world()
            if self.want_stop and not self.want_checkpoint:
                self.journal("exit", code=143)
                return 143
            self.step += 1
            self.journal("step")
            every = self.args.checkpoint_every
            if self.want_checkpoint or (every > 0 and self.step % every == 0):
                self.want_checkpoint = False
                self.checkpoint()
            if self.want_stop:
                self.journal("exit", code=143)
                return 143
        self.journal("exit", code=0)
        return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="steps to run, then exit 0")
    p.add_argument("--step-s", type=float, default=0.1, help="seconds per step")
    p.add_argument("--checkpoint-every", type=int, default=10, help="checkpoint every K steps (0: only on the signal)")
    p.add_argument("--hardware-bound", action="store_true", help="mark checkpoints hardware-bound")
    p.add_argument("--bytes", type=int, default=0, help="padding bytes per checkpoint")
    p.add_argument(
        "--signal",
        default=os.environ.get("SUANLI_CHECKPOINT_SIGNAL", "SIGUSR1"),
        help="the checkpoint signal (default: $SUANLI_CHECKPOINT_SIGNAL, else SIGUSR1)",
    )
    args = p.parse_args()
    t = Trainer(args)

    def on_checkpoint(_sig, _frame):
        t.want_checkpoint = True

    def on_term(_sig, _frame):
        t.want_stop = True
        if sig == signal.SIGTERM:
            # SIGTERM is the checkpoint signal: checkpoint at the end of this step, then exit.
            t.want_checkpoint = True

    sig = getattr(signal, args.signal, None)
    if sig is None:
        print("trainer: unknown --signal %r" % args.signal, file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, on_term)
    if sig != signal.SIGTERM:
        signal.signal(sig, on_checkpoint)
    return t.run()


if __name__ == "__main__":
    sys.exit(main())
