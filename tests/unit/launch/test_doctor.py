"""ringsync.launch.doctor: `ringsync doctor` without the native core."""

import os
import subprocess
import sys

from ringsync.launch import doctor

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(doctor.__file__))))  # ringsync/launch/doctor.py: three levels down


def test_doctor_works_without_the_native_core():
    # sys.modules[name] = None makes any import of ringsync._native fail, as if unbuilt.
    code = ("import sys; sys.modules['ringsync._native'] = None; "
            "from ringsync.launch.cli import main; sys.exit(main(['doctor']))")
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT)
    finished = subprocess.run([sys.executable, "-c", code],
                              capture_output=True, text=True, env=env, timeout=120)
    assert finished.returncode == 0, finished.stderr
    native_line = [l for l in finished.stdout.splitlines() if l.startswith("native core:")]
    assert "not built" in native_line[0]
    assert "mpi4py" in finished.stdout
