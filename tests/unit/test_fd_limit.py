"""Open-file limits: init() raises a low soft RLIMIT_NOFILE towards the hard limit (every
rank keeps a socket to every peer), warns once when even the hard limit is too low, and a
ring that runs out of descriptors while connecting fails naming the limit. Each case runs
in a subprocess: limits are per process."""
import os
import subprocess
import sys
import textwrap

import pytest

resource = pytest.importorskip("resource")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(code, timeout=120):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _limits():
    return resource.getrlimit(resource.RLIMIT_NOFILE)


@pytest.mark.skipif(_limits()[1] != resource.RLIM_INFINITY and _limits()[1] < 3000,
                    reason="needs a hard limit of at least 3000 open files")
def test_a_low_soft_limit_is_raised_for_a_large_job():
    done = run("""
        import resource
        from ringsync import bootstrap
        NOFILE = resource.RLIMIT_NOFILE
        resource.setrlimit(NOFILE, (256, resource.getrlimit(NOFILE)[1]))
        assert bootstrap.raise_fd_limit(2000, 0) is None
        soft, hard = resource.getrlimit(NOFILE)
        assert soft >= bootstrap.fds_needed(2000) >= 2000 + bootstrap.FD_MARGIN, soft
        assert soft == hard or hard == resource.RLIM_INFINITY, (soft, hard)
        # enough already: nothing changes
        resource.setrlimit(NOFILE, (2500, hard))
        assert bootstrap.raise_fd_limit(8, 0) is None
        assert resource.getrlimit(NOFILE)[0] == 2500
        print("ok")
    """)
    assert done.stdout.strip() == "ok" and done.stderr == "", done.stderr


def test_a_hard_limit_too_low_is_raised_to_and_said_once():
    done = run("""
        import resource
        from ringsync import bootstrap
        NOFILE = resource.RLIMIT_NOFILE
        resource.setrlimit(NOFILE, (100, 300))
        first = bootstrap.raise_fd_limit(1000, 3)
        assert resource.getrlimit(NOFILE) == (300, 300), resource.getrlimit(NOFILE)
        assert "rank 4:" in bootstrap.raise_fd_limit(1000, 4)  # said, not printed, again
        print(first)
    """)
    warning = done.stdout.strip()
    for fragment in ("rank 3: a job of 1000 ranks needs about", "RLIMIT_NOFILE allows 300",
                     "(hard limit 300)", "ulimit -Hn"):
        assert fragment in warning, warning
    assert done.stderr.count("ringsync:") == 1 and warning in done.stderr, done.stderr


def test_running_out_of_descriptors_while_connecting_names_the_limit():
    """16 thread-ranks in one process need 16 listening sockets and two ends of each
    connection to the 5 partners every rank connects to at setup (ring neighbours,
    recursive-doubling partners): a hard limit of 60 cannot hold them: init() fails on a
    rank with the limit and the count in words."""
    done = run("""
        import resource, sys
        sys.path.insert(0, ".")
        from tests.thread_ranks import run_ranks
        resource.setrlimit(resource.RLIMIT_NOFILE, (60, 60))
        outcomes = run_ranks(lambda comm: None, 16, timeout=60,
                             env={"RINGSYNC_TRANSPORT": "tcp",
                                  "RINGSYNC_START_TIMEOUT_SECONDS": "3"})
        print("\\n=====\\n".join(o.error or "" for o in outcomes))
    """)
    assert "out of file descriptors. In a job of 16 ranks each keeps a socket to each peer " \
        "it exchanges with (up to 15)" in done.stdout, done.stdout[-3000:]
    assert "RLIMIT_NOFILE soft limit 60, hard limit 60" in done.stdout, done.stdout[-3000:]
    assert done.stderr.count("needs about") == 1, done.stderr  # the warning, once
