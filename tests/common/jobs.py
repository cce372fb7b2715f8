"""A job started from a test (torchrun, ringsync run, ...) with a deadline."""
import os
import shlex
import signal
import subprocess


def run_to_deadline(command, env, deadline_s: float, cwd=None):
    """(exit status, output) of `command`, stdout and stderr together; the job is started
    in a session of its own, which is killed at the deadline (its launcher and every rank
    with it), and the test then fails with everything the job printed."""
    job = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = job.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        raise AssertionError(f"{shlex.join(command)} passed the {deadline_s} s deadline:\n"
                             f"{output}")
    return job.returncode, output
