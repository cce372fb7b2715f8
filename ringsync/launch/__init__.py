"""The ``ringsync`` command (``ringsync run``, ``ringsync doctor``), split as horovodrun's
launcher is:

cli.py          argument parsing (the option table), ``run`` and ``main``: the entry point
direct.py       ``--launcher local|ssh``: ranks started without MPI, meeting at our store
mpirun.py       finding MPI and building the mpirun command line
hosts.py        hosts and slots: -H lists, hostfiles, this host's cores
process.py      mpirun as the launcher's child: its death signal, signals passed on,
                per-rank output files, the job's exit status from the ranks' records
config_file.py  horovodrun's YAML ``--config-file``
doctor.py       the settings report and ``ringsync doctor``

Each module imports only those below it in this order: cli, direct, doctor,
config_file, mpirun, hosts, process (none imports cli). Importing any of them starts no MPI.
"""
