#!/usr/bin/env python3
"""A local stand-in for SLURM, to run tools/cluster/train.sbatch on one machine with N "nodes".

Three roles, chosen by the name it is called under (symlinks in a bin folder) or by the first argument:

    fake_srun.py sbatch [--nodes N] [--job-id ID] [--job-name NAME] SCRIPT [ARGS...]
        the allocation: makes a folder with `srun` and `scontrol` links to this file, puts it first
        on PATH, sets the job's variables (SLURM_JOB_ID, SLURM_JOB_NAME, SLURM_NNODES,
        SLURM_JOB_NUM_NODES, SLURM_JOB_NODELIST (a compressed hostlist: 127.0.0.[1-N], all of them
        loopback addresses of this machine), SLURM_SUBMIT_DIR, SLURM_CPUS_ON_NODE,
        SLURM_RESTART_COUNT) and runs SCRIPT with bash, as slurmd runs a batch script.
        SIGUSR1/SIGUSR2/SIGTERM sent to it go to the batch shell only (like `scancel --batch
        --signal=...` or `#SBATCH --signal=B:...`). Exits with the script's status.
    srun [--nodes N] [--ntasks-per-node 1] [--kill-on-bad-exit[=1]] [--label] [...] CMD [ARGS...]
        one job step: starts nodes x tasks-per-node copies of CMD, each with the step's variables
        (SLURM_NODEID, SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NPROCS, SLURM_STEP_ID,
        SLURM_STEP_NUM_NODES, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST, SLURMD_NODENAME,
        SLURM_TASKS_PER_NODE, ...). Like srun it forwards SIGINT/SIGTERM/SIGHUP/SIGUSR1/SIGUSR2/SIGQUIT
        to every task, kills the other tasks when one fails with --kill-on-bad-exit, and exits with
        the highest task exit status (128+N for a task killed by signal N).
    scontrol show hostnames [LIST] | scontrol requeue JOBID
        expands a hostlist like SLURM's, one host a line; records a requeue request (one line
        "requeue JOBID" appended to $FAKE_SLURM_LOG when set) instead of requeueing.

Unknown srun/sbatch flags are errors, so the batch script and this stand-in cannot drift apart
silently. Only the standard library: it runs where the package's environment runs.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

KILL_WAIT_S = 30  # slurm.conf's KillWait default: SIGTERM, then SIGKILL this much later
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's hostlist syntax: comma-separated items, each with any number of [a-b,c] groups;
    numbers keep the zero padding of the range's start ("node[08-10]" -> node08, node09, node10)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    items.append(hostlist[start:])
    hosts: list[str] = []
    for item in filter(None, (s.strip() for s in items)):
        match = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, rest = match.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            values = [lo] if not hi else [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
            for value in values:
                hosts.extend(prefix + value + tail for tail in expand_hostlist(rest) or [""])
    return hosts


def _scontrol(argv: list[str]) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `scontrol show hostnames | head -n 1` ends quietly
    if argv[:2] == ["show", "hostnames"]:
        hostlist = argv[2] if len(argv) > 2 else os.environ.get("SLURM_JOB_NODELIST", "")
        print("\n".join(expand_hostlist(hostlist)))
        return 0
    if argv[:1] == ["requeue"] and len(argv) == 2:
        print(f"fake scontrol: requeue of job {argv[1]} requested (not requeued: this is a stand-in)")
        if os.environ.get("FAKE_SLURM_LOG"):
            with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
                log.write(f"requeue {argv[1]}\n")
        return 0
    print(f"fake scontrol: unsupported: {' '.join(argv)}", file=sys.stderr)
    return 2


def _options(argv: list[str], spec: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Leading `--flag value`, `--flag=value`, `-f value` options named in `spec` (name -> kind:
    'value' or 'flag'); everything from the first non-option on is the command."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        name, eq, value = argv[i].partition("=")
        if name not in spec:
            raise SystemExit(f"fake srun/sbatch: unsupported option {argv[i]!r} (supported: {', '.join(spec)})")
        key = spec[name].split(":")[1]
        if spec[name].startswith("flag"):
            opts[key] = value if eq else "1"
        elif eq:
            opts[key] = value
        else:
            i += 1
            opts[key] = argv[i]
        i += 1
    return opts, argv[i:]


def _kill_all(procs, sig) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass


def _srun(argv: list[str]) -> int:
    opts, cmd = _options(argv, {
        "-N": "value:nodes", "--nodes": "value:nodes", "--ntasks-per-node": "value:per_node",
        "-K": "flag:kill", "--kill-on-bad-exit": "flag:kill", "-l": "flag:label", "--label": "flag:label",
        "--cpus-per-task": "value:cpus", "-c": "value:cpus", "--export": "value:export"})
    if not cmd:
        raise SystemExit("fake srun: no command")
    if opts.get("export", "ALL") != "ALL":
        raise SystemExit("fake srun: only --export=ALL is supported")
    hosts = expand_hostlist(os.environ.get("SLURM_JOB_NODELIST", "localhost"))
    nodes = int(opts.get("nodes", os.environ.get("SLURM_NNODES", len(hosts))))
    per_node = int(opts.get("per_node", 1))
    if nodes > len(hosts):
        raise SystemExit(f"fake srun: {nodes} nodes asked, the allocation has {len(hosts)}")
    ntasks = nodes * per_node
    step_id = int(os.environ.get("FAKE_SRUN_STEP", "0"))
    base = dict(os.environ, SLURM_STEP_ID=str(step_id), SLURM_STEPID=str(step_id),
                SLURM_NTASKS=str(ntasks), SLURM_NPROCS=str(ntasks), SLURM_STEP_NUM_TASKS=str(ntasks),
                SLURM_STEP_NUM_NODES=str(nodes), SLURM_STEP_NODELIST=",".join(hosts[:nodes]),
                SLURM_TASKS_PER_NODE=f"{per_node}(x{nodes})", SLURM_STEP_TASKS_PER_NODE=f"{per_node}(x{nodes})",
                SLURM_LOCAL_NODES=str(nodes), FAKE_SRUN_STEP=str(step_id + 1))
    if "cpus" in opts:
        base["SLURM_CPUS_PER_TASK"] = opts["cpus"]
    procs = []
    for node in range(nodes):
        for local in range(per_node):
            env = dict(base, SLURM_NODEID=str(node), SLURM_PROCID=str(node * per_node + local),
                       SLURM_LOCALID=str(local), SLURMD_NODENAME=hosts[node], SLURM_TOPOLOGY_ADDR=hosts[node])
            # each task in its own process group, so a signal reaches the task's children too
            # (torchrun forwards by itself; a plain shell would not)
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True,
                                          stdout=subprocess.PIPE if "label" in opts else None,
                                          stderr=subprocess.STDOUT if "label" in opts else None))
    if "label" in opts:
        def pump(rank, stream):
            for line in iter(stream.readline, b""):
                sys.stdout.buffer.write(f"{rank}: ".encode() + line)
                sys.stdout.buffer.flush()
        pumps = [threading.Thread(target=pump, args=(r, p.stdout), daemon=True) for r, p in enumerate(procs)]
        for t in pumps:
            t.start()

    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: _kill_all(procs, signum))
    kill_on_bad_exit = opts.get("kill", "0") not in ("0", "")
    killed_at = None
    while [p.poll() for p in procs].count(None):
        if kill_on_bad_exit and killed_at is None and any(p.returncode not in (None, 0) for p in procs):
            bad = next(r for r, p in enumerate(procs) if p.returncode not in (None, 0))
            print(f"fake srun: task {bad} exited with {procs[bad].returncode}: terminating the other tasks "
                  "(--kill-on-bad-exit)", file=sys.stderr, flush=True)
            _kill_all(procs, signal.SIGTERM)
            killed_at = time.monotonic()
        if killed_at is not None and time.monotonic() - killed_at > KILL_WAIT_S:
            _kill_all(procs, signal.SIGKILL)  # what slurmd does after KillWait
        time.sleep(0.1)
    if "label" in opts:
        for t in pumps:
            t.join(timeout=5)
    codes = [p.returncode if p.returncode >= 0 else 128 - p.returncode for p in procs]
    return max(codes)


def _sbatch(argv: list[str]) -> int:
    opts, cmd = _options(argv, {"-N": "value:nodes", "--nodes": "value:nodes", "--job-id": "value:job_id",
                                "--job-name": "value:name", "-J": "value:name"})
    if not cmd:
        raise SystemExit("fake sbatch: no script")
    nodes = int(opts.get("nodes", 2))
    script = Path(cmd[0])
    with tempfile.TemporaryDirectory(prefix="fake-slurm-") as tmp:
        bindir = Path(tmp) / "bin"
        bindir.mkdir()
        for name in ("srun", "scontrol"):
            (bindir / name).symlink_to(Path(__file__).resolve())
        job_id = opts.get("job_id", str(os.getpid()))
        env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
                   SLURM_JOB_ID=job_id, SLURM_JOBID=job_id,
                   SLURM_JOB_NAME=opts.get("name", script.name), SLURM_NNODES=str(nodes),
                   SLURM_JOB_NUM_NODES=str(nodes), SLURM_JOB_NODELIST=f"127.0.0.[1-{nodes}]",
                   SLURM_NODELIST=f"127.0.0.[1-{nodes}]", SLURM_SUBMIT_DIR=os.getcwd(),
                   SLURM_CPUS_ON_NODE=str(max(1, (os.cpu_count() or 1) // nodes)),
                   SLURM_RESTART_COUNT=os.environ.get("SLURM_RESTART_COUNT", "0"),
                   SLURMD_NODENAME="127.0.0.1", SLURM_NODEID="0", SLURM_PROCID="0", SLURM_LOCALID="0")
        env.pop("FAKE_SRUN_STEP", None)
        batch = subprocess.Popen(["bash", str(script), *cmd[1:]], env=env)
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: batch.poll() is None and batch.send_signal(signum))
        while True:
            try:
                code = batch.wait()
                break
            except InterruptedError:  # pragma: no cover (Python retries wait itself)
                continue
    return code if code >= 0 else 128 - code


def main(argv: list[str]) -> int:
    role = Path(argv[0]).name
    args = argv[1:]
    if role not in ("srun", "scontrol", "sbatch"):
        if not args or args[0] not in ("srun", "scontrol", "sbatch"):
            print(__doc__, file=sys.stderr)
            return 2
        role, args = args[0], args[1:]
    return {"srun": _srun, "scontrol": _scontrol, "sbatch": _sbatch}[role](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
