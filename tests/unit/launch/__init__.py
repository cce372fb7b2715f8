"""The ringsync command (ringsync.launch), in one process: mpirun command building (with a
pretend MPI), signals passed on to a stand-in for mpirun, doctor without the native core;
one test module per module of ringsync.launch.

Tests that start real jobs through the command are in tests/mpi/test_launcher.py;
signals to a running job's launcher in tests/faults/test_launcher_signals.py."""
