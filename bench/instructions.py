"""CPU instructions per block of the in-process ingestion stages, counted by valgrind's callgrind
(issue 13). Prints figures; asserts nothing.

    .venv/bin/python bench/instructions.py [--workloads salted,chat] [--frames 200] [--json F]

Why instructions: on this shared 2-core machine a 5-repetition median of CPU time still moves by
20% between runs (bench/README.md), as much as a round of hot-path work gains; the number of
instructions the CPU executes for the same frames does not move (hash seeds and the tracker's
index multiplier are fixed in the counted process). It is not time (a cache miss costs more than
an add), so `peers.py` stays the figure that counts; this one says whether a change made the work
smaller.

What runs: the frames of `peers_workloads.py` (salted single-block chains, 50 per frame, 20,000
live; the chat workload's salted frames), pickled once; then, per stage, a child process under
`valgrind --tool=callgrind` loads them, applies the warm-up frames through the whole pipeline,
and runs `--frames` timed frames through the stages up to that one. A child with no timed frame
is the base; (stage - base) / timed blocks is the figure. Stages, each including the ones before:
`msgpack.unpackb` (the floor, alone), `decode_zmq_payload`, `Tracker.apply` (with the salt
verifier the daemon uses), `EventLog.record`, `encode_record_list` (one SSE consumer's bytes).
Not counted: the daemon's asyncio loop, ZMQ receive and socket writes (about a tenth of its
CPU in a py-spy profile, 2026-12-02).

Time: about 25 s per child under valgrind, 6 children per workload (about 3 minutes for
salted, a little more for chat). Needs `valgrind` on PATH (the Debian package); exits 2 without.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quiet import quiet_libraries

STAGES = ("msgpack.unpackb", "decode_zmq_payload", "+ Tracker.apply", "+ EventLog.record",
          "+ encode_record_list")
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def build(workloads: list[str], path: Path) -> dict[str, int]:
    """Pickle (warm-up frames, timed frames) per workload into `path`; returns blocks per frame."""
    from peers_workloads import chat_streams, salted_chains  # noqa: PLC0415

    from kv_listener.resolver.template import DEMO_TOKENIZER_DIR, load_tokenizer  # noqa: PLC0415

    out: dict[str, Any] = {}
    per_frame: dict[str, int] = {}
    for name in workloads:
        if name == "salted":
            stream = salted_chains(20000, 60000, 50)
        else:
            stream, _ = chat_streams(load_tokenizer(DEMO_TOKENIZER_DIR), pool_blocks=20000,
                                     timed=60000)
        out[name] = (stream.warmup.frames, stream.timed.frames,
                     stream.timed.blocks / len(stream.timed.frames))
        per_frame[name] = out[name][2]
    with path.open("wb") as f:
        pickle.dump(out, f)
    return per_frame


def child(data: Path, workload: str, stage: int, frames: int) -> None:
    """The counted process: warm up, then `frames` timed frames through stages 0..`stage`."""
    import msgpack  # noqa: PLC0415
    from peers_workloads import BACKEND, MODEL, SECRET  # noqa: PLC0415

    from kv_listener.core.decode import decode_zmq_payload  # noqa: PLC0415
    from kv_listener.core.eventlog import EventLog  # noqa: PLC0415
    from kv_listener.core.limits import Limits  # noqa: PLC0415
    from kv_listener.core.model import Engine  # noqa: PLC0415
    from kv_listener.core.salt import SaltVerifier  # noqa: PLC0415
    from kv_listener.core.sse import encode_record_list  # noqa: PLC0415
    from kv_listener.core.tracker import Tracker  # noqa: PLC0415

    random.seed(0)  # the tracker's index multiplier: the same probe sequences in every child
    with data.open("rb") as f:
        warmup, timed, _ = pickle.load(f)[workload]  # our own file, just written
    tracker = Tracker(engine=Engine.VLLM, model=MODEL, limits=Limits(),
                      salt_verifier=SaltVerifier(SECRET, BACKEND))
    log = EventLog(BACKEND, "bench", 100000, 0.0)
    for frame in warmup:
        log.record(tracker.apply(decode_zmq_payload(Engine.VLLM, frame).batch), 1.0)
    if stage == 0:
        for frame in timed[:frames]:
            msgpack.unpackb(frame)
        return
    for frame in timed[:frames]:
        batch = decode_zmq_payload(Engine.VLLM, frame).batch
        if stage >= 2:
            transitions = tracker.apply(batch)
            if stage >= 3:
                records = log.record(transitions, 1000.125)
                if stage >= 4:
                    encode_record_list(records)


def count(data: Path, workload: str, stage: int, frames: int) -> int:
    """Instructions of one child process, start to exit."""
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
           sys.executable, __file__, "--child", str(data), workload, str(stage), str(frames)]
    env = dict(os.environ, PYTHONHASHSEED="0")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    m = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or m is None:
        sys.exit(f"callgrind run failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return int(m.group(1))


def main() -> None:
    quiet_libraries()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="salted,chat", help="salted and/or chat")
    ap.add_argument("--frames", type=int, default=200, help="timed frames counted per stage")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        data, workload, stage, frames = args.child
        child(Path(data), workload, int(stage), int(frames))
        return
    if shutil.which("valgrind") is None:
        print("valgrind is not on PATH (Debian: apt-get install valgrind)", file=sys.stderr)
        sys.exit(2)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(workloads) - {"salted", "chat"}
    if unknown:
        sys.exit(f"unknown workloads: {sorted(unknown)}")
    figures: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="kv-instr-") as tmp:
        data = Path(tmp) / "frames.pickle"
        per_frame = build(workloads, data)
        for name in workloads:
            blocks = args.frames * per_frame[name]
            print(f"\n== {name}: {args.frames} timed frames, {blocks:,.0f} stored blocks, "
                  "instructions per stored block (callgrind) ==")
            base = count(data, name, 0, 0)
            cumulative = [(count(data, name, s, args.frames) - base) / blocks
                          for s in range(len(STAGES))]
            floor = cumulative[0]
            figures[name] = dict(zip(STAGES, cumulative, strict=True))
            previous = 0.0
            for stage, value in zip(STAGES, cumulative, strict=True):
                own = value - previous if stage.startswith("+") else value
                print(f"  {stage:<24}{value:>12,.0f} total{own:>12,.0f} own"
                      f"{floor / value:>8.2f}x msgpack.unpackb")
                if stage != STAGES[0]:
                    previous = value
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
