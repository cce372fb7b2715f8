"""scale_cost.py --processes --launcher ringsync: the ranks started by `ringsync run
--launcher ssh` through the namespace hosts' launch agent, with no MPI in the job.

Why: under mpirun, 256 ranks on 32 namespace hosts did not get through MPI_Init in 19
minutes (every rank in `from mpi4py import MPI`, the 2 cores busy); ringsync needs no
MPI to start. Without MPI there is no barrier before init, so setup's wall time includes
waiting for the last rank to start; its CPU time is the rank's own work either way.

Each rank runs `python -m benchmarks.scale_launched OUTDIR ITERATIONS`.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import scale_cost  # noqa: E402


def run_job(n, hosts, args):
    """One `ringsync run` job of n ranks on hosts: (records, job GiB, seconds), or None
    after printing the job's output when a rank left no record."""
    timeout = args.timeout or 120 + 4 * n
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGSYNC_TRANSPORT=args.transport,
               RINGSYNC_TIMEOUT_SECONDS=str(timeout // 2),
               RINGSYNC_START_TIMEOUT_SECONDS=str(timeout // 2), PYTHONPATH=ROOT)
    slots = scale_cost.slots_per_host(n, len(hosts.names))
    outdir = tempfile.mkdtemp(prefix="ringsync-scale-")
    command = [sys.executable, "-m", "ringsync.launch.cli", "run", "--launcher", "ssh",
               "--ssh-agent", hosts.agent, "--store-address", hosts.head_address,
               "-H", hosts.hosts_arg(slots), "-np", str(n),
               sys.executable, "-m", "benchmarks.scale_launched", outdir, str(args.iterations)]
    try:
        t0 = time.monotonic()
        with scale_cost.MemoryWatch() as watch:
            job = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
            try:
                output, _ = job.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, 9)
                output = job.communicate()[0] + f"\n(killed after {timeout} s)"
        seconds = time.monotonic() - t0
        records = [json.loads(open(os.path.join(outdir, name)).read())
                   for name in sorted(os.listdir(outdir))]
        if len(records) < n or job.returncode != 0:
            print(output[-20000:], file=sys.stderr, flush=True)
            return None
        return records, watch.used_gib, seconds
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


def main():
    outdir, iterations = sys.argv[1], int(sys.argv[2])
    record = scale_cost.measure_rank(iterations, lambda: None)
    scale_cost.rs.barrier()  # (every rank measured before any leaves)
    scale_cost.write_record(outdir, record)
    scale_cost.rs.shutdown()


if __name__ == "__main__":
    main()
